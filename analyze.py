"""Analyses of a frozen encoder: outlier neurons, clipping, and the geometry and semantic evaluations.

    python analyze.py outliers                                   # packaged MiniLM on the bundled corpus
    python analyze.py outliers --encoder bert-base-uncased --data data/austen.txt --output_dir runs/bert
    python analyze.py anisotropy --encoder roberta-base          # random token pairs, raw vs clipped, per layer
    python analyze.py self-similarity --clip 5,17                # Ethayarajh's self-similarity, given dims clipped
    python analyze.py isotropy --normalize whiten                # IsoScore, IsoScore*, singular-value spectrum
    python analyze.py wic --data wic/dev.jsonl                   # SuperGLUE WiC (or super_glue/wic, WiC .data.txt)
    python analyze.py sts --data stsb --static glove.840B.300d.txt   # STS-B, SICK-R, STS12-16, csv/tsv/jsonl
    python analyze.py all --wic wic/dev.jsonl --sts stsb sickr   # everything for one encoder + summary.md/json
    torchrun --nproc_per_node 4 analyze.py all ...               # items sharded over ranks, rank 0 writes

Every evaluation reports raw values beside clipped ones (`--clip auto`, the default, clips the dimensions that
the outlier analysis detects on the same data; `--clip none`; or given dimensions, `--clip 5,17`) and, with
`--normalize whiten` or `standardize`, beside a post-hoc normalisation. The protocols live in metrics/protocols.py,
the tables, figures and summary in callbacks/reports.py. Dimensions and layers are 0-indexed; layer 0 is the
embedding output. Errors in the input are one line on stderr and exit status 2, with nothing written.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from callbacks.figures import mean_vectors_figure, save_figure
from callbacks.reports import figures_of, print_report, summarise, summary_figure, summary_markdown
from datamodules.io import (
    DEFAULT_CORPUS,
    UserError,
    check_writable,
    iter_texts,
    sample_texts,
    staged_output,
    write_json,
)
from datamodules.pairs import STS_PRESETS, read_sts, read_wic, word_contexts
from lightning_modules.encoder import FrozenEncoder, default_encoder, load_encoder, normalise_clip
from metrics import protocols
from metrics.neuron_stats import NeuronStatisticsResult
from metrics.origins import summarise_origins, trace_origins
from metrics.outliers import OutlierRule, all_outlier_dims, detect_outliers, persistent_dims
from metrics.protocols import Reference, Setting
from metrics.transforms import NORMALIZATIONS

T = TypeVar("T")


@contextlib.contextmanager
def distributed() -> Iterator[tuple[int, int]]:
    """(rank, world size); under torchrun, a process group (NCCL on GPU, gloo on CPU) destroyed on exit."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or dist.is_initialized():
        yield (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        yield dist.get_rank(), dist.get_world_size()
    finally:
        dist.destroy_process_group()


def collectively(step: Callable[[], T]) -> T:
    """Run `step` on every rank; a UserError on any rank is raised on all of them, so no rank waits forever."""
    error, result = None, None
    try:
        result = step()
    except UserError as raised:
        error = str(raised)
    if dist.is_initialized():
        errors: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((message for message in errors if message), None)
    if error:
        raise UserError(error)
    return result


def read_sentences(args, rank: int = 0, world: int = 1, limit: int | None = None) -> list[str]:
    """The sampled sentences of --data (the same sample on every rank), then this rank's shard."""
    limit = args.max_sentences if limit is None else limit
    texts = sample_texts(iter_texts(args.data, args.text_column), limit, args.seed)
    if not texts:
        raise UserError(f"no sentences in {args.data}")
    return list(itertools.islice(texts, rank, None, world))


def open_encoder(args, clip=None) -> FrozenEncoder:
    device = args.device
    if device is None and torch.cuda.is_available() and dist.is_initialized():
        device = f"cuda:{torch.cuda.current_device()}"
    encoder = load_encoder(args.encoder, device=device, clip=clip, exclude_special=args.exclude_special)
    encoder.check_max_length(args.max_length)
    if isinstance(getattr(args, "clip", None), list):  # given dimensions: check them against this model
        normalise_clip(args.clip, encoder.num_hidden_states, encoder.hidden_size)
    return encoder


def setting_of(args, encoder: FrozenEncoder, rank: int = 0, world: int = 1) -> Setting:
    return Setting(encoder, args.batch_size, args.max_length, args.seed, not args.no_progress, rank, world)


def collect_statistics(encoder: FrozenEncoder, sentences: list[str], args) -> tuple[NeuronStatisticsResult, int, int]:
    """Stream this rank's sentences through the encoder into NeuronStatistics: (statistics, sentences, truncated)."""
    reference = protocols.reference_pass(setting_of(args, encoder), sentences, clip="auto", desc="outlier statistics")
    return reference.statistics, reference.num_sentences, reference.num_truncated


def prepare(args, rank: int, read: Callable[[], T]) -> tuple[T, FrozenEncoder]:
    """Read the data, check the output directory and load the encoder, failing together on every rank."""
    def step():
        data = read()
        if rank == 0:
            check_writable(args.output_dir)
        return data, open_encoder(args)

    return collectively(step)


def outliers_report(args, encoder: FrozenEncoder, result: NeuronStatisticsResult, num_sentences: int,
                    num_truncated: int) -> dict:
    if result.num_tokens == 0:
        raise UserError(f"no tokens counted in {args.data} (all special tokens excluded?)")
    rule = OutlierRule(min_share=args.min_share, sigma=args.sigma)
    layers = detect_outliers(result, rule)
    return {
        **run_header(args, encoder),
        "num_sentences": num_sentences,
        "num_tokens": result.num_tokens,
        "num_truncated": num_truncated,
        "hidden_size": encoder.hidden_size,
        "num_layers": encoder.num_layers,
        "rule": {"min_share": rule.min_share, "sigma": rule.sigma, "description": rule.describe()},
        "layers": [layer.to_dict() for layer in layers],
        "persistent_dims": persistent_dims(layers),
        "origins": trace_origins(encoder.model, all_outlier_dims(layers)),
    }


def mean_vectors_png(report: dict, result: NeuronStatisticsResult, encoder: FrozenEncoder):
    outliers = {layer["layer"]: layer["outlier_dims"] for layer in report["layers"]}
    return mean_vectors_figure(result.mean, outliers, title=f"average vector per layer: {encoder.short_name}")


def run_outliers(args, rank: int, world: int) -> dict:
    sentences, encoder = prepare(args, rank, lambda: read_sentences(args, rank, world))
    result, num_sentences, num_truncated = collect_statistics(encoder, sentences, args)
    report = outliers_report(args, encoder, result, num_sentences, num_truncated)
    finish(args, rank, {"outliers.json": report}, {"mean_vectors.png": lambda: mean_vectors_png(report, result, encoder)})
    if rank == 0:
        print_outliers(report)
        warn_truncation({"outliers": report})
    return report


def print_outliers(report: dict) -> None:
    print(f"\noutlier dimensions of {report['encoder']} on {report['data']}: {report['num_sentences']} sentences, "
          f"{report['num_tokens']:,} tokens (special tokens {report['special_tokens']}; dims 0-indexed)")
    print(f"{'layer':>5}  {'argmax dim (share)':>19}  {'argmin dim (share)':>19}  outlier dims")
    for layer in report["layers"]:
        print(f"{layer['layer']:>5}  {layer['argmax_dim']:>10} ({layer['argmax_share']:6.1%})  "
              f"{layer['argmin_dim']:>10} ({layer['argmin_share']:6.1%})  "
              f"{', '.join(map(str, layer['outlier_dims'])) or '-'}")
    print(f"persistent outlier dims (in at least half the layers): {report['persistent_dims'] or 'none'}")
    origins = report["origins"]
    if origins["position_embeddings"] is None:
        print(f"positional embeddings: none to trace ({origins['position_embeddings_note']})")
    elif origins["position_embeddings_note"]:
        print(f"positional embeddings: {origins['position_embeddings_note']}")
    for dim, line in summarise_origins(origins).items():
        if dim in report["persistent_dims"]:
            print(f"  origin of {dim}: {line}")


def warn_truncation(reports: dict[str, dict]) -> None:
    """One line on stderr per truncation count in `reports` ({name: report}; reports from one pass share a line).

    The count is the report's num_truncated, of its num_sentences (pair reports: 2 x num_pairs sentences)."""
    counts: dict[tuple[int, int, int], list[str]] = {}
    for name, report in reports.items():
        if report.get("num_truncated"):
            total = report.get("num_sentences", 2 * report.get("num_pairs", 0))
            counts.setdefault((report["num_truncated"], total, report["max_length"]), []).append(f"{name}.json")
    for (truncated, total, length), names in counts.items():
        where = "the report" if len(reports) == 1 else ", ".join(names)
        print(f"warning: {truncated} of {total} sentences were longer than {length} tokens and were truncated "
              f"(counted in {where} as num_truncated)", file=sys.stderr)


# ---------------------------------------------------------------- evaluations


def run_header(args, encoder: FrozenEncoder, reference: Reference | None = None) -> dict:
    header = {
        "encoder": str(args.encoder),
        "data": str(args.data),
        "max_length": args.max_length or encoder.max_length,
        "special_tokens": "excluded" if args.exclude_special else "included",
        "seed": args.seed,
        "indexing": "0-indexed dimensions; layer 0 = embedding output",
    }
    if reference is not None:
        header.update(reference.header())
    return header


def reference_of(args, setting: Setting, sentences: list[str], **needs) -> Reference:
    """The reference pass over `sentences` for --clip / --normalize (and what `needs` asks for)."""
    reference = protocols.reference_pass(setting, sentences, args.clip, args.normalize,
                                         OutlierRule(args.min_share, args.sigma), **needs)
    if reference.statistics is not None and reference.statistics.num_tokens == 0:
        raise UserError("no tokens counted for the outlier statistics (all special tokens excluded?)")
    return reference


def run_anisotropy(args, rank: int, world: int) -> dict:
    sentences, encoder = prepare(args, rank, lambda: read_sentences(args))
    setting = setting_of(args, encoder, rank, world)
    reference = reference_of(args, setting, sentences, sample=2 * args.num_pairs)
    report = {**run_header(args, encoder, reference), **protocols.anisotropy(setting, reference)}
    return publish(args, rank, "anisotropy", report, encoder)


def run_isotropy(args, rank: int, world: int) -> dict:
    sentences, encoder = prepare(args, rank, lambda: read_sentences(args))
    setting = setting_of(args, encoder, rank, world)
    reference = reference_of(args, setting, sentences, sample=2 * args.num_pairs, covariance=True)
    report = {**run_header(args, encoder, reference),
              **protocols.isotropy(setting, reference, args.zeta, args.minibatch, args.minibatches)}
    return publish(args, rank, "isotropy", report, encoder)


def read_contexts(args, limit: int):
    return word_contexts(read_sentences(args, limit=limit), args.num_words, args.min_sentences, args.seed)


def run_self_similarity(args, rank: int, world: int) -> dict:
    contexts, encoder = prepare(args, rank, lambda: read_contexts(args, args.max_sentences))
    setting = setting_of(args, encoder, rank, world)
    reference = reference_of(args, setting, contexts.sentences)
    report = {**run_header(args, encoder, reference),
              **protocols.self_similarity(setting, contexts, reference.variants)}
    return publish(args, rank, "self_similarity", report, encoder)


def pair_sentences(items) -> list[str]:
    return list(dict.fromkeys(s for item in items for s in (item.sentence1, item.sentence2)))


def run_wic(args, rank: int, world: int) -> dict:
    (items, skipped), encoder = prepare(args, rank, lambda: read_wic(args.data, args.gold))
    setting = setting_of(args, encoder, rank, world)
    reference = reference_of(args, setting, pair_sentences(items))
    report = {**run_header(args, encoder, reference), "skipped": skipped.to_dict(),
              **protocols.wic(setting, items, reference.variants)}
    return publish(args, rank, "wic", report, encoder)


def run_sts(args, rank: int, world: int) -> dict:
    (pairs, unscored), encoder = prepare(args, rank, lambda: read_sts(args.data, args.gold, args.score_range))
    setting = setting_of(args, encoder, rank, world)
    reference = reference_of(args, setting, pair_sentences(pairs), fit="sentences")  # Su et al. whiten sentences
    report = {**run_header(args, encoder, reference), "unscored": unscored, "score_range": list(args.score_range),
              **protocols.sts(setting, pairs, reference.variants, args.static)}
    return publish(args, rank, "sts", report, encoder)


def run_all(args, rank: int, world: int) -> dict:
    """The outlier report and every evaluation for one encoder, and summary.md / summary.json / summary.png."""
    def read():
        sentences = read_sentences(args)
        contexts = read_contexts(args, args.pool_sentences)
        wic_data = read_wic(args.wic, None) if args.wic else None
        sts_data = {name: read_sts(name, None, args.score_range) for name in args.sts or []}
        return sentences, contexts, wic_data, sts_data

    (sentences, contexts, wic_data, sts_data), encoder = prepare(args, rank, read)
    notes = [note for note, missing in (("WiC skipped: no --wic file given", wic_data is None),
                                        ("STS skipped: no --sts data given", not sts_data)) if missing]
    for note in notes if rank == 0 else []:
        print(f"note: {note}")
    setting = setting_of(args, encoder, rank, world)
    reference = reference_of(args, setting, sentences, statistics=True, sample=2 * args.num_pairs, covariance=True)
    header = run_header(args, encoder, reference)
    reports = {"outliers": outliers_report(args, encoder, reference.statistics, reference.num_sentences,
                                           reference.num_truncated),
               "anisotropy": {**header, **protocols.anisotropy(setting, reference)},
               "isotropy": {**header, **protocols.isotropy(setting, reference, args.zeta, args.minibatch,
                                                               args.minibatches)},
               "self_similarity": {**header, **protocols.self_similarity(setting, contexts, reference.variants)}}
    if wic_data is not None:
        reports["wic"] = {**header, "data": args.wic, "skipped": wic_data[1].to_dict(),
                          **protocols.wic(setting, wic_data[0], reference.variants)}
    for name, (pairs, unscored) in sts_data.items():
        fitted = protocols.refit_on_sentences(setting, reference, pair_sentences(pairs))  # --normalize on sentences
        reports[f"sts_{dataset_name(name, reports)}"] = {**run_header(args, encoder, fitted), "data": name,
                                                         "unscored": unscored,
                                                         **protocols.sts(setting, pairs, fitted.variants, args.static)}
    summary = summarise(reports, notes)
    figures = {file: make for name in reports if name != "outliers"
               for file, make in figures_of(name, reports[name], encoder.short_name).items()}
    figures["mean_vectors.png"] = lambda: mean_vectors_png(reports["outliers"], reference.statistics, encoder)
    figures["summary.png"] = lambda: summary_figure(summary, encoder.short_name)
    files = {f"{name}.json": report for name, report in reports.items()}
    files["summary.json"] = summary
    finish(args, rank, files, figures, {"summary.md": summary_markdown(summary)})
    if rank == 0:
        print("\n" + summary_markdown(summary))
        warn_truncation(reports)
    return summary


def dataset_name(source: str, taken=()) -> str:
    """A file-name-safe name of an STS source (the preset name, or the file's stem), numbered if already taken."""
    name = source if source in STS_PRESETS else "".join(
        c if c.isalnum() or c in "-_." else "_" for c in Path(source).stem or source)
    number, unique = 1, name
    while f"sts_{unique}" in taken:
        number += 1
        unique = f"{name}_{number}"
    return unique


def publish(args, rank: int, name: str, report: dict, encoder: FrozenEncoder) -> dict:
    finish(args, rank, {f"{name}.json": report}, figures_of(name, report, encoder.short_name))
    if rank == 0:
        print_report(name, report)
        warn_truncation({name: report})
    return report


def finish(args, rank: int, reports: dict, figures: dict, texts: dict | None = None) -> None:
    """Rank 0 writes every report, figure and text at once (all or nothing) and names them."""
    if rank != 0:
        return
    with staged_output(args.output_dir) as stage:
        for name, report in reports.items():
            write_json(stage / name, report)
        for name, make in figures.items():
            save_figure(make(), stage / name)
        for name, text in (texts or {}).items():
            (stage / name).write_text(text, encoding="utf-8")
    names = [*reports, *figures, *(texts or {})]
    print(f"wrote {', '.join(str(Path(args.output_dir) / n) for n in names)}")


# ---------------------------------------------------------------- command line


def add_common_arguments(parser: argparse.ArgumentParser, output: str, data: str | None = str(DEFAULT_CORPUS),
                         max_sentences: int = 2000) -> None:
    parser.add_argument("--encoder", default=None,
                        help="hub id, local model directory, or this project's export (default: packaged MiniLM)")
    parser.add_argument("--data", default=data, required=data is None,
                        help="txt (a sentence a line), csv/tsv/jsonl with a text column, a datasets directory, "
                             "or a datasets NAME[:CONFIG][:SPLIT] (default: the bundled corpus)" if data else
                        "the pairs: a file, a datasets directory or NAME[:CONFIG][:SPLIT] (formats: README)")
    parser.add_argument("--output_dir", default=f"runs/analyze/{output}")
    parser.add_argument("--text_column", default=None, help="column holding the text (default: auto-detected)")
    parser.add_argument("--max_length", type=int, default=None, help="tokens per sentence (default: model maximum)")
    parser.add_argument("--max_sentences", type=int, default=max_sentences,
                        help=f"random sample of this many sentences, by --seed (0: all; default {max_sentences})")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--exclude_special", action="store_true", help="do not count special tokens ([CLS], <s>, ...)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: CUDA when available)")
    parser.add_argument("--no_progress", action="store_true", help="no progress bar")


