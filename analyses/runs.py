"""The evaluation subcommands of analyze.py: anisotropy, isotropy, self-similarity, WiC, STS, and `all`.

    python analyze.py anisotropy --encoder roberta-base          # random token pairs, raw vs clipped, per layer
    python analyze.py all --wic wic/dev.jsonl --sts stsb sickr   # everything for one encoder + summary.md/json

Each reads its data, opens the encoder (on every rank, failing together), runs the reference pass and its
protocol (analyses/geometry.py, analyses/semantic.py) and writes the report (analyses/session.py).
"""

from __future__ import annotations

from analyses import geometry, semantic
from analyses.outliers import mean_vectors_png, outliers_report, warn_chance
from analyses.reference import refit_on_sentences
from analyses.reports import figures_of, summarise, summary_figure, summary_markdown
from analyses.session import (
    dataset_name,
    finish,
    pair_sentences,
    prepare,
    publish,
    read_sentences,
    readable,
    reference_of,
    run_header,
    setting_of,
    warn_text_counts,
)
from core.tokenizers import lowercases, special_strings
from datamodules.pairs import read_sts, scorable_wic, wic_source
from datamodules.words import source_words

MORE_PAIRS = "more pairs (a larger --data)"  # what gives the outlier rule more tokens in wic and sts (their warning)


def run_anisotropy(args, rank: int, world: int) -> dict:
    sentences, encoder = prepare(args, rank, lambda: read_sentences(args))
    setting = setting_of(args, encoder, rank, world)
    reference = reference_of(args, setting, sentences, sample=2 * args.num_pairs)
    report = {**run_header(args, encoder, reference), **geometry.anisotropy(setting, reference, args.num_pairs)}
    return publish(args, rank, "anisotropy", reference.with_chance(report), encoder)


def spectra_feed(args, setting) -> geometry.SpectraFeed:
    """The per-sequence spectra the reference pass takes as it goes: those of the variants known before it (raw, a
    clipping of given dims, SoftDecay), so that isotropy's second pass encodes only for the others (none with --clip
    none and no fitted --normalize)."""
    encoder = setting.encoder
    return geometry.SpectraFeed(setting, geometry.variants_before_pass(
        args.clip, args.normalize, args.softdecay_alpha, encoder.num_hidden_states, encoder.hidden_size))


def run_isotropy(args, rank: int, world: int) -> dict:
    sentences, encoder = prepare(args, rank, lambda: read_sentences(args))
    setting = setting_of(args, encoder, rank, world)
    feed = spectra_feed(args, setting)
    reference = reference_of(args, setting, sentences, sample=2 * args.num_pairs, covariance=True, magnitudes=feed)
    report = {**run_header(args, encoder, reference),
              **geometry.isotropy(setting, reference, sentences, args.zeta, args.minibatch, args.minibatches,
                                  num_pairs=args.num_pairs, max_sentences=args.max_sentences, fed=feed)}
    return publish(args, rank, "isotropy", reference.with_chance(report), encoder)


def read_words(args, tokenizer, limit: int, option: str = "--pool_sentences", progress: bool = False):
    """The self-similarity words (their contexts: `.contexts(readable(encoder, args.max_length))`, once the encoder is
    loaded): from the whole of --data, streamed (limit 0), or a sample of `limit` (the value of `option`); drawn with
    the encoder's tokenizer (loaded alone, before its weights: too few words is refused before a hub model downloads),
    as a word written inside one of its special tokens ("unk" of WikiText's "<unk>") does not occur there, and in its
    case ("The" and "the" one word only when the tokenizer lowercases). `progress`: a bar over each pass."""
    return source_words(args.data, args.text_column, limit, args.num_words, args.min_sentences, args.seed, option,
                        special_strings(tokenizer), lowercases(tokenizer), progress)


def run_self_similarity(args, rank: int, world: int) -> dict:
    """Self-similarity of the words of --data, adjusted by the paper's anisotropy protocol on the same source: 2 x
    --num_pairs random sentences of --data (2,000), one random token each, paired (1,000 pairs)."""
    def read(tokenizer):
        sentences = read_sentences(args, limit=2 * args.num_pairs)
        return sentences, read_words(args, tokenizer(), args.max_sentences, "--max_sentences",
                                     not args.no_progress and rank == 0)

    (sentences, words), encoder = prepare(args, rank, read, tokenizer=True)
    contexts = words.contexts(readable(encoder, args.max_length), not args.no_progress and rank == 0)
    setting = setting_of(args, encoder, rank, world)
    reference = reference_of(args, setting, contexts.sentences)
    baseline = geometry.anisotropy_baseline(setting, sentences, reference.variants, args.num_pairs, args.data)
    report = {**run_header(args, encoder, reference),
              **geometry.self_similarity(setting, contexts, reference.variants, baseline)}
    return publish(args, rank, "self_similarity", reference.with_chance(report), encoder)


