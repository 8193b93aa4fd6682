"""The training hot path on CPU: no host synchronisation on an ordinary optimizer step (one process with accumulation,
and 2-process DDP), and the deferred non-finite check (a bad step never reaches the weights, is named, and no
checkpoint is written past it).

    .venv/bin/pytest tests/test_hot_path.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

import train
from tests.test_train import fit, tiny_args

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
LIVE_EVERY, LOG_EVERY, SAVE_EVERY = 4, 5, 5  # captures at 0, 4, 8; logs and checkpoints after steps 4 and 9


class SyncCounter(pl.Callback):
    """Test helper: counts the calls of Tensor methods that synchronise a device with the host (`SYNCS`) in each
    optimizer step, from its first micro-batch's start to the next step's, with what else happened in that window
    (a capture, a logging step, a checkpoint, a validation, an epoch end). Writes {step: [count, events, where]} per
    rank to `output` (rank appended) at the end of training."""

    def __init__(self, output: str, every_n_steps: int = LIVE_EVERY) -> None:
        self.output, self.every = output, every_n_steps
        self.windows: dict[int, list] = {}
        self.step: int | None = None
        self.originals = {name: getattr(torch.Tensor, name) for name in SYNCS}

    def _patch(self) -> None:
        for name, original in self.originals.items():
            def counting(tensor, *args, _name=name, _original=original, **kwargs):
                window = self.windows[self.step]
                window[0] += 1
                if len(window[2]) < 3:
                    frame = traceback.extract_stack(limit=3)[0]
                    window[2].append(f"{_name} at {Path(frame.filename).name}:{frame.lineno}")
                return _original(tensor, *args, **kwargs)
            setattr(torch.Tensor, name, counting)

    def _unpatch(self) -> None:
        for name, original in self.originals.items():
            setattr(torch.Tensor, name, original)

    def _event(self, name: str) -> None:
        if self.step is not None:
            self.windows[self.step][1].append(name)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.step == trainer.global_step:
            return  # the next micro-batch of the same optimizer step
        self._unpatch()
        self.step = trainer.global_step
        self.windows[self.step] = [0, [], []]
        if self.step % self.every == 0:
            self._event("capture")
        if (self.step + 1) % trainer.log_every_n_steps == 0:
            self._event("log")
        self._patch()

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._event("checkpoint")

    def on_validation_start(self, trainer, pl_module) -> None:
        self._event("validation")

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._event("epoch end")

    def on_train_end(self, trainer, pl_module) -> None:
        self._event("end")
        self._unpatch()
        self.step = None
        Path(f"{self.output}.{trainer.global_rank}").write_text(json.dumps(self.windows))

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._unpatch()


def live_callbacks(every: int = LIVE_EVERY) -> list[str]:
    specs = [{"class_path": f"callbacks.{module}.{name}", "init_args": {"every_n_steps": every,
                                                                         "image_every_n_steps": 0}}
             for module, name in (("outlier_statistics", "OutlierStatistics"),
                                  ("contribution_vectors", "ContributionVectors"),
                                  ("attention_geometry", "AttentionGeometry"))]
    return [arg for spec in specs for arg in ("--trainer.callbacks+", json.dumps(spec))]


@pytest.mark.slow
@pytest.mark.parametrize("devices, regularizer", [(1, "none"), (2, "none"), (1, "istar"), (2, "cosreg")])
def test_an_ordinary_optimizer_step_never_synchronises_with_the_host(corpus, cache, tmp_path, devices, regularizer):
    """1 process × 2 micro-batches a step, and 2 DDP processes (gloo) × 1: the live-statistics callbacks on (every
    4 steps), the progress bar on, logging and checkpoints every 5 steps; without a regulariser, with I-STAR (its C0
    at each epoch's start, its values summed for logging) and with CosReg (all-reduced every step under DDP). Every
    step whose window holds none of those (nor a validation or an epoch end) calls no synchronising Tensor method at
    all; the steps that do hold one are seen to synchronise (the counter works)."""
    root, output = tmp_path / "run", tmp_path / "syncs"
    counter = json.dumps({"class_path": "tests.test_hot_path.SyncCounter", "init_args": {"output": str(output)}})
    args = tiny_args(root, corpus, cache, "--data.batch_size", "4", *live_callbacks(), "--trainer.callbacks+", counter,
                     "--model.regularizer", regularizer, "--model.reg_weight", "0" if regularizer == "none" else "0.5",
                     "--trainer.log_every_n_steps", str(LOG_EVERY), "--checkpoint.every_n_train_steps",
                     str(SAVE_EVERY), "--trainer.enable_progress_bar", "true",
                     *(("--trainer.devices", "2", "--trainer.strategy", "ddp") if devices == 2 else ()))
    if devices == 1:
        assert train.cli_main(args) == 0
    else:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        result = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
    for rank in range(devices):
        windows = {int(step): value for step, value in json.loads(Path(f"{output}.{rank}").read_text()).items()}
        assert sorted(windows) == list(range(10))
        ordinary = {step: (count, where) for step, (count, events, where) in windows.items() if not events}
        assert sorted(ordinary) == [1, 2, 3, 6, 7], windows  # 0/4/8 capture, 4/9 log + checkpoint, 5 epoch end
        assert all(count == 0 for count, _ in ordinary.values()), ordinary
        assert windows[4][0] > 0 and windows[8][0] > 0, windows  # a capture and a logging step do synchronise


class NaNGradientAt(pl.Callback):
    """Test helper: one gradient entry NaN in optimizer step `step` (after the backward, before clipping); records
    the weights and the optimizer's step counts before that step and when the run stops. Instances register in
    `made`."""

    made: list[NaNGradientAt] = []

    def __init__(self, step: int = 2) -> None:
        self.step, self.before, self.after = step, None, None
        NaNGradientAt.made.append(self)

    @staticmethod
    def snapshot(trainer, pl_module) -> tuple[dict, list]:
        weights = {name: value.detach().clone() for name, value in pl_module.state_dict().items()}
        state = trainer.optimizers[0].state
        return weights, sorted({float(value["step"]) for value in state.values()})

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and self.before is None:
            self.before = self.snapshot(trainer, pl_module)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == self.step:
            pl_module.model.lm_head.dense.weight.grad[0, 0] = float("nan")

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.after = self.snapshot(trainer, pl_module)


@pytest.mark.slow
def test_a_non_finite_step_is_skipped_on_the_device_and_named_at_the_next_logging_step(corpus, cache, tmp_path, capsys):
    """Step 2's gradient is NaN; the check is read every 5 steps: the run stops after step 4 naming step 2, and
    neither step 2 nor the finite steps 3 and 4 after it changed a weight or the optimizer's state."""
    NaNGradientAt.made.clear()
    root = tmp_path / "run"
    spec = json.dumps({"class_path": "tests.test_hot_path.NaNGradientAt", "init_args": {"step": 2}})
    assert fit(root, corpus, cache, "--trainer.log_every_n_steps", "5", "--checkpoint.every_n_train_steps", "100",
               "--trainer.callbacks+", spec) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("train.py: error: non-finite training loss (") and "or gradient norm (nan) at step 2: " \
        "stopped before the optimizer step (found at step 4: no update since reached the weights); the last " \
        "checkpoint is the last good one" in err, err
    (planted,) = NaNGradientAt.made
    (before, steps_before), (after, steps_after) = planted.before, planted.after
    assert steps_before == steps_after == [2.0]  # AdamW's step count: steps 0 and 1 only
    for name, value in before.items():
        torch.testing.assert_close(after[name], value, rtol=0, atol=0, msg=name)
    assert all(torch.isfinite(value).all() for value in after.values())
    assert not (root / "checkpoints" / "last.ckpt").exists() and not (root / "export").exists()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The number of training batches")  # a 6-batch run, log_every_n_steps 50 on purpose
def test_without_fused_adamw_a_non_finite_step_is_stopped_at_once(corpus, cache, tmp_path, capsys, monkeypatch):
    """A device without fused AdamW kernels (stood in for by an AdamW refusing fused=True): the step cannot be skipped
    on the device, so the check synchronises in that step and stops before its update, naming it."""
    class NoFused(torch.optim.AdamW):
        def __init__(self, *args, fused=None, **kwargs):
            if fused:
                raise RuntimeError("no fused kernels here")
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(torch.optim, "AdamW", NoFused)
    NaNGradientAt.made.clear()
    spec = json.dumps({"class_path": "tests.test_hot_path.NaNGradientAt", "init_args": {"step": 2}})
    assert fit(tmp_path / "run", corpus, cache, "--trainer.log_every_n_steps", "50", "--trainer.callbacks+", spec) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("or gradient norm (nan) at step 2: stopped before the optimizer step; the last checkpoint is "
                        "the last good one"), err
    (planted,) = NaNGradientAt.made
    assert planted.after[1] == [2.0]  # AdamW's step count: steps 0 and 1 only
    assert all(torch.equal(planted.after[0][name], value) for name, value in planted.before[0].items())
