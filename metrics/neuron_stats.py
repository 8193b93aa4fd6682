"""Streaming per-layer, per-dimension statistics of hidden states: the numbers outlier detection reads.

    stats = NeuronStatistics(num_layers=13, hidden_size=768)
    stats.update(hidden_states, mask)      # hidden_states [layers, batch, seq, hidden], mask [batch, seq]
    result = stats.compute()               # NeuronStatisticsResult: mean, var, max_abs, argmax/argmin counts
    result.kurtosis_mean, result.kurtosis_max, result.layer_max_abs, result.top1_share_mean   # [layers] each
    result.kurtosis_sequence, result.inf_norm_sequence    # [layers]: Bondarenko et al.'s, per sequence, averaged

Per dimension (over tokens): mean, population variance, max |value|, and how many tokens have their largest
(smallest) component on the dimension (the outlier rule, metrics/outliers.py, reads these); a token whose largest
(smallest) value several dims hold (ties: bf16's coarse values, a zeroed dim) counts 1/k on each of its k dims, so no
dim gains from its index and the counts of a layer still sum to its tokens. Per token vector x (its `hidden`
components), averaged (or maximised) over the tokens of a layer, outlier magnitudes of ours (the kurtosis after
Bondarenko et al., NeurIPS 2023, whose code takes it per sequence: below):

    kurtosis   Pearson's (not excess) kurtosis of the components, m4 / m2^2 with m_k = mean_i (x_i - mean(x))^k:
               3 for Gaussian components, (h^2 - 3h + 3) / (h - 1) for one non-zero component of h; a constant
               vector counts as 0. Mean and max over tokens.
    max |x|    the layer's infinity-norm over all its tokens (the max of the per-dimension max |value|).
    top-1 share  max_i x_i^2 / sum_i x_i^2: the share of the token's squared norm on its largest component (0 for a
               zero vector); mean over tokens.

Per sequence (each [batch, seq, hidden] row's counted tokens, flattened into one vector of tokens x hidden values),
averaged over the sequences, exactly as Bondarenko et al.'s code computes them (outlier-free-transformers,
validate_mlm.py and transformers_language/utils.py: `kurtosis(x)` on `x.view(batch, -1)`, `x.norm(dim=1, p=inf)`, each
averaged over sequences with an AverageMeter):

    kurtosis_sequence   mu4 / (s^4 + 1e-6), mu4 = mean (x - mean(x))^4 and s torch's default std (Bessel's n - 1) over
                        the sequence's values: Pearson's kurtosis (not excess), their eps included
    inf_norm_sequence   the sequence's max |x|

Their sequences are packed blocks of 128 tokens without padding; ours are sentences, so padding is left out (our
choice; theirs has none to leave out). Only [layers, batch, seq, hidden] input has sequences: [layers, tokens, hidden]
input leaves these two unset (None).

Every state is a fixed-size tensor reduced by sum or max, so memory does not grow with the number of tokens and
the result is exact under DDP (torchmetrics syncs the states before `compute`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from metrics.base import Metric, token_sums

BONDARENKO_EPS = 1e-6  # their kurtosis(x, eps=1e-6): mu4 / (s^4 + eps)


@dataclass
class NeuronStatisticsResult:
    num_tokens: int
    mean: Tensor  # [layers, hidden]
    var: Tensor  # [layers, hidden], population variance over tokens
    max_abs: Tensor  # [layers, hidden]
    argmax_count: Tensor  # [layers, hidden] float64: tokens whose largest value lies on the dimension (ties split)
    argmin_count: Tensor  # [layers, hidden] float64: tokens whose smallest value lies on the dimension (ties split)
    kurtosis_sum: Tensor | None = None  # [layers]: sum over tokens of each token vector's Pearson kurtosis
    kurtosis_max: Tensor | None = None  # [layers]: its maximum over tokens
    top1_share_sum: Tensor | None = None  # [layers]: sum over tokens of max_i x_i^2 / |x|^2
    num_sequences: int = 0  # sequences with a counted token (4-d input only)
    kurtosis_sequence_sum: Tensor | None = None  # [layers]: sum over sequences of Bondarenko et al.'s kurtosis
    inf_norm_sequence_sum: Tensor | None = None  # [layers]: sum over sequences of the sequence's max |x|

    @property
    def kurtosis_mean(self) -> Tensor:  # [layers], mean over counted tokens
        return self.kurtosis_sum / max(self.num_tokens, 1)

    @property
    def top1_share_mean(self) -> Tensor:  # [layers], mean over counted tokens
        return self.top1_share_sum / max(self.num_tokens, 1)

    @property
    def kurtosis_sequence(self) -> Tensor | None:  # [layers], mean over sequences (None without sequences)
        return None if not self.num_sequences else self.kurtosis_sequence_sum / self.num_sequences

    @property
    def inf_norm_sequence(self) -> Tensor | None:  # [layers], mean over sequences (None without sequences)
        return None if not self.num_sequences else self.inf_norm_sequence_sum / self.num_sequences

    @property
    def layer_max_abs(self) -> Tensor:  # [layers]: the infinity-norm of the layer's activations, over every token
        return self.max_abs.amax(-1)

    @property
    def layer_scale(self) -> Tensor:
        """[layers]: the median over dimensions of each dimension's root mean square over tokens, sqrt(mean x_i^2):
        the activations' typical scale, which a few outlier dimensions do not move (1 for standard Gaussian ones)."""
        return (self.var + self.mean.pow(2)).sqrt().quantile(0.5, dim=-1)  # the middle two averaged for even counts

    def magnitudes(self) -> list[dict[str, float]]:
        """Per layer, the report keys of the outlier magnitudes: kurtosis_mean, kurtosis_max (Pearson, not excess, of
        each token vector: ours), max_abs (the layer's infinity-norm), top1_share (mean over tokens), and Bondarenko et
        al.'s kurtosis_sequence and inf_norm_sequence (None without sequences)."""
        columns = {"kurtosis_mean": self.kurtosis_mean, "kurtosis_max": self.kurtosis_max,
                   "max_abs": self.layer_max_abs, "top1_share": self.top1_share_mean,
                   "kurtosis_sequence": self.kurtosis_sequence, "inf_norm_sequence": self.inf_norm_sequence}
        return [{key: None if values is None else round(float(values[layer]), 6) for key, values in columns.items()}
                for layer in range(self.mean.shape[0])]

    @property
    def argmax_share(self) -> Tensor:  # [layers, hidden], fractions of counted tokens
        return self.argmax_count.double() / max(self.num_tokens, 1)

    @property
    def argmin_share(self) -> Tensor:
        return self.argmin_count.double() / max(self.num_tokens, 1)


