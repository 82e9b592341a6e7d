"""Sampling: candidate sets (top-k, top-p, cap), seeded determinism, the recorded log-prob."""

from __future__ import annotations

import pytest
import torch

from rlsys.config.sampling import SamplingConfig
from rlsys.engine.decode_graphs import SamplingBuffers
from rlsys.engine.sampler import (
    RowParams,
    SampledToken,
    SampleOut,
    UniformStream,
    candidate_set,
    draw_uniforms,
    sample,
    sample_batch,
    sample_rows,
)
from rlsys.model import token_log_probs

pytestmark = pytest.mark.unit


def test_top_p_keeps_the_shortest_prefix_reaching_the_mass() -> None:
    z = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert candidate_set(z, 0, 0.45, 10)[0].tolist() == [0]
    assert candidate_set(z, 0, 0.79, 10)[0].tolist() == [0, 1]
    assert candidate_set(z, 0, 0.81, 10)[0].tolist() == [0, 1, 2]
    assert candidate_set(z, 2, 1.0, 10)[0].tolist() == [0, 1]


def test_cap_cuts_the_tail_and_says_so() -> None:
    z = torch.zeros(10)
    ids, capped = candidate_set(z, 0, 1.0, 4)
    assert ids.tolist() == [0, 1, 2, 3] and capped  # ties: lower id first
    assert not candidate_set(z, 4, 1.0, 4)[1]


def test_sampled_token_is_in_its_candidates_with_the_restricted_log_prob() -> None:
    logits = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 3
    params = SamplingConfig(temperature=0.7, top_p=0.9, top_k=20)
    tok = sample(logits, params, 8, torch.Generator().manual_seed(1))
    assert tok.token_id in tok.candidates and len(tok.candidates) <= 8
    cand = torch.tensor([tok.candidates])
    expected = token_log_probs((logits / 0.7)[None], torch.tensor([tok.token_id]), cand)
    assert tok.logprob == float(expected[0])


def test_same_seed_same_tokens_other_seed_other_tokens() -> None:
    logits = torch.zeros(64)
    params = SamplingConfig()

    def draw(seed: int) -> list[int]:
        rng = torch.Generator().manual_seed(seed)
        return [sample(logits, params, 64, rng).token_id for _ in range(20)]

    assert draw(3) == draw(3)
    assert draw(3) != draw(4)


def test_top_k_one_is_greedy_with_log_prob_zero() -> None:
    logits = torch.tensor([0.1, 2.0, 1.9])
    tok = sample(logits, SamplingConfig(top_k=1), 64, torch.Generator())
    assert tok.token_id == 1 and tok.logprob == 0.0 and tok.candidates == [1]


def test_a_step_draws_what_sample_batch_draws_as_rows_join_and_leave() -> None:
    """The graphs' sampling buffers keep the parameter rows while the batch's sequences stay
    and draw each uniform into its column: the drawn tokens, log-probs and candidate sets
    are `sample_batch`'s, step after step, as the rows change (a row leaves, one joins with
    other parameters) and each generator advances by one draw per step."""
    gen = torch.Generator().manual_seed(0)
    params = [SamplingConfig(temperature=0.7, top_p=0.9), SamplingConfig(top_k=5)]
    rows = [RowParams(params[i % 2], 8, torch.Generator().manual_seed(i)) for i in range(4)]
    twins = [
        RowParams(r.params, r.cap, torch.Generator().manual_seed(i)) for i, r in enumerate(rows)
    ]
    buffers = SamplingBuffers(6, torch.device("cpu"))
    batches = [[0, 1, 2, 3], [0, 1, 2, 3], [0, 2, 3], [0, 2, 3, 1], [3]]
    for batch in batches:
        logits = torch.randn(6, 64, generator=gen) * 2  # the graph's rows, padding included
        buffers.fill([rows[i] for i in batch])
        drawn = sample_rows(logits, buffers.tensors(), 8, 64, None)
        got = SampleOut.unpack(drawn.packed(len(batch)))
        want = sample_batch(logits[: len(batch)], [twins[i] for i in batch])
        assert got == want


def test_unpack_gives_the_exact_ids_log_probs_and_flags() -> None:
    out = SampleOut(
        tokens=torch.tensor([7, 2**40 + 3]),
        logprob=torch.tensor([-0.125, -1.0e-7]),
        capped=torch.tensor([True, False]),
        count=torch.tensor([2, 1]),
        cand=torch.tensor([[7, 2**40 + 5, -1], [2**40 + 3, -1, -1]]),
    )
    got = SampleOut.unpack(out.packed(2))
    assert got == [
        SampledToken(7, -0.125, [7, 2**40 + 5], True),
        SampledToken(2**40 + 3, float(torch.tensor(-1.0e-7)), [2**40 + 3], False),
    ]
    assert all(type(i) is int for tok in got for i in tok.candidates)
    assert all(type(tok.capped) is bool for tok in got)


def test_a_uniform_stream_gives_the_one_element_draws_across_blocks() -> None:
    """A long-lived row's uniforms, drawn a block at a time, are the values one-element
    draws from the same seed give, across block boundaries: a seeded request's tokens do
    not depend on the block."""
    stream = UniformStream(torch.Generator().manual_seed(11))
    row = RowParams(SamplingConfig(), 8, stream=stream)
    twin = RowParams(SamplingConfig(), 8, torch.Generator().manual_seed(11))
    n = 2 * UniformStream.BLOCK + 5
    got = [x for _ in range(n) for x in draw_uniforms([row])]
    want = [x for _ in range(n) for x in draw_uniforms([twin])]
    assert got == want and len(set(got)) == n
