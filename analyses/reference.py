"""What every evaluation protocol starts from: the encoder setting, and one reference pass over the sentences.

    setting = Setting(encoder, batch_size=32, max_length=None, seed=0, rank=0, world=1)
    reference = reference_pass(setting, sentences, parse_clip("auto"), normalize="none", sample=2000)
    reference.variants                               # raw, clipped, normalised: what the protocols apply
    reference_pass(setting, pair_sentences, normalize="whiten", fit="sentences")   # STS: fit on pooled sentences
    refit_on_sentences(setting, reference, pair_sentences)   # the same normalisation, refit for STS in `all`
    for key, view, group in views(batch, reference.variants):   # a protocol's batch as each variant sees it
        vectors = pick(view); [metric[v.key].update(v.apply(vectors)) for v in group]

Under DDP (torchrun), every rank holds the same sentence or pair list and encodes its shard (item i on rank
i % world); the Metrics sync on compute(), so every rank returns the same report.

The reference pass encodes the reference sentences once and yields what the other protocols apply: the outlier
dimensions (`--clip auto` / `per-layer`: NeuronStatistics + detect_outliers), the token covariance (--normalize, IsoScore)
and one seeded random token per sentence (anisotropy, IsoScore* mini-batches). The variants are then applied to the
vectors each protocol keeps (clipping and the normalisations commute with averaging), so one forward pass serves
raw, clipped and normalised results alike. --normalize is estimated from token vectors for the token-level
protocols and, for STS (Su et al. 2021 whiten sentence embeddings), from the mean-pooled embeddings of the pairs'
sentences (`fit="sentences"`); reports say which in `normalize_fit`.

SoftDecay (--normalize softdecay, tokenUni) is fit on nothing and acts on each sentence's whole token matrix before
a protocol picks anything (metrics.transforms: a `per_sentence` variant), so it does not commute with picking: every
protocol loop takes its vectors from `views(batch, variants)`, one view of each batch per group of variants (the raw
states, shared by raw / clipped / whitened / standardized, which then act on the picked vectors; and SoftDecay's
transformed states), and the reference pass keeps SoftDecay's own token sample and token moments
(`sample_of`, `moments_of`) beside the raw ones. Still one forward pass per batch.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor
from torchmetrics.aggregation import SumMetric

from lightning_modules.encoder import EncodedBatch, FrozenEncoder, TokenizedBatch
from lightning_modules.pooling import mean_pool, random_tokens
from metrics.geometry import Covariance, CovarianceResult, TokenSample
from metrics.neuron_stats import NeuronStatistics, NeuronStatisticsResult
from metrics.outliers import MORE_SENTENCES, LayerOutliers, OutlierRule, chance_of, detect_outliers
from metrics.transforms import (
    RAW,
    REPORT_KEYS,
    SOFTDECAY_ALPHA,
    Clipping,
    ClipRequest,
    SoftDecay,
    Variant,
    clipped_dims,
    normalization,
    parse_clip,
    per_layer_report,
)

NO_CLIP = parse_clip("none")


@dataclass
class Setting:
    encoder: FrozenEncoder
    batch_size: int = 32
    max_length: int | None = None
    seed: int = 0
    progress: bool = True
    rank: int = 0
    world: int = 1
    replay: dict | None = None  # opt-in: each text list tokenised once and its batches kept (see `tokenized`)

    def shard(self, count: int) -> list[int]:
        """The items of this rank: i with i % world == rank."""
        return list(range(self.rank, count, self.world))

    def tokenized(self, texts: list[str], offsets: bool = False, pairs: bool = False) -> Iterable[TokenizedBatch]:
        """This rank's shard of `texts` tokenised in batches, each batch's `rows` mapped back to positions in `texts`.
        With `pairs`, texts 2p and 2p + 1 are pair p, and pairs (not sentences) are sharded, so both sides of a pair
        stay on one rank, in one buffer of batches (an even batch size). With `replay` (a dict), a text list is
        tokenised once, on first use, and the same batches are served again after (analyze.py intervene: every
        variant of the model reads the same padded batches)."""
        if pairs:
            mine = [2 * p + side for p in self.shard(len(texts) // 2) for side in (0, 1)]
            batch_size = max(2, self.batch_size - self.batch_size % 2)
        else:
            mine, batch_size = self.shard(len(texts)), self.batch_size

        def tokenize() -> Iterator[TokenizedBatch]:
            for item in self.encoder.tokenized_batches([texts[i] for i in mine], batch_size, self.max_length, offsets):
                yield replace(item, rows=[mine[r] for r in item.rows])

        if self.replay is None:
            return tokenize()
        key = (tuple(texts), offsets, pairs)
        if key not in self.replay:
            self.replay[key] = list(tokenize())
        return self.replay[key]

    def batches(self, texts: list[str], offsets: bool = False, desc: str = "encoding", pairs: bool = False
                ) -> Iterator[EncodedBatch]:
        """The encoder's batches over this rank's shard of `texts` (`tokenized`), each batch's `rows` mapped back to
        positions in `texts`."""
        count = len(self.shard(len(texts) // 2)) * 2 if pairs else len(self.shard(len(texts)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # truncations are counted in the reports instead
            yield from self.encoder.encode(self.tokenized(texts, offsets, pairs), count, self.progress, desc,
                                           self.max_length)


@dataclass
class Reference:
    """What the reference sentences give the other protocols."""

    variants: list[Variant]
    clip: str  # --clip as given: "auto", "per-layer", "none", dims or the explicit per-layer form
    clipped: dict[int, list[int]] | None  # {layer: dims} zeroed; None when --clip none
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
    samples: dict = field(default_factory=dict)  # {per-sentence variant key: its own token sample, as `sample`}
    clip_rule: str = ""  # which clipping rule applied to this model, and why (ClipRequest.rule)
    moments: dict = field(default_factory=dict)  # {per-sentence variant key: CovarianceResult of its own tokens}
    num_special_in_text: int = 0  # special tokens written in the sentences ("[SEP]" in a line; EncodedBatch)
    num_unknown: int = 0  # the tokenizer's unknown tokens in the sentences ([UNK]; EncodedBatch)
    chance: dict | None = None  # the chance of the detection that chose the clipping (metrics.outliers.chance_of)

    def header(self) -> dict:
        header = {"clip": self.clip, "clip_rule": self.clip_rule, "clipped_dims": clipped_dims(self.clipped or {}),
                  "clipped_dims_per_layer": per_layer_report(self.clipped or {}), "normalize": self.normalize,
                  "normalize_fit": self.normalize_fit, "normalize_fit_count": self.normalize_fit_count,
                  "variants": [variant.key for variant in self.variants]}
        softdecay = next((v for v in self.variants if isinstance(v, SoftDecay)), None)
        if softdecay is not None:
            header["softdecay_alpha"] = softdecay.alpha
        return {**header, "normalize_warning": self.normalize_warning} if self.normalize_warning else header

    def counts(self) -> dict:
        """What the reports say of the text read: sentences truncated, special tokens written in it, unknown tokens."""
        return {"num_truncated": self.num_truncated, "num_special_in_text": self.num_special_in_text,
                "num_unknown": self.num_unknown}

    def with_chance(self, report: dict) -> dict:
        """`report` with what the outlier detection that chose its clipping (--clip auto / per-layer) says of chance
        (ours, as outliers.json: metrics/outliers.py chance_of): chance_bound in each of its layer rows, and
        chance_warning; as it is when no detection chose it (--clip none, dims, layers:dims)."""
        if self.chance is None:
            return report
        return {**report, "layers": [{**row, "chance_bound": self.chance["chance_bound"]} for row in report["layers"]],
                "chance_warning": self.chance["chance_warning"]}

    def sample_of(self, variant: Variant) -> tuple[Tensor, Tensor]:
        """The token sample `variant` is applied to: its own for a per-sentence variant, else the raw one."""
        return self.samples[variant.key] if variant.per_sentence else self.sample

    def moments_of(self, variant: Variant) -> tuple[Tensor, Tensor]:
        """(mean [layers, hidden], cov [layers, hidden, hidden]) of the variant's tokens: its own for a per-sentence
        variant, else the exact transform of the raw moments."""
        if variant.per_sentence:
            own = self.moments[variant.key]
            return own.mean, own.cov
        return variant.moments(self.covariance.mean, self.covariance.cov)

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


def views(batch: EncodedBatch, variants: list[Variant]) -> list[tuple[str | None, EncodedBatch, list[Variant]]]:
    """The batch as each group of variants sees it: (None, the batch, the variants that act on picked vectors: raw,
    clipped, whitened, standardized), then (key, the batch with the variant's transformed states, [variant]) for each
    per-sentence variant (SoftDecay). The same groups, in the same order, for every batch."""
    shared = [variant for variant in variants if not variant.per_sentence]
    groups = [(None, batch, shared)] if shared else []
    return groups + [(variant.key, replace(batch, hidden_states=variant.states(batch.hidden_states, batch.mask)),
                      [variant]) for variant in variants if variant.per_sentence]


def reference_pass(setting: Setting, sentences: list[str], clip: ClipRequest = NO_CLIP, normalize: str = "none",
                   rule: OutlierRule = OutlierRule(), statistics: bool = False, covariance: bool = False,
                   sample: int = 0, desc: str = "reference pass", fit: str = "tokens",
                   softdecay_alpha: float = SOFTDECAY_ALPHA, magnitudes=None, more: str = MORE_SENTENCES
                   ) -> Reference:
    """Encode `sentences` once for the outlier statistics, the token covariance and one random token from each of
    `sample` seeded random sentences (all when fewer), as far as `clip` (metrics.transforms.parse_clip), `normalize` and
    `statistics`, `covariance`, `sample` need them. `normalize` whiten / standardize is estimated from the token
    vectors (`fit="tokens"`) or from the mean-pooled sentence embeddings (`fit="sentences"`, for STS); softdecay
    (`softdecay_alpha`) is fit on nothing, and the pass keeps the token sample and covariance of its transformed
    states too. `magnitudes` (analyses.magnitudes.Magnitudes: massive activations, the magnitude criterion; or anything
    with `update(batch)`: intervene's next-token loss) is updated with every batch. When `clip` detects the outliers
    it clips, the reference holds the detection's chance (`chance`; `more`: what gives the rule more tokens, as its
    warning says it). Memory: fixed-size states plus the [sample, layers, hidden] token sample(s), whatever the number
    of sentences."""
    if fit not in ("tokens", "sentences"):
        raise ValueError(f"fit must be 'tokens' or 'sentences', got {fit!r}")
    encoder = setting.encoder
    device, layers, hidden = encoder.device, encoder.num_hidden_states, encoder.hidden_size
    fitting = normalize in REPORT_KEYS
    per_sentence = [SoftDecay(softdecay_alpha)] if normalize == "softdecay" else []
    stats = NeuronStatistics(layers, hidden).to(device) if clip.needs_outliers or statistics else None
    cov = Covariance(layers, hidden).to(device) if covariance or fitting and fit == "tokens" else None
    pooled = Covariance(layers, hidden).to(device) if fitting and fit == "sentences" else None
    chosen = range(len(sentences)) if sample >= len(sentences) else sorted(
        random.Random(setting.seed).sample(range(len(sentences)), sample))
    slot_of = {index: slot for slot, index in enumerate(chosen)}
    groups = [None] + [variant.key for variant in per_sentence]  # views(): the raw states, then each variant's own
    tokens = {key: TokenSample(len(chosen), layers, hidden).to(device) for key in groups} if sample else {}
    moments = {key: Covariance(layers, hidden).to(device) for key in groups[1:]} if cov is not None else {}
    counted, truncated, special, unknown = counter(device), counter(device), counter(device), counter(device)
    encode = stats is not None or cov is not None or pooled is not None or bool(tokens) or magnitudes is not None
    if encode:
        for batch in setting.batches(sentences, desc=desc):
            rows = batch.rows
            if magnitudes is not None:
                magnitudes.update(batch)
            if stats is not None:
                stats.update(batch.hidden_states, batch.mask)
            if cov is not None:
                cov.update(batch.hidden_states, batch.mask)
            if pooled is not None:
                pooled.update(mean_pool(batch.hidden_states, batch.mask))
            for key, view, _ in views(batch, [RAW, *per_sentence]) if tokens or moments else ():
                if key in moments:
                    moments[key].update(view.hidden_states, view.mask)
                if tokens:
                    vectors, kept = random_tokens(view, rows, setting.seed)
                    wanted = [k for k, r in enumerate(kept) if rows[r] in slot_of]
                    tokens[key].update(torch.tensor([slot_of[rows[kept[k]]] for k in wanted], dtype=torch.long),
                                       vectors[:, wanted])
            counted.update(len(rows))
            truncated.update(batch.num_truncated)
            special.update(batch.num_special_in_text)
            unknown.update(batch.num_unknown)
    reference = Reference([RAW], clip.text, None, normalize, *((int(counted.compute()), int(truncated.compute()))
                                                               if encode else (0, 0)))
    reference.clip_rule = clip.rule(layers)
    reference.num_special_in_text = int(special.compute()) if encode else 0
    reference.num_unknown = int(unknown.compute()) if encode else 0
    if stats is not None:
        reference.statistics = stats.compute()
        reference.outliers = detect_outliers(reference.statistics, rule)
        if clip.needs_outliers:
            reference.chance = chance_of(reference.outliers, reference.statistics.num_tokens, hidden, rule, more)
    if clip.mode != "none":
        reference.clipped = clip.resolve(reference.outliers, layers, hidden)
        reference.variants.append(Clipping(reference.clipped, layers))
    if cov is not None:
        reference.covariance = cov.compute()
    if fitting:
        reference = reference.fitted(normalize, reference.covariance if fit == "tokens" else pooled.compute(), fit)
    reference.variants += per_sentence
    if tokens:
        reference.sample = tokens[None].compute()
        reference.samples = {key: tokens[key].compute() for key in groups[1:]}
    reference.moments = {key: metric.compute() for key, metric in moments.items()}
    return reference


def refit_on_sentences(setting: Setting, reference: Reference, sentences: list[str], desc: str = "sentence fit"
                       ) -> Reference:
    """`reference` with its --normalize variant re-estimated from the mean-pooled embeddings of `sentences` (the STS
    pairs' sentences in `all`, whose reference pass is over --data): one more streamed pass, a fixed-size Covariance
    of the pooled vectors. Unchanged without a fitted --normalize (none, softdecay)."""
    if reference.normalize not in REPORT_KEYS:
        return reference
    encoder = setting.encoder
    pooled = Covariance(encoder.num_hidden_states, encoder.hidden_size).to(encoder.device)
    for batch in setting.batches(sentences, desc=desc):
        pooled.update(mean_pool(batch.hidden_states, batch.mask))
    return reference.fitted(reference.normalize, pooled.compute(), "sentences")


def per_layer(values: dict[str, Tensor], num_layers: int) -> list[dict]:
    """{variant key: [layers] or [layers, ...]} -> [{"layer", key: value, ...}] with floats (nan -> None)."""
    return [{"layer": layer, **{key: number(value[layer]) for key, value in values.items()}}
            for layer in range(num_layers)]


def number(value):
    if isinstance(value, dict):
        return {k: number(v) for k, v in value.items()}
    value = float(value)
    return None if value != value else round(value, 6)
