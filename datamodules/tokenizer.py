"""Tokenizers for MLM pretraining: a byte-level BPE trained on the corpus with RoBERTa's special ids, or an existing one.

    tokenizer = train_tokenizer(iter_texts("data/austen.txt"), vocab_size=8192)   # <s>=0 <pad>=1 </s>=2 <unk>=3 <mask>=4
    tokenizer = load_tokenizer("roberta-base")                                     # hub id or local directory
    fingerprint(tokenizer)                                                         # sha256 of its full definition

A trained tokenizer is a transformers `RobertaTokenizer` (fast), so `save_pretrained` writes the files that
`AutoTokenizer.from_pretrained` reads back, and it adds <s> ... </s> around each text like RoBERTa's.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable
from pathlib import Path

from datamodules.io import UserError

SPECIAL_TOKENS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")  # ids 0..4, RoBERTa's (fairseq's) order
MIN_VOCAB = len(SPECIAL_TOKENS) + 256  # the byte alphabet must fit


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2, max_texts: int | None = None,
                    model_max_length: int = 512):
    """Train a byte-level BPE on `texts` (the first `max_texts` when given) with RoBERTa's special tokens and ids."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import RobertaTokenizerFast

    if vocab_size < MIN_VOCAB:
        raise UserError(f"--data.vocab_size must be at least {MIN_VOCAB} for a byte-level BPE, got {vocab_size}")
    trainer = ByteLevelBPETokenizer()
    texts = itertools.islice(texts, max_texts) if max_texts else texts
    trainer.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=min_frequency,
                                special_tokens=list(SPECIAL_TOKENS), show_progress=False)
    tokenizer = RobertaTokenizerFast(vocab=trainer.get_vocab(), merges=_merges(trainer), model_max_length=model_max_length)
    check_special_ids(tokenizer, "the trained tokenizer")
    return tokenizer


def _merges(trainer) -> list[tuple[str, str]]:
    import json

    state = json.loads(trainer._tokenizer.to_str())
    return [tuple(merge) if isinstance(merge, list) else tuple(merge.split(" ")) for merge in state["model"]["merges"]]


def load_tokenizer(source: str | Path):
    """An existing tokenizer by hub id or local directory; it must have <mask> and <pad> tokens."""
    from transformers import AutoTokenizer

    path = Path(source).expanduser()
    if not path.exists() and looks_like_path(str(source)):
        raise UserError(f"tokenizer path not found: {source}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path) if path.exists() else str(source))
    except (OSError, ValueError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(f"cannot load tokenizer {str(source)!r}: {first}") from None
    for name in ("mask_token_id", "pad_token_id"):
        if getattr(tokenizer, name, None) is None:
            raise UserError(f"tokenizer {source} has no {name.removesuffix('_token_id')} token, needed for MLM")
    if not tokenizer.is_fast:
        raise UserError(f"tokenizer {source} is not a fast (Rust) tokenizer")
    return tokenizer


def looks_like_path(source: str) -> bool:
    """A local path rather than a hub id (`name` or `org/name`): it starts with '.', '/' or '~', has more than one
    '/', or its parent directory exists here."""
    parts = Path(source).parts
    return source.startswith((".", "/", "~")) or len(parts) > 2 or (len(parts) == 2 and Path(parts[0]).is_dir())


def check_special_ids(tokenizer, name: str) -> None:
    """RoBERTa's ids: <s>=0, <pad>=1, </s>=2, <unk>=3, <mask>=4."""
    got = tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    if got != list(range(len(SPECIAL_TOKENS))):
        raise UserError(f"{name} has special ids {dict(zip(SPECIAL_TOKENS, got))}, expected 0..4")


def vocab_limit(tokenizer) -> int:
    """One more than the largest id the tokenizer can produce (the rows a model's embedding needs)."""
    return max(tokenizer.get_vocab().values()) + 1


def fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's full definition (vocabulary, merges, special tokens, normalisation)."""
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode("utf-8")).hexdigest()[:16]


def tokenizer_files(tokenizer) -> dict[str, str]:
    """The files `save_pretrained` writes, as {name: text}, to embed a tokenizer in a checkpoint."""
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        tokenizer.save_pretrained(directory)
        return {path.name: path.read_text(encoding="utf-8") for path in Path(directory).iterdir() if path.is_file()}


def tokenizer_from_files(files: dict[str, str]):
    """Inverse of `tokenizer_files`."""
    import tempfile

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as directory:
        for name, text in files.items():
            (Path(directory) / name).write_text(text, encoding="utf-8")
        return AutoTokenizer.from_pretrained(directory)
