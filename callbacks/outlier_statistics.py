"""Live per-layer outlier statistics during MLM pretraining, logged to W&B (or any Lightning logger).

    python train.py fit --config configs/pretrain/tiny.yaml           # on in every pretraining config
    # its cadence: every_n_steps / image_every_n_steps in the config's trainer.callbacks (a command-line
    # --trainer.callbacks.init_args.X would set only the list's last callback)

Every `every_n_steps` optimizer steps, from the hidden states of that step's own forward pass (all its micro-batches
on every rank; no extra pass: see callbacks/live.py), and over the whole validation set at each validation,
per layer l (0 = embedding output; dimensions 0-indexed; padding never counts, special tokens do):

    outliers/layer_{l}/argmax_dim, argmax_share     the dimension holding most tokens' maximum, and the share it holds
    outliers/layer_{l}/argmin_dim, argmin_share     the same for the minimum
    outliers/layer_{l}/top{i}_dim, top{i}_mean      the top_k dimensions by |mean| and their means (i = 1..top_k)
    outliers/layer_{l}/max_median_ratio             max |mean| / median |mean| of the layer's mean vector
    outliers/layer_{l}/anisotropy                   the paper's anisotropy (§4.1, as `analyze.py anisotropy`): the
                                                    mean cosine of pairs of random tokens of different sequences
                                                    (one counted token of each sequence, sequences paired at random)
    outliers/layer_{l}/num_outliers                 dimensions the outlier rule flags (metrics/outliers.py)
    outliers/layer_{l}/kurtosis, kurtosis_max       Pearson kurtosis of each token vector's components (not excess:
                                                    3 for Gaussian), mean and max over the tokens (Bondarenko et al.)
    outliers/layer_{l}/max_abs                      the layer's max |activation| (infinity-norm) over the tokens
    outliers/layer_{l}/top1_share                   mean share of a token's squared norm on its largest component
    outliers/num_tokens

(`val_outliers/...` for validation.) Statistics are metrics/ classes (NeuronStatistics, TokenSample, detect_outliers,
top_mean_dims, max_median_ratio, random_tokens, sample_anisotropy) updated on the device and synced across ranks, so a
step's values equal one process's on the same global batch.

Anisotropy: sequence i of the captured step's global batch (or of the validation set), i counted as the loaders
split a global batch over ranks (rank r of w holds i = r, r + w, ...: BlockSampler, DistributedSampler), gives the
token at random.Random(key * 1_000_003 + i).randrange(its counted tokens) (special tokens count, padding never: the
analysis' default), for the first `anisotropy_sequences` (2000: the paper's 2000 sentences) sequences; the tokens
gathered across ranks (TokenSample) are paired by random.Random(key).shuffle, first half with second, as in
analyses/geometry.py. key = `seed` at validation, so an eval-mode validation over the sentences of a file logs what
`analyze.py anisotropy --seed <seed> --clip none` reports on that file (tested), and pair_seed(seed, step) in training
(fresh tokens each capture). In training the states are the training step's: dropout on, masked tokens included.

W&B also gets, every `image_every_n_steps` and at each validation, the image
`outliers/mean_vectors` (average vector per layer, outlier dimensions marked: the paper's Figure 1), the table
`outliers/table` (a row per layer at each of those steps and validations: outlier dims, dominant dims, shares,
ratio, anisotropy; it grows over time and is logged again at the end of training), and the summary entries `outliers/layer_{l}/
outlier_dims` and `outliers/persistent_dims` (latest). TensorBoard gets the images and the table as text; CSV the
scalars.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from callbacks import wandb_logging as logs
from callbacks.live import Captured, LiveCallback
from core.errors import UserError
from core.figures import mean_vectors_figure
from metrics.geometry import TokenSample, random_tokens, sample_anisotropy
from metrics.neuron_stats import NeuronStatistics
from metrics.outliers import (
    OutlierRule,
    detect_outliers,
    max_median_ratio,
    outlier_verdict,
    persistent_dims,
    top_mean_dims,
)

PREFIX = {"train": "outliers", "val": "val_outliers"}
TABLE_COLUMNS = ["step", "split", "layer", "outlier_dims", "argmax_dim", "argmax_share", "argmin_dim", "argmin_share",
                 "top_dims", "max_median_ratio", "anisotropy"]


def pair_positions(seq_len: int, num_pairs: int, seed: int, device=None) -> tuple[Tensor, Tensor]:
    """`num_pairs` distinct positions p of a sequence and a partner q != p for each: (p [n], q [n]), from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    num_pairs = min(num_pairs, seq_len)
    first = torch.randperm(seq_len, generator=generator)[:num_pairs]
    shift = torch.randint(1, max(seq_len, 2), (num_pairs,), generator=generator)
    return first.to(device), ((first + shift) % seq_len).to(device)


