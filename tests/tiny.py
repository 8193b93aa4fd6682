"""Tiny random BERT / RoBERTa / DistilBERT / ALBERT encoders and tokenizers for unit tests (CPU, seconds).

    tokenizer = bert_tokenizer(tmp_path)                      # WordPiece vocabulary of the bundled corpus
    path = save_tiny_encoder(tmp_path / "bert", "bert", tokenizer, plant=lambda model: ...)
    port = free_port()                                        # for a 2-process gloo group
"""

from __future__ import annotations

import itertools
import socket
from collections.abc import Callable
from pathlib import Path

import torch

from datamodules.text import DEFAULT_CORPUS

HIDDEN = 32
LAYERS = 3
MAX_POSITIONS = 64


def corpus_sentences(n: int = 400, start: int = 0) -> list[str]:
    with open(DEFAULT_CORPUS, encoding="utf-8") as handle:
        return [line.strip() for line in itertools.islice(handle, start, start + n)]


def bert_tokenizer(directory: Path, vocab_size: int = 600):
    """A WordPiece vocabulary of the bundled corpus built deterministically: the special tokens, every character as a
    word start and as a continuation (##c), the most frequent pieces inside words, then the most frequent words (ties
    by spelling). tokenizers' own WordPiece
    trainer breaks frequency ties differently in every process (a Rust HashMap's random seed), so tests that
    trained one saw another vocabulary, and other model outputs, on each run."""
    from collections import Counter

    from tokenizers import normalizers, pre_tokenizers
    from transformers import BertTokenizerFast

    normalizer, splitter = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    counts = Counter(word for sentence in corpus_sentences(2000)
                     for word, _ in splitter.pre_tokenize_str(normalizer.normalize_str(sentence)))
    base = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted({c for word in counts for c in word}),
            *sorted({f"##{c}" for word in counts for c in word[1:]})]
    pieces = Counter()  # word endings of 2-4 characters (##ing, ##ed, ...): a third of the rest
    for word, count in counts.items():
        for size in range(2, 5):
            for start in range(1, len(word) - size + 1):
                pieces[f"##{word[start:start + size]}"] += count

    def most_frequent(counter: Counter, n: int) -> list[str]:
        ranked = sorted(counter.items(), key=lambda item: (-item[1], item[0]))
        return [token for token, _ in ranked if token not in base][:max(0, n)]

    rest = vocab_size - len(base)
    vocab = base + most_frequent(pieces, rest // 3)
    vocab += most_frequent(counts, vocab_size - len(vocab))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    return BertTokenizerFast(vocab=str(directory / "vocab.txt"), model_max_length=MAX_POSITIONS)


def roberta_tokenizer(directory: Path, vocab_size: int = 600):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import RobertaTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(corpus_sentences(2000), vocab_size=vocab_size, min_frequency=1,
                                special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    trainer.save_model(str(directory))
    return RobertaTokenizerFast(vocab=str(directory / "vocab.json"), merges=str(directory / "merges.txt"),
                                model_max_length=MAX_POSITIONS - 2)


def tiny_config(kind: str, vocab_size: int, **overrides):
    from transformers import AlbertConfig, BertConfig, DistilBertConfig, RobertaConfig

    common = dict(vocab_size=vocab_size, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=MAX_POSITIONS, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0)
    if kind == "bert":
        return BertConfig(**{**common, **overrides})
    if kind == "roberta":
        return RobertaConfig(**{**common, "max_position_embeddings": MAX_POSITIONS + 2, "pad_token_id": 1,
                                "bos_token_id": 0, "eos_token_id": 2, "type_vocab_size": 1, **overrides})
    if kind == "distilbert":
        return DistilBertConfig(vocab_size=vocab_size, dim=HIDDEN, n_layers=LAYERS, n_heads=4, hidden_dim=64,
                                max_position_embeddings=MAX_POSITIONS, dropout=0.0, attention_dropout=0.0, **overrides)
    if kind == "albert":
        return AlbertConfig(**{**common, "embedding_size": 16, **overrides})
    raise ValueError(kind)


def save_tiny_encoder(directory: Path, kind: str, tokenizer, plant: Callable | None = None, seed: int = 0,
                      masked_lm: bool = False, **overrides) -> Path:
    """A random tiny encoder of `kind` saved with its tokenizer; `plant(model)` edits weights before saving."""
    from transformers import AutoModel, AutoModelForMaskedLM

    torch.manual_seed(seed)
    config = tiny_config(kind, len(tokenizer), **overrides)
    return save_planted((AutoModelForMaskedLM if masked_lm else AutoModel).from_config(config), tokenizer, directory,
                        plant)


def save_planted(model, tokenizer, directory: Path, plant: Callable | None = None) -> Path:
    """`model` saved with `tokenizer` in `directory`, after `plant(model)` edited its weights (when given)."""
    if plant is not None:
        with torch.no_grad():
            plant(model)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def free_port() -> int:
    """A free TCP port on localhost (MASTER_PORT of a 2-process DDP test)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def reports_close(a, b, where: str = "", rel: float = 1e-5, abs: float = 1e-7, skip: tuple[str, ...] = ()) -> None:
    """Two reports (JSON-like) of equal structure, their floats within `rel` / `abs` (a sharded pass sums in another
    order, pads otherwise), everything else equal; the paths in `skip` (e.g. ".output_dir") are not compared."""
    import pytest

    if where in skip:
        return
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            reports_close(a[key], b[key], f"{where}.{key}", rel, abs, skip)
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            reports_close(x, y, f"{where}[{index}]", rel, abs, skip)
    elif isinstance(a, float):
        assert b == pytest.approx(a, rel=rel, abs=abs), where
    else:
        assert a == b, where
