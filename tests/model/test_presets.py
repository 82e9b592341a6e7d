"""Presets, parameter counts on the meta device, and `rlsys model info`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from rlsys.cli.model_cmd import model as model_cli
from rlsys.config.model import PRESETS, preset
from rlsys.model import Transformer

pytestmark = pytest.mark.unit


def test_deep92_builds_on_the_meta_device_with_the_3_to_1_pattern() -> None:
    cfg = preset("deep-92")
    with torch.device("meta"):
        net = Transformer(cfg)
    kinds = [b.kind for b in net.blocks]
    assert len(kinds) == 92
    assert kinds[:8] == ["swa", "swa", "swa", "sparse"] * 2
    assert kinds.count("swa") == 3 * kinds.count("sparse")
    assert net.num_parameters(active=True) < net.num_parameters() / 4


def test_small_stays_a_few_million_parameters() -> None:
    net = Transformer(preset("small"))
    assert 1_000_000 < net.num_parameters() < 6_000_000


def test_model_info_json_reports_layers_pattern_params_and_bytes() -> None:
    result = CliRunner().invoke(model_cli, ["info", "deep-92", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["layers"] == 92
    assert report["attention_pattern"].count("sparse") == 23
    assert report["total_parameters"] > report["active_parameters"] > 0
    assert report["kv_cache_bytes_per_token"] > 0
    # 92 MoE layers x 6 experts x (1 byte id + 4 byte gate)
    assert report["routing_record_bytes_per_token"] == 92 * 6 * 5
    # 23 Sparse GQA layers x 4 KV groups x 512 blocks (k 4096 / B 8) x int16
    assert report["selection_record_bytes_per_token"] == 23 * 4 * 512 * 2


def test_model_info_applies_overrides_and_rejects_bad_ones() -> None:
    ok = CliRunner().invoke(model_cli, ["info", "small", "--set", "n_layers=12", "--json"])
    assert json.loads(ok.output)["layers"] == 12
    for args in (
        ["info", "small", "--set", "n_heads=3"],
        ["info", "nope"],
        ["info", "small", "--set", "colour=red"],
        ["info", "small", "--set", "x"],
    ):
        result = CliRunner().invoke(model_cli, args)
        assert result.exit_code != 0
        assert type(result.exception).__name__ == "UserError", args


def test_presets_validate_and_config_imports_without_torch() -> None:
    assert set(PRESETS) == {"tiny", "small", "medium", "large", "deep-92"}
    large = preset("large")  # the GPU job's preset: >= 48 blocks, 3:1 SWA : Sparse GQA, MoE
    assert large.n_layers >= 48 and large.swa_per_sparse == 3 and large.n_experts > 1
    code = "import sys, rlsys.config.model, rlsys.cli.model_cmd; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_model_and_kernels_import_no_service_clients() -> None:
    code = (
        "import sys, rlsys.model, rlsys.kernels\n"
        "print(sorted(m for m in ('ray', 'redis', 'sqlalchemy', 'triton') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
