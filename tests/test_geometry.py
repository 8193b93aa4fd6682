"""Geometry and similarity metrics against hand-computed values, direct computations on materialised tensors,
scipy, and a 2-process DDP run."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from scipy.stats import rankdata, spearmanr

from metrics.geometry import Covariance, MeanCosine, SelfSimilarity, TokenSample, cosine
from metrics.intra_sentence import IntraSentenceSimilarity
from metrics.isotropy import IsoScoreStar, isoscore, isoscore_star, spectrum, spectrum_of_moments
from metrics.similarity import PairCosine, average_ranks, pearson, spearman, threshold_accuracy
from metrics.transforms import Clipping, keep_mask, standardization, whitening, zero_dims
from tests.tiny import free_port

LAYERS, HIDDEN = 2, 6


def test_anisotropy_of_identical_vectors_is_one_and_of_orthogonal_vectors_zero():
    metric = MeanCosine(1)
    a = torch.tensor([[[1.0, 2.0, 0.0], [0.0, 0.0, 3.0]]])  # [layers=1, pairs=2, hidden=3]
    metric.update(a, 5 * a)  # same direction
    assert metric.compute().item() == pytest.approx(1.0)
    metric.reset()
    metric.update(a, torch.tensor([[[2.0, -1.0, 0.0], [1.0, 0.0, 0.0]]]))  # each pair orthogonal
    assert metric.compute().item() == pytest.approx(0.0, abs=1e-7)
    metric.reset()
    metric.update(torch.tensor([[[1.0, 0.0]]]), torch.tensor([[[1.0, 1.0]]]))  # 45 degrees
    assert metric.compute().item() == pytest.approx(1 / math.sqrt(2))


def test_mean_cosine_streaming_equals_direct():
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, LAYERS, 50, HIDDEN, generator=generator)
    metric = MeanCosine(LAYERS)
    for start in range(0, 50, 7):
        metric.update(a[:, start:start + 7], b[:, start:start + 7])
    direct = torch.nn.functional.cosine_similarity(a, b, dim=-1).double().mean(1)
    torch.testing.assert_close(metric.compute(), direct, rtol=0, atol=1e-6)


def test_self_similarity_by_hand_and_against_all_pairs():
    metric = SelfSimilarity(num_words=2, num_layers=1, hidden_size=2)
    e1, e2 = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 3.0])
    # word 0: e1, 2 e1, e2 -> pairwise cosines 1, 0, 0 -> 1/3; word 1: e1, (1, 1) -> cos 1/sqrt 2
    vectors = torch.stack([e1, 2 * e1, e2, e1, torch.tensor([1.0, 1.0])]).unsqueeze(0)
    metric.update(torch.tensor([0, 0, 0, 1, 1]), vectors)
    result = metric.compute()
    assert result.per_word[0, 0].item() == pytest.approx(1 / 3)
    assert result.per_word[1, 0].item() == pytest.approx(1 / math.sqrt(2))
    assert result.mean.item() == pytest.approx((1 / 3 + 1 / math.sqrt(2)) / 2)

    generator = torch.Generator().manual_seed(1)
    words = torch.randint(0, 4, (60,), generator=generator)
    vectors = torch.randn(LAYERS, 60, HIDDEN, generator=generator) + 2.0
    vectors[:, 5] = 0  # a zero vector (fully clipped) counts with cosine 0 against everything
    metric = SelfSimilarity(4, LAYERS, HIDDEN)
    for start in range(0, 60, 11):
        metric.update(words[start:start + 11], vectors[:, start:start + 11])
    result = metric.compute()
    unit = torch.nn.functional.normalize(vectors.double(), dim=-1)
    for word in range(4):
        index = (words == word).nonzero().flatten().tolist()
        pairs = [(i, j) for i in index for j in index if i < j]
        direct = torch.stack([(unit[:, i] * unit[:, j]).sum(-1) for i, j in pairs]).mean(0)
        torch.testing.assert_close(result.per_word[word], direct, rtol=0, atol=1e-6)  # float32 unit vectors
        assert result.counts[word] == len(index)


def test_self_similarity_needs_two_contexts():
    metric = SelfSimilarity(3, 1, 2)
    metric.update(torch.tensor([0, 0, 1]), torch.tensor([[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]]))
    result = metric.compute()
    assert result.num_words == 1 and math.isnan(result.per_word[1, 0]) and math.isnan(result.per_word[2, 0])
    assert result.mean.item() == pytest.approx(1.0)


def planted_tokens(seed: int = 2, n: int = 300) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randn(LAYERS, n, HIDDEN, generator=generator) @ torch.randn(HIDDEN, HIDDEN, generator=generator)
    tokens[:, :, 3] = 500.0 + 0.01 * tokens[:, :, 3]  # mean dwarfs the spread (float32 cancellation bait)
    return tokens


def test_covariance_streaming_equals_direct_with_a_huge_mean_dimension():
    tokens = planted_tokens()
    hidden = tokens.reshape(LAYERS, 30, 10, HIDDEN)  # [layers, batch, seq, hidden]
    mask = torch.rand(30, 10, generator=torch.Generator().manual_seed(3)) > 0.3
    metric = Covariance(LAYERS, HIDDEN)
    for start in range(0, 30, 4):
        metric.update(hidden[:, start:start + 4], mask[start:start + 4])
    result = metric.compute()
    kept = hidden[:, mask].double()  # [layers, N, hidden]
    assert result.num_tokens == kept.shape[1]
    for layer in range(LAYERS):
        torch.testing.assert_close(result.cov[layer], torch.cov(kept[layer].T, correction=0), rtol=1e-4, atol=1e-9)
        torch.testing.assert_close(result.second_moment[layer], kept[layer].T @ kept[layer] / kept.shape[1],
                                   rtol=1e-7, atol=1e-6)
    assert result.cov[:, 3, 3].min() > 0.5e-4  # the planted dimension keeps its tiny variance


def one_thread(function, *args):
    """LAPACK's threaded SVD / eigensolvers are many times slower than one thread on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return function(*args)
    finally:
        torch.set_num_threads(threads)


