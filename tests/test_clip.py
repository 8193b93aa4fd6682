"""--clip, the same everywhere: each mode zeroes exactly the dims and layers it names, on the hidden states."""

from __future__ import annotations

import pytest
import torch

from core.errors import UserError
from metrics.outliers import LayerOutliers, persistent_dims
from metrics.transforms import Clipping, clipped_dims, parse_clip, per_layer_report

LAYERS, HIDDEN = 5, 12  # hidden states 0..4: the embedding output and 4 transformer layers


def outliers() -> list[LayerOutliers]:
    """Planted detections: dim 3 in layers 0-4, dim 7 in layers 2-3 only, dim 9 in the embedding output only."""
    dims = {0: [3, 9], 1: [3], 2: [3, 7], 3: [7, 3], 4: [3]}
    return [LayerOutliers(layer=layer, argmax_dim=d[0], argmax_share=0.5, argmin_dim=d[0], argmin_share=0.5,
                          outlier_dims=d) for layer, d in dims.items()]


def zeroed(spec: dict[int, list[int]]) -> dict[int, list[int]]:
    """{layer: dims} that Clipping(spec) actually zeroes on random hidden states [layers, batch, seq, hidden]."""
    hidden = torch.randn(LAYERS, 2, 3, HIDDEN, generator=torch.Generator().manual_seed(0)) + 0.1
    clipped = Clipping(spec, LAYERS).apply(hidden)
    changed = (clipped != hidden).flatten(1, 2).any(1)  # [layers, hidden]
    assert torch.equal(clipped[changed.unsqueeze(1).unsqueeze(1).expand_as(clipped)],
                       torch.zeros(int(changed.sum()) * 6))  # what changed became exactly 0; the rest is untouched
    return {layer: changed[layer].nonzero().flatten().tolist() for layer in range(LAYERS) if changed[layer].any()}


@pytest.mark.parametrize("text, expected", [
    ("auto", {layer: [3, 7] for layer in range(1, LAYERS)}),  # persistent (7 is in 2 of layers 1..4), not layer 0
    ("per-layer", {1: [3], 2: [3, 7], 3: [3, 7], 4: [3]}),  # each layer's own outliers, there only (not 9 in 0)
    ("none", {}),
    ("5", {layer: [5] for layer in range(1, LAYERS)}),
    ("7,2", {layer: [2, 7] for layer in range(1, LAYERS)}),
    ("1-2:8,4:0+11", {1: [8], 2: [8], 4: [0, 11]}),
    ("0:4", {0: [4]}),  # the explicit form may name the embedding output
])
def test_each_clip_mode_zeroes_exactly_what_it_names(text, expected):
    assert persistent_dims(outliers()) == [3, 7]
    request = parse_clip(text)
    spec = request.resolve(outliers() if request.needs_outliers else None, LAYERS, HIDDEN)
    assert spec == expected and zeroed(spec) == expected
    assert clipped_dims(spec) == sorted({d for dims in expected.values() for d in dims})
    assert per_layer_report(spec) == {str(layer): dims for layer, dims in expected.items()}


def test_overlapping_ranges_are_merged_and_said_so():
    request = parse_clip("1-3:8,3-4:9")
    assert request.resolve(None, LAYERS, HIDDEN) == {1: [8], 2: [8], 3: [8, 9], 4: [9]}
    assert request.notes == ("layer 3 is in '1-3:8' and '3-4:9': its dims are merged",)
    assert parse_clip("1-3:8,3-4:8").notes == ()  # the same dims: nothing to merge


@pytest.mark.parametrize("text, message", [
    ("big", "--clip must be auto, per-layer, none"),
    ("1-3:", "--clip item '1-3:' is empty"),
    (":4", "--clip item ':4' is empty"),
    ("3-1:4", "layers run low-high"),
    ("-2", "dimensions must be 0 or more"),
])
def test_bad_clip_text_is_one_line(text, message):
    with pytest.raises(UserError, match=message):
        parse_clip(text)


@pytest.mark.parametrize("text, message", [
    ("12", r"--clip dimensions \[12\] are outside the model's dimensions 0..11"),
    ("2-5:1", "--clip layer 5 is outside the model's layers 0..4"),
])
def test_clip_outside_the_model_is_one_line(text, message):
    with pytest.raises(UserError, match=message):
        parse_clip(text).resolve(None, LAYERS, HIDDEN)
