"""NeuronStatistics against a direct computation on the materialised tensors, in one process and under DDP."""

from __future__ import annotations

import os

import numpy as np
import pytest
import scipy.stats
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from metrics.neuron_stats import NeuronStatistics
from tests.tiny import free_port

LAYERS, HIDDEN = 3, 16


def random_batches(seed: int, n: int = 5):
    """Batches [layers, batch, seq, hidden] with ragged masks, one dimension huge with a tiny spread."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        batch, seq = 4, int(torch.randint(3, 9, (1,), generator=generator))
        hidden = torch.randn(LAYERS, batch, seq, HIDDEN, generator=generator)
        hidden[:, :, :, 7] = 1000.0 + 0.01 * hidden[:, :, :, 7]  # mean dwarfs spread: catastrophic cancellation bait
        mask = torch.rand(batch, seq, generator=generator) > 0.3
        batches.append((hidden, mask))
    return batches


def direct(batches):
    tokens = torch.cat([hidden[:, mask] for hidden, mask in batches], dim=1).double()  # [layers, N, hidden]
    argmax = torch.stack([torch.bincount(t.argmax(-1), minlength=HIDDEN) for t in tokens]).double()  # no ties here
    argmin = torch.stack([torch.bincount(t.argmin(-1), minlength=HIDDEN) for t in tokens]).double()
    return tokens.shape[1], tokens.mean(1), tokens.var(1, unbiased=False), tokens.abs().amax(1), argmax, argmin


def direct_magnitudes(batches):
    """Per layer, from the materialised token vectors with scipy: mean and max over tokens of the Pearson kurtosis of
    each vector's components, the max |activation|, and the mean share of the top-1 component in the squared norm."""
    tokens = torch.cat([hidden[:, mask] for hidden, mask in batches], dim=1).double().numpy()  # [layers, N, hidden]
    kurt = scipy.stats.kurtosis(tokens, axis=-1, fisher=False)  # [layers, N]
    share = (tokens ** 2).max(-1) / (tokens ** 2).sum(-1)
    return {"kurtosis_mean": kurt.mean(1), "kurtosis_max": kurt.max(1), "layer_max_abs": np.abs(tokens).max((1, 2)),
            "top1_share_mean": share.mean(1)}


def assert_magnitudes(values: dict, batches) -> None:
    for key, expected in direct_magnitudes(batches).items():
        np.testing.assert_allclose(np.asarray(values[key]), expected, rtol=1e-4, err_msg=key)


def assert_matches(result, expected):
    count, mean, var, max_abs, argmax, argmin = expected
    assert result.num_tokens == count
    torch.testing.assert_close(result.mean, mean, rtol=0, atol=1e-9)
    torch.testing.assert_close(result.var, var, rtol=1e-4, atol=1e-10)
    torch.testing.assert_close(result.max_abs, max_abs, rtol=1e-6, atol=1e-6)
    assert torch.equal(result.argmax_count, argmax)
    assert torch.equal(result.argmin_count, argmin)
    torch.testing.assert_close(result.argmax_share, argmax.double() / count)  # the share of the tokens, by hand
    torch.testing.assert_close(result.argmin_share, argmin.double() / count)


def split_ties(tokens: torch.Tensor, largest: bool) -> torch.Tensor:
    """[hidden] counts of tokens [N, hidden] by hand, one token at a time: 1 / k on each of the k dims that hold its
    largest (smallest) value."""
    counts = torch.zeros(tokens.shape[-1], dtype=torch.float64)
    for vector in tokens.tolist():
        extreme = max(vector) if largest else min(vector)
        holders = [d for d, value in enumerate(vector) if value == extreme]
        for d in holders:
            counts[d] += 1 / len(holders)
    return counts


