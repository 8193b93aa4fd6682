"""Stacked linear probes over cached frozen-encoder features: the position probe and sentence classifiers.

    python probe.py fit --config configs/probe/position.yaml --model.encoder bert-base-uncased --data.source x.txt
    python probe.py fit --config configs/probe/sst2.yaml --model.encoder roberta-base

    model, dm = PositionProbe(), PositionDataModule(source="core/corpus/austen.txt")        # from Python
    trainer.fit(model, datamodule=dm); trainer.test(model, datamodule=dm)
    model.write_outputs("runs/probe")            # position_probe.json, contributions*.npy, figures

The probes of every layer (and of the random-encoder baseline, the control task, and for classifiers of the clipped
features) are one StackedProbe applied to features [slots, items, hidden] (lightning_modules/linear_probes.py, the
machinery they share): training them together equals training each alone. The modules size themselves in `setup` from the data module's FeatureSpec (classes and
layers are known only once the data is read). Layers are 0-indexed hidden states (0 = embedding output); dimensions
are 0-indexed.
"""

from __future__ import annotations

import numpy as np
from torch import Tensor

from core.figures import heatmap_figure, heatmap_grid_figure, layer_panels_figure, save_figure
from core.models import short_name
from core.output import staged_output, write_json
from lightning_modules.linear_probes import INDEXING, FeatureSpec, LinearProbes, check_learning_rate
from metrics.contributions import Contributions, rank_dims
from metrics.transforms import clipped_dims, keep_mask, parse_clip, per_layer_report, zero_dims


class PositionProbe(LinearProbes):
    """Bias-free linear probes hidden → positions on every layer's token vectors, with contribution vectors.

    Args:
        encoder: the encoder whose features are probed: a hub id (org/name@REVISION pins one), a local directory or
            this project's export (None: the packaged MiniLM); probe.py links it to --data.encoder, and setup checks it against the data module's.
        lr: the probes' Adam learning rate (default 1e-3: ours; the paper's §3 names Adam, batches of 128, 10 epochs).
        top_k: contributing dims listed per layer in the report, largest contribution first.
        seed: the probes' initialisation (probe.py links it to --seed_everything).
        allow_random_weights: probe an encoder whose checkpoint lacks some of its weights, randomly initialised then
            (default False: refused); probe.py links it to --data.allow_random_weights.
    """

    use_bias = False

    def __init__(self, encoder: str | None = None, lr: float = 1e-3, top_k: int = 10, seed: int = 0,
                 allow_random_weights: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_learning_rate(lr)

    def build(self, spec: FeatureSpec) -> None:
        super().build(spec)
        self.contributions = Contributions(spec.encoder_slots, spec.hidden_size, spec.num_classes)

    def test_step(self, batch, batch_idx: int) -> None:
        self._shared_step(batch, "test")
        features, positions = batch[0], batch[1]
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
        """position_probe.json: per layer the accuracy, top contributing dims, and each outlier dim's rank, each rank with
        its ties (metrics.contributions.rank_dims)."""
        spec, top_k = self.spec, self.hparams.top_k
        layers = []
        for i, (layer, accuracy, chosen) in enumerate(zip(spec.layers, self.accuracy_of("encoder"), self.selection())):
            ranking = rank_dims(self.results["contributions"][i], spec.outlier_dims, top_k)
            layers.append({"layer": layer, "accuracy": accuracy, **self.control_columns(i), **chosen,
                           "top_contribution_dims": ranking["top_dims"],
                           "top_contribution_ranks": ranking["top_ranks"], "top_contribution_ties": ranking["top_ties"],
                           "mean_contribution": ranking["mean_contribution"],
                           "outlier_dims": {str(d): v for d, v in ranking["dims"].items()}})
        return {
            "encoder": spec.encoder,
            "encoder_commit": spec.encoder_commit,
            **spec.data,
            "seed": spec.seed,
            "indexing": INDEXING,
            "batch": "batch_size token vectors drawn across sentences, shuffled each epoch; each layer tested with its "
                     "weights of the epoch of best validation accuracy",
            "splits": spec.counts,
            "outlier_dims": spec.outlier_dims,
            "outlier_dims_source": spec.outlier_source,
            "outlier_layers": {str(lay.layer): lay.outlier_dims for lay in spec.outlier_layers},
            "outlier_chance_bound": spec.outlier_chance_bound,
            "outlier_chance_warning": spec.outlier_chance_warning,  # probe.py prints it once
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
                                       colorbar="mean contribution |w_i v_i|", rows=spec.layers,
                                       marked=spec.outlier_dims),
                        stage / "contributions_by_layer.png")
            save_figure(heatmap_grid_figure(self.results["contributions_by_position"][:, :seen],
                                            [f"layer {layer}" for layer in spec.layers], "dimension (0-indexed)",
                                            "position", f"contribution |w_i v_i| by position: {name}",
                                            colorbar="mean contribution |w_i v_i|", marked=spec.outlier_dims),
                        stage / "contributions_by_position.png")
            save_figure(self.outlier_figure(f"outlier neurons vs the mean contribution: {name} (outlier dims "
                                            f"{spec.outlier_dims or 'none'})"), stage / "outlier_contributions.png")
        return report


