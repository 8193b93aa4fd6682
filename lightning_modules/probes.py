"""Stacked linear probes over cached frozen-encoder features: the position probe and sentence classifiers.

    python probe.py fit --config configs/probe/position.yaml --model.encoder bert-base-uncased --data.source x.txt
    python probe.py fit --config configs/probe/sst2.yaml --model.encoder roberta-base

    model, dm = PositionProbe(), PositionDataModule(source="data/austen.txt")        # from Python
    trainer.fit(model, datamodule=dm); trainer.test(model, datamodule=dm)
    model.write_outputs("runs/probe")            # position_probe.json, contributions*.npy, figures

The probes of every layer (and of the random-encoder baseline, and for classifiers of the clipped features) are one
StackedProbe (lightning_modules/stacked.py) applied to features [slots, items, hidden]: training them together
equals training each alone. The modules size themselves in `setup` from the data module's FeatureSpec (classes and
layers are known only once the data is read). Layers are 0-indexed hidden states (0 = embedding output); dimensions
are 0-indexed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import Tensor

from core.errors import UserError
from core.figures import accuracy_by_layer_figure, heatmap_figure, heatmap_grid_figure, save_figure
from core.models import short_name
from core.output import staged_output, write_json
from lightning_modules.stacked import StackedProbe
from metrics.contributions import Contributions, LayerAccuracy, rank_dims
from metrics.outliers import LayerOutliers
from metrics.transforms import keep_mask, zero_dims

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
    counts: dict = field(default_factory=dict)  # per split: sentences, items, and more
    majority: dict = field(default_factory=dict)  # majority and chance baselines
    data: dict = field(default_factory=dict)  # source, max_length, special tokens, ... for the report
    seed: int = 0

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
        self.spec: FeatureSpec | None = None
        self.probe_slots: list[tuple[str, int]] = []
        self.results: dict[str, Tensor] = {}

    # ---- construction ---------------------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        if self.spec is not None:
            return
        spec = getattr(self.trainer.datamodule, "spec", None) if self.trainer.datamodule is not None else None
        if spec is None:
            raise RuntimeError(f"{type(self).__name__} needs a probing data module (datamodules/probing.py)")
        encoder = self.hparams.encoder
        if encoder is not None and str(encoder) != spec.encoder:
            raise UserError(f"the probe is for encoder {encoder} but the data module's features are of {spec.encoder}")
        self.build(spec)

    def slots(self, spec: FeatureSpec) -> list[tuple[str, int]]:
        return list(spec.slots)

    def build(self, spec: FeatureSpec) -> None:
        """Create the stacked probes (each slot from its own seeded generator) and the metrics."""
        self.spec, self.probe_slots = spec, self.slots(spec)
        self.probe = StackedProbe(self.probe_slots, spec.hidden_size, spec.num_classes, self.hparams.seed,
                                  bias=self.use_bias)
        self.val_accuracy = LayerAccuracy(len(self.probe_slots))
        self.test_accuracy = LayerAccuracy(len(self.probe_slots))

    @property
    def weight(self) -> Tensor:
        """[slots, hidden, classes]."""
        return self.probe.weight

    @property
    def bias(self) -> Tensor | None:
        """[slots, classes] (None for a bias-free probe)."""
        return self.probe.bias

    def inputs(self, features: Tensor) -> Tensor:
        """The features each slot's probe reads: [slots, items, hidden]."""
        return features

    def forward(self, features: Tensor) -> Tensor:
        """features [data slots, items, hidden] → logits [probe slots, items, classes]."""
        return self.probe(self.inputs(features))

    # ---- steps ----------------------------------------------------------------------------------------------------
    def _shared_step(self, batch: tuple[Tensor, Tensor], stage: str) -> Tensor:
        features, labels = batch  # [slots, items, hidden], [items]
        items, slots = labels.shape[0], len(self.probe_slots)
        # the sum over slots of each slot's mean loss: every slot's gradient is the one it would get alone
        if stage == "train":
            loss = self.probe.loss(self.inputs(features), labels)
        else:
            logits = self(features)  # [probe slots, items, classes]
            loss = F.cross_entropy(logits.flatten(0, 1), labels.repeat(slots), reduction="sum") / max(items, 1)
            getattr(self, f"{stage}_accuracy").update(logits, labels)
        self.log(f"{stage}/loss", loss.detach() / slots, batch_size=max(items, 1), on_step=stage == "train",
                 on_epoch=True, prog_bar=stage == "train")
        return loss

    def training_step(self, batch, batch_idx: int) -> Tensor:
        return self._shared_step(batch, "train")

    def validation_step(self, batch, batch_idx: int) -> None:
        self._shared_step(batch, "val")

    def test_step(self, batch, batch_idx: int) -> None:
        self._shared_step(batch, "test")

    def on_validation_epoch_end(self) -> None:
        self._log_accuracy("val", self.val_accuracy.compute())
        self.val_accuracy.reset()

    def on_test_epoch_end(self) -> None:
        accuracy = self.test_accuracy.compute()
        self._log_accuracy("test", accuracy)
        self.results["accuracy"] = accuracy.cpu()
        self.test_accuracy.reset()

    def _log_accuracy(self, stage: str, accuracy: Tensor) -> None:
        names = {"encoder": "accuracy", "random": "random_accuracy", "clipped": "clipped_accuracy"}
        self.log_dict({f"{stage}/{names[kind]}_layer{layer}": accuracy[i]
                       for i, (kind, layer) in enumerate(self.probe_slots)})

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)

    # ---- results --------------------------------------------------------------------------------------------------
    def accuracy_of(self, kind: str) -> list[float]:
        """Test accuracy per layer of one kind of slot ("encoder", "random", "clipped")."""
        accuracy = self.results["accuracy"]
        return [float(accuracy[i]) for i, (k, _) in enumerate(self.probe_slots) if k == kind]

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
        return baselines

    def accuracy_figure(self, title: str):
        series = {"encoder": self.accuracy_of("encoder")}
        for kind, name in (("clipped", "encoder, outliers clipped"), ("random", "random-init encoder")):
            if self.accuracy_of(kind):
                series[name] = self.accuracy_of(kind)
        return accuracy_by_layer_figure(self.spec.layers, series,
                                        {"majority": self.spec.majority["majority"],
                                         "chance": self.spec.majority["chance"]}, title=title)


