"""The evaluation protocols of analyze.py: how each statistic is sampled from a frozen encoder and data.

    setting = Setting(encoder, batch_size=32, max_length=None, seed=0, rank=0, world=1)
    reference = reference_pass(setting, sentences, clip="auto", normalize="none", rule=OutlierRule(), sample=2000)
    anisotropy(setting, reference)                    # {"layers": [{"layer", "raw", "clipped"}], ...}
    isotropy(setting, reference)                      # IsoScore, IsoScore*, singular-value spectrum per layer
    self_similarity(setting, word_contexts(pool), reference.variants)
    wic(setting, items, reference.variants); sts(setting, pairs, reference.variants, static=None)
    reference_pass(setting, pair_sentences, normalize="whiten", fit="sentences")   # STS: fit on pooled sentences
    refit_on_sentences(setting, reference, pair_sentences)   # the same normalisation, refit for STS in `all`

Each protocol returns the JSON-ready body of its report; analyze.py adds the header, writes and prints it. Under
DDP (torchrun), every rank holds the same sentence or pair list and encodes its shard (item i on rank i % world);
the Metrics sync on compute(), so every rank returns the same report.

The reference pass encodes the reference sentences once and yields what the other protocols apply: the outlier
dimensions (`--clip auto`: NeuronStatistics + detect_outliers), the token covariance (for --normalize and IsoScore)
and one seeded random token per sentence (anisotropy, IsoScore* mini-batches). The variants are then applied to the
vectors each protocol keeps (clipping and the normalisations commute with averaging), so one forward pass serves
raw, clipped and normalised results alike. --normalize is estimated from token vectors for the token-level
protocols and, for STS (Su et al. 2021 whiten sentence embeddings), from the mean-pooled embeddings of the pairs'
sentences (`fit="sentences"`); reports say which in `normalize_fit`.
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass, replace

import torch
from torch import Tensor
from torchmetrics.aggregation import SumMetric

from datamodules.io import UserError
from datamodules.pairs import (
    StsPair,
    WicItem,
    WordContexts,
    read_static_vectors,
    sentence_words,
    static_sentence_vector,
)
from lightning_modules.encoder import FrozenEncoder
from lightning_modules.pooling import indexed_batches, mean_pool, random_tokens, span_vectors
from metrics.geometry import (
    Covariance,
    CovarianceResult,
    IsoScoreStar,
    MeanCosine,
    SelfSimilarity,
    Spectrum,
    TokenSample,
    cosine,
    isoscore,
)
from metrics.neuron_stats import NeuronStatistics, NeuronStatisticsResult
from metrics.outliers import LayerOutliers, OutlierRule, all_outlier_dims, detect_outliers
from metrics.similarity import PairCosine, spearman, threshold_accuracy
from metrics.transforms import RAW, REPORT_KEYS, Clipping, Variant, normalization

THRESHOLDS = [round(0.1 * t, 1) for t in range(1, 10)]


@dataclass
class Setting:
    encoder: FrozenEncoder
    batch_size: int = 32
    max_length: int | None = None
    seed: int = 0
    progress: bool = True
    rank: int = 0
    world: int = 1

    def shard(self, count: int) -> list[int]:
        """The items of this rank: i with i % world == rank."""
        return list(range(self.rank, count, self.world))

    def batches(self, texts: list[str], offsets: bool = False, desc: str = "encoding"):
        """indexed_batches over this rank's shard of `texts`, rows mapped back to positions in `texts`."""
        mine = self.shard(len(texts))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # truncations are counted in the reports instead
            for rows, batch, spans in indexed_batches(self.encoder, [texts[i] for i in mine], self.batch_size,
                                                      self.max_length, offsets, self.progress, desc):
                yield [mine[r] for r in rows], batch, spans


