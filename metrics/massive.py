"""Massive activations (Sun, Chen, Kolter & Liu, "Massive Activations in Large Language Models", COLM 2024; code
locuslab/massive-activations): a handful of activations, at the first token or a delimiter, hundreds to thousands of
times the median |activation| of their layer.

    metric = MassiveActivations(num_layers=7, hidden_size=384)
    metric.update(hidden_states, mask, input_ids)   # [layers, batch, seq, hidden], [batch, seq], [batch, seq]
    result = metric.compute()                       # MassiveResult
    result.median                                   # [layers]: median |activation| (from the histogram)
    result.peak_abs, result.peak_position, result.peak_token   # [layers, hidden]: each dimension's largest |x|, where
    MassiveRule().describe(); MassiveRule("sun").passes(value, median)

Per layer and dimension, the largest |activation| over the counted tokens with its signed value, its position in
its sequence (0-indexed) and its token id: the top-k of a layer are its k dimensions of largest peak (each a
different dimension, so one massive dimension that peaks in every sentence does not fill the list). The median
|activation| of a layer, over every counted token and dimension, is not streamable exactly in fixed memory: it is read
off a histogram of |x| with fixed log-spaced bins, BINS_PER_DECADE (64) bins a decade from 1e-6 to 1e6 (values
below 1e-6, zeros included, in an underflow bin, values above 1e6 in an overflow bin), interpolated log-linearly
inside its bin: within a factor 10^(1/64) (3.7%) of the exact median, in practice within about 1%. The histogram is a
sum-reduced count and the peaks a fixed-size [layers, hidden, 4] state merged across ranks by keeping each
(layer, dimension)'s largest |x| (ties: the smaller position, then the smaller token id), so the result is exact
under DDP.

The rules (MassiveRule): "ratio" (the default, ours), an activation at least `ratio` (20) times its layer's median
|activation|: Gaussian activations give a max / median of 7-8 over millions of values (6.7 / 0.674 = 10 even over
1e10), the packaged MiniLM's first-token dimension stands at 23-45 times its layer's median in every layer
(docs/analyses.md). "sun", their rule made for LLMs: |x| > `min_abs` (100) and at least `ratio` (1000) times the
median.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from core.defaults import MASSIVE_DEFAULTS, MASSIVE_RULES
from metrics.base import Metric

BINS_PER_DECADE = 64
LOW_DECADE, HIGH_DECADE = -6, 6  # the histogram's range, 1e-6 .. 1e6
NUM_BINS = BINS_PER_DECADE * (HIGH_DECADE - LOW_DECADE) + 2  # + underflow and overflow
RULES, DEFAULTS = MASSIVE_RULES, MASSIVE_DEFAULTS  # core/defaults.py: the parsers show them without torch


@dataclass(frozen=True)
class MassiveRule:
    """When an activation is massive: |x| >= ratio x the layer's median |x| (and, for "sun", |x| > min_abs)."""

    rule: str = "ratio"
    ratio: float | None = None  # None: the rule's default (20 for "ratio", 1000 for "sun")
    min_abs: float | None = None  # None: the rule's default (100 for "sun"; "ratio" has none)

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"massive rule must be one of {RULES}, got {self.rule!r}")
        object.__setattr__(self, "ratio", DEFAULTS[self.rule]["ratio"] if self.ratio is None else float(self.ratio))
        object.__setattr__(self, "min_abs", DEFAULTS[self.rule]["min_abs"] if self.min_abs is None
                           else float(self.min_abs))

    def passes(self, value: float, median: float) -> bool:
        value = abs(value)
        return value > self.min_abs and (median > 0 and value >= self.ratio * median or median == 0 and value > 0)

    def describe(self) -> str:
        if self.rule == "sun":
            return (f"|x| > {self.min_abs:g} and |x| >= {self.ratio:g} x the layer's median |x| (Sun et al. 2024's "
                    "rule, made for LLMs)")
        return (f"|x| >= {self.ratio:g} x the layer's median |x| (ours: scale-free; Gaussian activations reach about "
                "7-10)" + (f" and |x| > {self.min_abs:g}" if self.min_abs else ""))

    def to_dict(self) -> dict:
        return {"rule": self.rule, "ratio": self.ratio, "min_abs": self.min_abs, "description": self.describe()}


