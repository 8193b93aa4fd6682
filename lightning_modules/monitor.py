"""What the training loop needs to know about its steps, kept on the device: no host synchronisation per step.

    python train.py fit --config configs/pretrain/tiny.yaml       # MLMModule keeps one StepMonitor per fit

    monitor = StepMonitor(device, first_step=trainer.global_step)
    monitor.add_loss(loss)                   # each micro-batch: summed on the device
    monitor.add_values({"reg_loss": term})   # other per-micro-batch values (a regulariser's): summed alike
    found_inf = monitor.end_step(grad_norm)  # each optimizer step: 1.0 (on the device) from the first non-finite step on
    optimizer.found_inf = found_inf          # a fused AdamW then leaves weights and state untouched, on the device
    values = monitor.flush(strategy)         # at a logging step: one all-reduce and one read of 3 numbers
    monitor.check(strategy)                  # before a checkpoint or the export: raises if a step was non-finite

A step is non-finite when its gradient norm (of the gradients DDP already averaged, the same on every rank) or the
loss of any of its micro-batches is NaN or infinite. From that step on `found_inf` is 1 (sticky), so no later update
reaches the weights either, until the host reads the flag at the next logging step, checkpoint or end of training
and stops the run naming the first bad step. A rank whose loss alone was non-finite (its gradients finite, so its
partners stepped) never reaches a checkpoint: the flag is reduced over ranks before any checkpoint is written.
"""

from __future__ import annotations

import torch
from torch import Tensor

from core.errors import UserError


class StepMonitor:
    """Device-side loss sums and the first non-finite optimizer step of a fit (see the module docstring)."""

    def __init__(self, device: torch.device, first_step: int) -> None:
        self.first_step = first_step  # the trainer's global step when the fit started (or resumed)
        self.loss_sum = torch.zeros((), device=device)  # micro-batch losses since the last flush
        self.batches = 0  # micro-batches since the last flush (the same count on every rank)
        self.window = torch.zeros((), device=device)  # loss sum of the optimizer step in progress
        self.window_batches = 0
        self.steps = torch.zeros((), dtype=torch.long, device=device)  # optimizer steps seen, on the device
        self.first_bad = torch.full((), -1, dtype=torch.long, device=device)  # index of the first non-finite step
        self.bad_values = torch.zeros(2, device=device)  # its (mean loss, gradient norm)
        self.norm = torch.zeros((), device=device)  # the last step's gradient norm
        self.found_inf = torch.zeros((), device=device)
        self.value_sums: dict[str, Tensor] = {}  # other per-micro-batch values since the last flush (add_values)

    def add_values(self, values: dict[str, Tensor]) -> None:
        """Per-micro-batch values (the same names every micro-batch, on every rank), summed on the device and
        flushed with the loss: their mean over all ranks and micro-batches since the last flush."""
        for name, value in values.items():
            value = value.detach().float()
            self.value_sums[name] = self.value_sums[name] + value if name in self.value_sums else value.clone()

    def add_loss(self, loss: Tensor) -> None:
        self.window += loss.detach().float()
        self.window_batches += 1

    def end_step(self, norm: Tensor) -> Tensor:
        """The optimizer step's gradient norm; returns `found_inf` (float 0/1 on the device, 1 from the first
        non-finite step on)."""
        norm = norm.detach().float()
        bad = ~torch.isfinite(norm) | ~torch.isfinite(self.window)
        first = bad & (self.first_bad < 0)
        self.first_bad = torch.where(first, self.steps, self.first_bad)
        mean = self.window / max(self.window_batches, 1)
        self.bad_values = torch.where(first, torch.stack([mean, norm]), self.bad_values)
        self.steps += 1
        self.loss_sum += self.window
        self.batches += self.window_batches
        self.window = torch.zeros_like(self.window)
        self.window_batches = 0
        self.norm = norm
        self.found_inf = (self.first_bad >= 0).float()
        return self.found_inf

    def flush(self, strategy) -> dict[str, float]:
        """At a logging step (every rank): the mean micro-batch loss over all ranks since the last flush and the last
        gradient norm (and the mean of each add_values name); raises when a step was non-finite. One all-reduce and one
        device-to-host read."""
        names = sorted(self.value_sums)
        local = torch.stack([self.loss_sum, self.found_inf, *(self.value_sums[name] for name in names)])
        total = strategy.reduce(local.clone(), reduce_op="sum")
        loss_sum, bad, *sums, norm = torch.cat([total, self.norm.view(1)]).tolist()
        if bad > 0:
            self._raise(strategy)
        count = max(self.batches * getattr(strategy, "world_size", 1), 1)
        values = {"loss": loss_sum / count, "grad_norm": norm, **{name: v / count for name, v in zip(names, sums)}}
        self.loss_sum.zero_()
        self.value_sums = {}
        self.batches = 0
        return values

    def check(self, strategy) -> None:
        """Raise (on every rank) when any rank saw a non-finite step; a collective, one read."""
        if float(strategy.reduce(self.found_inf.clone(), reduce_op="sum")) > 0:
            self._raise(strategy)

    def _raise(self, strategy) -> None:
        local = torch.cat([self.first_bad.float().view(1), self.bad_values]).view(1, 3)
        rows = strategy.all_gather(local).reshape(-1, 3).tolist()  # [(first bad index, loss, norm)] per rank
        index, loss, norm = min((row for row in rows if row[0] >= 0), key=lambda row: row[0])
        step = self.first_step + int(index)
        now = self.first_step + int(self.steps)
        later = f" (found at step {now - 1}: no update since reached the weights)" if now - 1 > step else ""
        raise UserError(f"non-finite training loss ({loss}) or gradient norm ({norm}) at step {step}: stopped before "
                        f"the optimizer step{later}; the last checkpoint is the last good one")