def isoscore_reference(points: np.ndarray) -> float:
    """IsoScore, step by step as in Rudman et al. (2022): PCA-reorient, variances, normalise, defect, rescale."""
    centred = points - points.mean(0)
    _, _, components = one_thread(torch.linalg.svd, torch.from_numpy(centred), False)
    reoriented = centred @ components.numpy().T
    variances = np.diag(np.cov(reoriented.T))
    n = len(variances)
    normalised = variances * np.sqrt(n) / np.linalg.norm(variances)
    defect = np.linalg.norm(normalised - 1) / np.sqrt(2 * (n - np.sqrt(n)))
    phi = (n - defect ** 2 * (n - np.sqrt(n))) ** 2 / n ** 2
    return (n * phi - 1) / (n - 1)


def isoscore_of_covariance_reference(cov: np.ndarray) -> float:
    """IsoScore of a covariance as in Rudman et al. (2022): the variances in the PCA basis are its eigenvalues (numpy),
    zeros included when it is rank-deficient; then normalise, defect, rescale, step by step."""
    variances = np.linalg.eigvalsh(cov).clip(min=0)
    n = len(variances)
    normalised = variances * np.sqrt(n) / np.linalg.norm(variances)
    defect = np.linalg.norm(normalised - 1) / np.sqrt(2 * (n - np.sqrt(n)))
    phi = (n - defect ** 2 * (n - np.sqrt(n))) ** 2 / n ** 2
    return (n * phi - 1) / (n - 1)


def test_isoscore_near_one_for_isotropic_near_zero_for_rank_one_and_equal_to_the_algorithm():
    generator = torch.Generator().manual_seed(4)
    gaussian = torch.randn(20000, 8, generator=generator, dtype=torch.float64)
    assert isoscore(torch.cov(gaussian.T)).item() > 0.99
    line = torch.randn(5000, 1, generator=generator, dtype=torch.float64) * torch.randn(1, 8, dtype=torch.float64)
    assert abs(isoscore(torch.cov(line.T)).item()) < 1e-6
    skewed = torch.randn(400, 8, generator=generator, dtype=torch.float64) * torch.linspace(0.1, 3.0, 8)
    assert isoscore(torch.cov(skewed.T)).item() == pytest.approx(isoscore_reference(skewed.numpy()), abs=1e-9)
    # Hand value: variances (1, 0): normalised (sqrt 2, 0), delta = 1, phi = (2 - (2 - sqrt 2))^2 / 4 = 1/2 -> 0.
    assert isoscore(torch.diag(torch.tensor([1.0, 0.0]))).item() == pytest.approx(0.0, abs=1e-12)


def test_isoscore_of_the_streamed_covariance_per_layer():
    """analyze.py isotropy's IsoScore: of the covariance streamed batch by batch, per layer, against the reference."""
    tokens = planted_tokens(5)
    metric = Covariance(LAYERS, HIDDEN)
    for start in range(0, tokens.shape[1], 64):
        metric.update(tokens[:, start:start + 64])
    expected = torch.tensor([isoscore_reference(tokens[layer].double().numpy()) for layer in range(LAYERS)])
    torch.testing.assert_close(isoscore(metric.compute().cov), expected.double(), rtol=0, atol=1e-4)


