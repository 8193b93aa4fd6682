"""An online position probe trained alongside pretraining, with its accuracy and contribution vectors logged live.

    python train.py fit --config configs/pretrain/tiny.yaml            # on in every pretraining config
    python probe.py fit --config configs/probe/position.yaml \\
        --trainer.callbacks+ callbacks.contribution_vectors.ContributionVectors \\
        --trainer.callbacks.every_n_steps 1                              # live, beside the probe.py position probe

Like online linear evaluation in self-supervised learning: a bias-free linear probe hidden -> position per chosen
layer (the probe.py probes' StackedProbe, weight [layers, hidden, positions], one batched matmul) with its own Adam
optimiser, trained on the detached hidden states the model produces anyway (callbacks/live.py): every `every_n_steps`
optimizer steps it
takes one Adam step on the mean cross-entropy over all tokens of that step's global batch (gradients summed across
ranks and divided by the global token count, so every rank holds the same probe and a DDP run trains the probe a
single process would). The encoder never sees the probe's gradient. Before its update the probe is scored on the
same tokens (prequential accuracy: tokens it has not trained on) and the contribution vectors c(i) = |w_gold,i v_i|
of metrics/contributions.py are taken; at every validation, over the whole validation set, without training.

Logged (0 = embedding output; positions are token indices, 0-indexed; dimensions 0-indexed), a summary section and
the per-layer detail below it (W&B groups panels by the key's first component; callbacks/live.py):

    position_probe/accuracy                              mean over the non-input layers of the accuracies below
    position_probe/contributions                         image: mean contribution, layer x neuron
    position_probe/steps                                 probe updates so far
    position_probe_by_layer/layer_{l}/accuracy           share of tokens whose position the probe gets right
    position_probe_by_layer/layer_{l}/top{i}_dim, top{i}_contribution   the top_k neurons by mean contribution (the
                                                         dims also as the list top_dims: W&B only)
    position_probe_by_layer/layer_{l}/top{i}_rank, top{i}_ties   its rank (1 + the neurons of strictly larger
                                                         contribution) and the neurons of exactly its contribution
                                                         (a tied one listed is the lowest-indexed of its tie)
    position_probe_by_layer/layer_{l}/mean_contribution  the mean over all neurons (for scale)
    position_probe_by_layer/num_tokens                   tokens scored

(`val_position_probe/...` for validation, at the step of `val/loss`.) The heatmap comes every `image_every_n_steps`
and at each validation; beside an OutlierStatistics in the same trainer it numbers that callback's latest persistent
outlier dims (`outliers/persistent_dims`) above the panel in red, as probe.py's contributions_by_layer.png does. The
probe (weights and optimiser state) is saved in checkpoints and resumes with them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from callbacks import wandb_logging as logs
from callbacks.live import Captured, LiveCallback, by_layer, layer_metrics
from callbacks.media import FIGURES
from callbacks.outlier_statistics import OutlierStatistics
from core.errors import UserError
from core.figures import heatmap_figure
from core.models import model_max_length
from lightning_modules.stacked import StackedProbe
from metrics.contributions import Contributions, LayerAccuracy, rank_dims
from metrics.summary import over_layers

PREFIX = {"train": "position_probe", "val": "val_position_probe"}


class ContributionVectors(LiveCallback):
    """Online position probe on chosen layers, its accuracy and top contribution neurons, every N steps and at
    validation.

    Args:
        every_n_steps: trainer steps between two probe updates (each one is also scored and logged): optimizer
            steps in pretraining, blocks of cached features (--data.steps_per_block batches each) in probe.py.
        image_every_n_steps: steps between two contribution heatmaps (a multiple of every_n_steps; 0: only at
            validation).
        layers: hidden-state layers probed (default all, 0 = embedding output).
        num_positions: positions the probe tells apart (default: the model's maximum input length, or the probe
            data's classes); tokens at later positions are left out.
        lr: the probe's Adam learning rate.
        top_k: neurons of largest contribution logged per layer.
        on_validation: also score the probe over the whole validation set at every validation.
        chunk_tokens: tokens per probe matmul (bounds the [layers, tokens, positions] logits' memory).
        seed: the probe's initial weights (the same on every rank).
    """

    supports_probe_features = True

    def __init__(self, every_n_steps: int = 100, image_every_n_steps: int = 1000, layers: list[int] | None = None,
                 num_positions: int | None = None, lr: float = 1e-3, top_k: int = 3, on_validation: bool = True,
                 chunk_tokens: int = 4096, seed: int = 0) -> None:
        super().__init__(every_n_steps, image_every_n_steps, layers, on_validation)
        self.requested_positions, self.lr, self.top_k, self.chunk_tokens, self.seed = (num_positions, lr, top_k,
                                                                                     chunk_tokens, seed)
        self.probe: StackedProbe | None = None  # weight [layers, hidden, positions]
        self.optimizer: torch.optim.Optimizer | None = None
        self.updates = 0
        self._pending: dict | None = None  # a checkpoint's probe, applied once the probe exists
        self._tokens = 0  # tokens this rank trained on in the step being captured
        self.accuracy: dict[str, LayerAccuracy] = {}
        self.contributions: dict[str, Contributions] = {}

    def check_settings(self) -> None:
        """The cadence and num_positions (train.py checks these before anything is written)."""
        super().check_settings()
        if self.requested_positions is not None and self.requested_positions < 2:
            raise UserError(f"ContributionVectors: num_positions must be at least 2, got {self.requested_positions}")

    def num_positions(self, trainer, pl_module) -> int:
        if self.requested_positions is not None:
            return self.requested_positions
        if self._modules is None:
            return trainer.datamodule.spec.num_classes
        limit = getattr(pl_module, "max_length", None)
        return int(limit) if limit is not None else model_max_length(pl_module)

    @property
    def weight(self) -> Tensor | None:
        """The probe's weight [layers, hidden, positions] (None before setup)."""
        return self.probe.weight if self.probe is not None else None

    def build(self, trainer, pl_module) -> None:
        if self.probe is not None:
            return
        positions, layers, hidden = self.num_positions(trainer, pl_module), len(self.layers), self.hidden_size
        slots = [("encoder", layer) for layer in self.layers]
        self.probe = StackedProbe(slots, hidden, positions, self.seed).to(pl_module.device)
        self.optimizer = torch.optim.Adam(self.probe.parameters(), lr=self.lr)
        for stage in PREFIX:
            self.accuracy[stage] = LayerAccuracy(layers).to(pl_module.device)
            self.contributions[stage] = Contributions(layers, hidden, positions).to(pl_module.device)
        if self._pending is not None:
            self.load_state_dict(self._pending)
        logs.define_step_metrics(trainer, [f"{name}/*" for prefix in PREFIX.values()
                                           for name in (prefix, by_layer(prefix))])

    def update(self, stage: str, captured: Captured, trainer, pl_module) -> None:
        tokens, positions = captured.tokens, captured.positions  # [layers, n, hidden], [n]
        weight = self.weight
        if weight.device != tokens.device:
            self._move(tokens.device)
            weight = self.weight
        keep = positions < weight.shape[2]
        if not bool(keep.all()):
            tokens, positions = tokens[:, keep], positions[keep]
        accuracy = self.accuracy[stage]
        for start in range(0, positions.numel(), self.chunk_tokens):
            x = tokens[:, start:start + self.chunk_tokens].float()  # [layers, chunk, hidden]
            y = positions[start:start + self.chunk_tokens]
            with torch.no_grad():
                accuracy.update(self.probe(x), y)  # scored before the probe learns from these tokens
            if stage == "train":
                with torch.enable_grad():  # the summed loss: its gradient is reduced over ranks in _step_probe
                    (self.probe.loss(x, y) * y.numel()).backward()
        self.contributions[stage].update(tokens, weight.detach(), positions)
        if stage == "train":
            self._tokens += positions.numel()

    def _move(self, device) -> None:
        state = self.optimizer.state_dict()
        self.probe.to(device)
        self.optimizer = torch.optim.Adam(self.probe.parameters(), lr=self.lr)
        self.optimizer.load_state_dict(state)
        for metric in (*self.accuracy.values(), *self.contributions.values()):
            metric.to(device)

    def finish(self, stage: str, trainer, pl_module, step: int) -> None:
        accuracy, contributions = self.accuracy[stage].compute(), self.contributions[stage].compute()  # every rank
        self.accuracy[stage].reset()
        self.contributions[stage].reset()
        if stage == "train":
            self._step_probe(trainer)
        if trainer.is_global_zero and logs.real_loggers(trainer) and contributions.num_tokens > 0:
            self.log_result(trainer, stage, step, accuracy.cpu(), contributions.mean.float().cpu(),
                            contributions.num_tokens)

    def _step_probe(self, trainer) -> None:
        """One Adam step on the mean loss over the global batch: gradients and token counts summed over ranks."""
        weight = self.weight
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        count = trainer.strategy.reduce(torch.tensor(float(self._tokens), device=weight.device), reduce_op="sum")
        grad = trainer.strategy.reduce(weight.grad, reduce_op="sum")
        self._tokens = 0
        if float(count) > 0:
            weight.grad = grad / count
            self.optimizer.step()
            self.updates += 1
        self.optimizer.zero_grad(set_to_none=True)

    def log_result(self, trainer, stage: str, step: int, accuracy: Tensor, contribution: Tensor, tokens: int) -> None:
        prefix = PREFIX[stage]
        rankings = [rank_dims(contribution[i], top_k=self.top_k) for i in range(len(self.layers))]
        columns = {"accuracy": accuracy.tolist(), "mean_contribution": [r["mean_contribution"] for r in rankings]}
        for rank in range(len(rankings[0]["top_dims"])):
            columns[f"top{rank + 1}_dim"] = [r["top_dims"][rank] for r in rankings]
            columns[f"top{rank + 1}_contribution"] = [float(contribution[i, r["top_dims"][rank]])
                                                      for i, r in enumerate(rankings)]
            for key, listed in (("rank", "top_ranks"), ("ties", "top_ties")):  # a tied one: the lowest-indexed
                columns[f"top{rank + 1}_{key}"] = [r[listed][rank] for r in rankings]
        metrics = {f"{prefix}/accuracy": over_layers(columns["accuracy"], self.layers, "mean"),
                   **layer_metrics(prefix, self.layers, columns), f"{by_layer(prefix)}/num_tokens": float(tokens)}
        if stage == "train":
            metrics[f"{prefix}/steps"] = float(self.updates)
        lists = layer_metrics(prefix, self.layers, {"top_dims": [r["top_dims"] for r in rankings]})
        logs.log_scalars(trainer, metrics, step, lists)
        if stage == "val" or self.due_images(step):  # drawn off the training thread (callbacks/media.py)
            when, layers, contribution = "validation" if stage == "val" else "training step", list(self.layers), \
                contribution.clone()
            marked = OutlierStatistics.latest_persistent_dims(trainer)  # numbered above, as probe.py's heatmap does
            note = " (red: OutlierStatistics' persistent outlier dims)" if marked else ""
            FIGURES.submit(trainer, f"{prefix}/contributions", lambda: heatmap_figure(
                contribution, "dimension (0-indexed)", "layer",
                f"online position probe, {when} {step}: mean contribution per neuron{note}",
                colorbar="mean contribution |w_i v_i|", rows=layers, marked=marked), step)

    # ---- checkpoints: the probe resumes with the run ----
    def state_dict(self) -> dict:
        if self.weight is None:
            return dict(self._pending or {})
        return {"weight": self.weight.detach().cpu(), "optimizer": self.optimizer.state_dict(),
                "updates": self.updates, "layers": self.layers}

    def load_state_dict(self, state_dict: dict) -> None:
        if not state_dict:
            return
        if self.weight is None:
            self._pending = state_dict
            return
        if list(state_dict["layers"]) != self.layers or tuple(state_dict["weight"].shape) != tuple(self.weight.shape):
            raise UserError(f"ContributionVectors: the checkpoint's probe (layers {list(state_dict['layers'])}, "
                            f"weight {tuple(state_dict['weight'].shape)}) does not fit this run's (layers "
                            f"{self.layers}, weight {tuple(self.weight.shape)})")
        with torch.no_grad():
            self.weight.copy_(state_dict["weight"])
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.updates = int(state_dict["updates"])
        self._pending = None
