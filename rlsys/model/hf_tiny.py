"""Tiny Hugging Face models with random weights, built locally (nothing is downloaded).

`python -m rlsys.model.hf_tiny DIR [--kind qwen3|qwen3_moe]` writes a Qwen3-style dense or
Qwen3-MoE-style model of ~1-2M parameters to DIR with `save_pretrained` (no tokenizer: the
jobs run on the byte tokenizer's ids, so the vocabulary is `rlsys.tokenizer.VOCAB_SIZE`).
This is what `configs/vllm-tiny.yaml` (`model.make_tiny`: `rlsys run` makes it on first
use), the vLLM tests and the benchmark load.
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlsys.tokenizer import VOCAB_SIZE

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "eos_token_id": None,
}


def _qwen3(**overrides: Any) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**{"intermediate_size": 384, **_COMMON, **overrides})


def _qwen3_moe(**overrides: Any) -> Any:
    from transformers import Qwen3MoeConfig

    moe = {
        "intermediate_size": 384,
        "moe_intermediate_size": 128,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "norm_topk_prob": True,
    }
    return Qwen3MoeConfig(**{**moe, **_COMMON, **overrides})


TINY_MODELS: dict[str, Callable[..., Any]] = {"qwen3": _qwen3, "qwen3_moe": _qwen3_moe}


def build_tiny(path: str | Path, kind: str = "qwen3", seed: int = 0, **overrides: Any) -> Path:
    """Write a random tiny `kind` model to `path` (fp32 safetensors); returns the path.
    `overrides` set config fields (e.g. `num_hidden_layers=8`)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = TINY_MODELS[kind](**overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(path))
    return Path(path)


def ensure_tiny(path: str | Path, kind: str) -> bool:
    """Make the tiny `kind` model at `path` unless a directory is there; True if made.

    Written beside `path` and renamed into place, so an interrupted build never leaves a
    directory that a later run would take for a model."""
    target = Path(path)
    if target.exists():
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.{os.getpid()}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    build_tiny(staging, kind)
    try:
        staging.rename(target)
    except OSError:  # another run made it meanwhile: keep theirs
        shutil.rmtree(staging, ignore_errors=True)
        if not target.is_dir():
            raise
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--kind", choices=sorted(TINY_MODELS), default="qwen3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    print(build_tiny(args.path, args.kind, args.seed, num_hidden_layers=args.layers))


if __name__ == "__main__":
    main()
