"""Host time of packing a trainer step's micro-batches (`rlsys.trainer.batch.pack`).

Usage: python benchmarks/bench_trainer_pack.py [--preset large] [--lengths 8192,32768]
    [--repeat 3] [--forms block,block-ids,per-token]

`Trainer._plan` packs every micro-batch of a step before the first forward, so the GPU
waits for it; with the trunk replayed as CUDA graphs the step is short enough for this to
matter. Per length: two trajectories shaped as `bench_trainer_gpu.py` builds them (a
256-token prompt, then policy tokens with a log-prob, a version, a top-64 candidate set
and the routed experts of every MoE layer per row), each packed as its own micro-batch
(`micro_batch_tokens` = length), `--repeat` times; prints the best, the spread and the
share of the time spent in the routes and in the candidate sets (cProfile of one more
round); then one trajectory's pickled size and unpickling time (a worker publishes it
pickled to the rollout stream; the trainer's inbox unpickles it). Routes in the forms a
segment can hold them (`ROUTE_FORMS`): the engine's block with fp32 gates, the block of ids
alone (`engine.route_gates: none`, a job's default unless its replay reads the gates), and
the per-token entries segments held before (the anchor). Host-only: runs anywhere, the figures are this
machine's.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import pickle
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlsys.config.model import preset  # noqa: E402
from rlsys.engine.route_log import TokenRoutes  # noqa: E402
from rlsys.trainer.batch import pack  # noqa: E402
from rlsys.trajectory import Segment, Trajectory  # noqa: E402

PROMPT, CANDIDATES = 256, 64
# how a generation's routes reach the segment: the engine's one block (`TokenRoutes`, kept
# whole by `RouteRows`), with fp32 gates or ids only, or cut into one {"indices", "gates"}
# entry per token (the anchor: what segments stored before)
ROUTE_FORMS = {
    "block": lambda ids, gates: TokenRoutes({"indices": ids, "gates": gates}),
    # engine.route_gates none: what a job whose replay is `indices` (the default) records
    "block-ids": lambda ids, gates: TokenRoutes({"indices": ids}),
    "per-token": lambda ids, gates: list(TokenRoutes({"indices": ids, "gates": gates})),
}


def trajectory(layers: int, k: int, length: int, seed: int, form: str = "block") -> Trajectory:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (length,), generator=g).tolist()
    idx = torch.randint(0, 32, (layers, length, k), generator=g).to(torch.uint8)
    gates = torch.rand(layers, length, k, generator=g)
    top = torch.randint(0, 256, (length, CANDIDATES), generator=g).tolist()
    rows = range(PROMPT - 1, length - 1)
    targets = tokens[PROMPT:]
    seg = Segment()
    seg.append(tokens[:PROMPT], turn=-1, policy=False)
    seg.append(
        targets,
        turn=0,
        policy=True,
        logprobs=[-1.0] * len(targets),
        versions=[0] * len(targets),
        candidates=[sorted({*top[r], targets[j]}) for j, r in enumerate(rows)],
        routed=ROUTE_FORMS[form](
            idx[:, PROMPT - 1 : length - 1], gates[:, PROMPT - 1 : length - 1]
        ),
    )
    return Trajectory("r0", "g", "t", [seg], reward=1.0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="large")
    p.add_argument("--lengths", default="8192,32768")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument(
        "--forms", default="block,block-ids,per-token", help="of " + ", ".join(ROUTE_FORMS)
    )
    args = p.parse_args()
    cfg = preset(args.preset)
    layers, k = cfg.n_layers, cfg.experts_per_token
    print(f"preset {args.preset}: {layers} MoE layers x top-{k} routes per row, "
          f"{CANDIDATES} candidates per policy token; 2 trajectories, one micro-batch each")  # fmt: skip
    print(
        "\n| tokens/seq | routes as | pack s per step (best) | spread | routes | candidate sets "
        "| pickled MB per trajectory | unpickle s per trajectory (best) |"
    )
    print("|---:|---|---:|---|---:|---:|---:|---:|")
    for length, form in itertools.product(
        (int(x) for x in args.lengths.split(",")), args.forms.split(",")
    ):
        trajs = [trajectory(layers, k, length, seed, form) for seed in (0, 1)]
        items = [[(i, t.segments[0], t)] for i, t in enumerate(trajs)]
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            for micro in items:
                pack(micro, version=0)
            times.append(time.perf_counter() - start)
        prof = cProfile.Profile()
        prof.enable()
        for micro in items:
            pack(micro, version=0)
        prof.disable()
        stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
        total = sum(v[3] for f, v in stats.items() if f[2] == "pack")
        share = {
            name: sum(v[3] for f, v in stats.items() if f[2] == name) / total
            for name in ("_routes", "_candidates")
        }
        payload = pickle.dumps(trajs[0])  # what a worker publishes to the rollout stream
        loads = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            pickle.loads(payload)  # what the trainer's inbox does per trajectory
            loads.append(time.perf_counter() - start)
        print(
            f"| {length} | {form} | {min(times):.3f} | {min(times):.3f}-{max(times):.3f} "
            f"| {share['_routes']:.0%} | {share['_candidates']:.0%} "
            f"| {len(payload) / 1e6:.1f} | {min(loads):.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