@dataclass
class Reference:
    """What the reference sentences give the other protocols."""

    variants: list[Variant]
    clip: str  # "auto" | "given" | "none"
    clipped_dims: list[int] | None  # None when --clip none
    normalize: str
    num_sentences: int
    num_truncated: int
    statistics: NeuronStatisticsResult | None = None
    outliers: list[LayerOutliers] | None = None
    covariance: object = None  # CovarianceResult of the token vectors when computed
    sample: tuple[Tensor, Tensor] | None = None  # ([sentences, layers, hidden], filled [sentences])
    normalize_fit: str | None = None  # what --normalize was estimated from: "tokens" | "sentences" (None: none)
    normalize_fit_count: int | None = None  # how many of them
    normalize_warning: str | None = None

    def header(self) -> dict:
        header = {"clip": self.clip, "clipped_dims": self.clipped_dims or [], "normalize": self.normalize,
                  "normalize_fit": self.normalize_fit, "normalize_fit_count": self.normalize_fit_count,
                  "variants": [variant.key for variant in self.variants]}
        return {**header, "normalize_warning": self.normalize_warning} if self.normalize_warning else header

    def fitted(self, normalize: str, stats: CovarianceResult, fit: str) -> Reference:
        """This reference with the --normalize variant estimated from `stats` (of `fit`: tokens or sentences)."""
        variants = [v for v in self.variants if v.key not in REPORT_KEYS.values()]
        variants.append(normalization(normalize, stats, fit))
        hidden = stats.mean.shape[-1]
        warning = None if normalize != "whiten" or stats.num_tokens > hidden + 1 else (
            f"whitening fit on {stats.num_tokens} {fit}, not more than hidden size + 1 ({hidden + 1}): the fit "
            "vectors whiten to a regular simplex (all their pairwise cosines equal), so whitened values are noise")
        return replace(self, variants=variants, normalize_fit=fit, normalize_fit_count=stats.num_tokens,
                       normalize_warning=warning)


def counter(device) -> SumMetric:
    return SumMetric().to(device)


def reference_pass(setting: Setting, sentences: list[str], clip: str | list[int] = "auto", normalize: str = "none",
                   rule: OutlierRule = OutlierRule(), statistics: bool = False, covariance: bool = False,
                   sample: int = 0, desc: str = "reference pass", fit: str = "tokens") -> Reference:
    """Encode `sentences` once for the outlier statistics, the token covariance and one random token from each of
    `sample` seeded random sentences (all when fewer), as far as `clip` ("auto", "none" or dims), `normalize` and
    `statistics`, `covariance`, `sample` need them. `normalize` is estimated from the token vectors (`fit="tokens"`)
    or from the mean-pooled sentence embeddings (`fit="sentences"`, for STS). Memory: fixed-size states plus the
    [sample, layers, hidden] token sample, whatever the number of sentences."""
    if fit not in ("tokens", "sentences"):
        raise ValueError(f"fit must be 'tokens' or 'sentences', got {fit!r}")
    encoder = setting.encoder
    device, layers, hidden = encoder.device, encoder.num_hidden_states, encoder.hidden_size
    normalizing = normalize != "none"
    stats = NeuronStatistics(layers, hidden).to(device) if clip == "auto" or statistics else None
    cov = Covariance(layers, hidden).to(device) if covariance or normalizing and fit == "tokens" else None
    pooled = Covariance(layers, hidden).to(device) if normalizing and fit == "sentences" else None
    chosen = range(len(sentences)) if sample >= len(sentences) else sorted(
        random.Random(setting.seed).sample(range(len(sentences)), sample))
    slot_of = {index: slot for slot, index in enumerate(chosen)}
    tokens = TokenSample(len(chosen), layers, hidden).to(device) if sample else None
    counted, truncated = counter(device), counter(device)
    encode = stats is not None or cov is not None or pooled is not None or tokens is not None
    if encode:
        for rows, batch, _ in setting.batches(sentences, desc=desc):
            if stats is not None:
                stats.update(batch.hidden_states, batch.mask)
            if cov is not None:
                cov.update(batch.hidden_states, batch.mask)
            if pooled is not None:
                pooled.update(mean_pool(batch))
            if tokens is not None:
                vectors, kept = random_tokens(batch, rows, setting.seed)
                wanted = [k for k, r in enumerate(kept) if rows[r] in slot_of]
                tokens.update(torch.tensor([slot_of[rows[kept[k]]] for k in wanted], dtype=torch.long),
                              vectors[:, wanted])
            counted.update(len(rows))
            truncated.update(batch.num_truncated)
    reference = Reference([RAW], "none", None, normalize, *((int(counted.compute()), int(truncated.compute()))
                                                            if encode else (0, 0)))
    if stats is not None:
        reference.statistics = stats.compute()
        reference.outliers = detect_outliers(reference.statistics, rule)
    if clip == "auto":
        reference.clip, reference.clipped_dims = "auto", all_outlier_dims(reference.outliers)
    elif clip != "none":
        reference.clip, reference.clipped_dims = "given", sorted(set(clip))
    if reference.clipped_dims is not None:
        reference.variants.append(Clipping(reference.clipped_dims, layers))
    if cov is not None:
        reference.covariance = cov.compute()
    if normalizing:
        reference = reference.fitted(normalize, reference.covariance if fit == "tokens" else pooled.compute(), fit)
    if tokens is not None:
        reference.sample = tokens.compute()
    return reference


