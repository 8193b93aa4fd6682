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
from core.figures import (
    accuracy_by_layer_figure,
    heatmap_figure,
    heatmap_grid_figure,
    layer_panels_figure,
    save_figure,
)
from core.models import short_name
from core.output import staged_output, write_json
from lightning_modules.stacked import StackedProbe
from metrics.contributions import Contributions, LayerAccuracy, rank_dims
from metrics.outliers import LayerOutliers
from metrics.transforms import clipped_dims, keep_mask, parse_clip, per_layer_report, zero_dims

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
    batch_size: int = 0  # items per optimizer step; a training batch of the loader holds several (0: one)
    num_hidden_states: int = 0  # the encoder's hidden states (layers 0..L), whichever are cached

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
                                  bias=self.use_bias, pad=True)  # stored padded: no padded copy per step
        self.val_accuracy = LayerAccuracy(len(self.probe_slots))
        self.test_accuracy = LayerAccuracy(len(self.probe_slots))
        slots = len(self.probe_slots)  # each slot's epoch of best validation accuracy and its weights (tested)
        self.register_buffer("best_val_accuracy", torch.full((slots,), -1.0, dtype=torch.float64), persistent=False)
        self.register_buffer("best_epoch", torch.full((slots,), -1, dtype=torch.long), persistent=False)
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

    def inputs(self, features: Tensor) -> Tensor:
        """The features each slot's probe reads: [slots, items, hidden]."""
        return features

    def forward(self, features: Tensor) -> Tensor:
        """features [data slots, items, hidden] → logits [probe slots, items, classes]."""
        return self.probe(self.inputs(features))

    # ---- steps ----------------------------------------------------------------------------------------------------
    def _shared_step(self, batch: tuple[Tensor, Tensor], stage: str) -> None:
        features, labels = batch  # [slots, items, hidden], [items]
        items, slots = labels.shape[0], len(self.probe_slots)
        logits = self(features)  # [probe slots, items, classes]
        loss = F.cross_entropy(logits.flatten(0, 1), labels.repeat(slots), reduction="sum") / max(items, 1)
        getattr(self, f"{stage}_accuracy").update(logits, labels)
        self.log(f"{stage}/loss", loss.detach() / slots, batch_size=max(items, 1), on_epoch=True)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        """A block of consecutive batches of `spec.batch_size` items (datamodules/probing.py): one Adam step per
        batch, in order, as if each were its own trainer step (manual optimisation: fewer trainer round trips)."""
        features, labels = batch  # [slots, block items, hidden], [block items]
        items, slots = labels.shape[0], len(self.probe_slots)
        step = self.spec.batch_size or max(items, 1)
        inputs = self.inputs(features)  # [probe slots, block items, hidden]
        optimizer = self.optimizers()
        total = torch.zeros((), device=features.device)  # the sum over items of each slot's loss, summed over slots
        for start in range(0, items, step):
            target = labels[start:start + step]
            # the sum over slots of each slot's mean loss: every slot's gradient is the one it would get alone
            loss = self.probe.loss(inputs[:, start:start + step], target)
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
            total += loss.detach() * target.shape[0]
        self.log("train/loss", total / max(items, 1) / slots, batch_size=max(items, 1), on_step=True, on_epoch=True,
                 prog_bar=True)

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
                 "softdecay": "softdecay_accuracy"}
        self.log_dict({f"{stage}/{names[kind]}_layer{layer}": accuracy[i]
                       for i, (kind, layer) in enumerate(self.probe_slots)})

    def configure_optimizers(self):
        # fused: Adam's update in one pass over the weights (the same update as the default for-loop's)
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr, fused=self.device.type in ("cpu", "cuda"))

    # ---- results --------------------------------------------------------------------------------------------------
    def accuracy_of(self, kind: str, result: str = "accuracy") -> list:
        """Test accuracy (or "val_accuracy" / "best_epoch" of the tested weights) per layer of one kind of slot
        ("encoder", "random", "clipped", "softdecay")."""
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
        return baselines

    def accuracy_figure(self, title: str):
        series = {"encoder": self.accuracy_of("encoder")}
        for kind, name in (("clipped", "encoder, outliers clipped"), ("softdecay", "encoder, SoftDecay"),
                           ("random", "random-init encoder")):
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
        for i, (layer, accuracy, chosen) in enumerate(zip(spec.layers, self.accuracy_of("encoder"), self.selection())):
            ranking = rank_dims(self.results["contributions"][i], spec.outlier_dims, top_k)
            layers.append({"layer": layer, "accuracy": accuracy, **chosen, "top_contribution_dims": ranking["top_dims"],
                           "mean_contribution": ranking["mean_contribution"],
                           "outlier_dims": {str(d): v for d, v in ranking["dims"].items()}})
        return {
            "encoder": spec.encoder,
            **spec.data,
            "seed": spec.seed,
            "indexing": INDEXING,
            "batch": "batch_size token vectors drawn across sentences, shuffled each epoch; each layer tested with its "
                     "weights of the epoch of best validation accuracy",
            "splits": spec.counts,
            "outlier_dims": spec.outlier_dims,
            "outlier_dims_source": spec.outlier_source,
            "outlier_layers": {str(lay.layer): lay.outlier_dims for lay in spec.outlier_layers},
            "contribution": "c(i) = |w_i * v_i|, w the probe's weight row of the gold position, mean over test tokens",
            "layers": layers,
            "baselines": self.baselines(),
        }

    def outlier_figure(self, title: str):
        """The paper's Figure 5b/5c: each outlier neuron's contribution against the mean contribution, per layer."""
        contributions, spec = self.results["contributions"], self.spec  # [layers, hidden]
        series = {f"dim {d}": contributions[:, d].tolist() for d in spec.outlier_dims[:8]}
        if series:  # else the panel says that no outlier dimension was found
            series["mean over neurons"] = contributions.mean(1).tolist()
        return layer_panels_figure([{"title": "contribution c(i) = |w_i v_i| of the outlier neurons", "ylabel":
                                     "mean contribution", "layers": spec.layers, "series": series,
                                     "empty": "no outlier dimension was " + ("given" if spec.outlier_source == "given"
                                              else "detected in this encoder on the probe's sentences")}], title=title,
                                   columns=1)

    def write_outputs(self, output_dir) -> dict:
        """position_probe.json, contributions.npy [layers, hidden], contributions_by_position.npy
        [layers, positions, hidden], accuracy_by_layer.png, contributions_by_layer.png (layer x dimension),
        contributions_by_position.png (position x dimension, a panel per layer) and outlier_contributions.png (each
        outlier neuron's contribution against the mean, per layer: Figure 5b/5c); all or nothing."""
        report, spec = self.report(), self.spec
        name = short_name(spec.encoder)
        seen = int(self.results["position_counts"].nonzero().max()) + 1 if self.results["position_counts"].any() else 1
        with staged_output(output_dir) as stage:
            write_json(stage / "position_probe.json", report)
            np.save(stage / "contributions.npy", self.results["contributions"].numpy())
            np.save(stage / "contributions_by_position.npy", self.results["contributions_by_position"].numpy())
            save_figure(self.accuracy_figure(f"position probe accuracy: {name}"), stage / "accuracy_by_layer.png")
            save_figure(heatmap_figure(self.results["contributions"], "dimension (0-indexed)", "layer",
                                       f"mean contribution |w_i v_i| per layer: {name}",
                                       colorbar="mean contribution |w_i v_i|", rows=spec.layers),
                        stage / "contributions_by_layer.png")
            save_figure(heatmap_grid_figure(self.results["contributions_by_position"][:, :seen],
                                            [f"layer {layer}" for layer in spec.layers], "dimension (0-indexed)",
                                            "position", f"contribution |w_i v_i| by position: {name}",
                                            colorbar="mean contribution |w_i v_i|"),
                        stage / "contributions_by_position.png")
            save_figure(self.outlier_figure(f"outlier neurons vs the mean contribution: {name} (outlier dims "
                                            f"{spec.outlier_dims or 'none'})"), stage / "outlier_contributions.png")
        return report


