"""Every way a job can end is named, end to end: a crash in any start-up phase, an
interrupt during the warm start, no learning signal, and a driver killed outright (seen
`orphaned`, reaped, resumed). After each, the ledger holds no live rollout of the job.
The fault is injected at the edge: the driver's phase hook, a signal, SIGKILL."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from rlsys.actors.job import ledger_url_for, run_job
from rlsys.ledger.store import Ledger
from tests.e2e.cli_job import CliJob, rlsys_json

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

PHASES = [
    "stream",
    "ray",
    "reporting",
    "actors",
    "warm_start",
    "critic_pretrain",
    "first_broadcast",
]
LIVE_SQL = (
    "SELECT count(*) FROM rollouts WHERE job_id = :j AND state IN "
    "('planned','admitted','running','scored','buffered')"
)


class Injected(RuntimeError):
    pass


def _job_row(cfg, job_id: str) -> tuple[dict, int]:
    lg = Ledger.open(ledger_url_for(cfg), create=False)
    try:
        with lg.engine.connect() as conn:
            live = conn.execute(sa.text(LIVE_SQL), {"j": job_id}).scalar_one()
        return lg.get_job(job_id), live
    finally:
        lg.close()


@pytest.mark.parametrize("phase", PHASES)
def test_a_crash_in_any_start_up_phase_ends_the_job_failed(tiny_job, phase):
    cfg = tiny_job(2, "algo.critic.enabled=true", "algo.critic.pretrain_steps=2")
    seen: list[str] = []

    def crash_at(name: str) -> None:
        seen.append(name)
        if name == phase:
            raise Injected(f"injected at {name}")

    with pytest.raises(Injected):
        run_job(cfg, job_id=f"j-crash-{phase}", on_event=lambda s: None, on_phase=crash_at)
    job, live = _job_row(cfg, f"j-crash-{phase}")
    assert seen[-1] == phase
    assert job["status"] == "failed" and live == 0
    assert job["end_reason"] == f"Injected: injected at {phase} (during {phase})"


def test_sigterm_during_the_warm_start_stops_the_job_without_a_traceback(tiny_job_file, tmp_path):
    job = CliJob(str(tiny_job_file(2)), "--set", "trainer.warm_start.steps=5000", cwd=tmp_path)
    job_id = job.job_id()
    job.wait_for_line("warm start:")
    job.signal(signal.SIGTERM)
    code, _out, err = job.finish()
    assert code == 130, err[-3000:]
    assert "Traceback" not in err
    stats = rlsys_json("ledger", "stats", "--job", job_id, cwd=tmp_path)
    assert stats["job_status"] == "stopped" and stats["lost"] == 0
    assert stats["end_reason"] == "interrupted (SIGINT or SIGTERM) during warm_start"


def test_a_job_without_learning_signal_ends_failed_in_bounded_time(tiny_job_file, tmp_path):
    # One token a turn can never hold an answer: every reward is exactly 0, and a malformed
    # turn costs nothing, so no group carries a signal.
    sets = [
        "sampling.max_tokens_per_turn=1",
        "rollout.scaffold.malformed_penalty=0",
        "trainer.warm_start.steps=0",
        "algo.max_generation_per_step=4",
    ]
    job = CliJob(str(tiny_job_file(3)), *[a for s in sets for a in ("--set", s)], cwd=tmp_path)
    job_id = job.job_id()
    code, _out, err = job.finish(timeout_s=600)
    assert code == 1, err[-3000:]
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"job {job_id} failed: no learning signal: ")
    stats = rlsys_json("ledger", "stats", "--job", job_id, cwd=tmp_path)
    assert stats["lost"] == 0 and stats["in_flight"] == 0
    assert stats["terminal"]["trained"] == 0
    assert stats["terminal"]["filtered_zero_variance"] >= 4 * 4  # sifted by the controller


def test_a_solved_task_set_ends_the_job_completed_as_soon_as_the_evidence_is_in(tiny_job):
    # One prompt, and every reward counts as a pass: the first four scored rollouts retire
    # the prompt and solve the set. The job must end there, `completed` (solved), before a
    # trainer step (two groups make a step): generating on would only burn rollouts.
    cfg = tiny_job(
        30,
        "rollout.curriculum.task_set=1",
        "rollout.curriculum.pass_reward=-100",
        "trainer.checkpoint_every=1000",
    )
    summary = run_job(cfg, job_id="j-solved", on_event=lambda s: None)
    assert summary["status"] == "completed", summary
    assert summary["end_reason"] == "solved: pass rate 1.000 >= 0.95 over 1 prompts"
    assert summary["terminal"]["trained"] == 0  # ended before any step, not after one
    assert summary["lost"] == 0 and summary["in_flight"] == 0
    job, live = _job_row(cfg, "j-solved")
    assert job["status"] == "completed" and live == 0
    checkpoint = Path(cfg.store.run_root) / "j-solved" / "checkpoint"
    assert checkpoint.exists()  # the solved policy is kept, whatever checkpoint_every is


def test_a_killed_driver_is_seen_orphaned_reaped_and_resumed(tiny_job_file, tmp_path):
    config = str(tiny_job_file(3))
    sets = ["--set", "store.driver_timeout_s=3"]
    first = CliJob(config, *sets, cwd=tmp_path)
    job_id = first.job_id()
    first.wait_for_line("step    1")
    first.kill_group()  # SIGKILL: no handler, no finally, no atexit
    deadline = time.monotonic() + 120
    while True:
        jobs = {j["id"]: j for j in rlsys_json("jobs", "list", cwd=tmp_path)}
        if jobs[job_id]["status"] == "orphaned":
            break
        assert time.monotonic() < deadline, jobs[job_id]
        time.sleep(0.5)
    stats = rlsys_json("ledger", "stats", "--job", job_id, cwd=tmp_path)
    assert stats["job_status"] == "orphaned" and stats["in_flight"] == 0
    assert stats["lost"] > 0  # its live rollouts are lost, not in flight, until reaped
    reaped = rlsys_json("jobs", "reap", job_id, cwd=tmp_path)
    assert reaped["rollouts_ended"] == stats["lost"]
    after = rlsys_json("ledger", "stats", "--job", job_id, cwd=tmp_path)
    assert after["job_status"] == "failed" and after["lost"] == 0
    assert after["terminal"]["failed_driver_lost"] == stats["lost"]
    resumed = CliJob(config, *sets, "--resume", job_id, cwd=tmp_path)
    code, _out, err = resumed.finish()
    assert code == 0, err[-3000:]
    final = rlsys_json("ledger", "stats", "--job", job_id, cwd=tmp_path)
    assert final["job_status"] == "completed" and final["lost"] == 0
    steps = rlsys_json("monitor", "--job", job_id, cwd=tmp_path)
    assert [s["step"] for s in steps] == [1, 2, 3]
