"""What Lightning prints during a run, made into lines a user can act on (train.py and probe.py, via core.cli).

    quiet_trainer(trainer)   # its default model summary: one line; its Rich progress bar: steps of a step-bounded run

Lightning's model summary (a 14-line table ending "Total FLOPs: 0") becomes one line, "MLMModule: 1.4 M parameters
(1.4 M trainable)". Its Rich progress bar reads "Epoch 0/-2 200/200" on a run bounded by --trainer.max_steps (max_epochs
-1): it then counts the optimizer steps of the whole run, "step 120/200", across epochs and from a resumed step, and
leaves out the logger's version ("v_num"). The banners that say nothing (GPU / TPU available: False, "Seed set to")
are dropped by core.errors.plain_warnings.
"""

from __future__ import annotations

import logging

from pytorch_lightning.callbacks import ModelSummary, RichModelSummary
from pytorch_lightning.callbacks.progress.rich_progress import RichProgressBar
from pytorch_lightning.utilities.model_summary import get_human_readable_count

log = logging.getLogger("pytorch_lightning.callbacks.model_summary")  # Lightning's own: held and printed as its


class OneLineSummary(ModelSummary):
    """The model summary as one line: the module's class, its parameters and the trainable ones."""

    def on_fit_start(self, trainer, pl_module) -> None:
        if not self._max_depth or not trainer.is_global_zero:
            return
        parameters = list(pl_module.parameters())
        total = sum(p.numel() for p in parameters)
        trainable = sum(p.numel() for p in parameters if p.requires_grad)
        log.info(f"{type(pl_module).__name__}: {get_human_readable_count(total).strip()} parameters "
                 f"({get_human_readable_count(trainable).strip()} trainable)")


def step_bounded(trainer) -> bool:
    """A run that --trainer.max_steps ends (max_epochs -1 or unset)."""
    return trainer.max_steps is not None and trainer.max_steps > 0 and trainer.max_epochs in (None, -1)


class StepProgressBar(RichProgressBar):
    """Lightning's Rich bar; on a step-bounded run one bar of the run's optimizer steps ("step 120/200")."""

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if not step_bounded(trainer):
            return super().on_train_epoch_start(trainer, pl_module)
        if self.is_disabled or self.progress is None:
            return
        if self.train_progress_bar_id is None:  # one bar for the whole run, from the step it starts (or resumes) at
            self.train_progress_bar_id = self._add_task(trainer.max_steps, self._get_train_description(0))
        self.progress.update(self.train_progress_bar_id, completed=trainer.global_step)
        self.refresh()

    def _get_train_description(self, current_epoch: int) -> str:
        if not step_bounded(self.trainer):
            return super()._get_train_description(current_epoch)
        return f"{'step':{len(self.validation_description)}}"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not step_bounded(trainer):
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if not self.is_disabled and self.train_progress_bar_id is None:
            self.on_train_epoch_start(trainer, pl_module)
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)
        self.refresh()

    def get_metrics(self, trainer, pl_module) -> dict:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)  # the logger's run id: nothing to read during training
        return metrics


def quiet_trainer(trainer) -> None:
    """Swap the trainer's default model summary and Rich progress bar (exactly Lightning's classes, their settings
    kept) for OneLineSummary and StepProgressBar."""
    for callback in trainer.callbacks:
        if type(callback) in (ModelSummary, RichModelSummary):
            callback.__class__ = OneLineSummary
        elif type(callback) is RichProgressBar:
            callback.__class__ = StepProgressBar
