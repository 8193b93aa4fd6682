"""The null of the outlier statistics (ours): what Gaussian noise, and what the model before training, give; statistics
across seeds; and the verdict "beyond the null".

    states = gaussian_states((layers, batch, seq, hidden), generator)   # seeded N(0, 1) hidden states
    expected_kurtosis(128)            # 3 (d - 1) / (d + 1) = 2.953: a Gaussian token vector's Pearson kurtosis
    expected_top_share(128)           # 1 / d: the share of tokens whose max (or min) any one dimension holds
    across_seeds([0.31, 0.42, 0.40])  # {"mean", "sd"}: sample standard deviation (n - 1), None for one seed
    beyond(value, null, margin=0.5)   # value > (1 + margin) * null

Gaussian vectors are what a model without outliers looks like to these statistics: isotropic, independent components
of one scale. The study (analyses/null.py) puts them through the very Metrics a checkpoint goes through
(NeuronStatistics, the outlier rule), token for token on the same sentences, so every statistic has its null computed
the same way; closed forms exist for two of them and the tests check the sample against them:

    kurtosis   a token vector x of d iid Gaussian components, Pearson's b2 = m4 / m2^2 around the vector's own mean,
               has E[b2] = 3 (d - 1) / (d + 1) (-> 3 as d grows; Fisher 1930)
    top share  by symmetry every dimension holds the max (and the min) of a token with probability 1 / d: each
               dimension's share is Binomial(n, 1 / d) / n, so the largest of them is 1 / d plus a few binomial
               standard deviations sqrt((1 / d)(1 - 1 / d) / n)

A statistic that scales with the activations (max |x|, the inf-norm) is compared at the checkpoint's own scale:
`rescaled(value, own_scale, target_scale)` multiplies a null layer's value by the ratio of the checkpoint's scale in
that layer to the null's (NeuronStatisticsResult.layer_scale: the median over dimensions of each dimension's root mean
square, 1 for standard Gaussian vectors, and not moved by a few outlier dimensions, so that an outlier does not raise
its own null). Scale-free statistics (kurtosis, shares) are used as they are.

"Beyond the null", precisely: the statistic exceeds (1 + margin) times the largest of its null values (the same run at
step 0, and every Gaussian sample), margin 0.5 unless the study file says otherwise. A verdict over seeds counts the
seeds in which it does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


def gaussian_states(shape: Sequence[int], generator: torch.Generator, dtype: torch.dtype = torch.float32) -> Tensor:
    """Standard Gaussian hidden states of `shape` (e.g. [layers, batch, seq, hidden]), drawn from `generator` (CPU)."""
    return torch.randn(tuple(shape), generator=generator, dtype=dtype)


def expected_kurtosis(dimension: int) -> float:
    """E[b2] of d iid Gaussian components, b2 = m4 / m2^2 around their own mean: 3 (d - 1) / (d + 1)."""
    return 3.0 * (dimension - 1) / (dimension + 1)


def expected_top_share(dimension: int) -> float:
    """The share of token vectors whose largest (or smallest) component any one dimension holds: 1 / d."""
    return 1.0 / dimension


def top_share_sd(dimension: int, num_tokens: int) -> float:
    """The binomial standard deviation of one dimension's share of n Gaussian token vectors."""
    p = expected_top_share(dimension)
    return math.sqrt(p * (1 - p) / max(num_tokens, 1))


def rescaled(value: float, own_scale: float | None, target_scale: float | None) -> float:
    """A scale-dependent statistic of activations of scale `own_scale`, as it would be at `target_scale`."""
    if not own_scale or target_scale is None:
        return value
    return value * target_scale / own_scale


def across_seeds(values: Sequence[float | None]) -> dict:
    """Mean and sample standard deviation (n - 1) of the values given (None skipped); sd None for fewer than 2."""
    numbers = [float(value) for value in values if value is not None and not math.isnan(value)]
    if not numbers:
        return {"mean": None, "sd": None}
    mean = sum(numbers) / len(numbers)
    sd = math.sqrt(sum((x - mean) ** 2 for x in numbers) / (len(numbers) - 1)) if len(numbers) > 1 else None
    return {"mean": mean, "sd": sd}


def beyond(value: float | None, null: float | None, margin: float) -> bool:
    """Whether `value` exceeds (1 + margin) times its null (False when either is missing)."""
    if value is None or null is None or math.isnan(value) or math.isnan(null):
        return False
    return value > (1 + margin) * null


def verdict_text(count: int, total: int) -> str:
    return f"beyond the null in {count} of {total} seed{'s' if total != 1 else ''}"
