"""An optional learnable critic: a token-level baseline for the policy gradient.

A small MLP reads the policy's hidden state at the row that predicts a policy token
(detached: the critic never moves the policy) and regresses that token's return (the
outcome reward plus the penalty of the token's turn). It has its own optimiser.

Invariant: the critic's baseline is used for advantages only once it has taken
`warmup_updates` updates (a pre-training phase on collected trajectories, and/or the first
trainer steps, during which the group-relative baseline is used); before that an untrained
critic would only add noise to the advantages.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from rlsys.config.algo import CriticConfig


class Critic(nn.Module):
    def __init__(self, d_model: int, cfg: CriticConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.net = nn.Sequential(
            nn.LayerNorm(d_model),
            nn.Linear(d_model, cfg.hidden),
            nn.GELU(),
            nn.Linear(cfg.hidden, 1),
        )
        self.optimizer = torch.optim.AdamW(self.parameters(), lr=cfg.lr, weight_decay=0.0)
        self.register_buffer("updates", torch.zeros((), dtype=torch.int64))
        # a host mirror of `updates` (checkpointed as the buffer): reading the buffer each
        # step would wait for the device; None until read once after a load
        self._updates_seen: int | None = 0

    @property
    def ready(self) -> bool:
        """Whether its baseline is used (pre-training phase over)."""
        if self._updates_seen is None:
            self._updates_seen = int(self.updates)
        return self._updates_seen >= self.cfg.warmup_updates

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        self._updates_seen = None  # the loaded count is read at the next `ready`
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def forward(self, h_Pd: Tensor) -> Tensor:
        """Values (P,) of the detached fp32 hidden rows."""
        return self.net(h_Pd.detach().float()).squeeze(-1)

    def loss(self, h_Pd: Tensor, returns_P: Tensor, weights_P: Tensor) -> tuple[Tensor, Tensor]:
        """(weighted squared error, values): call `.backward()` on the first per micro-batch."""
        values = self(h_Pd)
        return ((values - returns_P) ** 2 * weights_P).sum(), values.detach()

    def update(self) -> None:
        """One optimiser step on the gradients accumulated since the last update."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.updates += 1
        if self._updates_seen is not None:
            self._updates_seen += 1