def refit_on_sentences(setting: Setting, reference: Reference, sentences: list[str], desc: str = "sentence fit"
                       ) -> Reference:
    """`reference` with its --normalize variant re-estimated from the mean-pooled embeddings of `sentences` (the STS
    pairs' sentences in `all`, whose reference pass is over --data): one more streamed pass, a fixed-size Covariance
    of the pooled vectors. Unchanged without --normalize."""
    if reference.normalize == "none":
        return reference
    encoder = setting.encoder
    pooled = Covariance(encoder.num_hidden_states, encoder.hidden_size).to(encoder.device)
    for _, batch, _ in setting.batches(sentences, desc=desc):
        pooled.update(mean_pool(batch))
    return reference.fitted(reference.normalize, pooled.compute(), "sentences")


def _per_layer(values: dict[str, Tensor], num_layers: int) -> list[dict]:
    """{variant key: [layers] or [layers, ...]} -> [{"layer", key: value, ...}] with floats (nan -> None)."""
    return [{"layer": layer, **{key: _number(value[layer]) for key, value in values.items()}}
            for layer in range(num_layers)]


def _number(value):
    if isinstance(value, dict):
        return {k: _number(v) for k, v in value.items()}
    value = float(value)
    return None if value != value else round(value, 6)


def sample_pairs(filled: Tensor, seed: int) -> tuple[Tensor, Tensor]:
    """Pair the sampled sentences by a seeded permutation: (first [pairs], second [pairs]) slot indices."""
    slots = filled.nonzero().flatten().tolist()
    random.Random(seed).shuffle(slots)
    half = len(slots) // 2
    return torch.tensor(slots[:half], dtype=torch.long), torch.tensor(slots[half:2 * half], dtype=torch.long)


def pair_anisotropy(sample: tuple[Tensor, Tensor], variants: list[Variant], seed: int) -> tuple[dict, int]:
    """Mean cosine of random token pairs from the sample, per variant: ({key: [layers]}, pairs)."""
    vectors, filled = sample
    first, second = sample_pairs(filled, seed)
    if first.numel() == 0:
        return {variant.key: torch.full((vectors.shape[1],), float("nan")) for variant in variants}, 0
    a, b = vectors[first].transpose(0, 1), vectors[second].transpose(0, 1)  # [layers, pairs, hidden]
    result = {}
    for variant in variants:
        # The sample is already the same on every rank: no sync.
        metric = MeanCosine(vectors.shape[1], sync_on_compute=False).to(vectors.device)
        metric.update(variant.apply(a), variant.apply(b))
        result[variant.key] = metric.compute()
    return result, int(first.numel())


