"""Tiny Hugging Face models for the vLLM-backend tests, built once per session (random
weights, `save_pretrained` to a temp dir: nothing is downloaded). Tests that need them skip
with the reason when `transformers` (or `vllm`) is not installed: CI's default venv has
neither; the rlsys[vllm] extra brings both."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

# CI's vLLM suite sets RLSYS_REQUIRE_VLLM=1: there a missing package fails the tests
# instead of skipping them, so that suite never passes by skipping the real thing.
REQUIRED = os.environ.get("RLSYS_REQUIRE_VLLM") == "1"
HAS_TRANSFORMERS = REQUIRED or importlib.util.find_spec("transformers") is not None
HAS_VLLM = REQUIRED or importlib.util.find_spec("vllm") is not None

needs_transformers = pytest.mark.skipif(
    not HAS_TRANSFORMERS, reason="transformers is not installed (the rlsys[vllm] extra)"
)
needs_vllm = pytest.mark.skipif(
    not HAS_VLLM, reason="vllm is not installed (the rlsys[vllm] extra; README 'vLLM backend')"
)


@pytest.fixture(scope="session")
def hf_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """kind -> directory of a tiny random model: `qwen3` (dense) and `qwen3_moe`."""
    from rlsys.model.hf_tiny import TINY_MODELS, build_tiny

    root = tmp_path_factory.mktemp("hf-models")
    return {kind: build_tiny(root / kind, kind) for kind in sorted(TINY_MODELS)}
