"""The capture schedule every live-statistics callback shares: hidden states of the steps a model runs anyway.

    python train.py fit --config configs/pretrain/tiny.yaml     # OutlierStatistics, ContributionVectors and
                                                                # AttentionGeometry use this

    class MyStatistic(LiveCallback):        # build(trainer, module), update(stage, captured, ...), finish(stage, ...)
        ...

Layers follow transformers' `hidden_states`: 0 is the embedding module's output, l the output of transformer layer l.
No extra forward pass: a module with a `hidden_state_tap` (core.capture.HiddenStateTap: MLMModule, eager or compiled)
returns them from its own forward when a callback requests them; any other encoder is hooked for the captured batch
(core.models.hidden_state_sites finds the modules, core.capture.HiddenStateCapture hooks them).

LiveCallback is the schedule the callbacks share. Training: on trainer step s with s % every_n_steps == 0, forward
hooks are on for every micro-batch of that step on every rank (so the step's whole global batch is seen, however it
is split over devices and accumulation), `update("train", captured)` runs after each micro-batch and `finish("train",
step=s)` on every rank once the optimizer step is done: metrics sync collectively there, only rank zero logs. Other
steps touch nothing on the device (no request, no hook, no synchronisation). A trainer step is the count Lightning
logs `train/loss` at (`trainer_step`): one per optimizer step of a pretraining run, one per block of a probe.py run
(whose block takes several optimizer steps), so every statistic shares the x axis of the run's own metrics.
Validation (`on_validation`): every validation batch is captured (eval mode), `finish("val")` at the epoch end, at
the step Lightning logs `val/loss` at (`validation_step`: during fit, one less than the optimizer steps taken). The
sanity check is skipped. Hooks hold references to the layer outputs only until the batch ends and are removed at
batch end, on an exception and at teardown; a tap request is released at the same points. Training states come from the training forward pass itself: dropout on,
15% of the tokens masked; validation states from the eval-mode validation pass.

In probe.py runs (a PositionProbe over cached features), the captured states are the batch's features of the chosen
layers and the labels are the positions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pytorch_lightning as pl
import torch
from torch import Tensor, nn

from callbacks.media import FIGURES
from core.capture import HiddenStateCapture, HiddenStateTap
from core.errors import UserError
from core.models import find_encoder, hidden_size, hidden_state_sites


@dataclass
class Captured:
    """What one batch gave: token vectors of the chosen layers and each token's 0-indexed position in its sequence."""

    hidden: Tensor | None  # [layers, batch, seq, hidden] from hooks; None for cached probe features
    mask: Tensor | None  # [batch, seq] bool, True for real tokens
    features: Tensor | None = None  # [layers, tokens, hidden] when there is no sequence structure
    labels: Tensor | None = None  # [tokens] positions of `features`
    input_ids: Tensor | None = None  # [batch, seq] the batch's token ids, when it has them

    @property
    def tokens(self) -> Tensor:
        """[layers, tokens, hidden]: the unmasked token vectors (a view when nothing is masked)."""
        if self.hidden is None:
            return self.features
        if self.mask is None or bool(self.mask.all()):
            return self.hidden.flatten(1, 2)
        return self.hidden[:, self.mask]

    @property
    def positions(self) -> Tensor:
        """[tokens]: each token's index in its sequence."""
        if self.hidden is None:
            return self.labels
        batch, seq = self.hidden.shape[1:3]
        positions = torch.arange(seq, device=self.hidden.device).expand(batch, seq)
        return positions.flatten() if self.mask is None or bool(self.mask.all()) else positions[self.mask]


# ---- W&B sections: W&B groups a run's panels by the key's first component ----

def by_layer(prefix: str) -> str:
    """The per-layer detail section of a family of keys: `outliers` -> `outliers_by_layer`. A family's own section
    (`outliers/...`) holds a few whole-model numbers (metrics/summary.py) and images; its detail section holds
    `<prefix>_by_layer/layer_{l}/<statistic>` for every layer."""
    return f"{prefix}_by_layer"


def layer_metrics(prefix: str, layers: Sequence[int], values: Mapping[str, Sequence]) -> dict:
    """{`<prefix>_by_layer/layer_{l}/<name>`: values[name][i]} for the i-th of `layers`, layer by layer."""
    return {f"{by_layer(prefix)}/layer_{layer}/{name}": column[i] for i, layer in enumerate(layers)
            for name, column in values.items()}


