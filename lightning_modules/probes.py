"""Stacked linear probes over cached frozen-encoder features: the position probe and sentence classifiers.

    python probe.py fit --config configs/probe/position.yaml --model.encoder bert-base-uncased --data.source x.txt
    python probe.py fit --config configs/probe/sst2.yaml --model.encoder roberta-base

    model, dm = PositionProbe(), PositionDataModule(source="data/austen.txt")        # from Python
    trainer.fit(model, datamodule=dm); trainer.test(model, datamodule=dm)
    model.write_outputs("runs/probe")            # position_probe.json, contributions*.npy, figures

The probes of every layer (and of the random-encoder baseline, and for classifiers of the clipped features) are one
weight [slots, hidden, classes] applied with one batched matmul to features [slots, items, hidden]; the loss is the
sum over slots of each slot's mean cross-entropy, so every slot gets exactly the gradient it would get alone, and
each slot's initial weights come from its own seeded generator: training them together equals training each alone.
The modules size themselves in `setup` from the data module's FeatureSpec (classes and layers are known only once
the data is read). Layers are 0-indexed hidden states (0 = embedding output); dimensions are 0-indexed.
"""

from __future__ import annotations

import math

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from callbacks.figures import accuracy_by_layer_figure, heatmap_figure, heatmap_grid_figure, save_figure
from datamodules.io import staged_output, write_json
from datamodules.probing import FeatureSpec
from lightning_modules.encoder import short_name
from metrics.contributions import Contributions, LayerAccuracy, rank_dims

INDEXING = "0-indexed dimensions and positions; layer 0 = embedding output"
_INIT_KIND = {"encoder": 0, "clipped": 0, "random": 1}  # a clipped probe starts from its unclipped twin's weights