def count_extremes(count: Tensor, tokens: Tensor, largest: bool) -> Tensor:
    """Add to count [layers, hidden] (float64), per token of tokens [layers, tokens, hidden], 1 on the dim holding its
    largest (`largest`, else smallest) value, split equally among the dims when several hold it (torch's argmax would
    give a tie to the lowest index). Returns the extreme values [layers, tokens]."""
    top = tokens.topk(min(2, tokens.shape[-1]), dim=-1, largest=largest)  # values, indices [layers, tokens, <= 2]
    tied = top.values[..., 0] == top.values[..., -1] if tokens.shape[-1] > 1 else torch.zeros_like(top.values[..., 0],
                                                                                                     dtype=torch.bool)
    count.scatter_add_(1, top.indices[..., 0], (~tied).to(count.dtype))
    if tied.any():  # rare outside coarse dtypes: only the tied tokens' rows are compared
        layer, token = tied.nonzero(as_tuple=True)
        holders = (tokens[layer, token] == top.values[layer, token, :1]).to(count.dtype)  # [tied tokens, hidden]
        count.index_put_((layer,), holders / holders.sum(-1, keepdim=True), accumulate=True)
    return top.values[..., 0]


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
        self.add_state("argmax_count", torch.zeros(shape, dtype=torch.float64), dist_reduce_fx="sum")  # ties split
        self.add_state("argmin_count", torch.zeros(shape, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("kurtosis_sum", torch.zeros(num_layers, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("kurtosis_max", torch.zeros(num_layers, dtype=torch.float64), dist_reduce_fx="max")
        self.add_state("top1_share_sum", torch.zeros(num_layers, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("num_sequences", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("kurtosis_sequence_sum", torch.zeros(num_layers, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("inf_norm_sequence_sum", torch.zeros(num_layers, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, hidden_states: Tensor, mask: Tensor | None = None) -> None:
        """hidden_states [layers, batch, seq, hidden] (or [layers, tokens, hidden]); mask [batch, seq] bool."""
        if hidden_states.dim() == 4:
            self._update_sequences(hidden_states, mask)
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
        batch_sum = token_sums(tokens)  # [layers, hidden]
        self.max_abs = torch.maximum(self.max_abs, torch.maximum(tokens.amax(1), -tokens.amin(1)).double())
        largest = count_extremes(self.argmax_count, tokens, largest=True)  # [layers, tokens]
        smallest = count_extremes(self.argmin_count, tokens, largest=False)
        # Squares are summed around the batch mean (accurate in float32 even where the mean dwarfs the spread, as
        # an outlier's does), then shifted back exactly in float64: sum x² = M2 + (sum x)² / n.
        centred = tokens - (batch_sum / n).float().unsqueeze(1)
        batch_m2 = token_sums(centred.pow_(2))
        self.count += n
        self.sum += batch_sum
        self.sum_sq += batch_m2 + batch_sum.pow(2) / n
        # Per token vector, over its components: m2, m4 around the vector's own mean (in place: one temporary).
        component_mean = tokens.mean(-1, keepdim=True)  # [layers, tokens, 1]
        squares = torch.sub(tokens, component_mean, out=centred).pow_(2)
        m2 = squares.mean(-1)  # [layers, tokens]
        m4 = squares.pow_(2).mean(-1)
        kurtosis = torch.where(m2 > 0, m4.double() / m2.double().pow(2).clamp_min(1e-300), 0.0)
        self.kurtosis_sum += kurtosis.sum(1)
        self.kurtosis_max = torch.maximum(self.kurtosis_max, kurtosis.amax(1))
        norm_sq = (m2.double() + component_mean.squeeze(-1).double().pow(2)) * tokens.shape[-1]  # sum_i x_i^2
        top_sq = torch.maximum(largest.double().pow(2), smallest.double().pow(2))
        self.top1_share_sum += torch.where(norm_sq > 0, top_sq / norm_sq.clamp_min(1e-300), 0.0).clamp_(max=1).sum(1)

    def _update_sequences(self, hidden_states: Tensor, mask: Tensor | None) -> None:
        """Bondarenko et al.'s per-sequence kurtosis and inf-norm (module docstring) of each row of hidden_states
        [layers, batch, seq, hidden] over its counted tokens (mask [batch, seq]); rows without a token are skipped."""
        if hidden_states.shape[0] != self.num_layers or hidden_states.shape[-1] != self.hidden_size:
            return  # update() names the mismatch
        weight = (mask.float() if mask is not None else hidden_states.new_ones(hidden_states.shape[1:3]).float())
        weight = weight.to(hidden_states.device)[:, :, None]  # [batch, seq, 1]
        count = weight.sum((1, 2), dtype=torch.float64) * self.hidden_size  # [batch]: values per sequence
        kept = count > 0
        if not kept.any():
            return
        kurtosis, inf_norm = [], []
        for layer in hidden_states:  # one layer's temporaries at a time: [batch, seq, hidden]
            values = layer.float()
            mean = (values * weight).sum((1, 2), dtype=torch.float64) / count.clamp_min(1)  # [batch]
            squares = (values - mean.float()[:, None, None]).mul_(weight).pow_(2)
            m2 = squares.sum((1, 2), dtype=torch.float64)
            mu4 = squares.pow_(2).sum((1, 2), dtype=torch.float64) / count.clamp_min(1)
            std4 = (m2 / (count - 1).clamp_min(1)).pow(2)  # s^4, s with Bessel's correction (torch.std's default)
            kurtosis.append(mu4 / (std4 + BONDARENKO_EPS))
            inf_norm.append(values.abs().mul_(weight).amax((1, 2)).double())
        self.num_sequences += kept.sum()
        self.kurtosis_sequence_sum += torch.stack(kurtosis)[:, kept].sum(1)
        self.inf_norm_sequence_sum += torch.stack(inf_norm)[:, kept].sum(1)

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
            kurtosis_sum=self.kurtosis_sum.clone(),
            kurtosis_max=self.kurtosis_max.clone(),
            top1_share_sum=self.top1_share_sum.clone(),
            num_sequences=int(self.num_sequences.item()),
            kurtosis_sequence_sum=self.kurtosis_sequence_sum.clone(),
            inf_norm_sequence_sum=self.inf_norm_sequence_sum.clone(),
        )
