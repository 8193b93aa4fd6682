"""A quiet run: Lightning's model summary in one line with the module's parameter counts, and the Rich progress bar of a
step-bounded run counting its optimizer steps across epochs (not "Epoch 0/-2")."""

from __future__ import annotations

import logging

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelSummary, RichModelSummary
from pytorch_lightning.callbacks.progress.rich_progress import RichProgressBar

from core.quiet import OneLineSummary, StepProgressBar, quiet_trainer


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 3)
        self.frozen = torch.nn.Linear(3, 2).requires_grad_(False)

    def training_step(self, batch, batch_idx):
        return self.frozen(self.layer(batch[0])).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.layer.parameters(), lr=0.1)


class Seen(pl.Callback):
    """The step bar's (completed, total, description) at every batch end (after the bar's own update)."""

    def __init__(self) -> None:
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        bar = trainer.progress_bar_callback
        task = bar.progress.tasks[bar.train_progress_bar_id]
        self.rows.append((trainer.current_epoch, int(task.completed), task.total, task.description.strip()))


def test_one_line_summary_and_a_bar_of_steps_across_epochs(tmp_path, caplog):
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(12, 4)), batch_size=4)  # 3 a epoch
    seen = Seen()
    trainer = pl.Trainer(max_steps=7, accelerator="cpu", logger=False, enable_checkpointing=False,
                         default_root_dir=tmp_path)  # Lightning's default bar and summary: Rich's
    assert {RichProgressBar, RichModelSummary} <= {type(c) for c in trainer.callbacks}
    quiet_trainer(trainer)
    trainer.callbacks.append(seen)  # after the bar: it reads what the bar shows
    assert [type(c) for c in trainer.callbacks if isinstance(c, (RichProgressBar, ModelSummary))] == \
        [StepProgressBar, OneLineSummary]
    model = Tiny()
    with caplog.at_level(logging.INFO, logger="pytorch_lightning"):
        trainer.fit(model, data)
    summary = [r.getMessage() for r in caplog.records if r.name == "pytorch_lightning.callbacks.model_summary"]
    assert summary == ["Tiny: 23 parameters (15 trainable)"]  # 4*3+3 trainable, 3*2+2 frozen
    # after the bar's update at the end of batch i (step i+1): one bar for the run, across the 3 epochs
    assert [(epoch, done, total) for epoch, done, total, _ in seen.rows] == \
        [(step // 3, step + 1, 7) for step in range(7)]
    assert {description for *_, description in seen.rows} == {"step"}