def test_isoscore_star_shrinkage_limits_stability_and_gradient():
    generator = torch.Generator().manual_seed(6)
    population = torch.randn(20000, 16, generator=generator, dtype=torch.float64) * torch.linspace(0.5, 2, 16)
    full = torch.cov(population.T)
    small = population[:40]
    assert isoscore_star(small, 0.0).item() == pytest.approx(isoscore_reference(small.numpy()), abs=1e-9)
    batch = population[:10]  # fewer points than dimensions: the sample covariance is rank-deficient
    sample = np.cov(batch.numpy().T)  # unbiased, rank 9 of 16
    assert isoscore_star(batch, 0.0).item() == pytest.approx(isoscore_of_covariance_reference(sample), abs=1e-9)
    for zeta, given, target in ((0.2, full, full.numpy()), (0.5, None, np.eye(16))):  # C0 default: the identity
        shrunk = isoscore_of_covariance_reference((1 - zeta) * sample + zeta * target)  # C_zeta = (1 - zeta) C + zeta C0
        assert isoscore_star(batch, zeta, given).item() == pytest.approx(shrunk, abs=1e-9), zeta
    truth = isoscore(full).item()
    assert truth == pytest.approx(isoscore_of_covariance_reference(full.numpy()), abs=1e-9)
    assert isoscore_star(batch, 1.0, full).item() == pytest.approx(truth, abs=1e-12)
    # Mini-batches of 10 points underestimate the population's IsoScore; shrinking towards the covariance of many
    # points removes more of that bias the larger zeta.
    errors = [abs(torch.stack([isoscore_star(population[i:i + 10], zeta, full) for i in range(0, 500, 10)])
                  .mean().item() - truth) for zeta in (0.0, 0.2, 0.5, 0.8)]
    assert errors == sorted(errors, reverse=True) and errors[-1] < errors[0] / 4
    star = torch.stack([isoscore_star(population[i:i + 10], 0.2, full) for i in range(0, 500, 10)])
    metric = IsoScoreStar(1, 16, zeta=0.2, shrinkage=full)
    for i in range(0, 500, 10):
        metric.update(population[i:i + 10].unsqueeze(0))
    assert metric.compute().item() == pytest.approx(star.mean().item(), abs=1e-12)
    lonely = IsoScoreStar(1, 16, zeta=0.2, shrinkage=full)  # one-point mini-batches have no covariance: skipped
    lonely.update(population[:1].unsqueeze(0))
    assert lonely.compute().isnan().all()  # not a score of 0
    # Differentiable: the autograd gradient matches a central finite difference.
    points = batch.clone().requires_grad_(True)
    isoscore_star(points, 0.2, full).backward()
    bumped = [batch.clone(), batch.clone()]
    bumped[0][3, 5] += 1e-6
    bumped[1][3, 5] -= 1e-6
    numeric = (isoscore_star(bumped[0], 0.2, full) - isoscore_star(bumped[1], 0.2, full)).item() / 2e-6
    assert points.grad[3, 5].item() == pytest.approx(numeric, rel=1e-4, abs=1e-9)


def test_spectrum_equals_singular_values_of_the_token_matrix():
    tokens = planted_tokens(7)[0].double()  # [N, hidden]
    metric = Covariance(1, HIDDEN)
    metric.update(tokens.unsqueeze(0))
    result = metric.compute()
    spec = spectrum(result.second_moment, result.num_tokens)
    sigma = torch.linalg.svdvals(tokens)
    torch.testing.assert_close(spec["singular_values"][0], sigma / sigma[0], rtol=1e-5, atol=1e-8)
    assert spec["energy_top1"][0].item() == pytest.approx((sigma[0] ** 2 / sigma.pow(2).sum()).item(), rel=1e-6)
    grid = np.linspace(0, 1, 200001)
    values = (sigma / sigma[0]).numpy()
    cdf = (values[None, :] <= grid[:, None]).mean(1)
    assert spec["cdf_auc"][0].item() == pytest.approx(np.trapezoid(cdf, grid), abs=1e-4)


