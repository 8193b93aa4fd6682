"""Planted outliers in tiny random BERT and RoBERTa: found in the right layers, traced to the right origin."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

import analyze
from analyses import outliers, session
from metrics.neuron_stats import NeuronStatisticsResult
from metrics.outliers import LayerOutliers, OutlierRule, detect_outliers, persistent_dims, robust_z
from metrics.ranks import rank_by_magnitude
from tests.figure_data import panels, same, saved_figures
from tests.tiny import HIDDEN, LAYERS, MAX_POSITIONS, save_tiny_encoder

PE_DIM, LATE_DIM, LATE_LAYER = 5, 17, 2  # LATE_DIM is planted in the LayerNorm that writes hidden state 2


def plant(model, offset: int) -> None:
    """PE_DIM: large in every usable position row and in the embedding LayerNorm bias; LATE_DIM: very negative in
    the output LayerNorm bias of transformer block LATE_LAYER - 1, so it appears from hidden state LATE_LAYER on."""
    for module in model.modules():  # trained-looking LayerNorms, so ranks are not all ties at 1.0 / 0.0
        if isinstance(module, torch.nn.LayerNorm):
            module.weight.normal_(1.0, 0.1)
            module.bias.normal_(0.0, 0.1)
    embeddings = model.embeddings
    embeddings.position_embeddings.weight[offset:, PE_DIM] += 6.0
    embeddings.LayerNorm.bias[PE_DIM] = 4.0
    model.encoder.layer[LATE_LAYER - 1].output.LayerNorm.bias[LATE_DIM] = -8.0


@pytest.fixture(params=["bert", "roberta"])
def planted(request, tmp_path, bert_tok, roberta_tok):
    kind = request.param
    tokenizer, offset = (bert_tok, 0) if kind == "bert" else (roberta_tok, 2)
    return kind, save_tiny_encoder(tmp_path / kind, kind, tokenizer, plant=lambda m: plant(m, offset))


def run(encoder, data, out, *extra) -> dict:
    code = analyze.main(["outliers", "--encoder", str(encoder), "--data", str(data), "--output_dir", str(out),
                         "--max_sentences", "0", "--no_progress", *extra])
    assert code == 0
    return json.loads((out / "outliers.json").read_text())


def test_planted_outliers_found_in_right_layers_and_traced(planted, sentences_file, tmp_path, monkeypatch):
    kind, path = planted
    saved = saved_figures(monkeypatch, session)
    report = run(path, sentences_file, tmp_path / "out")
    layers = report["layers"]
    assert [layer["layer"] for layer in layers] == list(range(LAYERS + 1))
    for layer in layers:  # the embedding-level outlier holds the maximum of nearly every token, in every layer
        assert layer["argmax_dim"] == PE_DIM and layer["argmax_share"] > 0.9
        assert PE_DIM in layer["outlier_dims"]
    for layer in layers[:LATE_LAYER]:  # the late outlier is absent before the LayerNorm that plants it
        assert LATE_DIM not in layer["outlier_dims"]
    for layer in layers[LATE_LAYER:]:
        assert layer["argmin_dim"] == LATE_DIM and layer["argmin_share"] > 0.9
        assert LATE_DIM in layer["outlier_dims"]
    assert PE_DIM in report["persistent_dims"]

    origins = report["origins"]
    table = origins["position_embeddings"]["dims"]
    assert table[str(PE_DIM)]["share_as_max"] == 1.0  # every usable row (RoBERTa: after the padding offset)
    assert table[str(PE_DIM)]["column_mean_rank"] == 1
    assert table[str(LATE_DIM)]["share_as_max"] < 0.5
    norms = {entry["module"]: entry for entry in origins["layer_norms"][str(PE_DIM)]}
    assert norms["embeddings.LayerNorm"]["bias_rank"] == 1 and norms["embeddings.LayerNorm"]["layer"] == 0
    late = {entry["module"]: entry for entry in origins["layer_norms"][str(LATE_DIM)]}
    planted_norm = late[f"encoder.layer.{LATE_LAYER - 1}.output.LayerNorm"]
    assert planted_norm["bias_rank"] == 1 and planted_norm["layer"] == LATE_LAYER and planted_norm["bias"] == -8.0
    assert late["embeddings.LayerNorm"]["bias_rank"] > 1
    assert report["num_tokens"] == direct_token_count(path, sentences_file)
    # hundreds of tokens: chance alone cannot give a dim 20% of them (2 x 32 x P(Binomial(n, 1 / 32) >= 0.2 n) ~ 1e-28)
    assert all(0 <= row["chance_bound"] == layers[0]["chance_bound"] < 1e-20 for row in layers)
    assert report["chance_warning"] is None
    check_position_rows_figure(panels(saved["position_embeddings.png"]), path, 0 if kind == "bert" else 2,
                               report["persistent_dims"])


def check_position_rows_figure(drawn: list[dict], path, offset: int, dims: list[int]) -> None:
    """position_embeddings.png (the paper's Figures 3-4) against the position table read from the saved model: the
    rows a token can use (RoBERTa's: after the padding offset) as a heatmap with the outlier dims marked, and below
    each outlier dim's value and the mean |value| of all dims against the position."""
    from transformers import AutoModel

    rows = AutoModel.from_pretrained(path).embeddings.position_embeddings.weight.detach()[offset:].double()
    heatmap, curves = drawn
    (image,) = heatmap["images"]
    np.testing.assert_allclose(image, rows.numpy(), rtol=1e-6)
    assert PE_DIM in dims and sorted(x[0] for _, x, _ in heatmap["dashed"]) == sorted(dims)  # the marked dims
    positions = range(rows.shape[0])
    assert list(curves["lines"]) == [f"dim {d}" for d in dims[:6]]
    for d in dims[:6]:
        same(curves["lines"][f"dim {d}"], positions, rows[:, d].tolist())
    ((label, x, y),) = curves["dashed"]
    assert label == "mean |value| of all dims"
    same((x, y), positions, rows.abs().mean(1).tolist())


def direct_token_count(path, sentences_file) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    lines = [line.strip() for line in sentences_file.read_text().splitlines() if line.strip()]
    return sum(min(len(ids), MAX_POSITIONS) for ids in tokenizer(lines)["input_ids"])  # truncated at 64 tokens


def test_one_short_sentence_warns_in_one_line_that_its_outliers_could_be_chance(tmp_path, bert_tok, capsys):
    """One sentence of a handful of tokens: two tokens on one dim's max make an outlier, which chance alone gives with
    probability near 1 in 32 dims; every layer's chance_bound is 2 x 32 x the binomial tail summed here, capped at 1,
    and the warning (the planted dim is still found persistent) is one line on stderr, the report's chance_warning."""
    path = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok, plant=lambda m: plant(m, 0))
    data = tmp_path / "one.txt"
    data.write_text("the cat sat.\n", encoding="utf-8")
    capsys.readouterr()
    report = run(path, data, tmp_path / "out")
    n = report["num_tokens"]
    assert n == direct_token_count(path, data) and n < 10
    needed = math.ceil(0.2 * n - 1e-9)
    tail = sum(math.comb(n, k) * (1 / HIDDEN) ** k * (1 - 1 / HIDDEN) ** (n - k) for k in range(needed, n + 1))
    bound = min(1.0, 2 * HIDDEN * tail)
    assert bound > 0.01 and PE_DIM in report["persistent_dims"]
    assert [row["chance_bound"] for row in report["layers"]] == pytest.approx([bound] * (LAYERS + 1), rel=1e-12)
    said = [line for line in capsys.readouterr().err.splitlines() if "chance" in line]
    assert said == [f"warning: {report['chance_warning']}"]
    assert f"rested on {n} token vectors" in said[0] and f"up to {bound:.3g}" in said[0]
    assert f"the outliers of {LAYERS} non-input layers" in said[0] and "(--max_sentences" in said[0]


def test_exclude_special_counts_fewer_tokens(planted, sentences_file, tmp_path):
    _, path = planted
    with_special = run(path, sentences_file, tmp_path / "a")
    without = run(path, sentences_file, tmp_path / "b", "--exclude_special")
    lines = [line for line in sentences_file.read_text().splitlines() if line.strip()]
    assert with_special["num_sentences"] == without["num_sentences"] == len(lines)
    assert with_special["num_tokens"] - without["num_tokens"] == 2 * len(lines)  # [CLS]/[SEP] or <s>/</s> each
    assert without["special_tokens"] == "excluded"


def test_no_positional_embeddings_has_no_position_origin(tmp_path, roberta_tok, sentences_file):
    def zero_positions(model):
        model.embeddings.position_embeddings.weight.zero_()
        model.embeddings.LayerNorm.bias[PE_DIM] = 6.0

    path = save_tiny_encoder(tmp_path / "nope", "roberta", roberta_tok, plant=zero_positions)
    report = run(path, sentences_file, tmp_path / "out")
    assert report["origins"]["position_embeddings"] is None
    assert "all zeros" in report["origins"]["position_embeddings_note"]
    assert report["layers"][0]["argmax_dim"] == PE_DIM


def test_detection_rule_by_hand():
    # 8 dims, 10 tokens. dim 0 holds 3 maxima, dim 1 holds 7; dim 2 holds all minima. dim 3's mean is far out: an
    # outlier by the opt-in robust z-score only (the paper's rule counts maxima and minima, not means).
    result = NeuronStatisticsResult(
        num_tokens=10,
        mean=torch.tensor([[0.1, 0.2, -0.1, 9.0, 0.0, 0.15, -0.05, 0.05]], dtype=torch.float64),
        var=torch.ones(1, 8, dtype=torch.float64),
        max_abs=torch.ones(1, 8, dtype=torch.float64),
        argmax_count=torch.tensor([[3, 7, 0, 0, 0, 0, 0, 0]]),
        argmin_count=torch.tensor([[0, 0, 10, 0, 0, 0, 0, 0]]),
    )
    # median of the mean vector is 0.075; |dev| = [.025,.125,.175,8.925,.075,.075,.125,.025], MAD = 0.1
    z = robust_z(result.mean)
    assert z[0, 3].item() == pytest.approx(8.925 / (1.4826 * 0.1))
    (paper,) = detect_outliers(result)  # the default: the paper's rule, share >= 0.2, no mean criterion
    assert paper.outlier_dims == [1, 0, 2]  # by |mean|: 0.2, 0.1, 0.1 (dim 0 holds 30% of the maxima)
    assert 3 not in paper.outlier_dims  # planted only by its mean: no longer an outlier by default
    (layer,) = detect_outliers(result, OutlierRule(min_share=0.5, sigma=10.0))  # ours, opt-in
    assert (layer.argmax_dim, layer.argmax_share, layer.argmin_dim, layer.argmin_share) == (1, 0.7, 2, 1.0)
    assert layer.outlier_dims == [3, 1, 2]  # by |mean|: 9.0, 0.2, 0.1; dim 0 (share 0.3) is not an outlier
    (strict,) = detect_outliers(result, OutlierRule(min_share=0.8, sigma=100.0))
    assert strict.outlier_dims == [2]


def test_persistence_counts_the_non_input_layers_only():
    """A dim is persistent when it is an outlier in at least half of layers 1..L; layer 0 never counts."""
    def layer(number: int, dims: list[int]) -> LayerOutliers:
        return LayerOutliers(layer=number, argmax_dim=0, argmax_share=0.0, argmin_dim=0, argmin_share=0.0,
                             outlier_dims=dims)

    layers = [layer(0, [5, 9]), layer(1, [5, 7]), layer(2, [7]), layer(3, [5, 7]), layer(4, [8])]
    # counts over layers 1..4 (half = 2): dim 5 twice, dim 7 three times, dim 9 never (only layer 0), dim 8 once
    assert persistent_dims(layers) == [7, 5]
    assert persistent_dims(layers[:1]) == []  # only the embedding output: nothing is persistent
    odd = [layer(0, [1]), layer(1, [1]), layer(2, [2]), layer(3, [2])]  # 3 non-input layers: at least 2
    assert persistent_dims(odd) == [2]


def test_rank_by_magnitude():
    assert rank_by_magnitude(torch.tensor([0.5, -3.0, 2.0, -0.1])).tolist() == [3, 1, 2, 4]


def test_ranks_and_ties_by_sorting_equal_the_direct_comparison_of_every_pair():
    """The one-sort ranks and ties equal the [hidden, hidden] comparison they replace (rank = 1 + the strictly larger
    |values|, ties = the others of the same |value|) on planted ties of both signs, -0.0, +-inf and NaN (rank 1, ties
    -1, no effect on the others), in every float width; and by hand on a small vector."""
    from metrics.ranks import ranks_and_ties, ties_by_magnitude

    def direct(values):
        magnitude = values.abs()
        return ((magnitude[None, :] > magnitude[:, None]).sum(1) + 1,
                (magnitude[None, :] == magnitude[:, None]).sum(1) - 1)

    nan, inf = float("nan"), float("inf")
    rank, ties = ranks_and_ties(torch.tensor([2.0, nan, -2.0, 0.5, inf, -0.0, 0.0, nan, -inf]))
    assert rank.tolist() == [3, 1, 3, 5, 1, 6, 6, 1, 1] and ties.tolist() == [1, -1, 1, 0, 1, 1, 1, -1, 1]
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        for size in (1, 2, 7, 64, 129):
            values = torch.randint(-3, 4, (size,), generator=generator).to(dtype) / 2  # few distinct |values|: ties
            pick = torch.rand(size, generator=generator)
            values[pick < 0.1] = nan
            values[(pick > 0.9) & (pick < 0.95)] = inf
            values[pick > 0.95] = -inf
            values[(pick > 0.4) & (pick < 0.5)] = -0.0
            want_rank, want_ties = direct(values)
            rank, ties = ranks_and_ties(values)
            assert torch.equal(rank, want_rank) and torch.equal(ties, want_ties), (dtype, size)
            assert torch.equal(rank_by_magnitude(values), want_rank) and torch.equal(ties_by_magnitude(values), want_ties)
    assert ranks_and_ties(torch.tensor([]))[0].numel() == 0


def test_mean_vectors_figure_plots_each_layers_mean_and_marks_the_outliers(tmp_path, bert_tok, sentences_file):
    import matplotlib.pyplot as plt
    from transformers import AutoModel

    path = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok, plant=lambda m: plant(m, 0))
    texts = [line for line in sentences_file.read_text().splitlines() if line.strip()]
    args = analyze.build_parser().parse_args(["outliers", "--encoder", str(path), "--data", str(sentences_file),
                                              "--max_sentences", "0", "--no_progress"])
    encoder = session.open_encoder(args)
    reference = outliers.collect_statistics(encoder, texts, args)
    report, result = outliers.outliers_report(args, encoder, reference), reference.statistics
    fig = outliers.mean_vectors_png(report, result, encoder)  # what analyze.py saves as mean_vectors.png

    model = AutoModel.from_pretrained(path).eval()  # the mean vectors computed directly, from transformers
    inputs = bert_tok(texts, padding=True, truncation=True, max_length=MAX_POSITIONS, return_tensors="pt")
    with torch.no_grad():
        hidden = torch.stack(model(**inputs, output_hidden_states=True).hidden_states)
    means = hidden[:, inputs["attention_mask"].bool()].double().mean(1)  # [layers, hidden]

    assert len(fig.axes) == LAYERS + 1
    for layer, (ax, entry) in enumerate(zip(fig.axes, report["layers"])):
        assert ax.get_ylabel() == f"layer {layer}"
        (bars,) = ax.patches  # one step patch: a bar of width 1 per dimension
        values, edges, baseline = bars.get_data()
        assert [round((a + b) / 2) for a, b in zip(edges[:-1], edges[1:])] == list(range(means.shape[1]))
        assert baseline == 0 and np.allclose(np.diff(edges), 1) and bars.get_fill()
        heights = torch.tensor(values, dtype=torch.float64)
        torch.testing.assert_close(heights, means[layer], atol=1e-5, rtol=1e-4)
        (markers,) = ax.collections
        marked = [round(x) for x in markers.get_offsets()[:, 0]]
        assert marked == entry["outlier_dims"] and PE_DIM in marked and (LATE_DIM in marked) == (layer >= LATE_LAYER)
        torch.testing.assert_close(torch.tensor(markers.get_offsets()[:, 1], dtype=torch.float64),
                                   means[layer, marked], atol=1e-5, rtol=1e-4)
        labels = [(text.get_text(), text.xy[0]) for text in ax.texts]
        assert labels == [(str(d), d) for d in marked[:4]]
    plt.close(fig)


