"""Live statistics during pretraining: OutlierStatistics, ContributionVectors and AttentionGeometry on tiny runs,
checked against direct computations on the hidden states (and, for attention, the eager attention probabilities and
the query / key projections' outputs) transformers gives for the same batches; W&B offline logs; DDP; faults.

    .venv/bin/pytest tests/test_callbacks.py -q
"""

from __future__ import annotations

import copy
import csv
import json
import math
import os
import random
import re
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
import wandb
from PIL import Image
from pytorch_lightning.loggers import CSVLogger

import train
from callbacks.attention_geometry import AttentionGeometry
from callbacks.contribution_vectors import ContributionVectors
from callbacks.live import LiveCallback, by_layer, trainer_step
from callbacks.outlier_statistics import TABLE_COLUMNS, OutlierStatistics, pair_positions, pair_seed
from callbacks.wandb_logging import AutoWandbLogger, LoggingWarning, choose_mode
from core.errors import UserError
from core.models import attention_projections, encoder_layers
from tests.tiny import corpus_sentences
from tests.wandb_log import read_run

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
STEPS = 6  # 55 training blocks / global batch 8: one epoch of 6 steps, validation at its end (global step 6)
VAL_STEP = STEPS - 1  # the step Lightning logs that validation's val/loss at, and the live statistics with it
EVERY, IMAGES, LAYERS, PAIRS = 2, 4, 3, 64  # captures at steps 0, 2, 4; images at 0 and 4; 2 layers + embeddings


class Recorder(pl.Callback):
    """Test helper: at each captured step (and validation batch), transformers' own hidden states of the batch and
    the online probe's weights at that moment. Instances register in `Recorder.made`."""

    made: list[Recorder] = []

    def __init__(self, every_n_steps: int = EVERY) -> None:
        self.every, self.train, self.val = every_n_steps, {}, []
        self.attention, self.val_attention = {}, []  # direct_attention of the same batches
        self.ids, self.val_ids = {}, []  # the batches' input_ids
        Recorder.made.append(self)

    @staticmethod
    def direct(pl_module, batch) -> torch.Tensor:  # [layers, batch, seq, hidden], float64
        with torch.no_grad():
            states = pl_module.model.base_model(input_ids=batch["input_ids"], output_hidden_states=True).hidden_states
        return torch.stack(states).double()

    @staticmethod
    def probe(trainer) -> torch.Tensor:
        callback = next(c for c in trainer.callbacks if isinstance(c, ContributionVectors))
        return callback.weight.detach().double().clone()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step % self.every == 0:
            self.train[trainer.global_step] = (self.direct(pl_module, batch), self.probe(trainer))
            self.attention[trainer.global_step] = direct_attention(pl_module, batch)
            self.ids[trainer.global_step] = batch["input_ids"].clone()

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if not trainer.sanity_checking:
            self.val.append((self.direct(pl_module, batch), self.probe(trainer)))
            self.val_attention.append(direct_attention(pl_module, batch))
            self.val_ids.append(batch["input_ids"].clone())


def direct_attention(pl_module, batch) -> dict:
    """An eager copy of the model on the batch (weights as they are now, before the step's update): each layer's
    query and key projection outputs [batch, seq, heads, head_dim] (forward hooks) and attention probabilities
    [batch, heads, seq, seq] (transformers' own `attentions`), float64."""
    model = copy.deepcopy(pl_module.model).eval()
    model.set_attn_implementation("eager")
    outputs, handles = {}, []
    for layer, (query, key, heads) in enumerate(attention_projections(model), 1):
        for kind, module in (("query", query), ("key", key)):
            def keep(module, args, output, name=(layer, kind), heads=heads):
                outputs[name] = output.detach().double().unflatten(-1, (heads, -1))
            handles.append(module.register_forward_hook(keep))
    with torch.no_grad():
        probabilities = model.base_model(input_ids=batch["input_ids"], output_attentions=True).attentions
    for handle in handles:
        handle.remove()
    return {"outputs": outputs, "probabilities": [p.double() for p in probabilities]}


def callbacks(every: int = EVERY, images: int = IMAGES, record: bool = True) -> list[str]:
    specs = ([{"class_path": "tests.test_callbacks.Recorder", "init_args": {"every_n_steps": every}}] if record else [])
    specs += [{"class_path": f"callbacks.{module}.{name}", "init_args": {"every_n_steps": every,
                                                                         "image_every_n_steps": images}}
              for module, name in (("outlier_statistics", "OutlierStatistics"),
                                   ("contribution_vectors", "ContributionVectors"),
                                   ("attention_geometry", "AttentionGeometry"))]
    return [arg for spec in specs for arg in ("--trainer.callbacks+", json.dumps(spec))]


def tiny_args(root: Path, corpus: Path, cache: Path, *extra: str, logger: str | None = "wandb") -> list[str]:
    """train.py arguments of a tiny run; `logger` None: train.py's default logger."""
    kind = {"wandb": "callbacks.wandb_logging.AutoWandbLogger", "csv": "pytorch_lightning.loggers.CSVLogger",
            "tensorboard": "pytorch_lightning.loggers.TensorBoardLogger", "flaky": "tests.test_callbacks.FlakyCSVLogger",
            None: None}[logger]
    chosen = ["--trainer.logger", json.dumps({"class_path": kind, "init_args": {"save_dir": str(root)}})] if kind else []
    return [
        "fit", "--model.hidden_size", "32", "--model.num_hidden_layers", str(LAYERS - 1),
        "--model.num_attention_heads", "4", "--model.intermediate_size", "64", "--model.max_position_embeddings", "34",
        "--model.dropout", "0.0", "--model.warmup_steps", "2", "--model.lr", "1e-3", "--model.decay_steps", str(STEPS),
        "--data.corpus", str(corpus), "--data.vocab_size", "600", "--data.block_length", "32",
        "--data.batch_size", "8", "--data.global_batch_size", "8", "--data.val_fraction", "0.1",
        "--data.cache_dir", str(cache), "--trainer.accelerator", "cpu", "--trainer.devices", "1",
        "--trainer.max_steps", str(STEPS), "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.log_every_n_steps", "1",
        "--trainer.num_sanity_val_steps", "0", "--trainer.default_root_dir", str(root), *chosen,
        "--checkpoint.every_n_train_steps", "1000", *extra,
    ]


def wandb_run(root: Path):
    (directory,) = (root / "wandb").glob("offline-run-*")
    return read_run(directory)


@pytest.fixture(scope="module")
def single(tmp_path_factory, corpus, cache):
    """One process, W&B offline, both callbacks every 2 steps, and the Recorder."""
    root = tmp_path_factory.mktemp("single")
    Recorder.made.clear()
    assert train.cli_main(tiny_args(root, corpus, cache, *callbacks())) == 0
    (recorder,) = Recorder.made
    return wandb_run(root), recorder, root


# ---- direct computations (numpy / plain torch, no metrics/ code) ----

def direct_outliers(hidden: torch.Tensor, validation: bool, top_k: int = 3) -> list[dict]:
    """Per layer from hidden [layers, batch, seq, hidden] (float64): what OutlierStatistics should log (the anisotropy
    at validation only, seed 0)."""
    layers, batch, seq, size = hidden.shape
    tokens = hidden.flatten(1, 2).numpy()
    anisotropy = direct_anisotropy(hidden, 0) if validation else [None] * layers
    out = []
    for layer in range(layers):
        mean = tokens[layer].mean(0)
        max_share = np.bincount(tokens[layer].argmax(1), minlength=size) / tokens.shape[1]
        min_share = np.bincount(tokens[layer].argmin(1), minlength=size) / tokens.shape[1]
        deviation = np.abs(mean - np.median(mean))
        z = deviation / (1.4826 * np.median(deviation))
        flagged = np.flatnonzero((max_share >= 0.2) | (min_share >= 0.2) | (z > 10.0))
        order = np.argsort(-np.abs(mean), kind="stable")
        vectors = tokens[layer]  # [n, hidden]: each token's components
        centred = vectors - vectors.mean(1, keepdims=True)
        kurtosis = (centred ** 4).mean(1) / ((centred ** 2).mean(1) ** 2)  # Pearson's, per token
        out.append({"kurtosis": float(kurtosis.mean()), "kurtosis_max": float(kurtosis.max()),
                    "max_abs": float(np.abs(vectors).max()),
                    "top1_share": float(((vectors ** 2).max(1) / (vectors ** 2).sum(1)).mean()),
                    "argmax_dim": int(max_share.argmax()), "argmax_share": float(max_share.max()),
                    "argmin_dim": int(min_share.argmax()), "argmin_share": float(min_share.max()),
                    "top_dims": order[:top_k].tolist(), "top_means": mean[order[:top_k]].tolist(),
                    "max_median_ratio": float(np.abs(mean).max() / np.median(np.abs(mean))),
                    "anisotropy": None if anisotropy[layer] is None else float(anisotropy[layer]),
                    "num_tokens": tokens.shape[1],
                    "outlier_dims": sorted(flagged.tolist(), key=lambda d: -abs(mean[d]))})
    return out


def direct_anisotropy(hidden: torch.Tensor, key: int) -> torch.Tensor:
    """The paper's anisotropy of hidden [layers, sequences, seq, hidden] (every token counts), by hand: sequence i's
    token at random.Random(key * 1000003 + i).randrange(seq), the sequences shuffled by random.Random(key) and the
    first half paired with the second: mean cosine per layer."""
    count, seq = hidden.shape[1:3]
    positions = [random.Random(key * 1_000_003 + i).randrange(seq) for i in range(count)]
    tokens = hidden[:, torch.arange(count), torch.tensor(positions)]  # [layers, sequences, hidden]
    order = list(range(count))
    random.Random(key).shuffle(order)
    half = count // 2
    return F.cosine_similarity(tokens[:, order[:half]], tokens[:, order[half:2 * half]], dim=-1).mean(1)


