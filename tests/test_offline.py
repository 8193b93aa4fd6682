"""Offline (no network, no HF_HUB_OFFLINE), a hub id or datasets name fails at once with the one line that names the way
out, and no hub call is made (they are stubbed here: one would retry for minutes). Told to stay offline, an uncached hub
name's line names the variable that tells the library so, read as the libraries read it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
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
from lightning_modules.finetune import load_classifier
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


FAKE = "no-such-org/no-such-model-39"  # in no cache: the libraries (offline in tests: conftest) refuse it at once


def test_an_uncached_hub_name_offline_names_the_variable_that_says_offline(monkeypatch, tmp_path, capsys):
    for flag in sources.OFFLINE_FLAGS:
        monkeypatch.delenv(flag, raising=False)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")  # the one variable set (huggingface_hub reads it)
    out = tmp_path / "out"
    assert analyze.main(["outliers", "--encoder", FAKE, "--output_dir", str(out), "--no_progress"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"analyze.py outliers: error: cannot load encoder '{FAKE}' (offline: TRANSFORMERS_OFFLINE is set): ")
    assert not out.exists() and list(tmp_path.iterdir()) == []
    # the tokenizer (train.py --data.tokenizer) and the fine-tuned encoder (train.py --model.encoder), HF_HUB_OFFLINE
    monkeypatch.delenv("TRANSFORMERS_OFFLINE")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError) as error:
        load_tokenizer(FAKE)
    assert str(error.value).startswith(f"cannot load tokenizer '{FAKE}' (offline: HF_HUB_OFFLINE is set): ")
    with pytest.raises(UserError) as error:
        load_classifier(FAKE, [0, 1])
    assert str(error.value).startswith(f"cannot load encoder '{FAKE}' (offline: HF_HUB_OFFLINE is set): ")
    # a local path's failure is not the hub's: no note
    assert str(sources.cannot_load("encoder", str(tmp_path), "why")) == f"cannot load encoder {str(tmp_path)!r}: why"


OFFLINE_CASES = [  # ({variable: value}, what transformers is told, what datasets is told), read by hand from the rules
    ({}, [], []),
    ({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}, ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"],
     ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"]),
    ({"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "1"}, [], []),  # HF_HUB_OFFLINE, set, is the one read
    ({"HF_HUB_OFFLINE": "", "TRANSFORMERS_OFFLINE": "yes"}, ["TRANSFORMERS_OFFLINE"], ["TRANSFORMERS_OFFLINE"]),
    ({"HF_DATASETS_OFFLINE": "1"}, [], ["HF_DATASETS_OFFLINE"]),  # datasets alone
    ({"HF_DATASETS_OFFLINE": "0", "HF_HUB_OFFLINE": "true"}, ["HF_HUB_OFFLINE"], []),
    ({"HF_DATASETS_OFFLINE": "", "HF_HUB_OFFLINE": "1"}, ["HF_HUB_OFFLINE"], []),  # datasets: set, even empty, rules
]


def test_offline_flags_read_as_the_libraries_read_them(monkeypatch):
    for environment, hub, data in OFFLINE_CASES:
        for flag in sources.OFFLINE_FLAGS:
            monkeypatch.delenv(flag, raising=False)
        for flag, value in environment.items():
            monkeypatch.setenv(flag, value)
        assert (sources.offline_flags("encoder"), sources.offline_flags("tokenizer"), sources.offline_flags("dataset")) \
            == (hub, hub, data), environment
    # and the libraries themselves (their flags are read once, at import: a fresh process, reloaded per case)
    script = ("import importlib, json, os, sys\nimport huggingface_hub.constants as hub\nimport datasets.config as dc\n"
              "answers = []\nfor env in json.loads(sys.argv[1]):\n"
              "    [os.environ.pop(f, None) for f in ('HF_HUB_OFFLINE', 'HF_DATASETS_OFFLINE', 'TRANSFORMERS_OFFLINE')]\n"
              "    os.environ.update(env); importlib.reload(hub); importlib.reload(dc)\n"
              "    answers.append([hub.HF_HUB_OFFLINE, dc.HF_HUB_OFFLINE])\nprint(json.dumps(answers))")
    done = subprocess.run([sys.executable, "-c", script, json.dumps([env for env, _, _ in OFFLINE_CASES])],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [[bool(hub), bool(data)] for _, hub, data in OFFLINE_CASES]
