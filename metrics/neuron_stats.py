"""Streaming per-layer, per-dimension statistics of hidden states: the numbers outlier detection reads.

    stats = NeuronStatistics(num_layers=13, hidden_size=768)
    stats.update(hidden_states, mask)      # hidden_states [layers, batch, seq, hidden], mask [batch, seq]
    result = stats.compute()               # NeuronStatisticsResult: mean, var, max_abs, argmax/argmin counts

Every state is a fixed-size tensor reduced by sum or max, so memory does not grow with the number of tokens and
the result is exact under DDP (torchmetrics syncs the states before `compute`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torchmetrics import Metric


@dataclass
class NeuronStatisticsResult:
    num_tokens: int
    mean: Tensor  # [layers, hidden]
    var: Tensor  # [layers, hidden], population variance over tokens
    max_abs: Tensor  # [layers, hidden]
    argmax_count: Tensor  # [layers, hidden]: tokens whose largest value lies on the dimension
    argmin_count: Tensor  # [layers, hidden]: tokens whose smallest value lies on the dimension

    @property
    def argmax_share(self) -> Tensor:  # [layers, hidden], fractions of counted tokens
        return self.argmax_count.double() / max(self.num_tokens, 1)

    @property
    def argmin_share(self) -> Tensor:
        return self.argmin_count.double() / max(self.num_tokens, 1)


class NeuronStatistics(Metric):
    """Mean, variance, max |value| and argmax/argmin counts per layer and dimension, over unmasked tokens."""

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    def __init__(self, num_layers: int, hidden_size: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        shape = (num_layers, hidden_size)
        self.add_state("count", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("sum", torch.zeros(shape, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("sum_sq", torch.zeros(shape, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("max_abs", torch.zeros(shape, dtype=torch.float64), dist_reduce_fx="max")
        self.add_state("argmax_count", torch.zeros(shape, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("argmin_count", torch.zeros(shape, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, hidden_states: Tensor, mask: Tensor | None = None) -> None:
        """hidden_states [layers, batch, seq, hidden] (or [layers, tokens, hidden]); mask [batch, seq] bool."""
        if hidden_states.dim() == 4:
            tokens = hidden_states[:, mask.bool()] if mask is not None else hidden_states.flatten(1, 2)
        elif hidden_states.dim() == 3:
            tokens = hidden_states
        else:
            raise ValueError(f"expected [layers, batch, seq, hidden] or [layers, tokens, hidden], got {tuple(hidden_states.shape)}")
        if tokens.shape[0] != self.num_layers or tokens.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden states {tuple(tokens.shape)} do not match {self.num_layers} layers × {self.hidden_size} dims"
            )
        if tokens.shape[1] == 0:
            return
        tokens = tokens.float()  # [layers, tokens, hidden]; at most two token-sized temporaries below
        n = tokens.shape[1]
        batch_sum = tokens.sum(1, dtype=torch.float64)  # [layers, hidden]
        self.max_abs = torch.maximum(self.max_abs, torch.maximum(tokens.amax(1), -tokens.amin(1)).double())
        ones = torch.ones(tokens.shape[:2], dtype=torch.long, device=tokens.device)
        self.argmax_count.scatter_add_(1, tokens.argmax(-1), ones)
        self.argmin_count.scatter_add_(1, tokens.argmin(-1), ones)
        # Squares are summed around the batch mean (accurate in float32 even where the mean dwarfs the spread, as
        # an outlier's does), then shifted back exactly in float64: sum x² = M2 + (sum x)² / n.
        centred = tokens - (batch_sum / n).float().unsqueeze(1)
        batch_m2 = centred.pow_(2).sum(1, dtype=torch.float64)
        self.count += n
        self.sum += batch_sum
        self.sum_sq += batch_m2 + batch_sum.pow(2) / n

    def compute(self) -> NeuronStatisticsResult:
        count = self.count.clamp_min(1)
        mean = self.sum / count
        var = (self.sum_sq / count - mean.pow(2)).clamp_min(0)
        return NeuronStatisticsResult(
            num_tokens=int(self.count.item()),
            mean=mean,
            var=var,
            max_abs=self.max_abs.clone(),
            argmax_count=self.argmax_count.clone(),
            argmin_count=self.argmin_count.clone(),
        )
