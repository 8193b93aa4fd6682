"""Checkpointing for pretraining: atomic writes, last.ckpt at the end and on SIGTERM, and the resume checks.

    python train.py fit --config configs/pretrain/tiny.yaml --ckpt_path last     # resume exactly (check_resume first)
    kill -TERM <pid>        # last.ckpt after the current optimizer step, then exit status 143 (PREEMPTED_EXIT)
    ... --checkpoint.sigterm_every_n_steps 10    # several processes: the ranks agree every 10 steps (the default)

Checkpoints go to <default_root_dir>/checkpoints (last.ckpt every --checkpoint.every_n_train_steps and at the end),
written atomically (a kill mid-write keeps the previous one), the last.ckpt of the step before kept as previous.ckpt
(a step's re-save after its validation replaces last.ckpt in place); they are read weights-only, and --ckpt_path last
falls back to previous.ckpt (saying so) when last.ckpt cannot be read.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from pytorch_lightning.utilities import rank_zero_only

from core.errors import UserError
from core.output import atomic_file, disk_full, write_error
from core.safe_load import WeightsOnlyCheckpointIO
from core.signals import Interrupted
from core.tokenizers import fingerprint
from lightning_modules.checkpoints import read_checkpoint
from lightning_modules.mlm import check_architecture
from lightning_modules.training import check_resumed_schedule

LAST, PREVIOUS = "last.ckpt", "previous.ckpt"  # the newest checkpoint and the one before it (AtomicCheckpointIO)
PREEMPTED_EXIT = 143  # 128 + SIGTERM, as a shell reports a job ended by SIGTERM: resubmit with --ckpt_path last


class Preempted(SystemExit):
    """Ends the run on every rank after a SIGTERM, once last.ckpt holds a whole optimizer step (exit status 143)."""

    def __init__(self, step: int, path: str, rank: int) -> None:
        super().__init__(PREEMPTED_EXIT)
        self.step, self.path, self.rank = step, path, rank


class PretrainCheckpoint(ModelCheckpoint):
    """ModelCheckpoint that also saves last.ckpt when training ends between two periodic saves, and on SIGTERM.

    During training SIGTERM only sets a flag (Lightning's own handler is replaced: it would stop after any
    micro-batch, even inside a gradient-accumulation window that a checkpoint cannot resume exactly, and it runs a
    collective inside the signal handler). One process reads its flag at every optimizer-step boundary (no device
    work); several agree at every `sigterm_every_n_steps`-th step boundary (one small all-reduce and a read, not one
    per step; any rank signalled stops all of them), so a run stops at most N steps after the signal. Then
    last.ckpt is saved and `Preempted` ends the run before the next micro-batch. Lightning's own per-micro-batch
    SIGTERM broadcast (a collective and a host synchronisation every micro-batch) is switched off: with its handler
    replaced it could only ever broadcast "no". A SIGTERM during the export at the end is ignored: the run is
    finished then.

    Args:
        sigterm_every_n_steps: with several processes, optimizer steps between two SIGTERM agreements (default 10:
            well inside SLURM's usual 30 s to 2 min between SIGTERM and SIGKILL at roberta-base step times).
        save_initial: also save the model before its first update, at step 0 (a periodic checkpoint's name, and
            last.ckpt so that a run stopped before its first periodic save resumes), in a run that starts fresh:
            a trajectory's first point and the study's null (ours; default false; study.py sets it for every arm).
        everything else: ModelCheckpoint's.
    """

    _sigterm = False
    _previous_handler = None
    _stop: Preempted | None = None

    def __init__(self, *args, sigterm_every_n_steps: int = 10, save_initial: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sigterm_every_n_steps = sigterm_every_n_steps
        self.save_initial = save_initial

    def check_settings(self) -> None:
        """train.py's before_fit (here, not in __init__: jsonargparse would bury the message in its own)."""
        if self.sigterm_every_n_steps < 1:
            raise UserError(f"--checkpoint.sigterm_every_n_steps must be at least 1, got {self.sigterm_every_n_steps}")

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        if self.save_initial and trainer.global_step == 0 and not trainer.fast_dev_run:  # a fresh run, not a resume
            candidates = self._monitor_candidates(trainer)
            if self.save_last:  # first: a run stopped between the two saves resumes (--ckpt_path last) and saves both
                self._save_last_checkpoint(trainer, candidates)
            self._save_checkpoint(trainer, self.format_checkpoint_name(candidates))  # e.g. epoch=0-step=0.ckpt
        self._sigterm = bool(trainer.received_sigterm)  # one that came during the set-up, under Lightning's handler
        self._stop = None
        self._step_seen = trainer.global_step
        self._pid = os.getpid()
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
            epoch_loop = trainer.fit_loop.epoch_loop
            if not trainer.received_sigterm and hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
                epoch_loop._broadcast_sigterm_tensor = _no_broadcast  # (a set-up SIGTERM keeps Lightning's path)

    def _on_sigterm(self, signum, frame) -> None:
        if os.getpid() != self._pid:  # a forked loader worker: the training process decides
            return
        if not self._sigterm:
            os.write(2, b"train.py: SIGTERM received: saving last.ckpt after this optimizer step, then stopping\n")
        self._sigterm = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if trainer.global_step == self._step_seen:
            return  # inside a gradient-accumulation window: only a whole optimizer step resumes exactly
        self._step_seen = trainer.global_step
        if trainer.world_size == 1:
            stop = self._sigterm
        elif trainer.global_step % self.sigterm_every_n_steps == 0:
            stop = trainer.strategy.reduce_boolean_decision(self._sigterm, all=False)  # the same on every rank
        else:
            stop = False
        if stop:
            if not self._should_skip_saving_checkpoint(trainer):
                self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
            self._stop = Preempted(trainer.global_step, self.last_model_path, trainer.global_rank)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._stop is not None:  # raised here, once this step's loss is logged (and a validation due has run)
            raise self._stop

    def on_validation_end(self, trainer, pl_module) -> None:
        """A validation right after a save of its step (val_check_interval and every_n_train_steps meeting, as at the
        last step of every config; a SIGTERM's last.ckpt): the checkpoints saved then are saved again, now holding the
        validation (its loss, the live statistics' state, the summary's reading) that Lightning ran after saving them;
        a resume or a re-run of the finished run reads it, and analyze.py trajectory reports it at its step. Only what
        was saved is saved again: a SIGTERM's step gets no periodic checkpoint, and a monitored top-k's entry of the
        step competes once, with this validation's value. last.ckpt is replaced in place (still written then
        renamed): previous.ckpt stays the checkpoint of the step before, not this step's before its validation.
        A validation inside a gradient-accumulation window (--trainer.val_check_interval counts micro-batches, so one
        that is not a multiple of the accumulation falls there) saves nothing: the data position and loops are then
        part-way into the next step, whose resume would take its optimizer step on the rest of its global batch."""
        saved_before = self._last_global_step_saved == trainer.global_step  # (not by this validation's own save)
        super().on_validation_end(trainer, pl_module)
        if trainer.sanity_checking or trainer.fast_dev_run or trainer.state.fn != "fit" or not saved_before or \
                trainer.global_step == 0 or trainer.fit_loop.epoch_loop._should_accumulate():
            return
        candidates = self._monitor_candidates(trainer)
        topk = self._topk_saved if self._topk_saved and self._topk_saved[0] == trainer.global_step else None
        self._last_global_step_saved = -1  # ModelCheckpoint saves a step once: this step again
        if topk is not None:
            self.best_k_models.pop(topk[1], None)  # its stale value (the validation before) leaves the top k
            self._save_topk_checkpoint(trainer, candidates)
            if self._topk_saved[1] != topk[1] and topk[1] not in self.best_k_models:  # a name with the metric in it
                self._remove_checkpoint(trainer, topk[1])
        io = trainer.strategy.checkpoint_io
        with io.same_step() if isinstance(io, AtomicCheckpointIO) else contextlib.nullcontext():
            self._save_last_checkpoint(trainer, candidates)
        self._last_global_step_saved = trainer.global_step

    _topk_saved: tuple[int, str] | None = None  # (step, path) of the last periodic (top-k) save

    def _save_topk_checkpoint(self, trainer, monitor_candidates) -> None:
        before = self._last_global_step_saved
        super()._save_topk_checkpoint(trainer, monitor_candidates)
        if self._last_global_step_saved == trainer.global_step != before:
            self._topk_saved = (trainer.global_step, self._last_checkpoint_saved)

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        if self.save_last and not self._should_skip_saving_checkpoint(trainer) and \
                self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def _save_last_checkpoint(self, trainer, monitor_candidates) -> None:
        super()._save_last_checkpoint(trainer, monitor_candidates)
        if self.save_last:
            self._saved = (trainer.global_step, self.last_model_path)

    _saved: tuple[int, str] | None = None  # (step, path) of the last.ckpt this process saved last

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._restore_handler()
        super().on_exception(trainer, pl_module, exception)
        if isinstance(exception, Interrupted) and trainer.state.fn == "fit":
            exception.detail = self.resume_advice(trainer)

    def resume_advice(self, trainer) -> str:
        """Where a run stopped at once (Ctrl-C) stands, for train.py's line: the step, and the checkpoint a rerun with
        --ckpt_path last resumes from (its step when this process saved it), or that none was saved yet."""
        found = last_checkpoint(self.dirpath) if self.dirpath else None
        if found is None:
            others = sorted(Path(self.dirpath).glob("*.ckpt"), key=lambda p: p.stat().st_mtime) if self.dirpath and \
                Path(self.dirpath).is_dir() else []
            if not others:
                return (f" after step {trainer.global_step}, before its first checkpoint: rerun the same command to "
                        "start again")
            return f" after step {trainer.global_step}; rerun with --ckpt_path {others[-1]} to resume"
        step = f" (step {self._saved[0]})" if self._saved and Path(self._saved[1]) == found else ""
        return f" after step {trainer.global_step}; rerun with --ckpt_path last to resume from {found}{step}"

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._restore_handler()
        super().teardown(trainer, pl_module, stage)

    def _restore_handler(self) -> None:
        if self._previous_handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_handler)
        self._previous_handler = None