@dataclass
class MassiveResult:
    num_values: int  # counted activations per layer (tokens x hidden)
    histogram: Tensor  # [layers, NUM_BINS] counts of |x|
    peak_abs: Tensor  # [layers, hidden]: each dimension's largest |x| (-1 when it saw no token)
    peak_value: Tensor  # [layers, hidden]: its signed value
    peak_position: Tensor  # [layers, hidden] long: its token's position in its sequence
    peak_token: Tensor  # [layers, hidden] long: its token id (-1 when none was given)

    @property
    def median(self) -> Tensor:  # [layers]
        return histogram_quantile(self.histogram, 0.5)

    def top(self, k: int) -> Tensor:
        """[layers, k']: the dimensions of the k largest peaks of each layer, largest first (k' = min(k, hidden))."""
        return self.peak_abs.argsort(dim=-1, descending=True, stable=True)[:, :k]


def bin_edges() -> Tensor:
    """The histogram's bin edges in |x| [NUM_BINS - 1]: 1e-6, ..., 1e6 (bin 0 below the first, the last above)."""
    return torch.logspace(LOW_DECADE, HIGH_DECADE, NUM_BINS - 1, dtype=torch.float64)


def histogram_quantile(histogram: Tensor, q: float) -> Tensor:
    """The q-quantile of |x| per row of histogram [rows, NUM_BINS], interpolated log-linearly inside its bin (0 when
    it falls in the underflow bin, 1e6 in the overflow bin)."""
    counts = histogram.double()
    total = counts.sum(-1, keepdim=True)
    cumulative = counts.cumsum(-1)
    target = q * total
    index = torch.searchsorted(cumulative, target).clamp_(max=NUM_BINS - 1)  # the bin holding the quantile
    before = torch.where(index > 0, cumulative.gather(-1, (index - 1).clamp_min(0)), torch.zeros_like(target))
    inside = counts.gather(-1, index).clamp_min(1)
    fraction = ((target - before) / inside).clamp(0, 1)
    log_value = LOW_DECADE + (index.double() - 1 + fraction) / BINS_PER_DECADE
    value = torch.pow(10.0, log_value)
    value = torch.where(index == 0, torch.zeros_like(value), value)
    value = torch.where(index == NUM_BINS - 1, torch.full_like(value, 10.0 ** HIGH_DECADE), value)
    return torch.where(total > 0, value, torch.full_like(value, math.nan)).squeeze(-1)


def merge_peaks(stacked: Tensor) -> Tensor:
    """The DDP reduction of the peak state: stacked [ranks, layers, hidden, 4] (|x|, x, position, token) -> per
    (layer, dimension) the entry of the largest |x|; ties go to the smaller position, then the smaller token id."""
    best = stacked[0]
    for other in stacked[1:]:
        best = torch.where(better(other, best)[..., None], other, best)
    return best


def better(candidate: Tensor, current: Tensor) -> Tensor:
    """[..., 4] peak entries -> bool [...]: the candidate's |x| is larger, or equal at a smaller (position, token)."""
    larger = candidate[..., 0] > current[..., 0]
    tie = candidate[..., 0] == current[..., 0]
    earlier = (candidate[..., 2] < current[..., 2]) | (candidate[..., 2] == current[..., 2]) & (
        candidate[..., 3] < current[..., 3])
    return larger | tie & earlier


