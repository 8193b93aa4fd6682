"""Pair scores for WiC and STS: per-pair cosines gathered across ranks, Spearman correlation, threshold accuracy.

    scores = PairCosine(num_pairs=1379, num_layers=13)
    scores.update(pair_ids, a, b)                 # pair_ids [k], a, b [layers, k, hidden]
    cosines, seen = scores.compute()              # [pairs, layers], [pairs] bool (every rank holds all pairs)
    spearman(cosines[seen], gold[seen])           # [layers], Spearman rho per layer (ties get average ranks)
    threshold_accuracy(cosines, labels, torch.arange(1, 10) / 10)   # [layers, thresholds]

The pairs are known in advance, so PairCosine keeps one slot per pair and layer; the rank that scores a pair
writes its slot and the sum reduction assembles the full matrix on every rank under DDP. Its size is the
protocol's own output (pairs x layers), independent of sentence length and batch size.
"""

from __future__ import annotations

import torch
from torch import Tensor

from metrics.base import Metric
from metrics.geometry import cosine


class PairCosine(Metric):
    """Cosine of the two vectors of each pair, per layer, in a [pairs, layers] state reduced by sum."""

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    def __init__(self, num_pairs: int, num_layers: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_pairs, self.num_layers = num_pairs, num_layers
        self.add_state("cosines", torch.zeros(num_pairs, num_layers, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("seen", torch.zeros(num_pairs, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, pair_ids: Tensor, a: Tensor, b: Tensor) -> None:
        """pair_ids [k] (each pair scored once, on one rank); a, b [layers, k, hidden]."""
        if a.shape != b.shape or a.dim() != 3 or a.shape[0] != self.num_layers or a.shape[1] != pair_ids.numel():
            raise ValueError(f"a {tuple(a.shape)}, b {tuple(b.shape)} are not [{self.num_layers}, "
                             f"{pair_ids.numel()}, hidden]")
        pair_ids = pair_ids.to(self.seen.device).long()
        self.cosines[pair_ids] = cosine(a, b).transpose(0, 1).double()
        self.seen[pair_ids] = 1.0

    def compute(self) -> tuple[Tensor, Tensor]:
        """(cosines [pairs, layers], seen [pairs] bool)."""
        return self.cosines, self.seen > 0


def average_ranks(values: Tensor) -> Tensor:
    """Ranks 1..n along dim 0 of [n] or [n, k], ties sharing the average of their ranks (as scipy.stats.rankdata)."""
    squeeze = values.dim() == 1
    values = values.double().reshape(values.shape[0], -1)
    ranks = torch.empty_like(values)
    for column in range(values.shape[1]):
        sorted_values, order = torch.sort(values[:, column], stable=True)
        _, counts = torch.unique_consecutive(sorted_values, return_counts=True)
        ends = counts.cumsum(0).double()
        average = ends - (counts.double() - 1) / 2  # mean of the 1-based ranks start..end of each tie group
        ranks[order, column] = torch.repeat_interleave(average, counts)
    return ranks.squeeze(1) if squeeze else ranks


def pearson(x: Tensor, y: Tensor) -> Tensor:
    """Pearson r between each column of x [n, k] (or [n]) and y [n]; nan where a column is constant."""
    x, y = x.double(), y.double()
    squeeze = x.dim() == 1
    x = x.reshape(x.shape[0], -1) - x.reshape(x.shape[0], -1).mean(0)
    y = (y - y.mean()).unsqueeze(1)
    denominator = (x.pow(2).sum(0) * y.pow(2).sum(0)).sqrt()
    r = torch.where(denominator > 0, (x * y).sum(0) / denominator.clamp_min(1e-300),
                    torch.full_like(denominator, float("nan")))
    return r[0] if squeeze else r


def spearman(x: Tensor, y: Tensor) -> Tensor:
    """Spearman rho (Pearson r of average ranks) of each column of x [n, k] (or [n]) against y [n]."""
    return pearson(average_ranks(x), average_ranks(y))


def threshold_accuracy(cosines: Tensor, labels: Tensor, thresholds: Tensor) -> Tensor:
    """Accuracy of "same sense iff cosine >= threshold": cosines [pairs, layers], labels [pairs] bool,
    thresholds [T] -> [layers, T]."""
    predicted = cosines.unsqueeze(-1) >= thresholds.to(cosines)  # [pairs, layers, T]
    return (predicted == labels.bool().view(-1, 1, 1)).double().mean(0)
