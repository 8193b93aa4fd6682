"""A seeded fuzz of the three entry points' inputs: random bytes, truncated files of each format they read, huge
lines, empty fields. Every outcome is a report (exit 0) or one line on stderr with exit status 2 and nothing written;
never a traceback. Inputs that cannot be valid (random bytes, a torn binary or JSON file) must be refused.

    .venv/bin/pytest tests/test_fuzz.py -q         # in-process calls, about a second a case
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import analyze
import probe
import train
from tests.test_train import tiny_args
from tests.test_untrusted import ARCHITECTURE, probe_args
from tests.tiny import corpus_sentences, save_tiny_encoder

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("ignore")  # warnings are a valid outcome; this file checks the errors
SEED = 17
BANNER = ("Traceback", "GPU available", "Seed set", "usage:")

SENTENCES = [s.replace(",", " ").replace('"', " ").replace("\t", " ") for s in corpus_sentences(12, start=40)]
WIC_ITEM = {"word": "bank", "sentence1": "He sat on the bank of the river.", "sentence2": "The bank closed early.",
            "start1": 14, "end1": 18, "start2": 4, "end2": 8, "label": False}


def valid_files() -> dict[str, bytes]:
    """One small valid file of each format the data options read."""
    wic = [WIC_ITEM, {**WIC_ITEM, "sentence1": "They bank on it.", "start1": 5, "end1": 9, "label": True}]
    sts = [{"sentence1": a, "sentence2": b, "score": i % 5} for i, (a, b) in enumerate(zip(SENTENCES, SENTENCES[1:]))]
    return {
        "data.txt": "".join(f"{s}\n" for s in SENTENCES).encode(),
        "data.csv": ("id,text\n" + "".join(f"{i},{s}\n" for i, s in enumerate(SENTENCES))).encode(),
        "data.tsv": ("id\ttext\n" + "".join(f"{i}\t{s}\n" for i, s in enumerate(SENTENCES))).encode(),
        "data.jsonl": "".join(json.dumps({"text": s}) + "\n" for s in SENTENCES).encode(),
        "wic.jsonl": "".join(json.dumps(item) + "\n" for item in wic).encode(),
        "sts.jsonl": "".join(json.dumps(pair) + "\n" for pair in sts).encode(),
    }


def generated(rng: random.Random) -> list[tuple[str, str, Callable[[Path], bytes], bool]]:
    """(case id, file name, its content from a folder of valid files, whether it must be refused)."""
    cases = []
    for suffix in (".txt", ".csv", ".tsv", ".jsonl", ".json"):
        noise = rng.randbytes(4096)
        cases.append((f"random bytes{suffix}", f"random{suffix}", lambda _, b=noise: b, True))
    for suffix in (".txt", ".csv"):  # no NUL: past the binary check, into UTF-8 decoding
        noise = bytes(byte | 0x80 for byte in rng.randbytes(4096))
        cases.append((f"random high bytes{suffix}", f"high{suffix}", lambda _, b=noise: b, True))
    for name in ("data.txt", "data.csv", "data.tsv", "data.jsonl"):
        for cut in (rng.random(), rng.random()):
            cases.append((f"{name} truncated at {cut:.2f}", name, lambda folder, n=name, c=cut: _cut(folder / n, c),
                          False))
    huge = " ".join(rng.choice(SENTENCES) for _ in range(2500))  # about 300 KB on one line
    cases += [("a huge line.txt", "huge.txt", lambda _: f"{huge}\n{SENTENCES[0]}\n".encode(), False),
              ("a huge field.csv", "huge.csv", lambda _: f'text\n"{huge}"\n{SENTENCES[0]}\n'.encode(), False),
              ("a huge value.jsonl", "huge.jsonl", lambda _: (json.dumps({"text": huge}) + "\n").encode(), False)]
    cases += [("empty fields.csv", "empty.csv", lambda _: b"id,text\n1,\n2, \n", True),
              ("empty values.jsonl", "empty.jsonl", lambda _: b'{"text": ""}\n{"text": null}\n', True),
              ("blank lines.txt", "blank.txt", lambda _: b"\n \n\t\n", True)]
    return cases


def _cut(path: Path, fraction: float) -> bytes:
    data = path.read_bytes()
    return data[: max(1, int(len(data) * fraction))]


CASES = generated(random.Random(SEED))


@pytest.fixture(scope="module")
def folder(tmp_path_factory, bert_tok) -> Path:
    """Valid files of every format, a tiny encoder, and a valid checkpoint of plain data."""
    folder = tmp_path_factory.mktemp("valid")
    for name, content in valid_files().items():
        (folder / name).write_bytes(content)
    save_tiny_encoder(folder / "bert", "bert", bert_tok)
    torch.save({"state_dict": {"model.w": torch.ones(4, 4)}, "hyper_parameters": ARCHITECTURE, "global_step": 2},
               folder / "good.ckpt")
    (folder / "config.yaml").write_bytes((ROOT / "configs" / "pretrain" / "tiny.yaml").read_bytes())
    return folder


def check(code: int, err: str, out: Path, program: str, refused: bool, case: str) -> None:
    """A report, or one line and nothing written; refused inputs must be refused."""
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("warning:", "note:"))]
    assert not any(word in line for line in lines for word in BANNER), (case, lines[:5])
    if code == 0 and not refused:
        assert out.exists() and any(out.iterdir()), case
        return
    assert code == 2, (case, code, lines[-3:])
    assert len(lines) == 1 and lines[0].startswith(f"{program}") and ": error: " in lines[0], (case, lines)
    assert not out.exists(), case


def direct_texts(path: Path) -> list[str] | None:
    """The texts of a data file read directly with the standard library (strict UTF-8; .txt: its non-blank lines;
    .csv / .tsv: the `text` column; .jsonl: each line's "text"), blank ones left out; None where the file is no valid
    file of its format (undecodable, a torn JSON line, no `text` column)."""
    import csv
    import io

    try:
        content = path.read_bytes().decode("utf-8")
        if path.suffix == ".txt":
            texts = content.splitlines()
        elif path.suffix in (".csv", ".tsv"):
            texts = [row["text"] for row in csv.DictReader(io.StringIO(content), delimiter="," if path.suffix == ".csv"
                                                           else "\t")]
        elif path.suffix == ".jsonl":
            texts = [json.loads(line)["text"] for line in content.splitlines() if line.strip()]
        else:
            return None
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, csv.Error):
        return None
    return [text for text in texts if isinstance(text, str) and text.strip()]


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_analyze_data(case, folder, tmp_path, capfd, bert_tok):
    """Also against a direct reading: a file the standard library reads into at least one text gives a report of
    min(10, that many) sentences (and, when all are taken, their tokens as the tokenizer counts them, cut to the
    encoder's 64 positions); any other is refused."""
    _, name, make, refused = next(c for c in CASES if c[0] == case)
    data = tmp_path / name
    data.write_bytes(make(folder))
    out = tmp_path / "out"
    code = analyze.main(["outliers", "--encoder", str(folder / "bert"), "--data", str(data), "--output_dir", str(out),
                         "--max_sentences", "10", "--no_progress"])
    check(code, capfd.readouterr().err, out, "analyze.py outliers", refused, case)
    texts = direct_texts(data)
    assert code == (0 if texts else 2), (case, texts)
    if texts:
        report = json.loads((out / "outliers.json").read_text())
        assert report["num_sentences"] == min(10, len(texts)), case
        if len(texts) <= 10:  # every text taken (more: a seeded sample of 10)
            assert report["num_tokens"] == sum(min(len(ids), 64) for ids in bert_tok(texts)["input_ids"]), case


def pair_cases(rng: random.Random, kind: str) -> list[tuple[str, Callable[[Path], bytes], bool]]:
    """WiC / STS files: random bytes, truncated, and each field emptied in turn."""
    name = f"{kind}.jsonl"
    noise = rng.randbytes(2048)
    cases = [("random bytes", lambda _: noise, True)]
    cases += [(f"truncated at {cut:.2f}", lambda folder, c=cut: _cut(folder / name, c), False)
              for cut in (rng.random(), rng.random())]
    first = json.loads(valid_files()[name].decode().splitlines()[0])
    for key in first:
        def emptied(folder, key=key):
            rows = [json.loads(line) for line in (folder / name).read_text().splitlines()]
            return "".join(json.dumps({**row, key: ""}) + "\n" for row in rows).encode()
        cases.append((f"empty {key}", emptied, key != "word"))  # WiC's offsets find the word: its name may be blank
    return cases


PAIR_CASES = {kind: pair_cases(random.Random(SEED + i), kind) for i, kind in enumerate(("wic", "sts"))}


@pytest.mark.parametrize("kind, case", [(kind, c[0]) for kind, cases in PAIR_CASES.items() for c in cases])
def test_analyze_pairs(kind, case, folder, tmp_path, capfd):
    _, make, refused = next(c for c in PAIR_CASES[kind] if c[0] == case)
    data = tmp_path / f"{kind}.jsonl"
    data.write_bytes(make(folder))
    out = tmp_path / "out"
    code = analyze.main([kind, "--encoder", str(folder / "bert"), "--data", str(data), "--output_dir", str(out),
                         "--clip", "none", "--no_progress"])
    check(code, capfd.readouterr().err, out, f"analyze.py {kind}", refused, case)
    try:  # read directly: every line a JSON object whose fields are all given (WiC's word may be blank)
        rows = [json.loads(line) for line in data.read_bytes().decode("utf-8").splitlines() if line.strip()]
        whole = bool(rows) and all(value != "" for row in rows for key, value in row.items() if key != "word")
    except (UnicodeDecodeError, ValueError, AttributeError):
        rows, whole = [], False
    assert code == (0 if whole else 2), case
    if whole:  # every pair in the report
        assert json.loads((out / f"{kind}.json").read_text())["num_pairs"] == len(rows), case


ENCODER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors")


@pytest.mark.parametrize("damage", ["truncated", "random bytes"])
@pytest.mark.parametrize("name", [*ENCODER_FILES, "good.ckpt"])
def test_analyze_and_probe_encoders(name, damage, folder, tmp_path, sentences_file, capfd):
    rng = random.Random(f"{SEED}{name}{damage}")
    if name == "good.ckpt":
        encoder = tmp_path / "model.ckpt"
        source = (folder / name).read_bytes()
    else:
        encoder = tmp_path / "bert"
        shutil.copytree(folder / "bert", encoder)
        source = (encoder / name).read_bytes()
    broken = source[: int(len(source) * rng.uniform(0.05, 0.95))] if damage == "truncated" else rng.randbytes(2048)
    (encoder if name == "good.ckpt" else encoder / name).write_bytes(broken)
    out = tmp_path / "out"
    code = analyze.main(["outliers", "--encoder", str(encoder), "--data", str(sentences_file), "--output_dir",
                         str(out), "--no_progress"])
    check(code, capfd.readouterr().err, out, "analyze.py outliers", True, f"analyze {name} {damage}")
    with pytest.raises(SystemExit) as exited:
        probe.cli_main(probe_args(encoder, sentences_file, out))
    check(exited.value.code, capfd.readouterr().err, out, "probe.py", True, f"probe {name} {damage}")


TRAIN_CASES = [case for case in CASES if case[3]]  # refused ones only: an accepted corpus would start training


@pytest.mark.parametrize("case", [c[0] for c in TRAIN_CASES])
def test_train_and_probe_data(case, folder, corpus, cache, tmp_path, sentences_file, capfd):
    _, name, make, _ = next(c for c in TRAIN_CASES if c[0] == case)
    data = tmp_path / name
    data.write_bytes(make(folder))
    out = tmp_path / "out"
    code = train.cli_main(tiny_args(out, corpus, cache, "--data.corpus", str(data)))
    check(code, capfd.readouterr().err, out, "train.py", True, f"train {case}")
    with pytest.raises(SystemExit) as exited:
        probe.cli_main(probe_args(folder / "bert", data, out))
    check(exited.value.code, capfd.readouterr().err, out, "probe.py", True, f"probe {case}")


@pytest.mark.parametrize("option", ["--ckpt_path", "--config"])
@pytest.mark.parametrize("damage", ["truncated", "random bytes", "empty"])
def test_train_checkpoints_and_configs(option, damage, folder, corpus, cache, tmp_path, capfd):
    rng = random.Random(f"{SEED}{option}{damage}")
    source = (folder / ("good.ckpt" if option == "--ckpt_path" else "config.yaml")).read_bytes()
    broken = {"truncated": source[: int(len(source) * rng.uniform(0.05, 0.95))], "random bytes": rng.randbytes(2048),
              "empty": b""}[damage]
    path = tmp_path / ("broken.ckpt" if option == "--ckpt_path" else "broken.yaml")
    path.write_bytes(broken)
    out = tmp_path / "out"
    # a config that still parses must not start training: the learning rate after it is refused
    guard = ("--model.lr", "-1") if option == "--config" else ()
    code = train.cli_main(tiny_args(out, corpus, cache, option, str(path), *guard))
    check(code, capfd.readouterr().err, out, "train.py", True, f"train {option} {damage}")


@pytest.mark.parametrize("damage", ["truncated", "random bytes", "not YAML"])
def test_probe_configs(damage, folder, tmp_path, sentences_file, capfd):
    rng = random.Random(f"{SEED}probe{damage}")
    source = (ROOT / "configs" / "probe" / "position.yaml").read_bytes()
    broken = {"truncated": source[: int(len(source) * rng.uniform(0.05, 0.95))], "random bytes": rng.randbytes(2048),
              "not YAML": b"model: [unclosed\n  data: {\n"}[damage]
    path = tmp_path / "broken.yaml"
    path.write_bytes(broken)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exited:  # the learning rate after it: a config that still parses stops there
        probe.cli_main(probe_args(folder / "bert", sentences_file, out, "--config", path, "--model.lr", "-1"))
    check(exited.value.code, capfd.readouterr().err, out, "probe.py", True, f"probe --config {damage}")