class SentenceClassifier(LinearProbes):
    """Linear classifiers hidden → classes on every layer's mean-pooled vectors (bias-free, W ∈ R^{hidden×classes} as
    the paper's §4.4, unless `bias`), with and without the outlier dimensions clipped (zeroed), all in one run."""

    def __init__(self, encoder: str | None = None, lr: float = 1e-3, clip: str = "auto", bias: bool = False,
                 seed: int = 0) -> None:
        """clip: also train classifiers on clipped features, --clip as in analyze.py (metrics.transforms.parse_clip):
        "auto" (the persistent outlier dims, detected on the training split or --data.outlier_dims, in every
        non-input layer; for models deeper than 12 layers each layer's own detected outliers), "per-layer", "none" (no clipped classifiers), dims, or layers:dims; bias: add a bias (ours;
        the paper's classifiers have none); encoder: the encoder whose features are classified (probe.py links it to
        --data.encoder; checked against the data module's at setup)."""
        super().__init__()
        self.save_hyperparameters()
        check_learning_rate(lr)
        self.clip_request = parse_clip(clip)
        self.use_bias = bias
        self.clipped: dict[int, list[int]] = {}
        self.clip_rule = ""

    def slots(self, spec: FeatureSpec) -> list[tuple[str, int]]:
        clipped = [("clipped", layer) for layer in spec.layers] if self.clip_request.mode != "none" else []
        return list(spec.slots) + clipped

    def build(self, spec: FeatureSpec) -> None:
        super().build(spec)
        request = self.clip_request
        if request.mode == "auto" and spec.outlier_source == "given":  # the given dims, in every non-input layer
            request = parse_clip(",".join(map(str, spec.outlier_dims)) or "none")
        num_layers = spec.num_hidden_states or max(spec.layers) + 1
        self.clipped = request.resolve(spec.outlier_layers, num_layers, spec.hidden_size)
        self.clip_rule = request.rule(num_layers)
        slots = spec.encoder_slots  # the encoder's cached layers, each with that layer's clipped dims zeroed
        spec_by_slot = {i: self.clipped.get(layer, []) for i, layer in enumerate(spec.layers)}
        self.register_buffer("keep", keep_mask(spec_by_slot, slots, spec.hidden_size), persistent=False)

    def inputs(self, features: Tensor) -> Tensor:
        if self.clip_request.mode == "none":
            return features
        return torch.cat([features, zero_dims(features[:self.spec.encoder_slots], self.keep)])

    def report(self) -> dict:
        spec = self.spec
        clipped = self.accuracy_of("clipped") or [None] * len(spec.layers)
        softdecay = self.accuracy_of("softdecay")  # with --data.normalize softdecay: pooled from SoftDecay's states
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
            "bias": self.use_bias,
            "clip": self.clip_request.text,
            "clip_rule": self.clip_rule,
            "clipped_dims": clipped_dims(self.clipped) if self.clip_request.mode != "none" else None,
            "clipped_dims_per_layer": per_layer_report(self.clipped) if self.clip_request.mode != "none" else None,
            "clipped_dims_source": spec.outlier_source if self.clip_request.needs_outliers else "given",
            "layers": [{"layer": layer, "accuracy": accuracy, "accuracy_clipped": clip, **chosen,
                        **({"accuracy_softdecay": softdecay[i]} if softdecay else {})}
                       for i, (layer, accuracy, clip, chosen) in enumerate(zip(spec.layers, self.accuracy_of("encoder"),
                                                                               clipped, self.selection()))],
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