def run_wic(args, rank: int, world: int) -> dict:
    (items, skipped), encoder = prepare(args, rank, lambda: scorable_wic(args.data, args.gold))
    setting = setting_of(args, encoder, rank, world)
    reference = reference_of(args, setting, pair_sentences(items), more=MORE_PAIRS)
    report = {**run_header(args, encoder, reference), **wic_source(args.data), "skipped": skipped.to_dict(),
              **semantic.wic(setting, items, reference.variants)}
    return publish(args, rank, "wic", reference.with_chance(report), encoder)


def run_sts(args, rank: int, world: int) -> dict:
    (pairs, unscored), encoder = prepare(args, rank, lambda: read_sts(args.data, args.gold, args.score_range))
    setting = setting_of(args, encoder, rank, world)
    reference = reference_of(args, setting, pair_sentences(pairs), fit="sentences", more=MORE_PAIRS)  # Su et al.
    report = {**run_header(args, encoder, reference), "unscored": unscored, "score_range": list(args.score_range),
              **semantic.sts(setting, pairs, reference.variants, args.static, args.static_lowercase)}
    return publish(args, rank, "sts", reference.with_chance(report), encoder)


def run_all(args, rank: int, world: int) -> dict:
    """The outlier report and every evaluation for one encoder, and summary.md / summary.json / summary.png."""
    def read(tokenizer):
        sentences = read_sentences(args)
        wic_data = scorable_wic(args.wic, None) if args.wic else None
        sts_data = {name: read_sts(name, None, args.score_range) for name in args.sts or []}
        return sentences, wic_data, sts_data, read_words(args, tokenizer(), args.pool_sentences,
                                                         progress=not args.no_progress and rank == 0)

    (sentences, wic_data, sts_data, words), encoder = prepare(args, rank, read, tokenizer=True)
    contexts = words.contexts(readable(encoder, args.max_length), not args.no_progress and rank == 0)
    notes = [note for note, missing in (("WiC skipped: no --wic file given", wic_data is None),
                                        ("STS skipped: no --sts data given", not sts_data)) if missing]
    for note in notes if rank == 0 else []:
        print(f"note: {note}")
    setting = setting_of(args, encoder, rank, world)
    feed = spectra_feed(args, setting)
    reference = reference_of(args, setting, sentences, statistics=True, sample=2 * args.num_pairs, covariance=True,
                             magnitudes=feed)
    header = run_header(args, encoder, reference)
    anisotropy = {**header, **geometry.anisotropy(setting, reference, args.num_pairs)}  # also self-similarity's baseline
    reports = {"outliers": outliers_report(args, encoder, reference),
               "anisotropy": anisotropy,
               "isotropy": {**header, **geometry.isotropy(setting, reference, sentences, args.zeta, args.minibatch,
                                                               args.minibatches, num_pairs=args.num_pairs,
                                                               max_sentences=args.max_sentences, fed=feed)},
               "self_similarity": {**header, **geometry.self_similarity(setting, contexts, reference.variants,
                                                                         geometry.Baseline(anisotropy, "anisotropy.json",
                                                                                           args.num_pairs))}}
    if wic_data is not None:
        reports["wic"] = {**header, **wic_source(args.wic), "skipped": wic_data[1].to_dict(),
                          **semantic.wic(setting, wic_data[0], reference.variants)}
    for name, (pairs, unscored) in sts_data.items():
        fitted = refit_on_sentences(setting, reference, pair_sentences(pairs))  # --normalize on sentences
        reports[f"sts_{dataset_name(name, reports)}"] = {**run_header(args, encoder, fitted), "data": name,
                                                         "unscored": unscored,
                                                         **semantic.sts(setting, pairs, fitted.variants, args.static,
                                                                        args.static_lowercase)}
    summary = summarise(reports, notes)  # its notes hold the chance_warning once, outliers.json's
    reports = {name: report if name == "outliers" else reference.with_chance(report) for name, report in reports.items()}
    figures = {file: make for name in reports if name != "outliers"
               for file, make in figures_of(name, reports[name], encoder.short_name).items()}
    figures["mean_vectors.png"] = lambda: mean_vectors_png(reports["outliers"], reference.statistics, encoder)
    figures["summary.png"] = lambda: summary_figure(summary, encoder.short_name)
    files = {f"{name}.json": report for name, report in reports.items()}
    files["summary.json"] = summary
    finish(args, rank, files, figures, {"summary.md": summary_markdown(summary)})
    if rank == 0:
        print("\n" + summary_markdown(summary))
        warn_text_counts(reports)
        warn_chance(reports["outliers"])
    return summary