def direct_probe(hidden: torch.Tensor, weight: torch.Tensor, top_k: int = 3) -> list[dict]:
    """Accuracy and contribution vectors |w_gold,i v_i| of probe `weight` [layers, hidden, positions]."""
    layers, batch, seq, size = hidden.shape
    tokens = hidden.flatten(1, 2)  # [layers, n, hidden]
    positions = torch.arange(seq).repeat(batch)
    accuracy = (torch.einsum("lnh,lhp->lnp", tokens, weight).argmax(-1) == positions).double().mean(1)
    contribution = (weight[:, :, positions].transpose(1, 2) * tokens).abs().mean(1)  # [layers, hidden]
    order = contribution.argsort(dim=1, descending=True, stable=True)[:, :top_k]
    top = contribution.gather(1, order)  # [layers, top_k]
    ranks = 1 + (contribution[:, None, :] > top[:, :, None]).sum(2)  # 1 + the neurons of strictly larger c(i)
    ties = (contribution[:, None, :] == top[:, :, None]).sum(2) - 1  # the others of exactly the same c(i)
    return [{"accuracy": float(accuracy[layer]), "top_dims": order[layer].tolist(),
             "top_values": contribution[layer, order[layer]].tolist(), "top_ranks": ranks[layer].tolist(),
             "top_ties": ties[layer].tolist(),
             "mean_contribution": float(contribution[layer].mean())} for layer in range(layers)]


def expected_attention(records: list[dict], seed_step: int | None, causal: bool = False) -> list[dict]:
    """Per transformer layer, from direct_attention of the step's (or validation's) batches: what AttentionGeometry
    should log, each head's value averaged over the heads (`causal`: a query at position i has i + 1 keys; the one at
    0 is left out)."""
    seq = records[0]["probabilities"][0].shape[-1]
    first, second = pair_positions(seq, PAIRS, pair_seed(0, seed_step))
    rows = pair_positions(seq, PAIRS, pair_seed(0, seed_step) + 1)[0]
    out = []
    for layer in range(1, LAYERS):
        q = torch.cat([r["outputs"][layer, "query"] for r in records])  # [sequences, seq, heads, d]
        k = torch.cat([r["outputs"][layer, "key"] for r in records])
        probabilities = torch.cat([r["probabilities"][layer - 1] for r in records])  # [sequences, heads, seq, seq]
        mean_q, mean_k = q.mean((0, 1)), k.mean((0, 1))  # [heads, d]
        picked = probabilities[:, :, rows]  # [sequences, heads, queries, keys]
        keys = (rows + 1).double() if causal else torch.full((len(rows),), float(seq), dtype=torch.float64)
        entropy = (-(picked * picked.clamp_min(1e-300).log()).sum(-1) / keys.clamp_min(2).log())[..., keys >= 2]
        out.append({"qk_mean_cosine": F.cosine_similarity(mean_q, mean_k, dim=-1).mean().item(),
                    "query_mean_norm_ratio": (mean_q.norm(dim=-1) / q.norm(dim=-1).mean((0, 1))).mean().item(),
                    "key_mean_norm_ratio": (mean_k.norm(dim=-1) / k.norm(dim=-1).mean((0, 1))).mean().item(),
                    "query_anisotropy": F.cosine_similarity(q[:, first], q[:, second], dim=-1).mean().item(),
                    "key_anisotropy": F.cosine_similarity(k[:, first], k[:, second], dim=-1).mean().item(),
                    "entropy": entropy.mean().item(), "num_tokens": q.shape[0] * seq})
    return out


def check_attention(row: dict, prefix: str, expected: list[dict]) -> None:
    assert row[f"{by_layer(prefix)}/num_tokens"] == expected[0]["num_tokens"]
    for layer, want in enumerate(expected, 1):
        for name, value in want.items():
            if name != "num_tokens":
                assert row[f"{by_layer(prefix)}/layer_{layer}/{name}"] == pytest.approx(value, rel=1e-4, abs=1e-6), \
                    (layer, name)
    for name in expected[0]:  # the summary section: the mean over the layers
        if name != "num_tokens":
            mean = sum(want[name] for want in expected) / len(expected)
            assert row[f"{prefix}/{name}"] == pytest.approx(mean, rel=1e-4, abs=1e-6), name


def logged(run, prefix: str, step: int) -> dict:
    rows = [row for row in run.history if row.get("trainer/global_step") == step
            and any(key.startswith(by_layer(prefix) + "/layer_") for key in row)]
    assert len(rows) == 1, (prefix, step, len(rows))
    return rows[0]


def check_outliers(row: dict, prefix: str, expected: list[dict], lists: bool = True) -> None:
    """The per-layer detail and the summary section (over layers 1..L, by hand) of one capture; `lists`: the row is
    W&B's and must hold the lists (outlier and persistent dims), else it must hold none (CSV takes numbers only)."""
    assert row[f"{by_layer(prefix)}/num_tokens"] == expected[0]["num_tokens"]
    for layer, want in enumerate(expected):
        key = f"{by_layer(prefix)}/layer_{layer}"
        for name in ("argmax_dim", "argmin_dim"):
            assert row[f"{key}/{name}"] == want[name], (key, name)
        for name in ("argmax_share", "argmin_share"):
            assert row[f"{key}/{name}"] == pytest.approx(want[name], abs=1e-6)
        assert [row[f"{key}/top{i}_dim"] for i in (1, 2, 3)] == want["top_dims"]
        assert [row[f"{key}/top{i}_mean"] for i in (1, 2, 3)] == pytest.approx(want["top_means"], rel=1e-5)
        assert row[f"{key}/max_median_ratio"] == pytest.approx(want["max_median_ratio"], rel=1e-5)
        if want["anisotropy"] is None:  # training captures take none (docs/live-statistics.md)
            assert f"{key}/anisotropy" not in row
        else:
            assert row[f"{key}/anisotropy"] == pytest.approx(want["anisotropy"], rel=1e-5)
        assert row[f"{key}/num_outliers"] == len(want["outlier_dims"])
        if lists:
            assert row[f"{key}/outlier_dims"] == want["outlier_dims"], key
        else:
            assert f"{key}/outlier_dims" not in row
        for name in ("kurtosis", "kurtosis_max", "max_abs", "top1_share"):
            assert row[f"{key}/{name}"] == pytest.approx(want[name], rel=1e-4), (key, name)
    upper = expected[1:]  # the summary: layer 0 (the embedding output) never counts
    assert row[f"{prefix}/top_share"] == pytest.approx(max(max(w["argmax_share"], w["argmin_share"]) for w in upper),
                                                       abs=1e-6)
    for name in ("kurtosis", "max_abs", "max_median_ratio"):
        assert row[f"{prefix}/{name}"] == pytest.approx(max(w[name] for w in upper), rel=1e-4), name
    counts: dict[int, int] = {}
    for want in upper:
        for dim in want["outlier_dims"]:
            counts[dim] = counts.get(dim, 0) + 1
    persistent = sorted(dim for dim, count in counts.items() if 2 * count >= len(upper))
    assert row[f"{prefix}/persistent_count"] == len(persistent)
    if lists:
        assert sorted(row[f"{prefix}/persistent_dims"]) == persistent
    else:
        assert f"{prefix}/persistent_dims" not in row
    if upper[0]["anisotropy"] is None:
        assert f"{prefix}/anisotropy" not in row
    else:
        mean = sum(w["anisotropy"] for w in upper) / len(upper)
        assert row[f"{prefix}/anisotropy"] == pytest.approx(mean, rel=1e-5)


def check_probe(row: dict, prefix: str, expected: list[dict]) -> None:
    accuracies = [want["accuracy"] for want in expected[1:]]  # the summary: the mean over layers 1..L
    assert row[f"{prefix}/accuracy"] == pytest.approx(sum(accuracies) / len(accuracies), abs=1e-9)
    for layer, want in enumerate(expected):
        key = f"{by_layer(prefix)}/layer_{layer}"
        assert row[f"{key}/accuracy"] == pytest.approx(want["accuracy"], abs=1e-9)
        assert [row[f"{key}/top{i}_dim"] for i in (1, 2, 3)] == want["top_dims"]
        assert [row[f"{key}/top{i}_contribution"] for i in (1, 2, 3)] == pytest.approx(want["top_values"], rel=1e-5)
        assert [row[f"{key}/top{i}_rank"] for i in (1, 2, 3)] == want["top_ranks"]
        assert [row[f"{key}/top{i}_ties"] for i in (1, 2, 3)] == want["top_ties"]
        assert row[f"{key}/mean_contribution"] == pytest.approx(want["mean_contribution"], rel=1e-5)


