"""The live callbacks' figures, drawn off the training loop's thread.

    from callbacks.media import FIGURES
    FIGURES.submit(trainer, "outliers/by_layer", lambda: layer_step_figure(...), step)   # returns at once
    FIGURES.drain(trainer)      # the training thread logs what is drawn (the callbacks do this after each batch)
    FIGURES.flush(trainer)      # waits for the rest and logs it (at the end of training, before the logger closes)

Making and drawing a figure costs far more than computing its statistics (~0.1-0.2 s of CPU each at the tiny config;
a capture step's statistics take a few ms). `submit` queues a callable that makes the figure from data already on the
CPU (the callbacks pass copies, never live state) to one daemon thread, which draws it to an RGB array and, when a
W&B logger is there, encodes it as a `wandb.Image`; the logger calls themselves stay on the training thread (`drain`,
`flush`), so W&B and TensorBoard are never called from two threads. The figures use matplotlib's Figure API without
pyplot (core/figures.py), so a figure is never shared between threads. The GIL is released by PyTorch's kernels, so
the drawing overlaps the training step where a core is free (wall time); the CPU time is the same. A figure that
fails is warned about once (LoggingWarning) and training goes on. Rank zero only: only it logs.
"""

from __future__ import annotations

import queue
import threading
import warnings
from collections.abc import Callable

from pytorch_lightning.loggers import TensorBoardLogger, WandbLogger

from callbacks.wandb_logging import (
    LoggingWarning,
    _first_line,
    _safely,
    _tensorboard,
    image_loggers,
    real_loggers,
)
from core.figures import figure_array


class FigureWorker:
    """One daemon thread that draws figures; the training thread logs them (see the module docstring)."""

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._ready: list[tuple] = []  # (key, step, RGB array, wandb.Image | None, error | None), drawn, not logged
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._warned = False

    @property
    def ready(self) -> bool:
        return bool(self._ready)

    def submit(self, trainer, key: str, make: Callable, step: int) -> None:
        """Queue `make()` (a matplotlib Figure from copied data) to be drawn and logged under `key` at `step`."""
        loggers = image_loggers(trainer)
        if not loggers:
            return
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._work, name="live-figures", daemon=True)
            self._thread.start()
        self._jobs.put((key, make, step, any(isinstance(logger, WandbLogger) for logger in loggers)))

    def _work(self) -> None:
        while True:
            key, make, step, for_wandb = self._jobs.get()
            try:
                array = figure_array(make())
                image = None
                if for_wandb:
                    import wandb

                    image = wandb.Image(array)  # the PNG is encoded here, off the training thread
                done = (key, step, array, image, None)
            except Exception as error:  # never stop training for a figure
                done = (key, step, None, None, error)
            with self._lock:
                self._ready.append(done)
            self._jobs.task_done()

    def drain(self, trainer) -> None:
        """Log the figures drawn so far (training thread)."""
        if not self._ready:
            return
        with self._lock:
            ready, self._ready = self._ready, []
        for key, step, array, image, error in ready:
            if error is not None:
                if not self._warned:
                    self._warned = True
                    warnings.warn(f"the live figure {key} failed ({_first_line(error)}); training continues, later "
                                  "figures are still tried", LoggingWarning, stacklevel=2)
                continue
            for logger in real_loggers(trainer):
                if isinstance(logger, WandbLogger) and image is not None:  # log_image's record, without the copy of
                    # the image it makes (which reads the PNG back from disk on this thread: ~half its time per image)
                    _safely(logger, key, logger.log_metrics, {key: [image]}, step)
                elif isinstance(logger, TensorBoardLogger):
                    _safely(logger, key, _tensorboard, logger, "add_image", key, array, step, dataformats="HWC")

    def flush(self, trainer) -> None:
        """Wait until every queued figure is drawn, then log them (before the loggers close)."""
        if self._thread is not None:
            self._jobs.join()
        self.drain(trainer)


FIGURES = FigureWorker()
