"""--clip, the same everywhere: each mode zeroes exactly the dims and layers it names, on the hidden states."""

from __future__ import annotations

import re

import pytest
import torch

from core.errors import UserError
from metrics.outliers import LayerOutliers, persistent_dims
from metrics.transforms import Clipping, clipped_dims, parse_clip, per_layer_report
from tests.tiny import save_tiny_encoder

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


# ---- --clip auto: the paper's choice by depth, on planted models ----------------------------------------------------

def planted(ranges: dict[int, tuple[int, int, float]]):
    """plant(model) for tests.tiny.save_tiny_encoder: dim d made an outlier of hidden-state layers first..last: +-value
    in d's output LayerNorm bias of layer `first` (the residual stream carries it on) and switched off after `last`
    (that layer's LayerNorm gain and bias 0 in d)."""
    def plant(model) -> None:
        layers = model.encoder.layer
        for dim, (first, last, value) in ranges.items():
            layers[first - 1].output.LayerNorm.bias[dim] = value
            if last < len(layers):
                layers[last].output.LayerNorm.weight[dim] = 0.0
                layers[last].output.LayerNorm.bias[dim] = 0.0
    return plant


def direct_outlier_dims(path, sentences: list[str]) -> list[list[int]]:
    """Each hidden-state layer's outlier dims by hand: every token of every sentence (special tokens included, padding
    not, 64 tokens at most); d is an outlier when it holds the max or the min of >= 20% of the tokens."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    inputs = tokenizer(sentences, return_tensors="pt", padding=True, truncation=True, max_length=64)
    with torch.no_grad():
        hidden = torch.stack(model(**inputs, output_hidden_states=True).hidden_states)  # [layers, batch, seq, hidden]
    tokens = hidden[:, inputs["attention_mask"].bool()]  # [layers, n, hidden]
    found = []
    for layer in tokens:
        share_max = torch.bincount(layer.argmax(1), minlength=layer.shape[1]) / layer.shape[0]
        share_min = torch.bincount(layer.argmin(1), minlength=layer.shape[1]) / layer.shape[0]
        found.append(sorted(((share_max >= 0.2) | (share_min >= 0.2)).nonzero().flatten().tolist()))
    return found


def anisotropy_report(path, sentences_file, out) -> dict:
    import json

    import analyze

    assert analyze.main(["anisotropy", "--encoder", str(path), "--data", str(sentences_file), "--max_sentences", "0",
                         "--no_progress", "--device", "cpu", "--output_dir", str(out)]) == 0
    return json.loads((out / "anisotropy.json").read_text())


@pytest.mark.slow
def test_clip_auto_on_a_deep_model_zeroes_each_layers_own_outliers_where_they_are(bert_tok, sentences_file, tmp_path):
    """A 24-layer model whose outlier moves across layer ranges as BERT-large's does (App. D): none persists over half
    the layers, so the base-depth rule would clip nothing; auto zeroes each layer's own outliers in that layer, and
    clipped differs from raw in exactly the layers that have one."""
    ranges = {5: (1, 8, 8.0), 9: (8, 14, -8.0), 13: (14, 18, 8.0), 20: (18, 23, -8.0)}
    path = save_tiny_encoder(tmp_path / "deep", "bert", bert_tok, plant=planted(ranges), num_hidden_layers=24)
    sentences = sentences_file.read_text(encoding="utf-8").split("\n")[:-1]
    expected = direct_outlier_dims(path, sentences)  # [25 hidden-state layers]
    for dim, (first, last, _) in ranges.items():  # the plant took: each dim is an outlier in its range only
        assert [layer for layer in range(25) if dim in expected[layer]] == list(range(first, last + 1))
    assert not [d for d in range(32) if sum(d in dims for dims in expected[1:]) >= 12]  # none in half of 1..24

    report = anisotropy_report(path, sentences_file, tmp_path / "a")
    assert report["clip"] == "auto" and "Appendix D" in report["clip_rule"] and "24 > 12" in report["clip_rule"]
    assert report["clipped_dims_per_layer"] == {str(layer): dims for layer, dims in enumerate(expected)
                                                if layer >= 1 and dims}
    for row in report["layers"]:
        if row["layer"] >= 1 and expected[row["layer"]]:  # (rounded to 6 decimals; some are near 1 either way)
            assert row["clipped"] != row["raw"], row
        else:  # the embedding output, and a layer without outliers: nothing zeroed
            assert row["clipped"] == row["raw"], row


@pytest.mark.slow
def test_clip_auto_on_a_base_depth_model_keeps_the_persistent_rule(bert_tok, sentences_file, tmp_path):
    """12 layers: dim 5 is an outlier in layers 1..8 (persistent: 8 >= 6 of 12), dim 9 in 3..4 only; auto zeroes the
    persistent dims in every layer 1..12 (§4), and not dim 9."""
    path = save_tiny_encoder(tmp_path / "base", "bert", bert_tok, plant=planted({5: (1, 8, 8.0), 9: (3, 4, -8.0)}),
                             num_hidden_layers=12)
    sentences = sentences_file.read_text(encoding="utf-8").split("\n")[:-1]
    expected = direct_outlier_dims(path, sentences)
    persistent = sorted(d for d in range(32) if sum(d in dims for dims in expected[1:]) >= 6)
    assert 5 in persistent and 9 not in persistent and 9 in expected[3]
    report = anisotropy_report(path, sentences_file, tmp_path / "a")
    assert "§4" in report["clip_rule"] and "12 <= 12" in report["clip_rule"]
    assert report["clipped_dims_per_layer"] == {str(layer): persistent for layer in range(1, 13)}
    assert all(row["clipped"] != row["raw"] for row in report["layers"][1:])
    assert report["layers"][0]["clipped"] == report["layers"][0]["raw"]


def test_clip_auto_rule_by_depth_on_planted_detections():
    """The same detections read by a 4-layer and (padded to) a 24-layer model: persistent vs per layer."""
    deep = outliers() + [LayerOutliers(layer=layer, argmax_dim=0, argmax_share=0.5, argmin_dim=0, argmin_share=0.5,
                                       outlier_dims=[]) for layer in range(LAYERS, 25)]
    request = parse_clip("auto")
    assert request.resolve(outliers(), LAYERS, HIDDEN) == {layer: [3, 7] for layer in range(1, LAYERS)}
    assert request.resolve(deep, 25, HIDDEN) == {1: [3], 2: [3, 7], 3: [3, 7], 4: [3]}  # 3 is in 4 of 24: not persistent
    assert request.rule(13).startswith("auto: persistent") and request.rule(14).startswith("auto: each")
    assert parse_clip("per-layer").rule(7).startswith("per-layer") and parse_clip("5").rule(25).startswith("given")


@pytest.mark.parametrize("text", ["auto", "per-layer", ",".join(map(str, range(HIDDEN))), "2:" + "+".join(
    map(str, range(HIDDEN)))])
def test_clip_that_zeroes_every_dim_of_a_layer_is_refused(text):
    """A layer with all its dims clipped is zero vectors (every clipped cosine, spectrum, classifier 0/0): one line,
    whichever mode asked; one dim fewer is clipped as usual."""
    every = [LayerOutliers(layer=layer, argmax_dim=0, argmax_share=0.5, argmin_dim=1, argmin_share=0.5,
                           outlier_dims=list(range(HIDDEN))) for layer in range(LAYERS)]
    spec = {layer: list(range(HIDDEN)) for layer in range(1, LAYERS)}
    assert not Clipping(spec, LAYERS).apply(torch.ones(LAYERS, 1, 1, HIDDEN))[1:].any()  # what it would compare
    layer = 2 if text.startswith("2:") else 1
    with pytest.raises(UserError, match=re.escape(f"--clip {text} zeroes all {HIDDEN} dims of layer {layer}")):
        parse_clip(text).resolve(every, LAYERS, HIDDEN)
    fewer = [LayerOutliers(**{**o.to_dict(), "outlier_dims": list(range(HIDDEN - 1))}) for o in every]
    assert parse_clip("auto").resolve(fewer, LAYERS, HIDDEN) == {layer: list(range(HIDDEN - 1))
                                                                 for layer in range(1, LAYERS)}


def test_a_model_so_narrow_that_every_dim_is_an_outlier_is_refused_before_anything_is_written(bert_tok, sentences_file,
                                                                                             tmp_path, capfd):
    """Hidden size 4, one layer: the max/min-share rule (20%) flags all 4 dims, found here by hand; --clip auto would
    zero every vector of layer 1, so anisotropy refuses in one line and writes nothing; --clip none measures."""
    import analyze

    path = save_tiny_encoder(tmp_path / "narrow", "bert", bert_tok, seed=1, hidden_size=4, num_attention_heads=1,
                             num_hidden_layers=1, intermediate_size=4)  # (seed 0 flags 3 of the 4: clipped as usual)
    sentences = sentences_file.read_text(encoding="utf-8").split("\n")[:-1]
    assert direct_outlier_dims(path, sentences)[1] == [0, 1, 2, 3]
    argv = ["anisotropy", "--encoder", str(path), "--data", str(sentences_file), "--no_progress", "--device", "cpu"]
    assert analyze.main([*argv, "--output_dir", str(tmp_path / "auto")]) == 2
    errors = [line for line in capfd.readouterr().err.splitlines() if "error:" in line]
    assert errors == ["analyze.py anisotropy: error: --clip auto zeroes all 4 dims of layer 1 (the outlier rule flags "
                      "every one): nothing is left to compare; use --clip none or fewer dims"]
    assert not (tmp_path / "auto").exists()
    assert analyze.main([*argv, "--clip", "none", "--output_dir", str(tmp_path / "none")]) == 0
