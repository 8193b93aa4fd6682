"""NeuronStatistics against a direct computation on the materialised tensors, in one process and under DDP."""

from __future__ import annotations

import os

import pytest
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
    argmax = torch.stack([torch.bincount(t.argmax(-1), minlength=HIDDEN) for t in tokens])
    argmin = torch.stack([torch.bincount(t.argmin(-1), minlength=HIDDEN) for t in tokens])
    return tokens.shape[1], tokens.mean(1), tokens.var(1, unbiased=False), tokens.abs().amax(1), argmax, argmin


def assert_matches(result, expected):
    count, mean, var, max_abs, argmax, argmin = expected
    assert result.num_tokens == count
    torch.testing.assert_close(result.mean, mean, rtol=0, atol=1e-9)
    torch.testing.assert_close(result.var, var, rtol=1e-4, atol=1e-10)
    torch.testing.assert_close(result.max_abs, max_abs, rtol=1e-6, atol=1e-6)
    assert torch.equal(result.argmax_count, argmax)
    assert torch.equal(result.argmin_count, argmin)
    torch.testing.assert_close(result.argmax_share.sum(1), torch.ones(LAYERS, dtype=torch.float64))


def test_streaming_equals_direct_computation():
    batches = random_batches(0)
    metric = NeuronStatistics(LAYERS, HIDDEN)
    for hidden, mask in batches:
        metric.update(hidden, mask)
    result = metric.compute()
    assert_matches(result, direct(batches))
    # The planted dimension's variance is 1e-4 around a mean of 1000: float32 sums of squares would lose it.
    assert result.var[:, 7].min() > 0.5e-4 and result.var[:, 7].max() < 2e-4


def test_state_size_does_not_grow_with_tokens():
    metric = NeuronStatistics(LAYERS, HIDDEN)
    sizes = []
    for hidden, mask in random_batches(1, n=6):
        metric.update(hidden, mask)
        sizes.append(sum(state.numel() for state in metric.metric_state.values()))
    assert len(set(sizes)) == 1 and sizes[0] == 1 + 5 * LAYERS * HIDDEN


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
            torch.save({key: getattr(result, key) for key in ("num_tokens", "mean", "var", "max_abs",
                                                              "argmax_count", "argmin_count")}, out)
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
