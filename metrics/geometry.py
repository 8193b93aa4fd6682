"""Streaming geometry of hidden-state spaces: anisotropy, self-similarity, covariance, IsoScore(*), spectra.

    anisotropy = MeanCosine(num_layers=13)
    anisotropy.update(a, b)                         # a, b [layers, pairs, hidden] -> mean cosine per layer
    selfsim = SelfSimilarity(num_words=1000, num_layers=13, hidden_size=768)
    selfsim.update(word_ids, vectors)               # word_ids [n], vectors [layers, n, hidden]
    cov = Covariance(13, 768); cov.update(hidden_states, mask)      # [layers, batch, seq, hidden], [batch, seq]
    result = cov.compute()
    isoscore(result.cov)                            # [layers]
    isoscore_star(points, zeta=0.2, shrinkage=c0)   # a mini-batch [..., m, n]; differentiable (I-STAR's term)
    mean_pairwise_cosine(unit_sum, norm_sum, count) # from sums of unit vectors: self-similarity, CosReg
    spectrum_of_moments(*variant.moments(result.mean, result.cov), result.num_tokens)["singular_values"]
    sample = TokenSample(2000, 13, 768); sample.update(slots, vectors)   # protocol samples gathered across ranks
    vectors, rows = random_tokens(hidden_states, mask, items, seed)  # one seeded random token of each sentence
    values, pairs = sample_anisotropy(*sample.compute(), seed)      # the paper's anisotropy of such a sample

Every Metric here has fixed-size tensor states reduced by sum, so memory does not grow with the number of tokens
and the result is exact under DDP. Two identities keep them streaming:
- mean pairwise cosine of n vectors with unit versions u_i:  (||sum u||^2 - sum ||u_i||^2) / (n (n - 1)),
  so self-similarity keeps, per word and layer, the sum of unit vectors (and of their squared norms);
- covariance from sum x and sum x x^T per layer; IsoScore, IsoScore*, the singular-value spectrum and the
  whitening of metrics/transforms.py all read it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import Metric


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
        batch_sum = tokens.sum(1, dtype=torch.float64)  # [layers, hidden]
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


def eigvalsh(matrices: Tensor) -> Tensor:
    """torch.linalg.eigvalsh, on CPU in one thread: LAPACK's threaded symmetric eigensolver is several times slower
    than a single thread for hidden sizes in the hundreds (and worse on a busy machine)."""
    return _one_thread(torch.linalg.eigvalsh, matrices)


def eigh(matrices: Tensor) -> tuple[Tensor, Tensor]:
    return _one_thread(torch.linalg.eigh, matrices)


def svd(matrices: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Thin torch.linalg.svd (U, S, Vh) of [..., m, n] matrices, on CPU in one thread (as eigvalsh)."""
    return _one_thread(lambda m: torch.linalg.svd(m, full_matrices=False), matrices)


def _one_thread(function, matrices: Tensor):
    if matrices.device.type != "cpu":
        return function(matrices)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return function(matrices)
    finally:
        torch.set_num_threads(threads)


def isoscore_from_eigenvalues(eigenvalues: Tensor) -> Tensor:
    """IsoScore from the variances along the principal components (eigenvalues of the covariance), [..., n] -> [...].

    Rudman, Gillman, Rayne & Eickhoff, "IsoScore: Measuring the Uniformity of Embedding Space Utilization",
    Findings of ACL 2022, Algorithm 1 (reference code: github.com/bcbi-edu/p_eickhoff_isoscore): normalise the
    variance vector to norm sqrt(n), take its distance delta to the all-ones vector over sqrt(2 (n - sqrt n)), then
    phi = (n - delta^2 (n - sqrt n))^2 / n^2 is the fraction of dimensions used and IsoScore = (n phi - 1) / (n - 1):
    1 for an isotropic cloud, 0 when all variance lies on one direction. nan when every variance is zero.
    Differentiable (plain torch ops).
    """
    n = eigenvalues.shape[-1]
    variances = eigenvalues.clamp_min(0)
    norm = torch.linalg.vector_norm(variances, dim=-1, keepdim=True)
    normalised = variances * math.sqrt(n) / norm
    delta = torch.linalg.vector_norm(normalised - 1, dim=-1) / math.sqrt(2 * (n - math.sqrt(n)))
    return ((n - delta.pow(2) * (n - math.sqrt(n))).pow(2) - n) / (n * (n - 1))


def isoscore(cov: Tensor) -> Tensor:
    """IsoScore of covariance matrices [..., n, n] -> [...] (see isoscore_from_eigenvalues)."""
    return isoscore_from_eigenvalues(eigvalsh(cov.double()))


