"""One number per model from per-layer statistics: the reductions the live W&B summary panels and `analyze.py
trajectory --runs` share (ours: the paper reports per layer only).

    over_layers([0.1, 0.6, 0.4], layers=[0, 1, 2], how="max")    # 0.6: over layers 1..L
    top_share(argmax_share=[0.9, 0.3], argmin_share=[0.1, 0.5], layers=[0, 1])   # 0.5

Layer 0 (the embedding output) never counts unless it is the only layer given, as in the persistence rule of
metrics/outliers.py; a missing value (None or nan) is left out; nothing left gives nan. Outlier measures (shares,
kurtosis, max |activation|, the max / median ratio) take the max over the layers (the strongest layer), geometry
measures (anisotropy, IsoScore*, probe accuracy, attention statistics) the mean.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

REDUCTIONS = {"max": max, "min": min, "mean": lambda values: sum(values) / len(values)}


def over_layers(values: Sequence[float | None], layers: Sequence[int], how: str) -> float:
    """The `how` ("max", "min" or "mean") of `values` (one per entry of `layers`) over layers 1..L."""
    if len(values) != len(layers):
        raise ValueError(f"{len(values)} values for {len(layers)} layers")
    pairs = [(layer, float(value)) for layer, value in zip(layers, values)
             if value is not None and not math.isnan(float(value))]
    kept = [value for layer, value in pairs if layer >= 1] or [value for _, value in pairs if len(layers) == 1]
    return REDUCTIONS[how](kept) if kept else float("nan")


def top_share(argmax_share: Sequence[float], argmin_share: Sequence[float], layers: Sequence[int]) -> float:
    """The dominant dimension's share of the maxima or minima, the larger of the two, max over layers 1..L."""
    return over_layers([max(a, b) for a, b in zip(argmax_share, argmin_share)], layers, "max")
