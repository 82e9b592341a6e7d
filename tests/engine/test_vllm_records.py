"""A vLLM token's record: exact top-p set when the nucleus fits in the returned log-probs,
flagged (and no set) when it does not. Pure Python: runs without vLLM."""

import math

import pytest

from rlsys.engine.vllm_records import token_record

pytestmark = pytest.mark.unit

NEG_INF = float("-inf")


def test_nucleus_inside_the_returned_logprobs_is_recorded_exactly():
    # processed log-probs: the nucleus {3, 7, 1} renormalised, the rest masked to -inf
    probs = {3: 0.5, 7: 0.3, 1: 0.2}
    returned = {i: math.log(p) for i, p in probs.items()} | {9: NEG_INF, 4: NEG_INF}
    rec = token_record(7, returned)
    assert rec.token_id == 7 and rec.logprob == pytest.approx(math.log(0.3))
    assert rec.candidates == [3, 7, 1] and not rec.capped


def test_nucleus_larger_than_the_returned_logprobs_is_flagged_without_a_set():
    # only the top 2 of a 4-token nucleus came back (plus the sampled id, ranked 3rd)
    returned = {0: math.log(0.4), 5: math.log(0.3), 2: math.log(0.2)}
    rec = token_record(2, returned)
    assert rec.capped and rec.candidates == []
    assert rec.logprob == pytest.approx(math.log(0.2))


def test_ties_order_by_id():
    returned = {8: math.log(0.5), 2: math.log(0.5)}
    assert token_record(8, returned).candidates == [2, 8]
