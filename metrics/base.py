"""The base of every metric in metrics/: torchmetrics' `Metric`, with the shapes its `compute` gives kept.

    from metrics.base import Metric     # instead of torchmetrics.Metric

torchmetrics squeezes every one-element tensor that a `compute` returns ([1] -> [], [1, 1] -> []). A per-layer result
of a callback watching one layer, or a per-head result of a one-head model, then lost its axis, and the code that reads
it layer by layer failed (`OutlierStatistics(layers=[2])` raised an IndexError at its first capture). Here `compute`
returns what the metric's own `compute` returns, shapes and all; the rest is torchmetrics' (states synchronised across
processes, the result cached and cloned). A 0-d result stays 0-d.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torchmetrics
from torch import Tensor


class _Kept:
    """A one-element tensor carried past torchmetrics' squeeze (it maps tensors only)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor


def _map(value: Any, kind: type, fn: Callable) -> Any:
    """`fn` applied to every `kind` inside nested dicts, lists, tuples and dataclasses (what the metrics here return,
    and where torchmetrics looks)."""
    if isinstance(value, kind):
        return fn(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        mapped = copy.copy(value)
        for field in dataclasses.fields(value):
            setattr(mapped, field.name, _map(getattr(value, field.name), kind, fn))
        return mapped
    if isinstance(value, dict):
        return {key: _map(item, kind, fn) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map(item, kind, fn) for item in value)
    return value


def _hide(value: Any) -> Any:
    return _map(value, Tensor, lambda tensor: _Kept(tensor) if tensor.dim() > 0 and tensor.numel() == 1 else tensor)


def _show(value: Any) -> Any:
    return _map(value, _Kept, lambda kept: kept.tensor.clone())  # cloned, as torchmetrics clones the others


class Metric(torchmetrics.Metric):
    """torchmetrics.Metric whose `compute` keeps the shapes it returns (module docstring)."""

    def _wrap_compute(self, compute: Callable) -> Callable:
        wrapped = super()._wrap_compute(functools.wraps(compute)(lambda *args, **kwargs: _hide(compute(*args, **kwargs))))

        @functools.wraps(compute)
        def shaped(*args: Any, **kwargs: Any) -> Any:
            return _show(wrapped(*args, **kwargs))

        return shaped
