"""The geometry protocols: anisotropy (Luo et al. §4.1), isotropy (IsoScore, IsoScore*, spectra) and
self-similarity with intra-sentence similarity (Ethayarajh 2019), each per layer and per variant (raw, clipped,
normalised).

    anisotropy(setting, reference)                    # {"layers": [{"layer", "raw", "clipped"}], ...}
    feed = SpectraFeed(setting, variants_before_pass(clip, normalize, alpha, layers, hidden))  # before the pass,
    reference = reference_pass(setting, sentences, clip, normalize, covariance=True, magnitudes=feed)  # fed by it
    isotropy(setting, reference, sentences, fed=feed)  # IsoScore, IsoScore*, singular-value spectra per layer
    self_similarity(setting, word_contexts(pool), reference.variants, Baseline(anisotropy_report, name))

Each returns the JSON-ready body of its report; analyses/runs.py adds the header, writes and prints it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from analyses.reference import Reference, Setting, counter, number, per_layer, reference_pass, views
from core.errors import UserError
from core.wording import plural
from datamodules.words import WordContexts
from lightning_modules.pooling import lost_spans, span_vectors
from metrics.geometry import MeanCosine, SelfSimilarity, sample_pairs
from metrics.intra_sentence import IntraSentenceSimilarity, sentence_tokens
from metrics.isotropy import IsoScoreStar, SequenceSpectrum, isoscore, spectrum_of_moments
from metrics.transforms import RAW, Clipping, ClipRequest, SoftDecay, Variant


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


def anisotropy(setting: Setting, reference: Reference, num_pairs: int | None = None) -> dict:
    """Luo et al. (2021) §4.1: the mean cosine of 1000 pairs of random tokens drawn from 2000 random sentences
    (the reference pass's token sample, paired by a seeded permutation); `anisotropy_warning` when fewer than the
    `num_pairs` asked for could be drawn (a source with fewer than 2 x num_pairs sentences)."""
    values, pairs = pair_anisotropy(reference.sample, reference.variants, setting.seed, reference.samples)
    got, total = int(reference.sample[1].sum()), reference.num_sentences
    if pairs == 0:
        raise UserError(f"anisotropy needs at least 2 sentences with a token, got {got}"
                        + (f" of {plural(total, 'sentence')}" if got != total else ""))
    shortfall = None
    if num_pairs is not None and pairs < num_pairs:
        shortfall = (f"anisotropy from {pairs} random token pairs, not --num_pairs {num_pairs}: one random token from "
                     f"each of {2 * num_pairs} sentences needs {2 * num_pairs} sentences with a token, got {got}")
    return {"num_sentences": reference.num_sentences, "num_pairs": pairs, **reference.counts(),
            "layers": per_layer(values, setting.encoder.num_hidden_states),
            **({"anisotropy_warning": shortfall} if shortfall else {})}


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


def sample_caps(read: int, num_pairs: int, max_sentences: int) -> str:
    """What to change for a larger token sample (one random token from each of min(2 x `num_pairs`, `read`) sentences,
    `read` of --data read under --max_sentences `max_sentences`, 0: all): each cap that binds, named."""
    wanted, caps = 2 * num_pairs, []
    if wanted <= read:
        caps.append(f"raise --num_pairs (the sample is one random token from each of 2 x --num_pairs = {wanted} "
                    "sentences)")
    if read <= wanted:
        caps.append(f"give more sentences (--max_sentences {max_sentences})" if max_sentences and read >= max_sentences
                    else f"give --data with more sentences (all {read} of its sentences are read)")
    return " and ".join(caps)


def minibatch_shortfall(batches: int, minibatch: int, minibatches: int, sentences: int, read: int, num_pairs: int,
                        max_sentences: int) -> str | None:
    """The warning when fewer IsoScore* mini-batches than asked for could be drawn (one random token per sentence
    with a token, `sentences` of them), saying what it needs and which cap of the sample binds (sample_caps: `read`
    sentences of --data, --num_pairs, --max_sentences); None when all were."""
    if batches >= minibatches:
        return None
    needs = (f"--minibatches {minibatches} of --minibatch {plural(minibatch, 'token')} need "
             f"{plural(minibatch * minibatches, 'sentence')} with a token (one random token each), got {sentences}")
    caps = sample_caps(read, num_pairs, max_sentences)
    if batches == 0:
        return f"IsoScore* not computed ('-'): {needs}; lower --minibatch or {caps}"
    return f"IsoScore* averaged over {plural(batches, 'mini-batch', 'mini-batches')}, not {minibatches}: {needs}; lower --minibatch or {caps}"


def isotropy(setting: Setting, reference: Reference, sentences: list[str], zeta: float = 0.2, minibatch: int = 250,
             minibatches: int = 4, *, num_pairs: int, max_sentences: int, fed: SpectraFeed | None = None) -> dict:
    """IsoScore of all tokens; IsoScore* (and plain IsoScore) of up to `minibatches` mini-batches of `minibatch`
    tokens drawn from the sample (one random token per sentence), shrunk towards the covariance of all tokens; the
    singular-value spectrum of each layer's corpus-wide token matrix (all sentences' tokens together: `corpus_*`,
    moments transformed exactly); and tokenUni's per-sequence spectrum (`sequence_*`: each sentence's own token
    matrix; `fed`, a SpectraFeed the reference pass updated, gives the variants it holds, and only the others take one
    more pass over `sentences`: sequence_spectra); per variant. `num_pairs`, `max_sentences`: the caps of the sample,
    named in the warning when it is too small for the mini-batches."""
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
    sequences = sequence_spectra(setting, sentences, reference.variants, fed)
    for key, result in sequences.items():
        values[key].update(sequence_energy_top1=result["energy_top1"], sequence_cdf_auc=result["cdf_auc"])
    rows = [{"layer": layer, **{key: {name: number(v[layer]) for name, v in value.items()}
                                for key, value in values.items()}} for layer in range(layers)]
    shortfall = minibatch_shortfall(batches, minibatch, minibatches, int(reference.sample[1].sum()),
                                    reference.num_sentences, num_pairs, max_sentences)
    return {"num_sentences": reference.num_sentences, "num_tokens": stats.num_tokens,
            **reference.counts(), "zeta": zeta,
            "minibatch_tokens": minibatch, "num_minibatches": batches, "layers": rows,
            **({"isoscore_star_warning": shortfall} if shortfall else {}),
            "corpus_spectra": spectra,
            "sequence_spectra": {key: [[round(float(v), 6) for v in row] for row in result["spectrum"]]
                                 for key, result in sequences.items()},
            "spectra_note": "corpus_*: the singular values of each layer's token matrix of all sentences together "
                            "(uncentred); sequence_*: of each sentence's own token matrix, divided by its largest and "
                            "pooled over sentences (tokenUni, Yan et al. 2022); sequence_spectra[variant][layer][k] "
                            "is the mean k-th normalised singular value over the sentences that have one"}


def variants_before_pass(clip: ClipRequest, normalize: str, softdecay_alpha: float, layers: int, hidden: int
                         ) -> list[Variant]:
    """The variants of a reference pass (analyses.reference.reference_pass) known before it runs: raw, a clipping of
    given dims (--clip dims / layers:dims; not --clip auto / per-layer, which clip the outliers the pass detects) and
    SoftDecay (fit on nothing); never a fitted --normalize (whiten, standardize: estimated by the pass)."""
    known = [RAW]
    if clip.mode != "none" and not clip.needs_outliers:
        known.append(Clipping(clip.resolve(None, layers, hidden), layers))
    return known + ([SoftDecay(softdecay_alpha)] if normalize == "softdecay" else [])


class SpectraFeed:
    """tokenUni's per-sequence spectra (SequenceSpectrum) of `variants`, updated with each batch of a pass over the
    sentences (`update(batch)`: reference_pass's `magnitudes` hook), so that the variants known before the reference
    pass (variants_before_pass) take theirs from its forward instead of a second one (sequence_spectra)."""

    def __init__(self, setting: Setting, variants: list[Variant]) -> None:
        encoder = setting.encoder
        max_rank = min(setting.max_length or encoder.max_length, encoder.hidden_size)
        self.variants = variants
        self.metrics = {v.key: SequenceSpectrum(encoder.num_hidden_states, max_rank).to(encoder.device)
                        for v in variants}

    def update(self, batch) -> None:
        for _, view, group in views(batch, self.variants):
            for variant in group:
                self.metrics[variant.key].update(variant.apply(view.hidden_states), view.mask)

    def holds(self, variant: Variant) -> bool:
        """Whether this feed's spectra are `variant`'s: the same kind of variant, with the same dims or alpha."""
        return any(type(own) is type(variant) and vars(own) == vars(variant) for own in self.variants
                   if own.key == variant.key)

    def compute(self) -> dict[str, dict]:
        return {key: metric.compute() for key, metric in self.metrics.items()}


def sequence_spectra(setting: Setting, sentences: list[str], variants: list[Variant], fed: SpectraFeed | None = None
                     ) -> dict[str, dict]:
    """{variant key: SequenceSpectrum result} over `sentences` (this rank's shard; synced). The variants `fed` holds
    (a SpectraFeed the reference pass over the same `sentences` updated) are taken from it; the others, if any, from
    one more pass. A clipping that zeroes no dimension (`--clip auto` on a model without outliers) has the raw states'
    spectra: its SVDs, the pass's largest cost beside the forward on long sentences, are not taken twice."""
    as_raw = {v.key for v in variants if isinstance(v, Clipping) and not v.spec} if RAW in variants else set()
    done = {v.key for v in variants if fed is not None and fed.holds(v)}
    results = fed.compute() if done else {}
    rest = [v for v in variants if v.key not in as_raw and v.key not in done]
    if rest:
        feed = SpectraFeed(setting, rest)
        for batch in setting.batches(sentences, desc="per-sequence spectra"):
            feed.update(batch)
        results.update(feed.compute())
    return {v.key: results[RAW.key if v.key in as_raw else v.key] for v in variants}


@dataclass
class Baseline:
    """An anisotropy report ({"layers": [{"layer", <variant>: value}], "num_pairs", "num_sentences"}) to adjust a
    self-similarity by, its name for the report, and the pairs the protocol asked for (None: as many as it found)."""

    report: dict
    name: str
    wanted_pairs: int | None = None

    def values(self, key: str) -> Tensor:
        return torch.tensor([float("nan") if row[key] is None else row[key] for row in self.report["layers"]],
                            dtype=torch.float64)

    def describe(self) -> dict:
        """What the report says of its adjustment: which anisotropy, from how many pairs and sentences, and why it has
        fewer pairs than the protocol's when it has."""
        pairs, sentences = self.report["num_pairs"], self.report["num_sentences"]
        short = self.wanted_pairs is not None and pairs < self.wanted_pairs
        return {"adjusted_by": self.name, "baseline_pairs": pairs, "baseline_sentences": sentences,
                "baseline_note": (f"the source has {plural(sentences, 'sentence')} with a token, not the "
                                  f"protocol's {2 * self.wanted_pairs}: {plural(pairs, 'pair')} instead of {self.wanted_pairs}")
                if short else None}


def anisotropy_baseline(setting: Setting, sentences: list[str], variants: list[Variant], num_pairs: int,
                        source: str) -> Baseline:
    """The paper's anisotropy protocol (Luo et al. 2021 §4.1, as `analyze.py anisotropy`) on `sentences` (2 x
    `num_pairs` random sentences of the self-similarity's source): one seeded random token of each, paired at random,
    the mean cosine per layer of each of `variants` (the self-similarity's: the same clipping and fitted
    normalisation; SoftDecay from its own transformed states). One more encoder pass over those sentences."""
    per_sentence = next((variant for variant in variants if variant.per_sentence), None)
    reference = reference_pass(setting, sentences, normalize="softdecay" if per_sentence else "none",
                               sample=2 * num_pairs, desc="anisotropy baseline",
                               **({"softdecay_alpha": per_sentence.alpha} if per_sentence else {}))
    values, pairs = pair_anisotropy(reference.sample, variants, setting.seed, reference.samples)
    report = {"num_pairs": pairs, "num_sentences": int(reference.sample[1].sum()),
              "layers": per_layer(values, setting.encoder.num_hidden_states)}
    return Baseline(report, f"anisotropy of {len(sentences)} random sentences of {source} (the paper's §4.1 protocol, "
                    "as analyze.py anisotropy, with the self-similarity's variants)", num_pairs)


def self_similarity(setting: Setting, contexts: WordContexts, variants: list[Variant], baseline: Baseline) -> dict:
    """Ethayarajh (2019) eq. 1 per layer and variant, adjusted by the anisotropy of the same layer and variant
    (adjusted = self-similarity - anisotropy): `baseline`, the paper's anisotropy protocol on the same source
    (`analyze.py paper` and `all`: the anisotropy report of the same data; the standalone subcommand:
    anisotropy_baseline). Beside it, in the same pass, Ethayarajh's intra-sentence similarity (eq. 2) of the
    sentences encoded, over their counted tokens (metrics/intra_sentence.py), adjusted by the same anisotropy."""
    encoder = setting.encoder
    layers, hidden, device = encoder.num_hidden_states, encoder.hidden_size, encoder.device
    metrics = {v.key: SelfSimilarity(len(contexts.words), layers, hidden).to(device) for v in variants}
    intra = {v.key: IntraSentenceSimilarity(layers).to(device) for v in variants}
    lost, in_special, truncated, special, unknown = (counter(device) for _ in range(5))
    for batch in setting.batches(contexts.sentences, offsets=True, desc="self-similarity"):
        rows = batch.rows
        wanted = [[(start, end) for _, start, end in contexts.spans[row]] for row in rows]
        for _, view, group in views(batch, variants):
            vectors, found = span_vectors(view, wanted)
            word_ids = torch.tensor([contexts.spans[rows[r]][i][0] for r, i in found], dtype=torch.long)
            tokens, owners = sentence_tokens(view.hidden_states, view.mask)  # every counted token, its row
            for variant in group:
                metrics[variant.key].update(word_ids, variant.apply(vectors))
                intra[variant.key].update(variant.apply(tokens), sentences=owners)
        cut, inside = lost_spans(batch, wanted, found)
        lost.update(cut)
        in_special.update(inside)
        truncated.update(batch.num_truncated)
        special.update(batch.num_special_in_text)
        unknown.update(batch.num_unknown)
    warning = None
    if not baseline.report.get("num_pairs"):
        warning = ("the anisotropy-adjusted self-similarity and intra-sentence similarity are not computed ('-'): "
                   "their anisotropy baseline's random token pairs need at least 2 sentences with a token, got "
                   f"{baseline.report.get('num_sentences', 0)}")
    values, counted = {}, 0
    for variant in variants:
        result = metrics[variant.key].compute()
        anisotropy = baseline.values(variant.key)
        sentence = intra[variant.key].compute()
        values[variant.key] = {"self_similarity": result.mean, "anisotropy": anisotropy,
                               "adjusted": result.mean - anisotropy.to(result.mean), "intra_sentence": sentence.mean,
                               "intra_sentence_adjusted": sentence.mean - anisotropy.to(sentence.mean)}
        counted, sentences = result.num_words, int(sentence.num_sentences)
    rows = [{"layer": layer, **{key: {name: number(v[layer]) for name, v in value.items()}
                                for key, value in values.items()}} for layer in range(layers)]
    cut_off, in_specials = int(lost.compute()), int(in_special.compute())
    if not counted:  # every self-similarity is nan: say why rather than print empty columns
        warning = (f"self-similarity not computed ('-'): no word of the {len(contexts.words)} sampled kept 2 of its "
                   f"contexts ({plural(cut_off, 'context')} lost to truncation: a larger --max_length keeps them"
                   + (f"; {in_specials} written inside a special token, as 'mask' in '[MASK]'" if in_specials else "") + ")")
    return {"num_words": counted, "contexts_per_word": contexts.contexts_per_word,
            "num_candidates": contexts.num_candidates, "pool_sentences": contexts.pool,
            "duplicate_sentences": contexts.duplicates,
            "word_case": "lowercased (the tokenizer lowercases)" if contexts.lowercase else
            "as written (a cased tokenizer: 'The' and 'the' are two words)",
            "num_sentences": len(contexts.sentences), "intra_sentence_sentences": sentences, **baseline.describe(),
            "contexts_lost_to_truncation": cut_off, "contexts_in_special_tokens": in_specials,
            "num_truncated": int(truncated.compute()),
            "num_special_in_text": int(special.compute()), "num_unknown": int(unknown.compute()),
            "words": contexts.words, "layers": rows,
            **({"self_similarity_warning" if not counted else "adjusted_warning": warning} if warning else {})}