def test_albert_positions_traced_through_the_factorised_projection(bert_tok):
    from transformers import AlbertModel

    from metrics.origins import summarise_origins, trace_origins
    from tests.tiny import tiny_config

    torch.manual_seed(0)
    config = tiny_config("albert", len(bert_tok))
    width, hidden = config.embedding_size, config.hidden_size
    assert width < hidden
    model = AlbertModel(config).eval()
    table = model.embeddings.position_embeddings.weight
    projection = model.encoder.embedding_hidden_mapping_in.weight  # [hidden, width]
    e_dim, rows = 3, [0, 1, 2, 5]
    with torch.no_grad():  # a large value in E-space dim e_dim of a few position rows ...
        table[rows, e_dim] += 6.0
        projection[hidden - 7, e_dim] = 2.0  # ... that the projection sends mostly to hidden dim hidden - 7
    expected = (table.detach() @ projection.detach().T)  # [positions, hidden], computed directly
    h_dim = int(expected[rows[0]].argmax())
    assert h_dim == hidden - 7
    report = trace_origins(model, [h_dim])
    note = report["position_embeddings_note"]
    assert "factorised embeddings" in note and f"E={width}" in note and f"H={hidden}" in note
    info = report["position_embeddings"]["dims"][str(h_dim)]
    assert report["position_embeddings"]["num_positions"] == config.max_position_embeddings
    as_max = (expected.argmax(1) == h_dim).nonzero().flatten().tolist()
    assert set(rows) <= set(as_max) and info["positions_as_max"] == as_max
    assert info["share_as_max"] == pytest.approx(len(as_max) / config.max_position_embeddings, abs=1e-6)
    assert info["column_mean_rank"] == 1 and info["column_mean"] == pytest.approx(float(expected[:, h_dim].mean()),
                                                                                 abs=1e-5)

    # One group shared by every layer: its LayerNorms write no single layer; one group per layer: each writes one.
    shared = report["layer_norms"][str(h_dim)]
    assert len(shared) == 2 and all(entry["layer"] is None for entry in shared)
    assert all(entry["shared_by_layers"] == list(range(1, LAYERS + 1)) for entry in shared)
    assert f"shared by layers 1-{LAYERS}" in summarise_origins(report)[h_dim]
    grouped = AlbertModel(tiny_config("albert", len(bert_tok), num_hidden_groups=LAYERS))
    entries = trace_origins(grouped, [0])["layer_norms"]["0"]
    assert sorted(entry["layer"] for entry in entries) == sorted(2 * list(range(1, LAYERS + 1)))
    assert not any("shared_by_layers" in entry for entry in entries)


