"""The policy-model interface the trainer sees, and the registry that builds one.

`PolicyModel` is what `rlsys.trainer` calls: our Sparse GQA `Transformer` and `HFPolicy`
(a Hugging Face causal LM) both implement it, so nothing in the trainer branches on the
model's kind. `build_policy` picks the implementation by `model.kind` (a registry).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from torch import Tensor, nn

from rlsys.config.job import ModelSection
from rlsys.model.attention import SeqSpan
from rlsys.model.aux import AuxLosses
from rlsys.model.routing import Routing


class PolicyModel(Protocol):
    cfg: Any  # has vocab_size and d_model
    mtp: nn.ModuleList  # multi-token-prediction heads (may be empty)
    training: bool

    def hidden_packed(
        self,
        tokens: Tensor,
        spans: list[SeqSpan],
        routing: Routing | None = None,
        aux: AuxLosses | None = None,
    ) -> Tensor: ...

    def head_logits(self, h: Tensor) -> Tensor: ...

    def engine_state_dict(self) -> dict[str, Tensor]: ...

    def set_activation_checkpointing(self, on: bool) -> None: ...

    def set_trunk_graphs(self, on: bool) -> None: ...

    def update_balance(self) -> None: ...

    def grad_clamp_clipped(self) -> Tensor: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]: ...

    def load_state_dict(
        self, state_dict: Any, strict: bool = True, assign: bool = False
    ) -> Any: ...

    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...


def _native(section: ModelSection) -> nn.Module:
    from rlsys.model.transformer import Transformer

    return Transformer(section.resolve())


def _hf(section: ModelSection) -> nn.Module:
    from rlsys.model.hf_policy import HFPolicy

    assert section.path is not None  # ModelSection: kind hf needs a path
    return HFPolicy.from_pretrained(section.path)


POLICY_MODELS: dict[str, Callable[[ModelSection], nn.Module]] = {"native": _native, "hf": _hf}


def build_policy(section: ModelSection) -> nn.Module:
    """The trainer's policy model for `model` (fresh init, or the directory's weights)."""
    return POLICY_MODELS[section.kind](section)
