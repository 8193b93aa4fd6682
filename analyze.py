"""Analyses of a frozen encoder: outlier neurons and their origins (more subcommands: see --help).

    python analyze.py outliers                                   # packaged MiniLM on the bundled corpus
    python analyze.py outliers --encoder bert-base-uncased --data data/austen.txt --output_dir runs/bert
    python analyze.py outliers --encoder runs/pretrain/export --data wikitext:wikitext-103-raw-v1:test
    torchrun --nproc_per_node 4 analyze.py outliers ...          # sentences sharded over ranks, rank 0 writes

Dimensions and layers are 0-indexed; layer 0 is the embedding output. Errors in the input are one line on
stderr and exit status 2, with nothing written.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from torchmetrics.aggregation import SumMetric

from callbacks.figures import mean_vectors_figure, save_figure
from datamodules.io import (
    DEFAULT_CORPUS,
    UserError,
    check_writable,
    iter_texts,
    sample_texts,
    staged_output,
    write_json,
)
from lightning_modules.encoder import FrozenEncoder, default_encoder, load_encoder
from metrics.neuron_stats import NeuronStatistics, NeuronStatisticsResult
from metrics.origins import summarise_origins, trace_origins
from metrics.outliers import OutlierRule, all_outlier_dims, detect_outliers, persistent_dims

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


def read_sentences(args, rank: int = 0, world: int = 1) -> list[str]:
    """The sampled sentences of --data (the same sample on every rank), then this rank's shard."""
    texts = sample_texts(iter_texts(args.data, args.text_column), args.max_sentences, args.seed)
    if not texts:
        raise UserError(f"no sentences in {args.data}")
    return list(itertools.islice(texts, rank, None, world))


def open_encoder(args, clip=None) -> FrozenEncoder:
    device = args.device
    if device is None and torch.cuda.is_available() and dist.is_initialized():
        device = f"cuda:{torch.cuda.current_device()}"
    encoder = load_encoder(args.encoder, device=device, clip=clip, exclude_special=args.exclude_special)
    encoder.check_max_length(args.max_length)
    return encoder


def collect_statistics(encoder: FrozenEncoder, sentences: list[str], args) -> tuple[NeuronStatisticsResult, int, int]:
    """Stream the sentences through the encoder into NeuronStatistics: (statistics, sentences, truncated)."""
    stats = NeuronStatistics(encoder.num_hidden_states, encoder.hidden_size).to(encoder.device)
    counted, truncated = SumMetric().to(encoder.device), SumMetric().to(encoder.device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the truncation count goes in the report instead
        for batch in encoder.batches(sentences, args.batch_size, args.max_length, total=len(sentences),
                                     progress=not args.no_progress):
            stats.update(batch.hidden_states, batch.mask)
            counted.update(batch.hidden_states.shape[1])
            truncated.update(batch.num_truncated)
    result = stats.compute()  # syncs across ranks under DDP
    return result, int(counted.compute()), int(truncated.compute())


def run_outliers(args, rank: int, world: int) -> dict:
    def prepare():
        sentences = read_sentences(args, rank, world)
        if rank == 0:
            check_writable(args.output_dir)
        return sentences, open_encoder(args)

    sentences, encoder = collectively(prepare)
    rule = OutlierRule(min_share=args.min_share, sigma=args.sigma)
    result, num_sentences, num_truncated = collect_statistics(encoder, sentences, args)
    if result.num_tokens == 0:
        raise UserError(f"no tokens counted in {args.data} (all special tokens excluded?)")
    layers = detect_outliers(result, rule)
    dims = all_outlier_dims(layers)
    report = {
        "encoder": str(args.encoder),
        "data": str(args.data),
        "num_sentences": num_sentences,
        "num_tokens": result.num_tokens,
        "num_truncated": num_truncated,
        "max_length": args.max_length or encoder.max_length,
        "special_tokens": "excluded" if args.exclude_special else "included",
        "seed": args.seed,
        "indexing": "0-indexed dimensions; layer 0 = embedding output",
        "hidden_size": encoder.hidden_size,
        "num_layers": encoder.num_layers,
        "rule": {"min_share": rule.min_share, "sigma": rule.sigma, "description": rule.describe()},
        "layers": [layer.to_dict() for layer in layers],
        "persistent_dims": persistent_dims(layers),
        "origins": trace_origins(encoder.model, dims),
    }
    if rank == 0:
        with staged_output(args.output_dir) as stage:
            write_json(stage / "outliers.json", report)
            figure = mean_vectors_figure(result.mean, {lay.layer: lay.outlier_dims for lay in layers},
                                         title=f"average vector per layer: {encoder.short_name}")
            save_figure(figure, stage / "mean_vectors.png")
        print_outliers(report, args.output_dir)
    return report


def print_outliers(report: dict, output_dir) -> None:
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
    for dim, line in summarise_origins(origins).items():
        if dim in report["persistent_dims"]:
            print(f"  origin of {dim}: {line}")
    if report["num_truncated"]:
        print(f"{report['num_truncated']} sentences truncated to {report['max_length']} tokens")
    print(f"wrote {Path(output_dir) / 'outliers.json'} and {Path(output_dir) / 'mean_vectors.png'}")


def add_common_arguments(parser: argparse.ArgumentParser, output: str) -> None:
    parser.add_argument("--encoder", default=None,
                        help="hub id, local model directory, or this project's export (default: packaged MiniLM)")
    parser.add_argument("--data", default=str(DEFAULT_CORPUS),
                        help="txt (a sentence a line), csv/tsv/jsonl with a text column, a datasets directory, "
                             "or a datasets NAME[:CONFIG][:SPLIT] (default: the bundled corpus)")
    parser.add_argument("--output_dir", default=f"runs/analyze/{output}")
    parser.add_argument("--text_column", default=None, help="column holding the text (default: auto-detected)")
    parser.add_argument("--max_length", type=int, default=None, help="tokens per sentence (default: model maximum)")
    parser.add_argument("--max_sentences", type=int, default=2000,
                        help="random sample of this many sentences, by --seed (0: all)")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--exclude_special", action="store_true", help="do not count special tokens ([CLS], <s>, ...)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: CUDA when available)")
    parser.add_argument("--no_progress", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="analyze.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    outliers = commands.add_parser("outliers", help="outlier dimensions per layer and their origins")
    add_common_arguments(outliers, "outliers")
    outliers.add_argument("--min_share", type=float, default=OutlierRule.min_share,
                          help="argmax/argmin share that makes a dimension an outlier")
    outliers.add_argument("--sigma", type=float, default=OutlierRule.sigma,
                          help="robust z-score of a dimension's mean that makes it an outlier")
    outliers.set_defaults(run=run_outliers)
    return parser


def validate(args) -> None:
    for name in ("batch_size", "max_sentences", "max_length"):
        value = getattr(args, name, None)
        if value is not None and value < (0 if name == "max_sentences" else 1):
            raise UserError(f"--{name} must be positive, got {value}")
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