def test_layernorm_ranks_report_ties_and_top_3_only_when_strictly_among_them(bert_tok):
    """A random-init BERT's LayerNorm gains are all 1 and its biases all 0: every dim has rank 1 and hidden - 1 ties,
    and is among the top 3 in none of them (tied across the edge in all). Planted gains and biases: the ranks and
    ties written out by hand."""
    from transformers import BertModel

    from metrics.origins import summarise_origins, trace_origins
    from tests.tiny import HIDDEN, tiny_config

    torch.manual_seed(0)
    model = BertModel(tiny_config("bert", len(bert_tok))).eval()
    names = ["embeddings.LayerNorm"] + [f"encoder.layer.{i}.{part}.LayerNorm" for i in range(LAYERS)
                                        for part in ("attention.output", "output")]
    norms = 2 * LAYERS + 1
    entries = trace_origins(model, [9])["layer_norms"]["9"]
    assert [entry["module"] for entry in entries] == names
    assert all((entry["weight_rank"], entry["weight_ties"], entry["bias_rank"], entry["bias_ties"])
               == (1, HIDDEN - 1, 1, HIDDEN - 1) for entry in entries)
    line = summarise_origins(trace_origins(model, [9]))[9].split("; ")[1:]  # after the position rows
    assert line == [f"LN gain rank 1, tied with {HIDDEN - 1} other dims (layer 0)",
                    f"LN bias rank 1, tied with {HIDDEN - 1} other dims (layer 0)",
                    f"top-3 in 0/{norms} gains, 0/{norms} biases (tied across the top-3 edge in {norms} gains, "
                    f"{norms} biases)"]

    d, a, b, c = 9, 1, 2, 3
    modules = dict(model.named_modules())
    with torch.no_grad():
        modules[names[0]].weight[d] = 5.0  # strictly largest: rank 1, no ties
        modules[names[0]].bias[d] = -0.5  # strictly largest |bias|: rank 1, no ties
        modules[names[1]].weight[[d, a, b]] = 2.0  # three-way tie at the top: rank 1, 2 ties, top-3 either way
        modules[names[2]].weight[[d, a, b, c]] = 2.0  # four-way tie: rank 1, 3 ties, across the top-3 edge
        modules[names[3]].weight[[a, b, c]] = 3.0
        modules[names[3]].weight[d] = -2.5  # |gain| 2.5 below three dims of 3: rank 4, no ties, not top-3
    expected = [(1, 0), (1, 2), (1, 3), (4, 0)] + [(1, HIDDEN - 1)] * (norms - 4)
    entries = trace_origins(model, [d])["layer_norms"][str(d)]
    assert [(entry["weight_rank"], entry["weight_ties"]) for entry in entries] == expected
    assert [(entry["bias_rank"], entry["bias_ties"]) for entry in entries] == [(1, 0)] + [(1, HIDDEN - 1)] * (norms - 1)
    line = summarise_origins(trace_origins(model, [d]))[d].split("; ")[1:]
    assert line == ["LN gain rank 1 (layer 0)", "LN bias rank 1 (layer 0)",
                    f"top-3 in 2/{norms} gains, 1/{norms} biases (tied across the top-3 edge in {norms - 3} gains, "
                    f"{norms - 1} biases)"]


