"""A byte-level BPE trained on the pretraining corpus, with RoBERTa's special tokens and ids.

    tokenizer = train_tokenizer(iter_texts("core/corpus/austen.txt"), vocab_size=8192)   # <s>=0 <pad>=1 </s>=2 <unk>=3 <mask>=4

A trained tokenizer is a transformers `RobertaTokenizer` (fast), so `save_pretrained` writes the files that
`AutoTokenizer.from_pretrained` reads back, and it adds <s> ... </s> around each text like RoBERTa's. Loading an
existing tokenizer, and a tokenizer's identity, live in core/tokenizers.py.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable

from core.errors import UserError
from core.tokenizers import SPECIAL_TOKENS, check_special_ids

MIN_VOCAB = len(SPECIAL_TOKENS) + 256  # the byte alphabet must fit


def check_vocab_size(vocab_size: int) -> None:
    """A byte-level BPE's vocabulary holds at least the special tokens and the 256 bytes."""
    if vocab_size < MIN_VOCAB:
        raise UserError(f"--data.vocab_size must be at least {MIN_VOCAB} for a byte-level BPE, got {vocab_size}")


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2, max_texts: int | None = None,
                    model_max_length: int = 512):
    """Train a byte-level BPE on `texts` (the first `max_texts` when given) with RoBERTa's special tokens and ids."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import RobertaTokenizerFast

    check_vocab_size(vocab_size)
    trainer = ByteLevelBPETokenizer()
    texts = itertools.islice(texts, max_texts) if max_texts else texts
    trainer.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=min_frequency,
                                special_tokens=list(SPECIAL_TOKENS), show_progress=False)
    tokenizer = RobertaTokenizerFast(vocab=trainer.get_vocab(), merges=_merges(trainer), model_max_length=model_max_length)
    check_special_ids(tokenizer, "the trained tokenizer")
    return tokenizer


def _merges(trainer) -> list[tuple[str, str]]:
    state = json.loads(trainer._tokenizer.to_str())
    return [tuple(merge) if isinstance(merge, list) else tuple(merge.split(" ")) for merge in state["model"]["merges"]]
