"""KL penalty to a reference policy, per token (the k3 estimator: unbiased, non-negative).

k3 = exp(ref - logp) - (ref - logp) - 1
"""

from __future__ import annotations

import torch
from torch import Tensor


def kl_k3(logp_BT: Tensor, ref_BT: Tensor) -> Tensor:
    delta = ref_BT - logp_BT
    return torch.exp(delta) - delta - 1.0
