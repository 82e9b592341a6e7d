"""`HFPolicy`: a Hugging Face causal LM behind the trainer's policy-model interface.

The trainer calls what our `Transformer` offers (`rlsys.model.policy.PolicyModel`):
`hidden_packed` (packed segments, each from position 0 -> fp32 final hidden rows),
`head_logits` (rows -> logits), the bookkeeping hooks, and `cfg.vocab_size` /
`cfg.d_model`. So the same objectives, TIS, candidate-set replay, zero-center projection,
chunked LM head and checkpoints run unchanged on a Hugging Face model.

Invariants:
- parameter names are the Hugging Face module's (`model.*`, `lm_head.weight`), so a
  checkpoint is the module's state dict; `engine_state_dict` is the same weights in the
  *serialised* layout (what `save_pretrained` writes and vLLM's `reload_weights` takes:
  transformers 5 fuses a MoE's experts in memory and splits them again on save);
- `hidden_packed` returns the trunk's output *after* its final norm (Hugging Face models
  apply it inside the trunk), so `head_logits` is the LM head alone;
- routed-expert replay (R3) goes through a hook on each MoE router (`hf_routing.py`); the
  routes must come from elsewhere: vLLM on CPU records none, so there a MoE model is
  routed by the trainer's own router.

`transformers` is imported lazily: the default install does not need it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from rlsys.model.attention import SeqSpan
from rlsys.model.aux import AuxLosses
from rlsys.model.hf_routing import replay_routes
from rlsys.model.routing import Routing, RoutingReplay


@dataclass(frozen=True)
class PolicyDims:
    """The dimensions the trainer reads from `model.cfg`."""

    vocab_size: int
    d_model: int


class HFPolicy(nn.Module):
    def __init__(self, causal_lm: Any) -> None:
        super().__init__()
        # registered under the Hugging Face names (see module doc)
        self.model = causal_lm.model
        self.lm_head = causal_lm.lm_head
        self.hf_config = causal_lm.config
        self._hf = [causal_lm]  # the whole model, unregistered: its weight-layout mapping
        self.cfg = PolicyDims(causal_lm.config.vocab_size, causal_lm.config.hidden_size)
        self.mtp = nn.ModuleList()  # no multi-token-prediction heads

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32) -> HFPolicy:
        from transformers import AutoModelForCausalLM

        return cls(AutoModelForCausalLM.from_pretrained(path, dtype=dtype))

    def hidden_packed(
        self,
        tokens: Tensor,
        spans: list[SeqSpan],
        routing: Routing | None = None,
        aux: AuxLosses | None = None,
    ) -> Tensor:
        """Packed varlen forward (each span from position 0) -> fp32 hidden rows (N, d).

        One trunk call per span: exact causal attention within each sequence, no padding.
        `routing`: a `RoutingReplay` of the packed rows (R3, `hf_routing.py`), or None."""
        assert routing is None or isinstance(routing, RoutingReplay), "replay only"
        rows = []
        with replay_routes(self.model, routing) as span:
            for s in spans:
                assert s.pos == 0, "a packed training sequence starts at 0"
                span.row, span.n = s.row, s.n
                ids = tokens[s.row : s.row + s.n].unsqueeze(0)
                positions = torch.arange(s.n, device=tokens.device).unsqueeze(0)
                out = self.model(input_ids=ids, position_ids=positions, use_cache=False)
                rows.append(out.last_hidden_state[0])
        return torch.cat(rows).float()

    def head_logits(self, h: Tensor) -> Tensor:
        """LM head in the model's dtype: hidden rows (..., d) -> (..., V)."""
        return self.lm_head(h.to(self.lm_head.weight.dtype))

    def logits(self, h: Tensor) -> Tensor:
        return self.head_logits(h).float()

    def engine_state_dict(self) -> dict[str, Tensor]:
        """The weights under their serialised names and layout (what an engine loads)."""
        from transformers.core_model_loading import revert_weight_conversion

        state = {k: v.detach() for k, v in self._hf[0].state_dict().items()}
        return revert_weight_conversion(self._hf[0], state)

    def set_trunk_graphs(self, on: bool) -> None:
        """The graphed trunk (`trainer.cuda_graphs`) is rlsys's own model's: refused here."""
        if on:
            raise ValueError(
                "trainer.cuda_graphs needs rlsys's own policy model, not a Hugging Face "
                "one: turn trainer.cuda_graphs off"
            )

    def set_activation_checkpointing(self, on: bool) -> None:
        """Transformers' own gradient checkpointing of its decoder layers."""
        causal_lm = self._hf[0]
        if on:
            causal_lm.gradient_checkpointing_enable({"use_reentrant": False})
        elif causal_lm.is_gradient_checkpointing:
            causal_lm.gradient_checkpointing_disable()

    def update_balance(self) -> None:
        """No bias-based balancing: a Hugging Face MoE balances through its own losses."""

    def grad_clamp_clipped(self) -> Tensor:
        """Always 0: no fine-grained gradient clamp on Hugging Face models."""
        return torch.zeros((), dtype=torch.int64, device=next(self.parameters()).device)

    def save_pretrained(self, path: str) -> None:
        """Write the current weights as a Hugging Face model directory (vLLM loads it)."""
        self._hf[0].save_pretrained(path)
