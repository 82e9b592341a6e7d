"""TP-size invariance: shards over 1, 2, 4, 8 ranks give the TP=1 trainer's log-probs bitwise,
as threads in one process and as real gloo processes."""

from __future__ import annotations

import pytest
import torch

from rlsys.engine.tp_dist import DistTPRunner
from rlsys.engine.tp_shard import shard_plan, tp_error
from tests.engine.conftest import make_core, prompts, request, run_all, tiny, trainer_log_probs

pytestmark = pytest.mark.unit


def test_shard_plan_replicates_whole_groups_beyond_the_group_count() -> None:
    cfg, _ = tiny()  # 4 heads in 2 groups, head_dim 8: eight 4-column chunks of wo
    plan = shard_plan(cfg, 8, 5)
    assert plan.groups == (1, 2) and plan.heads == (2, 4)
    assert plan.wo_cols == (20, 24) and plan.out_cols == (4, 8)
    assert plan.hidden == (20, 24)
    assert tp_error(cfg.with_overrides({"n_kv_groups": 3, "n_heads": 12}), 2) is not None
    assert tp_error(cfg.with_overrides({"n_kv_groups": 4, "n_heads": 12}), 8) is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_tp_degree_gives_the_trainer_log_probs(dtype: str) -> None:
    cfg, model = tiny(dtype)
    reqs = [request(f"r{i}", p, top_p=0.95) for i, p in enumerate(prompts(3))]
    results = {
        tp: run_all(make_core(cfg, model, tp=tp, max_step_tokens=20), reqs) for tp in (1, 2, 4, 8)
    }
    for req in reqs:
        ref = results[1][req.request_id]
        expected = trainer_log_probs(model, req.prompt_ids, ref)
        assert torch.equal(torch.tensor(ref.logprobs), expected)
        for tp in (2, 4, 8):
            res = results[tp][req.request_id]
            assert res.token_ids == ref.token_ids and res.logprobs == ref.logprobs


def test_gloo_ranks_match_the_full_forward() -> None:
    cfg, model = tiny()
    seqs = prompts(3)
    with torch.no_grad():
        ref = [model(torch.tensor([s]), with_mtp=False).logits[0, -1] for s in seqs]
    for degree in (2, 8):
        runner = DistTPRunner(cfg, model.state_dict(), degree, "gloo")
        try:
            keys = [runner.new_cache() for _ in seqs]
            runner.step(keys, [s[:2] for s in seqs])  # prefill in two mixed chunks
            out = runner.step(keys, [s[2:] for s in seqs])
        finally:
            runner.close()
        for i in range(len(seqs)):
            assert torch.equal(out.last_logits[i], ref[i]), (degree, i)