def trainer_step(trainer) -> int:
    """The step Lightning logs a training batch's metrics (`train/loss`) at: its count of batches that stepped the
    optimizer, one per batch however many optimizer steps the batch takes (a probe.py block takes one per batch of
    the block, and `global_step` counts each; a pretraining step takes one, so there the two agree). Lightning's
    LearningRateMonitor logs at it too."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def validation_step(trainer) -> int:
    """The step Lightning logs a validation's metrics (`val/loss`) at, so that the live statistics of the same
    validation line up with them: `trainer_step`, which during fit is read before it counts the step the validation
    follows (one less than `global_step` in a pretraining run)."""
    return trainer_step(trainer)


def resolve_layers(layers: list[int] | None, available: int, owner: str) -> list[int]:
    """The chosen layers (default: all 0..available-1), checked."""
    if layers is None:
        return list(range(available))
    bad = [layer for layer in layers if not 0 <= layer < available]
    if bad or not layers or len(set(layers)) != len(layers):
        raise UserError(f"{owner}: layers {list(layers)} must be distinct, within 0..{available - 1} "
                        "(0 = embedding output)")
    return list(layers)


class LiveCallback(pl.Callback):
    """The shared capture schedule (see the module docstring); subclasses implement build, update and finish."""

    supports_probe_features = False

    def __init__(self, every_n_steps: int, image_every_n_steps: int, layers: list[int] | None,
                 on_validation: bool) -> None:
        self.every_n_steps, self.image_every_n_steps = every_n_steps, image_every_n_steps
        self.requested_layers, self.on_validation = layers, on_validation
        self.layers: list[int] = []
        self._modules: list[nn.Module] | None = None  # hook targets; None: the batch holds probe features
        self._slots: list[int] = []  # probe features: the feature slot of each chosen layer
        self._capture: HiddenStateCapture | None = None
        self._tap: HiddenStateTap | None = None  # the module's own hidden-state output, when it has one
        self._tapped = False  # a tap request of this callback is open
        self._step: int | None = None  # the trainer step being captured (trainer_step)
        self._optimizer_steps = 0  # global_step when it started: the step is done once global_step moves on
        self._validating = False
        self.hidden_size = 0

    # ---- where the hidden states come from ----
    def check_settings(self) -> None:
        """The cadence (checked here, not in __init__: jsonargparse would bury the message in its own)."""
        name, every, images = type(self).__name__, self.every_n_steps, self.image_every_n_steps
        if every < 1:
            raise UserError(f"{name}: every_n_steps must be at least 1, got {every}")
        if images < 0 or images % every:
            raise UserError(f"{name}: image_every_n_steps ({images}) must be a multiple of every_n_steps ({every}), "
                            "or 0 for no images during training")

    def check(self, pl_module: pl.LightningModule, data: pl.LightningDataModule | None = None) -> None:
        """Raise a UserError now when the module's hidden states cannot be captured, or, for a module without an
        encoder, the prepared probe data module `data` holds no position-probe features to read (train.py and
        probe.py call this before any logger starts)."""
        self.check_settings()
        if data is not None and find_encoder(pl_module) is None and self.supports_probe_features:
            self.probe_slots(pl_module, data)
            return
        modules = hidden_state_sites(pl_module)
        self.capture_layers(pl_module, len(modules))

    def capture_layers(self, pl_module: pl.LightningModule, available: int) -> list[int]:
        """The hidden-state layers (0 = embedding output, of `available`) this callback reads, checked: its `layers`
        (a subclass may read others, e.g. the inputs of the transformer layers it watches)."""
        return resolve_layers(self.requested_layers, available, type(self).__name__)

    def _resolve_source(self, trainer, pl_module) -> None:
        if find_encoder(pl_module) is not None or not self.supports_probe_features:
            self._tap = getattr(pl_module, "hidden_state_tap", None)
            self._modules = hidden_state_sites(pl_module)
            self.layers = self.capture_layers(pl_module, len(self._modules))
            self.hidden_size = hidden_size(find_encoder(pl_module).config)
            return
        self.layers, self._slots = self.probe_slots(pl_module, trainer.datamodule)
        self._modules, self.hidden_size = None, trainer.datamodule.spec.hidden_size

    def probe_slots(self, pl_module: pl.LightningModule, data) -> tuple[list[int], list[int]]:
        """(the layers read, their feature slots) of a probe data module's cached position-probe features."""
        spec = getattr(data, "spec", None)  # the position probe's FeatureSpec (datamodules.probing.PositionDataModule)
        if spec is None or getattr(data, "item_name", None) != "tokens":
            raise UserError(f"{type(self).__name__}: cannot capture the hidden states of {type(pl_module).__name__}: it "
                            "holds no transformers encoder and its data are not the position probe's cached features "
                            "(use it in MLM pretraining or with configs/probe/position.yaml)")
        encoder_layer_ids = [layer for kind, layer in spec.slots if kind == "encoder"]
        layers = self.requested_layers or encoder_layer_ids
        missing = [layer for layer in layers if layer not in encoder_layer_ids]
        if missing:
            raise UserError(f"{type(self).__name__}: layers {missing} are not among the probe's layers {encoder_layer_ids}")
        return layers, [spec.slots.index(("encoder", layer)) for layer in layers]

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.check_settings()
        self._resolve_source(trainer, pl_module)
        self.build(trainer, pl_module)

    def build(self, trainer, pl_module) -> None:
        raise NotImplementedError

    def update(self, stage: str, captured: Captured, trainer, pl_module) -> None:
        raise NotImplementedError

    def finish(self, stage: str, trainer, pl_module, step: int) -> None:
        raise NotImplementedError

    # ---- capture around a batch ----
    def _open(self) -> None:
        if self._tap is not None:
            self._tap.request(self)
            self._tapped = True
        elif self._modules is not None:
            self._capture = HiddenStateCapture(self._modules, self.layers).__enter__()

    def _close(self, batch) -> Captured:
        if self._modules is None:
            features, labels = batch[0], batch[1]  # (a control task's labels may follow)
            return Captured(hidden=None, mask=None, features=features[self._slots], labels=labels)
        if self._tap is not None:
            try:
                hidden = self._tap.stack(self.layers)
            finally:
                self._drop()
        else:
            capture, self._capture = self._capture, None
            capture.__exit__(None, None, None)
            hidden = capture.stack()
        mask = batch.get("attention_mask") if isinstance(batch, dict) else None
        return Captured(hidden=hidden, mask=mask.bool() if mask is not None else None,
                        input_ids=batch.get("input_ids") if isinstance(batch, dict) else None)

    def _drop(self) -> None:
        if self._tapped:
            self._tap.release(self)
            self._tapped = False
        if self._capture is not None:
            self._capture.__exit__(None, None, None)
            self._capture = None

    @property
    def capture_step(self) -> int | None:
        """The trainer step whose micro-batches are being captured (None outside a captured step)."""
        return self._step

    def due_images(self, step: int) -> bool:
        return self.image_every_n_steps > 0 and step % self.image_every_n_steps == 0

    # ---- Lightning hooks ----
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        step = trainer_step(trainer)
        if step % self.every_n_steps == 0 and self._step in (None, step):
            if self._step is None:  # the step's first micro-batch
                self._optimizer_steps = trainer.global_step
            self._step = step
            self._open()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if FIGURES.ready:  # figures drawn off this thread since: logged from here (callbacks/media.py)
            FIGURES.drain(trainer)
        if self._step is None:
            return
        self.update("train", self._close(batch), trainer, pl_module)
        if trainer.global_step != self._optimizer_steps:  # the step is done: every rank finishes it together
            step, self._step = self._step, None
            self.finish("train", trainer, pl_module, step)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.on_validation and not trainer.sanity_checking:
            self._validating = True
            self._open()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        if self._validating:
            self._validating = False
            self.update("val", self._close(batch), trainer, pl_module)

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if self.on_validation and not trainer.sanity_checking:
            self.finish("val", trainer, pl_module, validation_step(trainer))

    def on_train_end(self, trainer, pl_module) -> None:
        FIGURES.flush(trainer)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._drop()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._drop()
        FIGURES.flush(trainer)  # before the loggers close


def check_callbacks(trainer, pl_module, data: pl.LightningDataModule | None = None) -> None:
    """Before anything is written (train.py's before_fit; probe.py's, `data` its prepared probe data module): every
    live-statistics callback can capture the module, or read the probe's cached features."""
    for callback in trainer.callbacks:
        if isinstance(callback, LiveCallback):
            callback.check(pl_module, data)
