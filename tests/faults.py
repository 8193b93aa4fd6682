"""Fault injection for tests/test_faults.py: entry points run in a subprocess with one fault planted.

    python -m tests.faults train [train.py arguments]                  # train.py as is (callbacks below via CLI)
    python -m tests.faults train --die-in-save 2 [train.py arguments]  # SIGKILL half-way through the 2nd torch.save
    python -m tests.faults train --full-disk-in-save 2 [train.py ...]  # the disk is full from the 2nd torch.save on
    torchrun --nproc_per_node 2 -m tests.faults analyze --fail-rank 1 outliers ...   # that rank raises mid-run
    python -m tests.faults analyze --pause-in-analysis READY outliers ...   # writes READY and waits before encoding
    python -m tests.faults probe [probe.py arguments]; python -m tests.faults study [study.py arguments]

The callbacks are given to train.py with `--trainer.callbacks+ '{"class_path": "tests.faults.Pause", ...}'`.
"""

from __future__ import annotations

import errno
import importlib
import io
import os
import signal
import sys
import time
from pathlib import Path

import pytorch_lightning as pl


class Pause(pl.Callback):
    """Stops the run at a chosen point, writes `ready`, and waits (up to `timeout` s) until `go` exists.

    where: "batch_start" (before micro-batch `at` of the run, counted from 0) or "optimizer_step" (after the
    backward of optimizer step `at`, before the step itself). The test sends its signal while the run waits here.
    """

    def __init__(self, ready: str, go: str = "", at: int = 0, where: str = "batch_start", timeout: float = 120) -> None:
        self.ready, self.go, self.at, self.where, self.timeout = Path(ready), Path(go), at, where, timeout
        self.done, self.batches = False, 0

    def _wait(self) -> None:
        self.done = True
        self.ready.write_text(str(os.getpid()))
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline and not (self.go.name and self.go.exists()):
            time.sleep(0.02)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.where == "batch_start" and not self.done and self.batches == self.at:
            self._wait()
        self.batches += 1

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.where == "optimizer_step" and not self.done and trainer.global_step == self.at:
            self._wait()


class FailOnRank(pl.Callback):
    """Raises RuntimeError on global rank `rank` at the start of optimizer step `step` (the other ranks carry on)."""

    def __init__(self, rank: int = 1, step: int = 2) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            raise RuntimeError(f"planted failure on rank {self.rank} at step {self.step}")


def die_in_save(count: int) -> None:
    """Make the `count`-th torch.save write half its bytes, fsync them, and SIGKILL this process (a node dying
    mid-write)."""
    import torch

    real_save, calls = torch.save, [0]

    def save(obj, f, *args, **kwargs):
        calls[0] += 1
        if calls[0] < count:
            return real_save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        f.write(buffer.getvalue()[: buffer.tell() // 2])
        f.flush()
        os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    torch.save = save


def full_disk_in_save(count: int) -> None:
    """Make the `count`-th torch.save (and every later one) write half its bytes and find the disk full."""
    import torch

    real_save, calls = torch.save, [0]

    def save(obj, f, *args, **kwargs):
        calls[0] += 1
        if calls[0] < count:
            return real_save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        f.write(buffer.getvalue()[: buffer.tell() // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    torch.save = save


def fail_on_rank(rank: int) -> None:
    """analyze.py: the outlier statistics raise RuntimeError on `rank` (after the collective start-up checks)."""
    from analyses import outliers

    real = outliers.collect_statistics

    def collect(*args, **kwargs):
        if int(os.environ.get("RANK", "0")) == rank:
            raise RuntimeError(f"planted failure on rank {rank} while encoding")
        return real(*args, **kwargs)

    outliers.collect_statistics = collect


def pause_in_analysis(ready: str) -> None:
    """analyze.py: the outlier statistics write `ready` and wait (up to 120 s) before they encode anything; the test
    sends its signal while the run waits there."""
    from analyses import outliers

    real = outliers.collect_statistics

    def collect(*args, **kwargs):
        Pause(ready)._wait()
        return real(*args, **kwargs)

    outliers.collect_statistics = collect


def main(argv: list[str]) -> int:
    program, argv = argv[0], argv[1:]
    if argv[:1] == ["--die-in-save"]:
        die_in_save(int(argv[1]))
        argv = argv[2:]
    if argv[:1] == ["--full-disk-in-save"]:
        full_disk_in_save(int(argv[1]))
        argv = argv[2:]
    if argv[:1] == ["--fail-rank"]:
        fail_on_rank(int(argv[1]))
        argv = argv[2:]
    if argv[:1] == ["--pause-in-analysis"]:
        pause_in_analysis(argv[1])
        argv = argv[2:]
    if program == "train":
        import train

        return train.cli_main(argv)
    if program in ("probe", "study"):
        return importlib.import_module(program).main(argv)
    import analyze

    return analyze.main(argv)


if __name__ == "__main__":
    from core.signals import exit_status

    sys.exit(exit_status(main(sys.argv[1:])))  # as the programs end (a run Ctrl-C stopped: by SIGINT)