class LoggingStep(Callback):
    """At the first batch of a fit, Lightning's logging step (the steps that stepped the optimizer: the live
    statistics' and train/loss's step) is the optimizer steps done. Lightning's restart adds 1 to it, for a checkpoint
    saved at a batch's end before the step counts; the step-0 checkpoint (save_initial) is saved before any batch, and
    a run resumed from it logged every step one step late (CSV, W&B, the live statistics' captures). First of the
    trainer's callbacks (train.py puts it there): the live statistics read the step in the same hook."""

    _first = False

    def on_train_start(self, trainer, pl_module) -> None:
        self._first = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._first and pl_module.automatic_optimization:
            trainer.fit_loop.epoch_loop._batches_that_stepped = trainer.global_step
        self._first = False


def _no_broadcast() -> None:
    """Stands in for Lightning's per-micro-batch SIGTERM broadcast (PretrainCheckpoint agrees every N steps)."""


class AtomicCheckpointIO(WeightsOnlyCheckpointIO):
    """torch.save into a temporary file beside the checkpoint, fsync, os.replace: a kill or a full disk mid-write
    leaves the previous checkpoint in place and loadable; with `keep_previous`, the last.ckpt it replaces stays as
    previous.ckpt beside it (a last.ckpt corrupted later, on disk or by hand, then resumes from the one before),
    except inside `same_step` (the same step saved again: previous.ckpt stays the step before's).
    Reading is weights-only (core/safe_load.py).

    Lightning's own `_atomic_save` builds the whole file in memory, writes it under the system temp directory and
    moves it, which is a plain (non-atomic) copy onto the target whenever that directory is another filesystem (a
    node's /tmp vs the cluster's scratch), and it never fsyncs. Leftovers of a killed write are removed at the next.
    A full disk (or any other write error) is one line, and the checkpoint saved before stays in place.
    """

    def __init__(self, keep_previous: bool = True) -> None:
        super().__init__()
        self.keep_previous = keep_previous
        self._same_step = False

    @contextlib.contextmanager
    def same_step(self) -> Iterator[None]:
        """Saves of last.ckpt inside replace it without keeping it as previous.ckpt: a step saved again (after its
        validation) keeps the step before as previous.ckpt. The new file is still written and renamed onto last.ckpt,
        so a whole last.ckpt is there at every moment, previous.ckpt unchanged beside it."""
        self._same_step = True
        try:
            yield
        finally:
            self._same_step = False

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None or "://" in str(path):  # remote storage: Lightning's fsspec transaction
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        for stale in path.parent.glob(f".{path.name}.*.tmp"):
            stale.unlink(missing_ok=True)
        rotate = self.keep_previous and path.name == LAST and not self._same_step
        previous = path.with_name(PREVIOUS) if rotate else None
        kept = "the one saved before is kept (resume with --ckpt_path last once there is room)" if path.exists() \
            else "no checkpoint of this run was saved before"
        try:
            with atomic_file(path, keep_previous=previous) as handle:
                torch.save(checkpoint, handle)
        except Exception as error:  # torch.save turns a full disk into "RuntimeError: [enforce fail ...]"
            if not isinstance(error, OSError) and not disk_full(error):
                raise
            raise UserError(f"cannot save checkpoint {path}: {write_error(error, path)}; {kept}") from None