@pytest.mark.slow
def test_wandb_run_holds_statistics_equal_to_a_direct_computation(single):
    run, recorder, _ = single
    assert sorted(recorder.train) == [0, 2, 4]
    for step, (hidden, weight) in recorder.train.items():
        check_outliers(logged(run, "outliers", step), "outliers", direct_outliers(hidden, False))
        check_probe(logged(run, "position_probe", step), "position_probe", direct_probe(hidden, weight))
    # validation: the whole validation set (several batches), eval mode, fixed pairs, the probe after its last update
    val_hidden = torch.cat([hidden for hidden, _ in recorder.val], dim=1)
    expected = direct_outliers(val_hidden, True)
    check_outliers(logged(run, "val_outliers", VAL_STEP), "val_outliers", expected)
    check_probe(logged(run, "val_position_probe", VAL_STEP), "val_position_probe",
                direct_probe(val_hidden, recorder.val[0][1]))

    # the probe's own optimiser: step 0 -> 2 is one Adam step on the mean cross-entropy of step 0's tokens
    hidden, weight = recorder.train[0]
    probe = weight.float().clone().requires_grad_(True)
    optimizer = torch.optim.Adam([probe], lr=1e-3)
    tokens, positions = hidden.flatten(1, 2).float(), torch.arange(hidden.shape[2]).repeat(hidden.shape[1])
    sum(F.cross_entropy(tokens[layer] @ probe[layer], positions) for layer in range(LAYERS)).backward()
    optimizer.step()
    torch.testing.assert_close(recorder.train[2][1].float(), probe.detach(), rtol=0, atol=1e-6)
    assert not torch.equal(recorder.train[2][1], recorder.train[0][1])

    # summaries: the latest values, lists included
    for layer, want in enumerate(expected):
        assert run.summary[f"val_outliers_by_layer/layer_{layer}/outlier_dims"] == want["outlier_dims"]
        assert run.summary[f"outliers_by_layer/layer_{layer}/argmax_dim"] == logged(run, "outliers", 4)[
            f"outliers_by_layer/layer_{layer}/argmax_dim"]
        assert run.summary[f"position_probe_by_layer/layer_{layer}/top_dims"] == direct_probe(*recorder.train[4])[
            layer]["top_dims"]
    assert run.summary["val_outliers/persistent_dims"] == logged(run, "val_outliers", VAL_STEP)[
        "val_outliers/persistent_dims"]
    for family in ("outliers", "position_probe", "attention"):
        for prefix in (family, f"val_{family}"):
            for pattern in (f"{prefix}/*", f"{by_layer(prefix)}/*"):
                assert run.metrics[pattern] == "trainer/global_step"

    # images: mean vectors and contribution heatmaps at steps 0 and 4 and at validation; the table over time
    images = {}
    for path in run.media:
        if path.suffix == ".png":
            key = str(path.parent.relative_to(run.directory / "files" / "media" / "images")) + "/" + \
                path.name.rsplit("_", 2)[0]
            images[key] = images.get(key, 0) + 1
            with Image.open(path) as image:
                assert min(image.size) > 100
    assert images == {"outliers/by_layer": 2, "val_outliers/by_layer": 1, "outliers_by_layer/mean_vectors": 2,
                      "val_outliers_by_layer/mean_vectors": 1, "position_probe/contributions": 2,
                      "val_position_probe/contributions": 1, "attention/over_steps": 2, "val_attention/over_steps": 1}
    tables = sorted((p for p in run.media if p.name.endswith(".table.json")), key=lambda p: int(p.name.split("_")[1]))
    table = json.loads(tables[-1].read_text())
    assert table["columns"] == TABLE_COLUMNS
    assert [(row[0], row[1], row[2]) for row in table["data"]] == \
        [(step, "train", layer) for step in (0, 4) for layer in range(LAYERS)] + \
        [(VAL_STEP, "val", layer) for layer in range(LAYERS)]
    for row in table["data"]:
        prefix = "outliers" if row[1] == "train" else "val_outliers"
        assert row[4] == logged(run, prefix, row[0])[f"{by_layer(prefix)}/layer_{row[2]}/argmax_dim"]


@pytest.mark.slow
def test_attention_geometry_equals_the_eager_attention_probabilities_and_projections(single):
    """Each captured step's queries and keys (the step's forward, before its update) and attention entropies, and
    the whole validation set's, against an eager copy of the model on the same batches."""
    run, recorder, _ = single
    assert sorted(recorder.attention) == [0, 2, 4]
    for step, record in recorder.attention.items():
        check_attention(logged(run, "attention", step), "attention", expected_attention([record], step))
    check_attention(logged(run, "val_attention", VAL_STEP), "val_attention", expected_attention(recorder.val_attention,
                                                                                          None))
    row = logged(run, "attention", 4)
    assert all(0 < row[f"attention_by_layer/layer_{layer}/entropy"] < 1 for layer in (1, 2))
    for name in ("qk_mean_cosine", "entropy"):
        assert run.summary[f"attention/{name}"] == row[f"attention/{name}"]
    # the weights moved between the steps: statistics from the weights after the update would differ
    assert expected_attention([recorder.attention[2]], 2) != expected_attention([recorder.attention[0]], 2)


def direct_sinks(probabilities: list[torch.Tensor], ids: torch.Tensor, special: tuple[int, ...]) -> list[dict]:
    """Per transformer layer from the eager attention [batch, heads, seq, seq] (every position a token) and the
    input ids, by hand: Gu et al.'s share of (sequence, head) whose first token gets > 0.3 of the attention averaged
    over the queries, that mean attention, and the mean attention on the special tokens."""
    out = []
    for weights in probabilities:
        first = weights[..., 0].mean(-1)  # [batch, heads]
        keys = torch.isin(ids, torch.tensor(special))[:, None, None, :]
        out.append({"sink_share": float((first > 0.3).double().mean()), "first_token_mass": float(first.mean()),
                    "special_token_mass": float((weights * keys).sum(-1).mean())})
    return out


def direct_magnitudes(hidden: torch.Tensor) -> list[dict]:
    """Per layer from hidden [layers, batch, seq, hidden] (every position a token), by hand: Bondarenko et al.'s
    per-sequence kurtosis (their formula) and inf-norm, the peak over the median |x| and its dimension, and the
    dimensions above 4 x the token's RMS in at least 20% of the tokens."""
    out = []
    for layer in hidden:
        flat = layer.flatten(1)  # [batch, seq * hidden]
        centred = flat - flat.mean(1, keepdim=True)
        kurtosis = (centred ** 4).mean(1) / (flat.std(1) ** 4 + 1e-6)
        tokens = layer.flatten(0, 1)
        rms = tokens.pow(2).mean(-1, keepdim=True).sqrt()
        out.append({"kurtosis_sequence": float(kurtosis.mean()), "inf_norm_sequence": float(flat.abs().amax(1).mean()),
                    "massive_ratio": float(tokens.abs().max() / tokens.abs().median()),
                    "massive_dim": int(tokens.abs().amax(0).argmax()),
                    "num_magnitude_outliers": int(((tokens.abs() > 4 * rms).double().mean(0) >= 0.2).sum())})
    return out


@pytest.mark.slow
def test_sinks_and_magnitudes_equal_a_direct_computation(single):
    """The live attention sinks (AttentionGeometry) and the per-sequence kurtosis, massive activations and magnitude
    outliers (OutlierStatistics) of each captured step and of the validation, against the eager attention and the
    hidden states of the same batches, by hand."""
    run, recorder, _ = single
    special = (0, 2, 4)  # the trained tokenizer's <s>, </s> and <mask> (pad 1 and <unk> 3 are not counted)
    stages = [("", step, [recorder.attention[step]], [recorder.ids[step]], recorder.train[step][0])
              for step in (0, 2, 4)]
    stages.append(("val_", VAL_STEP, recorder.val_attention, recorder.val_ids,
                   torch.cat([hidden for hidden, _ in recorder.val], dim=1)))
    for prefix, step, records, ids, hidden in stages:
        probabilities = [torch.cat([r["probabilities"][layer] for r in records]) for layer in range(LAYERS - 1)]
        row = logged(run, f"{prefix}sinks", step)
        wanted = direct_sinks(probabilities, torch.cat(ids), special)
        for layer, want in enumerate(wanted, 1):
            for name, value in want.items():
                assert row[f"{prefix}sinks_by_layer/layer_{layer}/{name}"] == pytest.approx(value, abs=1e-5), (step, name)
        for name in ("sink_share", "first_token_mass"):  # the summary section: the mean over layers 1..L
            assert row[f"{prefix}sinks/{name}"] == pytest.approx(np.mean([w[name] for w in wanted]), abs=1e-5)
        row = logged(run, f"{prefix}outliers", step)
        for layer, want in enumerate(direct_magnitudes(hidden)):
            key = f"{prefix}outliers_by_layer/layer_{layer}"
            for name in ("kurtosis_sequence", "inf_norm_sequence"):
                assert row[f"{key}/{name}"] == pytest.approx(want[name], rel=1e-4), (step, key, name)
            assert row[f"{key}/massive_ratio"] == pytest.approx(want["massive_ratio"], rel=0.02)  # the histogram
            assert (row[f"{key}/massive_dim"], row[f"{key}/num_magnitude_outliers"]) == \
                (want["massive_dim"], want["num_magnitude_outliers"])
    assert run.metrics["sinks/*"] == run.metrics["val_sinks_by_layer/*"] == "trainer/global_step"


@pytest.mark.slow
def test_wandb_view_sums_up_every_layer_first_and_validation_shares_the_step_of_val_loss(single):
    """The run's sections: each family's own section holds at most eight panels (whole-model numbers and images), the
    per-layer keys sit in `<family>_by_layer/layer_{l}/...`; the persistent dims are in the history of every capture;
    validation statistics are logged at the step val/loss is (the optimizer updates the model had)."""
    run, _, _ = single
    sections: dict[str, set] = {}  # section -> its panels (an image's or table's fields count once, as its key)
    for row in run.history:
        media = {key.rsplit("/", 1)[0] for key in row if key.endswith("/_type")}
        for key in row:
            panel = next((name for name in media if key.startswith(name + "/")), key)
            if "/" in panel:
                sections.setdefault(panel.split("/")[0], set()).add(panel.split("/", 1)[1])
    for family in ("outliers", "position_probe", "attention"):
        for prefix in (family, f"val_{family}"):
            assert 2 <= len(sections[prefix]) <= 8, (prefix, sorted(sections[prefix]))
            assert not any(name.startswith("layer_") for name in sections[prefix])
            layers = {name.split("/")[0] for name in sections[by_layer(prefix)] if name.startswith("layer_")}
            assert layers == {f"layer_{layer}" for layer in range(1 if family == "attention" else 0, LAYERS)}
    assert sorted(sections["outliers"]) == ["by_layer", "kurtosis", "max_abs", "max_median_ratio", "persistent_count",
                                            "persistent_dims", "top_share"]
    assert sorted(sections["val_outliers"]) == sorted(sections["outliers"] | {"anisotropy"})
    captured = [row for row in run.history if "outliers/top_share" in row]
    assert [row["trainer/global_step"] for row in captured] == [0, 2, 4]
    assert all(isinstance(row["outliers/persistent_dims"], list) and
               row["outliers/persistent_count"] == len(row["outliers/persistent_dims"]) for row in captured)
    val_loss = {row["trainer/global_step"] for row in run.history if "val/loss" in row}
    assert val_loss == {VAL_STEP}
    for prefix in ("val_outliers", "val_position_probe", "val_attention"):
        assert {row["trainer/global_step"] for row in run.history if any(k.startswith(prefix) for k in row)} == val_loss