def test_a_tie_for_the_max_or_min_is_split_among_its_dims_not_given_to_the_lowest_index():
    from metrics.outliers import OutlierRule, detect_outliers

    generator = torch.Generator().manual_seed(3)
    hidden = 8
    tied = torch.tensor([2.0, 2.0, 0.0, 0.5, -1.0, 0.25, -1.0, 0.0]).expand(3, hidden)  # dims 0, 1 hold the max
    spread = torch.randn(9, hidden, generator=generator) * 0.1
    spread[torch.arange(9), 2 + torch.arange(9) % 6] = 1.0  # the max of the others on dims 2..7, one or two each
    coarse = torch.randn(40, hidden, generator=generator).bfloat16().float()  # bf16: some ties of their own
    tokens = torch.cat([tied, spread, torch.zeros(1, hidden), coarse])[None]  # [1 layer, 53 tokens, hidden]
    metric = NeuronStatistics(1, hidden)
    metric.update(tokens)
    result = metric.compute()
    torch.testing.assert_close(result.argmax_count[0], split_ties(tokens[0], largest=True), rtol=0, atol=1e-12)
    torch.testing.assert_close(result.argmin_count[0], split_ties(tokens[0], largest=False), rtol=0, atol=1e-12)
    assert float(result.argmax_count.sum()) == pytest.approx(53) and float(result.argmin_count.sum()) == pytest.approx(53)
    # the tied tokens alone: half a token each to dims 0 and 1, so the rule flags neither (torch's argmax: dim 0 only)
    alone = NeuronStatistics(1, hidden)
    alone.update(torch.cat([tied, spread])[None])
    counts = alone.compute()
    assert counts.argmax_count[0, :2].tolist() == [1.5, 1.5] and counts.argmax_share[0, 0] == 1.5 / 12  # not 3 / 12
    assert not {0, 1} & set(detect_outliers(counts, OutlierRule(min_share=0.2))[0].outlier_dims)


def test_streaming_equals_direct_computation():
    batches = random_batches(0)
    metric = NeuronStatistics(LAYERS, HIDDEN)
    for hidden, mask in batches:
        metric.update(hidden, mask)
    result = metric.compute()
    assert_matches(result, direct(batches))
    # The planted dimension's variance is 1e-4 around a mean of 1000: float32 sums of squares would lose it.
    assert result.var[:, 7].min() > 0.5e-4 and result.var[:, 7].max() < 2e-4
    assert_magnitudes({key: getattr(result, key) for key in MAGNITUDES}, batches)


MAGNITUDES = ("kurtosis_mean", "kurtosis_max", "layer_max_abs", "top1_share_mean")