OUR_NUMBERS = re.compile(r"0\.2\b|20 ?%|\bhalf\b|[<>]=? ?12\b|\b12 layers")  # share, persistence, --clip auto's depth


def credits_the_paper(text: str) -> list[str]:
    """The places in `text` where one of our numbers (the 0.2 / 20% share, half of the layers, the 12-layer threshold)
    is not said to be ours, before the sentence ends or the paper is named: [the text from the number on]."""
    found = []
    for match in OUR_NUMBERS.finditer(text):
        rest = text[match.end():]
        end = re.search(r"\.(\s|$)", rest)  # a sentence's end ("1..3" and "0.2" are not)
        sentence = rest[:end.start()] if end else rest
        ours = sentence.find("ours")
        paper = min([i for i in (sentence.find("Luo et al"), sentence.find("the paper's")) if i >= 0], default=-1)
        if ours < 0 or 0 <= paper < ours:
            found.append(text[match.start():match.start() + 80])
    return found


def test_no_report_credits_the_paper_with_a_number_it_does_not_give(tmp_path, bert_tok, sentences_file, capsys):
    """The paper's rule is "the largest or smallest value of most vectors", its outliers "persistent", and it clips its
    base and large models two ways without naming a depth: the rule description, the persistence, the clipping rule
    (base depth and deeper), the terminal table and paper.md's §3 lines each say the 0.2 share, the half of the layers
    and the 12-layer threshold are ours. The check itself flags the wording these reports had before."""
    from analyses.paper_report import paper_markdown
    from metrics.transforms import parse_clip

    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok, plant=lambda m: plant(m, 0))
    assert analyze.main(["outliers", "--encoder", str(encoder), "--data", str(sentences_file), "--no_progress",
                         "--sigma", "3", "--output_dir", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "outliers.json").read_text())
    rule = report["rule"]
    assert "0.2" in rule["description"] and "half" in rule["persistence"] and report["persistent_dims"]
    clip_rules = [parse_clip("auto").rule(layers) for layers in (LAYERS + 1, 13, 25)]
    summary = {"encoder": str(encoder), "section3_sentences": {"sst2": 20}, "section3_sentences_asked": 20,
               "clip": "1:5", "clipped_dims": [PE_DIM], "clip_rule": clip_rules[0], "data": {},
               "section3_outliers": {"layers": report["layers"], "persistent_dims": report["persistent_dims"],
                                     "rule": rule["description"], "persistence": rule["persistence"]},
               "section3_position_probe": None, "figure6": {}, "table1_wic": None, "table2_sts": [],
               "table3_classifiers": {}, "notes": []}
    texts = [rule["description"], rule["persistence"], capsys.readouterr().out, *clip_rules, paper_markdown(summary)]
    for text in texts:
        assert credits_the_paper(text) == [], text
    before = ["argmax or argmin share >= 0.2 (Luo et al. 2021)",
              "persistent outlier dims (in at least half of the non-input layers 1..3): [5]",
              "auto: persistent outlier dims (outliers in at least half of layers 1..3) zeroed in every non-input "
              "layer, the paper's §4 rule for base-depth models (3 <= 12 layers)",
              "auto: each non-input layer's own outlier dims zeroed in that layer only, the paper's Appendix D rule for "
              "deep models (24 > 12 layers: their outliers move across layer ranges)"]
    assert all(credits_the_paper(text) for text in before)