def pair_seed(seed: int, step: int | None) -> int:
    """The anisotropy pairs' seed: one per training step, a fixed one for validation (comparable over time)."""
    return seed * 1_000_003 + (step + 1 if step is not None else 0)


class OutlierStatistics(LiveCallback):
    """Per-layer outlier statistics of the training step's hidden states every N steps and at validation.

    Args:
        every_n_steps: optimizer steps between two captures (step 0 included).
        image_every_n_steps: steps between two mean-vector figures (a multiple of every_n_steps; 0: only at
            validation).
        layers: hidden-state layers to watch (default all, 0 = embedding output).
        top_k: dimensions of largest |mean| logged per layer.
        min_share, sigma: the outlier rule (metrics/outliers.py), as in `analyze.py outliers`: the paper's share
            rule, and the opt-in robust z-score of ours (sigma, off by default).
        anisotropy_sequences: at most this many sequences of a captured step or of the validation set give their
            random token to the anisotropy (the paper: 2000 sentences, 1000 pairs).
        on_validation: also over the whole validation set at every validation.
        seed: draws the anisotropy's tokens and pairs (with the step, in training).
    """

    def __init__(self, every_n_steps: int = 100, image_every_n_steps: int = 1000, layers: list[int] | None = None,
                 top_k: int = 3, min_share: float = 0.2, sigma: float | None = None, anisotropy_sequences: int = 2000,
                 on_validation: bool = True, seed: int = 0) -> None:
        super().__init__(every_n_steps, image_every_n_steps, layers, on_validation)
        self.top_k, self.rule, self.anisotropy_sequences, self.seed = top_k, OutlierRule(min_share, sigma), \
            anisotropy_sequences, seed
        self.rows: list[list] = []  # the outlier table, kept in checkpoints
        self.stats: dict[str, NeuronStatistics] = {}
        self.tokens: dict[str, TokenSample] = {}  # the anisotropy's random token of each sequence, by its index
        self.seen = dict.fromkeys(PREFIX, 0)  # sequences this rank has captured since the stage's last finish
        self.last: dict | None = None  # rank zero: the verdict of the last capture (train.py's end-of-run summary)

    def check_settings(self) -> None:
        super().check_settings()
        if self.anisotropy_sequences < 2:
            raise UserError(f"OutlierStatistics: anisotropy_sequences must be at least 2 (one pair), got "
                            f"{self.anisotropy_sequences}")

    def build(self, trainer, pl_module) -> None:
        if self.stats:
            return
        for stage in PREFIX:
            self.stats[stage] = NeuronStatistics(len(self.layers), self.hidden_size).to(pl_module.device)
            self.tokens[stage] = TokenSample(self.anisotropy_sequences, len(self.layers),
                                             self.hidden_size).to(pl_module.device)
        logs.define_step_metrics(trainer, [f"{prefix}/*" for prefix in PREFIX.values()])

    def key(self, stage: str, step: int | None) -> int:
        """The anisotropy's seed: `seed` at validation, one per captured step in training."""
        return pair_seed(self.seed, step) if stage == "train" else self.seed

    def update(self, stage: str, captured: Captured, trainer, pl_module) -> None:
        hidden, mask = captured.hidden, captured.mask  # [layers, batch, seq, hidden], [batch, seq]
        stats, tokens = self.stats[stage], self.tokens[stage]
        if stats.device != hidden.device:
            stats.to(hidden.device)
            tokens.to(hidden.device)
        with torch.no_grad():
            stats.update(hidden, mask)
            start, batch = self.seen[stage], hidden.shape[1]
            self.seen[stage] += batch
            rank, world = trainer.global_rank, trainer.world_size
            index = [rank + world * (start + row) for row in range(batch)]  # in the global batch / validation set
            kept = [row for row in range(batch) if index[row] < tokens.num_slots]
            if kept:
                key = self.key(stage, self.capture_step)
                chosen = torch.tensor(kept, device=hidden.device)
                vectors, rows = random_tokens(hidden.index_select(1, chosen),
                                              mask.index_select(0, chosen) if mask is not None else None,
                                              [index[row] for row in kept], key)
                if rows:
                    tokens.update(torch.tensor([index[kept[row]] for row in rows]), vectors)

    def finish(self, stage: str, trainer, pl_module, step: int) -> None:
        stats, tokens = self.stats[stage], self.tokens[stage]
        result, sample = stats.compute(), tokens.compute()  # every rank: the states sync here
        anisotropy, _ = sample_anisotropy(*sample, self.key(stage, step))
        stats.reset()
        tokens.reset()
        self.seen[stage] = 0
        if not trainer.is_global_zero or result.num_tokens == 0:
            return
        self.last = self.verdict(result, stage, step)
        if logs.real_loggers(trainer):
            self.log_result(trainer, stage, step, result, anisotropy.cpu())

    def verdict(self, result, stage: str, step: int) -> dict:
        """The capture's outlier verdict (metrics.outliers.outlier_verdict), its layers numbered as hidden states."""
        cpu = replace(result, **{name: getattr(result, name).cpu() for name in (
            "mean", "argmax_count", "argmin_count", "kurtosis_sum")})
        found = detect_outliers(cpu, self.rule)
        for layer, outliers in zip(self.layers, found):
            outliers.layer = layer
        kurtosis = [row["kurtosis_mean"] for row in cpu.magnitudes()]
        return {"stage": stage, "step": step, **outlier_verdict(found, kurtosis)}

    def log_result(self, trainer, stage: str, step: int, result, anisotropy: Tensor) -> None:
        prefix = PREFIX[stage]
        result = replace(result, **{name: getattr(result, name).cpu() for name in (
            "mean", "var", "max_abs", "argmax_count", "argmin_count", "kurtosis_sum", "kurtosis_max", "top1_share_sum")})
        found = detect_outliers(result, self.rule)  # indexed 0..len(layers)-1: numbered as hidden-state layers below
        for layer, outliers in zip(self.layers, found):
            outliers.layer = layer
        dims, means = top_mean_dims(result.mean, self.top_k)
        ratio = max_median_ratio(result.mean)
        magnitudes = result.magnitudes()
        metrics: dict[str, float] = {f"{prefix}/num_tokens": float(result.num_tokens)}
        summary: dict = {}
        milestone = stage == "val" or self.due_images(step)  # images, and a row per layer in the table
        for i, (layer, outliers) in enumerate(zip(self.layers, found)):
            key = f"{prefix}/layer_{layer}"
            metrics.update({f"{key}/argmax_dim": outliers.argmax_dim, f"{key}/argmax_share": outliers.argmax_share,
                            f"{key}/argmin_dim": outliers.argmin_dim, f"{key}/argmin_share": outliers.argmin_share,
                            f"{key}/max_median_ratio": float(ratio[i]), f"{key}/anisotropy": float(anisotropy[i]),
                            f"{key}/num_outliers": len(outliers.outlier_dims),
                            f"{key}/kurtosis": magnitudes[i]["kurtosis_mean"],
                            f"{key}/kurtosis_max": magnitudes[i]["kurtosis_max"],
                            f"{key}/max_abs": magnitudes[i]["max_abs"], f"{key}/top1_share": magnitudes[i]["top1_share"]})
            for rank in range(dims.shape[1]):
                metrics[f"{key}/top{rank + 1}_dim"] = int(dims[i, rank])
                metrics[f"{key}/top{rank + 1}_mean"] = float(means[i, rank])
            summary[f"{key}/outlier_dims"] = outliers.outlier_dims
            if milestone:
                self.rows.append([step, stage, layer, ", ".join(map(str, outliers.outlier_dims)), outliers.argmax_dim,
                                  outliers.argmax_share, outliers.argmin_dim, outliers.argmin_share,
                                  ", ".join(map(str, dims[i].tolist())), round(float(ratio[i]), 4),
                                  round(float(anisotropy[i]), 4)])
        summary[f"{prefix}/persistent_dims"] = persistent_dims(found)
        logs.log_scalars(trainer, metrics, step)
        logs.log_summary(trainer, summary)
        if milestone:
            if logs.wants_images(trainer):
                full = torch.zeros(max(self.layers) + 1, result.mean.shape[1])
                full[self.layers] = result.mean.float()
                title = f"average vector per layer, {'validation' if stage == 'val' else 'training step'} {step}"
                figure = mean_vectors_figure(full, {layer: o.outlier_dims for layer, o in zip(self.layers, found)},
                                             title=title + " (outlier dimensions in red)", layers=self.layers)
                logs.log_figure(trainer, f"{prefix}/mean_vectors", figure, step)
            logs.log_table(trainer, "outliers/table", TABLE_COLUMNS, self.rows, step)

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero and self.rows and logs.real_loggers(trainer):
            logs.log_table(trainer, "outliers/table", TABLE_COLUMNS, self.rows, trainer.global_step)

    def state_dict(self) -> dict:
        return {"rows": self.rows, "last": self.last}

    def load_state_dict(self, state_dict: dict) -> None:
        self.rows = list(state_dict.get("rows", []))
        self.last = state_dict.get("last")
