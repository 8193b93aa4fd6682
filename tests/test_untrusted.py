"""A user's checkpoint never runs code: a crafted .ckpt whose unpickling would write a file is refused, with one line,
by every entry point and in every form it can be given, and the file never appears (docs/guarantees.md).

    .venv/bin/pytest tests/test_untrusted.py -q
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

import analyze
import probe
import train
from core.errors import UserError
from core.safe_load import WeightsOnlyCheckpointIO, load_weights_only
from tests.test_train import tiny_args

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
ARCHITECTURE = {"vocab_size": 600, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                "intermediate_size": 64, "max_position_embeddings": 34, "position_embeddings": True}  # tiny_args'


class WritesAFile:
    """Unpickled, this calls open(path, "w"): the file appears. (Any callable would do: os.system, exec, ...)"""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def crafted(folder: Path, name: str = "crafted.ckpt") -> tuple[Path, Path]:
    """A checkpoint shaped like this project's (hyper-parameters, state_dict) that carries the payload, and the file
    the payload would write."""
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder.parent / f"{folder.name}-{name}.written"
    path = folder / name
    torch.save({"state_dict": {}, "hyper_parameters": dict(ARCHITECTURE), "epoch": 0, "global_step": 4,
                "payload": WritesAFile(marker)}, path)
    return path, marker


def test_the_crafted_checkpoint_runs_code_when_unpickled_the_old_way(tmp_path):
    path, marker = crafted(tmp_path / "ckpt")
    assert not marker.exists()
    torch.load(path, map_location="cpu", weights_only=False)  # our own test file: shows the payload is live
    assert marker.exists()


def probe_args(encoder, sentences: Path, out: Path, *extra) -> list[str]:
    return ["fit", "--config", str(ROOT / "configs" / "probe" / "position.yaml"), "--model.encoder", str(encoder),
            "--data.source", str(sentences), "--data.progress", "false", "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(out), *map(str, extra)]


def run_entry_point(program: str, argv: list[str]) -> int:
    if program == "train.py":
        return train.cli_main(argv)
    if program == "analyze.py":
        return analyze.main(argv)
    with pytest.raises(SystemExit) as exited:
        probe.cli_main(argv)
    return exited.value.code


FORMS = ["train.py --ckpt_path FILE", "train.py --ckpt_path last (RUN_DIR)", "analyze.py --encoder FILE",
         "analyze.py --encoder RUN_DIR", "probe.py --model.encoder FILE", "probe.py --model.encoder RUN_DIR",
         "probe.py --ckpt_path FILE"]


@pytest.mark.parametrize("form", FORMS)
def test_every_entry_point_refuses_the_crafted_checkpoint_and_runs_nothing(form, tmp_path, corpus, cache,
                                                                           sentences_file, capfd):
    run_dir = tmp_path / "run"  # a run directory without export/: its checkpoints/last.ckpt is the encoder
    path, marker = crafted(run_dir / "checkpoints", "last.ckpt") if "RUN_DIR" in form else crafted(tmp_path / "dl")
    out = tmp_path / "out"
    program = form.split()[0]
    if program == "train.py":
        root = run_dir if "RUN_DIR" in form else out
        argv = tiny_args(root, corpus, cache, "--ckpt_path", "last" if "RUN_DIR" in form else str(path))
    elif program == "analyze.py":
        argv = ["outliers", "--encoder", str(run_dir if "RUN_DIR" in form else path), "--data", str(sentences_file),
                "--output_dir", str(out), "--no_progress"]
    elif "--ckpt_path" in form:
        argv = probe_args(tmp_path / "nowhere-bert", sentences_file, out, "--ckpt_path", path)
    else:
        argv = probe_args(run_dir if "RUN_DIR" in form else path, sentences_file, out)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert run_entry_point(program, argv) == 2
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert lines == [f"{program}{' outliers' if program == 'analyze.py' else ''}: error: refused to load checkpoint "
                     f"{path}: it needs 'io.open', which is code, not data (checkpoints load weights-only: tensors, "
                     "numbers, strings and plain containers); nothing in it was run"]
    assert not marker.exists()
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written, no lock left


def test_lightnings_own_resume_reads_weights_only_whatever_it_is_asked(tmp_path, monkeypatch):
    path, marker = crafted(tmp_path / "ckpt")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # torch.load(weights_only=None) would unpickle
    with pytest.raises(UserError, match="refused to load checkpoint .*: it needs 'io.open'"):
        WeightsOnlyCheckpointIO().load_checkpoint(path, weights_only=False)
    assert not marker.exists()
    good = tmp_path / "good.ckpt"
    state = {"state_dict": {"w": torch.arange(6.0).reshape(2, 3)}, "loops": {"step": 3}, "betas": (0.9, 0.98)}
    torch.save(state, good)
    loaded = WeightsOnlyCheckpointIO().load_checkpoint(good)
    assert torch.equal(loaded["state_dict"]["w"], state["state_dict"]["w"]) and loaded["betas"] == (0.9, 0.98)
    noise = tmp_path / "noise.ckpt"
    noise.write_bytes(bytes(range(256)) * 8)
    with pytest.raises(UserError) as refused:
        WeightsOnlyCheckpointIO().load_checkpoint(noise)
    assert str(refused.value) == f"cannot read checkpoint {noise}: truncated or corrupt (not a checkpoint torch.save wrote)"


def test_weights_only_false_is_refused_on_the_command_line(tmp_path, corpus, cache, capsys):
    root = tmp_path / "run"
    assert train.cli_main(tiny_args(root, corpus, cache, "--weights_only", "false")) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "train.py: error: --weights_only false is not supported: checkpoints are always read weights-only (a "
        "checkpoint that needs anything else is refused)"]
    assert not root.exists()


@pytest.mark.parametrize("payload, needs", [
    (lambda marker: {"a": WritesAFile(marker)}, "'io.open'"),
    (lambda marker: [socket.socket], "'socket.socket'"),
])
def test_a_refusal_names_what_the_checkpoint_would_have_built(tmp_path, payload, needs):
    marker = tmp_path / "written"
    path = tmp_path / "x.ckpt"
    torch.save(payload(marker), path)
    with pytest.raises(UserError) as refused:
        load_weights_only(path)
    assert str(refused.value).startswith(f"refused to load checkpoint {path}: it needs {needs}, which is code")
    assert not marker.exists()


def test_an_embedded_tokenizer_cannot_write_outside_its_temporary_directory(tmp_path):
    from core.tokenizers import tokenizer_from_files

    escape = tmp_path / "escaped.txt"
    files = {"../../../../../../../../" + str(escape).lstrip("/"): "x", "tokenizer.json": "{}"}
    with pytest.raises(UserError, match="its files are not plain names and texts"):
        tokenizer_from_files(files, "the tokenizer embedded in x.ckpt")
    assert not escape.exists()


def with_code(folder: Path, source: Path, where: str) -> Path:
    """A copy of the model directory `source` whose config.json (or tokenizer_config.json) names its own class in an
    auto_map, as a model on the hub with `trust_remote_code` does; importing that code writes the marker file."""
    import json
    import shutil

    shutil.copytree(source, folder)
    marker = folder / "code-ran"
    (folder / "custom_code.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Custom: pass\n")
    name = "tokenizer_config.json" if where == "tokenizer" else "config.json"
    config = json.loads((folder / name).read_text())
    if where == "tokenizer":
        config.update(auto_map={"AutoTokenizer": ["custom_code.Custom", "custom_code.Custom"]},
                      tokenizer_class="CustomTokenizer")
    else:
        config.update(model_type="custom_bert", auto_map={"AutoConfig": "custom_code.Custom",
                                                         "AutoModel": "custom_code.Custom"})
    (folder / name).write_text(json.dumps(config))
    return marker


@pytest.mark.parametrize("program, where", [
    (program, where) for program in ("analyze.py", "probe.py", "train.py fine-tuning") for where in ("model", "tokenizer")
] + [("train.py --data.tokenizer", "tokenizer")])
def test_a_model_with_its_own_code_is_refused_even_when_a_person_would_say_yes(program, where, tmp_path, corpus,
                                                                              cache, sentences_file, bert_tok,
                                                                              monkeypatch, capfd):
    """transformers asks at a terminal "Do you wish to run the custom code? [y/N]": it is never asked (the answer here
    would be yes) and the code never runs. A model that needs its code is refused in one line; a tokenizer whose
    tokenizer.json holds it all is read from that file without its code."""
    from tests.test_finetune import CONFIG, labelled
    from tests.tiny import save_tiny_encoder

    monkeypatch.setattr("builtins.input", lambda *args: "y")
    path = tmp_path / "with-code"
    marker = with_code(path, save_tiny_encoder(tmp_path / "bert", "bert", bert_tok), where)
    out = tmp_path / "out"
    if program == "analyze.py":
        code = analyze.main(["outliers", "--encoder", str(path), "--data", str(sentences_file), "--output_dir",
                             str(out), "--no_progress"])
    elif program == "probe.py":
        try:
            probe.cli_main(probe_args(path, sentences_file, out, "--trainer.max_epochs", "1",
                                      "--data.random_baseline", "false", "--data.control_task", "false"))
            code = 0
        except SystemExit as exited:
            code = exited.code
    elif program == "train.py fine-tuning":
        code = train.cli_main(["fit", "--config", str(CONFIG), "--model.encoder", str(path), "--data.source",
                               str(labelled(tmp_path / "labelled.csv")), "--data.max_length", "32",
                               "--trainer.max_steps", "1", "--trainer.default_root_dir", str(out),
                               "--trainer.logger", "false", "--trainer.enable_progress_bar", "false"])
    else:
        code = train.cli_main(tiny_args(out, corpus, cache, "--data.tokenizer", str(path), "--trainer.max_steps", "1"))
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip() and "warn" not in line.lower()]
    assert not marker.exists()
    if where == "tokenizer":  # its tokenizer.json is data: read without the code, the entry point runs on
        assert code == 0 and out.exists()
        return
    assert code == 2 and not out.exists()
    assert lines[-1].endswith("it needs its own Python code (an auto_map in its config: a class transformers does not "
                              "have), and this project never runs code from a model's files (trust_remote_code stays "
                              "off)")