def anisotropy(setting: Setting, reference: Reference) -> dict:
    """Luo et al. (2021) §4.1: the mean cosine of 1000 pairs of random tokens drawn from 2000 random sentences
    (the reference pass's token sample, paired by a seeded permutation)."""
    values, pairs = pair_anisotropy(reference.sample, reference.variants, setting.seed)
    if pairs == 0:
        raise UserError(f"anisotropy needs at least 2 sentences with a token, got {reference.num_sentences}")
    return {"num_sentences": reference.num_sentences, "num_pairs": pairs, "num_truncated": reference.num_truncated,
            "layers": _per_layer(values, setting.encoder.num_hidden_states)}


def isotropy(setting: Setting, reference: Reference, zeta: float = 0.2, minibatch: int = 250,
             minibatches: int = 4) -> dict:
    """IsoScore of all tokens; IsoScore* (and plain IsoScore) of up to `minibatches` mini-batches of `minibatch`
    tokens drawn from the sample (one random token per sentence), shrunk towards the covariance of all tokens; and
    the singular-value spectrum of each layer's token matrix; per variant (moments transformed exactly)."""
    stats, (vectors, filled) = reference.covariance, reference.sample
    layers, hidden = setting.encoder.num_hidden_states, setting.encoder.hidden_size
    points = vectors[filled.nonzero().flatten()].transpose(0, 1)  # [layers, sampled tokens, hidden]
    order = torch.randperm(points.shape[1], generator=torch.Generator().manual_seed(setting.seed))
    batches = [order[i:i + minibatch] for i in range(0, len(order) - minibatch + 1, minibatch)][:minibatches]
    values, spectra = {}, {}
    for variant in reference.variants:
        mean, cov = variant.moments(stats.mean, stats.cov)
        # The sample is already the same on every rank: no sync.
        star = IsoScoreStar(layers, hidden, zeta, shrinkage=cov, sync_on_compute=False).to(points.device)
        plain = IsoScoreStar(layers, hidden, 0.0, sync_on_compute=False).to(points.device)
        transformed = variant.apply(points)
        for batch in batches:
            star.update(transformed[:, batch])
            plain.update(transformed[:, batch])
        spec = Spectrum.of_moments(mean, cov, stats.num_tokens)  # of the synced moments: no second sync
        spectra[variant.key] = [[round(float(s), 6) for s in row] for row in spec["singular_values"]]
        values[variant.key] = {
            "isoscore": isoscore(cov),
            "isoscore_star": star.compute() if batches else torch.full((layers,), float("nan")),
            "isoscore_minibatch": plain.compute() if batches else torch.full((layers,), float("nan")),
            **{key: spec[key] for key in ("energy_top1", "energy_top10", "cdf_auc")},
        }
    rows = [{"layer": layer, **{key: {name: _number(v[layer]) for name, v in value.items()}
                                for key, value in values.items()}} for layer in range(layers)]
    return {"num_sentences": reference.num_sentences, "num_tokens": stats.num_tokens, "zeta": zeta,
            "minibatch_tokens": minibatch, "num_minibatches": len(batches), "layers": rows, "spectra": spectra}