def test_electra_positions_traced_through_its_embedding_projection():
    """ELECTRA with embedding_size E != hidden_size H: its position rows reach the hidden space through
    `embeddings_project` (rows @ W.T, no bias), as ALBERT's through embedding_hidden_mapping_in."""
    from transformers import ElectraConfig, ElectraModel

    from core.models import position_rows
    from metrics.origins import trace_origins

    torch.manual_seed(0)
    config = ElectraConfig(vocab_size=60, embedding_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=24)
    model = ElectraModel(config).eval()
    table, projection = model.embeddings.position_embeddings.weight, model.embeddings_project.weight  # [24, 16], [32, 16]
    planted = [0, 3, 4, 9]
    with torch.no_grad():  # a large value in E-space dim 5 of a few rows, sent by the projection to hidden dim 30
        table[planted, 5] += 6.0
        projection[30, 5] = 2.0
    expected = table.detach() @ projection.detach().T  # [positions, H], computed directly
    rows, note = position_rows(model)
    torch.testing.assert_close(rows, expected)  # BERT-style numbering from 0: every row a token can use
    assert "embeddings_project" in note and "E=16" in note and "H=32" in note
    report = trace_origins(model, [30])
    as_max = (expected.argmax(1) == 30).nonzero().flatten().tolist()
    assert set(planted) <= set(as_max) and report["position_embeddings"]["dims"]["30"]["positions_as_max"] == as_max


