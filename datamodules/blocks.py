"""Tokenise and pack a corpus into full MLM blocks once, cached on disk; the tokenizer is trained once and cached too.

    cache = BlockCache("core/corpus/austen.txt", text_column=None, max_texts=None, cache_dir=None)
    tokenizer = cache.tokenizer(vocab_size=4096, tokenizer_texts=1_000_000)   # trained once, then read back
    info = cache.build(tokenizer, block_length=128, val_fraction=0.02, max_val_blocks=128)  # {"train": n, "validation": m}
    blocks = datasets.load_from_disk(cache.blocks_dir(tokenizer, 128, split))

Blocks: each text is tokenised without special tokens and followed by </s>; the stream is cut into pieces of
`block_length - 2` tokens and each block is `<s> piece </s>` (every block full, no padding, position 0 is <s>).
The cache lives under `cache_dir/blocks/<corpus>-<block_length>-<key>` (and `tokenizers/...`), the key hashing the
corpus (a local file by path, size and mtime), the tokenizer, the block length and the split; an entry is built in a
staging directory (core.output.new_stage: .staging-<host>-<pid>-*) and moved into place whole, so a killed build never
leaves a half-written entry behind, and the next build in the same directory removes the staging directory it left
(its pid gone from this host; a live build's stays).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
from pathlib import Path

import numpy as np

from core.errors import UserError, first_line
from core.output import new_stage, publish_directory
from core.tokenizers import boundary_ids, fingerprint, load_tokenizer, vocab_limit
from core.wording import plural
from datamodules.text import DATA_OPTION, iter_texts
from datamodules.tokenizer import train_tokenizer

CACHE_VERSION = 1


# ---- tokenise and pack (named module-level functions, so `datasets` can hash them) ----

def corpus_records(source: str, text_column: str | None, max_texts: int | None, skip_texts: int = 0):
    """Yield {"text": ...} for texts skip_texts .. skip_texts + max_texts of the corpus."""
    stop = None if max_texts is None else skip_texts + max_texts
    for text in itertools.islice(iter_texts(source, text_column, DATA_OPTION), skip_texts, stop):
        yield {"text": text}


def tokenize_texts(texts: list[str], tokenizer) -> list[list[int]]:
    """Token ids of each text without special tokens, and without the pad token where a text writes it ("<pad>",
    "[PAD]" in scraped text): the pad id is the model's zero padding row and, in RoBERTa, where positions restart."""
    rows = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    pad = tokenizer.pad_token_id
    return [[i for i in row if i != pad] if pad in row else row for row in rows]


def pack_blocks(ids: list[list[int]], block_length: int, bos: int, eos: int,
                carry: list[int] | None = None) -> tuple[list[list[int]], list[int]]:
    """Concatenate texts (each followed by eos), cut into <s> piece </s> blocks: (full blocks, leftover tokens)."""
    stream = list(carry or [])
    for row in ids:
        stream.extend(row)
        stream.append(eos)
    piece = block_length - 2
    full = len(stream) // piece
    blocks = [[bos, *stream[i * piece:(i + 1) * piece], eos] for i in range(full)]
    return blocks, stream[full * piece:]


def tokenize_and_pack(batch: dict, tokenizer, block_length: int) -> dict:
    """datasets.map function: a batch of texts → the full blocks it makes (the remainder of the batch is dropped)."""
    blocks, _ = pack_blocks(tokenize_texts(batch["text"], tokenizer), block_length, *boundary_ids(tokenizer))
    return {"input_ids": blocks}


def check_training_texts(source: str, text_column: str | None, val_texts: int) -> None:
    """A streaming run holds out the corpus's first `val_texts` texts for validation and trains on the rest: refuse a
    corpus with no text after them (a small file, read whole into validation), before anything is written."""
    if not any(corpus_records(source, text_column, 1, val_texts)):
        held = sum(1 for _ in corpus_records(source, text_column, val_texts))
        raise UserError(f"--data.val_texts {val_texts} holds out all {held} texts of corpus {source} for validation "
                        "(--data.streaming true), leaving none to train on: lower --data.val_texts, or read the corpus "
                        "without --data.streaming")


def reader_error(error: BaseException, source: str) -> str:
    """The reader's own one line (a UserError) inside datasets' "An error occurred while generating the dataset"."""
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, UserError):
        cause = cause.__cause__ or cause.__context__
    return str(cause) if cause is not None else f"no text in {source} (every row's text is empty?): {first_line(error)}"