@pytest.mark.slow
def test_two_process_ddp_logs_what_one_process_logs(single, corpus, cache, tmp_path):
    root = tmp_path / "ddp"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    args = tiny_args(root, corpus, cache, *callbacks(record=False), "--data.batch_size", "4", "--trainer.devices", "2",
                     "--trainer.strategy", "ddp")
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)  # a deadlock (a rank left waiting in a collective) times out
    assert result.returncode == 0, result.stderr[-3000:]
    # one W&B run for the two processes: rank 1 starts none, and the run is the one kept in the run directory
    (part,) = (root / "wandb").glob("offline-run-*")
    assert part.name.endswith("-" + (root / "wandb_run_id").read_text().strip())
    one, two = single[0], wandb_run(root)
    prefixes = (("outliers", (0, 2, 4)), ("position_probe", (0, 2, 4)), ("val_outliers", (VAL_STEP,)),
                ("val_position_probe", (VAL_STEP,)), ("attention", (0, 2, 4)), ("val_attention", (VAL_STEP,)),
                ("sinks", (0, 2, 4)), ("val_sinks", (VAL_STEP,)))
    assert same_statistics(one, two, prefixes) > 250


def same_statistics(one, two, prefixes) -> int:
    """Assert two runs logged the same statistics (integers exactly, floats to float tolerance); how many."""
    compared = 0
    for prefix, steps in prefixes:
        for step in steps:
            a, b = logged(one, prefix, step), logged(two, prefix, step)
            ours = (prefix + "/", by_layer(prefix) + "/")
            keys = sorted(k for k in a if k.startswith(ours))
            assert keys == sorted(k for k in b if k.startswith(ours))
            for key in keys:
                if isinstance(a[key], list) or key.endswith(("_dim", "num_tokens", "num_outliers", "_count")):
                    assert a[key] == b[key], key
                else:
                    assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
                compared += 1
    return compared


@pytest.mark.slow
def test_compiled_run_captures_every_step_and_logs_what_the_eager_run_logs(single, corpus, cache, tmp_path):
    """--model.compile true (inductor, CPU): the encoder and the loss in two graphs, one returning the hidden states
    (steps 0, 2, 4) and one not, never recompiled; every capture step and the validation log the eager run's
    statistics and each step's loss, to float tolerance."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()  # dynamo's counters outlive reset(): earlier tests' graphs
    root = tmp_path / "compiled"
    assert train.cli_main(tiny_args(root, corpus, cache, *callbacks(record=False), "--model.compile", "true")) == 0
    assert counters["stats"]["unique_graphs"] == 2 and not counters["recompiles"]
    one, two = single[0], wandb_run(root)
    prefixes = (("outliers", (0, 2, 4)), ("position_probe", (0, 2, 4)), ("val_outliers", (VAL_STEP,)),
                ("val_position_probe", (VAL_STEP,)), ("attention", (0, 2, 4)), ("val_attention", (VAL_STEP,)),
                ("sinks", (0, 2, 4)), ("val_sinks", (VAL_STEP,)))
    assert same_statistics(one, two, prefixes) > 250
    losses = [{row["trainer/global_step"]: row["train/loss"] for row in run.history if "train/loss" in row}
              for run in (one, two)]
    assert sorted(losses[0]) == list(range(STEPS))
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


@pytest.mark.slow
def test_resumed_run_continues_the_probe_and_the_table_exactly(single, corpus, cache, tmp_path):
    straight = torch.load(single[2] / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    root = tmp_path / "resumed"
    assert train.cli_main(tiny_args(root, corpus, cache, *callbacks(record=False), "--trainer.max_steps", "4")) == 0
    assert train.cli_main(tiny_args(root, corpus, cache, *callbacks(record=False), "--ckpt_path", "last")) == 0
    resumed = torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    # nothing pickled but torch's own tensor rebuilders: both callbacks' states, the tokenizer (as text), the loops
    assert torch.serialization.get_unsafe_globals_in_checkpoint(root / "checkpoints" / "last.ckpt") == []
    probe, reference = resumed["callbacks"]["ContributionVectors"], straight["callbacks"]["ContributionVectors"]
    assert probe["updates"] == reference["updates"] == 3  # steps 0, 2 and 4
    torch.testing.assert_close(probe["weight"], reference["weight"], rtol=0, atol=1e-7)
    assert resumed["callbacks"]["OutlierStatistics"]["rows"] == straight["callbacks"]["OutlierStatistics"]["rows"]
    history = resumed["callbacks"]["AttentionGeometry"]["history"]
    assert history == straight["callbacks"]["AttentionGeometry"]["history"] and [row[0] for row in history] == \
        [0, 0, 2, 2, 4, 4, VAL_STEP, VAL_STEP]


def short_fit(root: Path, corpus: Path, cache: Path, *extra: str, logger: str = "wandb") -> int:
    return train.cli_main(tiny_args(root, corpus, cache, *callbacks(record=False), "--trainer.max_steps", "4",
                                    *extra, logger=logger))


def final_step(root: Path) -> int:
    return torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"]


def test_wandb_that_cannot_start_warns_and_training_goes_on(corpus, cache, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("wandb service unavailable")

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.warns(LoggingWarning) as caught:
        assert short_fit(tmp_path / "run", corpus, cache) == 0
    messages = [str(w.message) for w in caught if issubclass(w.category, LoggingWarning)]
    assert any("W&B could not start offline (RuntimeError: wandb service unavailable)" in m for m in messages)
    assert any("training continues without it" in m for m in messages)
    assert final_step(tmp_path / "run") == 4 and (tmp_path / "run" / "export" / "config.json").exists()


def test_wandb_failing_mid_run_warns_once_and_training_goes_on(corpus, cache, tmp_path, monkeypatch):
    from wandb.sdk.wandb_run import Run

    log = Run.log

    def flaky(self, data, *args, **kwargs):
        if data.get("trainer/global_step", 0) >= 2:
            raise ConnectionError("wandb-core went away")
        return log(self, data, *args, **kwargs)

    monkeypatch.setattr(Run, "log", flaky)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert short_fit(tmp_path / "run", corpus, cache) == 0
    failures = [w for w in caught if issubclass(w.category, LoggingWarning)]
    assert len(failures) == 1 and "W&B failed mid-run (ConnectionError: wandb-core went away)" in str(failures[0].message)
    assert final_step(tmp_path / "run") == 4
    steps = {row["trainer/global_step"] for row in wandb_run(tmp_path / "run").history if "trainer/global_step" in row}
    assert steps == {0, 1}  # everything before the failure was kept, nothing after


def logger_from_the_command_line(save_dir: str) -> AutoWandbLogger:
    """The logger as LightningCLI builds it: jsonargparse follows **kwargs down to wandb.init's signature and hands
    every parameter over, None where unset (settings=None, resume=None included)."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(AutoWandbLogger, "logger")
    config = parser.parse_args(["--logger.save_dir", save_dir])
    assert "settings" in config.logger and config.logger.settings is None  # what made W&B print its banner before
    return parser.instantiate(config).logger


@pytest.mark.parametrize("built", ["directly", "by the command line"])
def test_without_credentials_wandb_goes_offline_with_one_line(built, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_IDENTITY_TOKEN_FILE", raising=False)
    (tmp_path / "netrc").write_text("")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert choose_mode() == ("offline", "no W&B credentials: set WANDB_API_KEY or run `wandb login`")
    with socket.socket() as server:  # credentials, and a host that answers / one that does not
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert choose_mode() == ("online", None)
    assert choose_mode() == ("offline", "127.0.0.1 cannot be reached")  # the port is closed now
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.delenv("WANDB_BASE_URL")

    monkeypatch.delenv("WANDB_SILENT", raising=False)  # the suite's own setting: W&B's output is what is checked
    build = AutoWandbLogger if built == "directly" else logger_from_the_command_line
    logger = build(save_dir=str(tmp_path / "run"))
    assert logger._wandb_init["resume"] == "allow"  # Lightning's default stands: a re-start resumes the same run
    logger.log_metrics({"outliers/x": 0.5}, step=3)
    logger.finalize("success")
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("W&B:")]
    assert len(lines) == 1 and "offline (no W&B credentials" in lines[0]
    # nothing else: W&B's own offline banner and run summary repeat that line
    assert not [line for line in (captured.out + captured.err).splitlines() if line.lower().startswith("wandb:")]
    (directory,) = (tmp_path / "run" / "wandb").glob("offline-run-*")
    sync = lines[0].split("wandb sync ")[-1]  # every part of this run (one per start): here the one
    assert sorted(Path("/").glob(sync.lstrip("/"))) == [directory] and sync.endswith(f"-{logger.run_id}*")
    assert read_run(directory).values("outliers/x") == [0.5]


class GRUModule(pl.LightningModule):
    """A model without a transformers encoder: nothing for the hooks to find."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = torch.nn.GRU(4, 4, batch_first=True)

    def training_step(self, batch, batch_idx):
        return self.rnn(batch[0])[0].pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("callback", [OutlierStatistics, ContributionVectors, AttentionGeometry])
def test_a_model_whose_hidden_states_cannot_be_captured_is_a_clear_error(callback, tmp_path):
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 3, 4)), batch_size=4)
    trainer = pl.Trainer(max_steps=1, logger=False, callbacks=[callback(every_n_steps=1, image_every_n_steps=0)],
                         enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    with pytest.raises(UserError, match="cannot capture the hidden states of GRUModule: it holds no transformers (encoder|model)"):
        trainer.fit(GRUModule(), data)


class PreNormModule(pl.LightningModule):
    """A transformers encoder whose layers normalise their input before the attention (RoBERTa-PreLayerNorm):
    its queries and keys are no projection of the hidden states."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import RobertaPreLayerNormConfig, RobertaPreLayerNormModel

        self.encoder = RobertaPreLayerNormModel(RobertaPreLayerNormConfig(
            vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32))

    def training_step(self, batch, batch_idx):
        return self.encoder(input_ids=batch[0]).last_hidden_state.pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_model_whose_attention_cannot_be_read_is_refused_at_setup_with_one_line(tmp_path):
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randint(3, 50, (8, 6))), batch_size=4)
    trainer = pl.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         callbacks=[AttentionGeometry(every_n_steps=1, image_every_n_steps=0)], default_root_dir=tmp_path)
    module = PreNormModule()
    with pytest.raises(UserError) as raised:
        trainer.fit(module, data)
    assert str(raised.value) == ("cannot read the attention of PreNormModule: its layers normalise their input before "
                                 "the attention (pre-LayerNorm), so queries and keys are not projections of the hidden "
                                 "states")
    assert trainer.global_step == 0


