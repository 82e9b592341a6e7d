"""Shared fixtures: real databases (SQLite file, PostgreSQL) and service discovery.

A PostgreSQL/Redis test skips when the server does not answer, unless
RLSYS_REQUIRE_SERVICES=1 (set by .ci/run), where it fails instead: CI must never pass by
skipping the real thing.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

# One intra-op thread for the tests and every process they start (rlsys run, Ray drivers;
# Ray's own workers get one already). The box has 2 cores and the suite keeps both busy
# (Ray actors, the learning run): an OpenMP team of 2 then waits at every op's barrier for
# a thread the scheduler has parked, and small-op code slows down 5-20x (the align test:
# 0.9 s alone, 17 s beside one busy process, 3.3 s there on one thread). Results do not
# depend on it: the model's reductions are fixed-order. An explicit OMP_NUM_THREADS wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# tiny Hugging Face model fixtures (vLLM backend); per-test CPU (RLSYS_TEST_CPU_LOG)
pytest_plugins = ["tests.hf_models", "tests.cpu_accounting", "tests.interpreter_patches"]

# Without a GPU the Triton kernels run through Triton's CPU interpreter. It is read when a
# kernel module is imported, so it is set before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite runs in three phases, ordered so the 2-core box stays busy without the parts
# fighting over it (measured: the learning run is ~420 s of one core; beside the end-to-end
# jobs it stretched them by ~30%):
# 1. tests that keep one core busy (the Triton interpreter, the engine, model and trainer on
#    the CPU, bwrap sandboxes, the ledger's databases, the command line's subprocesses),
#    beside the learning run's one thread (tests/trainer/conftest.py);
# 2. the tests whose Ray jobs keep both cores busy on their own (TWO_CORES), which by then
#    have the box to themselves;
# 3. the learning test, which only reads the background run's result.
TWO_CORES = ("e2e", "actors")
READS_THE_LEARNING_RUN = "test_learning.py"
TESTS = Path(__file__).resolve().parent


def suite_phase(item: pytest.Item) -> int:
    if item.path.name == READS_THE_LEARNING_RUN:
        return 2
    parts = item.path.relative_to(TESTS).parts if item.path.is_relative_to(TESTS) else ()
    return 1 if len(parts) > 1 and parts[0] in TWO_CORES else 0


@pytest.hookimpl(tryfirst=True)  # before tests/e2e/conftest.py's own-cluster-last sort
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=suite_phase)  # stable: the order within each phase is kept


PG_HOST, PG_PORT = os.environ.get("RLSYS_TEST_PG_HOST", "127.0.0.1"), 5432
PG_ADMIN_URL = os.environ.get(
    "RLSYS_TEST_PG_URL", f"postgresql+psycopg://postgres@{PG_HOST}:{PG_PORT}/test"
)
REDIS_URL = os.environ.get("RLSYS_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def service_answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def require_service(name: str, host: str, port: int) -> None:
    """Skip (locally) or fail (CI) when a service the test needs does not answer."""
    if service_answers(host, port):
        return
    missing_service(f"{name} does not answer on {host}:{port}")


def missing_service(msg: str) -> None:
    """Skip, saying why; under RLSYS_REQUIRE_SERVICES=1 (CI) fail instead."""
    if os.environ.get("RLSYS_REQUIRE_SERVICES") == "1":
        pytest.fail(msg + " (RLSYS_REQUIRE_SERVICES=1)")
    pytest.skip(msg)


# Logical CPUs of the session's local Ray cluster: enough for every job the tests run on it
# at once (a tiny job asks for about 2.5), so no actor ever waits for a CPU slot. Ray does
# not pin actors to cores.
RAY_LOGICAL_CPUS = 8


@pytest.fixture(scope="session")
def _ray_started() -> Iterator[None]:
    """The session's local Ray cluster: started by the first test that needs one, shut down
    at the end of the session (each `ray.init` costs seconds; jobs share the cluster)."""
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def local_ray(_ray_started: None) -> None:
    """This process joined to the session's local Ray cluster. A test that needs a cluster
    of its own (tests/e2e/test_lost_node.py) shuts it down; the next test starts it again."""
    from rlsys.actors.runtime import init_ray

    init_ray("local", logical_cpus=RAY_LOGICAL_CPUS)


@pytest.fixture
def pg_database_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test, dropped afterwards."""
    require_service("PostgreSQL", PG_HOST, PG_PORT)
    from rlsys.ledger.scratch import scratch_postgres_database

    with scratch_postgres_database(PG_ADMIN_URL, "rlsys_t") as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_url(request: pytest.FixtureRequest, tmp_path) -> str:  # type: ignore[no-untyped-def]
    """A ledger URL on each backend: a fresh SQLite file, a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    return request.getfixturevalue("pg_database_url")


@pytest.fixture
def ledger(ledger_url: str):  # type: ignore[no-untyped-def]
    from rlsys.ledger.store import Ledger

    lg = Ledger.open(ledger_url)
    yield lg
    lg.close()
