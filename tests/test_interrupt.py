"""Ctrl-C (SIGINT) and SIGTERM in the middle of analyze.py, probe.py and study.py: one line, the shell's status (130 by
SIGINT itself, 143), no traceback, nothing half-written, and a rerun into the same directory works; a report's files
and a checkpoint's renames finish before a signal stops the run (train.py's Ctrl-C and its resume: test_faults.py).

    .venv/bin/pytest tests/test_interrupt.py -q
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

import probe
import study
import train
from core.output import OWNERS, atomic_file, staged_output
from core.signals import Interrupted, stop_on_signals
from tests.test_faults import ROOT, pause, spawn, wait_for
from tests.test_study import write_study
from tests.test_train import checkpoint
from tests.tiny import save_tiny_encoder

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
NAMES = ["outliers.json", "mean_vectors.png", "magnitudes.png"]


def signal_at_first(monkeypatch, signum: int) -> list[str]:
    """os.replace sends `signum` to this process as it is first called (a file about to move into place); the names
    it moved."""
    real, moved = os.replace, []

    def replace(source, target):
        if not moved:
            os.kill(os.getpid(), signum)
        moved.append(Path(target).name)
        real(source, target)

    monkeypatch.setattr(os, "replace", replace)
    return moved


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_reports_files_all_move_in_before_a_signal_stops_the_run(tmp_path, monkeypatch, signum):
    out = tmp_path / "report"
    with staged_output(out, owner="outliers") as stage:  # the earlier run's report
        for name in NAMES:
            (stage / name).write_text("earlier run")
    moved = signal_at_first(monkeypatch, signum)
    with pytest.raises(Interrupted) as stopped, stop_on_signals(signum):
        with staged_output(out, owner="outliers") as stage:
            for name in NAMES:
                (stage / name).write_text("this run")
    assert stopped.value.status == 128 + signum
    assert set(NAMES) <= set(moved)  # the signal came with the first file: every one moved in after it
    landed = {path.name: path.read_text() for path in out.iterdir() if path.name in NAMES}
    assert landed == dict.fromkeys(NAMES, "this run")
    assert json.loads((out / OWNERS).read_text()) == dict.fromkeys(sorted(NAMES), "outliers")
    assert sorted(path.name for path in out.iterdir()) == sorted([*NAMES, OWNERS])  # no staging directory left


def test_a_checkpoint_kept_as_previous_has_its_successor_in_place_before_a_signal_stops_the_run(tmp_path, monkeypatch):
    last, previous = tmp_path / "last.ckpt", tmp_path / "previous.ckpt"
    with atomic_file(last, keep_previous=previous) as handle:
        handle.write(b"step 2")
    moved = signal_at_first(monkeypatch, signal.SIGINT)  # last.ckpt -> previous.ckpt, then the new one -> last.ckpt
    with pytest.raises(Interrupted), stop_on_signals(signal.SIGINT):
        with atomic_file(last, keep_previous=previous) as handle:
            handle.write(b"step 4")
    assert moved == ["previous.ckpt", "last.ckpt"]
    assert (last.read_bytes(), previous.read_bytes()) == (b"step 4", b"step 2")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["last.ckpt", "previous.ckpt"]


def stopped(process, signum: int) -> list[str]:
    """The signal sent, the process's stderr lines once it ended (it must have, within 120 s)."""
    process.send_signal(signum)
    _, err = process.communicate(timeout=120)
    assert "Traceback" not in err, err[-3000:]
    return err.strip().splitlines()