@pytest.mark.parametrize("spec, message", [
    ({"class_path": "callbacks.outlier_statistics.OutlierStatistics", "init_args": {"layers": [0, 3]}},
     "OutlierStatistics: layers [0, 3] must be distinct, within 0..2"),
    ({"class_path": "callbacks.contribution_vectors.ContributionVectors",
      "init_args": {"every_n_steps": 3, "image_every_n_steps": 10}},
     "ContributionVectors: image_every_n_steps (10) must be a multiple of every_n_steps (3), or 0 for no images"),
    ({"class_path": "callbacks.outlier_statistics.OutlierStatistics", "init_args": {"every_n_steps": 0}},
     "OutlierStatistics: every_n_steps must be at least 1, got 0"),
    ({"class_path": "callbacks.contribution_vectors.ContributionVectors", "init_args": {"num_positions": 1}},
     "ContributionVectors: num_positions must be at least 2, got 1"),
    ({"class_path": "callbacks.attention_geometry.AttentionGeometry", "init_args": {"layers": [0, 2]}},
     "AttentionGeometry: layers [0, 2] must be distinct transformer layers within 1..2 (attention has none at the "
     "embedding output)"),
    ({"class_path": "callbacks.attention_geometry.AttentionGeometry", "init_args": {"queries_per_sequence": 0}},
     "AttentionGeometry: queries_per_sequence must be at least 1, got 0"),
    ({"class_path": "callbacks.attention_geometry.AttentionGeometry", "init_args": {"sink_epsilon": 1.0}},
     "AttentionGeometry: sink_epsilon must lie in [0, 1), got 1.0"),
    ({"class_path": "callbacks.outlier_statistics.OutlierStatistics", "init_args": {"anisotropy_sequences": 1}},
     "OutlierStatistics: anisotropy_sequences must be at least 2 (one pair), got 1"),
])
def test_bad_callback_settings_are_one_line_exit_2_and_write_nothing(corpus, cache, tmp_path, capsys, spec, message):
    root = tmp_path / "run"
    assert train.cli_main(tiny_args(root, corpus, cache, "--trainer.callbacks+", json.dumps(spec))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("train.py: error: ") and message in err[-1]
    assert not root.exists()


@pytest.mark.slow
def test_sanity_check_is_skipped_and_tensorboard_gets_scalars_and_images(corpus, cache, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    Recorder.made.clear()
    root = tmp_path / "run"
    assert train.cli_main(tiny_args(root, corpus, cache, *callbacks(), "--trainer.num_sanity_val_steps", "2",
                                    logger="tensorboard")) == 0
    (recorder,) = Recorder.made
    events = EventAccumulator(str(next(root.rglob("events.out.tfevents.*")).parent), size_guidance={"images": 0})
    events.Reload()
    val_tokens = sum(hidden.shape[1] * hidden.shape[2] for hidden, _ in recorder.val)  # the validation set only
    assert [(e.step, e.value) for e in events.Scalars("val_outliers_by_layer/num_tokens")] == [(VAL_STEP, val_tokens)]
    assert [e.step for e in events.Scalars("outliers_by_layer/num_tokens")] == [0, 2, 4]
    expected = direct_outliers(recorder.train[2][0], False)
    assert events.Scalars("outliers_by_layer/layer_1/argmax_dim")[1].value == expected[1]["argmax_dim"]
    assert [e.step for e in events.Images("outliers_by_layer/mean_vectors")] == [0, 4]
    assert [e.step for e in events.Images("outliers/by_layer")] == [0, 4]
    assert [e.step for e in events.Images("val_position_probe/contributions")] == [VAL_STEP]
    assert "outliers_by_layer/table/text_summary" in events.Tags()["tensors"]


def test_no_figure_is_drawn_for_a_disabled_wandb_run_and_tensorboard_beside_it_still_gets_it(tmp_path, monkeypatch):
    """WANDB_MODE=disabled keeps nothing: a live figure is neither made nor encoded for it alone (its maker is never
    called), and once a TensorBoard logger sits beside it the same figure is made once and TensorBoard holds it."""
    from pytorch_lightning.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from callbacks.media import FIGURES
    from callbacks.wandb_logging import wants_images
    from core.figures import heatmap_figure

    monkeypatch.setenv("WANDB_MODE", "disabled")
    disabled = AutoWandbLogger(save_dir=str(tmp_path))
    made = []

    def make():
        made.append(1)
        return heatmap_figure(np.arange(6.0).reshape(2, 3), "dimension", "layer")

    class Trainer:
        loggers, is_global_zero, global_step = [disabled], True, 0

    FIGURES.submit(Trainer, "outliers/by_layer", make, 4)
    FIGURES.flush(Trainer)
    assert disabled.mode == "disabled" and made == [] and not wants_images(Trainer)
    Trainer.loggers = [disabled, TensorBoardLogger(str(tmp_path / "tb"))]
    FIGURES.submit(Trainer, "outliers/by_layer", make, 4)
    FIGURES.flush(Trainer)
    assert made == [1] and wants_images(Trainer)
    Trainer.loggers[1].experiment.flush()
    events = EventAccumulator(str(next((tmp_path / "tb").rglob("events.out.tfevents.*")).parent),
                              size_guidance={"images": 0})
    events.Reload()
    assert [e.step for e in events.Images("outliers/by_layer")] == [4]
    disabled.finalize("success")


def test_fast_dev_run_neither_crashes_nor_logs(corpus, cache, tmp_path):
    root = tmp_path / "run"
    assert train.cli_main(tiny_args(root, corpus, cache, *callbacks(every=1, images=1, record=False),
                                    "--trainer.fast_dev_run", "true")) == 0
    assert (root / "export" / "config.json").exists() and not (root / "wandb").exists()


class ProbeRecorder(pl.Callback):
    """Test helper for probe.py runs: each step's cached features, positions and the online probe's weights."""

    made: list[ProbeRecorder] = []

    def __init__(self) -> None:
        self.seen = {}
        ProbeRecorder.made.append(self)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # keyed by the trainer step the statistics are logged at (a block of cached features: one trainer step)
        self.seen[trainer_step(trainer)] = (batch[0].double(), batch[1], Recorder.probe(trainer))


@pytest.mark.slow
def test_contribution_vectors_in_a_probe_py_run(tmp_path, bert_tok):
    import probe
    from tests.tiny import save_tiny_encoder

    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    data = tmp_path / "s.txt"
    data.write_text("\n".join(corpus_sentences(40)) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    spec = {"class_path": "callbacks.contribution_vectors.ContributionVectors",
            "init_args": {"every_n_steps": 1, "image_every_n_steps": 0, "layers": [1, 3], "on_validation": False}}
    logger = {"class_path": "pytorch_lightning.loggers.CSVLogger", "init_args": {"save_dir": str(out)}}
    ProbeRecorder.made.clear()
    cli = probe.cli_main(["fit", "--config", str(ROOT / "configs" / "probe" / "position.yaml"), "--model.encoder",
                          str(encoder), "--data.source", str(data), "--data.batch_size", "8", "--data.random_baseline",
                          "false", "--data.progress", "false", "--trainer.max_epochs", "1", "--trainer.accelerator",
                          "cpu", "--trainer.enable_progress_bar", "false", "--trainer.log_every_n_steps", "1",
                          "--trainer.logger", json.dumps(logger), "--trainer.default_root_dir", str(out),
                          "--trainer.callbacks+", "tests.test_callbacks.ProbeRecorder",
                          "--trainer.callbacks+", json.dumps(spec)])
    (recorder,) = ProbeRecorder.made
    rows = {}
    for path in out.rglob("metrics.csv"):
        with path.open() as handle:
            rows.update({int(row["step"]): row for row in csv.DictReader(handle)
                         if row.get("position_probe_by_layer/num_tokens")})
    assert sorted(rows) == sorted(recorder.seen) and len(rows) >= 3
    slots = [cli.datamodule.spec.slots.index(("encoder", layer)) for layer in (1, 3)]
    for step, (features, positions, weight) in recorder.seen.items():
        tokens = features[slots]  # [2 layers, tokens, hidden]
        accuracy = (torch.einsum("lnh,lhp->lnp", tokens, weight).argmax(-1) == positions).double().mean(1)
        contribution = (weight[:, :, positions].transpose(1, 2) * tokens).abs().mean(1)
        for i, layer in enumerate((1, 3)):
            key = f"position_probe_by_layer/layer_{layer}"
            assert float(rows[step][f"{key}/accuracy"]) == pytest.approx(float(accuracy[i]))
            assert int(float(rows[step][f"{key}/top1_dim"])) == int(contribution[i].argmax())
        assert float(rows[step]["position_probe_by_layer/num_tokens"]) == positions.numel()


@pytest.mark.parametrize("config, init_args, message", [
    ("classify", {}, "ContributionVectors: cannot capture the hidden states of SentenceClassifier: it holds no "
                     "transformers encoder and its data are not the position probe's cached features"),
    ("position", {"layers": [1, 9]}, "ContributionVectors: layers [9] are not among the probe's layers [0, 1, 2, 3]"),
    ("classify", None, f"--clip {','.join(map(str, range(32)))} zeroes all 32 dims of layer 1: nothing is left"),
])
def test_a_live_callback_a_probe_py_run_cannot_take_is_refused_before_the_wandb_run_starts(tmp_path, bert_tok, capfd,
                                                                                            config, init_args, message):
    """probe.py builds its probes and checks its live callbacks once the features are cached and before Lightning
    starts the loggers (it sets the module and callbacks up after): a refusal of either is the one line, and no W&B
    run (wandb/, wandb_run_id) is left behind. None: no callback, a clip that leaves a layer nothing (the probe's)."""
    import probe
    from tests.tiny import save_tiny_encoder

    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    data = tmp_path / "l.csv"
    data.write_text("text,label\n" + "".join(f"{t.replace(',', ' ')},{i % 2}\n"
                                             for i, t in enumerate(corpus_sentences(30))), encoding="utf-8")
    out = tmp_path / "out"
    spec = {"class_path": "callbacks.contribution_vectors.ContributionVectors", "init_args": init_args}
    with pytest.raises(SystemExit) as exited:
        probe.cli_main(["fit", "--config", str(ROOT / "configs" / "probe" / f"{config}.yaml"), "--model.encoder",
                        str(encoder), "--data.source", str(data), "--data.random_baseline", "false",
                        "--data.progress", "false", "--trainer.accelerator", "cpu", "--trainer.logger",
                        "callbacks.wandb_logging.AutoWandbLogger", "--trainer.default_root_dir", str(out),
                        *(("--trainer.callbacks+", json.dumps(spec)) if init_args is not None else
                          ("--model.clip", ",".join(map(str, range(32)))))])
    assert exited.value.code == 2
    errors = [line for line in capfd.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(f"probe.py: error: {message}")
    assert not out.exists() or not [path for path in out.rglob("*") if path.is_file()]


class FailInCapturedStep(pl.Callback):
    """Test helper: raises inside training step `step` (a captured one), after its forward pass and before its
    backward, and remembers what the module's hidden-state tap held at that moment. Instances register in `made`."""

    made: list[FailInCapturedStep] = []

    def __init__(self, step: int = 2) -> None:
        self.step = step
        FailInCapturedStep.made.append(self)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if trainer.global_step == self.step:
            self.module, self.live = pl_module, [c for c in trainer.callbacks if isinstance(c, LiveCallback)]
            tap = pl_module.hidden_state_tap
            self.owners, self.kept = set(tap.owners), tap.hidden
            self.hooks = [len(module._forward_hooks) for module in encoder_layers(pl_module)]
            raise RuntimeError(f"planted failure in step {self.step}")


def test_an_error_inside_a_captured_step_releases_the_hidden_states(corpus, cache, tmp_path):
    FailInCapturedStep.made.clear()
    fail = json.dumps({"class_path": "tests.test_callbacks.FailInCapturedStep", "init_args": {"step": EVERY}})
    with pytest.raises(RuntimeError, match=f"planted failure in step {EVERY}"):
        train.cli_main(tiny_args(tmp_path / "run", corpus, cache, *callbacks(record=False), "--trainer.callbacks+",
                                 fail, logger="csv"))
    (failed,) = FailInCapturedStep.made
    tap = failed.module.hidden_state_tap
    assert len(failed.live) == 3 and failed.owners == {id(callback) for callback in failed.live}  # all had asked...
    assert len(failed.kept) == LAYERS and all(h.shape == (8, 32, 32) for h in failed.kept)  # ...and got the forward's
    assert failed.hooks == [len(module._forward_hooks) for module in encoder_layers(failed.module)]  # no hook added
    assert tap.owners == set() and tap.hidden is None and not any(callback._tapped for callback in failed.live)
    batch = {"input_ids": torch.randint(5, 100, (2, 8)), "positions": torch.tensor([[1], [2]]),
             "targets": torch.tensor([[7], [9]])}
    with torch.no_grad():  # a later forward pass: nobody asks, nothing is kept
        failed.module._shared_step(batch, "val")
    assert tap.hidden is None


def test_hooks_of_an_encoder_without_a_tap_keep_its_hidden_states_and_go_on_error(bert_tok, tmp_path):
    """Encoders other than MLMModule's are hooked for a captured batch: the states equal transformers' own
    `hidden_states`, and the hooks are removed even when the forward pass fails."""
    from transformers import AutoModel

    from core.capture import HiddenStateCapture
    from tests.tiny import save_tiny_encoder

    model = AutoModel.from_pretrained(save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)).eval()
    modules, ids = encoder_layers(model), torch.randint(5, 100, (2, 9))
    with torch.no_grad(), HiddenStateCapture(modules, [0, 2, 3]) as capture:
        expected = model(input_ids=ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(capture.stack(), torch.stack([expected[0], expected[2], expected[3]]), rtol=0, atol=0)
    hooks = [len(module._forward_hooks) for module in modules]  # transformers' own (inactive) hidden-state hooks
    with pytest.raises(RuntimeError, match="planted"), HiddenStateCapture(modules, [1, 2]):
        assert [len(module._forward_hooks) for module in modules] == [hooks[0], hooks[1] + 1, hooks[2] + 1, hooks[3]]
        raise RuntimeError("planted")
    assert [len(module._forward_hooks) for module in modules] == hooks


class LoggerSpy(pl.Callback):
    """Test helper: the trainer's loggers and each training step's loss. Instances register in `made`."""

    made: list[LoggerSpy] = []

    def __init__(self) -> None:
        self.loggers, self.losses = [], {}
        LoggerSpy.made.append(self)

    def on_fit_start(self, trainer, pl_module) -> None:
        self.loggers = list(trainer.loggers)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses[self.step] = float(outputs["loss"])


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:this run stops at step 2:UserWarning")  # a resume inside the warm-up, on purpose
def test_train_py_logs_to_offline_wandb_under_the_root_dir_by_default(corpus, cache, tmp_path):
    LoggerSpy.made.clear()
    root = tmp_path / "run"
    assert train.cli_main(tiny_args(root, corpus, cache, "--trainer.callbacks+", "tests.test_callbacks.LoggerSpy",
                                    "--trainer.max_steps", "2", logger=None)) == 0  # the config names no logger
    (spy,) = LoggerSpy.made
    (logger,) = spy.loggers
    assert type(logger) is AutoWandbLogger and Path(logger.save_dir) == root
    (directory,) = (root / "wandb").glob("offline-run-*")  # WANDB_MODE=offline (conftest): the run is kept there
    history = [row for row in read_run(directory).history if "train/loss" in row]
    assert {row["trainer/global_step"]: row["train/loss"] for row in history} == pytest.approx(spy.losses)
    assert sorted(spy.losses) == [0, 1]


def csv_rows(root: Path, key: str) -> dict[int, dict]:
    """{step: row} of the metrics.csv rows under `root` holding `key`, values as floats (one row per step)."""
    rows = {}
    for path in root.rglob("metrics.csv"):
        with path.open() as handle:
            for row in csv.DictReader(handle):
                if row.get(key):
                    assert int(row["step"]) not in rows
                    rows[int(row["step"])] = {k: float(v) for k, v in row.items() if v != ""}
    return rows


def test_csv_logger_gets_the_statistics_of_a_direct_computation(corpus, cache, tmp_path):
    Recorder.made.clear()
    root = tmp_path / "run"
    assert train.cli_main(tiny_args(root, corpus, cache, *callbacks(), "--trainer.max_steps", "4", logger="csv")) == 0
    (recorder,) = Recorder.made
    outliers = csv_rows(root, "outliers_by_layer/num_tokens")
    probe = csv_rows(root, "position_probe_by_layer/num_tokens")
    assert sorted(outliers) == sorted(probe) == sorted(recorder.train) == [0, 2]
    for step, (hidden, weight) in recorder.train.items():
        check_outliers(outliers[step], "outliers", direct_outliers(hidden, False), lists=False)
        check_probe(probe[step], "position_probe", direct_probe(hidden, weight))


def test_special_token_mass_counts_the_special_tokens_of_the_datas_tokenizer(cache, tmp_path, roberta_tok):
    """The live sinks' special tokens are the training data's tokenizer's (trainer.datamodule.tokenizer), by the rule
    of `analyze.py outliers`: a token added as special, written in the text (which the config's bos / eos / cls / sep
    ids never name), and <mask> count; [UNK] and the pad do not. The logged mass equals the eager attention's mass on
    exactly those ids, by hand, and the logger's hyperparameters say which ids and where they came from."""
    import yaml
    from transformers import AutoTokenizer

    roberta_tok.save_pretrained(tmp_path / "plain")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "plain")
    tokenizer.add_tokens(["<mark>"], special_tokens=True)  # special, yet not among all_special_ids
    tokenizer.save_pretrained(tmp_path / "tok")
    mark = tokenizer.convert_tokens_to_ids("<mark>")
    expected = sorted([tokenizer.convert_tokens_to_ids(t) for t in ("<s>", "</s>", "<mask>")] + [mark])  # by hand
    corpus = tmp_path / "marked.txt"
    corpus.write_text("\n".join(f"{s[:len(s) // 2]} <mark> {s[len(s) // 2:]}" for s in corpus_sentences(30)) + "\n",
                      encoding="utf-8")
    Recorder.made.clear()
    root = tmp_path / "run"
    assert train.cli_main(tiny_args(root, corpus, cache, *callbacks(), "--data.tokenizer", str(tmp_path / "tok"),
                                    "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--model.warmup_steps", "1",
                                    "--model.decay_steps", "2", logger="csv")) == 0
    (recorder,) = Recorder.made
    (hparams,) = root.rglob("hparams.yaml")
    setting = yaml.safe_load(hparams.read_text())
    assert setting["sinks/special_token_ids"] == expected
    assert setting["sinks/special_tokens"] == tokenizer.convert_ids_to_tokens(expected)
    assert setting["sinks/special_tokens_from"].startswith("the training data's tokenizer")
    stages = [("", 0, [recorder.attention[0]], recorder.ids[0]),
              ("val_", 1, recorder.val_attention, torch.cat(recorder.val_ids))]
    for prefix, step, records, ids in stages:
        assert (ids == mark).any()  # the planted token is in the batches the mass is taken over
        rows = csv_rows(root, f"{prefix}sinks_by_layer/layer_1/sink_share")
        probabilities = [torch.cat([r["probabilities"][layer] for r in records]) for layer in range(LAYERS - 1)]
        wanted = direct_sinks(probabilities, ids, tuple(expected))
        for layer, want in enumerate(wanted, 1):
            assert rows[step][f"{prefix}sinks_by_layer/layer_{layer}/special_token_mass"] == pytest.approx(
                want["special_token_mass"], abs=1e-5), (prefix, layer)


def test_without_a_tokenizer_the_sinks_take_the_configs_ids_and_say_so():
    """No datamodule tokenizer to reach (a model fitted on bare dataloaders): the config's bos / eos / cls / sep ids,
    its pad left out, and the setting says that added special tokens are not counted."""
    from types import SimpleNamespace

    from transformers import RobertaConfig

    from callbacks.attention_geometry import sink_special_ids

    config = RobertaConfig(pad_token_id=1, bos_token_id=0, eos_token_id=2, sep_token_id=1)  # sep = pad: left out
    for trainer in (SimpleNamespace(datamodule=None), SimpleNamespace(datamodule=SimpleNamespace(tokenizer=None))):
        ids, setting = sink_special_ids(trainer, config)
        assert ids == setting["sinks/special_token_ids"] == [0, 2]
        assert "added special tokens are not counted" in setting["sinks/special_tokens_from"]


class FlakyCSVLogger(CSVLogger):
    """Test helper: a CSV logger that fails to log the live statistics from step 2 on (Lightning's own metrics go
    through)."""

    def log_metrics(self, metrics, step=None) -> None:
        if step is not None and step >= 2 and any(key.startswith(("outliers", "position_probe")) for key in metrics):
            raise ConnectionError("the metrics server went away")
        super().log_metrics(metrics, step)


def test_a_non_wandb_logger_failing_mid_run_warns_once_and_training_goes_on(corpus, cache, tmp_path):
    root = tmp_path / "run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert short_fit(root, corpus, cache, logger="flaky") == 0  # captures at steps 0 and 2 of 4
    failures = [str(w.message) for w in caught if issubclass(w.category, LoggingWarning)]
    assert failures == ["FlakyCSVLogger failed to log metrics (ConnectionError: the metrics server went away); "
                        "training continues without it"]
    assert final_step(root) == 4
    assert sorted(csv_rows(root, "outliers_by_layer/num_tokens")) == \
        sorted(csv_rows(root, "position_probe_by_layer/num_tokens")) == [0]
    assert sorted(csv_rows(root, "train/loss")) == [0, 1, 2, 3]  # the logger itself still takes Lightning's metrics


@pytest.mark.slow
def test_validation_anisotropy_is_what_analyze_py_anisotropy_reports_on_the_same_sentences(bert_tok, tmp_path):
    """An eval-mode validation over a fine-tuning data module's validation split (several padded batches): the logged
    val_outliers_by_layer/layer_{l}/anisotropy equals `analyze.py anisotropy --clip none` on a file of the same sentences, in
    order, with the same seed: the same random token of each sentence and the same pairs (the paper's definition)."""
    import analyze
    from datamodules.finetune import FineTuneDataModule
    from lightning_modules.finetune import FineTuneModule
    from tests.test_finetune import labelled
    from tests.tiny import save_tiny_encoder

    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    module = FineTuneModule(encoder=str(encoder), classes=["comma", "plain"])
    data = FineTuneDataModule(source=str(labelled(tmp_path / "data.csv", count=200)), max_length=32,
                              eval_batch_size=6)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=CSVLogger(tmp_path, name="logs"),
                         callbacks=[OutlierStatistics(every_n_steps=1, image_every_n_steps=0)],
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.validate(module, datamodule=data, verbose=False)
    trainer.logger.save()
    (path,) = (tmp_path / "logs").glob("version_*/metrics.csv")
    with path.open() as handle:
        (row,) = [r for r in csv.DictReader(handle) if r.get("val_outliers_by_layer/layer_0/anisotropy")]

    sentences = [text for text, _ in data.splits.texts["val"]]
    assert len(sentences) == 20
    (tmp_path / "val.txt").write_text("\n".join(sentences) + "\n", encoding="utf-8")
    assert analyze.main(["anisotropy", "--encoder", str(encoder), "--data", str(tmp_path / "val.txt"),
                         "--max_sentences", "0", "--max_length", "32", "--clip", "none", "--seed", "0", "--no_progress",
                         "--device", "cpu", "--output_dir", str(tmp_path / "a")]) == 0
    report = json.loads((tmp_path / "a" / "anisotropy.json").read_text())
    assert report["num_pairs"] == 10 and report["num_sentences"] == 20
    for layer in report["layers"]:
        logged_value = float(row[f"val_outliers_by_layer/layer_{layer['layer']}/anisotropy"])
        assert logged_value == pytest.approx(layer["raw"], abs=2e-6), layer


def live_callbacks(layers: list[int] | None) -> list[str]:
    """The three live callbacks every 2 steps, watching `layers` (None: every layer)."""
    specs = []
    for module, name in (("outlier_statistics", "OutlierStatistics"), ("contribution_vectors", "ContributionVectors"),
                         ("attention_geometry", "AttentionGeometry")):
        init = {"every_n_steps": 2, "image_every_n_steps": 0, **({"layers": layers} if layers else {})}
        specs += ["--trainer.callbacks+", json.dumps({"class_path": f"callbacks.{module}.{name}", "init_args": init})]
    return specs


def test_callbacks_watching_one_layer_log_for_it_what_they_log_for_it_among_all(corpus, cache, tmp_path):
    """torchmetrics squeezes a one-element result ([1] -> []): with one watched layer, OutlierStatistics raised an
    IndexError at its first capture (metrics/base.py keeps the shapes). The same run watching layer 2 alone logs, for
    layer 2, what the run watching every layer logs for it (same seed, same batches), and its summaries over the watched
    layers are layer 2's own values."""
    logged_rows = {}
    for name, layers in (("all", None), ("one", [2])):
        assert train.cli_main(tiny_args(tmp_path / name, corpus, cache, *live_callbacks(layers),
                                        "--trainer.max_steps", "4", logger="csv")) == 0
        merged: dict[int, dict] = {}
        for key in ("outliers_by_layer/num_tokens", "position_probe_by_layer/num_tokens", "attention/entropy",
                    "sinks/sink_share"):  # each callback logs its own row of the step
            for step, row in csv_rows(tmp_path / name, key).items():
                merged.setdefault(step, {}).update(row)
        logged_rows[name] = merged
    every, one = logged_rows["all"], logged_rows["one"]
    assert sorted(every) == sorted(one) == [0, 2]
    for step, row in one.items():
        per_layer = {key for key in row if "/layer_" in key}
        assert {key.split("/layer_")[1].split("/")[0] for key in per_layer} == {"2"}
        assert {key.split("/")[0] for key in per_layer} == {"outliers_by_layer", "position_probe_by_layer",
                                                             "attention_by_layer", "sinks_by_layer"}
        assert {key: row[key] for key in per_layer} == pytest.approx({key: every[step][key] for key in per_layer},
                                                                     rel=1e-5, abs=1e-7)
        for summary, layer_key in (("outliers/kurtosis", "outliers_by_layer/layer_2/kurtosis"),
                                   ("outliers/max_abs", "outliers_by_layer/layer_2/max_abs"),
                                   ("position_probe/accuracy", "position_probe_by_layer/layer_2/accuracy"),
                                   ("sinks/first_token_mass", "sinks_by_layer/layer_2/first_token_mass"),
                                   ("attention/qk_mean_cosine", "attention_by_layer/layer_2/qk_mean_cosine")):
            assert row[summary] == pytest.approx(row[layer_key], rel=1e-6), summary


def test_a_validation_set_of_one_sequence_logs_no_anisotropy_rather_than_nan(corpus, cache, tmp_path, recwarn):
    """The anisotropy pairs random tokens of different sequences: one validation sequence has no pair. It logged
    val_outliers/anisotropy = nan in every layer; now it is left out with a warning, and the rest of the validation
    capture is logged: its token count is the one sequence's block length (32), and every value is finite."""
    spec = {"class_path": "callbacks.outlier_statistics.OutlierStatistics",
            "init_args": {"every_n_steps": 2, "image_every_n_steps": 0}}
    assert train.cli_main(tiny_args(tmp_path, corpus, cache, "--trainer.callbacks+", json.dumps(spec),
                                    "--data.max_val_blocks", "1", "--trainer.max_steps", "2",
                                    "--trainer.val_check_interval", "2", logger="csv")) == 0
    rows = csv_rows(tmp_path, "val_outliers_by_layer/num_tokens")
    assert len(rows) == 1
    (row,) = rows.values()
    assert row["val_outliers_by_layer/num_tokens"] == 32  # --data.block_length 32, one block
    assert not [key for key in row if "anisotropy" in key]
    assert all(math.isfinite(value) for value in row.values()) and "val_outliers/kurtosis" in row
    assert any("OutlierStatistics: the validation set has 1 sequence(s): its anisotropy needs 2" in str(w.message)
               for w in recwarn)


# ---- the W&B view: every key documented, the config, the summary, one x axis ----

def documented_keys(layers: range, attention_layers: range, top_k: int) -> set[str]:
    """docs/live-statistics.md's "Every key" table, expanded: {l} over the layers (AttentionGeometry's and the sinks'
    over theirs), {i} over 1..top_k, and a `val_` copy of every key marked *both*."""
    text = (ROOT / "docs" / "live-statistics.md").read_text(encoding="utf-8")
    table = text.split("\n## Every key\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| (as is|both|val only) \|", table, re.M)
    assert len(rows) > 60, "the doc's key table is not where the test reads it"
    keys = set()
    for key, when in rows:
        for prefix in ("", "val_") if when == "both" else ("",):
            for layer in (attention_layers if key.startswith(("attention", "sinks")) else layers) if "{l}" in key \
                    else [None]:
                for i in range(1, top_k + 1) if "{i}" in key else [None]:
                    keys.add(prefix + key.format(l=layer, i=i))
    return keys


def panel_keys(run) -> set[str]:
    """Every key a run logged, an image's or table's fields as its one key, without W&B's own (_step, ...)."""
    keys = set()
    for row in run.history:
        media = {key.rsplit("/", 1)[0] for key in row if key.endswith("/_type")}
        keys |= {next((name for name in media if key.startswith(name + "/")), key) for key in row
                 if not key.startswith("_")}
    return keys


def test_every_key_logged_is_in_the_docs_key_table_and_every_key_there_is_logged(single):
    run, _, _ = single
    documented = documented_keys(range(LAYERS), range(1, LAYERS), top_k=3)
    logged = panel_keys(run)
    assert sorted(logged - documented) == [] and sorted(documented - logged) == []
    assert not [key for key in logged if re.search(r"layer\d", key)]  # one spelling: layer_{l}


def test_wandb_config_is_the_runs_resolved_config_and_the_table_is_logged_once_per_validation(single):
    """The run's config is config.yaml's (every section, each callback's options, the seed) with the versions; its
    name is the run directory's, its job type `pretrain`; the outlier table comes at each validation, not again at
    the end when no row came since, holding a row per layer of each image step and validation."""
    import importlib.metadata

    import yaml

    from core.run_config import PACKAGES

    run, _, root = single
    written = yaml.safe_load((root / "config.yaml").read_text(encoding="utf-8"))
    for section in ("model", "data", "trainer", "seed_everything", "checkpoint", "ckpt_path"):
        assert run.config[section] == written[section], section
    assert run.config["trainer"]["max_steps"] == STEPS
    assert [c["init_args"]["every_n_steps"] for c in run.config["trainer"]["callbacks"]] == [EVERY] * 4
    for name in PACKAGES:
        assert run.config["versions"][name] == importlib.metadata.version(name)
    assert run.name == "/".join(root.parts[-2:]) and run.job_type == "pretrain"
    table = [row for row in run.history if "outliers_by_layer/table/_type" in row]
    assert [row["trainer/global_step"] for row in table] == [VAL_STEP]
    image_steps = [step for step in range(0, STEPS, EVERY) if step % IMAGES == 0]
    assert table[0]["outliers_by_layer/table/nrows"] == LAYERS * (len(image_steps) + 1)


def test_summary_keeps_the_best_and_the_last_val_loss(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = AutoWandbLogger(save_dir=str(tmp_path))
    losses = [3.5, 1.25, 2.0]
    for step, loss in enumerate(losses):
        logger.log_metrics({"val/loss": loss}, step=step)
    logger.finalize("success")
    (directory,) = (tmp_path / "wandb").glob("offline-run-*")
    run = read_run(directory)
    assert run.values("val/loss") == losses
    assert run.summary["val/loss"] == {"min": min(losses), "last": losses[-1]}


def test_a_probe_py_run_logs_the_live_probe_on_the_x_axis_of_its_own_loss(tmp_path, bert_tok):
    """probe.py's blocks take several optimizer steps (--data.steps_per_block 3): the live probe is captured every
    2nd trainer step, the step `train/loss` is logged at, over both epochs; the probes' accuracies are keyed
    `<stage>_by_layer/layer_{l}/...` as the live statistics are; the W&B run is named and typed."""
    import probe
    from tests.tiny import save_tiny_encoder

    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    data = tmp_path / "s.txt"
    data.write_text("\n".join(corpus_sentences(40)) + "\n", encoding="utf-8")
    out = tmp_path / "probe" / "arm"
    spec = {"class_path": "callbacks.contribution_vectors.ContributionVectors",
            "init_args": {"every_n_steps": 2, "image_every_n_steps": 0}}
    logger = {"class_path": "callbacks.wandb_logging.AutoWandbLogger"}
    probe.cli_main(["fit", "--config", str(ROOT / "configs" / "probe" / "position.yaml"), "--model.encoder",
                    str(encoder), "--data.source", str(data), "--data.batch_size", "16", "--data.steps_per_block", "3",
                    "--data.random_baseline", "false", "--data.progress", "false", "--trainer.max_epochs", "2",
                    "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
                    "--trainer.log_every_n_steps", "1", "--trainer.logger", json.dumps(logger),
                    "--trainer.default_root_dir", str(out), "--trainer.callbacks+", json.dumps(spec)])
    first, second = (read_run(d) for d in sorted((out / "wandb").glob("offline-run-*")))  # fit, then test
    steps = [row["trainer/global_step"] for row in first.history if "train/loss" in row]
    assert steps == list(range(len(steps))) and len(steps) >= 6  # every trainer step, over both epochs
    captured = [row["trainer/global_step"] for row in first.history if "position_probe/accuracy" in row]
    assert captured == [step for step in steps if step % 2 == 0]
    validations = [row["trainer/global_step"] for row in first.history if "val/loss" in row]
    assert [row["trainer/global_step"] for row in first.history if "val_position_probe/accuracy" in row] == \
        validations and len(validations) == 2
    layers = range(4)  # the tiny encoder's embedding output and its 3 layers
    for run, stage in ((first, "val"), (second, "test")):
        keys = panel_keys(run)
        assert {f"{stage}_by_layer/layer_{layer}/{kind}" for layer in layers
                for kind in ("accuracy", "control_accuracy")} <= keys
        assert not [key for key in keys if re.search(r"layer\d", key)] and "train/loss_step" not in keys
        assert (run.name, run.job_type) == ("probe/arm", "probe")


class PlantedOutlierModule(pl.LightningModule):
    """A tiny BERT whose every layer's output LayerNorm adds +8 to one dimension and -8 to another: those two are
    every token's maximum and minimum in every layer, the outliers OutlierStatistics must find."""

    PLANTED = (5, 11)

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        torch.manual_seed(0)
        self.encoder = BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                            intermediate_size=32, max_position_embeddings=16))
        self.max_length = 8
        with torch.no_grad():
            for layer in self.encoder.encoder.layer:
                layer.output.LayerNorm.bias[self.PLANTED[0]] += 8.0
                layer.output.LayerNorm.bias[self.PLANTED[1]] -= 8.0

    def training_step(self, batch, batch_idx):
        return self.encoder(input_ids=batch[0]).last_hidden_state.pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def live_heatmap(tmp_path, monkeypatch, *others) -> tuple:
    """The contribution heatmap ContributionVectors submits at step 0 of a one-step run of PlantedOutlierModule beside
    `others` (made here, not drawn by the worker), and the numbers drawn above it in red."""
    from pytorch_lightning.loggers import TensorBoardLogger

    from callbacks.media import FIGURES
    from core.figure_style import OUTLIER_RED

    submitted = {}
    monkeypatch.setattr(FIGURES, "submit", lambda trainer, key, make, step: submitted.setdefault(key, make))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randint(3, 50, (4, 8))), batch_size=4)
    trainer = pl.Trainer(max_steps=1, logger=TensorBoardLogger(str(tmp_path)), enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[*others, ContributionVectors(every_n_steps=1, image_every_n_steps=1)])
    trainer.fit(PlantedOutlierModule(), data)
    fig = submitted["position_probe/contributions"]()
    (ax,) = [ax for ax in fig.axes if not hasattr(ax, "_colorbar")]
    numbers = sorted(int(n) for text in ax.texts if text.get_color() == OUTLIER_RED
                     for n in text.get_text().split(", "))
    return ax, numbers