def build_blocks(output: Path, source: str, text_column: str | None, max_texts: int | None, tokenizer,
                 block_length: int, val_fraction: float, max_val_blocks: int, num_proc: int | None,
                 skip_texts: int = 0, only_val: bool = False) -> dict:
    """Write a DatasetDict {"train", "validation"} of packed blocks to `output` (via a staging dir); its info."""
    import datasets

    stage = new_stage(output.parent)
    try:
        dtype = "uint16" if vocab_limit(tokenizer) <= 65536 else "int32"
        features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value(dtype), length=block_length)})
        try:
            texts = datasets.Dataset.from_generator(
                corpus_records, cache_dir=str(stage / "hf"), num_proc=None,
                gen_kwargs={"source": source, "text_column": text_column, "max_texts": max_texts,
                            "skip_texts": skip_texts})
        except datasets.exceptions.DatasetGenerationError as error:  # wraps what the reader raised, or no texts
            raise UserError(reader_error(error, source)) from None
        blocks = texts.map(tokenize_and_pack, batched=True, batch_size=2000, remove_columns=texts.column_names,
                           fn_kwargs={"tokenizer": tokenizer, "block_length": block_length}, features=features,
                           num_proc=num_proc, desc=f"tokenising and packing into {block_length}-token blocks")
        if len(blocks) < 2 and not only_val:
            raise UserError(f"corpus {source} gives {plural(len(blocks), 'full block')} of {block_length} tokens; "
                            "need at least 2 (a bigger corpus or a shorter --data.block_length)")
        if len(blocks) == 0:
            raise UserError(f"corpus {source} gives no full block of {block_length} tokens")
        if only_val:
            split = {"validation": blocks}
        else:
            num_val = min(max(1, round(val_fraction * len(blocks))), max_val_blocks, len(blocks) - 1)
            order = np.random.default_rng(0).permutation(len(blocks))
            split = {"train": blocks.select(np.sort(order[num_val:])), "validation": blocks.select(np.sort(order[:num_val]))}
        datasets.DatasetDict(split).save_to_disk(str(stage / "data"))
        info = {name: len(part) for name, part in split.items()}
        (stage / "data" / "blocks.json").write_text(json.dumps(info) + "\n")
        publish_directory(stage / "data", output)
        return info
    finally:
        shutil.rmtree(stage, ignore_errors=True)


# ---- the cache ----

def default_cache_dir() -> Path:
    return Path(os.environ.get("POSART_CACHE", Path.home() / ".cache" / "positional-artefacts"))


def corpus_fingerprint(source: str, text_column: str | None, max_texts: int | None) -> dict:
    """What identifies a corpus: a local file or directory by path, size and mtime; a hub name by itself."""
    path = Path(source).expanduser()
    if path.exists():
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        ident: object = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    else:
        ident = source
    return {"corpus": ident, "text_column": text_column, "max_texts": max_texts}


def digest(payload: object) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def corpus_stem(source: str) -> str:
    name = Path(source).stem if Path(source).expanduser().exists() else source
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:40]


class BlockCache:
    """Where a corpus's trained tokenizer and packed blocks are cached, and making them (see the module docstring)."""

    def __init__(self, corpus: str, text_column: str | None, max_texts: int | None, cache_dir: str | None) -> None:
        self.corpus, self.text_column, self.max_texts = corpus, text_column, max_texts
        self.root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        self.corpus_id = corpus_fingerprint(corpus, text_column, max_texts)

    def tokenizer_dir(self, vocab_size: int, tokenizer_texts: int) -> Path:
        key = digest({"corpus": self.corpus_id, "vocab": vocab_size, "texts": tokenizer_texts, "v": CACHE_VERSION})
        return self.root / "tokenizers" / f"{corpus_stem(self.corpus)}-{vocab_size}-{key}"

    def blocks_dir(self, tokenizer, block_length: int, split: dict) -> Path:
        key = digest({"corpus": self.corpus_id, "tokenizer": fingerprint(tokenizer), "block": block_length,
                      "split": split, "v": CACHE_VERSION})
        return self.root / "blocks" / f"{corpus_stem(self.corpus)}-{block_length}-{key}"

    def cached_tokenizer(self, vocab_size: int, tokenizer_texts: int):
        """The trained tokenizer if it is cached already, else None."""
        target = self.tokenizer_dir(vocab_size, tokenizer_texts)
        return load_tokenizer(target) if (target / "tokenizer.json").exists() else None

    def tokenizer(self, vocab_size: int, tokenizer_texts: int):
        """The cached trained tokenizer, trained on the first `tokenizer_texts` texts and cached if not there yet."""
        cached = self.cached_tokenizer(vocab_size, tokenizer_texts)
        if cached is not None:
            return cached
        texts = iter_texts(self.corpus, self.text_column)
        limit = min(tokenizer_texts, self.max_texts or tokenizer_texts)
        tokenizer = train_tokenizer(texts, vocab_size, max_texts=limit)
        target = self.tokenizer_dir(vocab_size, tokenizer_texts)
        stage = new_stage(target.parent)
        try:
            tokenizer.save_pretrained(stage)
            publish_directory(stage, target)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        return tokenizer