def tree(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.mark.slow
def test_analyze_stopped_by_ctrl_c_is_one_line_and_leaves_the_earlier_report_as_it_was(tmp_path, bert_tok,
                                                                                      sentences_file):
    """(SIGTERM takes the same path, with status 143: the probe's test below.)"""
    import analyze

    signum = signal.SIGINT

    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    out = tmp_path / "out"
    args = ["outliers", "--encoder", str(encoder), "--data", str(sentences_file), "--output_dir", str(out),
            "--no_progress"]
    assert analyze.main(args) == 0
    earlier = tree(out)
    ready = tmp_path / "ready"
    process = spawn("analyze", ["--pause-in-analysis", str(ready), *args, "--max_sentences", "20"])
    wait_for(ready, process)
    lines = stopped(process, signum)
    assert process.returncode == -signum  # by SIGINT itself, as Python ends a Ctrl-C'd program (a shell loop stops)
    assert lines[-1] == ("analyze.py outliers: stopped by SIGINT (exit status 130); its reports are written whole, at "
                         "the end, or not at all")
    assert tree(out) == earlier  # byte for byte, and no staging directory beside it


@pytest.mark.slow
def test_probe_stopped_by_sigterm_says_so_with_status_143_and_the_rerun_writes_the_report_a_fresh_run_does(
        tmp_path, bert_tok, sentences_file):
    """Lightning's own SIGTERM handling ended probe.py with status 0 and no report (a scheduler took it for done)."""
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)

    def args(root: Path, *extra: str) -> list[str]:
        return ["fit", "--config", str(ROOT / "configs" / "probe" / "position.yaml"), "--model.encoder", str(encoder),
                "--data.source", str(sentences_file), "--data.progress", "false", "--data.batch_size", "16",
                "--trainer.max_epochs", "2", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
                "--trainer.enable_model_summary", "false", "--trainer.default_root_dir", str(root), *extra]

    root = tmp_path / "run"
    spec, ready, _ = pause(tmp_path, at=1, where="batch_start")
    process = spawn("probe", args(root, "--trainer.callbacks+", spec))
    wait_for(ready, process)
    lines = stopped(process, signal.SIGTERM)
    assert process.returncode == 143
    assert lines[-1] == ("probe.py: stopped by SIGTERM (exit status 143); its report is written whole, at the end, or "
                         "not at all: rerun the same command to train the probes again")
    assert sorted(path.name for path in root.iterdir()) == ["config.yaml"]  # no report, lock or staging directory
    assert probe.main(args(root)) == 0
    assert probe.main(args(tmp_path / "fresh")) == 0
    rerun, fresh = (json.loads((folder / "position_probe.json").read_text()) for folder in (root, tmp_path / "fresh"))
    assert rerun == fresh  # same seed, same bits


@pytest.mark.slow
def test_study_stopped_by_ctrl_c_mid_arm_says_so_and_the_rerun_ends_the_arm_as_an_uninterrupted_run(
        tmp_path, corpus, cache, sentences_file):
    spec, ready, go = pause(tmp_path, at=3, where="batch_start")  # in the arm's step 3; a rerun finds `go`: no wait
    config = write_study(tmp_path / "config", corpus, cache, sentences_file, trainer__callbacks=[json.loads(spec)])
    out = tmp_path / "out"
    args = ["--config", str(config), "--output_dir", str(out), "--arms", "baseline", "--seeds", "0", "--max_steps", "6"]
    process = spawn("study", args)
    wait_for(ready, process)
    lines = stopped(process, signal.SIGINT)
    arm = out / "baseline" / "seed0"
    assert process.returncode == -signal.SIGINT
    assert lines[-2:] == [
        f"train.py: stopped by SIGINT after step 3; rerun with --ckpt_path last to resume from {arm}/checkpoints/"
        "last.ckpt (step 2) (exit status 130)",
        "study.py: stopped by SIGINT while training arm baseline/seed0 (exit status 130); rerun the same command to go "
        "on: finished arms are skipped, a stopped one resumes from its last checkpoint"]
    assert checkpoint(arm)["global_step"] == 2 and not (out / "study.json").exists()
    go.touch()
    assert study.main(args) == 0
    straight = tmp_path / "straight"  # the arm's own train.py arguments, uninterrupted, in another directory
    arguments = json.loads((arm / "study_arm.json").read_text())["train_args"]
    arguments[arguments.index("--trainer.default_root_dir") + 1] = str(straight)
    assert train.cli_main(arguments) == 0
    assert checkpoint(arm)["global_step"] == checkpoint(straight)["global_step"] == 6
    for name, value in checkpoint(straight)["state_dict"].items():
        torch.testing.assert_close(checkpoint(arm)["state_dict"][name], value, rtol=0, atol=0, msg=name)