class PositionProbe(LinearProbes):
    """Bias-free linear probes hidden → positions on every layer's token vectors, with contribution vectors."""

    use_bias = False

    def __init__(self, encoder: str | None = None, lr: float = 1e-3, top_k: int = 10, seed: int = 0) -> None:
        """encoder: the encoder whose features are probed (probe.py links it to --data.encoder; checked against the
        data module's at setup); top_k: contributing dims listed."""
        super().__init__()
        self.save_hyperparameters()
        check_learning_rate(lr)

    def build(self, spec: FeatureSpec) -> None:
        super().build(spec)
        self.contributions = Contributions(spec.encoder_slots, spec.hidden_size, spec.num_classes)

    def test_step(self, batch, batch_idx: int) -> None:
        self._shared_step(batch, "test")
        features, positions = batch
        encoder_slots = self.spec.encoder_slots  # the encoder's layers come first
        self.contributions.update(features[:encoder_slots], self.weight[:encoder_slots], positions)

    def on_test_epoch_end(self) -> None:
        super().on_test_epoch_end()
        result = self.contributions.compute()
        self.results.update(contributions=result.mean.float().cpu(),
                            contributions_by_position=result.by_position.float().cpu(),
                            position_counts=result.position_counts.cpu())
        self.contributions.reset()

    def report(self) -> dict:
        """position_probe.json: per layer the accuracy, top contributing dims, and each outlier dim's rank."""
        spec, top_k = self.spec, self.hparams.top_k
        layers = []
        for i, (layer, accuracy) in enumerate(zip(spec.layers, self.accuracy_of("encoder"))):
            ranking = rank_dims(self.results["contributions"][i], spec.outlier_dims, top_k)
            layers.append({"layer": layer, "accuracy": accuracy, "top_contribution_dims": ranking["top_dims"],
                           "mean_contribution": ranking["mean_contribution"],
                           "outlier_dims": {str(d): v for d, v in ranking["dims"].items()}})
        return {
            "encoder": spec.encoder,
            **spec.data,
            "seed": spec.seed,
            "indexing": INDEXING,
            "batch": "batch_size sentences, all their tokens",
            "splits": spec.counts,
            "outlier_dims": spec.outlier_dims,
            "outlier_dims_source": spec.outlier_source,
            "outlier_layers": {str(lay.layer): lay.outlier_dims for lay in spec.outlier_layers},
            "contribution": "c(i) = |w_i * v_i|, w the probe's weight row of the gold position, mean over test tokens",
            "layers": layers,
            "baselines": self.baselines(),
        }

    def write_outputs(self, output_dir) -> dict:
        """position_probe.json, contributions.npy [layers, hidden], contributions_by_position.npy
        [layers, positions, hidden], accuracy_by_layer.png, contributions_by_layer.png (layer x dimension) and
        contributions_by_position.png (position x dimension, a panel per layer); all or nothing."""
        report, spec = self.report(), self.spec
        name = short_name(spec.encoder)
        seen = int(self.results["position_counts"].nonzero().max()) + 1 if self.results["position_counts"].any() else 1
        with staged_output(output_dir) as stage:
            write_json(stage / "position_probe.json", report)
            np.save(stage / "contributions.npy", self.results["contributions"].numpy())
            np.save(stage / "contributions_by_position.npy", self.results["contributions_by_position"].numpy())
            save_figure(self.accuracy_figure(f"position probe accuracy: {name}"), stage / "accuracy_by_layer.png")
            save_figure(heatmap_figure(self.results["contributions"], "dimension (0-indexed)", "layer",
                                       f"mean contribution |w_i v_i| per layer: {name}"),
                        stage / "contributions_by_layer.png")
            save_figure(heatmap_grid_figure(self.results["contributions_by_position"][:, :seen],
                                            [f"layer {layer}" for layer in spec.layers], "dimension (0-indexed)",
                                            "position", f"contribution |w_i v_i| by position: {name}"),
                        stage / "contributions_by_position.png")
        return report


