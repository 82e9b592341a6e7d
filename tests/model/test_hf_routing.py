"""R3 on a Hugging Face MoE model: the router hook imposes recorded routes on the rows that
have one (ids, and gates recomputed or recorded) and leaves the others to the router."""

import pytest
import torch

from rlsys.model.attention import SeqSpan
from rlsys.model.routing import RoutedExperts, RoutingReplay
from tests.hf_models import needs_transformers

pytestmark = [pytest.mark.unit, needs_transformers]

SPANS = [SeqSpan(0, 7, 0), SeqSpan(7, 12, 0)]


def _record(policy, tokens) -> RoutedExperts:
    """The routes the model's own routers pick for the packed rows (a test-side recorder)."""
    from rlsys.model.hf_routing import routers

    found = routers(policy.model)
    seen: dict[int, list] = {i: [] for i in range(len(found))}
    handles = [
        r.register_forward_hook(lambda m, a, out, i=i: seen[i].append((out[2], out[1])))
        for i, r in enumerate(found)
    ]
    with torch.no_grad():
        policy.hidden_packed(tokens, SPANS)
    for h in handles:
        h.remove()
    ids = torch.stack([torch.cat([i for i, _ in seen[layer]]) for layer in seen])
    gates = torch.stack([torch.cat([g for _, g in seen[layer]]) for layer in seen])
    return RoutedExperts(ids.long(), gates.float())


@pytest.fixture
def moe(hf_model_dirs):  # per test: under the test's torch thread count (conftest)
    from rlsys.model.hf_policy import HFPolicy

    policy = HFPolicy.from_pretrained(str(hf_model_dirs["qwen3_moe"])).eval()
    tokens = torch.randint(0, 259, (19,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        free = policy.hidden_packed(tokens, SPANS)
    return policy, tokens, free, _record(policy, tokens)


@pytest.mark.parametrize("use_gates", [False, True])
def test_replaying_the_models_own_routes_changes_nothing(moe, use_gates):
    policy, tokens, free, routes = moe
    assert routes.indices.shape == (4, 19, 2)
    with torch.no_grad():
        replayed = policy.hidden_packed(tokens, SPANS, RoutingReplay(routes, use_gates))
    if use_gates:  # the same ids and gate values: the same forward, bit for bit
        assert torch.equal(replayed, free)
    else:  # gates recomputed from the router: the same math in another op order
        torch.testing.assert_close(replayed, free, rtol=0, atol=1e-5)


def test_other_routes_are_imposed_only_on_recorded_rows(moe):
    policy, tokens, free, routes = moe
    other = RoutedExperts((routes.indices + 3) % 8, routes.gates)
    only_second = torch.arange(19) >= 7
    with torch.no_grad():
        forced = policy.hidden_packed(tokens, SPANS, RoutingReplay(other, True, only_second))
    assert torch.equal(forced[:7], free[:7])  # no record: the router's own choice
    assert (forced[7:] - free[7:]).abs().max() > 1e-3  # the imposed experts ran


def test_indices_replay_keeps_the_routers_gradient(moe):
    policy, tokens, _, routes = moe
    policy.zero_grad()
    policy.hidden_packed(tokens, SPANS, RoutingReplay(routes, False)).sum().backward()
    from rlsys.model.hf_routing import routers

    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0
               for r in routers(policy.model))  # fmt: skip
