"""metrics/base.py: the metrics keep the shapes their compute gives, where torchmetrics squeezes every one-element
tensor ([1] -> []), and the rest of torchmetrics' compute (the cache, the clones) stays.

    .venv/bin/pytest tests/test_metric_base.py -q
"""

from __future__ import annotations

import collections
import copy
import pickle
from dataclasses import dataclass

import pytest
import torch
import torchmetrics

from metrics.base import Metric
from metrics.sinks import AttentionSinks


@dataclass
class Result:
    per_layer: torch.Tensor
    count: int


class Sums(Metric):
    """Per layer and head, the sum of what it was given: a [layers, heads] state."""

    def __init__(self, layers: int, heads: int) -> None:
        super().__init__()
        self.add_state("total", torch.zeros(layers, heads), dist_reduce_fx="sum")

    def update(self, values: torch.Tensor) -> None:
        self.total += values

    def compute(self) -> dict:
        return {"by_head": self.total, "by_layer": self.total.sum(1), "all": self.total.sum(),
                "result": Result(self.total.sum(1), 3), "list": [self.total[:, 0]]}


class TorchmetricsSums(torchmetrics.Metric):
    """The same metric on torchmetrics' own base."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", torch.zeros(1, 1), dist_reduce_fx="sum")

    def update(self, values: torch.Tensor) -> None:
        self.total += values

    def compute(self) -> dict:
        return {"by_head": self.total, "by_layer": self.total.sum(1)}


def test_one_element_results_keep_their_shape_where_torchmetrics_squeezes_them():
    theirs = TorchmetricsSums()
    theirs.update(torch.tensor([[2.5]]))
    assert theirs.compute()["by_layer"].shape == torch.Size([])  # why metrics/base.py exists
    ours = Sums(1, 1)
    ours.update(torch.tensor([[2.5]]))
    ours.update(torch.tensor([[1.0]]))
    out = ours.compute()
    assert out["by_head"].shape == (1, 1) and out["by_head"].item() == 3.5
    assert out["by_layer"].shape == (1,) and out["by_layer"].tolist() == [3.5]
    assert out["all"].shape == () and out["all"].item() == 3.5  # a 0-d result stays 0-d
    assert out["result"].per_layer.tolist() == [3.5] and out["result"].count == 3
    assert out["list"][0].tolist() == [3.5]


def test_results_are_cached_and_cloned_as_torchmetrics_does():
    metric = Sums(1, 1)
    metric.update(torch.tensor([[2.0]]))
    first = metric.compute()
    first["by_layer"].add_(100.0)  # changing a result changes neither the state nor the next (cached) result
    first["by_head"].add_(100.0)
    again = metric.compute()
    assert again["by_layer"].tolist() == [2.0] and again["by_head"].tolist() == [[2.0]]
    assert metric.total.tolist() == [[2.0]]
    metric.update(torch.tensor([[1.0]]))  # a new update drops the cache
    assert metric.compute()["by_layer"].tolist() == [3.0]


def test_larger_results_are_untouched():
    metric = Sums(3, 2)
    values = torch.arange(6.0).reshape(3, 2)
    metric.update(values)
    out = metric.compute()
    assert torch.equal(out["by_head"], values) and torch.equal(out["by_layer"], values.sum(1))


def test_attention_sinks_of_one_layer_and_one_head_equal_a_direct_computation():
    """A one-layer, one-head sink report is per layer, as for any other model (it was squeezed to a scalar)."""
    masses = torch.tensor([[[[0.5, 0.3, 0.2]], [[0.1, 0.6, 0.3]]]])  # [1 layer, 2 sequences, 1 head, 3 keys]
    sinks = AttentionSinks(num_layers=1, num_heads=1, epsilon=0.3)
    sinks.update(masses, torch.ones(2, 3, dtype=torch.bool))
    out = sinks.compute()
    assert out["sink_share"].tolist() == [0.5]  # one of the two sequences puts more than 0.3 on its first token
    assert out["first_token_mass"].shape == (1,) and out["first_token_mass"].item() == pytest.approx(0.3)  # (0.5+0.1)/2
    assert out["first_token_mass_by_head"].shape == (1, 1) and out["first_token_mass_by_head"].item() == pytest.approx(0.3)


Pair = collections.namedtuple("Pair", "per_layer total")


class Shaped(Metric):
    """One [1] state, returned in a namedtuple or an OrderedDict (torchmetrics' squeeze walks both)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.add_state("total", torch.zeros(1), dist_reduce_fx="sum")

    def update(self, values: torch.Tensor) -> None:
        self.total += values.sum()

    def compute(self):
        if self.kind == "namedtuple":
            return Pair(self.total.clone(), self.total.sum())
        return collections.OrderedDict(per_layer=self.total.clone())


def test_namedtuples_and_dict_subclasses_keep_their_type_and_shapes():
    """A namedtuple result raised a TypeError (rebuilt from one iterable) and an OrderedDict came back a dict."""
    pair = Shaped("namedtuple")
    pair.update(torch.tensor([1.0, 2.5]))
    out = pair.compute()
    assert type(out) is Pair and out.per_layer.shape == (1,) and out.per_layer.tolist() == [3.5]
    assert out.total.shape == () and out.total.item() == 3.5
    ordered = Shaped("ordered")
    ordered.update(torch.tensor([2.0]))
    out = ordered.compute()
    assert type(out) is collections.OrderedDict and out["per_layer"].tolist() == [2.0]


def test_a_cached_one_element_result_moves_with_the_states():
    """torchmetrics casts and moves a cached result with the states (set_dtype, .to): the kept one-element ones too,
    as for a larger result of the same metric."""
    one, larger = Sums(1, 1), Sums(2, 1)
    for metric in (one, larger):
        metric.update(torch.ones(metric.total.shape))
        metric.compute()  # cached
        metric.set_dtype(torch.float64)
        assert metric.total.dtype == torch.float64
        assert metric.compute()["by_layer"].dtype == torch.float64, metric.total.shape


def test_copies_and_pickles_keep_the_shapes_and_the_cache():
    """torchmetrics re-wraps compute in __setstate__ (deepcopy, pickle, clone): a copy of a metric with a cached
    result returns it, and after one more update the new sum, one-element results still [1]."""
    metric = Sums(1, 1)
    metric.update(torch.tensor([[2.0]]))
    metric.compute()
    for copy_of in (copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m)), Sums.clone):
        copied = copy_of(metric)
        assert copied.compute()["by_layer"].tolist() == [2.0]
        copied.update(torch.tensor([[0.5]]))
        out = copied.compute()
        assert out["by_layer"].tolist() == [2.5] and out["by_head"].shape == (1, 1) and out["all"].shape == ()
    assert metric.compute()["by_layer"].tolist() == [2.0]
