"""Isotropy and spectra of hidden-state spaces: IsoScore, IsoScore*, singular-value spectra (corpus-wide and per
sentence), and the one-thread linear algebra they and metrics/transforms.py share.

    cov = Covariance(13, 768); cov.update(hidden_states, mask)      # metrics/geometry.py: the streamed moments
    result = cov.compute()
    isoscore(result.cov)                            # [layers]  (Rudman et al. 2022)
    isoscore_star(points, zeta=0.2, shrinkage=c0)   # a mini-batch [..., m, n]; differentiable (I-STAR's term)
    spectrum_of_moments(*variant.moments(result.mean, result.cov), result.num_tokens)["singular_values"]
    spectra = SequenceSpectrum(13, max_rank=64); spectra.update(hidden_states, mask)   # tokenUni's per sentence

Every Metric here has fixed-size tensor states reduced by sum: exact under DDP, memory independent of the tokens.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from metrics.base import Metric


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

    def compute(self) -> Tensor:  # [layers]; nan without a mini-batch of 2 points or more
        return torch.where(self.batches > 0, self.score_sum / self.batches.clamp_min(1), float("nan"))


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
