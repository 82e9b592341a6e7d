"""The data plane's overhead on a simulated job of 10,000 sessions (PostgreSQL + Redis).

Everything but the model is real: the controller core (`Planner`, `FailureHandler`'s
bookkeeping, `StepCommitter`) in this process, rollout workers in `--workers` processes
(`--concurrency` sessions each, as threads), a trainer process consuming the Redis stream
through `TrajectoryInbox`, a PostgreSQL ledger. The policy is scripted and the environment
is the latency environment (`ToolLatencyConfig`): each session makes `--turns` tool calls,
each answered after a lognormal delay, then publishes a scripted trajectory (token ids and
log-probs of ~`--tokens` policy tokens) and records `scored` with its turn events. The
trainer "steps" instantly, so what is measured is the platform's own cost:

- ledger + stream share: per session, time in ledger writes and stream publishes over the
  session's wall time (goal < 1%);
- controller CPU per 1,000 rollouts: this process's CPU time (planning, ledger writes of
  plans and step commits, stats per step, message handling), no Ray edge;
- stream peak memory: Redis `used_memory` above its baseline, and the longest the stream
  got (entries), sampled every 50 ms: bounded by what is in flight, since acked entries
  are deleted.

    .venv/bin/python benchmarks/bench_job_overhead.py [--sessions 10000]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import queue
import statistics
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlsys.config.job import JobConfig
from rlsys.control.ledger_sink import LedgerEventBuffer
from rlsys.control.ledger_writer import GroupCommitWriter
from rlsys.control.messages import Assignment, RolloutReport
from rlsys.control.planner import Planner
from rlsys.control.step_commit import StepCommitter
from rlsys.control.trajectory_inbox import TrajectoryInbox
from rlsys.ledger.queries import stats
from rlsys.ledger.records import Transition
from rlsys.ledger.redis_stream import RedisRolloutStream
from rlsys.ledger.scratch import scratch_postgres_database
from rlsys.ledger.store import Ledger
from rlsys.ledger.stream import RedisStreamConfig, open_stream
from rlsys.rollout.latency import ToolLatencyConfig, tool_delay_s
from rlsys.trajectory import Segment, Trajectory
from rlsys.types import RolloutState as S

PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
REDIS = "redis://127.0.0.1:6379/0"
STOP = None


def scripted_trajectory(a: Assignment, tokens: int, turns: int) -> Trajectory:
    seg = Segment()
    seg.append(list(range(60)), turn=-1, policy=False)
    per_turn = tokens // turns
    for t in range(turns):
        seg.append([7] * per_turn, turn=t, policy=True, logprobs=[-0.5] * per_turn,
                   versions=[0] * per_turn)  # fmt: skip
        seg.append([9] * 12, turn=t, policy=False)
    return Trajectory(a.rollout_id, a.group_id, f"t/{a.task_index}", [seg], reward=a.task_index % 2,
                      num_turns=turns)  # fmt: skip


def worker_main(args: dict[str, Any], tasks: Any, results: Any) -> None:
    ledger = Ledger.open(args["ledger"], create=False)
    # The worker's write path: group commit (what `RolloutWorker` does), or one transaction
    # per write (--no-group-commit, the path before it).
    writer: Any = GroupCommitWriter(ledger) if args["group_commit"] else ledger
    stream = open_stream(RedisStreamConfig(url=REDIS, stream=args["stream"]))
    latency = ToolLatencyConfig(median_s=args["latency"], sigma=0.5)
    owner = f"worker-{uuid.uuid4().hex[:6]}"
    ledger.heartbeat(owner, args["job"], 3600)

    def one(a: Assignment) -> None:
        started = time.perf_counter()
        sink = LedgerEventBuffer(a.rollout_id, args["job"])
        t0 = time.perf_counter()
        writer.apply([Transition(a.rollout_id, S.ADMITTED, updates={"owner": owner}),
                      Transition(a.rollout_id, S.RUNNING)])  # fmt: skip
        ledger_s = time.perf_counter() - t0
        for turn in range(args["turns"]):
            time.sleep(tool_delay_s(latency, a.rollout_id, turn))  # the environment
            sink.emit("turn", turn, args["tokens"] // args["turns"], {})
            sink.emit("tool_call", turn, 0, {"tool": "calc"})
        traj = scripted_trajectory(a, args["tokens"], args["turns"])
        t0 = time.perf_counter()
        entry = stream.publish(a.rollout_id, pickle.dumps(traj))
        stream_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        writer.apply([Transition(a.rollout_id, S.SCORED, updates={"reward": traj.reward})],
                     sink.drain())  # fmt: skip
        ledger_s += time.perf_counter() - t0
        wall = time.perf_counter() - started
        report = RolloutReport(a.rollout_id, S.SCORED.value, entry, reward=traj.reward)
        results.put((report, ledger_s, stream_s, wall))

    with ThreadPoolExecutor(args["concurrency"]) as pool:
        while (a := tasks.get()) is not STOP:
            pool.submit(one, a)


def trainer_main(stream_name: str, steps: Any, done: Any) -> None:
    inbox = TrajectoryInbox(open_stream(RedisStreamConfig(url=REDIS, stream=stream_name)))
    while (msg := steps.get()) is not STOP:
        kind, ids = msg
        if kind == "step":
            inbox.take(ids, timeout_s=300)
            done.put(len(ids))
        else:
            inbox.commit(ids)


def sample_redis(stream_name: str, peak: dict[str, int], stop: threading.Event) -> None:
    stream = RedisRolloutStream(RedisStreamConfig(url=REDIS, stream=stream_name))
    base = stream.server_memory_bytes()
    while not stop.wait(0.05):
        peak["memory"] = max(peak["memory"], stream.server_memory_bytes() - base)
        peak["length"] = max(peak["length"], stream.length())
    stream.close()


def run(args: argparse.Namespace, ledger_url: str) -> dict[str, float]:
    steps_total = args.sessions // (args.groups_per_step * args.group_size)
    cfg = JobConfig.model_validate({
        "rollout": {"group_size": args.group_size, "groups_in_flight": args.groups_in_flight},
        "trainer": {"steps": steps_total, "groups_per_step": args.groups_per_step},
        # scripted rewards are equal within a group (one task per group): with the filter
        # on, the planner would drop every group and end the job for want of a signal
        "algo": {
            "max_staleness": args.groups_in_flight // args.groups_per_step - 1,
            "filter_zero_variance": False,
        },
    })  # fmt: skip
    ledger = Ledger.open(ledger_url)
    job = ledger.create_job("bench", {})
    stream_name = f"rlsys:bench:{uuid.uuid4().hex}"
    open_stream(RedisStreamConfig(url=REDIS, stream=stream_name)).close()
    ctx = mp.get_context("spawn")
    tasks, results, steps, done = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    wargs = {"ledger": ledger_url, "stream": stream_name, "job": job, "turns": args.turns,
             "tokens": args.tokens, "latency": args.latency, "concurrency": args.concurrency,
             "group_commit": args.group_commit}  # fmt: skip
    # daemons: an exception in the controller loop below ends the benchmark instead of
    # leaving it waiting on children blocked in `tasks.get()`
    procs = [
        ctx.Process(target=worker_main, args=(wargs, tasks, results), daemon=True)
        for _ in range(args.workers)
    ]
    procs.append(ctx.Process(target=trainer_main, args=(stream_name, steps, done), daemon=True))
    for p in procs:
        p.start()
    peak = {"memory": 0, "length": 0}
    stop = threading.Event()
    sampler = threading.Thread(target=sample_redis, args=(stream_name, peak, stop), daemon=True)
    sampler.start()
    planner, committer = Planner(cfg, job, ledger), StepCommitter(ledger, job)
    step, batch, timings = 0, None, []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    while step < steps_total:
        for a in planner.plan(step=step, training=batch is not None):
            tasks.put(a)
        if batch is None and (groups := planner.next_batch()) is not None:
            batch = [r for g in groups for r in sorted(g.scored)]
            committer.buffer(batch)
            steps.put(("step", batch))
        try:
            report, ledger_s, stream_s, wall = results.get(timeout=0.02)
            planner.scored(report)
            planner.sift()  # judges finished groups (all kept: the filter is off)
            timings.append((ledger_s, stream_s, wall))
        except queue.Empty:
            pass
        try:
            done.get_nowait()
        except queue.Empty:
            continue
        step += 1
        planner.version = step
        metrics = {"step": step, "drop_rate": stats(ledger, job)["drop_rate"]}
        ledger.record_trainer_step(job, step, step, metrics)
        committer.commit(batch, [], step)
        steps.put(("commit", batch))
        batch = None
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    for _ in range(args.workers):
        tasks.put(STOP)
    steps.put(STOP)
    for p in procs:
        p.join(timeout=120)
    stop.set()
    sampler.join()
    trained = stats(ledger, job)["terminal"]["trained"]
    ledger.close()
    RedisRolloutStream(RedisStreamConfig(url=REDIS, stream=stream_name)).delete()
    overhead = [(lg + st) / w for lg, st, w in timings]
    return {
        "sessions": len(timings),
        "trained": trained,
        "wall_s": wall,
        "share_mean": sum(lg + st for lg, st, _ in timings) / sum(w for *_, w in timings),
        "share_p99": sorted(overhead)[int(0.99 * len(overhead))],
        "ledger_ms": statistics.mean(lg for lg, _, _ in timings) * 1e3,
        "stream_ms": statistics.mean(st for _, st, _ in timings) * 1e3,
        "session_s": statistics.mean(w for *_, w in timings),
        "controller_cpu_per_1000": cpu / len(timings) * 1000,
        "peak_memory_mb": peak["memory"] / 2**20,
        "peak_length": peak["length"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=10_000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=200, help="Sessions per worker process.")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--groups-per-step", type=int, default=25)
    ap.add_argument("--groups-in-flight", type=int, default=100)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=120, help="Policy tokens per session.")
    ap.add_argument("--latency", type=float, default=1.0, help="Median tool latency (s).")
    ap.add_argument("--group-commit", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    with scratch_postgres_database(PG_ADMIN, "rlsys_bench") as url:
        r = run(args, url)
    print(f"{r['sessions']:,} sessions ({r['trained']:,} trained) in {r['wall_s']:.0f} s; "
          f"mean session {r['session_s']:.2f} s")  # fmt: skip
    print("| ledger+stream share of session wall (mean / p99) | ledger ms / session | "
          "stream ms / session | controller CPU / 1,000 rollouts | stream peak memory | "
          "stream peak length |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|")
    print(f"| {r['share_mean']:.2%} / {r['share_p99']:.2%} | {r['ledger_ms']:.1f} | "
          f"{r['stream_ms']:.1f} | {r['controller_cpu_per_1000']:.2f} s | "
          f"{r['peak_memory_mb']:.1f} MiB | {r['peak_length']:,} |")  # fmt: skip


if __name__ == "__main__":
    main()
