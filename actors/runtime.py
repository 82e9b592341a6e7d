"""Starting or joining Ray for a job.

Local runs use `ray.init(address="local")`, which starts a private cluster on free ports
(never Redis's 6379); a cluster is joined through `RAY_ADDRESS` (or an explicit address).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import ray


def init_ray(address: str | None = None, *, logical_cpus: float = 0) -> None:
    """Join `address`/`RAY_ADDRESS` if given, else start a local cluster.

    `logical_cpus` lets a laptop declare more logical CPUs than cores, so fractional actor
    requests (engine replicas, workers, trainer) all fit; Ray does not pin them to cores.
    """
    if ray.is_initialized():
        return
    target = address or os.environ.get("RAY_ADDRESS")
    with _callers_sigterm_handler():
        if joins_cluster(address):
            ray.init(address=target, log_to_driver=False)
            return
        ray.init(
            address="local",
            num_cpus=max(os.cpu_count() or 1, int(logical_cpus + 0.999)),
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )


def joins_cluster(address: str | None = None) -> bool:
    """Whether `init_ray(address)` joins an existing cluster (which may grow: an autoscaler)
    rather than start a local one."""
    target = address or os.environ.get("RAY_ADDRESS")
    return bool(target) and target != "local"


@contextmanager
def _callers_sigterm_handler() -> Iterator[None]:
    # ray.init makes SIGTERM `sys.exit`, which would end a job as failed; `rlsys run` turns
    # SIGTERM (what `ray job stop` sends) into a graceful stop, so its handler is put back.
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, handler)


def shutdown_ray() -> None:
    if ray.is_initialized():
        ray.shutdown()
