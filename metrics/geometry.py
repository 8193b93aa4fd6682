"""Streaming geometry of hidden-state spaces: anisotropy, self-similarity, covariance, the protocols' token samples.

    anisotropy = MeanCosine(num_layers=13)
    anisotropy.update(a, b)                         # a, b [layers, pairs, hidden] -> mean cosine per layer
    selfsim = SelfSimilarity(num_words=1000, num_layers=13, hidden_size=768)
    selfsim.update(word_ids, vectors)               # word_ids [n], vectors [layers, n, hidden]
    cov = Covariance(13, 768); cov.update(hidden_states, mask)      # [layers, batch, seq, hidden], [batch, seq]
    result = cov.compute()                          # IsoScore(*) and spectra of it: metrics/isotropy.py
    mean_pairwise_cosine(unit_sum, norm_sum, count) # from sums of unit vectors: self-similarity
    cosine_matrix_mean(unit_sum, count)             # CosReg's R_cos (Gao et al. 2019): the N x N matrix, diagonal in
    sample = TokenSample(2000, 13, 768); sample.update(slots, vectors)   # protocol samples gathered across ranks
    vectors, rows = random_tokens(hidden_states, mask, items, seed)  # one seeded random token of each sentence
    values, pairs = sample_anisotropy(*sample.compute(), seed)      # the paper's anisotropy of such a sample

Every Metric here has fixed-size tensor states reduced by sum, so memory does not grow with the number of tokens
and the result is exact under DDP. Two identities keep them streaming:
- mean pairwise cosine of n vectors with unit versions u_i:  (||sum u||^2 - sum ||u_i||^2) / (n (n - 1)),
  so self-similarity keeps, per word and layer, the sum of unit vectors (and of their squared norms);
- covariance from sum x and sum x x^T per layer; IsoScore, IsoScore*, the singular-value spectrum
  (metrics/isotropy.py) and the whitening of metrics/transforms.py all read it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from metrics.base import Metric, token_sums


def _tokens(hidden_states: Tensor, mask: Tensor | None) -> Tensor:
    """[layers, batch, seq, hidden] + mask [batch, seq] -> [layers, tokens, hidden]; [layers, n, hidden] passes."""
    if hidden_states.dim() == 4:
        return hidden_states[:, mask.bool()] if mask is not None else hidden_states.flatten(1, 2)
    if hidden_states.dim() == 3:
        return hidden_states
    raise ValueError(f"expected [layers, batch, seq, hidden] or [layers, n, hidden], got {tuple(hidden_states.shape)}")


class MeanCosine(Metric):
    """Mean cosine similarity of paired vectors, per layer: the anisotropy of random token pairs (Ethayarajh 2019;
    Luo et al. 2021, §4.1, 1000 pairs of random tokens from 2000 random sentences). Zero vectors count as cosine 0."""

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    def __init__(self, num_layers: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_layers = num_layers
        self.add_state("sum", torch.zeros(num_layers, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, a: Tensor, b: Tensor) -> None:
        """a, b: [layers, pairs, hidden]."""
        if a.shape != b.shape or a.dim() != 3 or a.shape[0] != self.num_layers:
            raise ValueError(f"pairs {tuple(a.shape)} and {tuple(b.shape)} are not both [{self.num_layers}, n, hidden]")
        self.sum += cosine(a, b).sum(1, dtype=torch.float64)
        self.count += a.shape[1]

    def compute(self) -> Tensor:  # [layers]
        return self.sum / self.count.clamp_min(1)


def cosine(a: Tensor, b: Tensor) -> Tensor:
    """Cosine along the last dimension in float32, 0 where either vector is zero. [..., hidden] -> [...]."""
    a, b = a.float(), b.float()
    norms = a.norm(dim=-1) * b.norm(dim=-1)
    return torch.where(norms > 0, (a * b).sum(-1) / norms.clamp_min(1e-30), torch.zeros_like(norms))


def mean_pairwise_cosine(unit_sum: Tensor, norm_sum: Tensor, count: Tensor) -> Tensor:
    """Mean cosine over the n (n - 1) ordered pairs of n vectors, from the sum of their unit vectors [..., hidden],
    the sum of those units' squared norms [...] (1 a vector, 0 for a zero one) and n [...]:
    (||sum u||^2 - sum ||u||^2) / (n (n - 1)); nan below 2 vectors. Differentiable (CosReg's statistic, Gao et al.
    2019, in lightning_modules/regularizers.py; self-similarity's per word)."""
    pairs = count * (count - 1)
    value = (unit_sum.pow(2).sum(-1) - norm_sum) / pairs.clamp_min(1)
    return torch.where(pairs > 0, value, torch.full_like(value, float("nan")))


def cosine_matrix_mean(unit_sum: Tensor, count: Tensor) -> Tensor:
    """CosReg's R_cos (Gao et al. 2019, eq. 4; Rudman & Eickhoff 2024's CosReg baseline less 1/n: their code leaves the
    diagonal out of the sum, still over n^2): the mean of the n x n cosine matrix of n vectors, its diagonal included, 1/n^2 sum_i sum_j u_i . u_j = ||sum u||^2 / n^2, from the sum of their
    unit vectors [..., hidden] and n [...] (a zero vector's unit is zero: its row, column and diagonal add 0). It is
    (n - 1)/n x mean_pairwise_cosine + 1/n for nonzero vectors. nan for no vector. Differentiable."""
    value = unit_sum.pow(2).sum(-1) / count.pow(2).clamp_min(1)
    return torch.where(count > 0, value, torch.full_like(value, float("nan")))


@dataclass
class SelfSimilarityResult:
    per_word: Tensor  # [words, layers] mean pairwise cosine of the word's contexts (nan below 2 contexts)
    counts: Tensor  # [words] contexts seen per word
    mean: Tensor  # [layers] average over words with at least 2 contexts

    @property
    def num_words(self) -> int:
        return int((self.counts >= 2).sum())


class SelfSimilarity(Metric):
    """Self-similarity (Ethayarajh 2019, eq. 1): per word, the mean cosine between its contextual vectors in the
    different sentences it occurs in, per layer. State: per word and layer, the sum of unit vectors and the sum of
    their squared norms (1, or 0 for a zero vector), so mean pairwise cosine = (||sum||^2 - sum||u||^2) / (n(n-1))."""

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    def __init__(self, num_words: int, num_layers: int, hidden_size: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_words, self.num_layers, self.hidden_size = num_words, num_layers, hidden_size
        self.add_state("unit_sum", torch.zeros(num_words, num_layers, hidden_size, dtype=torch.float64),
                       dist_reduce_fx="sum")
        self.add_state("norm_sum", torch.zeros(num_words, num_layers, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros(num_words, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, word_ids: Tensor, vectors: Tensor) -> None:
        """word_ids [n] (0..num_words-1), vectors [layers, n, hidden]: one contextual vector per occurrence."""
        if vectors.dim() != 3 or vectors.shape[0] != self.num_layers or vectors.shape[2] != self.hidden_size:
            raise ValueError(f"vectors {tuple(vectors.shape)} are not [{self.num_layers}, n, {self.hidden_size}]")
        if word_ids.numel() != vectors.shape[1]:
            raise ValueError(f"{word_ids.numel()} word ids for {vectors.shape[1]} vectors")
        if word_ids.numel() == 0:
            return
        word_ids = word_ids.to(self.count.device).long()
        unit = F.normalize(vectors.float(), dim=-1).transpose(0, 1).double()  # [n, layers, hidden]
        self.unit_sum.index_add_(0, word_ids, unit)
        self.norm_sum.index_add_(0, word_ids, unit.pow(2).sum(-1))
        self.count.index_add_(0, word_ids, torch.ones_like(word_ids, dtype=torch.float64))

    def compute(self) -> SelfSimilarityResult:
        per_word = mean_pairwise_cosine(self.unit_sum, self.norm_sum, self.count.unsqueeze(1))  # nan below 2
        valid = self.count >= 2
        mean = per_word[valid].mean(0) if bool(valid.any()) else torch.full((self.num_layers,), float("nan"),
                                                                             dtype=torch.float64)
        return SelfSimilarityResult(per_word=per_word, counts=self.count.clone(), mean=mean)


@dataclass
class CovarianceResult:
    num_tokens: int
    mean: Tensor  # [layers, hidden]
    cov: Tensor  # [layers, hidden, hidden], population covariance (divided by the token count)
    second_moment: Tensor  # [layers, hidden, hidden], uncentred: X^T X / N of each layer's token matrix X


class Covariance(Metric):
    """Per-layer mean, covariance and uncentred second moment of token vectors, from sum x and sum x x^T (float64).

    Each batch's outer products are summed around the batch mean in float32 and shifted back exactly in float64
    (sum x x^T = M2 + n m m^T), so a dimension whose mean dwarfs its spread keeps its variance.
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    def __init__(self, num_layers: int, hidden_size: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_layers, self.hidden_size = num_layers, hidden_size
        self.add_state("count", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("sum", torch.zeros(num_layers, hidden_size, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("sum_outer", torch.zeros(num_layers, hidden_size, hidden_size, dtype=torch.float64),
                       dist_reduce_fx="sum")

    def update(self, hidden_states: Tensor, mask: Tensor | None = None) -> None:
        """hidden_states [layers, batch, seq, hidden] with mask [batch, seq], or [layers, n, hidden]."""
        tokens = _tokens(hidden_states, mask)
        if tokens.shape[0] != self.num_layers or tokens.shape[2] != self.hidden_size:
            raise ValueError(f"tokens {tuple(tokens.shape)} are not [{self.num_layers}, n, {self.hidden_size}]")
        n = tokens.shape[1]
        if n == 0:
            return
        tokens = tokens.float()
        batch_sum = token_sums(tokens)  # [layers, hidden]
        batch_mean = batch_sum / n
        centred = tokens - batch_mean.float().unsqueeze(1)
        m2 = torch.bmm(centred.transpose(1, 2), centred).double()  # [layers, hidden, hidden]
        self.count += n
        self.sum += batch_sum
        self.sum_outer += m2 + n * batch_mean.unsqueeze(2) * batch_mean.unsqueeze(1)

    def compute(self) -> CovarianceResult:
        count = self.count.clamp_min(1)
        mean = self.sum / count
        second = self.sum_outer / count
        cov = second - mean.unsqueeze(2) * mean.unsqueeze(1)
        return CovarianceResult(int(self.count.item()), mean, (cov + cov.transpose(1, 2)) / 2, second)


class TokenSample(Metric):
    """A fixed-size sample of vectors gathered across ranks: slot i is written by the rank that holds item i, and the
    sum reduction assembles the full [slots, layers, hidden] sample on every rank (unwritten slots stay zero)."""

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    def __init__(self, num_slots: int, num_layers: int, hidden_size: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_slots, self.num_layers, self.hidden_size = num_slots, num_layers, hidden_size
        self.add_state("vectors", torch.zeros(num_slots, num_layers, hidden_size), dist_reduce_fx="sum")
        self.add_state("filled", torch.zeros(num_slots), dist_reduce_fx="sum")

    def update(self, slots: Tensor, vectors: Tensor) -> None:
        """slots [n] (each written once), vectors [layers, n, hidden]."""
        if vectors.dim() != 3 or vectors.shape[0] != self.num_layers or vectors.shape[1] != slots.numel():
            raise ValueError(f"vectors {tuple(vectors.shape)} are not [{self.num_layers}, {slots.numel()}, hidden]")
        slots = slots.to(self.filled.device).long()
        self.vectors[slots] = vectors.transpose(0, 1).float()
        self.filled[slots] = 1.0

    def compute(self) -> tuple[Tensor, Tensor]:
        """([slots, layers, hidden], filled [slots] bool)."""
        return self.vectors, self.filled > 0


# ---- the paper's anisotropy: one random token of each sentence, sentences paired at random (Luo et al. §4.1) ----

def random_tokens(hidden_states: Tensor, mask: Tensor | None, items: Sequence[int], seed: int
                  ) -> tuple[Tensor, list[int]]:
    """One counted token of each row, position random.Random(seed * 1_000_003 + items[row]).randrange(count) among its
    counted tokens (mask [batch, seq]; None: all), so the draw depends on the item, not on batching or ranks:
    hidden_states [layers, batch, seq, hidden] -> ([layers, rows with a token, hidden] float32, those rows)."""
    batch, seq = hidden_states.shape[1:3]
    if mask is not None:  # each row's counted positions, read off the device once
        counted = mask.bool().nonzero().cpu()  # [n, 2] (row, position), row-major
        counts = torch.bincount(counted[:, 0], minlength=batch).tolist()
        columns = counted[:, 1].split(counts)
    else:
        counts, columns = [seq] * batch, None
    rows, positions = [], []
    for row, (item, count) in enumerate(zip(items, counts)):
        if count:
            pick = random.Random(seed * 1_000_003 + int(item)).randrange(int(count))
            positions.append(int(columns[row][pick]) if columns is not None else pick)
            rows.append(row)
    if not rows:
        return hidden_states.new_zeros(hidden_states.shape[0], 0, hidden_states.shape[-1]).float(), []
    index_rows = torch.tensor(rows, device=hidden_states.device)
    index_positions = torch.tensor(positions, device=hidden_states.device)
    return hidden_states[:, index_rows, index_positions].float(), rows


def sample_pairs(filled: Tensor, seed: int) -> tuple[Tensor, Tensor]:
    """Pair the filled slots of a sample by a seeded permutation (random.Random(seed).shuffle), the first half with the
    second: (first [pairs], second [pairs]) slot indices."""
    slots = filled.nonzero().flatten().tolist()
    random.Random(seed).shuffle(slots)
    half = len(slots) // 2
    return torch.tensor(slots[:half], dtype=torch.long), torch.tensor(slots[half:2 * half], dtype=torch.long)


def sample_anisotropy(vectors: Tensor, filled: Tensor, seed: int) -> tuple[Tensor, int]:
    """The mean cosine of the sample's tokens (vectors [slots, layers, hidden], filled [slots]) paired by
    sample_pairs(filled, seed): ([layers], pairs); nan per layer without a pair. The sample is already the same on
    every rank (TokenSample): no sync."""
    first, second = sample_pairs(filled.cpu(), seed)
    if first.numel() == 0:
        return torch.full((vectors.shape[1],), float("nan")), 0
    first, second = first.to(vectors.device), second.to(vectors.device)
    metric = MeanCosine(vectors.shape[1], sync_on_compute=False).to(vectors.device)
    metric.update(vectors[first].transpose(0, 1), vectors[second].transpose(0, 1))
    return metric.compute(), int(first.numel())