def isoscore_of_covariance(cov: Tensor) -> Tensor:
    """IsoScore of covariance matrices [..., n, n] -> [...] without an eigendecomposition: differentiable, and no
    host synchronisation (torch's eigensolvers check their convergence on the host on CUDA devices).

    With the eigenvalues v of a covariance, isoscore_from_eigenvalues's n - delta^2 (n - sqrt n) simplifies to
    sqrt(n) sum(v) / ||v||, so IsoScore = (PR - 1) / (n - 1) with the participation ratio
    PR = (sum v)^2 / sum v^2 = tr(C)^2 / ||C||_F^2: the same value for any positive semi-definite C (a covariance;
    the eigenvalue route also clamps rounding's tiny negative eigenvalues to 0). nan when C is zero.
    """
    n = cov.shape[-1]
    trace = cov.diagonal(dim1=-2, dim2=-1).sum(-1)
    return (trace.pow(2) / cov.pow(2).sum((-2, -1)) - 1) / (n - 1)


def isoscore_star_of_covariance(cov: Tensor, zeta: float = 0.2, shrinkage: Tensor | None = None) -> Tensor:
    """IsoScore* from a mini-batch's sample covariance [..., n, n] (see isoscore_star): IsoScore of
    (1 - zeta) C + zeta C0, C0 = `shrinkage` (default the identity). For a covariance assembled from moments, e.g.
    summed over ranks (I-STAR under DDP, lightning_modules/regularizers.py)."""
    if shrinkage is None:
        shrinkage = torch.eye(cov.shape[-1], dtype=cov.dtype, device=cov.device)
    return isoscore_of_covariance((1 - zeta) * cov + zeta * shrinkage.to(cov))


def isoscore_star(points: Tensor, zeta: float = 0.2, shrinkage: Tensor | None = None) -> Tensor:
    """IsoScore* of a mini-batch of points [..., m, n] -> [...]; differentiable, for regularisers (I-STAR) too.

    Rudman & Eickhoff, "Stable Anisotropic Regularization", ICLR 2024 (reference code: I-STAR/regularizers.py in
    github.com/bcbi-edu/p_eickhoff_isoscore): the sample covariance C (unbiased) is shrunk towards a covariance C0
    estimated from many more points, C_zeta = (1 - zeta) C + zeta C0, and IsoScore is taken of it
    (isoscore_of_covariance: the participation ratio of its eigenvalues, no eigendecomposition). Stable when m is
    below n, where the plain sample covariance is rank-deficient. zeta = 0 gives IsoScore; C0 defaults to the
    identity (the reference code's advice when no larger sample is at hand).
    """
    points = points.double()
    centred = points - points.mean(-2, keepdim=True)
    cov = centred.transpose(-1, -2) @ centred / max(points.shape[-2] - 1, 1)
    return isoscore_star_of_covariance(cov, zeta, shrinkage)


