"""One W&B run per training run, and the summary a pretraining run ends with.

A run stopped by SIGTERM after 3 steps, resumed with --ckpt_path last to its end, then re-run once finished: one W&B
run (the id kept in the run directory and the checkpoints), whose history (read from the offline run's record logs)
has every step once; the summary's paths are the run's files and its verdict the last capture's, as logged.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import re
import signal
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

import train
from callbacks.wandb_logging import CHECKPOINT_KEY, RUN_ID_FILE
from tests.test_callbacks import STEPS, tiny_args
from tests.wandb_log import read_run


class TermAt(pl.Callback):
    """Sends this process SIGTERM once the optimizer step `step` is done (as scancel or a SLURM pre-emption would)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def outliers_every(n: int) -> list[str]:
    spec = {"class_path": "callbacks.outlier_statistics.OutlierStatistics",
            "init_args": {"every_n_steps": n, "image_every_n_steps": 0}}
    return ["--trainer.callbacks+", json.dumps(spec)]


def summary_of(output: str) -> dict[str, str]:
    """{"export": ..., "checkpoints": ..., "W&B": ..., "validation": ..., "outliers": ...} of the printed summary."""
    lines = output[output.index("pretraining finished at step"):].splitlines()
    return {"title": lines[0], **{match.group(1): match.group(2) for line in lines[1:6]
                                  if (match := re.match(r"  (\S+)\s+(.*)", line))}}


@pytest.fixture(scope="module")
def stopped_resumed_rerun(tmp_path_factory, corpus, cache):
    """(root, [stdout of each of the three fits])."""
    root = tmp_path_factory.mktemp("one_run") / "run"
    args = tiny_args(root, corpus, cache, *outliers_every(2))
    outputs = []
    for extra, status in ((["--trainer.callbacks+", json.dumps({"class_path": "tests.test_one_run.TermAt",
                                                                 "init_args": {"step": 3}})], 143),
                          (["--ckpt_path", "last"], 0), (["--ckpt_path", "last"], 0)):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):  # (capsys is per test; the fits are shared by two)
            assert train.cli_main([*args, *extra]) == status
        outputs.append(out.getvalue())
    return root, outputs


@pytest.mark.slow
def test_a_stopped_resumed_and_rerun_training_run_is_one_wandb_run_with_every_step_once(stopped_resumed_rerun):
    root, _ = stopped_resumed_rerun
    kept = (root / RUN_ID_FILE).read_text().strip()
    checkpoint = torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint[CHECKPOINT_KEY] == kept and checkpoint["global_step"] == STEPS
    parts = sorted((root / "wandb").glob("offline-run-*"))
    assert len(parts) == 3 and all(re.search(f"-{kept}(-[0-9]+)?$", part.name) for part in parts)  # one run, three starts
    history = [row for part in parts for row in read_run(part).history]
    steps = [row["trainer/global_step"] for row in history if "train/loss" in row]
    assert steps == list(range(STEPS))  # every step once, in order: 0-2, then 3-5 after the resume
    captures = [row["trainer/global_step"] for row in history if "outliers_by_layer/num_tokens" in row]
    assert captures == [0, 2, 4]
    assert len([row for row in history if "val/loss" in row]) == 1  # the validation at the end, not again on the re-run


