"""Outlier-dimension detection from NeuronStatistics: the paper's criterion with our numbers (and one opt-in addition
of ours).

    layers = detect_outliers(stats.compute(), OutlierRule(min_share=0.2))      # the paper's criterion, our 0.2
    persistent_dims(layers)                                                    # outliers of half the non-input layers
    rule.describe(); rule.describe_persistence()                               # the reports' words, whose is which
    dims, means = top_mean_dims(result.mean, k=5); ratio = max_median_ratio(result.mean)   # [layers, k], [layers]
    chance_warning(layers, num_tokens, hidden_size, rule)      # a line when the verdict could be chance (ours), or None
    chance_of(layers, num_tokens, hidden_size, rule)           # {"chance_bound", "chance_warning"}: what reports carry

The rule (Luo et al. 2021, §3: a neuron that bears the largest or the smallest value of "most vectors"; the paper
gives no number, so the 0.2 share and the half-the-layers rule for persistence are ours). In layer l, dimension d is
an outlier when it holds the maximum or the minimum value of at least `min_share` (0.2) of the counted token
vectors (a token whose maximum or minimum k dims hold, a tie, counts 1/k on each: NeuronStatistics). Opt-in, ours (`sigma`, off by default): d is also an outlier when its mean lies more than
`sigma` robust standard deviations from the median of the layer's mean vector, the robust standard deviation being
1.4826 × the median absolute deviation ("|mean| above k standard deviations" of Kovaleva et al. 2021, made robust).
A dimension is *persistent* when it is an outlier in at least half of the non-input layers 1..L: layer 0 (the
embedding output) is reported but never counted. Nothing here knows any model's dimensions: everything is read off
the statistics.

Chance (ours, it changes no verdict): metrics/null.py's chance_outlier_bound is, per layer, an upper bound on the
probability that chance alone (exchangeable dimensions, independent tokens) makes some dimension an outlier of the
layer on the tokens counted; `chance_warning` says so in one line when a non-input layer with outliers has a bound
above CHANCE_LIMIT (0.01): on one sentence of 7 tokens of a 384-wide model, 0.108. `chance_of` gives both, as every
report of a detection carries them (outliers.json, the --clip auto reports, the probes, the live callback).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor

from core.defaults import OUTLIER_MIN_SHARE
from core.wording import plural
from metrics.neuron_stats import NeuronStatisticsResult
from metrics.null import chance_outlier_bound

CHANCE_LIMIT = 0.01  # a layer's chance bound above which the outlier verdict is said to be possibly chance (ours)
MORE_SENTENCES = "more sentences (--max_sentences, or a larger --data)"  # analyze.py: what gives the rule more tokens


@dataclass(frozen=True)
class OutlierRule:
    min_share: float = OUTLIER_MIN_SHARE
    sigma: float | None = None  # opt-in (ours): also a robust z-score of the dimension's mean above sigma

    def describe(self) -> str:
        """The rule as the reports write it, saying whose each part is (the paper gives the criterion, not the
        number)."""
        text = (f"argmax or argmin share >= {self.min_share} ({self.min_share} is ours: the criterion is Luo et al. "
                "2021's, a dimension holding the largest or smallest value of 'most vectors', and they give no number)")
        if self.sigma is not None:
            text += f", or |mean - median(mean)| > {self.sigma} x 1.4826 MAD of the layer's mean vector (opt-in, ours)"
        return text

    @staticmethod
    def describe_persistence() -> str:
        """What `persistent_dims` counts, saying whose it is."""
        return ("persistent: an outlier in at least half of the non-input layers 1..L (the half is ours: the paper "
                "calls the outliers persistent and gives no number; layer 0 never counts)")


@dataclass
class LayerOutliers:
    layer: int
    argmax_dim: int
    argmax_share: float
    argmin_dim: int
    argmin_share: float
    outlier_dims: list[int]  # ordered by |mean|, largest first
    outlier_means: list[float] = field(default_factory=list)
    robust_z: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def robust_z(mean: Tensor) -> Tensor:
    """|mean - median| in units of 1.4826 MAD (medians of even counts average the middle two) (falling back to the std when the MAD is zero). mean: [..., hidden]."""
    deviation = (mean - mean.quantile(0.5, dim=-1, keepdim=True)).abs()
    scale = 1.4826 * deviation.quantile(0.5, dim=-1, keepdim=True)
    scale = torch.where(scale > 0, scale, mean.std(-1, keepdim=True))
    return torch.where(scale > 0, deviation / scale.clamp_min(1e-30), torch.zeros_like(deviation))


def detect_outliers(result: NeuronStatisticsResult, rule: OutlierRule = OutlierRule()) -> list[LayerOutliers]:
    """Per layer: the dominant argmax/argmin dimensions with their shares, and the outlier dimensions."""
    max_share, min_share = result.argmax_share, result.argmin_share  # [layers, hidden]
    z = robust_z(result.mean.double())
    flagged = (max_share >= rule.min_share) | (min_share >= rule.min_share)
    if rule.sigma is not None:
        flagged |= z > rule.sigma
    layers = []
    for layer in range(result.mean.shape[0]):
        dims = flagged[layer].nonzero().flatten().tolist()
        dims.sort(key=lambda d: -abs(result.mean[layer, d].item()))
        layers.append(
            LayerOutliers(
                layer=layer,
                argmax_dim=int(max_share[layer].argmax()),
                argmax_share=round(float(max_share[layer].max()), 6),
                argmin_dim=int(min_share[layer].argmax()),
                argmin_share=round(float(min_share[layer].max()), 6),
                outlier_dims=dims,
                outlier_means=[round(float(result.mean[layer, d]), 6) for d in dims],
                robust_z=[round(float(z[layer, d]), 3) for d in dims],
            )
        )
    return layers


def persistent_dims(layers: list[LayerOutliers]) -> list[int]:
    """Dimensions that are outliers in at least half of the non-input layers among `layers` (layer 0, the embedding
    output, never counts), most frequent first."""
    counted = [layer for layer in layers if layer.layer >= 1]
    counts: dict[int, int] = {}
    for layer in counted:
        for dim in layer.outlier_dims:
            counts[dim] = counts.get(dim, 0) + 1
    needed = (len(counted) + 1) // 2
    return sorted((d for d, c in counts.items() if c >= needed), key=lambda d: (-counts[d], d))


def outlier_verdict(layers: list[LayerOutliers], kurtosis: list[float]) -> dict:
    """What one capture found, in a few numbers: the persistent dims; the top share (the largest argmax or argmin
    share over the non-input layers, with its layer and dim); the largest mean kurtosis over them (`kurtosis`: per
    entry of `layers`, Pearson, 3 for Gaussian) with its layer. Layer 0 counts only when no other layer is given."""
    chosen = [(layer, k) for layer, k in zip(layers, kurtosis) if layer.layer >= 1] or list(zip(layers, kurtosis))
    share, layer, dim = max(max((row.argmax_share, row.layer, row.argmax_dim), (row.argmin_share, row.layer,
                                                                                   row.argmin_dim))
                            for row, _ in chosen)
    peak, peak_layer = max((k, row.layer) for row, k in chosen)
    return {"persistent_dims": persistent_dims(layers), "top_share": share, "top_share_layer": layer,
            "top_share_dim": dim, "kurtosis": peak, "kurtosis_layer": peak_layer}


def chance_warning(layers: list[LayerOutliers], num_tokens: int, hidden_size: int, rule: OutlierRule,
                   more: str = MORE_SENTENCES) -> str | None:
    """One line when the outliers that enter the persistent verdict (those of the non-input layers 1..L) could be
    chance alone: some such layer has outliers and the chance bound of `num_tokens` token vectors of width
    `hidden_size` is above CHANCE_LIMIT; None otherwise (ours). `more`: what gives the rule more tokens."""
    bound = chance_outlier_bound(num_tokens, hidden_size, rule.min_share)
    found = [layer.layer for layer in layers if layer.layer >= 1 and layer.outlier_dims]
    if bound <= CHANCE_LIMIT or not found:
        return None
    return (f"the outlier rule rested on {plural(num_tokens, 'token vector', spec=',')}: chance alone "
            f"makes some of {hidden_size} dims an outlier of a layer with probability up to {bound:.3g} (chance_bound; "
            f"ours: a union bound for exchangeable dims and independent tokens), so the outliers of "
            f"{plural(len(found), 'non-input layer')} and the persistent dims may be chance: {more} would tell")


def chance_of(layers: list[LayerOutliers], num_tokens: int, hidden_size: int, rule: OutlierRule,
              more: str = MORE_SENTENCES) -> dict:
    """What a report of one detection (`layers`, by `rule` on `num_tokens` token vectors of width `hidden_size`) says
    of chance (ours): {"chance_bound": metrics/null.py's chance_outlier_bound, the same for every layer of the pass,
    "chance_warning": chance_warning's line or None}."""
    return {"chance_bound": chance_outlier_bound(num_tokens, hidden_size, rule.min_share),
            "chance_warning": chance_warning(layers, num_tokens, hidden_size, rule, more)}


def all_outlier_dims(layers: list[LayerOutliers]) -> list[int]:
    return sorted({dim for layer in layers for dim in layer.outlier_dims})


def top_mean_dims(mean: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k dimensions of largest |mean| per layer, largest first, and their signed means.

    mean: [layers, hidden] -> (dims [layers, k], means [layers, k]).
    """
    k = min(k, mean.shape[-1])
    dims = mean.abs().topk(k, dim=-1).indices
    return dims, mean.gather(-1, dims)


def max_median_ratio(mean: Tensor) -> Tensor:
    """How far the largest |mean| of a layer's mean vector stands above a typical one: max |mean| / median |mean|
    (the median of an even count averages the middle two; inf when only the median is 0, nan for an all-zero vector).
    mean: [..., hidden] -> [...]."""
    magnitude = mean.abs().double()
    median = magnitude.quantile(0.5, dim=-1)
    peak = magnitude.amax(-1)
    degenerate = torch.where(peak > 0, float("inf"), float("nan")).to(peak)
    return torch.where(median > 0, peak / median.clamp_min(1e-300), degenerate)