def self_similarity(setting: Setting, contexts: WordContexts, variants: list[Variant]) -> dict:
    """Ethayarajh (2019) eq. 1 per layer and variant, with the anisotropy of random token pairs of the same
    sentences as baseline (adjusted = self-similarity - anisotropy)."""
    encoder = setting.encoder
    layers, hidden, device = encoder.num_hidden_states, encoder.hidden_size, encoder.device
    metrics = {v.key: SelfSimilarity(len(contexts.words), layers, hidden).to(device) for v in variants}
    tokens = TokenSample(len(contexts.sentences), layers, hidden).to(device)
    lost, truncated = counter(device), counter(device)
    for rows, batch, offsets in setting.batches(contexts.sentences, offsets=True, desc="self-similarity"):
        wanted = [[(start, end) for _, start, end in contexts.spans[row]] for row in rows]
        vectors, found = span_vectors(batch, offsets, wanted)
        word_ids = torch.tensor([contexts.spans[rows[r]][i][0] for r, i in found], dtype=torch.long)
        for variant in variants:
            metrics[variant.key].update(word_ids, variant.apply(vectors))
        sampled, kept = random_tokens(batch, rows, setting.seed)
        tokens.update(torch.tensor([rows[r] for r in kept]), sampled)
        lost.update(sum(len(w) for w in wanted) - len(found))
        truncated.update(batch.num_truncated)
    baseline, pairs = pair_anisotropy(tokens.compute(), variants, setting.seed)
    values, counted = {}, 0
    for variant in variants:
        result = metrics[variant.key].compute()
        values[variant.key] = {"self_similarity": result.mean, "anisotropy": baseline[variant.key],
                               "adjusted": result.mean - baseline[variant.key].to(result.mean)}
        counted = result.num_words
    rows = [{"layer": layer, **{key: {name: _number(v[layer]) for name, v in value.items()}
                                for key, value in values.items()}} for layer in range(layers)]
    return {"num_words": counted, "contexts_per_word": contexts.contexts_per_word,
            "num_candidates": contexts.num_candidates, "pool_sentences": contexts.pool,
            "num_sentences": len(contexts.sentences), "baseline_pairs": pairs,
            "contexts_lost_to_truncation": int(lost.compute()), "num_truncated": int(truncated.compute()),
            "words": contexts.words, "layers": rows}


