"""The base of every metric in metrics/: torchmetrics' `Metric`, with the shapes its `compute` gives kept.

    from metrics.base import Metric     # instead of torchmetrics.Metric
    token_sums(tokens)                  # [layers, tokens, hidden] -> [layers, hidden] float64, one layer at a time

torchmetrics squeezes every one-element tensor that a `compute` returns ([1] -> [], [1, 1] -> []). A per-layer result
of a callback watching one layer, or a per-head result of a one-head model, then lost its axis, and the code that reads
it layer by layer failed (`OutlierStatistics(layers=[2])` raised an IndexError at its first capture). Here `compute`
returns what the metric's own `compute` returns, shapes and all; the rest is torchmetrics' (states synchronised across
processes, the result cached and cloned). A 0-d result stays 0-d.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torchmetrics
from lightning_utilities import apply_to_collection
from torch import Tensor


class _Kept:
    """A one-element tensor carried past torchmetrics' squeeze (it maps tensors only)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor


# Both walk the result as torchmetrics' own squeeze does (lightning_utilities' apply_to_collection: dicts and their
# subclasses, lists, tuples, namedtuples, dataclasses), so every tensor it would squeeze is reached, and every
# container keeps its type.
def _hide(value: Any) -> Any:
    return apply_to_collection(value, Tensor,
                               lambda tensor: _Kept(tensor) if tensor.dim() > 0 and tensor.numel() == 1 else tensor)


def _show(value: Any) -> Any:
    return apply_to_collection(value, _Kept, lambda kept: kept.tensor.clone())  # cloned, as torchmetrics clones


class Metric(torchmetrics.Metric):
    """torchmetrics.Metric whose `compute` keeps the shapes it returns (module docstring)."""

    def _wrap_compute(self, compute: Callable) -> Callable:
        hidden = functools.wraps(compute)(lambda *args, **kwargs: _hide(compute(*args, **kwargs)))
        wrapped = super()._wrap_compute(hidden)

        @functools.wraps(compute)
        def shaped(*args: Any, **kwargs: Any) -> Any:
            return _show(wrapped(*args, **kwargs))

        return shaped

    def _apply(self, fn: Callable, exclude_state: Sequence[str] = "") -> torch.nn.Module:
        """torchmetrics moves a cached result with the states (`.to`, `set_dtype`): the kept ones too."""
        this = super()._apply(fn, exclude_state)
        if this._computed is not None:
            this._computed = apply_to_collection(this._computed, _Kept, lambda kept: _Kept(fn(kept.tensor)))
        return this


def token_sums(tokens: Tensor) -> Tensor:
    """[layers, tokens, hidden] -> [layers, hidden]: the float64 sum over the tokens, one layer at a time. torch's
    `sum(dtype=torch.float64)` first casts its whole input to float64 (a batch of 32 x 512 bert-base tokens: a 1 GB
    copy); layer by layer the copy is one layer's, and the sums are the same bits (the same order of addition)."""
    return torch.stack([layer.sum(0, dtype=torch.float64) for layer in tokens]) if len(tokens) else \
        tokens.new_zeros(tokens.shape[0], tokens.shape[-1], dtype=torch.float64)