def test_spectrum_of_streamed_moments_is_the_singular_values_of_the_uncentred_token_matrix():
    """spectrum_of_moments (the singular values of each layer's token matrix, uncentred as tokenUni) of a Covariance
    fed masked batches equals torch.linalg.svdvals of the materialised matrix, also of clipped and whitened tokens
    (the variant's moments)."""
    tokens = planted_tokens(13).double()
    hidden = tokens.reshape(LAYERS, 30, 10, HIDDEN)
    mask = torch.rand(30, 10, generator=torch.Generator().manual_seed(14)) > 0.3
    cov = Covariance(LAYERS, HIDDEN)
    for start in range(0, 30, 4):
        cov.update(hidden[:, start:start + 4], mask[start:start + 4])
    kept = hidden[:, mask]  # [layers, N, hidden]
    stats = cov.compute()
    whiten, clip = whitening(stats), Clipping([3], LAYERS)

    def of(moments):
        return spectrum_of_moments(*moments(stats.mean, stats.cov), stats.num_tokens)

    raw = of(lambda mean, cov: (mean, cov))
    for result, matrix in ((raw, kept), (of(clip.moments), clip.apply(kept)), (of(whiten.moments), whiten.apply(kept))):
        for layer in range(LAYERS):
            sigma = one_thread(torch.linalg.svdvals, matrix[layer])  # uncentred, not of kept - mean
            torch.testing.assert_close(result["singular_values"][layer], sigma / sigma[0], rtol=1e-5, atol=1e-6)
            share = (sigma[0] ** 2 / sigma.pow(2).sum()).item()
            assert result["energy_top1"][layer].item() == pytest.approx(share, rel=1e-5)
    centred = one_thread(torch.linalg.svdvals, kept[0] - kept[0].mean(0))
    assert not torch.allclose(raw["singular_values"][0], centred / centred[0], atol=1e-3)


def state_bytes(metric) -> dict[str, tuple]:
    return {name: (tuple(value.shape), value.numel() * value.element_size())
            for name, value in metric.metric_state.items()}