class SentenceClassifier(LinearProbes):
    """Linear classifiers hidden → classes on every layer's mean-pooled vectors, with and without the outlier
    dimensions clipped (zeroed), all trained in one run."""

    use_bias = True

    def __init__(self, encoder: str | None = None, lr: float = 1e-3, clip: bool = True, seed: int = 0) -> None:
        """clip: also train classifiers on the features with the outlier dims (detected or --data.outlier_dims)
        zeroed; encoder: the encoder whose features are classified (probe.py links it to --data.encoder; checked
        against the data module's at setup)."""
        super().__init__()
        self.save_hyperparameters()
        check_learning_rate(lr)

    def slots(self, spec: FeatureSpec) -> list[tuple[str, int]]:
        clipped = [("clipped", layer) for layer in spec.layers] if self.hparams.clip else []
        return list(spec.slots) + clipped

    def build(self, spec: FeatureSpec) -> None:
        super().build(spec)
        slots = spec.encoder_slots  # the encoder's slots, the outlier dims zeroed in each
        self.register_buffer("keep", keep_mask(dict.fromkeys(range(slots), spec.outlier_dims), slots, spec.hidden_size),
                             persistent=False)  # [slots, hidden]

    def inputs(self, features: Tensor) -> Tensor:
        if not self.hparams.clip:
            return features
        return torch.cat([features, zero_dims(features[:self.spec.encoder_slots], self.keep)])

    def report(self) -> dict:
        spec = self.spec
        clipped = self.accuracy_of("clipped") or [None] * len(spec.layers)
        baselines = self.baselines()
        return {
            "encoder": spec.encoder,
            **spec.data,
            "seed": spec.seed,
            "indexing": INDEXING,
            "pooling": "mean over tokens, padding excluded",
            "classes": spec.classes,
            "splits": spec.counts,
            "majority_baseline": baselines["majority"],
            "chance_baseline": baselines["chance"],
            "clipped_dims": spec.outlier_dims if self.hparams.clip else None,
            "clipped_dims_source": spec.outlier_source if self.hparams.clip else None,
            "layers": [{"layer": layer, "accuracy": accuracy, "accuracy_clipped": clip}
                       for layer, accuracy, clip in zip(spec.layers, self.accuracy_of("encoder"), clipped)],
            "baselines": baselines,
        }

    def write_outputs(self, output_dir) -> dict:
        """classifier.json and accuracy_by_layer.png; all or nothing."""
        report = self.report()
        with staged_output(output_dir) as stage:
            write_json(stage / "classifier.json", report)
            save_figure(self.accuracy_figure(f"sentence classifier accuracy: {short_name(self.spec.encoder)}"),
                        stage / "accuracy_by_layer.png")
        return report
