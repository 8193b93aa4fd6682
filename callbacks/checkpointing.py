"""Checkpointing for pretraining: atomic writes, last.ckpt at the end and on SIGTERM, and the resume checks.

    python train.py fit --config configs/pretrain/tiny.yaml --ckpt_path last     # resume exactly (check_resume first)
    kill -TERM <pid>        # last.ckpt after the current optimizer step, then exit status 143 (PREEMPTED_EXIT)
    ... --checkpoint.sigterm_every_n_steps 10    # several processes: the ranks agree every 10 steps (the default)

Checkpoints go to <default_root_dir>/checkpoints (last.ckpt every --checkpoint.every_n_train_steps and at the end),
written atomically (a kill mid-write keeps the previous one).
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.plugins.io import TorchCheckpointIO

from core.errors import UserError
from core.output import atomic_file
from core.tokenizers import fingerprint
from lightning_modules.checkpoints import read_checkpoint
from lightning_modules.mlm import check_architecture

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
        everything else: ModelCheckpoint's.
    """

    _sigterm = False
    _previous_handler = None
    _stop: Preempted | None = None

    def __init__(self, *args, sigterm_every_n_steps: int = 10, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sigterm_every_n_steps = sigterm_every_n_steps

    def check_settings(self) -> None:
        """train.py's before_fit (here, not in __init__: jsonargparse would bury the message in its own)."""
        if self.sigterm_every_n_steps < 1:
            raise UserError(f"--checkpoint.sigterm_every_n_steps must be at least 1, got {self.sigterm_every_n_steps}")

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
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

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        if self.save_last and not self._should_skip_saving_checkpoint(trainer) and \
                self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._restore_handler()
        super().on_exception(trainer, pl_module, exception)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._restore_handler()
        super().teardown(trainer, pl_module, stage)

    def _restore_handler(self) -> None:
        if self._previous_handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_handler)
        self._previous_handler = None


def _no_broadcast() -> None:
    """Stands in for Lightning's per-micro-batch SIGTERM broadcast (PretrainCheckpoint agrees every N steps)."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save into a temporary file beside the checkpoint, fsync, os.replace: a kill or a full disk mid-write
    leaves the previous checkpoint in place and loadable.

    Lightning's own `_atomic_save` builds the whole file in memory, writes it under the system temp directory and
    moves it, which is a plain (non-atomic) copy onto the target whenever that directory is another filesystem (a
    node's /tmp vs the cluster's scratch), and it never fsyncs. Leftovers of a killed write are removed at the next.
    """

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None or "://" in str(path):  # remote storage: Lightning's fsspec transaction
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        for stale in path.parent.glob(f".{path.name}.*.tmp"):
            stale.unlink(missing_ok=True)
        with atomic_file(path) as handle:
            torch.save(checkpoint, handle)


def checkpoint_dir(root: str | None) -> str:
    return str(Path(root or os.getcwd()) / "checkpoints")


def last_checkpoint(directory: str | Path) -> Path | None:
    """The checkpoint `--ckpt_path last` resumes from: the newest *last*.ckpt of the checkpoint directory."""
    found = sorted(Path(directory).glob("*last*.ckpt"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def check_resume(path: Path, model, data, world_size: int) -> None:
    """Before anything is written: a whole checkpoint of this project, whose architecture (PE or not, sizes) and
    tokenizer match the config (`model`, an MLMModule), and whose data position continues on `world_size` devices
    (`data`, an MLMDataModule)."""
    checkpoint = read_checkpoint(path)
    check_architecture(checkpoint.get("hyper_parameters", {}), model.hparams, f"checkpoint {path}")
    data.check_position(checkpoint.get(type(data).__qualname__, {}), world_size, f"checkpoint {path}")
    saved = checkpoint.get(type(data).__qualname__, {}).get("tokenizer_fingerprint")
    tokenizer = data.cached_tokenizer()
    if saved is not None and tokenizer is not None and fingerprint(tokenizer) != saved:
        raise UserError(f"the tokenizer does not match checkpoint {path} (its vocabulary or merges differ); "
                        "resume with the tokenizer the run was started with")