def _pair_loop(setting: Setting, texts: list[str], variants: list[Variant], num_pairs: int, vectors_of,
               offsets: bool, desc: str) -> tuple[dict[str, PairCosine], int, int]:
    """Encode the flattened pairs (pair p = texts 2p, 2p+1) and score each pair once both sides are encoded.

    A chunk of sorted sentences always holds both sides of its pairs (even sizes), so at most a chunk is pending.
    """
    encoder = setting.encoder
    metrics = {v.key: PairCosine(num_pairs, encoder.num_hidden_states).to(encoder.device) for v in variants}
    lost, truncated = counter(encoder.device), counter(encoder.device)
    pending: dict[int, list] = {}
    for rows, batch, spans in _pair_batches(setting, texts, offsets, desc):
        vectors, found = vectors_of(rows, batch, spans)
        lost.update(len(rows) - len(found))
        truncated.update(batch.num_truncated)
        for column, row in enumerate(found):
            pending.setdefault(rows[row] // 2, [None, None])[rows[row] % 2] = vectors[:, column]
        done = [p for p, sides in pending.items() if sides[0] is not None and sides[1] is not None]
        if done:
            a = torch.stack([pending[p][0] for p in done], 1)
            b = torch.stack([pending[p][1] for p in done], 1)
            for variant in variants:
                metrics[variant.key].update(torch.tensor(done), variant.apply(a), variant.apply(b))
            for p in done:
                del pending[p]
    return metrics, int(lost.compute()), int(truncated.compute())


def _pair_batches(setting: Setting, texts: list[str], offsets: bool, desc: str):
    """Like Setting.batches, but pairs (not sentences) are sharded over ranks, so both sides stay on one rank."""
    pairs = setting.shard(len(texts) // 2)
    mine = [2 * p + side for p in pairs for side in (0, 1)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        batch_size = max(2, setting.batch_size - setting.batch_size % 2)
        for rows, batch, spans in indexed_batches(setting.encoder, [texts[i] for i in mine], batch_size,
                                                  setting.max_length, offsets, setting.progress, desc):
            yield [mine[r] for r in rows], batch, spans


def wic(setting: Setting, items: list[WicItem], variants: list[Variant]) -> dict:
    """Luo et al. (2021) §4.3 / Pilehvar & Camacho-Collados (2019): same sense iff the cosine of the target word's
    vectors (sub-word pieces averaged) in the two sentences reaches a threshold; the best threshold of 0.1..0.9 and
    the best layer, searched on the given data (an oracle choice, as in the paper)."""
    texts = [s for item in items for s in (item.sentence1, item.sentence2)]
    spans = [span for item in items for span in (item.span1, item.span2)]

    def vectors_of(rows, batch, offsets):
        vectors, found = span_vectors(batch, offsets, [[spans[row]] for row in rows])
        return vectors, [r for r, _ in found]

    metrics, lost, truncated = _pair_loop(setting, texts, variants, len(items), vectors_of, True, "wic")
    labels = torch.tensor([item.label for item in items])
    thresholds = torch.tensor(THRESHOLDS, dtype=torch.float64)
    report = {"num_pairs": len(items), "targets_lost_to_truncation": lost, "num_truncated": truncated,
              "thresholds": THRESHOLDS}
    per_variant = {}
    for variant in variants:
        cosines, seen = metrics[variant.key].compute()
        cosines, gold = cosines[seen.cpu()].cpu(), labels[seen.cpu()]
        accuracy = threshold_accuracy(cosines, gold, thresholds)  # [layers, thresholds]
        best_t = accuracy.argmax(1)
        per_variant[variant.key] = [{"accuracy": round(float(accuracy[layer, t]), 6), "threshold": THRESHOLDS[t]}
                                    for layer, t in enumerate(best_t.tolist())]
        layer = int(accuracy.max(1).values.argmax())
        key = "best" if variant.key == "raw" else f"best_{variant.key}"
        report[key] = {"accuracy": round(float(accuracy[layer].max()), 6), "layer": layer,
                       "threshold": THRESHOLDS[int(best_t[layer])]}
        report["num_scored"] = int(seen.sum())
        report["baseline"] = round(float(gold.double().mean()), 6) if gold.numel() else None  # all "same sense"
    report["layers"] = [{"layer": layer, **{key: rows[layer] for key, rows in per_variant.items()}}
                        for layer in range(setting.encoder.num_hidden_states)]
    return report


def sts(setting: Setting, pairs: list[StsPair], variants: list[Variant], static: str | None = None) -> dict:
    """Spearman x 100 between the cosine of mean-pooled sentence embeddings (padding excluded) and the gold
    scores, per layer and variant; optionally the same for averaged static word vectors (GloVe format)."""
    texts = [s for pair in pairs for s in (pair.sentence1, pair.sentence2)]

    def vectors_of(rows, batch, _):
        return mean_pool(batch), list(range(len(rows)))

    metrics, _, truncated = _pair_loop(setting, texts, variants, len(pairs), vectors_of, False, "sts")
    gold = torch.tensor([pair.score for pair in pairs], dtype=torch.float64)
    report = {"num_pairs": len(pairs), "num_truncated": truncated}
    per_variant = {}
    for variant in variants:
        cosines, seen = metrics[variant.key].compute()
        rho = 100 * spearman(cosines.cpu(), gold)
        per_variant[variant.key] = rho
        layer = int(rho.nan_to_num(float("-inf")).argmax())
        key = "best" if variant.key == "raw" else f"best_{variant.key}"
        report[key] = {"spearman": _number(rho[layer]), "layer": layer}
    report["layers"] = _per_layer(per_variant, setting.encoder.num_hidden_states)
    report["static_baseline"] = static_baseline(pairs, gold, static, setting.progress) if static else None
    return report


def static_baseline(pairs: list[StsPair], gold: Tensor, path: str, progress: bool = False) -> dict:
    """Spearman x 100 of averaged static word vectors (the paper's GloVe row), with the word coverage."""
    vocabulary = set().union(*(sentence_words(p.sentence1) | sentence_words(p.sentence2) for p in pairs))
    vectors, dim = read_static_vectors(path, vocabulary, progress)
    a = torch.stack([static_sentence_vector(p.sentence1, vectors, dim) for p in pairs])
    b = torch.stack([static_sentence_vector(p.sentence2, vectors, dim) for p in pairs])
    rho = 100 * spearman(cosine(a, b), gold)
    return {"file": str(path), "spearman": _number(rho), "dim": dim,
            "word_coverage": round(len(vectors) / max(len(vocabulary), 1), 6)}
