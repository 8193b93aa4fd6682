"""Token frequency against outlier magnitude (metrics/frequency.py, `analyze.py outliers --token_frequency`): the
streamed per-type sums against a direct computation with numpy / scipy, a planted frequency-driven outlier, DDP.

    .venv/bin/pytest tests/test_frequency.py -q
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections import Counter

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from scipy.stats import spearmanr

import analyze
from lightning_modules.encoder import load_encoder
from metrics.frequency import TokenDimensionMagnitude, frequency_correlation
from tests.tiny import free_port, save_tiny_encoder

LAYERS, HIDDEN, VOCAB = 3, 8, 20
PAIRS = [(0, 2), (1, 5), (2, 2)]


def random_batches(seed: int, n: int = 4):
    """([layers, batch, seq, hidden], ids [batch, seq], ragged mask [batch, seq]) with Zipf-like ids."""
    generator = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, VOCAB + 1, dtype=torch.float)
    out = []
    for _ in range(n):
        batch, seq = 3, int(torch.randint(4, 9, (1,), generator=generator))
        ids = torch.multinomial(weights, batch * seq, replacement=True, generator=generator).view(batch, seq)
        hidden = torch.randn(LAYERS, batch, seq, HIDDEN, generator=generator)
        out.append((hidden, ids, torch.rand(batch, seq, generator=generator) > 0.25))
    return out


def direct(batches):
    """Per type: count, and mean |value| of each pair over its tokens; Spearman by scipy over the types seen."""
    values = {pair: [] for pair in PAIRS}
    ids = []
    for hidden, batch_ids, mask in batches:
        ids += batch_ids[mask].tolist()
        for layer, dim in PAIRS:
            values[layer, dim] += hidden[layer][mask][:, dim].abs().tolist()
    counts = Counter(ids)
    types = sorted(counts)
    means = {pair: [np.mean([v for v, i in zip(values[pair], ids) if i == t]) for t in types] for pair in PAIRS}
    rho = [spearmanr([counts[t] for t in types], means[pair]).statistic for pair in PAIRS]
    return counts, types, means, rho


def streamed(batches) -> tuple[torch.Tensor, torch.Tensor]:
    metric = TokenDimensionMagnitude(VOCAB, PAIRS)
    for hidden, ids, mask in batches:
        metric.update(hidden, ids, mask)
    return metric.compute()


def test_streamed_sums_and_correlation_equal_a_direct_computation():
    batches = random_batches(0)
    count, mean = streamed(batches)
    counts, types, means, rho = direct(batches)
    assert count.tolist() == [counts.get(t, 0) for t in range(VOCAB)]
    for k, pair in enumerate(PAIRS):
        np.testing.assert_allclose(mean[types, k].numpy(), means[pair], rtol=1e-6)
    np.testing.assert_allclose(frequency_correlation(count, mean).numpy(), rho, rtol=1e-9)
    # state size: [vocab] + [vocab, pairs], whatever the number of tokens
    metric = TokenDimensionMagnitude(VOCAB, PAIRS)
    assert sum(s.numel() for s in metric.metric_state.values()) == VOCAB * (1 + len(PAIRS))


def test_planted_frequency_driven_magnitude_correlates_perfectly():
    # dim 2 of layer 0 carries log(1 + count) of the token's type: rho = 1; dim 5 of layer 1 carries its inverse: -1
    batches = random_batches(1)
    counts = Counter(i for _, ids, mask in batches for i in ids[mask].tolist())
    scale = torch.tensor([math.log1p(counts.get(t, 0)) for t in range(VOCAB)])
    for hidden, ids, _ in batches:
        hidden[0, :, :, 2] = 5 * scale[ids]
        hidden[1, :, :, 5] = 1 / (1 + scale[ids])
    rho = frequency_correlation(*streamed(batches))
    assert rho[0].item() == pytest.approx(1.0) and rho[1].item() == pytest.approx(-1.0)


def _ddp_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        metric = TokenDimensionMagnitude(VOCAB, PAIRS)
        for hidden, ids, mask in random_batches(0)[rank::world]:
            metric.update(hidden, ids, mask)
        count, mean = metric.compute()
        if rank == 0:
            torch.save({"count": count, "mean": mean}, out)
    finally:
        dist.destroy_process_group()


def test_ddp_two_processes_equal_one(tmp_path):
    out = str(tmp_path / "synced.pt")
    mp.start_processes(_ddp_worker, args=(2, free_port(), out), nprocs=2, start_method="spawn", join=True)
    synced = torch.load(out)
    count, mean = streamed(random_batches(0))
    assert torch.equal(synced["count"], count)
    torch.testing.assert_close(synced["mean"], mean, rtol=1e-12, atol=1e-12)


DIM = 11


@pytest.mark.slow
def test_outliers_report_correlation_equals_a_recomputation_from_the_hidden_states(sentences_file, tmp_path,
                                                                                  bert_tok):
    """A tiny BERT whose word embeddings carry log(1 + frequency) of each type on DIM (so DIM is the embedding
    output's outlier, driven by frequency): the report's rho per (layer, dim) equals scipy's on the hidden states."""
    sentences = sentences_file.read_text().splitlines()
    counts = Counter(i for s in sentences for i in bert_tok(s)["input_ids"])

    def plant(model):
        for token, count in counts.items():
            model.embeddings.word_embeddings.weight[token, DIM] = 0.5 + 0.5 * math.log1p(count)

    path = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok, plant=plant)
    out = tmp_path / "out"
    assert analyze.main(["outliers", "--encoder", str(path), "--data", str(sentences_file), "--output_dir", str(out),
                         "--max_sentences", "0", "--no_progress", "--token_frequency"]) == 0
    report = json.loads((out / "outliers.json").read_text())["token_frequency"]
    assert report["dims"] and (0, DIM) in [(row["layer"], row["dim"]) for row in report["dims"]]
    encoder = load_encoder(str(path), device="cpu")
    ids, hidden = [], []
    with warnings.catch_warnings():  # the truncation warning: the report says it, as the analysis truncates alike
        warnings.simplefilter("ignore", UserWarning)
        for batch in encoder.batches(sentences, 32, None, progress=False):
            ids += batch.input_ids[batch.mask].tolist()
            hidden.append(batch.hidden_states[:, batch.mask].double())  # [layers, tokens, hidden]
    hidden = torch.cat(hidden, 1).numpy()
    ids = np.array(ids)
    types, type_counts = np.unique(ids, return_counts=True)
    assert report["num_types"] == len(types)
    for row in report["dims"]:
        magnitude = [np.abs(hidden[row["layer"], ids == t, row["dim"]]).mean() for t in types]
        assert row["spearman"] == pytest.approx(spearmanr(type_counts, magnitude).statistic, abs=1e-6), row
        assert row["most_frequent"][0]["count"] == type_counts.max()
    planted = next(row for row in report["dims"] if (row["layer"], row["dim"]) == (0, DIM))
    assert planted["spearman"] > 0.8  # the planted dependence survives the embedding LayerNorm (and the truncation)
