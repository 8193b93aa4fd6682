"""What every model train.py trains shares: AdamW with warm-up and decay, the device-side step monitor (no host
synchronisation on an ordinary step), reproducible dropout, and the isotropy regulariser.

    python train.py fit --config configs/pretrain/tiny.yaml                 # MLMModule (lightning_modules/mlm.py)
    python train.py fit --config configs/finetune/classify.yaml ...         # FineTuneModule (lightning_modules/finetune.py)

    class MyModule(TrainingModule):
        def __init__(self, ..., regularizer="none", reg_weight=0.0, reg_layers=None, zeta=0.2, ...):
            super().__init__(); self.save_hyperparameters(); self.model = ...
            self.make_regularizer().bind(num_layers)  # the options checked, the layers against the model
        def training_step(self, batch, i):
            out = model(..., output_hidden_states=self.hidden_state_tap.active)   # asked for by the tap
            return self.regularized(task_loss, out.hidden_states, mask)           # + the regulariser's term, logged

A regulariser asks the module's hidden-state tap for the training forward's states with their graph (`grad=True`), the
same request the live-statistics callbacks make without it: one forward returns them for all (core/capture.py). Its
term and statistic are summed on the device (StepMonitor) and logged with train/loss at the logging steps:
`train/reg_loss` and `train/isoscore_star` or `train/mean_cosine`, the mean over the micro-batches since the last
logging step (each the statistic of one micro-batch over every rank together: lightning_modules/regularizers.py).
I-STAR's C0 is recomputed at the start of every epoch (this rank's share of the training tokens the data module's
`shrinkage_batches` gives, synced) and saved in checkpoints, so a resumed run continues with the C0 a straight run has.
"""

from __future__ import annotations

import math
import os

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_warn
from torch import Tensor

from core.capture import HiddenStateTap
from core.errors import UserError
from core.wording import plural
from lightning_modules.monitor import StepMonitor
from lightning_modules.regularizers import Regularizer