class SentenceClassifier(LinearProbes):
    """Linear classifiers hidden → classes on every layer's mean-pooled vectors (bias-free, W ∈ R^{hidden×classes} as
    the paper's §4.4, unless `bias`), with and without the outlier dimensions clipped (zeroed), all in one run.

    Args:
        encoder: the encoder whose features are classified: a hub id (org/name@REVISION pins one), a local directory
            or this project's export (None: the packaged MiniLM); probe.py links it to --data.encoder, and setup checks it against the data
            module's.
        lr: the classifiers' Adam learning rate (default 1e-3: ours; the paper's §4.4 names Adam and 10 epochs).
        clip: also train classifiers on clipped features, --clip as in analyze.py (metrics.transforms.parse_clip):
            auto (default: the persistent outlier dims, detected on the training split or --data.outlier_dims, in
            every non-input layer; for models deeper than 12 layers, a threshold of ours, each layer's own detected
            outliers), per-layer, none (no clipped classifiers), dims, or layers:dims.
        bias: add a bias (ours; default False: the paper's classifiers have none).
        seed: the classifiers' initialisation (probe.py links it to --seed_everything).
        allow_random_weights: classify with an encoder whose checkpoint lacks some of its weights, randomly
            initialised then (default False: refused); probe.py links it to --data.allow_random_weights.
    """

    def __init__(self, encoder: str | None = None, lr: float = 1e-3, clip: str = "auto", bias: bool = False,
                 seed: int = 0, allow_random_weights: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_learning_rate(lr)
        self.clip_request = parse_clip(clip)
        self.use_bias = bias
        self.clipped: dict[int, list[int]] = {}
        self.clip_rule = ""

    def extra_slots(self, spec: FeatureSpec) -> list[tuple[str, int]]:
        return [("clipped", layer) for layer in spec.layers] if self.clip_request.mode != "none" else []

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

    def extra_inputs(self, features: Tensor) -> list[Tensor]:
        if self.clip_request.mode == "none":
            return []
        return [zero_dims(features[:self.spec.encoder_slots], self.keep)]

    def report(self) -> dict:
        spec = self.spec
        clipped = self.accuracy_of("clipped") or [None] * len(spec.layers)
        softdecay = self.accuracy_of("softdecay")  # with --data.normalize softdecay: pooled from SoftDecay's states
        baselines = self.baselines()
        detected = self.clip_request.needs_outliers and spec.outlier_source == "detected"  # what the clipping used
        return {
            "encoder": spec.encoder,
            "encoder_commit": spec.encoder_commit,
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
            "outlier_chance_bound": spec.outlier_chance_bound if detected else None,
            "outlier_chance_warning": spec.outlier_chance_warning if detected else None,  # probe.py prints it
            "layers": [{"layer": layer, "accuracy": accuracy, "accuracy_clipped": clip, **self.control_columns(i),
                        **chosen,
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
