"""End-to-end fixtures: a job config small enough for CI (tiny model, real everything else).

One local Ray cluster per test session, shared by every job (`local_ray`, tests/conftest.py);
bwrap sandboxes, SQLite ledger, the local (SQLite) stream, native engine replicas, the trainer.
The tests that need a cluster of their own run last, so the shared one starts once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TINY_JOB = """
name: e2e
seed: 0
model: {{preset: tiny, overrides: {{vocab_size: 320}}}}
engine: {{replicas: 2, max_running: 8, max_context_tokens: 768, candidate_cap: 16, num_cpus: 0.25}}
sampling: {{max_tokens_per_turn: 48}}
rollout:
  workers: 2
  concurrency_per_worker: 4
  group_size: 4
  groups_in_flight: 3
  lease_s: 3.0
  task: {{type: arithmetic, max_factor: 9, max_addend: 9}}
  sandbox: {{type: bwrap}}
  scaffold: {{max_turns: 3, max_observation_tokens: 64, compaction: {{max_state_tokens: 64}}}}
trainer: {{steps: {steps}, groups_per_step: 2, warm_start: {{steps: 2, demonstrations: 8, batch_size: 4}}}}
store: {{run_root: {root}}}
"""


# Modules whose tests start (or join) a Ray cluster of their own, and so shut the shared one
# down: run after every other end-to-end test.
OWN_CLUSTER = ("test_lost_node.py",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name in OWN_CLUSTER)  # stable: order kept otherwise


@pytest.fixture
def tiny_job_file(tmp_path: Path):
    """The tiny job's YAML as a file (for `rlsys run` in a subprocess)."""

    def make(steps: int = 3) -> Path:
        path = tmp_path / "job.yaml"
        path.write_text(TINY_JOB.format(steps=steps, root=tmp_path / "runs"))
        return path

    return make


@pytest.fixture
def tiny_job(tmp_path: Path, request: pytest.FixtureRequest):
    from rlsys.cli.job_config import load_job_config

    if "cluster" not in request.fixturenames:  # a cluster of its own (test_lost_node.py)
        request.getfixturevalue("local_ray")

    def make(steps: int = 3, *sets: str):
        path = tmp_path / "job.yaml"
        path.write_text(TINY_JOB.format(steps=steps, root=tmp_path / "runs"))
        return load_job_config(str(path), sets)

    return make
