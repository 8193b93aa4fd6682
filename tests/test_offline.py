"""Offline (no network, no HF_HUB_OFFLINE), a hub id or datasets name fails at once with the one line that names the way
out, and no hub call is made (they are stubbed here: one would retry for minutes)."""

from __future__ import annotations

import socket
import time

import datasets
import pytest
import transformers

import analyze
from core import sources
from core.errors import UserError
from core.tokenizers import load_tokenizer
from datamodules.text import iter_records
from lightning_modules.encoder import load_encoder
from tests.tiny import free_port

WAY_OUT = "pass a local path, or set HF_HUB_OFFLINE=1 to use the local cache"


@pytest.fixture
def hub_calls(monkeypatch):
    """Online settings (no offline flag), the hub calls recorded instead of made."""
    for flag in sources.OFFLINE_FLAGS:
        monkeypatch.delenv(flag, raising=False)
    monkeypatch.setattr(sources, "_answered", {})
    calls = []

    def record(name):
        def call(*args, **kwargs):
            calls.append((name, args[-1] if args else kwargs))
            raise OSError(f"{name}: stubbed")
        return call

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", record("AutoConfig"))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", record("AutoTokenizer"))
    monkeypatch.setattr(datasets, "load_dataset", record("load_dataset"))
    return calls


def test_unreachable_hub_fails_in_seconds_with_the_way_out_and_no_hub_call(hub_calls, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens there: refused at once
    start = time.monotonic()
    for load, name, what in ((load_encoder, "bert-base-uncased", "encoder"), (load_tokenizer, "roberta-base", "tokenizer"),
                             (lambda source: list(iter_records(source)), "glue/sst2", "dataset")):
        with pytest.raises(UserError) as error:
            load(name)
        assert str(error.value) == f"{what} {name.split(':')[0]!r} is a hub name and 127.0.0.1 cannot be reached: {WAY_OUT}"
    assert hub_calls == []
    # through analyze.py: one line on stderr, exit status 2, nothing written
    out = tmp_path / "out"
    assert analyze.main(["outliers", "--encoder", "bert-base-uncased", "--output_dir", str(out), "--no_progress",
                         "--max_sentences", "5"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("analyze.py outliers: error: encoder 'bert-base-uncased'") and \
        lines[0].endswith(WAY_OUT)
    assert not out.exists() and hub_calls == []
    assert time.monotonic() - start < 10  # (the hub's own retries take 35-68 s)


def test_a_reachable_hub_or_offline_mode_goes_to_the_libraries(hub_calls, monkeypatch):
    with socket.socket() as server:  # a hub that accepts connections
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        with pytest.raises(UserError, match="AutoConfig: stubbed"):
            load_encoder("bert-base-uncased")
    assert [name for name, _ in hub_calls] == ["AutoConfig"]
    # HF_HUB_OFFLINE: the libraries read their cache (fast); nothing is probed
    monkeypatch.setattr(sources, "_answered", {})
    monkeypatch.setattr(sources, "reachable", lambda *a, **k: pytest.fail("probed the hub while offline"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="AutoTokenizer: stubbed"):
        load_tokenizer("roberta-base")
    assert [name for name, _ in hub_calls] == ["AutoConfig", "AutoTokenizer"]
