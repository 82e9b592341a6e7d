"""Run one child process with a wall timeout and capped capture of stdout and stderr.

Shared by the `process` and `bwrap` backends (bwrap is just a different argv and uid).

Invariants:
- Memory use is bounded by the caps: each stream keeps at most `max_output_bytes`; anything
  past the cap is read and dropped (or the command is killed, per `on_output_overflow`), so
  100 MB of output never sits in the host's memory.
- The child leads a new session and process group; when the leader exits, times out or
  floods, the whole group gets SIGKILL before `run_captured` returns.
- The leader is reaped with wait4, so CPU time and max RSS cover every descendant it reaped.
"""

from __future__ import annotations

import json
import os
import resource
import select
import selectors
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

from rlsys.sandboxes.base import KillReason
from rlsys.sandboxes.capped import CappedStream
from rlsys.sandboxes.config import SandboxLimits

CHUNK = 1 << 16
# After a kill, how long to wait for the pipes to close (a process that escaped the group,
# possible only without isolation, could hold them open forever).
DRAIN_GRACE_S = 1.0


@dataclass(frozen=True)
class Captured:
    exit_code: int
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    wall_s: float
    cpu_s: float | None
    max_rss_bytes: int | None
    killed_reason: KillReason | None


def run_captured(
    build_argv: Callable[[int, int], Sequence[str]],
    *,
    limits: SandboxLimits,
    timeout_s: float,
    cwd: str,
    env: Mapping[str, str],
    stdin: bytes | None,
    track: Callable[[int], AbstractContextManager[None]],
    user: int | None = None,
    leader_usage_counts: bool = True,
) -> Captured:
    """Run `build_argv(usage_fd, info_fd)`; `track(pgid)` is entered while it runs.

    `info_fd` is an inherited pipe on which bwrap (`--info-fd`) writes `{"child-pid": N}`,
    the host pid of its pid namespace's init. That process exits only after every process
    in the namespace is gone, so waiting for it is what makes "nothing outlives `run`" true
    (bwrap itself may exit while the namespace is still being torn down).

    `usage_fd` is an inherited pipe on which a wrapper inside a sandbox may write
    "CPU_SECONDS MAX_RSS_KIB" for the tree it waited for; when nothing is written, the
    leader's own wait4 figures are used if `leader_usage_counts` (right for a direct child,
    not for bwrap, which does not wait for its pid-namespace init), else they are unknown.
    """
    usage_r, usage_w = os.pipe()
    info_r, info_w = os.pipe()
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            list(build_argv(usage_w, info_w)),
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=dict(env),
            start_new_session=True,
            pass_fds=(usage_w, info_w),
            user=user,
            group=user,
            extra_groups=[] if user is not None else None,
        )
    finally:
        os.close(usage_w)
        os.close(info_w)
    try:
        with track(proc.pid):
            status, rusage, reason, (out, err), ns_pidfd = _supervise(
                proc, limits, timeout_s, stdin, start, info_r
            )
            if ns_pidfd is not None:
                _kill_and_wait(ns_pidfd)
        reported = _read_usage(usage_r)
    finally:
        os.close(usage_r)
        os.close(info_r)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4, tell Popen
    code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
    if reported is None and leader_usage_counts:
        reported = (rusage.ru_utime + rusage.ru_stime, rusage.ru_maxrss)
    cpu_s, rss_kib = reported if reported is not None else (None, None)
    return Captured(
        exit_code=code,
        stdout=bytes(out.data),
        stderr=bytes(err.data),
        stdout_truncated=out.truncated,
        stderr_truncated=err.truncated,
        wall_s=time.monotonic() - start,
        cpu_s=cpu_s,
        max_rss_bytes=rss_kib * 1024 if rss_kib is not None else None,
        killed_reason=reason or infer_limit_reason(code, bytes(err.data), cpu_s, limits),
    )


def _read_usage(fd: int) -> tuple[float, int] | None:
    os.set_blocking(fd, False)
    try:
        fields = os.read(fd, 256).split()
    except BlockingIOError:
        return None
    if len(fields) != 2:
        return None
    return float(fields[0]), int(fields[1])


