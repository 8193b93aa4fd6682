"""The machinery every stacked linear probe shares: what the cached features hold (FeatureSpec), the probes' training
with several optimizer steps per loader batch, each slot's best-validation weights, baselines, the control task.

    class MyProbe(LinearProbes): ...        # lightning_modules/probes.py: PositionProbe, SentenceClassifier

The probes of every slot (encoder layers, the random-encoder baseline, clipped or SoftDecay features, and the
control-task probes of Hewitt & Liang 2019) are one StackedProbe (lightning_modules/stacked.py) applied to features
[probe slots, items, hidden]: training them together equals training each alone. A control-task probe reads the same
cached features as the encoder's probe of its layer and learns the items' control labels (datamodules/probing.py,
metrics/control.py); its test accuracy and the selectivity (task - control) sit beside the random-encoder baseline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import Tensor

from core.errors import UserError
from core.figures import accuracy_by_layer_figure
from lightning_modules.stacked import StackedProbe
from metrics.contributions import LayerAccuracy
from metrics.control import selectivity
from metrics.outliers import LayerOutliers

INDEXING = "0-indexed dimensions and positions; layer 0 = embedding output"


@dataclass
class FeatureSpec:
    """What the cached features hold (the probe data modules build it); the probes size themselves from it."""

    encoder: str
    layers: list[int]  # hidden-state layers cached (0 = embedding output)
    hidden_size: int
    num_classes: int
    classes: list  # class names (positions 0..P-1 for the position probe)
    slots: list[tuple[str, int]]  # per feature slot: ("encoder" | "random", layer)
    outlier_dims: list[int]  # detected on the training split, or given
    outlier_source: str  # "detected" or "given"
    outlier_layers: list[LayerOutliers] = field(default_factory=list)
    outlier_chance_bound: float | None = None  # chance alone flags a dim of a layer at most this often (ours)
    outlier_chance_warning: str | None = None  # metrics.outliers.chance_warning's line when that could matter
    counts: dict = field(default_factory=dict)  # per split: sentences, items, and more
    majority: dict = field(default_factory=dict)  # majority and chance baselines
    data: dict = field(default_factory=dict)  # source, max_length, special tokens, ... for the report
    seed: int = 0
    batch_size: int = 0  # items per optimizer step; a training batch of the loader holds several (0: one)
    num_hidden_states: int = 0  # the encoder's hidden states (layers 0..L), whichever are cached
    control: dict = field(default_factory=dict)  # the control task the items carry labels of ({}: none)
    encoder_commit: str | None = None  # the hub commit the encoder was read at (FrozenEncoder.commit); None: a path

    @property
    def encoder_slots(self) -> int:
        return sum(kind == "encoder" for kind, _ in self.slots)


def check_learning_rate(lr: float) -> None:
    """Before any logger or directory exists (the optimizer, made later, would raise a traceback mid-run)."""
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise UserError(f"--model.lr must be a positive number, got {lr}")


class LinearProbes(pl.LightningModule):
    """One linear probe per feature slot, stacked: weight [slots, hidden, classes] (+ bias [slots, classes])."""

    use_bias = False

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False  # several optimizer steps per trainer step (training_step)
        self.spec: FeatureSpec | None = None
        self.probe_slots: list[tuple[str, int]] = []
        self.results: dict[str, Tensor] = {}

    # ---- construction ---------------------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        if self.spec is None:
            self.attach(self.trainer.datamodule)

    def attach(self, data) -> None:
        """Size the probes from a prepared probing data module's FeatureSpec, with their checks (one line each);
        probe.py calls it before Lightning starts the loggers (setup runs after)."""
        spec = getattr(data, "spec", None) if data is not None else None
        if spec is None:
            raise RuntimeError(f"{type(self).__name__} needs a probing data module (datamodules/probing.py)")
        encoder = self.hparams.encoder
        if encoder is not None and str(encoder) != spec.encoder:
            raise UserError(f"the probe is for encoder {encoder} but the data module's features are of {spec.encoder}")
        self.build(spec)

    def slots(self, spec: FeatureSpec) -> list[tuple[str, int]]:
        """The data's slots, the probe's own (`extra_slots`), then a control-task probe per encoder layer when the
        items carry control labels (it reads the encoder's features, as the task probe of its layer)."""
        control = [("control", layer) for layer in spec.layers] if spec.control else []
        return list(spec.slots) + self.extra_slots(spec) + control

    def extra_slots(self, spec: FeatureSpec) -> list[tuple[str, int]]:
        return []

    def build(self, spec: FeatureSpec) -> None:
        """Create the stacked probes (each slot from its own seeded generator) and the metrics."""
        self.spec, self.probe_slots = spec, self.slots(spec)
        self.probe = StackedProbe(self.probe_slots, spec.hidden_size, spec.num_classes, self.hparams.seed,
                                  bias=self.use_bias, pad=True)  # stored padded: no padded copy per step
        self.val_accuracy = LayerAccuracy(len(self.probe_slots))
        self.test_accuracy = LayerAccuracy(len(self.probe_slots))
        slots = len(self.probe_slots)  # each slot's epoch of best validation accuracy and its weights (tested)
        self.register_buffer("best_val_accuracy", torch.full((slots,), -1.0, dtype=torch.float64), persistent=False)
        self.register_buffer("best_epoch", torch.full((slots,), -1, dtype=torch.long), persistent=False)
        self.register_buffer("control_rows", torch.tensor([kind == "control" for kind, _ in self.probe_slots]),
                             persistent=False)
        self.register_buffer("best_weight", self.probe.weight.detach().clone(), persistent=False)
        if self.probe.bias is not None:
            self.register_buffer("best_bias", self.probe.bias.detach().clone(), persistent=False)

    @property
    def weight(self) -> Tensor:
        """[slots, hidden, classes] (a view of the padded parameter)."""
        return self.probe.weights

    @property
    def bias(self) -> Tensor | None:
        """[slots, classes] (None for a bias-free probe)."""
        return self.probe.bias

    def input_parts(self, features: Tensor) -> list[Tensor]:
        """The features the probe slots read, in slot order: the data's, the probe's own (`extra_inputs`), and the
        encoder's again (a view, no copy) for the control-task probes."""
        parts = [features, *self.extra_inputs(features)]
        if self.spec.control:
            parts.append(features[:self.spec.encoder_slots])
        return parts

    def inputs(self, features: Tensor) -> Tensor:
        """The features each probe slot reads, stacked: [probe slots, items, hidden]."""
        parts = self.input_parts(features)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def extra_inputs(self, features: Tensor) -> list[Tensor]:
        return []

    def targets(self, batch: tuple[Tensor, ...]) -> Tensor:
        """The labels each probe slot learns: [items] (the task's, for every slot), or [probe slots, items] when
        the batch carries control labels (third), which the control-task slots learn."""
        labels = batch[1]
        if len(batch) < 3 or not self.spec.control:  # (a Python test: no device sync per step)
            return labels
        return torch.where(self.control_rows.unsqueeze(1), batch[2].unsqueeze(0), labels.unsqueeze(0))

    def forward(self, features: Tensor) -> Tensor:
        """features [data slots, items, hidden] → logits [probe slots, items, classes]."""
        return self.probe(self.inputs(features))

    # ---- steps ----------------------------------------------------------------------------------------------------
    def _shared_step(self, batch: tuple[Tensor, ...], stage: str) -> None:
        features, targets = batch[0], self.targets(batch)  # [slots, items, hidden], [items] or [probe slots, items]
        items, slots = targets.shape[-1], len(self.probe_slots)
        logits = self(features)  # [probe slots, items, classes]
        flat = targets.flatten() if targets.dim() == 2 else targets.repeat(slots)
        loss = F.cross_entropy(logits.flatten(0, 1), flat, reduction="sum") / max(items, 1)
        getattr(self, f"{stage}_accuracy").update(logits, targets)
        self.log(f"{stage}/loss", loss.detach() / slots, batch_size=max(items, 1), on_epoch=True)

    def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> None:
        """A block of consecutive batches of `spec.batch_size` items (datamodules/probing.py): one Adam step per
        batch, in order, as if each were its own trainer step (manual optimisation: fewer trainer round trips)."""
        features, targets = batch[0], self.targets(batch)  # [slots, block items, hidden], [(probe slots,) items]
        items, slots = targets.shape[-1], len(self.probe_slots)
        step = self.spec.batch_size or max(items, 1)
        inputs = self.input_parts(features)  # [part slots, block items, hidden] each, in probe-slot order
        optimizer = self.optimizers()
        total = torch.zeros((), device=features.device)  # the sum over items of each slot's loss, summed over slots
        for start in range(0, items, step):
            target = targets[..., start:start + step]
            # the sum over slots of each slot's mean loss: every slot's gradient is the one it would get alone
            loss = self.probe.loss(tuple(part[:, start:start + step] for part in inputs), target)
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
            total += loss.detach() * target.shape[-1]
        # the step's loss as `train/loss` (pretraining's name) and the epoch's mean beside it (Lightning would call them
        # train/loss_step and train/loss_epoch)
        loss = total / max(items, 1) / slots
        self.log("train/loss", loss, batch_size=max(items, 1), on_step=True, on_epoch=False, prog_bar=True)
        self.log("train/loss_epoch", loss, batch_size=max(items, 1), on_step=False, on_epoch=True)

    def validation_step(self, batch, batch_idx: int) -> None:
        self._shared_step(batch, "val")

    def test_step(self, batch, batch_idx: int) -> None:
        self._shared_step(batch, "test")

    def on_validation_epoch_end(self) -> None:
        accuracy = self.val_accuracy.compute()
        self._log_accuracy("val", accuracy)
        self.val_accuracy.reset()
        if self.trainer.sanity_checking:
            return
        improved = accuracy.to(self.best_val_accuracy) > self.best_val_accuracy  # strictly: the earliest best
        self.best_val_accuracy[improved] = accuracy.to(self.best_val_accuracy)[improved]
        self.best_epoch[improved] = self.current_epoch
        with torch.no_grad():
            self.best_weight[improved] = self.probe.weight[improved]
            if self.probe.bias is not None:
                self.best_bias[improved] = self.probe.bias[improved]

    BEST = ("best_val_accuracy", "best_epoch", "best_weight", "best_bias")  # each slot's best validation so far

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """The best validation so far goes with the weights (its buffers are not the model's state): a run resumed
        with --ckpt_path tests each slot with the weights of its best epoch, before the stop or after it."""
        checkpoint["best_validation"] = {name: getattr(self, name) for name in self.BEST if hasattr(self, name)}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        for name, value in checkpoint.get("best_validation", {}).items():
            if name in self.BEST and hasattr(self, name) and getattr(self, name).shape == value.shape:
                getattr(self, name).copy_(value)

    def on_test_start(self) -> None:
        """Each slot is tested with its weights of the epoch of best validation accuracy (the final weights when
        no validation ran)."""
        chosen = self.best_epoch >= 0
        with torch.no_grad():
            self.probe.weight[chosen] = self.best_weight[chosen]
            if self.probe.bias is not None:
                self.probe.bias[chosen] = self.best_bias[chosen]

    def on_test_epoch_end(self) -> None:
        accuracy = self.test_accuracy.compute()
        self._log_accuracy("test", accuracy)
        self.results.update(accuracy=accuracy.cpu(), val_accuracy=self.best_val_accuracy.cpu(),
                            best_epoch=self.best_epoch.cpu())
        self.test_accuracy.reset()

    def _log_accuracy(self, stage: str, accuracy: Tensor) -> None:
        names = {"encoder": "accuracy", "random": "random_accuracy", "clipped": "clipped_accuracy",
                 "softdecay": "softdecay_accuracy", "control": "control_accuracy"}
        # one key pattern with the live statistics': <stage>_by_layer/layer_{l}/<statistic>
        self.log_dict({f"{stage}_by_layer/layer_{layer}/{names[kind]}": accuracy[i]
                       for i, (kind, layer) in enumerate(self.probe_slots)})

    def configure_optimizers(self):
        # fused: Adam's update in one pass over the weights (the same update as the default for-loop's)
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr, fused=self.device.type in ("cpu", "cuda"))

    # ---- results --------------------------------------------------------------------------------------------------
    def accuracy_of(self, kind: str, result: str = "accuracy") -> list:
        """Test accuracy (or "val_accuracy" / "best_epoch" of the tested weights) per layer of one kind of slot
        ("encoder", "random", "clipped", "softdecay", "control")."""
        values = self.results[result]
        return [values[i].item() for i, (k, _) in enumerate(self.probe_slots) if k == kind]

    def selection(self, kind: str = "encoder") -> list[dict]:
        """Per layer: the epoch whose weights were tested (best validation accuracy) and that accuracy."""
        epochs, accuracies = self.accuracy_of(kind, "best_epoch"), self.accuracy_of(kind, "val_accuracy")
        return [{"best_epoch": int(epoch) if epoch >= 0 else None, "val_accuracy": accuracy if epoch >= 0 else None}
                for epoch, accuracy in zip(epochs, accuracies)]

    def baselines(self) -> dict:
        spec = self.spec
        baselines = {"chance": spec.majority["chance"], "majority": spec.majority["majority"],
                     "majority_class": spec.classes[spec.majority["majority_class"]]}
        random = self.accuracy_of("random")
        if random:
            baselines["random_encoder"] = {
                "description": "the same probe on a randomly initialised encoder of the same architecture",
                "seed": spec.seed,
                "layers": [{"layer": layer, "accuracy": acc} for layer, acc in zip(spec.layers, random)],
            }
        control = self.accuracy_of("control")
        if control:
            baselines["control_task"] = {
                "description": "the same probe on the encoder's features, trained and tested on the control task's "
                               "labels; selectivity = task accuracy - control accuracy (Hewitt & Liang 2019)",
                **self.spec.control,
                "layers": [{"layer": layer, "accuracy": acc, "selectivity": sel} for layer, acc, sel in
                           zip(spec.layers, control, selectivity(self.accuracy_of("encoder"), control))],
            }
        return baselines

    def control_columns(self, index: int) -> dict:
        """The control task's accuracy and the selectivity of layer `index` (of spec.layers) for a report row ({}
        without a control task)."""
        control = self.accuracy_of("control")
        if not control:
            return {}
        return {"control_accuracy": control[index],
                "selectivity": selectivity(self.accuracy_of("encoder"), control)[index]}

    def accuracy_figure(self, title: str):
        series = {"encoder": self.accuracy_of("encoder")}
        for kind, name in (("clipped", "encoder, outliers clipped"), ("softdecay", "encoder, SoftDecay"),
                           ("random", "random-init encoder"), ("control", "control task (Hewitt & Liang)")):
            if self.accuracy_of(kind):
                series[name] = self.accuracy_of(kind)
        if self.accuracy_of("control"):
            series["selectivity (task - control)"] = selectivity(series["encoder"], self.accuracy_of("control"))
        return accuracy_by_layer_figure(self.spec.layers, series,
                                        {"majority": self.spec.majority["majority"],
                                         "chance": self.spec.majority["chance"]}, title=title)
