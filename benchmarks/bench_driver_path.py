"""What one trajectory costs the driver: bytes through it and its pickling time, before and
after trajectories moved onto the stream.

Trajectories are recorded by the real `InferenceEngine` on the quickstart's shapes (the
`small` preset, 3 turns of up to 40 tokens, top-p candidate sets capped at 32, routed
experts per token). The driver's share of each path, per trajectory:

- before (the controller carried trajectories): the worker's result with its trajectory
  arrives (unpickled on the driver), is pickled into the stream, and is pickled again into
  the trainer's step call: three crossings;
- after (workers publish, the trainer reads the stream): a `RolloutReport` arrives, and the
  rollout id goes out twice (the step call, the ack call).

Pickling is what Ray does to task arguments and results (protocol 5); each of `--runs`
timing runs is the median of `--repeat` passes over the trajectories, and the table shows
the spread (min-max) over the runs.

    .venv/bin/python benchmarks/bench_driver_path.py [--trajectories 32] [--repeat 5]
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from rlsys.config.engine import EngineConfig
from rlsys.config.model import preset
from rlsys.config.sampling import SamplingConfig
from rlsys.control.messages import RolloutReport
from rlsys.engine.api import GenerationRequest
from rlsys.engine.engine import InferenceEngine
from rlsys.model import Transformer
from rlsys.tokenizer import VOCAB_SIZE
from rlsys.trajectory import Segment, Trajectory

P = pickle.HIGHEST_PROTOCOL


def trajectories(n: int, seed: int = 0) -> list[Trajectory]:
    torch.manual_seed(seed)
    model = Transformer(preset("small"))
    rng = torch.Generator().manual_seed(seed)
    cfg = EngineConfig(seed=seed, max_context_tokens=384, candidate_cap=32, sample_vocab=VOCAB_SIZE)
    out = []
    with InferenceEngine(model.cfg, cfg, model.state_dict(), 0) as engine:
        for i in range(n):
            seg = Segment()
            seg.append(
                torch.randint(0, VOCAB_SIZE, (60,), generator=rng).tolist(), turn=-1, policy=False
            )
            for turn in range(3):
                r = engine.generate(
                    GenerationRequest(f"{i}-{turn}", str(i), list(seg.token_ids),
                                      SamplingConfig(max_tokens_per_turn=40))
                )  # fmt: skip
                assert r.error is None, r.error
                seg.append_generation(r, turn=turn)
                obs = torch.randint(0, VOCAB_SIZE, (12,), generator=rng).tolist()
                seg.append(obs, turn=turn, policy=False)
            out.append(Trajectory(f"r-{i:032x}", f"g-{i // 4:032x}", f"arithmetic/{i}", [seg],
                                  reward=1.0, num_turns=3))  # fmt: skip
    return out


def _timed(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def before(trajs: list[Trajectory], repeat: int) -> tuple[float, float]:
    """(bytes, seconds) per trajectory on the driver, the controller carrying trajectories."""
    results = [
        pickle.dumps({"rollout_id": t.rollout_id, "state": "scored", "trajectory": t}, P)
        for t in trajs
    ]

    def driver() -> int:
        sent = 0
        got = [pickle.loads(r) for r in results]  # worker -> driver
        for g in got:
            sent += len(pickle.dumps(g["trajectory"], P))  # driver -> stream
        sent += len(pickle.dumps([g["trajectory"] for g in got], P))  # driver -> trainer
        return sent

    sent = driver() + sum(len(r) for r in results)
    return sent / len(trajs), _timed(driver, repeat) / len(trajs)


def after(trajs: list[Trajectory], repeat: int) -> tuple[float, float]:
    reports = [pickle.dumps(RolloutReport(t.rollout_id, "scored", "0-1"), P) for t in trajs]

    def driver() -> int:
        got = [pickle.loads(r) for r in reports]  # worker -> driver
        ids = [g.rollout_id for g in got]
        return len(pickle.dumps((ids, 300.0), P)) + len(pickle.dumps((ids, []), P))  # step, ack

    sent = driver() + sum(len(r) for r in reports)
    return sent / len(trajs), _timed(driver, repeat) / len(trajs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    trajs = trajectories(args.trajectories)
    tokens = sum(t.num_policy_tokens for t in trajs) / len(trajs)
    print(f"{len(trajs)} trajectories, {tokens:.0f} policy tokens each on average")
    print("| path | bytes through the driver / trajectory | driver pickling / trajectory |")
    print("|---|---:|---:|")
    for name, fn in (("before: controller carries trajectories", before),
                     ("after: workers -> stream -> trainer", after)):  # fmt: skip
        runs = [fn(trajs, args.repeat) for _ in range(args.runs)]
        size = runs[0][0]
        lo, hi = min(s for _, s in runs) * 1e6, max(s for _, s in runs) * 1e6
        print(f"| {name} | {size:,.0f} B | {lo:,.1f}-{hi:,.1f} us |")


if __name__ == "__main__":
    main()