def pad_weight(weight: Tensor, multiple: int = 64) -> Tensor:
    """weight [slots, hidden, classes] → [slots, hidden, width]: with 64 classes or more the class dim is zero-padded
    to a multiple of `multiple` (CPU BLAS runs 300 columns slower than 320)."""
    slots, hidden, classes = weight.shape
    width = -(-classes // multiple) * multiple if classes >= multiple else classes
    if width == classes:
        return weight
    padded = weight.new_zeros(slots, hidden, width)
    padded[:, :, :classes] = weight
    return padded


def padded_logits(x: Tensor, weight: Tensor, bias: Tensor | None = None, classes: int | None = None) -> Tensor:
    """x [slots, items, hidden] @ weight [slots, hidden, classes] (+ bias [slots, classes]) → [slots, items, width].

    The weight is padded by `pad_weight` (or already is, with `classes` its true number of classes) and the padding
    columns of the logits are -inf, so a softmax over the padded logits is the true one.
    """
    padded = pad_weight(weight) if classes is None else weight
    classes = weight.shape[2] if classes is None else classes
    logits = torch.bmm(x.to(padded.dtype), padded)
    if bias is not None:
        logits[:, :, :classes] += bias.unsqueeze(1)
    logits[:, :, classes:] = float("-inf")
    return logits


class StackedLinearCrossEntropy(torch.autograd.Function):
    """Sum over slots of each slot's mean cross-entropy of x @ weight (+ bias), with the gradient formed in the
    forward pass: chunk by chunk of items, the softmax is taken once, turned into the logits' gradient in place
    (softmax - one-hot) and folded into the weight (and bias) gradient; the features' gradient is never formed.
    Nothing of size [slots, items, classes] is kept for backward, and on CPU the chunks (`chunk_elements` logits,
    4 MiB) reuse the same memory where whole-batch logits would fault in fresh pages every step. Equal to
    F.cross_entropy through autograd (tested), faster on CPU. The returned loss saturates at -log(smallest float)
    for a token whose gold probability underflows; the gradient is exact."""

    # logits per chunk on CPU; None: the whole batch in one chunk, as always on GPUs (their allocator reuses memory)
    chunk_elements: int | None = 2 ** 20

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor) -> Tensor:
        slots, items, classes = x.shape[0], x.shape[1], weight.shape[2]
        padded = pad_weight(weight)  # [slots, hidden, width]
        width = padded.shape[2]
        chunk_elements = StackedLinearCrossEntropy.chunk_elements
        one_piece = x.is_cuda or chunk_elements is None
        rows = max(items, 1) if one_piece else max(1, chunk_elements // (slots * width))  # an empty batch: no chunk
        grad_weight = torch.zeros(padded.shape, dtype=torch.float32, device=x.device)
        grad_bias = torch.zeros(slots, width, device=x.device) if bias is not None else None
        loss = torch.zeros((), device=x.device)
        for start in range(0, items, rows):
            chunk = x[:, start:start + rows].to(padded.dtype)  # [slots, rows, hidden]
            probs = torch.softmax(padded_logits(chunk, padded, bias, classes), -1).float()  # [slots, rows, width]
            index = target[start:start + rows].view(1, -1, 1).expand(slots, -1, 1)
            loss -= probs.gather(2, index).clamp_min(torch.finfo(probs.dtype).tiny).log().sum()
            probs.scatter_add_(2, index, torch.full(index.shape, -1.0, device=probs.device))  # d loss / d logits
            with torch.autocast(x.device.type, enabled=False):  # the gradient in float32, as autograd's would be
                grad_weight.baddbmm_(chunk.float().transpose(1, 2), probs)
            if grad_bias is not None:
                grad_bias += probs.sum(1)
        scale = 1.0 / max(items, 1)  # each slot's mean over items
        ctx.save_for_backward(grad_weight[:, :, :classes] * scale,
                              grad_bias[:, :classes] * scale if grad_bias is not None else None)
        ctx.dtype = weight.dtype
        return loss * scale

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad_weight, grad_bias = ctx.saved_tensors
        return (None, (grad_weight * grad).to(ctx.dtype),
                (grad_bias * grad).to(ctx.dtype) if grad_bias is not None else None, None)


def slot_seed(seed: int, kind: str, layer: int) -> int:
    """The initial-weight seed of one probe: the same whichever other probes train beside it."""
    return (seed * 1_000_003 + _INIT_KIND[kind] * 10_007 + layer) % (2 ** 63)


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
        self.build(spec)

    def slots(self, spec: FeatureSpec) -> list[tuple[str, int]]:
        return list(spec.slots)

    def build(self, spec: FeatureSpec) -> None:
        """Create the stacked weights (each slot from its own seeded generator) and the metrics."""
        self.spec, self.probe_slots = spec, self.slots(spec)
        hidden, classes = spec.hidden_size, spec.num_classes
        bound = 1.0 / math.sqrt(hidden)  # nn.Linear's default initialisation range
        weights, biases = [], []
        for kind, layer in self.probe_slots:
            generator = torch.Generator().manual_seed(slot_seed(self.hparams.seed, kind, layer))
            weights.append(torch.empty(hidden, classes).uniform_(-bound, bound, generator=generator))
            biases.append(torch.empty(classes).uniform_(-bound, bound, generator=generator))
        self.weight = nn.Parameter(torch.stack(weights))  # [slots, hidden, classes]
        self.bias = nn.Parameter(torch.stack(biases)) if self.use_bias else None  # [slots, classes]
        self.val_accuracy = LayerAccuracy(len(self.probe_slots))
        self.test_accuracy = LayerAccuracy(len(self.probe_slots))

    def inputs(self, features: Tensor) -> Tensor:
        """The features each slot's probe reads: [slots, items, hidden]."""
        return features

    def forward(self, features: Tensor) -> Tensor:
        """features [data slots, items, hidden] → logits [probe slots, items, classes]."""
        return padded_logits(self.inputs(features), self.weight, self.bias)[:, :, :self.weight.shape[2]]

    # ---- steps ----------------------------------------------------------------------------------------------------
    def _shared_step(self, batch: tuple[Tensor, Tensor], stage: str) -> Tensor:
        features, labels = batch  # [slots, items, hidden], [items]
        items, slots = labels.shape[0], len(self.probe_slots)
        # the sum over slots of each slot's mean loss: every slot's gradient is the one it would get alone
        if stage == "train":
            loss = StackedLinearCrossEntropy.apply(self.inputs(features), self.weight, self.bias, labels)
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
        """encoder: recorded in the report (probe.py links it to --data.encoder); top_k: contributing dims listed."""
        super().__init__()
        self.save_hyperparameters()

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
        zeroed; encoder: recorded in the report (probe.py links it to --data.encoder)."""
        super().__init__()
        self.save_hyperparameters()

    def slots(self, spec: FeatureSpec) -> list[tuple[str, int]]:
        clipped = [("clipped", layer) for layer in spec.layers] if self.hparams.clip else []
        return list(spec.slots) + clipped

    def build(self, spec: FeatureSpec) -> None:
        super().build(spec)
        keep = torch.ones(spec.hidden_size)
        keep[spec.outlier_dims] = 0
        self.register_buffer("keep", keep, persistent=False)  # [hidden]: 0 on the clipped dims

    def inputs(self, features: Tensor) -> Tensor:
        if not self.hparams.clip:
            return features
        encoder_slots = self.spec.encoder_slots
        return torch.cat([features, features[:encoder_slots] * self.keep])

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
