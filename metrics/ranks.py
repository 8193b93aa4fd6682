"""Ranks by magnitude, shared by the origins report (LayerNorm gains and biases) and the contribution rankings.

    rank_by_magnitude(torch.tensor([0.5, -3.0, 1.0]))     # tensor([3, 1, 2]): 1 = the largest |value|
    ties_by_magnitude(torch.tensor([1.0, -1.0, 0.5]))     # tensor([1, 1, 0]): other entries of the same |value|

A dimension of rank r with t ties shares ranks r..r+t with them (all-ones LayerNorm gains: rank 1, hidden - 1 ties):
it is strictly among the top k only when r + t <= k (`strictly_top`); `ranked(1, 383)` says so in words.

Both counts come from one sort of the magnitudes (O(hidden log hidden): a 4096-wide model's per-layer rankings, taken
at every live capture, are no [hidden, hidden] comparison). A NaN is neither larger than nor equal to anything, as
under `>` and `==`: its rank is 1 and its ties -1, and it moves no other entry's counts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from core.wording import plural


def ranks_and_ties(values: Tensor) -> tuple[Tensor, Tensor]:
    """(rank [hidden], ties [hidden]) of values [hidden] by magnitude: rank[d] = 1 + the number of entries with a
    strictly larger |value| (1 = largest), ties[d] = the number of other entries with exactly the same |value|."""
    magnitude = values.abs()
    nan = torch.isnan(magnitude)
    ordered = torch.sort(magnitude[~nan]).values  # ascending, NaN left out
    at_most = torch.searchsorted(ordered, magnitude, right=True)  # entries <= |value| (NaN's row: replaced below)
    below = torch.searchsorted(ordered, magnitude)  # entries < |value|
    rank = torch.where(nan, 1, ordered.numel() - at_most + 1)
    return rank, torch.where(nan, -1, at_most - below - 1)


def rank_by_magnitude(values: Tensor) -> Tensor:
    """rank[d] = 1 + the number of entries with a strictly larger |value| (1 = largest). values: [hidden]."""
    return ranks_and_ties(values)[0]


def ties_by_magnitude(values: Tensor) -> Tensor:
    """ties[d] = the number of other entries with exactly the same |value|. values: [hidden]."""
    return ranks_and_ties(values)[1]


def strictly_top(rank: int, ties: int, k: int) -> bool:
    """Whether a dimension of `rank` (1 + the entries strictly larger) with `ties` equal ones is among the top `k`
    whichever way its ties are broken."""
    return rank + ties <= k


def ranked(rank: int, ties: int) -> str:
    """'rank 2', or 'rank 1, tied with 383 other dims' (ranks 1-384 shared)."""
    return f"rank {rank}" + (f", tied with {plural(ties, 'other dim')}" if ties else "")