def add_rule_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--min_share", type=float, default=OutlierRule.min_share,
                        help="argmax/argmin share that makes a dimension an outlier")
    parser.add_argument("--sigma", type=float, default=OutlierRule.sigma,
                        help="robust z-score of a dimension's mean that makes it an outlier")


def add_variant_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clip", default="auto",
                        help="auto (the outlier dims detected on the same data), none, or dims d1,d2,... (0-indexed)")
    parser.add_argument("--normalize", choices=NORMALIZATIONS, default="none",
                        help="also report whitened (Su et al. 2021) or standardised (Timkey & van Schijndel 2021) "
                             "vectors, estimated on the token vectors of the same data (sts: on the mean-pooled "
                             "sentence embeddings of the pairs)")
    add_rule_arguments(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="analyze.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, run, help: str, output: str, data: str | None = str(DEFAULT_CORPUS),
                max_sentences: int = 2000, variants: bool = True) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        add_common_arguments(sub, output, data, max_sentences)
        add_variant_arguments(sub) if variants else add_rule_arguments(sub)
        sub.set_defaults(run=run)
        return sub

    command("outliers", run_outliers, "outlier dimensions per layer and their origins", "outliers", variants=False)
    anisotropy = command("anisotropy", run_anisotropy, "mean cosine of random token pairs per layer (2000 "
                         "sentences -> 1000 pairs), raw and clipped", "anisotropy")
    isotropy = command("isotropy", run_isotropy, "IsoScore, IsoScore* and the singular-value spectrum per layer",
                       "isotropy")
    selfsim = command("self-similarity", run_self_similarity, "self-similarity of words in different contexts "
                      "(Ethayarajh 2019), raw and anisotropy-adjusted", "self_similarity", max_sentences=5000)
    wic = command("wic", run_wic, "Word-in-Context: cosine of the target word's vectors against a threshold",
                  "wic", data=None)
    wic.add_argument("--gold", default=None, help="gold file of an original WiC .data.txt (default: beside it)")
    sts = command("sts", run_sts, "STS: Spearman of mean-pooled cosine against gold scores", "sts", data=None)
    sts.add_argument("--gold", default=None, help="gold file of a SentEval STS.input.*.txt (default: STS.gs.*)")
    everything = command("all", run_all, "the outlier report and every evaluation, with summary.md/json", "all")
    everything.add_argument("--wic", default=None, help="WiC data (as for `wic --data`); skipped when not given")
    everything.add_argument("--sts", nargs="+", default=None,
                            help=f"STS data sets (files or presets {', '.join(STS_PRESETS)}); skipped when not given")
    everything.add_argument("--pool_sentences", type=int, default=5000,
                            help="sentences searched for the self-similarity words (0: all; default 5000)")
    for sub in (sts, everything):
        sub.add_argument("--score_range", default="0,5", help="declared range of the gold scores LO,HI (default 0,5: "
                         "STS-B, STS12-16; SICK-R is 1-5)")
        sub.add_argument("--static", default=None, help="GloVe-format text file: a static-vector STS baseline")
    for sub in (selfsim, everything):
        sub.add_argument("--num_words", type=int, default=1000, help="words sampled for self-similarity")
        sub.add_argument("--min_sentences", type=int, default=10,
                         help="sentences a word must occur in; also the contexts used per word")
    for sub in (anisotropy, isotropy, everything):
        sub.add_argument("--num_pairs", type=int, default=1000,
                         help="token pairs: one random token from each of 2 x this many random sentences")
    for sub in (isotropy, everything):
        sub.add_argument("--zeta", type=float, default=0.2, help="IsoScore* shrinkage towards the full covariance")
        sub.add_argument("--minibatch", type=int, default=250, help="tokens per IsoScore* mini-batch")
        sub.add_argument("--minibatches", type=int, default=4, help="IsoScore* mini-batches (averaged)")
    return parser


