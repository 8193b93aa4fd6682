"""Contribution vectors of linear position probes, and per-layer probe accuracy: sum-state torchmetrics Metrics.

    contributions = Contributions(num_layers=13, hidden_size=768, num_positions=300)
    contributions.update(features, weight, positions)   # features [layers, tokens, hidden],
                                                        # weight [layers, hidden, positions], positions [tokens]
    result = contributions.compute()                    # .mean [layers, hidden], .by_position [layers, positions, hidden]
    ranking = rank_dims(result.mean[layer], dims=[5, 17])   # rank (1 = largest), ties and contribution of chosen dims

The contribution of neuron i to a token's prediction is c(i) = |w_i * v_i|, with v the token's hidden vector and w the
probe's weight row for the token's gold position (Luo et al. 2021, §3). `mean` averages c over all tokens,
`by_position` over the tokens of each position. Every state is a fixed-size tensor reduced by sum, so the result is
exact under DDP and memory does not grow with the number of tokens. Used by the position probe (probe.py) and by the
online probe callback during pretraining; nothing here knows about either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from metrics.base import Metric
from metrics.ranks import ranks_and_ties


@dataclass
class ContributionResult:
    num_tokens: int
    mean: Tensor  # [layers, hidden]: mean contribution over all tokens
    by_position: Tensor  # [layers, positions, hidden]: mean over the tokens of each position (0 where none)
    position_counts: Tensor  # [positions]: tokens seen at each position


class Contributions(Metric):
    """Mean contribution vector c(i) = |w_gold,i * v_i| per layer, overall and per gold position."""

    full_state_update = False
    is_differentiable = False
    higher_is_better = None
    chunk = 1024  # tokens per step of the update loop

    def __init__(self, num_layers: int, hidden_size: int, num_positions: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_layers, self.hidden_size, self.num_positions = num_layers, hidden_size, num_positions
        self.add_state("position_counts", torch.zeros(num_positions, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("sum", torch.zeros(num_layers, hidden_size, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("sum_by_position", torch.zeros(num_layers, num_positions, hidden_size, dtype=torch.float64),
                       dist_reduce_fx="sum")

    def update(self, features: Tensor, weight: Tensor, positions: Tensor) -> None:
        """features [layers, tokens, hidden], weight [layers, hidden, positions], positions [tokens] (gold labels).

        Tokens whose position lies outside 0..num_positions-1 are skipped.
        """
        if features.dim() != 3 or features.shape[0] != self.num_layers or features.shape[2] != self.hidden_size:
            raise ValueError(f"features {tuple(features.shape)} are not [{self.num_layers}, tokens, {self.hidden_size}]")
        if weight.shape != (self.num_layers, self.hidden_size, self.num_positions):
            raise ValueError(f"weight {tuple(weight.shape)} is not "
                             f"[{self.num_layers}, {self.hidden_size}, {self.num_positions}]")
        keep = (positions >= 0) & (positions < self.num_positions)
        if not bool(keep.all()):
            features, positions = features[:, keep], positions[keep]
        if positions.numel() == 0:
            return
        self.position_counts += torch.bincount(positions, minlength=self.num_positions).double()
        rows = weight.detach().float().transpose(1, 2).contiguous()  # [layers, positions, hidden]: a position's row
        for start in range(0, positions.numel(), self.chunk):  # bounded memory: [layers, chunk, hidden] at a time
            chunk = positions[start:start + self.chunk]
            gold = rows.index_select(1, chunk)  # [layers, chunk, hidden]
            contribution = (gold * features[:, start:start + self.chunk].detach().float()).abs()
            # summed over the tokens from a [layers, hidden, chunk] copy: the order, so the float64 rounding, of the sum
            # this took when it gathered the gold weights along their last dim (4x the time in all): the same bits
            self.sum += contribution.transpose(1, 2).contiguous().sum(2, dtype=torch.float64)
            self.sum_by_position.index_add_(1, chunk, contribution.double())

    def compute(self) -> ContributionResult:
        counts = self.position_counts
        total = counts.sum()
        return ContributionResult(
            num_tokens=int(total.item()),
            mean=self.sum / total.clamp_min(1),
            by_position=self.sum_by_position / counts.clamp_min(1)[None, :, None],
            position_counts=counts.clone(),
        )


class LayerAccuracy(Metric):
    """Accuracy of stacked probes, one per layer (or feature slot): correct and total counts, reduced by sum."""

    full_state_update = False
    is_differentiable = False
    higher_is_better = True

    def __init__(self, num_layers: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_layers = num_layers
        self.add_state("correct", torch.zeros(num_layers, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, logits: Tensor, target: Tensor) -> None:
        """logits [layers, items, classes], target [items] (every layer's) or [layers, items] (each layer's own)."""
        items = target.shape[-1]
        if logits.dim() != 3 or logits.shape[0] != self.num_layers or logits.shape[1] != items or (
                target.dim() == 2 and target.shape[0] != self.num_layers):
            raise ValueError(f"logits {tuple(logits.shape)} do not match [{self.num_layers}, {items}, classes] "
                             f"for targets {tuple(target.shape)}")
        self.correct += (logits.argmax(-1) == (target if target.dim() == 2 else target.unsqueeze(0))).sum(1).double()
        self.total += items

    def compute(self) -> Tensor:  # [layers]
        return self.correct / self.total.clamp_min(1)


def rank_dims(contribution: Tensor, dims: Sequence[int] = (), top_k: int = 10) -> dict:
    """Rank the neurons of one layer's contribution vector [hidden] as metrics.ranks does: rank = 1 + the number of
    strictly larger contributions (1 = largest), ties = the number of other neurons of exactly the same contribution (a
    neuron of rank r with t ties shares ranks r..r+t with them: all-zero contributions of an untrained probe are rank 1,
    hidden - 1 ties).

    Returns {"top_dims": the top_k dims, largest first (ties broken by the lower index: a listed dim with ties is one
    pick among them), "top_ranks", "top_ties": theirs, "mean_contribution": mean over all neurons,
    "dims": {dim: {"rank", "ties", "contribution", "mean_contribution"}}} for the chosen `dims`.
    """
    contribution = contribution.detach().double().cpu()
    order = torch.argsort(contribution, descending=True, stable=True)[:top_k]
    ranks, ties = ranks_and_ties(contribution)  # c(i) >= 0: |c| is c
    mean = float(contribution.mean())
    return {
        "top_dims": order.tolist(),
        "top_ranks": ranks[order].tolist(),
        "top_ties": ties[order].tolist(),
        "mean_contribution": mean,
        "dims": {int(d): {"rank": int(ranks[d]), "ties": int(ties[d]), "contribution": float(contribution[d]),
                          "mean_contribution": mean} for d in dims},
    }