def _supervise(
    proc: subprocess.Popen[bytes],
    limits: SandboxLimits,
    timeout_s: float,
    stdin: bytes | None,
    start: float,
    info_r: int,
) -> tuple[
    int, resource.struct_rusage, KillReason | None, tuple[CappedStream, CappedStream], int | None
]:
    """Pump stdin/stdout/stderr until the leader has exited and the pipes are drained."""
    assert proc.stdout is not None and proc.stderr is not None
    out, err = CappedStream(limits.max_output_bytes), CappedStream(limits.max_output_bytes)
    streams = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    sel = selectors.DefaultSelector()
    for fd in streams:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ, "out")
    pidfd = os.pidfd_open(proc.pid)
    sel.register(pidfd, selectors.EVENT_READ, "exit")
    sel.register(info_r, selectors.EVENT_READ, "info")
    info = bytearray()
    ns_pidfd: int | None = None
    pending = memoryview(stdin or b"")
    if proc.stdin is not None:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE, "in")

    deadline = start + timeout_s
    reason: KillReason | None = None
    exited = False
    drain_until: float | None = None  # set once the leader is gone
    open_fds = set(streams)
    try:
        while not exited or open_fds:
            now = time.monotonic()
            if reason is None and not exited and now >= deadline:
                reason = "timeout"
                _stop(proc.pid, pidfd, ns_pidfd)
            if drain_until is not None and now >= drain_until:
                break
            until = drain_until if drain_until is not None else deadline
            for key, _ in sel.select(timeout=max(until - now, 0.0) if reason is None else 0.1):
                if key.data == "exit":
                    sel.unregister(pidfd)
                    exited = True
                    # The leader is a zombie until wait4, so its pgid cannot be reused yet.
                    _kill_group(proc.pid)
                    drain_until = time.monotonic() + DRAIN_GRACE_S
                elif key.data == "in":
                    pending = _feed_stdin(proc, sel, pending)
                elif key.data == "info":
                    chunk = os.read(info_r, 4096)
                    info += chunk
                    if not chunk or chunk.rstrip().endswith(b"}"):
                        sel.unregister(info_r)
                        ns_pidfd = _open_namespace_init(bytes(info))
                else:
                    chunk = os.read(key.fd, CHUNK)
                    if not chunk:
                        sel.unregister(key.fd)
                        open_fds.discard(key.fd)
                    elif streams[key.fd].feed(chunk) and limits.on_output_overflow == "kill":
                        if reason is None:
                            reason = "output_cap"
                            _stop(proc.pid, pidfd, ns_pidfd)
    finally:
        sel.close()
        os.close(pidfd)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    _, status, rusage = os.wait4(proc.pid, 0)
    return status, rusage, reason, (out, err), ns_pidfd


def _open_namespace_init(info: bytes) -> int | None:
    """A pidfd for the sandbox's pid-1 from bwrap's --info-fd JSON (None if already gone)."""
    try:
        child_pid = int(json.loads(info)["child-pid"])
        return os.pidfd_open(child_pid)
    except (ValueError, KeyError, ProcessLookupError):
        return None


def _kill_and_wait(pidfd: int, timeout_s: float = 10.0) -> None:
    """SIGKILL a pid-namespace init and wait until it (and so its namespace) has exited."""
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        select.select([pidfd], [], [], timeout_s)
    except ProcessLookupError:
        pass
    finally:
        os.close(pidfd)


def _feed_stdin(
    proc: subprocess.Popen[bytes], sel: selectors.BaseSelector, pending: memoryview
) -> memoryview:
    assert proc.stdin is not None
    try:
        pending = pending[os.write(proc.stdin.fileno(), pending[:CHUNK]) :]
    except BlockingIOError:
        return pending
    except BrokenPipeError:
        pending = pending[:0]  # the command stopped reading; that is its business
    if not pending:
        sel.unregister(proc.stdin.fileno())
        proc.stdin.close()
    return pending


def _stop(pgid: int, leader_pidfd: int, ns_pidfd: int | None) -> None:
    """Kill a running command. With a sandbox pid 1 known, kill that and give bwrap (its
    parent) a moment to reap it and exit: killing bwrap first would hand the dying pid 1
    to the host's init as a zombie. Then SIGKILL the group, whatever is left of it."""
    if ns_pidfd is not None:
        try:
            signal.pidfd_send_signal(ns_pidfd, signal.SIGKILL)
            select.select([leader_pidfd], [], [], 5.0)
        except ProcessLookupError:
            pass
    _kill_group(pgid)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# Heuristics for limits the kernel enforces without telling the parent which one fired:
# RLIMIT_AS surfaces as an allocation failure, RLIMIT_NPROC as EAGAIN from fork.
_MEMORY_MARKERS = (b"MemoryError", b"Cannot allocate memory", b"std::bad_alloc", b"out of memory")
_PROCESS_MARKERS = (b"fork: retry", b"Resource temporarily unavailable", b"can't fork")
_FILE_SIZE_MARKERS = (b"File too large",)


def infer_limit_reason(
    exit_code: int, stderr: bytes, cpu_s: float | None, limits: SandboxLimits
) -> KillReason | None:
    """Name the rlimit that most likely ended a command that was not killed from outside."""
    if exit_code == 0:
        return None
    if exit_code == 128 + signal.SIGXCPU or (
        exit_code == 128 + signal.SIGKILL and cpu_s is not None and cpu_s >= limits.cpu_seconds
    ):
        return "cpu"  # the soft limit's SIGXCPU, or the hard limit's SIGKILL one second later
    if exit_code == 128 + signal.SIGXFSZ:
        return "file_size"
    tail = stderr[-4096:]
    for markers, reason in (
        (_MEMORY_MARKERS, "memory"),
        (_PROCESS_MARKERS, "processes"),
        (_FILE_SIZE_MARKERS, "file_size"),
    ):
        if any(m in tail for m in markers):
            return reason  # type: ignore[return-value]
    return None
