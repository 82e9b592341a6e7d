"""The thread-safe facade: concurrent callers, stops, abort, weight updates, bad input."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rlsys.config.engine import EngineConfig
from rlsys.engine.api import GenerationRequest
from rlsys.engine.engine import InferenceEngine
from rlsys.tokenizer import ByteTokenizer
from tests.engine.conftest import prompts, request, tiny, trainer_log_probs

pytestmark = pytest.mark.unit


@pytest.fixture
def engine_and_model():  # type: ignore[no-untyped-def]
    cfg, model = tiny()
    engine = InferenceEngine(
        cfg, EngineConfig(max_running=4, max_context_tokens=96), model.state_dict()
    )
    yield engine, model
    engine.close()


def test_many_threads_generate_concurrently(engine_and_model) -> None:  # type: ignore[no-untyped-def]
    engine, model = engine_and_model
    reqs = [request(f"r{i}", p) for i, p in enumerate(prompts(6))]
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(engine.generate, reqs))
    for req, res in zip(reqs, results, strict=True):
        assert res.request_id == req.request_id and len(res.token_ids) == 10
        assert torch.equal(
            torch.tensor(res.logprobs), trainer_log_probs(model, req.prompt_ids, res)
        )
    stats = engine.stats()
    assert stats.generated_tokens == 60 and stats.running == 0 and stats.tokens_per_s > 0


def test_stop_string_and_stop_token_are_kept_in_the_output(engine_and_model) -> None:  # type: ignore[no-untyped-def]
    engine, _ = engine_and_model
    free = engine.generate(request("free", prompts(1)[0], max_tokens=20))
    tail = ByteTokenizer().decode(free.token_ids[3:5])
    stopped = engine.generate(request("s", prompts(1)[0], max_tokens=20, stop_strings=(tail,)))
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[:5]
    by_id = engine.generate(
        request("t", prompts(1)[0], max_tokens=20, stop_token_ids=(free.token_ids[2],))
    )
    assert by_id.finish_reason == "stop" and by_id.token_ids[-1] == free.token_ids[2]


def test_bad_requests_fail_alone_and_the_others_are_served(engine_and_model) -> None:  # type: ignore[no-untyped-def]
    engine, _ = engine_and_model
    bad = {
        "empty": GenerationRequest("empty", "s", []),
        "long": GenerationRequest("long", "s", [1] * 96),
        "unknown": GenerationRequest("unknown", "s", [1, 64, 2]),
        "stop_id": GenerationRequest("stop_id", "s", [1], stop_token_ids=(64,)),
        "stop_text": GenerationRequest("stop_text", "s", [1], stop_strings=("",)),
        "seed": GenerationRequest("seed", "s", [1], seed=-1),
    }
    good = request("good", prompts(2)[1])
    futures = {rid: engine.submit(req) for rid, req in bad.items()}
    good_future = engine.submit(good)
    for rid, future in futures.items():
        res = future.result(timeout=30)
        assert res.finish_reason == "error" and res.error, rid
    assert "context budget" in futures["long"].result().error
    assert "prompt_ids[1]=64" in futures["unknown"].result().error
    assert good_future.result(timeout=30).finish_reason == "length"


def wait_until(condition: Callable[[], bool], timeout_s: float = 120.0) -> None:
    """Poll `condition`; a stalled engine fails the test instead of hanging the suite."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the engine made no progress"
        time.sleep(0.001)


def test_abort_returns_the_partial_result(engine_and_model) -> None:  # type: ignore[no-untyped-def]
    engine, _ = engine_and_model
    future = engine.submit(request("long", prompts(1)[0], max_tokens=80))
    wait_until(lambda: engine.stats().generated_tokens > 0)
    assert engine.abort("long")
    res = future.result(timeout=30)
    assert res.finish_reason == "abort" and len(res.token_ids) < 80
    assert not engine.abort("long")


def test_weight_update_keeps_requests_and_versions_tokens(engine_and_model) -> None:  # type: ignore[no-untyped-def]
    engine, model = engine_and_model
    _, new_model = tiny(seed=1)
    p = prompts(2)[1]
    future = engine.submit(request("w", p, max_tokens=60))
    wait_until(lambda: engine.stats().generated_tokens >= 3)
    engine.update_weights(new_model.state_dict(), version=1)
    res = future.result(timeout=60)
    assert res.finish_reason == "length" and len(res.token_ids) == 60
    assert res.versions[0] == 0 and res.versions[-1] == 1
    assert res.versions == sorted(res.versions)
    # tokens of version 1 are exactly the new weights' full forward over their context
    cut = res.versions.index(1)
    expected = trainer_log_probs(new_model, p, res)[cut:]
    assert torch.equal(torch.tensor(res.logprobs[cut:]), expected)
    assert engine.version == 1 and engine.stats().prefix_cache_entries >= 1


def test_close_aborts_in_flight_requests() -> None:
    cfg, model = tiny()
    engine = InferenceEngine(cfg, EngineConfig(max_context_tokens=2000), model.state_dict())
    future = engine.submit(request("x", prompts(1)[0], max_tokens=1500))
    wait_until(lambda: engine.stats().generated_tokens > 0)
    threading.Thread(target=engine.close).start()
    assert future.result(timeout=30).finish_reason == "abort"