def check_chance_in_the_summary(reading: dict, tokens: int, width: int) -> None:
    """A capture of 32 token vectors of width 16: a dim needs 7 of them (20%), which chance alone gives some dim with
    probability up to 2 x 16 x P(Binomial(32, 1 / 16) >= 7) ~ 0.1 (summed here); the verdict holds it, and the run's
    summary says it on one line of its own (the live callback logs no metric for it)."""
    from callbacks.summary import summary_lines

    tail = sum(math.comb(tokens, k) * width ** -k * (1 - 1 / width) ** (tokens - k) for k in range(7, tokens + 1))
    assert reading["num_tokens"] == tokens and reading["chance_bound"] == pytest.approx(2 * width * tail, rel=1e-12)
    assert 0.01 < reading["chance_bound"] < 1 and f"rested on {tokens} token vectors" in reading["chance_warning"]
    summary = {"step": 1, "run_dir": "run", "export": None, "checkpoint": None, "wandb": None, "validation": None,
               "no_validation": "--trainer.limit_val_batches 0", "outliers": reading}
    lines = summary_lines(summary)
    assert lines[-1] == f"  chance       {reading['chance_warning']}" and lines[-2].startswith("  outliers     ")
    assert summary_lines({**summary, "outliers": {**reading, "chance_warning": None}}) == lines[:-1]


def test_live_contribution_heatmap_numbers_the_outlier_dims_outlier_statistics_found(tmp_path, monkeypatch):
    """Beside OutlierStatistics the live heatmap numbers exactly its persistent outlier dims (the planted two) above the
    panel, as probe.py's heatmap does; without it, no number."""
    outliers = OutlierStatistics(every_n_steps=1, image_every_n_steps=0)
    ax, numbers = live_heatmap(tmp_path / "with", monkeypatch, outliers)
    assert sorted(outliers.last["persistent_dims"]) == sorted(PlantedOutlierModule.PLANTED)
    check_chance_in_the_summary(outliers.last, tokens=4 * 8, width=16)
    assert numbers == sorted(PlantedOutlierModule.PLANTED)
    assert "persistent outlier dims" in ax.get_title()
    ax, numbers = live_heatmap(tmp_path / "without", monkeypatch)
    assert numbers == [] and "outlier" not in ax.get_title()
