"""What a pretraining run ends with: where its export, checkpoints and W&B run are, its last validation loss, and the
outlier statistics of its last capture (persistent dims, top share, kurtosis: a reading of one run, not a verdict),
printed by train.py after the fit.

    python train.py fit --config configs/pretrain/tiny.yaml
    ...
    pretraining finished at step 200: runs/pretrain/tiny
      export       runs/pretrain/tiny/export (analyze.py outliers --encoder runs/pretrain/tiny)
      checkpoints  runs/pretrain/tiny/checkpoints/last.ckpt (resume: --ckpt_path last)
      W&B          offline run 5mfme1xx in runs/pretrain/tiny/wandb; upload: wandb sync runs/.../offline-run-*-5mfme1xx*
      validation   loss 6.338 at step 200
      outliers     the validation at step 200: persistent dims [77]; top share 61.2% (layer 3, dim 77); kurtosis 9.1 (layer 3)

When that capture held so few tokens that chance alone could have made its outliers (ours: metrics/null.py's chance
bound above 0.01), a sixth line, "chance", says so.

A run that never validated says why, as its settings tell: "validation   not run (--trainer.limit_val_batches 0)", or
"not run (the run ended before its first validation was due: --trainer.val_check_interval 500,
--trainer.check_val_every_n_epoch null)". Without a validation the reading is the last live capture of training: "the
last live capture, at training step 100 (every 100 steps)", or after a run shorter than the captures' every_n_steps
"the last live capture, at step 0 (the model before its first update; no capture after it: every_n_steps 100 >= the
run's 50 steps)".

RunSummary (a callback train.py adds) keeps the last validation loss with its step, in the checkpoints too, so that a
re-run of a finished run reports the same; the reading is OutlierStatistics' `last` (kept in its checkpoint state).
"""

from __future__ import annotations

from pathlib import Path

from pytorch_lightning.callbacks import Callback

from callbacks.wandb_logging import AutoWandbLogger, real_loggers
from core.wording import plural


class RunSummary(Callback):
    """The last validation loss and its step (`val_key`), kept in checkpoints; `summary(trainer)` at the end."""

    def __init__(self, val_key: str = "val/loss") -> None:
        self.val_key = val_key
        self.val: tuple[int, float] | None = None  # (step, loss)

    def on_validation_end(self, trainer, pl_module) -> None:
        value = trainer.callback_metrics.get(self.val_key)
        if not trainer.sanity_checking and value is not None:
            self.val = (trainer.global_step, float(value))

    def state_dict(self) -> dict:
        return {"val": list(self.val) if self.val else None}

    def load_state_dict(self, state_dict: dict) -> None:
        self.val = tuple(state_dict["val"]) if state_dict.get("val") else None


def run_summary(trainer) -> dict:
    """What the run ended with, JSON-ready: step, run directory, export, last checkpoint, W&B, validation, outliers."""
    root = Path(trainer.default_root_dir)
    callback = trainer.checkpoint_callback
    last = Path(callback.last_model_path) if callback is not None and callback.last_model_path else None
    if last is not None and last.parent == (root / "checkpoints").resolve():  # named as the run directory is
        last = root / "checkpoints" / last.name
    summary = {"step": trainer.global_step, "run_dir": str(root),
               "export": str(root / "export") if (root / "export" / "config.json").is_file() else None,
               "checkpoint": str(last) if last is not None and last.is_file() else None,
               "wandb": None, "validation": None, "no_validation": None, "outliers": None}
    for logger in trainer.loggers:
        if isinstance(logger, AutoWandbLogger):
            started = logger.mode is not None and logger in real_loggers(trainer)
            summary["wandb"] = {"id": logger.run_id, "mode": logger.mode if started else "off", "url": logger.url,
                                "dirs": [str(path) for path in logger.offline_dirs()],
                                "sync": logger.sync_command() if started else None}
    for callback in trainer.callbacks:
        if isinstance(callback, RunSummary) and callback.val is not None:
            summary["validation"] = {"step": callback.val[0], "loss": callback.val[1]}
        if type(callback).__name__ == "OutlierStatistics" and getattr(callback, "last", None):
            summary["outliers"] = {**callback.last, "every_n_steps": callback.every_n_steps}
    if summary["validation"] is None:
        summary["no_validation"] = why_no_validation(trainer)
    return summary


def why_no_validation(trainer) -> str:
    """Why a run never validated, from its settings: validation turned off, or a schedule the run ended
    before (its validation data are never empty: the data module refuses a run without a validation block)."""
    if trainer.limit_val_batches == 0:
        return "--trainer.limit_val_batches 0"
    every = trainer.check_val_every_n_epoch
    return (f"the run ended before its first validation was due: --trainer.val_check_interval "
            f"{trainer.val_check_interval}, --trainer.check_val_every_n_epoch {'null' if every is None else every}")


def summary_lines(summary: dict) -> list[str]:
    """The summary as the few lines train.py prints."""
    root = summary["run_dir"]
    lines = [f"pretraining finished at step {summary['step']}: {root}"]
    lines.append("  export       " + (f"{summary['export']} (analyze.py outliers --encoder {root})"
                                      if summary["export"] else "none"))
    lines.append("  checkpoints  " + (f"{summary['checkpoint']} (resume: --ckpt_path last)"
                                      if summary["checkpoint"] else "none saved (--checkpoint.save_last false)"))
    wandb = summary["wandb"]
    if wandb is None:
        lines.append("  W&B          not used (another logger, or --trainer.logger false)")
    elif wandb["mode"] == "online":
        lines.append(f"  W&B          run {wandb['id']}: {wandb['url']}")
    elif wandb["mode"] == "offline":
        where = str(Path(wandb["dirs"][-1]).parent) if wandb["dirs"] else "wandb/"
        lines.append(f"  W&B          offline run {wandb['id']} in {where}; upload: {wandb['sync']}")
    else:
        lines.append("  W&B          off: it could not start or failed (see the warning above)")
    val = summary["validation"]
    lines.append("  validation   " + (f"loss {val['loss']:.4g} at step {val['step']}" if val else
                                      f"not run ({summary['no_validation']})"))
    reading = summary["outliers"]
    if reading is None:
        lines.append("  outliers     no live outlier statistics in this run (callbacks.outlier_statistics)")
    else:
        lines.append(f"  outliers     {capture_said(reading, summary['step'])}: persistent dims "
                     f"{reading['persistent_dims'] or 'none'}; top share {reading['top_share']:.1%} (layer "
                     f"{reading['top_share_layer']}, dim {reading['top_share_dim']}); kurtosis "
                     f"{reading['kurtosis']:.3g} (layer {reading['kurtosis_layer']}; dims 0-indexed)")
        if reading.get("chance_warning"):  # a capture of few tokens (ours: callbacks/outlier_statistics.py)
            lines.append(f"  chance       {reading['chance_warning']}")
    return lines


def capture_said(reading: dict, steps: int) -> str:
    """Which capture the outlier reading is, said so that it cannot pass for a statistic of the run's step 0: the
    validation at step N; the last live capture of training, at step N; or, when the only training capture was the
    one at step 0 (the model before its first update: a run shorter than every_n_steps), that."""
    step, every = reading["step"], reading.get("every_n_steps")
    if reading["stage"] == "val":
        return f"the validation at step {step}"
    if step == 0 and every is not None and every >= steps:
        return (f"the last live capture, at step 0 (the model before its first update; no capture after it: "
                f"every_n_steps {every} >= the run's {plural(steps, 'step')})")
    return f"the last live capture, at training step {step}" + (f" (every {plural(every, 'step')})" if every else "")
