"""The plumbing of one analyze.py run: ranks, reading, the encoder, the reference pass, and writing reports.

    with distributed() as (rank, world):                  # torchrun: a process group, destroyed on exit
        sentences, encoder = prepare(args, rank, lambda: read_sentences(args))   # fail together on every rank
        setting = setting_of(args, encoder, rank, world)
        reference = reference_of(args, setting, sentences, sample=2000)
        publish(args, rank, "anisotropy", {**run_header(args, encoder, reference), **body}, encoder)

Rank 0 writes every report and figure at once (all or nothing, core.output.staged_output) and prints them.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from analyses.reference import Reference, Setting, reference_pass
from analyses.reports import figures_of, print_report
from core.errors import UserError
from core.figures import save_figure
from core.models import model_family
from core.output import check_writable, staged_output, write_json
from core.tokenizers import unknown_line
from core.wording import plural
from datamodules.pairs import STS_PRESETS
from datamodules.text import iter_texts, sample_texts
from lightning_modules.encoder import FrozenEncoder, encoder_tokenizer, load_encoder
from metrics.outliers import OutlierRule
from metrics.transforms import SOFTDECAY_ALPHA

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
    done = False
    try:
        yield dist.get_rank(), dist.get_world_size()
        done = True
    finally:
        leave_process_group(barrier=done)


def leave_process_group(barrier: bool) -> None:
    """Destroy the process group (one `distributed` made, or the one study.py's arms kept under torchrun): after a
    barrier when every rank is done (gloo can abort a rank whose peer left: exit status 134), at once after an error."""
    if dist.is_available() and dist.is_initialized():
        if barrier:
            dist.barrier()
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


def open_encoder(args, masked_lm: bool = False, tokenizer=None) -> FrozenEncoder:
    """--encoder on --device (under torchrun, this rank's GPU) in --dtype (float32 by default on every device: a GPU's
    report equals the CPU's); with `masked_lm`, with its MLM head when it has one; with `tokenizer` (its own, loaded
    alone already: encoder_tokenizer), without loading that again."""
    device = args.device
    if device is None and torch.cuda.is_available() and dist.is_initialized():
        device = f"cuda:{torch.cuda.current_device()}"
    encoder = load_encoder(args.encoder, device=device, dtype=getattr(torch, getattr(args, "dtype", "float32")),
                           exclude_special=args.exclude_special,
                           allow_random_weights=getattr(args, "allow_random_weights", False), masked_lm=masked_lm,
                           tokenizer=tokenizer)
    encoder.check_max_length(args.max_length)
    clip = getattr(args, "clip", None)
    if clip is not None and not clip.needs_outliers:  # given dims or layers: check them against this model now
        clip.resolve(None, encoder.num_hidden_states, encoder.hidden_size)
    return encoder


def readable(encoder: FrozenEncoder, max_length: int | None) -> Callable[[list[str]], list[int]]:
    """Given sentences, the leading characters of each that `encoder` reads: all of a sentence, or where its tokens
    end once truncated to `max_length` (FrozenEncoder.tokenize's `covered`). The self-similarity draws a word's
    contexts there (datamodules.words.WordSample.contexts): an occurrence past the cut has no vector. A sentence whose
    text, as the tokenizer's normalizer writes it, has fewer UTF-8 bytes than the tokens left beside the special
    tokens is read whole untokenised: a token holds a byte of that text at least (a character of WordPiece, a byte of
    a byte-level BPE), and a SentencePiece adds one '▁' before it. The normalized text, not the sentence: NFKC (XLM-R's,
    ALBERT's) writes '½' (2 bytes) as '1⁄2', three tokens."""
    room = encoder.check_max_length(max_length) - encoder.tokenizer.num_special_tokens_to_add(pair=False) - 1
    normalizer = getattr(getattr(encoder.tokenizer, "backend_tokenizer", None), "normalizer", None)
    normalized = normalizer.normalize_str if normalizer is not None else str

    def visible(sentences: list[str]) -> list[int]:
        covered = [len(sentence) for sentence in sentences]
        long = [i for i, sentence in enumerate(sentences)
                if len(sentence.encode("utf-8")) > room or len(normalized(sentence).encode("utf-8")) > room]
        if long:
            cut = encoder.tokenize([sentences[i] for i in long], max_length, offsets=True)[0]["covered"]
            for i, characters in zip(long, cut, strict=True):
                covered[i] = characters
        return covered

    return visible


def setting_of(args, encoder: FrozenEncoder, rank: int = 0, world: int = 1) -> Setting:
    return Setting(encoder, args.batch_size, args.max_length, args.seed, not args.no_progress, rank, world)


def prepare(args, rank: int, read: Callable[..., T], masked_lm: bool = False, tokenizer: bool = False
            ) -> tuple[T, FrozenEncoder]:
    """Read the data, check the output directory and load the encoder (`masked_lm`: with its MLM head when it has
    one), failing together on every rank. With `tokenizer`, `read` is called with a function that gives the encoder's
    tokenizer, loaded alone at its first call (`encoder_tokenizer`: its weights never read), for data drawn by it (the
    self-similarity words, outside its special tokens): data it refuses is refused before a hub model downloads, and
    the encoder then reuses that tokenizer."""
    def step():
        loaded = []

        def encoder_tokenizer_once():
            if not loaded:
                loaded.append(encoder_tokenizer(args.encoder))
            return loaded[0]

        data = read(encoder_tokenizer_once) if tokenizer else read()
        if rank == 0:
            check_writable(args.output_dir)
        return data, open_encoder(args, masked_lm, loaded[0] if loaded else None)

    data, encoder = collectively(step)
    same_commit(encoder.name, encoder.commit)
    return data, encoder


def same_commit(name: str, commit: str | None) -> None:
    """Under DDP, one line on every rank when the ranks read a hub id at different commits (its branch moved while they
    loaded: each process pins the commit its own first read resolved to), so that no report mixes two models."""
    if not dist.is_initialized():
        return
    commits: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(commits, commit)
    if len(set(commits)) > 1:
        shown = ", ".join(f"rank {rank}: {value}" for rank, value in enumerate(commits))
        raise UserError(f"the processes read {name} at different commits ({shown}): its branch moved while they "
                        f"loaded; run again, or pin one: --encoder {name.split('@')[0]}@{commits[0]}")


def run_header(args, encoder: FrozenEncoder, reference: Reference | None = None) -> dict:
    header = {
        "encoder": str(args.encoder),
        "encoder_commit": encoder.commit,  # the hub commit it was read at; None for a local path or checkpoint
        "data": str(args.data),
        "max_length": args.max_length or encoder.max_length,
        "dtype": str(next(encoder.model.parameters()).dtype).removeprefix("torch."),  # what it computed in
        "special_tokens": "excluded" if args.exclude_special else "included",
        "seed": args.seed,
        "indexing": "0-indexed dimensions; layer 0 = embedding output",
        "model_family": model_family(encoder.model).to_dict(),  # causal or not, positions, norms, what layer L is
    }
    if reference is not None:
        header.update(reference.header())
    return header


def reference_of(args, setting: Setting, sentences: list[str], **needs) -> Reference:
    """The reference pass over `sentences` for --clip / --normalize (and what `needs` asks for)."""
    reference = reference_pass(setting, sentences, args.clip, args.normalize, OutlierRule(args.min_share, args.sigma),
                               softdecay_alpha=getattr(args, "softdecay_alpha", SOFTDECAY_ALPHA), **needs)
    if reference.statistics is not None and reference.statistics.num_tokens == 0:
        raise UserError("no tokens counted for the outlier statistics (all special tokens excluded?)")
    return reference


def pair_sentences(items) -> list[str]:
    return list(dict.fromkeys(s for item in items for s in (item.sentence1, item.sentence2)))


def warn_text_counts(reports: dict[str, dict]) -> None:
    """One line on stderr per truncation count and per unknown-token count in `reports` ({name: report}; reports from
    one pass share a line).

    The truncations are the report's num_truncated, of its num_sentences (pair reports: 2 x num_pairs sentences); the
    unknown tokens its num_unknown ([UNK]: text the tokenizer's vocabulary lacks, read as one vector that is no word's),
    of the num_tokens of a report of the same count that has them."""
    counts: dict[tuple, list[str]] = {}
    tokens: dict[int, int] = {}
    for name, report in reports.items():
        if report.get("num_truncated"):
            total = report.get("num_sentences", 2 * report.get("num_pairs", 0))
            counts.setdefault((report["num_truncated"], total, report["max_length"]), []).append(f"{name}.json")
        if report.get("num_unknown"):
            counts.setdefault((report["num_unknown"],), []).append(f"{name}.json")
            if tokens.get(report["num_unknown"]) is None:
                tokens[report["num_unknown"]] = report.get("num_tokens")
    for key, names in counts.items():
        where = "the report" if len(reports) == 1 else ", ".join(names)
        if len(key) == 3:
            verb = "was" if key[0] == 1 else "were"
            print(f"warning: {key[0]} of {plural(key[1], 'sentence')} {verb} longer than {key[2]} tokens and {verb} "
                  f"truncated (counted in {where} as num_truncated)", file=sys.stderr)
        else:
            print(f"warning: {unknown_line(key[0], tokens[key[0]], where)}", file=sys.stderr)


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
        warn_text_counts({name: report})
    return report


def finish(args, rank: int, reports: dict, figures: dict, texts: dict | None = None) -> None:
    """Rank 0 writes every report, figure and text at once (all or nothing) and names them; the files an earlier run
    of the same subcommand wrote into --output_dir and this one does not (a figure this model has none of, an STS set
    left out) are removed (core.output.staged_output's `owner`), so no report of another run stands beside these."""
    if rank != 0:
        return
    with staged_output(args.output_dir, owner=getattr(args, "command", None)) as stage:
        for name, report in reports.items():
            write_json(stage / name, report)
        for name, make in figures.items():
            save_figure(make(), stage / name)
        for name, text in (texts or {}).items():
            (stage / name).write_text(text, encoding="utf-8")
    names = [*reports, *figures, *(texts or {})]
    print(f"wrote {', '.join(str(Path(args.output_dir) / n) for n in names)}")