def test_planted_outlier_magnitudes_by_hand():
    # One token vector a·e_3 of h components: mean a/h, m2 = a²(h-1)/h², m4 = a⁴((h-1)⁴ + h-1)/h⁵, so its kurtosis is
    # (h² - 3h + 3)/(h - 1) whatever a; all its squared norm is on one component (share 1). A second token alternates
    # ±1 (kurtosis 1, share 1/h). A constant vector counts kurtosis 0, share 1/h.
    a, h = 250.0, HIDDEN
    spike = torch.zeros(h)
    spike[3] = a
    flat = torch.tensor([1.0, -1.0]).repeat(h // 2)
    constant = torch.full((h,), 2.0)
    hidden = torch.stack([spike, flat, constant]).expand(LAYERS, 3, h)  # [layers, tokens, hidden]
    metric = NeuronStatistics(LAYERS, HIDDEN)
    metric.update(hidden.contiguous())
    result = metric.compute()
    spike_kurtosis = (h * h - 3 * h + 3) / (h - 1)  # 14.0667 for h = 16
    torch.testing.assert_close(result.kurtosis_max, torch.full((LAYERS,), spike_kurtosis, dtype=torch.float64))
    torch.testing.assert_close(result.kurtosis_mean, torch.full((LAYERS,), (spike_kurtosis + 1 + 0) / 3,
                                                                dtype=torch.float64))
    torch.testing.assert_close(result.layer_max_abs, torch.full((LAYERS,), a, dtype=torch.float64))
    torch.testing.assert_close(result.top1_share_mean, torch.full((LAYERS,), (1 + 2 / h) / 3, dtype=torch.float64))
    # Gaussian components: kurtosis near 3.
    gaussian = NeuronStatistics(1, 512)
    gaussian.update(torch.randn(1, 2000, 512, generator=torch.Generator().manual_seed(0)))
    assert abs(gaussian.compute().kurtosis_mean.item() - 3.0) < 0.05


def test_state_size_does_not_grow_with_tokens():
    metric = NeuronStatistics(LAYERS, HIDDEN)
    sizes = []
    for hidden, mask in random_batches(1, n=6):
        metric.update(hidden, mask)
        sizes.append(sum(state.numel() for state in metric.metric_state.values()))
    assert len(set(sizes)) == 1 and sizes[0] == 1 + 5 * LAYERS * HIDDEN + 3 * LAYERS + 1 + 2 * LAYERS  # + sequences


def test_rejects_mismatched_shapes():
    metric = NeuronStatistics(LAYERS, HIDDEN)
    with pytest.raises(ValueError, match="do not match"):
        metric.update(torch.zeros(LAYERS + 1, 2, 3, HIDDEN), torch.ones(2, 3, dtype=torch.bool))


def _ddp_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        metric = NeuronStatistics(LAYERS, HIDDEN)
        for hidden, mask in random_batches(0)[rank::world]:  # uneven token counts per rank
            metric.update(hidden, mask)
        result = metric.compute()
        if rank == 0:
            torch.save({key: getattr(result, key) for key in ("num_tokens", "mean", "var", "max_abs", "argmax_count",
                                                              "argmin_count", *MAGNITUDES)}, out)
    finally:
        dist.destroy_process_group()


def test_ddp_two_processes_equal_one(tmp_path):
    out = str(tmp_path / "synced.pt")
    mp.start_processes(_ddp_worker, args=(2, free_port(), out), nprocs=2, start_method="spawn", join=True)
    synced = torch.load(out)
    count, mean, var, max_abs, argmax, argmin = direct(random_batches(0))
    assert synced["num_tokens"] == count
    torch.testing.assert_close(synced["mean"], mean, rtol=0, atol=1e-9)
    torch.testing.assert_close(synced["var"], var, rtol=1e-4, atol=1e-10)
    torch.testing.assert_close(synced["max_abs"], max_abs, rtol=1e-6, atol=1e-6)
    assert torch.equal(synced["argmax_count"], argmax) and torch.equal(synced["argmin_count"], argmin)
    assert_magnitudes(synced, random_batches(0))  # sums and maxima of the magnitudes synced: the one-process values


def test_float64_sums_cast_one_layer_at_a_time(monkeypatch):
    """torch's sum(dtype=float64) casts its whole input to float64 first: a batch of 32 x 512 bert-base tokens made a
    1 GB copy in NeuronStatistics and Covariance. Every float64 sum of their updates now reads at most one layer's
    tokens (recorded by a wrapped Tensor.sum), and the statistics equal float64 sums taken directly."""
    from metrics.geometry import Covariance

    torch.manual_seed(0)
    layers, hidden = 5, 16
    states = torch.randn(layers, 3, 9, hidden) * 4 + 2
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[1, 6:] = mask[2, 3:] = False
    tokens = states[:, mask]  # [layers, 18, hidden]
    cast, original = [], torch.Tensor.sum

    def recording(self, *args, **kwargs):
        if kwargs.get("dtype") == torch.float64 and self.dtype != torch.float64:
            cast.append(self.numel())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "sum", recording)
    stats, covariance = NeuronStatistics(layers, hidden), Covariance(layers, hidden)
    stats.update(states, mask)
    covariance.update(states, mask)
    monkeypatch.undo()
    assert cast and max(cast) <= states[0].numel()  # one layer of the batch at most, never every layer at once
    direct = tokens.double()
    result, moments = stats.compute(), covariance.compute()
    torch.testing.assert_close(result.mean, direct.mean(1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(result.var, direct.var(1, unbiased=False), rtol=1e-6, atol=1e-6)  # float32 squares
    torch.testing.assert_close(moments.mean, direct.mean(1), rtol=1e-12, atol=1e-12)
    centred = direct - direct.mean(1, keepdim=True)
    torch.testing.assert_close(moments.cov, centred.transpose(1, 2) @ centred / tokens.shape[1], rtol=1e-6, atol=1e-6)