def batch_peaks(magnitude: Tensor, input_ids: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """magnitude [batch, seq, hidden] (|x|, -1 where not counted), input_ids [batch, seq] or None -> per dimension
    [hidden] the largest |x|, and the (row, position, token id) holding it, ties broken as across batches and ranks
    (`better`): the smaller position, then the smaller token id, then the earlier row. (torch's max picks any of
    equal values, and by row first: a batch of 2 and 2 batches of 1 named different tokens.)"""
    batch, seq, hidden = magnitude.shape
    flat = magnitude.flatten(0, 1)  # [batch * seq, hidden]
    largest = flat.amax(0)
    rows, dims = (flat == largest).nonzero(as_tuple=True)  # every entry at its dimension's largest |x|: few
    ids = input_ids.to(rows.device).flatten()[rows] if input_ids is not None else torch.full_like(rows, -1)
    keys = (rows % seq, ids, rows)  # position, token id, row (row-major: the earlier sequence)
    chosen = torch.ones_like(rows, dtype=torch.bool)
    for key in keys:  # lexicographic: keep the smallest of each key among those still tied
        best = torch.full((hidden,), torch.iinfo(torch.long).max, dtype=torch.long, device=rows.device)
        best.scatter_reduce_(0, dims[chosen], key[chosen].long(), "amin")
        chosen &= key.long() == best[dims]
    picked = rows.new_empty(hidden)
    picked[dims[chosen]] = rows[chosen]
    token = input_ids.to(rows.device).flatten()[picked] if input_ids is not None else torch.full_like(picked, -1)
    return largest, picked // seq, picked % seq, token


class MassiveActivations(Metric):
    """Each dimension's peak |activation| with its position and token, and a histogram of |x| per layer."""

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    def __init__(self, num_layers: int, hidden_size: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_layers, self.hidden_size = num_layers, hidden_size
        self.add_state("histogram", torch.zeros(num_layers, NUM_BINS, dtype=torch.long), dist_reduce_fx="sum")
        empty = torch.tensor([-1.0, 0.0, -1.0, -1.0], dtype=torch.float64).repeat(num_layers, hidden_size, 1)
        self.add_state("peak", empty, dist_reduce_fx=merge_peaks)  # [layers, hidden, (|x|, x, position, token)]

    def update(self, hidden_states: Tensor, mask: Tensor | None = None, input_ids: Tensor | None = None) -> None:
        """hidden_states [layers, batch, seq, hidden]; mask [batch, seq] bool (the counted tokens); input_ids
        [batch, seq] (None: token ids recorded as -1)."""
        if hidden_states.dim() != 4 or hidden_states.shape[0] != self.num_layers \
                or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden states {tuple(hidden_states.shape)} are not [{self.num_layers} layers, batch, "
                             f"seq, {self.hidden_size} hidden]")
        layers, batch, seq, hidden = hidden_states.shape
        mask = torch.ones(batch, seq, dtype=torch.bool, device=hidden_states.device) if mask is None else mask.bool()
        if not mask.any():
            return
        found = []
        for layer in range(layers):  # one layer's temporaries at a time
            values = hidden_states[layer]  # [batch, seq, hidden]
            magnitude = values.float().abs()
            bins = torch.log10(magnitude[mask].clamp_min(1e-30)).sub_(LOW_DECADE).mul_(BINS_PER_DECADE).floor_()
            bins = bins.add_(1).clamp_(0, NUM_BINS - 1).long().flatten()
            self.histogram[layer] += torch.bincount(bins, minlength=NUM_BINS)
            largest, row, position, token = batch_peaks(magnitude.masked_fill_(~mask[:, :, None], -1.0), input_ids)
            signed = values[row, position, torch.arange(hidden, device=values.device)].double()
            found.append(torch.stack([largest.double(), signed, position.double(), token.double()], -1))
        found = torch.stack(found)  # [layers, hidden, 4]
        self.peak = torch.where(better(found, self.peak)[..., None], found, self.peak)

    def compute(self) -> MassiveResult:
        peak = self.peak
        return MassiveResult(num_values=int(self.histogram[0].sum()) if self.num_layers else 0,
                             histogram=self.histogram.clone(), peak_abs=peak[..., 0].clone(),
                             peak_value=peak[..., 1].clone(), peak_position=peak[..., 2].long(),
                             peak_token=peak[..., 3].long())