def test_a_position_row_whose_max_or_min_several_dims_hold_counts_1_over_k_on_each():
    """A planted table with exact ties: a tied row is listed under every dim that holds its max (min) and counts 1/k in
    each one's share, as a token does in the outlier rule (torch's argmax gave it to the lowest index: dim 0's share of
    maxima would be 3/5)."""
    from transformers import BertConfig, BertModel

    from metrics.origins import trace_origins

    config = BertConfig(vocab_size=20, hidden_size=4, num_hidden_layers=1, num_attention_heads=1, intermediate_size=8,
                        max_position_embeddings=5)
    model = BertModel(config).eval()
    with torch.no_grad():
        model.embeddings.position_embeddings.weight.copy_(torch.tensor([
            [3.0, 3.0, 0.0, -1.0],  # max: dims 0, 1 (1/2 each); min: dim 3
            [1.0, 2.0, 2.0, 2.0],  # max: dims 1, 2, 3 (1/3 each); min: dim 0
            [5.0, 0.0, 0.0, 0.0],  # max: dim 0; min: dims 1, 2, 3 (1/3 each)
            [-2.0, 1.0, -2.0, 0.0],  # max: dim 1; min: dims 0, 2 (1/2 each)
            [0.0, 0.0, 0.0, 0.0],  # max and min: all four dims (1/4 each)
        ]))
    table = trace_origins(model, [0, 1, 2, 3])["position_embeddings"]
    assert table["num_positions"] == 5
    as_max = {0: 1 / 2 + 1 + 1 / 4, 1: 1 / 2 + 1 / 3 + 1 + 1 / 4, 2: 1 / 3 + 1 / 4, 3: 1 / 3 + 1 / 4}
    as_min = {0: 1 + 1 / 2 + 1 / 4, 1: 1 / 3 + 1 / 4, 2: 1 / 3 + 1 / 2 + 1 / 4, 3: 1 + 1 / 3 + 1 / 4}
    assert sum(as_max.values()) == pytest.approx(5) and sum(as_min.values()) == pytest.approx(5)  # every row, once
    rows_max = {0: [0, 2, 4], 1: [0, 1, 3, 4], 2: [1, 4], 3: [1, 4]}
    rows_min = {0: [1, 3, 4], 1: [2, 4], 2: [2, 3, 4], 3: [0, 2, 4]}
    for d in range(4):
        info = table["dims"][str(d)]
        assert info["share_as_max"] == pytest.approx(as_max[d] / 5, abs=1e-6)
        assert info["share_as_min"] == pytest.approx(as_min[d] / 5, abs=1e-6)
        assert info["positions_as_max"] == rows_max[d] and info["positions_as_min"] == rows_min[d]
