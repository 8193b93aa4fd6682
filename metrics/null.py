"""The null of the outlier statistics (ours): what Gaussian noise, and what the model before training, give; statistics
across seeds; and the verdict "beyond the null".

    states = gaussian_states((layers, batch, seq, hidden), generator)   # seeded N(0, 1) hidden states
    expected_kurtosis(128)            # 3 (d - 1) / (d + 1) = 2.953: a Gaussian token vector's Pearson kurtosis
    expected_top_share(128)           # 1 / d: the share of tokens whose max (or min) any one dimension holds
    across_seeds([0.31, 0.42, 0.40])  # {"mean", "sd"}: sample standard deviation (n - 1), None for one seed
    beyond(value, null, margin=0.5)   # value > (1 + margin) * null
    chance_outlier_bound(7, 384, 0.2) # 0.108: chance alone makes some dim an outlier of a layer, at most (ours)

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

The outlier rule's chance bound (ours; `chance_outlier_bound`, in outliers.json as each layer's chance_bound): on n
counted token vectors of width d, the rule (metrics/outliers.py: a dimension holding the max or the min of at least a
share s of the tokens) flags some dimension of a layer by chance alone with probability at most
2 d P(Binomial(n, 1 / d) >= ceil(s n)), capped at 1 (the union bound over the d dimensions, each as the max and as the
min). Exact binomial tail, summed in log space (binomial_tail), stable for n up to 1e8.

"Beyond the null", precisely: the statistic exceeds (1 + margin) times the largest of its null values (the same run at
step 0, and every Gaussian sample), margin 0.5 unless the study file says otherwise. A verdict over seeds counts the
seeds in which it does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from core.wording import plural


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
    return f"beyond the null in {count} of {plural(total, 'seed')}"


# ---- the outlier rule's chance bound (ours) ----


def share_count(num_tokens: int, share: float) -> int:
    """The fewest of `num_tokens` token vectors a dimension must hold for the rule's test count / n >= share (float64,
    as detect_outliers compares) to pass: ceil(share * n), corrected where the product rounds (0.1 * 30 gives
    3.0000000000000004); n + 1 when no count passes (share > 1)."""
    n = int(num_tokens)
    if n <= 0:
        return 0
    count = min(max(math.ceil(share * n), 0), n + 1)
    while count > 0 and (count - 1) / n >= share:
        count -= 1
    while count <= n and count / n < share:
        count += 1
    return count


def _log_pmf(n: int, p: float, k: Tensor) -> Tensor:
    """log P(Binomial(n, p) = k), k a float64 tensor (lgamma: relative error ~1e-7 at n = 1e8)."""
    return (math.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1) + k * math.log(p)
            + (n - k) * math.log1p(-p))


def _log_tail_sum(n: int, p: float, start: int, step: int) -> float:
    """log of the sum of P(X = k) from k = `start` away from the mode (`step` +1: up to n; -1: down to 0). Summed in
    chunks of growing length, stopped when the rest, at most the last term times r / (1 - r) (a geometric series: the
    ratio r of neighbouring terms only falls away from the mode), is below 1e-17 of the sum."""
    end, size, total, k0 = (n if step > 0 else 0), 256, -math.inf, start
    while True:
        stop = min(end, k0 + size - 1) if step > 0 else max(end, k0 - size + 1)
        ks = torch.arange(k0, stop + step, step, dtype=torch.float64)
        logs = _log_pmf(n, p, ks)
        total = float(torch.logaddexp(torch.tensor(total, dtype=torch.float64), torch.logsumexp(logs, 0)))
        if stop == end:
            return total
        k = stop
        ratio = (n - k) / (k + 1) * p / (1 - p) if step > 0 else k / (n - k + 1) * (1 - p) / p
        if float(logs[-1]) + math.log(ratio) - math.log1p(-ratio) < total - 40.0:  # e^-40 < 1e-17
            return total
        k0, size = stop + step, size * 2


def binomial_tail(num_trials: int, probability: float, at_least: int) -> float:
    """P(Binomial(n, p) >= k), exact in float64: the upper tail summed from k when k lies above the mean n p, else
    1 - the lower tail summed from k - 1 down (each sum from its largest term, in log space)."""
    n, p, k = int(num_trials), float(probability), int(at_least)
    if k <= 0:
        return 1.0
    if k > n or p <= 0:
        return 0.0
    if p >= 1:
        return 1.0
    if k > n * p:
        return math.exp(_log_tail_sum(n, p, k, 1))
    return -math.expm1(_log_tail_sum(n, p, k - 1, -1))


def chance_outlier_bound(num_tokens: int, dimension: int, min_share: float) -> float:
    """An upper bound on the probability that chance alone makes some dimension an outlier of one layer under the
    share rule (metrics/outliers.py), on `num_tokens` counted token vectors of width `dimension` (ours):

        2 d P(Binomial(n, 1 / d) >= ceil(s n)), capped at 1

    Why this null is the one for the rule: the rule reads only which dimension holds each token's max and min, never a
    magnitude. If the dimensions are exchangeable (every dimension as likely as any other to hold a token's max, and
    its min: Gaussian states are one case, any iid or exchangeable components without ties another) and the tokens
    independent, a dimension's count of maxima is Binomial(n, 1 / d), as is its count of minima; "some dimension is
    an outlier" is the union of these 2 d events, each of probability P(Binomial(n, 1 / d) >= ceil(s n)).

    What it does not cover: a trained model's dimensions are not exchangeable, so a small bound does not make an
    outlier real (nor does a large one make it chance: it says the sample cannot tell); the tokens of a sentence are
    not independent (they share context), so the sample is worth fewer than n tokens and the bound understates chance;
    the layers of one pass share the residual stream, so a persistent verdict's chance is not a product over layers;
    the opt-in sigma rule is outside it. A floor on caution, not a test."""
    if num_tokens <= 0:
        return 1.0
    tail = binomial_tail(num_tokens, 1.0 / dimension, share_count(num_tokens, min_share))
    return min(1.0, 2.0 * dimension * tail)
