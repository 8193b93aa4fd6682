"""Live per-layer outlier statistics during MLM pretraining, logged to W&B (or any Lightning logger).

    python train.py fit --config configs/pretrain/tiny.yaml           # on in every pretraining config
    # its cadence: every_n_steps / image_every_n_steps in the config's trainer.callbacks (a command-line
    # --trainer.callbacks.init_args.X would set only the list's last callback)

Every `every_n_steps` optimizer steps, from the hidden states of that step's own forward pass (all its micro-batches
on every rank; no extra pass: see callbacks/live.py), and over the whole validation set at each validation. W&B groups
panels by the key's first component: a summary section of whole-model numbers (metrics/summary.py: the max over the
non-input layers 1..L for outlier measures, the mean for the anisotropy), then the per-layer detail below it:

    outliers/top_share                              the dominant dimension's share of the tokens' maxima or minima
                                                    (the larger), max over layers
    outliers/persistent_count, persistent_dims      dimensions that are outliers in at least half of the layers 1..L
                                                    (the dims as a list: W&B only, in the history and the summary)
    outliers/kurtosis, max_abs, max_median_ratio    max over layers of the per-layer values below
    outliers/by_layer                               image: top share, kurtosis and max / median ratio, layer x step
    val_outliers/anisotropy                         the paper's anisotropy (§4.1), mean over layers (validation only)

    outliers_by_layer/layer_{l}/argmax_dim, argmax_share   the dimension holding most tokens' maximum, and its share
    outliers_by_layer/layer_{l}/argmin_dim, argmin_share   the same for the minimum
    outliers_by_layer/layer_{l}/top{i}_dim, top{i}_mean    the top_k dimensions by |mean| and their means
    outliers_by_layer/layer_{l}/max_median_ratio    max |mean| / median |mean| of the layer's mean vector
    outliers_by_layer/layer_{l}/num_outliers        dimensions the outlier rule flags (metrics/outliers.py); the
                                                    dims themselves as the list outlier_dims (W&B only)
    outliers_by_layer/layer_{l}/kurtosis, kurtosis_max   Pearson kurtosis of each token vector's components (not
                                                    excess: 3 for Gaussian), mean and max over the tokens (ours)
    outliers_by_layer/layer_{l}/max_abs             the layer's max |activation| (infinity-norm) over the tokens
    outliers_by_layer/layer_{l}/top1_share          mean share of a token's squared norm on its largest component
    outliers_by_layer/layer_{l}/kurtosis_sequence, inf_norm_sequence   Bondarenko et al.'s, as their code computes
                                                    them: the kurtosis and the max |x| of each sequence's flattened
                                                    tokens x hidden values, averaged over the sequences
    outliers_by_layer/layer_{l}/massive_ratio, massive_dim   the largest |activation| over the layer's median
                                                    |activation|, and its dimension (Sun et al. 2024; metrics/massive.py)
    outliers_by_layer/layer_{l}/num_magnitude_outliers   dimensions above 4 x the token's RMS in at least 20% of the
                                                    tokens (ours; metrics/magnitude.py's default rule)
    val_outliers_by_layer/layer_{l}/anisotropy      the mean cosine of pairs of random tokens of different sequences
    outliers_by_layer/num_tokens

(`val_outliers/...` and `val_outliers_by_layer/...` for validation, logged at the step of `val/loss`: see
callbacks/live.py.) Layers l: 0 = embedding output; dimensions 0-indexed; padding never counts, special tokens
do. Statistics are metrics/ classes (NeuronStatistics, TokenSample, detect_outliers, top_mean_dims,
max_median_ratio, random_tokens, sample_anisotropy, over_layers) updated on the device and synced across ranks, so a
step's values equal one process's on the same global batch.

Anisotropy, at validation only (one training batch gives 8 pairs at batch 16: sampling noise, docs/live-statistics.md
gives the numbers): sequence i of the validation set, i counted as the loaders split it over ranks (rank r of w holds
i = r, r + w, ...: DistributedSampler), gives the token at random.Random(seed * 1_000_003 + i).randrange(its counted
tokens) (special tokens count, padding never: the analysis' default), for the first `anisotropy_sequences` (2000: the
paper's 2000 sentences) sequences; the tokens gathered across ranks (TokenSample) are paired by
random.Random(seed).shuffle, first half with second, as in analyses/geometry.py. So an eval-mode validation over the
sentences of a file logs what `analyze.py anisotropy --seed <seed> --clip none` reports on that file (tested), and
every validation uses the same tokens and pairs: the curve moves with the model, not with the draw.

W&B also gets, every `image_every_n_steps` and at each validation, the images `outliers/by_layer` and
`outliers_by_layer/mean_vectors` (average vector per layer, outlier dimensions marked: the paper's Figure 1), and at
each validation and at the end of training the table `outliers_by_layer/table` (a row per layer at each of those image
steps and validations: outlier dims, dominant dims, shares, ratio, anisotropy; it grows over time). TensorBoard gets
the images and the table as text; CSV the scalars.

The outlier rule's chance bound (ours; metrics/null.py) is not logged per capture: it is a function of
outliers_by_layer/num_tokens, the width and the share alone, and ~0 for any real batch (a global batch of 256 x 512
tokens). The last capture's verdict (`last`: train.py's end-of-run summary) holds it, as chance_bound, and its one-line
chance_warning, printed once in that summary, when a capture of few tokens could have found its outliers by chance.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from callbacks import wandb_logging as logs
from callbacks.live import Captured, LiveCallback, by_layer, layer_metrics, trainer_step
from callbacks.media import FIGURES
from core.errors import UserError, warn_once
from core.figures import mean_vectors_figure
from core.step_figures import layer_step_figure
from metrics.geometry import TokenSample, random_tokens, sample_anisotropy
from metrics.magnitude import MagnitudeCounts, MagnitudeRule
from metrics.massive import MassiveActivations
from metrics.neuron_stats import NeuronStatistics
from metrics.outliers import (
    OutlierRule,
    chance_of,
    detect_outliers,
    max_median_ratio,
    outlier_verdict,
    persistent_dims,
    top_mean_dims,
)
from metrics.summary import over_layers, top_share

PREFIX = {"train": "outliers", "val": "val_outliers"}
TABLE_COLUMNS = ["step", "split", "layer", "outlier_dims", "argmax_dim", "argmax_share", "argmin_dim", "argmin_share",
                 "top_dims", "max_median_ratio", "anisotropy"]
TABLE = "outliers_by_layer/table"
HISTORY = ["top_share", "kurtosis", "max_median_ratio"]  # per layer and capture: the by_layer image
LIVE_MORE = "more tokens per capture (validation: --data.max_val_blocks; training: the global batch)"


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
        image_every_n_steps: steps between two sets of images (a multiple of every_n_steps; 0: only at validation).
        layers: hidden-state layers to watch (default all, 0 = embedding output).
        top_k: dimensions of largest |mean| logged per layer.
        min_share: the outlier rule's argmax or argmin share (metrics/outliers.py, as in `analyze.py outliers`; the
            paper's criterion, the number 0.2 ours: it gives none).
        sigma: also a dim whose mean is this many robust SDs off the layer's (ours, opt-in; None: off).
        anisotropy_sequences: at most this many sequences of the validation set give their random token to the
            anisotropy (the paper: 2000 sentences, 1000 pairs).
        on_validation: also over the whole validation set at every validation (the anisotropy is taken there only).
        seed: draws the anisotropy's tokens and pairs.
    """

    def __init__(self, every_n_steps: int = 100, image_every_n_steps: int = 1000, layers: list[int] | None = None,
                 top_k: int = 3, min_share: float = 0.2, sigma: float | None = None, anisotropy_sequences: int = 2000,
                 on_validation: bool = True, seed: int = 0) -> None:
        super().__init__(every_n_steps, image_every_n_steps, layers, on_validation)
        self.top_k, self.rule, self.anisotropy_sequences, self.seed = top_k, OutlierRule(min_share, sigma), \
            anisotropy_sequences, seed
        self.rows: list[list] = []  # the outlier table, kept in checkpoints
        self._tabled = 0  # rows in the table logged last (the end of training logs it again only if rows came since)
        self.history: list[list] = []  # [step, stage, layer, *HISTORY] per capture: the by_layer image; in checkpoints
        self.stats: dict[str, NeuronStatistics] = {}
        self.massive: dict[str, MassiveActivations] = {}  # the peak |x| per dimension and the median |x| per layer
        self.magnitude: dict[str, MagnitudeCounts] = {}  # tokens above the magnitude rule's threshold
        self.tokens: TokenSample | None = None  # validation: the anisotropy's random token of each sequence
        self.seen = 0  # validation sequences this rank has captured since the last validation's end
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
            self.massive[stage] = MassiveActivations(len(self.layers), self.hidden_size).to(pl_module.device)
            self.magnitude[stage] = MagnitudeCounts(len(self.layers), self.hidden_size).to(pl_module.device)
        if self.on_validation:
            self.tokens = TokenSample(self.anisotropy_sequences, len(self.layers), self.hidden_size).to(pl_module.device)
        logs.define_step_metrics(trainer, [f"{name}/*" for prefix in PREFIX.values()
                                           for name in (prefix, by_layer(prefix))])

    def update(self, stage: str, captured: Captured, trainer, pl_module) -> None:
        hidden, mask = captured.hidden, captured.mask  # [layers, batch, seq, hidden], [batch, seq]
        stats = self.stats[stage]
        if stats.device != hidden.device:
            for metric in (stats, self.massive[stage], self.magnitude[stage]):
                metric.to(hidden.device)
        with torch.no_grad():
            stats.update(hidden, mask)
            self.massive[stage].update(hidden, mask)
            self.magnitude[stage].update(hidden, mask)
            if stage == "val":
                self.sample_tokens(hidden, mask, trainer)

    def sample_tokens(self, hidden: Tensor, mask: Tensor | None, trainer) -> None:
        """The anisotropy's random token of each of the batch's sequences among the first anisotropy_sequences of the
        validation set, by its index in the set."""
        tokens = self.tokens
        if tokens.device != hidden.device:
            tokens.to(hidden.device)
        start, batch = self.seen, hidden.shape[1]
        self.seen += batch
        rank, world = trainer.global_rank, trainer.world_size
        index = [rank + world * (start + row) for row in range(batch)]  # in the validation set
        kept = [row for row in range(batch) if index[row] < tokens.num_slots]
        if kept:
            chosen = torch.tensor(kept, device=hidden.device)
            vectors, rows = random_tokens(hidden.index_select(1, chosen),
                                          mask.index_select(0, chosen) if mask is not None else None,
                                          [index[row] for row in kept], self.seed)
            if rows:
                tokens.update(torch.tensor([index[kept[row]] for row in rows]), vectors)

    def finish(self, stage: str, trainer, pl_module, step: int) -> None:
        stats = self.stats[stage]
        result = stats.compute()  # every rank: the states sync here
        massive, (above, counted) = self.massive[stage].compute(), self.magnitude[stage].compute()
        for metric in (stats, self.massive[stage], self.magnitude[stage]):
            metric.reset()
        peak, dims = massive.peak_abs.max(-1)  # [layers]
        extra = {"massive_ratio": (peak / massive.median.to(peak)).cpu().tolist(), "massive_dim": dims.cpu().tolist(),
                 "num_magnitude_outliers": [len(found) for found in MagnitudeRule().outliers(above, counted)]}
        anisotropy = None
        if stage == "val":
            vectors, filled = self.tokens.compute()
            anisotropy, pairs = sample_anisotropy(vectors, filled, self.seed)
            anisotropy = anisotropy.cpu().tolist() if pairs else None  # not a nan logged as a value
            if not pairs and trainer.is_global_zero:
                warn_once(f"OutlierStatistics: the validation set has {int(filled.sum())} sequence(s): its anisotropy "
                          "needs 2 (a pair of random tokens of different sequences) and is not logged; a larger "
                          "--data.max_val_blocks or --data.val_fraction gives it")
            self.tokens.reset()
            self.seen = 0
        if not trainer.is_global_zero or result.num_tokens == 0:
            return
        self.last = self.verdict(result, stage, trainer.global_step if stage == "val" else step)  # steps done
        if logs.real_loggers(trainer):
            self.log_result(trainer, stage, step, result, anisotropy, extra)

    def verdict(self, result, stage: str, step: int) -> dict:
        """The capture's outlier verdict (metrics.outliers.outlier_verdict), its layers numbered as hidden states."""
        cpu = replace(result, **{name: getattr(result, name).cpu() for name in (
            "mean", "argmax_count", "argmin_count", "kurtosis_sum")})
        found = detect_outliers(cpu, self.rule)
        for layer, outliers in zip(self.layers, found):
            outliers.layer = layer
        kurtosis = [row["kurtosis_mean"] for row in cpu.magnitudes()]
        tokens = result.num_tokens  # the chance bound (ours): here, in the end-of-run summary, not a metric per capture
        return {"stage": stage, "step": step, **outlier_verdict(found, kurtosis), "num_tokens": tokens,
                **chance_of(found, tokens, self.hidden_size, self.rule, LIVE_MORE)}

    def log_result(self, trainer, stage: str, step: int, result, anisotropy: list[float] | None, extra: dict
                   ) -> None:
        prefix, layers = PREFIX[stage], self.layers
        result = replace(result, **{name: getattr(result, name).cpu() for name in (
            "mean", "var", "max_abs", "argmax_count", "argmin_count", "kurtosis_sum", "kurtosis_max", "top1_share_sum")})
        found = detect_outliers(result, self.rule)  # indexed 0..len(layers)-1: numbered as hidden-state layers below
        for layer, outliers in zip(layers, found):
            outliers.layer = layer
        dims, means = top_mean_dims(result.mean, self.top_k)
        ratio = max_median_ratio(result.mean).tolist()
        magnitudes = result.magnitudes()
        columns = {"argmax_dim": [o.argmax_dim for o in found], "argmax_share": [o.argmax_share for o in found],
                   "argmin_dim": [o.argmin_dim for o in found], "argmin_share": [o.argmin_share for o in found],
                   "max_median_ratio": ratio, "num_outliers": [len(o.outlier_dims) for o in found],
                   "kurtosis": [m["kurtosis_mean"] for m in magnitudes],
                   "kurtosis_max": [m["kurtosis_max"] for m in magnitudes],
                   "max_abs": [m["max_abs"] for m in magnitudes], "top1_share": [m["top1_share"] for m in magnitudes],
                   "kurtosis_sequence": [m["kurtosis_sequence"] for m in magnitudes],
                   "inf_norm_sequence": [m["inf_norm_sequence"] for m in magnitudes], **extra}
        for rank in range(dims.shape[1]):
            columns[f"top{rank + 1}_dim"] = dims[:, rank].tolist()
            columns[f"top{rank + 1}_mean"] = means[:, rank].tolist()
        if anisotropy is not None:
            columns["anisotropy"] = anisotropy
        persistent = persistent_dims(found)
        shares = [max(o.argmax_share, o.argmin_share) for o in found]
        summary = {"top_share": top_share(columns["argmax_share"], columns["argmin_share"], layers),
                   "persistent_count": len(persistent),
                   **{name: over_layers(columns[name], layers, "max")
                      for name in ("kurtosis", "max_abs", "max_median_ratio")}}
        if anisotropy is not None:
            summary["anisotropy"] = over_layers(anisotropy, layers, "mean")
        metrics = {f"{prefix}/{name}": float(value) for name, value in summary.items()}
        metrics.update(layer_metrics(prefix, layers, columns))
        metrics[f"{by_layer(prefix)}/num_tokens"] = float(result.num_tokens)
        lists = {f"{prefix}/persistent_dims": persistent,
                 **layer_metrics(prefix, layers, {"outlier_dims": [o.outlier_dims for o in found]})}
        logs.log_scalars(trainer, metrics, step, lists)
        for i, layer in enumerate(layers):
            self.history.append([step, stage, layer, round(shares[i], 6), columns["kurtosis"][i], round(ratio[i], 6)])
        if stage == "val" or self.due_images(step):  # images, and a row per layer in the table
            for i, (layer, outliers) in enumerate(zip(layers, found)):
                self.rows.append([step, stage, layer, ", ".join(map(str, outliers.outlier_dims)), outliers.argmax_dim,
                                  outliers.argmax_share, outliers.argmin_dim, outliers.argmin_share,
                                  ", ".join(map(str, dims[i].tolist())), round(ratio[i], 4),
                                  None if anisotropy is None else round(anisotropy[i], 4)])
            if logs.wants_images(trainer):
                self.log_images(trainer, stage, step, result.mean, found)
        if stage == "val":  # the whole table is serialised each time (~0.2 s at the tiny config): not every image step
            logs.log_table(trainer, TABLE, TABLE_COLUMNS, self.rows, step)
            self._tabled = len(self.rows)

    def log_images(self, trainer, stage: str, step: int, mean: Tensor, found) -> None:
        """Drawn off the training thread (callbacks/media.py), from copies."""
        prefix, when, layers = PREFIX[stage], "validation" if stage == "val" else "training step", list(self.layers)
        rows = [row for row in self.history if row[1] == stage]
        FIGURES.submit(trainer, f"{prefix}/by_layer", lambda: self.figure(stage, rows, layers), step)
        full = torch.zeros(max(layers) + 1, mean.shape[1])
        full[layers] = mean.float()
        outliers = {layer: list(o.outlier_dims) for layer, o in zip(layers, found)}
        FIGURES.submit(trainer, f"{by_layer(prefix)}/mean_vectors", lambda: mean_vectors_figure(
            full, outliers, title=f"average vector per layer, {when} {step}", layers=layers), step)

    @staticmethod
    def figure(stage: str, rows: list[list], layers: list[int]):
        """History rows of `stage` as layer x step images: the top share, the kurtosis and the max / median ratio."""
        steps = sorted({row[0] for row in rows})
        column, place = {step: i for i, step in enumerate(steps)}, {layer: i for i, layer in enumerate(layers)}
        panels = []
        for offset, (title, label, log) in enumerate((
                ("dominant dimension's share", "share of tokens (max or min)", False),
                ("kurtosis of the token vectors", "Pearson kurtosis, mean over tokens", True),
                ("max / median |mean|", "ratio", True))):
            values = torch.full((len(layers), len(steps)), float("nan"))
            for row in rows:
                values[place[row[2]], column[row[0]]] = row[3 + offset]
            panels.append({"title": title, "colorbar": label, "values": values.numpy(), "log": log})
        over = "validations" if stage == "val" else "training steps"
        return layer_step_figure(panels, steps, layers, title=f"outlier statistics per layer over {over}")

    @staticmethod
    def latest_persistent_dims(trainer) -> list[int]:
        """The persistent outlier dims (`outliers/persistent_dims`) of the latest capture of an OutlierStatistics in
        `trainer` (rank zero; [] without one or before its first capture): what other callbacks' figures number."""
        found = next((c for c in trainer.callbacks if isinstance(c, OutlierStatistics) and c.last), None)
        return list(found.last["persistent_dims"]) if found is not None else []

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero and len(self.rows) > self._tabled and logs.real_loggers(trainer):
            logs.log_table(trainer, TABLE, TABLE_COLUMNS, self.rows, trainer_step(trainer))
            self._tabled = len(self.rows)

    def state_dict(self) -> dict:
        return {"rows": self.rows, "history": self.history, "last": self.last}

    def load_state_dict(self, state_dict: dict) -> None:
        self.rows = list(state_dict.get("rows", []))
        self.history = list(state_dict.get("history", []))
        self.last = state_dict.get("last")
