"""Contribution vectors and per-layer accuracy: streaming sums equal a direct computation, in one process and two."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from metrics.contributions import Contributions, LayerAccuracy, rank_dims
from tests.tiny import free_port

LAYERS, HIDDEN, POSITIONS = 3, 8, 6


def batches(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Uneven batches of (features [layers, tokens, hidden], positions [tokens]), some positions out of range."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for tokens in (5, 11, 1, 7, 9):
        features = torch.randn(LAYERS, tokens, HIDDEN, generator=generator)
        positions = torch.randint(-1, POSITIONS + 2, (tokens,), generator=generator)
        out.append((features, positions))
    return out


def weight() -> torch.Tensor:
    return torch.randn(LAYERS, HIDDEN, POSITIONS, generator=torch.Generator().manual_seed(7))


def direct(data, w):
    """Mean |w[l, i, gold] * v_i| by explicit loops over tokens."""
    total, count = torch.zeros(LAYERS, HIDDEN, dtype=torch.float64), 0
    by_position = torch.zeros(LAYERS, POSITIONS, HIDDEN, dtype=torch.float64)
    counts = torch.zeros(POSITIONS, dtype=torch.float64)
    for features, positions in data:
        for t, p in enumerate(positions.tolist()):
            if not 0 <= p < POSITIONS:
                continue
            for layer in range(LAYERS):
                c = (w[layer, :, p] * features[layer, t]).abs().double()
                total[layer] += c
                by_position[layer, p] += c
            counts[p] += 1
            count += 1
    return total / count, by_position / counts.clamp_min(1)[None, :, None], counts


def test_contributions_equal_direct_computation_across_batches_and_chunks():
    data, w = batches(0), weight()
    metric = Contributions(LAYERS, HIDDEN, POSITIONS)
    metric.chunk = 4  # several chunks per batch
    for features, positions in data:
        metric.update(features, w, positions)
    result = metric.compute()
    mean, by_position, counts = direct(data, w)
    assert result.num_tokens == int(counts.sum())
    torch.testing.assert_close(result.mean, mean, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(result.by_position, by_position, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(result.position_counts, counts)


def test_layer_accuracy_and_rank_dims_by_hand():
    logits = torch.tensor([[[2.0, 1.0], [0.0, 3.0], [0.0, 1.0]],
                           [[0.0, 1.0], [0.0, 3.0], [0.0, 5.0]]])  # [layers=2, items=3, classes=2]
    metric = LayerAccuracy(2)
    metric.update(logits[:, :2], torch.tensor([0, 1]))
    metric.update(logits[:, 2:], torch.tensor([1]))
    torch.testing.assert_close(metric.compute(), torch.tensor([1.0, 2 / 3], dtype=torch.float64))  # item 0 of layer 1

    ranking = rank_dims(torch.tensor([0.5, 3.0, 1.0, 3.0, 0.1]), dims=[0, 3, 4], top_k=3)
    assert ranking["top_dims"] == [1, 3, 2]
    assert ranking["mean_contribution"] == pytest.approx(7.6 / 5)
    assert {d: v["rank"] for d, v in ranking["dims"].items()} == {0: 4, 3: 1, 4: 5}  # ties share rank 1
    assert {d: v["contribution"] for d, v in ranking["dims"].items()} == {0: 0.5, 3: 3.0, 4: pytest.approx(0.1)}
    assert all(v["mean_contribution"] == pytest.approx(7.6 / 5) for v in ranking["dims"].values())


def _ddp_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        contributions, accuracy = Contributions(LAYERS, HIDDEN, POSITIONS), LayerAccuracy(LAYERS)
        w = weight()
        for features, positions in batches(0)[rank::world]:  # uneven shards: 3 batches and 2
            contributions.update(features, w, positions)
            logits = torch.einsum("lth,lhp->ltp", features, w)
            keep = (positions >= 0) & (positions < POSITIONS)
            accuracy.update(logits[:, keep], positions[keep])
        result, acc = contributions.compute(), accuracy.compute()
        if rank == 0:
            torch.save({"mean": result.mean, "by_position": result.by_position, "accuracy": acc}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_two_processes_equal_one(tmp_path):
    out = str(tmp_path / "synced.pt")
    mp.start_processes(_ddp_worker, args=(2, free_port(), out), nprocs=2, start_method="spawn", join=True)
    synced = torch.load(out)
    data, w = batches(0), weight()
    mean, by_position, _ = direct(data, w)
    torch.testing.assert_close(synced["mean"], mean, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(synced["by_position"], by_position, rtol=1e-6, atol=1e-9)
    correct = torch.zeros(LAYERS, dtype=torch.float64)
    total = 0
    for features, positions in data:
        keep = (positions >= 0) & (positions < POSITIONS)
        predicted = torch.einsum("lth,lhp->ltp", features[:, keep], w).argmax(-1)
        correct += (predicted == positions[keep]).sum(1).double()
        total += int(keep.sum())
    torch.testing.assert_close(synced["accuracy"], correct / total)


def test_contribution_ranks_come_with_their_ties_by_hand():
    """Planted contributions with ties (metrics.ranks' rule, as the LayerNorm ranks): rank = 1 + the neurons of strictly
    larger c(i), ties = the others of exactly the same c(i); the top list breaks ties by the lower index, and paper.md
    says each tie in words."""
    from analyses.paper_report import outlier_ranks_cell, probe_row, top_dims_cell

    # one layer, two tokens at positions 0 and 1, v = 1: c(i) = mean_t |w_{pos_t, i}| = [3, 3, 1, 0, 2, 1]
    weight = torch.tensor([[3.0, -3.0, 1.0, 0.0, 2.0, -1.0], [3.0, 3.0, 1.0, 0.0, -2.0, 1.0]]).T[None]  # [1, 6, 2]
    metric = Contributions(1, 6, 2)
    metric.update(torch.ones(1, 2, 6), weight, torch.tensor([0, 1]))
    ranking = rank_dims(metric.compute().mean[0], dims=[1, 2, 3, 5], top_k=4)
    # by hand: 3 at dims 0, 1 (rank 1, 1 tie each); 2 at dim 4 (rank 3); 1 at dims 2, 5 (rank 4, 1 tie); 0 at dim 3 (6)
    assert ranking["top_dims"] == [0, 1, 4, 2]  # dim 2 before its tie, dim 5: the lower index
    assert ranking["top_ranks"] == [1, 1, 3, 4] and ranking["top_ties"] == [1, 1, 0, 1]
    assert {d: (v["rank"], v["ties"]) for d, v in ranking["dims"].items()} == {1: (1, 1), 2: (4, 1), 3: (6, 0),
                                                                               5: (4, 1)}
    untrained = rank_dims(torch.zeros(6), dims=[4], top_k=2)  # a zero probe: every neuron tied at rank 1
    assert untrained["top_ranks"] == [1, 1] and untrained["top_ties"] == [5, 5]
    assert untrained["dims"][4] == {"rank": 1, "ties": 5, "contribution": 0.0, "mean_contribution": 0.0}

    row = probe_row({"layer": 1, "accuracy": 0.5, "top_contribution_dims": ranking["top_dims"],
                     "top_contribution_ties": ranking["top_ties"],
                     "outlier_dims": {str(d): v for d, v in ranking["dims"].items()}})
    assert top_dims_cell(row) == "0 (tied with 1), 1 (tied with 1), 4, 2 (tied with 1)"
    assert outlier_ranks_cell(row) == ("1: rank 1, tied with 1 other dim; 2: rank 4, tied with 1 other dim; "
                                       "3: rank 6; 5: rank 4, tied with 1 other dim")


def test_probe_py_says_which_layers_show_tied_top_dims(capsys, tmp_path):
    """The terminal table shows 3 top dims per layer: a layer whose shown dims have ties is named below it."""
    import probe

    row = {"accuracy": 0.5, "top_contribution_dims": [4, 1, 2, 0]}
    report = {"encoder": "e", "source": "s", "special_tokens": "counted",
              "baselines": {"majority": 0.1, "chance": 0.1},
              "layers": [{**row, "layer": 0, "top_contribution_ties": [0, 0, 0, 5]},  # a tie past the shown 3: not said
                         {**row, "layer": 1, "top_contribution_ties": [0, 1, 1, 0]},
                         {**row, "layer": 2, "top_contribution_ties": [3, 3, 3, 3]}]}
    probe.print_summary(report, tmp_path)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("tied")]
    assert lines == ["tied contributions among the top dims of layers 1, 2: ties broken by the lower dim "
                     "(top_contribution_ranks, top_contribution_ties in position_probe.json)"]