def checkpoint_dir(root: str | None) -> str:
    return str(Path(root or os.getcwd()) / "checkpoints")


def last_checkpoint(directory: str | Path) -> Path | None:
    """The checkpoint `--ckpt_path last` resumes from: the newest *last*.ckpt of the checkpoint directory."""
    found = sorted(Path(directory).glob("*last*.ckpt"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def resume_target(path: Path, kind: str = "mlm") -> Path:
    """`path`, or, when it is a run's last.ckpt that is missing or cannot be read and previous.ckpt beside it can be,
    that one (with a line saying so): the insurance AtomicCheckpointIO keeps. `kind`: the run's ("mlm",
    "finetune": lightning_modules/checkpoints.py)."""
    previous = path.with_name(PREVIOUS)
    if not path.exists() and path.name == LAST and previous.is_file():  # a save killed between its two renames
        reason = f"{path} is missing"
    else:
        try:
            read_checkpoint(path, kind)
            return path
        except UserError as error:
            if path.name != LAST or not previous.is_file():
                raise
            reason = str(error)
    try:
        step = read_checkpoint(previous, kind).get("global_step")
    except UserError:
        raise UserError(reason) from None
    if rank_zero_only.rank == 0:  # every DDP process resumes from the same file: said once
        print(f"note: {reason}; resuming from the checkpoint before it, {previous} (step {step})", file=sys.stderr)
    return previous


def earlier_run(root: str | Path) -> list[str]:
    """What of a run `root` holds: its checkpoints (checkpoints/*.ckpt, Lightning's hpc_ckpt_*.ckpt) and export."""
    root = Path(root)
    earlier = sorted(p.name for p in (root / "checkpoints").glob("*.ckpt")) if (root / "checkpoints").is_dir() else []
    earlier += sorted(p.name for p in root.glob("hpc_ckpt_*.ckpt")) if root.is_dir() else []
    if (root / "export" / "config.json").is_file():
        earlier.append("export/")
    return earlier


def check_fresh_start(root: str | Path) -> None:
    """A run started without --ckpt_path must not overwrite the checkpoints and export of an earlier run."""
    root = Path(root)
    earlier = earlier_run(root)
    if earlier:
        raise UserError(f"{root} holds an earlier run ({', '.join(earlier)}): resume it with --ckpt_path last, or "
                        "start this one in another --trainer.default_root_dir (or remove that run first)")


def run_of(path: str | Path) -> Path:
    """The run directory a checkpoint file belongs to (symbolic links followed): <run>/checkpoints/X.ckpt, or
    Lightning's <run>/hpc_ckpt_N.ckpt."""
    real = Path(os.path.realpath(path))
    return real.parent.parent if real.parent.name == "checkpoints" else real.parent


def check_resume_directory(path: Path, given: str, root: str | Path, folder: str | Path) -> None:
    """A resume writes its checkpoints, export and config into `root`: when `root` holds a run, the checkpoint must be
    that run's own (in `folder`, its checkpoint directory, or `root` itself: hpc_ckpt_N.ckpt), whichever way it is
    named (a path into another run, relative, through a symbolic link). `given`: --ckpt_path as given."""
    real = Path(os.path.realpath(path)).parent
    if real in (Path(os.path.realpath(folder)), Path(os.path.realpath(root))):
        return
    earlier = earlier_run(root)
    if earlier:
        other = run_of(path)
        raise UserError(f"{root} holds another run ({', '.join(earlier)}) and --ckpt_path {given} is a checkpoint of "
                        f"{other}: a resume writes into --trainer.default_root_dir and would overwrite that run; resume "
                        f"in the checkpoint's own directory (--trainer.default_root_dir {other}) or in an empty one")


def hpc_checkpoint(root: str | Path) -> Path:
    """`--ckpt_path hpc`: Lightning's newest hpc_ckpt_N.ckpt in the run directory (saved on SLURM's USR1)."""
    found = sorted(Path(root).glob("hpc_ckpt_*.ckpt"),
                   key=lambda p: int(p.stem.rsplit("_", 1)[-1]) if p.stem.rsplit("_", 1)[-1].isdigit() else -1)
    if not found:
        raise UserError(f"--ckpt_path hpc: no HPC checkpoint (hpc_ckpt_<n>.ckpt, which Lightning saves on SLURM's "
                        f"USR1 signal) in {root}; resume with --ckpt_path last or a checkpoint file")
    return found[-1]


def check_resume(path: Path, model, data, world_size: int, kind: str = "mlm", max_steps: int | None = None) -> None:
    """Before anything is written: a whole checkpoint of this project, read weights-only, that fits the config
    (`check_fits`), whose learning-rate schedule, which a resume keeps, does not end before --trainer.max_steps at a
    rate of 0, and whose data position continues on `world_size` devices (`data`, its data module)."""
    checkpoint = read_checkpoint(path, kind)
    check_resumed_schedule(checkpoint.get("lr_schedulers"), model.hparams, max_steps, path)
    check_fits(checkpoint, path, model, data)
    saved, seed = (checkpoint.get("datamodule_hyper_parameters") or {}).get("seed"), data.hparams.get("seed")
    if kind == "mlm" and isinstance(saved, int) and saved != seed:
        raise UserError(f"checkpoint {path} was trained with data seed {saved} (its blocks' order and masks) but this "
                        f"run's is {seed}: resume with the run's own --seed_everything (a run started before the data "
                        f"followed it: --data.seed {saved})")
    data.check_position(checkpoint.get(type(data).__qualname__, {}), world_size, f"checkpoint {path}")


def check_fits(checkpoint: dict, path: Path, model, data) -> None:
    """A checkpoint (read by read_checkpoint) whose architecture (PE or not, sizes), weights and tokenizer match the
    config (`model`, an MLMModule or FineTuneModule; `data`, its data module): what a resume and `train.py validate`
    both need."""
    check_architecture(checkpoint.get("hyper_parameters", {}), model.hparams, f"checkpoint {path}")
    if hasattr(model, "check_checkpoint"):  # what else the module needs to match (a fine-tuned model's classes)
        model.check_checkpoint(checkpoint.get("hyper_parameters", {}), f"checkpoint {path}")
    check_weights(checkpoint["state_dict"], model.state_dict(), path)
    saved = checkpoint.get(type(data).__qualname__, {}).get("tokenizer_fingerprint")
    tokenizer = data.cached_tokenizer()
    if saved is not None and tokenizer is not None and fingerprint(tokenizer) != saved:
        raise UserError(f"the tokenizer does not match checkpoint {path} (its vocabulary or merges differ); "
                        "resume with the tokenizer the run was started with")


def check_weights(saved: dict, expected: dict, path) -> None:
    """One line when a checkpoint's weights are not the model's (other names or shapes), as a foreign checkpoint
    with plausible hyper-parameters would have; Lightning's strict load would print every mismatch."""
    missing = [key for key in expected if key not in saved]
    unexpected = [key for key in saved if key not in expected]
    shapes = [key for key in expected if key in saved and hasattr(saved[key], "shape")
              and tuple(saved[key].shape) != tuple(expected[key].shape)]
    if missing or unexpected or shapes:
        raise UserError(f"checkpoint {path}: its weights do not fit the model (missing {missing[:3]}, unexpected "
                        f"{unexpected[:3]}, other shapes {shapes[:3]})")