def test_metric_states_stay_fixed_size_with_ten_times_the_data():
    """Streaming: every state tensor keeps its shape and bytes whatever the number of tokens, pairs or words seen,
    and the total is what the constructor arguments give (float64 states, 8 bytes a number)."""
    words, pairs = 7, 40
    metrics = {
        "mean": (MeanCosine(LAYERS), LAYERS + 1),
        "selfsim": (SelfSimilarity(words, LAYERS, HIDDEN), words * LAYERS * HIDDEN + words * LAYERS + words),
        "cov": (Covariance(LAYERS, HIDDEN), 1 + LAYERS * HIDDEN + LAYERS * HIDDEN * HIDDEN),
        "star": (IsoScoreStar(LAYERS, HIDDEN), LAYERS + 1),
        "pairs": (PairCosine(pairs, LAYERS), pairs * LAYERS + pairs),
        "intra": (IntraSentenceSimilarity(LAYERS), LAYERS + 1),
    }
    generator = torch.Generator().manual_seed(15)

    def feed(metric, name: str, n: int) -> None:
        a, b = torch.randn(2, LAYERS, n, HIDDEN, generator=generator)
        if name == "mean":
            metric.update(a, b)
        elif name == "selfsim":
            metric.update(torch.randint(0, words, (n,), generator=generator), a)
        elif name in ("cov", "star"):
            metric.update(a)
        elif name == "intra":  # n tokens of n // 4 sentences
            metric.update(a, sentences=torch.randint(0, n // 4, (n,), generator=generator))
        else:
            ids = torch.randint(0, pairs, (min(n, pairs),), generator=generator).unique()
            metric.update(ids, a[:, :len(ids)], b[:, :len(ids)])

    for name, (metric, numbers) in metrics.items():
        feed(metric, name, 20)
        before = state_bytes(metric)
        assert sum(size for _, size in before.values()) == 8 * numbers, name
        for _ in range(10):
            feed(metric, name, 200)  # 10 x the data, in batches 10 x larger
        assert state_bytes(metric) == before, name


def test_whitening_gives_identity_covariance_and_standardisation_unit_variance():
    generator = torch.Generator().manual_seed(8)
    rotation = torch.linalg.qr(torch.randn(HIDDEN, HIDDEN, generator=generator))[0]
    mixing = torch.diag(torch.linspace(0.5, 3.0, HIDDEN)) @ rotation  # correlated dims, condition number 36
    tokens = torch.randn(LAYERS, 300, HIDDEN, generator=generator) @ mixing + torch.linspace(-5, 5, HIDDEN)
    metric = Covariance(LAYERS, HIDDEN)
    metric.update(tokens)
    stats = metric.compute()
    whitened = whitening(stats).apply(tokens).double()
    standardised = standardization(stats).apply(tokens).double()
    for layer in range(LAYERS):
        torch.testing.assert_close(torch.cov(whitened[layer].T, correction=0), torch.eye(HIDDEN, dtype=torch.float64),
                                   rtol=0, atol=1e-5)
        torch.testing.assert_close(whitened[layer].mean(0), torch.zeros(HIDDEN, dtype=torch.float64), rtol=0,
                                   atol=1e-5)
        torch.testing.assert_close(standardised[layer].std(0, correction=0), torch.ones(HIDDEN, dtype=torch.float64),
                                   rtol=1e-5, atol=0)
    for variant in (whitening(stats), standardization(stats), Clipping([3, 1], LAYERS)):
        transformed = variant.apply(tokens).double()
        mean, cov = variant.moments(stats.mean, stats.cov)
        for layer in range(LAYERS):
            direct_cov = torch.cov(transformed[layer].T, correction=0)
            torch.testing.assert_close(cov[layer], direct_cov, rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(mean[layer], transformed[layer].mean(0), rtol=1e-5, atol=1e-5)


def test_whitening_beside_a_massive_activation_keeps_every_ordinary_direction():
    """A massive activation (Sun et al. 2024: |x| ~ 3000 at each sentence's first token) has variance ~3.6e5, 1e5 times
    the ordinary directions' (1 .. 1e-2). A floor relative to the largest eigenvalue dropped every ordinary direction
    below 0.36; the streamed float32 covariance knows them to 1e-5, so whitening must give them unit variance and the
    cosines of float64 whitening (Su et al.: (x - mu) U Lambda^-1/2 of the exact covariance). What is rounding is still
    dropped: LayerNorm's null direction, and a dimension constant up to float32 rounding."""
    generator = torch.Generator().manual_seed(21)
    hidden, seq, sentences = 16, 25, 200
    rotation = torch.linalg.qr(torch.randn(hidden - 1, hidden - 1, generator=generator, dtype=torch.float64))[0]
    spread = torch.logspace(0, -2, hidden - 1, dtype=torch.float64).sqrt()
    exact = torch.zeros(sentences, seq, hidden, dtype=torch.float64)
    exact[..., 1:] = (torch.randn(sentences, seq, hidden - 1, generator=generator, dtype=torch.float64) * spread) \
        @ rotation.T
    exact[:, 0, 0] = 3000 + torch.randn(sentences, generator=generator, dtype=torch.float64)
    exact[:, 1:, 0] = 0.1 * torch.randn(sentences, seq - 1, generator=generator, dtype=torch.float64)
    tokens = exact.float().reshape(1, -1, hidden)
    metric = Covariance(1, hidden)
    for chunk in tokens.split(500, dim=1):
        metric.update(chunk)
    whitened = whitening(metric.compute()).apply(tokens)[0].double()
    torch.testing.assert_close(torch.cov(whitened.T, correction=0), torch.eye(hidden, dtype=torch.float64), rtol=0,
                               atol=1e-4)
    flat = tokens[0].double()  # the float32 values, whitened in float64 from their exact covariance
    eigenvalues, vectors = torch.linalg.eigh(torch.cov(flat.T, correction=0))
    reference = (flat - flat.mean(0)) @ (vectors * eigenvalues.rsqrt())
    first, second = torch.arange(0, 400, 2), torch.arange(1, 400, 2)
    torch.testing.assert_close(cosine(whitened[first], whitened[second]), cosine(reference[first], reference[second]),
                               rtol=0, atol=1e-4)
    norm = torch.nn.LayerNorm(hidden - 1)  # its outputs' null direction (sum of (y - bias) / gain is 0) is rounding
    norm.weight.data = 0.5 + torch.rand(hidden - 1, generator=generator)
    with torch.no_grad():
        normed = norm(torch.randn(1, 4000, hidden - 1, generator=generator) * 3 + 20 * torch.eye(hidden - 1)[5])
    normed = torch.cat([normed[..., :2], torch.full((1, 4000, 1), 0.75), normed[..., 2:]], -1)  # dim 2: constant
    metric = Covariance(1, hidden)
    metric.update(normed)
    matrix = whitening(metric.compute()).matrix[0]
    assert int((matrix.abs().sum(0) > 0).sum()) == hidden - 2 and matrix[2].abs().max() == 0
    whitened = whitening(metric.compute()).apply(normed)[0].double()
    columns = matrix.abs().sum(0) > 0
    kept = torch.cov(whitened[:, columns].T, correction=0)
    torch.testing.assert_close(kept, torch.eye(hidden - 2, dtype=torch.float64), rtol=0, atol=1e-4)


def test_standardisation_maps_a_dimension_constant_up_to_rounding_to_zero():
    """A dimension constant up to float32 rounding (a last-layer LayerNorm weight near 0: MiniLM's layer 6) would
    otherwise be divided by its rounding noise and swamp every cosine."""
    tokens = torch.randn(1, 200, HIDDEN, generator=torch.Generator().manual_seed(16), dtype=torch.float64)
    tokens[..., 2] = 0.75 + 1e-9 * tokens[..., 2]  # variance 1e-18, far below float32 rounding of 0.75 (1e-6 × 1)^2
    metric = Covariance(1, HIDDEN)
    metric.update(tokens)
    standardised = standardization(metric.compute()).apply(tokens)
    assert standardised[..., 2].abs().max() == 0
    others = [d for d in range(HIDDEN) if d != 2]
    torch.testing.assert_close(standardised[0][:, others], (tokens[0][:, others] - tokens[0][:, others].mean(0))
                               / tokens[0][:, others].std(0, correction=0), rtol=1e-6, atol=1e-6)


def test_standardisation_keeps_a_low_variance_dimension_beside_a_rogue_one():
    """Timkey & van Schijndel's rogue dimensions: one variance 1e8, beside a genuine dimension of variance 1e-3 (mean
    5: far above float32 rounding, 1e-6 × 5) and one constant at 0.75. Only the constant one is zeroed; the rule is
    per dimension, not relative to the layer's largest variance (1e-6 × 1e8 = 100 would zero the 1e-3 one)."""
    generator = torch.Generator().manual_seed(17)
    tokens = torch.randn(1, 300, HIDDEN, generator=generator)  # float32, as hidden states are
    tokens[..., 0] = 1e4 * tokens[..., 0]  # rogue: variance ~1e8
    tokens[..., 1] = 5 + 1e-3 ** 0.5 * tokens[..., 1]  # genuine: variance ~1e-3
    tokens[..., 2] = 0.75
    metric = Covariance(1, HIDDEN)
    metric.update(tokens)
    standardised = standardization(metric.compute()).apply(tokens).double()
    x = tokens[0].double()
    assert x[:, 0].var() > 1e7 and 1e-4 < x[:, 1].var() < 1e-2
    assert standardised[..., 2].abs().max() == 0
    others = [d for d in range(HIDDEN) if d != 2]  # the rogue and the genuine dimension among them
    direct = (x[:, others] - x[:, others].mean(0)) / x[:, others].std(0, correction=0)
    torch.testing.assert_close(standardised[0][:, others], direct, rtol=1e-4, atol=1e-4)


def test_clipping_variant_zeroes_exactly_its_dims_in_every_layer():
    tokens = planted_tokens(9)
    clipped = Clipping([3, 0], LAYERS).apply(tokens)
    by_hand = tokens.clone()
    by_hand[..., [0, 3]] = 0
    assert torch.equal(clipped, by_hand)
    assert torch.equal(clipped, zero_dims(tokens, keep_mask({0: [0, 3], 1: [3, 0]}, LAYERS, HIDDEN)))
    per_layer = zero_dims(tokens, keep_mask({1: [2]}, LAYERS, HIDDEN))  # one dim in one layer only
    assert torch.equal(per_layer[0], tokens[0]) and per_layer[1][..., 2].abs().max() == 0
    assert torch.equal(per_layer[1][..., [0, 1, 3]], tokens[1][..., [0, 1, 3]])


def test_average_ranks_spearman_pearson_against_scipy():
    generator = torch.Generator().manual_seed(10)
    x = torch.randint(0, 6, (40, 3), generator=generator).double()  # many ties
    y = torch.randn(40, generator=generator, dtype=torch.float64).round(decimals=1)
    for column in range(3):
        assert np.allclose(average_ranks(x[:, column]).numpy(), rankdata(x[:, column].numpy()))
    rho = spearman(x, y)
    for column in range(3):
        assert rho[column].item() == pytest.approx(spearmanr(x[:, column], y).statistic, abs=1e-12)
    assert pearson(x[:, 0], y).item() == pytest.approx(np.corrcoef(x[:, 0], y)[0, 1], abs=1e-12)
    assert math.isnan(spearman(torch.ones(5), torch.arange(5.0)).item())


def test_pair_cosine_and_threshold_accuracy_against_a_loop():
    generator = torch.Generator().manual_seed(11)
    a, b = torch.randn(2, LAYERS, 20, HIDDEN, generator=generator)
    metric = PairCosine(20, LAYERS)
    for ids in torch.randperm(20, generator=generator).split(6):  # pairs arrive in any order
        metric.update(ids, a[:, ids], b[:, ids])
    cosines, seen = metric.compute()
    assert bool(seen.all())
    torch.testing.assert_close(cosines, torch.nn.functional.cosine_similarity(a, b, dim=-1).T.double(), rtol=0,
                               atol=1e-6)
    labels = torch.rand(20, generator=generator) > 0.5
    thresholds = torch.tensor([-0.5, 0.0, 0.3])
    accuracy = threshold_accuracy(cosines, labels, thresholds)
    for layer in range(LAYERS):
        for t, threshold in enumerate(thresholds.tolist()):
            hits = sum((cosines[p, layer].item() >= threshold) == bool(labels[p]) for p in range(20))
            assert accuracy[layer, t].item() == pytest.approx(hits / 20)


def test_token_sample_fills_its_slots():
    metric = TokenSample(5, LAYERS, HIDDEN)
    vectors = torch.randn(LAYERS, 2, HIDDEN)
    metric.update(torch.tensor([4, 1]), vectors)
    sample, filled = metric.compute()
    assert filled.tolist() == [False, True, False, False, True]
    assert torch.equal(sample[4], vectors[:, 0]) and torch.equal(sample[1], vectors[:, 1])
    assert sum(s.numel() for s in metric.metric_state.values()) == 5 * LAYERS * HIDDEN + 5


def ddp_inputs():
    generator = torch.Generator().manual_seed(12)
    words = torch.randint(0, 5, (33,), generator=generator)
    vectors = torch.randn(LAYERS, 33, HIDDEN, generator=generator) + 1.0
    a, b = torch.randn(2, LAYERS, 33, HIDDEN, generator=generator)
    return words, vectors, a, b


def all_metrics():
    return {"selfsim": SelfSimilarity(5, LAYERS, HIDDEN), "pairs": PairCosine(33, LAYERS), "cov": Covariance(LAYERS, HIDDEN),
            "mean": MeanCosine(LAYERS), "sample": TokenSample(33, LAYERS, HIDDEN), "intra": IntraSentenceSimilarity(LAYERS)}


def feed(metrics, items):
    words, vectors, a, b = ddp_inputs()
    sentences = a.reshape(LAYERS, 11, 3, HIDDEN).repeat(1, 3, 1, 1)  # 33 padded sentences of 0-3 tokens
    lengths = torch.arange(33) % 4
    for chunk in torch.tensor(items, dtype=torch.long).split(4):
        metrics["intra"].update(sentences[:, chunk], torch.arange(3) < lengths[chunk].unsqueeze(1))
        metrics["selfsim"].update(words[chunk], vectors[:, chunk])
        metrics["pairs"].update(chunk, a[:, chunk], b[:, chunk])
        metrics["cov"].update(vectors[:, chunk])
        metrics["mean"].update(a[:, chunk], b[:, chunk])
        metrics["sample"].update(chunk, vectors[:, chunk])
    computed = {name: metric.compute() for name, metric in metrics.items()}
    cov = computed["cov"]
    clipped = spectrum_of_moments(*Clipping([1], LAYERS).moments(cov.mean, cov.cov), cov.num_tokens)
    return {"selfsim": computed["selfsim"].per_word, "pairs": computed["pairs"][0], "cov": cov.cov,
            "intra": computed["intra"].mean, "intra_sentences": computed["intra"].num_sentences,
            "mean": computed["mean"], "sample": computed["sample"][0], "iso": isoscore(cov.cov),
            "spectrum_of": clipped["singular_values"]}


def _ddp_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = feed(all_metrics(), list(range(rank, 33, world)))  # uneven shards: 17 and 16 items
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


def test_ddp_two_processes_equal_one(tmp_path):
    out = str(tmp_path / "synced.pt")
    mp.start_processes(_ddp_worker, args=(2, free_port(), out), nprocs=2, start_method="spawn", join=True)
    synced, single = torch.load(out), feed(all_metrics(), list(range(33)))
    for name, value in single.items():
        torch.testing.assert_close(synced[name], value, rtol=1e-6, atol=1e-7, equal_nan=True, msg=name)


def test_sequence_spectra_of_a_clipping_that_zeroes_nothing_are_the_raw_ones_without_a_second_svd(
        tmp_path, bert_tok, monkeypatch):
    """`--clip auto` on a model without outliers clips nothing: its per-sequence spectra are the raw states' (no
    second SVD of every sentence and layer: counted), equal to a SequenceSpectrum fed the clipped states directly; a
    clipping of some dims still gets its own."""
    from analyses.geometry import sequence_spectra
    from analyses.reference import Setting
    from lightning_modules.encoder import load_encoder
    from metrics.isotropy import SequenceSpectrum
    from metrics.transforms import RAW, Clipping
    from tests.tiny import corpus_sentences, save_tiny_encoder

    encoder = load_encoder(save_tiny_encoder(tmp_path / "bert", "bert", bert_tok), device="cpu")
    texts = [text for text in corpus_sentences(30, start=300) if text][:9]
    setting = Setting(encoder, batch_size=4, progress=False)
    layers, width = encoder.num_hidden_states, min(encoder.max_length, encoder.hidden_size)
    updates, update = [], SequenceSpectrum.update
    monkeypatch.setattr(SequenceSpectrum, "update", lambda self, *args: (updates.append(1), update(self, *args))[1])
    for clip in (Clipping([], layers), Clipping([1, 5], layers)):
        updates.clear()
        spectra = sequence_spectra(setting, texts, [RAW, clip])
        batches = list(encoder.batches(texts, batch_size=4, progress=False))
        assert len(updates) == len(batches) * (1 if not clip.spec else 2)
        direct = SequenceSpectrum(layers, width)
        for batch in batches:
            direct.update(clip.apply(batch.hidden_states), batch.mask)
        expected = direct.compute()
        for key in ("spectrum", "energy_top1", "cdf_auc"):
            torch.testing.assert_close(spectra["clipped"][key], expected[key], rtol=1e-6, atol=1e-9)
        assert spectra["clipped"]["num_sentences"] == expected["num_sentences"] == len(texts)
        if clip.spec:
            assert not torch.allclose(spectra["clipped"]["spectrum"], spectra["raw"]["spectrum"])


@pytest.mark.parametrize("clip, normalize, passes", [("none", "none", 1), ("1,5", "softdecay", 1),
                                                     ("none", "whiten", 2)])
def test_isotropy_encodes_the_sentences_once_unless_a_variant_is_fitted_by_the_first_pass(
        tmp_path, bert_tok, monkeypatch, clip, normalize, passes):
    """`analyze.py isotropy` takes the per-sequence spectra of the variants known before its reference pass (raw, a
    clipping of given dims, SoftDecay) from that pass's forward: one encoder pass over the sentences (the encoder's
    forwards counted), two only when a variant is estimated by the first (whiten). isotropy.json equals the one of
    the two-pass path (every variant's spectra from a second pass, as before), and its raw sequence spectra those of
    a SequenceSpectrum fed the encoder's batches directly."""
    import json

    import analyze
    from analyses import geometry
    from lightning_modules.encoder import FrozenEncoder, load_encoder
    from metrics.isotropy import SequenceSpectrum
    from tests.tiny import corpus_sentences, save_tiny_encoder

    model = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    texts = [text for text in corpus_sentences(60, start=300) if text][:30]
    (tmp_path / "s.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    forwards, forward = [], FrozenEncoder.forward
    monkeypatch.setattr(FrozenEncoder, "forward", lambda self, *a, **k: (forwards.append(1), forward(self, *a, **k))[1])

    def isotropy(out: str) -> dict:
        forwards.clear()
        assert analyze.main(["isotropy", "--encoder", str(model), "--data", str(tmp_path / "s.txt"), "--max_sentences",
                             "0", "--max_length", "32", "--batch_size", "8", "--no_progress", "--clip", clip,
                             "--normalize", normalize, "--output_dir", str(tmp_path / out)]) == 0
        return json.loads((tmp_path / out / "isotropy.json").read_text())

    batches = math.ceil(len(texts) / 8)
    report = isotropy("one")
    assert len(forwards) == passes * batches
    with monkeypatch.context() as old:
        old.setattr(geometry.SpectraFeed, "holds", lambda self, variant: False)  # every variant from a second pass
        before = isotropy("two")
    assert len(forwards) == 2 * batches
    assert report == before

    encoder = load_encoder(model, device="cpu")
    direct = SequenceSpectrum(encoder.num_hidden_states, min(32, encoder.hidden_size))
    for batch in encoder.batches(texts, batch_size=8, max_length=32, progress=False):
        direct.update(batch.hidden_states, batch.mask)
    expected = direct.compute()
    torch.testing.assert_close(torch.tensor(report["sequence_spectra"]["raw"], dtype=torch.float64),
                               expected["spectrum"], rtol=0, atol=2e-6)
    assert [row["raw"]["sequence_energy_top1"] for row in report["layers"]] == pytest.approx(
        expected["energy_top1"].tolist(), abs=2e-6)
