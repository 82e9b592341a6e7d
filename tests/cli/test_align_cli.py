"""`rlsys align` on the quickstart config: 0.0 for every TP degree; user errors exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from rlsys.cli.align_cmd import align
from rlsys.cli.errors import UserError

pytestmark = pytest.mark.unit

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


def test_quickstart_is_bitwise_aligned_at_every_tp_degree() -> None:
    result = CliRunner().invoke(align, [str(QUICKSTART), "--tp", "1,2,4,8", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert sorted(report["tp"]) == ["1", "2", "4", "8"]
    for row in report["tp"].values():
        assert row["max_abs_logprob_diff"] == 0.0
        assert row["num_tokens"] > 0 and row["prefix_cache_hit_tokens"] > 0


def test_bad_tp_list_and_bad_config_are_user_errors(tmp_path: Path) -> None:
    result = CliRunner().invoke(align, [str(QUICKSTART), "--tp", "1,3"])
    assert isinstance(result.exception, UserError) and "1,2,4,8" in str(result.exception)
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine:\n  max_running: 0\n")
    result = CliRunner().invoke(align, [str(bad)])
    assert isinstance(result.exception, UserError)
    assert "engine.max_running" in str(result.exception)


def test_align_refuses_the_vllm_backend_it_does_not_check() -> None:
    result = CliRunner().invoke(align, [str(QUICKSTART.parent / "vllm-tiny.yaml")])
    assert isinstance(result.exception, UserError)
    assert "engine.backend 'vllm'" in str(result.exception)


def test_align_recomputes_through_the_trainers_configured_path(tmp_path: Path) -> None:
    """The trainer side is the job's trainer: with candidate-set replay turned off it
    normalises over the whole vocabulary, not the engine's candidate set, and align says so
    (a bare model forward would still report 0.0)."""
    import yaml

    data = yaml.safe_load(QUICKSTART.read_text())
    data["trainer"]["replay_candidates"] = False
    config = tmp_path / "no-candidate-replay.yaml"
    config.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(align, [str(config), "--tp", "1", "--json"])
    assert result.exit_code == 1, result.output
    row = json.loads(result.output.splitlines()[0])["tp"]["1"]
    assert row["max_abs_logprob_diff"] > 0.0 and row["num_tokens"] > 0