class IsoScoreStar(Metric):
    """IsoScore* averaged over mini-batches: each update() is one mini-batch of points per layer, scored against the
    shrinkage covariance C0 ([layers, hidden, hidden] or [hidden, hidden]; identity when None)."""

    full_state_update = False
    is_differentiable = False
    higher_is_better = True

    def __init__(self, num_layers: int, hidden_size: int, zeta: float = 0.2, shrinkage: Tensor | None = None,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        if not 0 <= zeta <= 1:
            raise ValueError(f"zeta must lie in [0, 1], got {zeta}")
        self.num_layers, self.hidden_size, self.zeta = num_layers, hidden_size, zeta
        if shrinkage is None:
            shrinkage = torch.eye(hidden_size, dtype=torch.float64)
        self.register_buffer("shrinkage", shrinkage.double().expand(num_layers, hidden_size, hidden_size).clone())
        self.add_state("score_sum", torch.zeros(num_layers, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("batches", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, points: Tensor) -> None:
        """points [layers, m, hidden]: one mini-batch (m >= 2)."""
        if points.dim() != 3 or points.shape[0] != self.num_layers or points.shape[2] != self.hidden_size:
            raise ValueError(f"points {tuple(points.shape)} are not [{self.num_layers}, m, {self.hidden_size}]")
        if points.shape[1] < 2:
            return
        self.score_sum += isoscore_star(points, self.zeta, self.shrinkage).nan_to_num(0.0)
        self.batches += 1

    def compute(self) -> Tensor:  # [layers]
        return self.score_sum / self.batches.clamp_min(1)


def spectrum(second_moment: Tensor, num_tokens: int, floor: float = 1e-7) -> dict[str, Tensor]:
    """Singular values of each layer's token matrix X [tokens, hidden] from its second moment X^T X / N [layers, h, h].

    Token uniformity as in tokenUni (Yan, Gui, Li & He, "Addressing Token Uniformity in Transformers via Singular
    Value Transformation", UAI 2022): the more skewed the singular values, the more alike the tokens. Returns
    `singular_values` [layers, hidden] (descending, divided by the largest), `energy_top1` and `energy_top10`
    (share of sum sigma^2 in the top 1 / 10 directions), and `cdf_auc` (area under the empirical CDF of the
    normalised singular values on [0, 1], i.e. 1 - their mean: near 1 when one direction dominates).
    The second moment is summed from float32 outer products, so an eigenvalue below `floor` (1e-7) of the largest is
    rounding noise: it counts as 0 (a singular value below ~3e-4 of the largest, as a zeroed dimension's is).
    """
    eig = eigvalsh(second_moment.double()).flip(-1).clamp_min(0)  # [layers, hidden], descending
    eig = torch.where(eig > floor * eig[..., :1], eig, torch.zeros_like(eig))
    sigma = (eig * num_tokens).sqrt()
    top = sigma[..., :1].clamp_min(1e-300)
    normalised = sigma / top
    energy = eig / eig.sum(-1, keepdim=True).clamp_min(1e-300)
    return {
        "singular_values": normalised,
        "energy_top1": energy[..., 0],
        "energy_top10": energy[..., :10].sum(-1),
        "cdf_auc": 1 - normalised.mean(-1),
    }


def spectrum_of_moments(mean: Tensor, cov: Tensor, num_tokens: int) -> dict[str, Tensor]:
    """spectrum() of the uncentred token matrix whose mean [layers, hidden] and covariance [layers, h, h] these are
    (synced moments already at hand, e.g. a CovarianceResult's, or a Variant's `moments` of them: one pass over the
    tokens serves every variant)."""
    return spectrum(cov + mean.unsqueeze(2) * mean.unsqueeze(1), num_tokens)


class SequenceSpectrum(Metric):
    """Token uniformity per sequence, as tokenUni measures it (Yan et al. 2022): the singular values of each
    sentence's own token matrix [its tokens, hidden] per layer (padding excluded), divided by the sentence's largest,
    pooled over sentences. States (sums, fixed size): per layer and rank k the sum of the k-th normalised singular
    value over the sentences that have one, the sum of sigma_1^2 / sum sigma^2, and the sum of all normalised values.

    compute() -> {"spectrum" [layers, ranks] (mean normalised sigma_k over sentences with at least k + 1 of them),
    "energy_top1" [layers] (mean over sentences of sigma_1^2 / sum sigma^2), "cdf_auc" [layers] (area under the
    empirical CDF of all pooled normalised values on [0, 1], i.e. 1 - their mean), "num_sentences"}.
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    def __init__(self, num_layers: int, max_rank: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_layers, self.max_rank = num_layers, max_rank
        self.add_state("rank_sum", torch.zeros(num_layers, max_rank, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("rank_count", torch.zeros(max_rank, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("energy_sum", torch.zeros(num_layers, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("value_sum", torch.zeros(num_layers, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("value_count", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("sentences", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, hidden_states: Tensor, mask: Tensor) -> None:
        """hidden_states [layers, batch, seq, hidden], mask [batch, seq] (the tokens that count)."""
        if hidden_states.dim() != 4 or hidden_states.shape[0] != self.num_layers:
            raise ValueError(f"hidden states {tuple(hidden_states.shape)} are not [{self.num_layers}, batch, seq, "
                             "hidden]")
        counts = mask.sum(1)  # [batch]
        keep = counts > 0
        if not bool(keep.any()):
            return
        tokens = hidden_states[:, keep].float() * mask[keep].to(hidden_states.device)[None, :, :, None]
        sigma = _one_thread(torch.linalg.svdvals, tokens).double()  # [layers, sentences, min(seq, hidden)], descending
        ranks = min(sigma.shape[-1], self.max_rank)
        sigma = sigma[..., :ranks]
        valid = torch.arange(ranks, device=sigma.device)[None, :] < counts[keep].to(sigma.device)[:, None]  # [s, k]
        normalised = sigma / sigma[..., :1].clamp_min(1e-300) * valid
        squares = sigma.pow(2) * valid
        self.rank_sum[:, :ranks] += normalised.sum(1)
        self.rank_count[:ranks] += valid.sum(0).double()
        self.energy_sum += (squares[..., 0] / squares.sum(-1).clamp_min(1e-300)).sum(1)
        self.value_sum += normalised.sum((1, 2))
        self.value_count += valid.sum().double()
        self.sentences += int(keep.sum())

    def compute(self) -> dict:
        seen = int((self.rank_count > 0).sum())
        return {"spectrum": self.rank_sum[:, :seen] / self.rank_count[:seen].clamp_min(1),
                "energy_top1": self.energy_sum / self.sentences.clamp_min(1),
                "cdf_auc": 1 - self.value_sum / self.value_count.clamp_min(1),
                "num_sentences": int(self.sentences.item())}


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