class TrainingModule(pl.LightningModule):
    """The shared optimisation of train.py's modules; subclasses set `self.model` and make the regulariser. The
    optimiser reads hparams lr, betas, eps, weight_decay, decay_bias_and_norm, warmup_steps, decay_steps, end_lr, power;
    the regulariser regularizer, reg_weight, reg_layers, zeta, reg_shrinkage_tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden_state_tap = HiddenStateTap()  # live-statistics callbacks and the regulariser ask for hidden states
        self.monitor: StepMonitor | None = None  # made at the start of each fit, on the device
        self.regularizer = Regularizer()
        self._seed = 0

    def make_regularizer(self) -> Regularizer:
        """The regulariser from the hyper-parameters (regularizer, reg_weight, reg_layers, zeta,
        reg_shrinkage_tokens), checked; `self.regularizer.bind(num_layers)` then checks its layers against the model."""
        h = self.hparams
        self.regularizer = Regularizer(h.regularizer, h.reg_weight, h.reg_layers, h.zeta, h.reg_shrinkage_tokens)
        return self.regularizer

    @property
    def uses_dropout(self) -> bool:
        return True

    # -- the regulariser --

    def request_states(self) -> bool:
        """Before a training forward: the regulariser asks the tap for the states with their graph. Returns whether
        the forward must return hidden states at all (the regulariser's or a callback's request)."""
        if self.regularizer.on and self.training:
            self.hidden_state_tap.request(self.regularizer, grad=True)
        return self.hidden_state_tap.active

    def regularized(self, loss: Tensor, hidden, mask: Tensor | None) -> Tensor:
        """A training step's loss: the task loss plus the regulariser's term on the chosen layers of `hidden` (the
        forward's hidden states, all layers; `mask` [batch, seq] the tokens that count, None: all), both summed on the
        device for logging; the tap keeps the states for the callbacks."""
        tap, reg = self.hidden_state_tap, self.regularizer
        try:
            if hidden is not None:
                tap.keep(hidden)
            if reg.on and self.training:
                term, value = reg(tap.live(reg.layers), mask)
                self.monitor.add_values({"reg_loss": term, reg.statistic: value})
                loss = loss + term
        finally:
            tap.release(reg)  # the callbacks' own requests stay until their batch ends
        self.monitor.add_loss(loss)  # summed on the device; logged at the logging interval (no sync here)
        return loss

    def shrinkage_states(self, batch: dict) -> tuple[list[Tensor], Tensor | None]:
        """The regulariser's layers' states [batch, seq, hidden] of a batch of training inputs, and its token mask
        (eval mode, no gradient: C0's pass)."""
        raise NotImplementedError

    def on_train_epoch_start(self) -> None:
        self.refresh_shrinkage()

    def refresh_shrinkage(self) -> None:
        """I-STAR's C0 for this epoch, unless it is already at hand (the epoch index: optimizer steps so far over
        steps per epoch, so a run resumed mid-epoch keeps the C0 it saved and one resumed at an epoch's end computes
        the next epoch's). Called at each epoch's start, and at each optimizer step's first micro-batch (a run
        resumed at an epoch's end starts the next epoch without Lightning's epoch-start hook): a comparison of two
        Python ints there, nothing on the device."""
        reg, trainer = self.regularizer, self.trainer
        if not reg.needs_shrinkage:
            return
        steps = trainer.num_training_batches / max(trainer.accumulate_grad_batches, 1)
        epoch = trainer.global_step // int(steps) if math.isfinite(steps) and steps >= 1 else trainer.current_epoch
        if reg.shrinkage is not None and reg.shrinkage_epoch == epoch:
            return
        data = trainer.datamodule
        batches = data.shrinkage_batches(epoch, reg.shrinkage_tokens, trainer.global_rank, trainer.world_size)
        training = self.training
        self.eval()
        try:
            reg.refresh(self.shrinkage_states, batches, self.model.config.hidden_size, self.device, epoch)
        finally:
            self.train(training)

    # -- randomness: dropout depends on (seed, rank, batch), so a resumed run draws what a straight one would --

    def on_fit_start(self) -> None:
        self._seed = run_seed()

    def on_train_start(self) -> None:
        self.monitor = StepMonitor(self.device, self.trainer.global_step)

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        self.refresh_shrinkage()
        if self.uses_dropout:
            index = self.trainer.fit_loop.epoch_loop.batch_progress.total.ready  # micro-batches so far, restored on resume
            torch.manual_seed((self._seed * 1_000_003 + self.global_rank * 7_919 + index * 104_729) % (2**63))

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        """At a logging step (every `log_every_n_steps` optimizer steps, the same on every rank): the mean loss over
        all ranks and micro-batches since the last one (and the regulariser's values), the last gradient norm, and
        the non-finite check."""
        monitor, trainer = self.monitor, self.trainer
        if monitor is None or monitor.batches == 0 or trainer.global_step % max(trainer.log_every_n_steps, 1):
            return
        values = monitor.flush(trainer.strategy)  # one all-reduce, one read; raises after a non-finite step
        self.log_dict({f"train/{name}": torch.tensor(value) for name, value in values.items()})
        # the progress bar reads plain floats (a logged tensor with prog_bar=True would be read every batch)
        trainer.progress_bar_metrics["train/loss"] = round(values["loss"], 4)

    # -- checkpoints --

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """No checkpoint holds a run past a non-finite step (every rank; a collective); the regulariser's C0."""
        if self.monitor is not None:
            self.monitor.check(self.trainer.strategy)
        if self.regularizer.on:
            checkpoint["regularizer"] = self.regularizer.state_dict()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if self.regularizer.on and checkpoint.get("regularizer"):
            self.regularizer.load_state_dict(checkpoint["regularizer"], self.device)

    # -- optimisation --

    def optimized_parameters(self):
        """(name, parameter) of what AdamW trains: the model's (a subclass may add its own)."""
        return self.model.named_parameters()

    def configure_optimizers(self):
        decay, no_decay = [], []
        for name, parameter in self.optimized_parameters():
            if not parameter.requires_grad:
                continue  # the frozen zero position table of a no-PE model
            exempt = parameter.ndim < 2 or "LayerNorm" in name or "layer_norm" in name
            (no_decay if exempt and not self.hparams.decay_bias_and_norm else decay).append(parameter)
        h = self.hparams
        groups = [{"params": decay, "weight_decay": h.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        try:  # fused: one kernel for all parameters, and it skips a non-finite step on the device (found_inf)
            optimizer = torch.optim.AdamW(groups, lr=h.lr, betas=tuple(h.betas), eps=h.eps, fused=True)
        except RuntimeError:  # a device without fused AdamW kernels: the non-fused step, checked on the host
            optimizer = torch.optim.AdamW(groups, lr=h.lr, betas=tuple(h.betas), eps=h.eps)
        end = schedule_end(h.decay_steps, None if h.decay_steps else self.trainer.max_steps)  # a trainer if needed
        schedule = PolynomialSchedule(h.warmup_steps, end, h.end_lr / h.lr, h.power)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Clip by global norm; a non-finite loss or gradient never reaches the weights. The check stays on the
        device: the fused AdamW skips the update (weights, moments, step count) when `found_inf` is 1, and the run
        stops at the next logging step, checkpoint or end, naming the step (lightning_modules/monitor.py). An
        optimizer that cannot skip on the device (not fused) is checked here, with a host synchronisation."""
        parameters = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(parameters, gradient_clip_val or math.inf, foreach=True)
        found_inf = self.monitor.end_step(norm)
        if optimizer.defaults.get("fused"):
            optimizer.found_inf = found_inf  # read by the fused kernel, on the device
        else:
            self.monitor.check(self.trainer.strategy)


def run_seed() -> int:
    """The run's one seed: Lightning's seed_everything (train.py's --seed_everything, set before the modules are
    built) keeps it in PL_GLOBAL_SEED; 0 without one."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


def schedule_end(decay_steps: int | None, max_steps: int | None) -> int:
    """The step where the learning rate reaches its end: --model.decay_steps, else --trainer.max_steps."""
    end = decay_steps or max_steps
    if end is None or end <= 0:
        raise UserError("set --trainer.max_steps or --model.decay_steps: the learning-rate schedule needs an end")
    return end


def check_resumed_schedule(schedulers, h, max_steps: int | None, path) -> None:
    """A resume restores the checkpoint's learning-rate schedule whole (LambdaLR saves PolynomialSchedule's fields and
    its base rates): its end step and end rate, warm-up, power and peak rate, whatever --trainer.max_steps and --model.*
    say now. One line when the resumed run would go on past that end at a rate of 0 (each step after it changing
    nothing: a run extended past the schedule it was started with); one warning when the settings give another
    schedule that is not followed."""
    try:
        saved = schedulers[0]["lr_lambdas"][0]
        saved_end, saved_ratio = int(saved["decay_steps"]), float(saved["end_ratio"])
    except (TypeError, KeyError, IndexError, ValueError):
        return  # no schedule of ours saved: nothing to compare
    end, ratio = schedule_end(h.decay_steps, None if h.decay_steps else max_steps), h.end_lr / h.lr
    given = {"--model.warmup_steps": h.warmup_steps, "--model.power": h.power, "--model.lr": h.lr}
    kept = {"--model.warmup_steps": saved.get("warmup_steps"), "--model.power": saved.get("power"),
            "--model.lr": (schedulers[0].get("base_lrs") or [None])[0]}
    others = [name for name, value in kept.items() if value is not None and value != given[name]]
    if (end, ratio) == (saved_end, saved_ratio) and not others:
        return
    if saved_ratio == 0 and max_steps is not None and max_steps > saved_end:
        raise UserError(f"checkpoint {path} ends its learning-rate schedule at step {saved_end}, and a resume keeps "
                        f"it: steps {saved_end + 1}..{max_steps} (--trainer.max_steps {max_steps}) would train at a rate "
                        f"of 0; to train longer, start the run with --model.decay_steps at its final length (or resume "
                        f"with --trainer.max_steps {saved_end})")
    was = "".join(f", {name} {kept[name]:g}" for name in others)
    now = "".join(f", {name} {given[name]:g}" for name in others)
    rank_zero_warn(f"checkpoint {path}'s learning-rate schedule (to {saved_ratio:g} x --model.lr at step {saved_end}"
                   f"{was}) is resumed as it was, not the one the settings give ({ratio:g} x at step {end}{now})")


def check_optimisation(h) -> None:
    """The optimiser's and schedule's arguments, before any logger or directory exists (AdamW, made when training
    starts, would otherwise stop the run with a traceback after its files are written)."""
    def number(value) -> bool:
        return isinstance(value, (int, float)) and math.isfinite(value)

    checks = [("lr", number(h.lr) and h.lr > 0, "a positive number"),
              ("end_lr", number(h.end_lr) and 0 <= h.end_lr <= h.lr, "between 0 and --model.lr"),
              ("eps", number(h.eps) and h.eps > 0, "a positive number"),
              ("weight_decay", number(h.weight_decay) and h.weight_decay >= 0, "at least 0"),
              ("dropout", h.get("dropout") is None or number(h.dropout) and 0 <= h.dropout < 1, "in [0, 1)"),
              ("power", number(h.power) and h.power > 0, "a positive number"),
              ("betas", len(h.betas) == 2 and all(number(b) and 0 <= b < 1 for b in h.betas), "two numbers in [0, 1)"),
              ("warmup_steps", h.warmup_steps >= 0, "at least 0"),
              ("decay_steps", h.decay_steps is None or h.decay_steps > 0, "positive (or null: --trainer.max_steps)")]
    for name, good, expected in checks:
        if not good:
            raise UserError(f"--model.{name} must be {expected}, got {getattr(h, name)}")


def check_warmup(warmup_steps: int, decay_steps: int | None, max_steps: int | None) -> None:
    """One warning (not an error: a short smoke run of a full-size config is a fair thing to start) when the warm-up
    does not end before the schedule does (the rate never decays), or when the run stops inside the warm-up of a
    longer schedule (to be resumed). The schedule must have an end."""
    end = schedule_end(decay_steps, max_steps)
    if warmup_steps >= end:
        source = "--model.decay_steps" if decay_steps else "--trainer.max_steps"
        rank_zero_warn(f"--model.warmup_steps {warmup_steps} does not end before the learning-rate schedule does "
                       f"(step {end}, {source}): the rate never decays; lower --model.warmup_steps for a whole "
                       "schedule")
    elif max_steps is not None and 0 < max_steps <= warmup_steps:
        rank_zero_warn(f"this run stops at step {max_steps} (--trainer.max_steps), inside the warm-up of "
                       f"{plural(warmup_steps, 'step')}: the learning rate stays below --model.lr until a resumed run goes on")


class PolynomialSchedule:
    """LR multiplier: step/warmup during warm-up, then end + (1 - end)(1 - progress)^power, held at `end` after."""

    def __init__(self, warmup_steps: int, decay_steps: int, end_ratio: float = 0.0, power: float = 1.0) -> None:
        self.warmup_steps, self.decay_steps, self.end_ratio, self.power = warmup_steps, decay_steps, end_ratio, power

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        span = max(1, self.decay_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.end_ratio + (1 - self.end_ratio) * (1 - progress) ** self.power