def parse_clip(text: str) -> str | list[int]:
    text = text.strip().lower()
    if text in ("auto", "none"):
        return text
    try:
        dims = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"--clip must be auto, none or comma-separated dimensions, got {text!r}") from None
    if not dims:
        raise UserError("--clip got no dimensions")
    return dims


def parse_range(text: str) -> tuple[float, float]:
    try:
        low, high = (float(part) for part in text.split(","))
    except ValueError:
        raise UserError(f"--score_range must be LO,HI, got {text!r}") from None
    if not low < high:
        raise UserError(f"--score_range {text}: LO must be below HI")
    return low, high


def validate(args) -> None:
    for name in ("batch_size", "max_sentences", "max_length", "num_words", "min_sentences", "minibatch",
                 "minibatches", "pool_sentences", "num_pairs"):
        value = getattr(args, name, None)
        if value is not None and value < (0 if name in ("max_sentences", "pool_sentences") else 1):
            raise UserError(f"--{name} must be positive, got {value}")
    if getattr(args, "min_sentences", 2) < 2:
        raise UserError(f"--min_sentences must be at least 2, got {args.min_sentences}")
    if not 0 <= getattr(args, "zeta", 0) <= 1:
        raise UserError(f"--zeta must lie in [0, 1], got {args.zeta}")
    if hasattr(args, "clip"):
        args.clip = parse_clip(args.clip)
    if hasattr(args, "score_range"):
        args.score_range = parse_range(args.score_range)
    if args.encoder is None:
        args.encoder = default_encoder()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        validate(args)
        with distributed() as (rank, world):
            args.run(args, rank, world)
    except UserError as error:
        print(f"analyze.py {args.command}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
