"""The geometry protocols: anisotropy (Luo et al. §4.1), isotropy (IsoScore, IsoScore*, spectra) and
self-similarity (Ethayarajh 2019), each per layer and per variant (raw, clipped, normalised).

    anisotropy(setting, reference)                    # {"layers": [{"layer", "raw", "clipped"}], ...}
    isotropy(setting, reference)                      # IsoScore, IsoScore*, singular-value spectrum per layer
    self_similarity(setting, word_contexts(pool), reference.variants)

Each returns the JSON-ready body of its report; analyses/runs.py adds the header, writes and prints it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from analyses.reference import Reference, Setting, counter, number, per_layer, views
from core.errors import UserError
from datamodules.pairs import WordContexts
from lightning_modules.pooling import random_tokens, span_vectors
from metrics.geometry import (
    IsoScoreStar,
    MeanCosine,
    SelfSimilarity,
    SequenceSpectrum,
    TokenSample,
    isoscore,
    sample_pairs,
    spectrum_of_moments,
)
from metrics.transforms import Variant


def pair_anisotropy(sample: tuple[Tensor, Tensor], variants: list[Variant], seed: int,
                    own: dict | None = None) -> tuple[dict, int]:
    """Mean cosine of random token pairs from the sample, per variant: ({key: [layers]}, pairs). A per-sentence
    variant (SoftDecay) takes its pairs from its own sample `own[key]` (the same sentences and tokens)."""
    vectors, filled = sample
    first, second = sample_pairs(filled, seed)
    if first.numel() == 0:
        return {variant.key: torch.full((vectors.shape[1],), float("nan")) for variant in variants}, 0
    result = {}
    for variant in variants:
        picked = own[variant.key][0] if variant.per_sentence else vectors
        a, b = picked[first].transpose(0, 1), picked[second].transpose(0, 1)  # [layers, pairs, hidden]
        # The sample is already the same on every rank: no sync.
        metric = MeanCosine(vectors.shape[1], sync_on_compute=False).to(vectors.device)
        metric.update(variant.apply(a), variant.apply(b))
        result[variant.key] = metric.compute()
    return result, int(first.numel())


def anisotropy(setting: Setting, reference: Reference) -> dict:
    """Luo et al. (2021) §4.1: the mean cosine of 1000 pairs of random tokens drawn from 2000 random sentences
    (the reference pass's token sample, paired by a seeded permutation)."""
    values, pairs = pair_anisotropy(reference.sample, reference.variants, setting.seed, reference.samples)
    if pairs == 0:
        got, total = int(reference.sample[1].sum()), reference.num_sentences
        raise UserError(f"anisotropy needs at least 2 sentences with a token, got {got}"
                        + (f" of {total} sentences" if got != total else ""))
    return {"num_sentences": reference.num_sentences, "num_pairs": pairs, "num_truncated": reference.num_truncated,
            "layers": per_layer(values, setting.encoder.num_hidden_states)}


def minibatch_isoscores(reference: Reference, variant: Variant, seed: int, zeta: float = 0.2, minibatch: int = 250,
                        minibatches: int = 4) -> tuple[Tensor, Tensor, int]:
    """(IsoScore* [layers], plain IsoScore [layers] of the same mini-batches, their number) of up to `minibatches`
    mini-batches of `minibatch` tokens of the reference's sample (one random token per sentence, in a seeded order),
    the variant applied, shrunk towards the covariance of all its tokens with `zeta` (nan without a whole batch)."""
    filled = reference.sample[1]
    kept = filled.nonzero().flatten()
    order = torch.randperm(len(kept), generator=torch.Generator().manual_seed(seed))
    batches = [order[i:i + minibatch] for i in range(0, len(order) - minibatch + 1, minibatch)][:minibatches]
    _, cov = reference.moments_of(variant)
    points = reference.sample_of(variant)[0][kept].transpose(0, 1)  # [layers, sampled tokens, hidden]
    layers, hidden = points.shape[0], points.shape[2]
    if not batches:
        return torch.full((layers,), float("nan")), torch.full((layers,), float("nan")), 0
    # The sample is already the same on every rank: no sync.
    star = IsoScoreStar(layers, hidden, zeta, shrinkage=cov, sync_on_compute=False).to(points.device)
    plain = IsoScoreStar(layers, hidden, 0.0, sync_on_compute=False).to(points.device)
    transformed = variant.apply(points)
    for batch in batches:
        star.update(transformed[:, batch])
        plain.update(transformed[:, batch])
    return star.compute(), plain.compute(), len(batches)


def minibatch_shortfall(batches: int, minibatch: int, minibatches: int, sentences: int) -> str | None:
    """The warning when fewer IsoScore* mini-batches than asked for could be drawn (one random token per sentence
    with a token, `sentences` of them), saying what it needs; None when all were."""
    if batches >= minibatches:
        return None
    needs = (f"--minibatches {minibatches} of --minibatch {minibatch} tokens need {minibatch * minibatches} sentences "
             f"with a token (one random token each), got {sentences}")
    if batches == 0:
        return f"IsoScore* not computed ('-'): {needs}; lower --minibatch or give more sentences (--max_sentences)"
    return f"IsoScore* averaged over {batches} mini-batches, not {minibatches}: {needs}"


def isotropy(setting: Setting, reference: Reference, sentences: list[str], zeta: float = 0.2, minibatch: int = 250,
             minibatches: int = 4) -> dict:
    """IsoScore of all tokens; IsoScore* (and plain IsoScore) of up to `minibatches` mini-batches of `minibatch`
    tokens drawn from the sample (one random token per sentence), shrunk towards the covariance of all tokens; the
    singular-value spectrum of each layer's corpus-wide token matrix (all sentences' tokens together: `corpus_*`,
    moments transformed exactly); and tokenUni's per-sequence spectrum (`sequence_*`: each sentence's own token
    matrix, one more pass over `sentences`); per variant."""
    stats = reference.covariance
    layers = setting.encoder.num_hidden_states
    values, spectra = {}, {}
    for variant in reference.variants:
        mean, cov = reference.moments_of(variant)  # exact moments of the variant's tokens
        star, plain, batches = minibatch_isoscores(reference, variant, setting.seed, zeta, minibatch, minibatches)
        spec = spectrum_of_moments(mean, cov, stats.num_tokens)  # of the synced moments: no second sync
        spectra[variant.key] = [[round(float(s), 6) for s in row] for row in spec["singular_values"]]
        values[variant.key] = {
            "isoscore": isoscore(cov),
            "isoscore_star": star,
            "isoscore_minibatch": plain,
            **{f"corpus_{key}": spec[key] for key in ("energy_top1", "energy_top10", "cdf_auc")},
        }
    sequences = sequence_spectra(setting, sentences, reference.variants)
    for key, result in sequences.items():
        values[key].update(sequence_energy_top1=result["energy_top1"], sequence_cdf_auc=result["cdf_auc"])
    rows = [{"layer": layer, **{key: {name: number(v[layer]) for name, v in value.items()}
                                for key, value in values.items()}} for layer in range(layers)]
    shortfall = minibatch_shortfall(batches, minibatch, minibatches, int(reference.sample[1].sum()))
    return {"num_sentences": reference.num_sentences, "num_tokens": stats.num_tokens, "zeta": zeta,
            "minibatch_tokens": minibatch, "num_minibatches": batches, "layers": rows,
            **({"isoscore_star_warning": shortfall} if shortfall else {}),
            "corpus_spectra": spectra,
            "sequence_spectra": {key: [[round(float(v), 6) for v in row] for row in result["spectrum"]]
                                 for key, result in sequences.items()},
            "spectra_note": "corpus_*: the singular values of each layer's token matrix of all sentences together "
                            "(uncentred); sequence_*: of each sentence's own token matrix, divided by its largest and "
                            "pooled over sentences (tokenUni, Yan et al. 2022); sequence_spectra[variant][layer][k] "
                            "is the mean k-th normalised singular value over the sentences that have one"}


def sequence_spectra(setting: Setting, sentences: list[str], variants: list[Variant]) -> dict[str, dict]:
    """{variant key: SequenceSpectrum result} over `sentences` (this rank's shard; synced)."""
    encoder = setting.encoder
    max_rank = min(setting.max_length or encoder.max_length, encoder.hidden_size)
    metrics = {v.key: SequenceSpectrum(encoder.num_hidden_states, max_rank).to(encoder.device) for v in variants}
    for batch in setting.batches(sentences, desc="per-sequence spectra"):
        for _, view, group in views(batch, variants):
            for variant in group:
                metrics[variant.key].update(variant.apply(view.hidden_states), view.mask)
    return {key: metric.compute() for key, metric in metrics.items()}


@dataclass
class Baseline:
    """An anisotropy report ({"layers": [{"layer", <variant>: value}], "num_pairs"}) to adjust a self-similarity by,
    and its name for the report."""

    report: dict
    name: str

    def values(self, key: str) -> Tensor:
        return torch.tensor([float("nan") if row[key] is None else row[key] for row in self.report["layers"]],
                            dtype=torch.float64)


def self_similarity(setting: Setting, contexts: WordContexts, variants: list[Variant],
                    baseline: Baseline | None = None) -> dict:
    """Ethayarajh (2019) eq. 1 per layer and variant, adjusted by the anisotropy of the same variant (adjusted =
    self-similarity - anisotropy): `baseline`'s (`analyze.py paper`: the anisotropy report of the same data, Figure 6's
    left panel), else that of random token pairs of the self-similarity sentences."""
    encoder = setting.encoder
    layers, hidden, device = encoder.num_hidden_states, encoder.hidden_size, encoder.device
    metrics = {v.key: SelfSimilarity(len(contexts.words), layers, hidden).to(device) for v in variants}
    groups = [None] + [variant.key for variant in variants if variant.per_sentence]  # as views() orders them
    sampling = baseline is None
    tokens = {key: TokenSample(len(contexts.sentences), layers, hidden).to(device) for key in groups} if sampling else {}
    lost, truncated = counter(device), counter(device)
    for batch in setting.batches(contexts.sentences, offsets=True, desc="self-similarity"):
        rows = batch.rows
        wanted = [[(start, end) for _, start, end in contexts.spans[row]] for row in rows]
        for key, view, group in views(batch, variants):
            vectors, found = span_vectors(view, wanted)
            word_ids = torch.tensor([contexts.spans[rows[r]][i][0] for r, i in found], dtype=torch.long)
            for variant in group:
                metrics[variant.key].update(word_ids, variant.apply(vectors))
            if sampling:
                sampled, kept = random_tokens(view, rows, setting.seed)
                tokens[key].update(torch.tensor([rows[r] for r in kept]), sampled)
        lost.update(sum(len(w) for w in wanted) - len(found))
        truncated.update(batch.num_truncated)
    warning = None
    if sampling:
        samples = {key: metric.compute() for key, metric in tokens.items()}
        anisotropy, pairs = pair_anisotropy(samples[None], variants, setting.seed, samples)
        adjusted_by = "anisotropy of random token pairs of the self-similarity sentences"
        if pairs == 0:
            warning = ("the anisotropy-adjusted self-similarity is not computed ('-'): its random token pairs need at "
                       f"least 2 sentences with a token, got {int(samples[None][1].sum())}")
    else:
        anisotropy = {variant.key: baseline.values(variant.key) for variant in variants}
        pairs, adjusted_by = baseline.report["num_pairs"], baseline.name
    values, counted = {}, 0
    for variant in variants:
        result = metrics[variant.key].compute()
        values[variant.key] = {"self_similarity": result.mean, "anisotropy": anisotropy[variant.key],
                               "adjusted": result.mean - anisotropy[variant.key].to(result.mean)}
        counted = result.num_words
    rows = [{"layer": layer, **{key: {name: number(v[layer]) for name, v in value.items()}
                                for key, value in values.items()}} for layer in range(layers)]
    return {"num_words": counted, "contexts_per_word": contexts.contexts_per_word,
            "num_candidates": contexts.num_candidates, "pool_sentences": contexts.pool,
            "num_sentences": len(contexts.sentences), "adjusted_by": adjusted_by, "baseline_pairs": pairs,
            "contexts_lost_to_truncation": int(lost.compute()), "num_truncated": int(truncated.compute()),
            "words": contexts.words, "layers": rows, **({"adjusted_warning": warning} if warning else {})}
