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

    @property
    def ready(self) -> bool:
        """Whether its baseline is used (pre-training phase over)."""
        return int(self.updates) >= self.cfg.warmup_updates

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