@pytest.mark.slow
def test_the_summary_names_the_run_files_and_the_last_capture(stopped_resumed_rerun):
    root, outputs = stopped_resumed_rerun
    assert "pretraining finished" not in outputs[0]  # stopped by SIGTERM: its own line says how to resume
    summary = summary_of(outputs[1])
    kept = (root / RUN_ID_FILE).read_text().strip()
    assert summary["title"] == f"pretraining finished at step {STEPS}: {root}"
    export = Path(summary["export"].split(" (")[0])
    assert export == root / "export" and (export / "config.json").is_file()
    last = Path(summary["checkpoints"].split(" (")[0])
    assert last == root / "checkpoints" / "last.ckpt" and last.is_file()
    wandb_line = re.fullmatch(r"offline run (\w+) in (\S+); upload: wandb sync (\S+)", summary["W&B"])
    assert wandb_line.group(1) == kept and Path(wandb_line.group(2)) == root / "wandb"
    assert sorted(Path("/").glob(wandb_line.group(3).lstrip("/"))) == sorted((root / "wandb").glob("offline-run-*"))
    # the last capture: the validation at the end, as W&B logged it
    (part,) = [p for p in sorted((root / "wandb").glob("offline-run-*")) if any(
        "val_outliers_by_layer/num_tokens" in row for row in read_run(p).history)]
    run = read_run(part)
    (row,) = [row for row in run.history if "val_outliers_by_layer/num_tokens" in row]
    (loss,) = run.values("val/loss")
    assert summary["validation"] == f"loss {loss:.4g} at step {STEPS}"
    layers = sorted({int(key.split("/")[1][6:]) for key in row if key.startswith("val_outliers_by_layer/layer_")})
    shares = max((row[f"val_outliers_by_layer/layer_{n}/{kind}_share"], n, row[f"val_outliers_by_layer/layer_{n}/{kind}_dim"])
                 for n in layers if n >= 1 for kind in ("argmax", "argmin"))
    kurtosis = max((row[f"val_outliers_by_layer/layer_{n}/kurtosis"], n) for n in layers if n >= 1)
    persistent = run.summary["val_outliers/persistent_dims"]
    assert summary["outliers"] == (
        f"the validation at step {STEPS}: persistent dims {persistent or 'none'}; top share {shares[0]:.1%} (layer "
        f"{shares[1]}, dim {shares[2]}); kurtosis {kurtosis[0]:.3g} (layer {kurtosis[1]}; dims 0-indexed)")
    # a re-run of the finished run reports the same, from its checkpoint
    again = summary_of(outputs[2])
    assert again["validation"] == summary["validation"] and again["outliers"] == summary["outliers"]


NO_VALIDATION = {  # settings that leave a run without validation, and the reason its summary gives
    "off": (["--trainer.limit_val_batches", "0"], "--trainer.limit_val_batches 0"),
    "not due": (["--trainer.val_check_interval", "1000", "--trainer.check_val_every_n_epoch", "null"],
                "the run ended before its first validation was due: --trainer.val_check_interval 1000, "
                "--trainer.check_val_every_n_epoch null"),
}


@pytest.mark.slow
@pytest.mark.parametrize("every, validation", [(STEPS + 4, "off"), (4, "not due"), (4, "at the end")])
def test_the_summary_says_which_training_capture_its_outliers_are_and_that_step_0_was_the_only_one(
        every, validation, tmp_path, corpus, cache, capsys):
    """Without validation captures the reading is the last training capture. The run's capture steps, computed from
    its schedule (optimizer steps 0..STEPS-1 divisible by every_n_steps), give the step the line names; a run shorter
    than every_n_steps captured step 0 alone, and the line says so (it read 'training step 0' before, easily taken for
    the outliers at the start of training), with the numbers that explain it. The validation line is the loss the run
    logged, or, for a run that logged none, the setting that kept it from validating (it read 'none run' before)."""
    spec = {"class_path": "callbacks.outlier_statistics.OutlierStatistics",
            "init_args": {"every_n_steps": every, "image_every_n_steps": 0, "on_validation": False}}
    root = tmp_path / "run"
    settings, reason = NO_VALIDATION.get(validation, ([], None))
    assert train.cli_main(tiny_args(root, corpus, cache, "--trainer.callbacks+", json.dumps(spec), *settings,
                                    logger="csv")) == 0
    captures = [step for step in range(STEPS) if step % every == 0]
    (metrics,) = root.rglob("metrics.csv")  # the captures the run logged: the schedule's
    with metrics.open(encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    logged = sorted({int(row["step"]) for row in rows if row.get("outliers_by_layer/num_tokens")})
    assert logged == captures
    summary = summary_of(capsys.readouterr().out)
    losses = [float(row["val/loss"]) for row in rows if row.get("val/loss")]
    if reason is None:
        assert len(losses) == 1 and summary["validation"] == f"loss {losses[0]:.4g} at step {STEPS}"
    else:
        assert losses == [] and summary["validation"] == f"not run ({reason})"
    line = summary["outliers"]
    said = line.split(": persistent dims")[0]
    if captures == [0]:
        assert said == (f"the last live capture, at step 0 (the model before its first update; no capture after it: "
                        f"every_n_steps {every} >= the run's {STEPS} steps)")
    else:
        assert len(captures) > 1 and said == f"the last live capture, at training step {captures[-1]} (every {every} steps)"
