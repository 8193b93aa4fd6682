"""Ranks by magnitude, shared by the origins report (LayerNorm gains and biases) and the contribution rankings.

    rank_by_magnitude(torch.tensor([0.5, -3.0, 1.0]))     # tensor([3, 1, 2]): 1 = the largest |value|
"""

from __future__ import annotations

from torch import Tensor


def rank_by_magnitude(values: Tensor) -> Tensor:
    """rank[d] = 1 + the number of entries with a strictly larger |value| (1 = largest). values: [hidden]."""
    magnitude = values.abs()
    return (magnitude.unsqueeze(0) > magnitude.unsqueeze(1)).sum(1) + 1
