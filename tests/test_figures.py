"""Figures a researcher can put in a talk (core/figures.py and its callers): every mark in a legend, every colour bar
labelled, titles inside the figure, plain numbers on log axes, line colours that read on white, and a panel with
nothing to show that says so. Each check reads the drawn figure's artists, not its pixels.

    .venv/bin/pytest tests/test_figures.py -q
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from matplotlib.collections import PathCollection
from matplotlib.colors import to_hex, to_rgb
from matplotlib.lines import Line2D

from analyses.reports import figure_of
from callbacks.outlier_statistics import OutlierStatistics
from core import figures, step_figures
from lightning_modules.probes import PositionProbe

LONG = "outlier neurons vs the mean contribution: all-MiniLM-L6-v2 (outlier dims [12, 45, 223, 300, 301, 302, 303])"


def drawn(fig):
    fig.canvas.draw()
    return fig.canvas.get_renderer()


def signature(artist) -> tuple:
    """What tells a mark apart in a legend: colour, line style, marker."""
    if isinstance(artist, PathCollection):
        return to_hex(artist.get_facecolor()[0], keep_alpha=False), "None", "o"
    marker = artist.get_marker() if artist.get_marker() not in (None, "", " ") else "None"
    return to_hex(artist.get_color(), keep_alpha=False), artist.get_linestyle(), marker


def marks(ax) -> list:
    """The data marks of a panel: lines and scatters (not the thin zero line, not colour-bar internals)."""
    lines = [line for line in ax.get_lines() if line.get_visible() and line.get_linewidth() >= 0.5]
    return lines + [c for c in ax.collections if isinstance(c, PathCollection)]


def legend_signatures(fig) -> set:
    """Every legend entry of the figure (a panel's legend may serve all panels, as the same name has one colour)."""
    legends = [legend for legend in [*(ax.get_legend() for ax in fig.axes), *fig.legends] if legend is not None]
    return {signature(handle) for legend in legends for handle in legend.legend_handles
            if isinstance(handle, (Line2D, PathCollection))}


def contrast_on_white(color) -> float:
    """The WCAG contrast ratio of `color` against white."""
    linear = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in to_rgb(color)]
    luminance = 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]
    return 1.05 / (luminance + 0.05)


def check_talk_ready(fig) -> int:
    """The checks below on a drawn figure; returns how many data marks it checked against the legend."""
    renderer = drawn(fig)
    checked = 0
    box = fig.bbox
    colorbars = [ax for ax in fig.axes if hasattr(ax, "_colorbar")]
    known, log_labels = legend_signatures(fig), []
    for ax in colorbars:
        assert ax.get_ylabel().strip(), "a colour bar without a label"
    for ax in fig.axes:  # titles, axis and colour-bar labels: inside the figure
        texts = [ax.title, ax.xaxis.label, ax.yaxis.label] + ([fig._suptitle] if fig._suptitle is not None else [])
        for text in texts:
            if text.get_text() and text.get_visible():
                extent = text.get_window_extent(renderer)
                assert box.x0 - 1 <= extent.x0 and extent.x1 <= box.x1 + 1 and box.y0 - 1 <= extent.y0 and \
                    extent.y1 <= box.y1 + 1, f"cut off: {text.get_text()!r}"
        for axis, scale in ((ax.yaxis, ax.get_yscale()), (ax.xaxis, ax.get_xscale())):
            if scale == "log":  # (a panel sharing its neighbour's y axis shows no labels of its own)
                log_labels += [t.get_text() for t in axis.get_ticklabels(which="both") if t.get_visible()]
        if ax in colorbars or not ax.get_visible():
            continue
        for mark in marks(ax):
            assert signature(mark) in known, f"a mark not in the legend: {signature(mark)} in {ax.get_title()!r}"
            assert contrast_on_white(signature(mark)[0]) >= 2.0, f"reads badly on white: {signature(mark)[0]}"
            checked += 1
    assert all(re.fullmatch(r"[0-9.]*", label) for label in log_labels), log_labels  # 300, not 3e+02
    assert any(log_labels) or not any("log" in (ax.get_yscale(), ax.get_xscale()) for ax in fig.axes)
    return checked


def test_yellow_is_gone_and_the_checks_catch_what_they_should():
    assert contrast_on_white("#fde725") < 2.0 and contrast_on_white("#bcbd22") < 2.1  # viridis' end, tab:olive
    assert min(contrast_on_white(c) for c in figures.line_colors(13)) >= 2.0
    assert min(contrast_on_white(c) for c in figures.SERIES) >= 2.0
    fig, ax = figures.subplots(figsize=(4, 3))
    ax.plot([0, 1], [0, 1], color="#1f77b4")  # a line nobody explained
    with pytest.raises(AssertionError, match="not in the legend"):
        check_talk_ready(fig)
    fig, ax = figures.subplots(figsize=(4, 3))
    ax.plot([1, 2], [3.4, 3.9])
    ax.set_yscale("log")  # matplotlib's own labels on less than a decade: 3x10^0, 4x10^0
    with pytest.raises(AssertionError):
        check_talk_ready(fig)


def test_every_figure_explains_its_marks_labels_its_colour_bars_and_fits_its_titles():
    rng = np.random.default_rng(0)
    mean = rng.normal(size=(4, 40))
    layers = [0, 1, 2, 3]
    made = [
        figures.mean_vectors_figure(mean, {1: [3, 7], 2: [3]}, title=LONG),
        figures.position_rows_figure(rng.normal(size=(30, 40)), [3, 7], title=LONG + " " + LONG),
        figures.heatmap_figure(rng.random((4, 40)), "dimension", "layer", LONG, colorbar="contribution"),
        figures.accuracy_by_layer_figure(layers, {"encoder": [0.9, 0.8, 0.7, 0.6], "random-init encoder":
                                                  [0.5, 0.4, 0.3, 0.3]}, {"majority": 0.1, "chance": 0.05}, LONG),
        figures.layer_panels_figure([{"title": LONG, "ylabel": "cosine", "layers": layers, "baselines": {"static": 0.2},
                                      "series": {f"dim {d}": list(rng.random(4)) for d in range(9)}}], LONG, columns=1),
        step_figures.over_steps_figure([{"title": "kurtosis", "log": True, "series": {f"layer {k}": ([0, 100, 200],
                                   [3.4 + k, 3.6 + k, 3.9 + k]) for k in layers}},
                                   {"title": "share", "series": {"layer 1": ([0, 100], [0.1, 0.5])}}], LONG),
        step_figures.layer_step_figure([{"title": "top share", "colorbar": "share of tokens", "values": rng.random((4, 5))},
                                   {"title": "kurtosis", "colorbar": "kurtosis", "log": True,
                                    "values": 3 + 40 * rng.random((4, 5))}], [0, 100, 200, 300, 400], layers, LONG),
        figures.spectrum_figure({"raw": [list(np.sort(rng.random(30))[::-1]) for _ in layers],
                                 "clipped": [list(np.sort(rng.random(30))[::-1]) for _ in layers]},
                                title="singular values of each sentence's token matrix, normalised and averaged per "
                                      "rank (tokenUni): all-MiniLM-L6-v2"),
        figures.heatmap_grid_figure([rng.random((6, 40)) for _ in layers], [f"layer {k}" for k in layers], "dimension",
                                    "position", LONG, colorbar="contribution"),
    ]
    checked = [check_talk_ready(fig) for fig in made]
    # the legend check saw every data mark, counted by hand from the inputs (heatmaps and images have none): 2 outlier
    # dot sets; 2 outlier dims marked on the heatmap + their 2 lines + the mean |value|; 2 series + 2 baselines; 9 dims
    # + 1 baseline; 4 + 1 layers; 2 spectra x 4 layers
    assert checked == [2, 5, 0, 4, 10, 5, 0, 8, 0], checked
    lines = made[0].legends[0].get_texts()  # the outlier dot is explained
    assert any("outlier" in text.get_text() for text in lines)


def test_a_title_breaks_at_spaces_and_never_inside_a_bracketed_list():
    text = figures.fit_title(LONG, width_inches=5.2, fontsize=10)
    assert text.replace("\n", " ") == LONG
    assert "[12, 45, 223, 300, 301, 302, 303])" in text.splitlines()[-1]
    assert all(line.count("[") == line.count("]") for line in text.splitlines())


def text_of(fig) -> str:
    return " ".join(t.get_text().replace("\n", " ") for ax in fig.axes for t in ax.texts)


def test_a_figure_with_nothing_to_show_says_so_in_words():
    probe = PositionProbe.__new__(PositionProbe)  # its outlier figure (Figure 5b/5c) when no outlier was detected
    object.__setattr__(probe, "results", {"contributions": torch.rand(3, 16)})
    object.__setattr__(probe, "spec", SimpleNamespace(outlier_dims=[], layers=[0, 1, 2], outlier_source="detected"))
    fig = probe.outlier_figure("outlier neurons vs the mean contribution")
    assert "nothing to show: no outlier dimension was detected" in text_of(fig) and not fig.axes[0].get_lines()
    report = {"layers": [{"layer": 0, "raw": {"isoscore": 0.1, "isoscore_star": None, "sequence_energy_top1": 0.3}}],
              "minibatch_tokens": 250, "zeta": 0.2, "num_minibatches": 0, "num_sentences": 200,
              "clipped_dims": [], "normalize": "none"}
    fig = figure_of("isotropy", report, "MiniLM")
    assert "nothing to show: 0 mini-batches of 250 tokens" in text_of(fig) and "200 sentences here" in text_of(fig)
    fig = OutlierStatistics.figure("val", [], [0, 1])  # the live layer x step image before any validation
    assert text_of(fig).count("nothing to show: no capture yet") == 3
    check_talk_ready(fig)


def test_the_live_layer_by_step_image_holds_the_history_it_is_given():
    rows = [[step, "train", layer, 0.1 * layer + step / 1000, 3.0 + layer, 2.0 + step / 100]
            for step in (0, 20, 40) for layer in (0, 1, 2)]
    fig = OutlierStatistics.figure("train", rows, [0, 1, 2])
    panels = [ax for ax in fig.axes if not hasattr(ax, "_colorbar")]
    assert [ax.get_title() for ax in panels] == ["dominant dimension's share", "kurtosis of the token vectors",
                                                 "max / median |mean|"]
    for column, ax in enumerate(panels):  # rows: layers 0, 1, 2; columns: steps 0, 20, 40
        expected = [[row[3 + column] for row in rows if row[2] == layer] for layer in (0, 1, 2)]
        np.testing.assert_allclose(np.asarray(ax.get_images()[0].get_array()), expected, rtol=1e-6)


def test_the_live_attention_image_draws_each_layers_history():
    """AttentionGeometry's image (logged beside its scalars): a panel per statistic, a line per layer through the
    values of its history rows (step, stage, layer, one value per statistic) at their steps."""
    from callbacks.attention_geometry import NAMES, AttentionGeometry
    from tests.figure_data import panels, same

    rows = [[step, "train", layer, *(k + layer / 10 + step / 1000 for k in range(len(NAMES)))]
            for step in (0, 20, 40) for layer in (1, 2)]
    drawn = panels(AttentionGeometry.figure("train", rows, [1, 2]))
    assert len(drawn) == len(NAMES)
    for k, panel in enumerate(drawn):
        assert list(panel["lines"]) == ["layer 1", "layer 2"]
        for layer in (1, 2):
            same(panel["lines"][f"layer {layer}"], [0, 20, 40], [k + layer / 10 + step / 1000 for step in (0, 20, 40)])


def test_the_figures_draw_the_values_they_are_given():
    """The drawn data read back from the artists against the inputs: each layer's bars and outlier dots
    (mean_vectors_figure), each series' and baseline's line (accuracy_by_layer_figure), the heatmap's cells."""
    from matplotlib.patches import StepPatch

    rng = np.random.default_rng(1)
    mean, outliers = rng.normal(size=(3, 12)), {1: [3, 7], 2: [11]}
    fig = figures.mean_vectors_figure(mean, outliers)
    assert len(fig.axes) == 3
    for layer, ax in enumerate(fig.axes):
        (bars,) = [patch for patch in ax.patches if isinstance(patch, StepPatch)]
        values, edges, _ = bars.get_data()
        np.testing.assert_array_equal(values, mean[layer])
        np.testing.assert_array_equal(edges, np.arange(13) - 0.5)  # dimension d's bar centred on d
        dots = [c.get_offsets() for c in ax.collections if isinstance(c, PathCollection)]
        expected = [[(d, mean[layer, d]) for d in outliers[layer]]] if layer in outliers else []
        assert [np.asarray(d).tolist() for d in dots] == [[list(p) for p in e] for e in expected]

    series = {"encoder": [0.9, 0.8, 0.7, 0.6], "random-init encoder": [0.5, 0.4, 0.3, 0.3]}
    fig = figures.accuracy_by_layer_figure([0, 1, 2, 3], series, {"majority": 0.1, "chance": 0.05})
    drawn_lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in fig.axes[0].get_lines()}
    assert drawn_lines == {"encoder": ([0, 1, 2, 3], series["encoder"]),
                           "random-init encoder": ([0, 1, 2, 3], series["random-init encoder"]),
                           "majority (0.100)": ([0, 1], [0.1, 0.1]), "chance (0.050)": ([0, 1], [0.05, 0.05])}

    matrix = rng.random((5, 9))
    fig = figures.heatmap_figure(matrix, "dimension", "layer", colorbar="contribution")
    (image,) = fig.axes[0].get_images()
    np.testing.assert_array_equal(np.asarray(image.get_array()), matrix)


def test_outlier_dims_are_numbered_where_a_reader_looks_for_them():
    """At bert-base scale (768 dims): each outlier dim's number is a text of the heatmap panels (contributions by layer
    and by position, the position rows) at its column, close dims stacked rather than drawn over each other."""
    rng = np.random.default_rng(2)
    dims = [300, 302, 557, 12]
    figs = [figures.heatmap_figure(rng.random((13, 768)), "dimension", "layer", LONG, colorbar="c", marked=dims),
            figures.heatmap_grid_figure([rng.random((5, 768)) for _ in range(3)], ["layer 0", "layer 1", "layer 2"],
                                        "dimension", "position", LONG, colorbar="c", marked=dims),
            figures.position_rows_figure(rng.normal(size=(50, 768)), dims, title=LONG)]
    for fig in figs:
        renderer = drawn(fig)
        for ax in fig.axes:
            if hasattr(ax, "_colorbar") or not ax.get_images():
                continue
            labels = {text.get_text(): text for text in ax.texts}
            assert sorted(labels) == ["12", "300, 302", "557"], sorted(labels)  # 300 and 302: 2 columns apart
            for label, text in labels.items():
                numbers = [int(n) for n in label.split(", ")]
                assert text.xy[0] == np.mean(numbers) and text.get_color() == figures.OUTLIER_RED
            ticks = [c for c in ax.collections if c.get_segments() and np.allclose(c.get_color(), to_rgb(
                figures.OUTLIER_RED) + (1,))]
            assert sorted(seg[0][0] for c in ticks for seg in c.get_segments()) == sorted(dims)  # a tick at each column
            boxes = [text.get_window_extent(renderer) for text in labels.values()]
            assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
            title = ax.title.get_window_extent(renderer)
            assert all(box.y1 <= title.y0 + 1 for box in boxes) or not ax.get_title()
        check_talk_ready(fig)
    none = figures.heatmap_figure(rng.random((3, 8)), "dimension", "layer", "t", colorbar="c")
    assert not none.axes[0].texts


def test_legends_and_titles_keep_off_the_data_at_13_layers():
    """13 layers (bert-base): the step panels' and the spectra's legends sit under every panel, not inside one; the
    title of a 13-panel mean_vectors.png stays above its legend; an accuracy axis shows a negative selectivity."""
    layers = list(range(13))
    figs = [step_figures.over_steps_figure([{"title": f"statistic {k}", "series": {
                f"layer {layer}": ([0, 100, 200], [layer, layer + 1, layer + k]) for layer in layers}}
                for k in range(6)], LONG),
            figures.spectrum_figure({"raw": [list(np.linspace(1, 0.01, 40)) for _ in layers],
                                     "clipped": [list(np.linspace(1, 0.01, 40)) for _ in layers]})]
    for fig in figs:
        renderer = drawn(fig)
        assert not any(ax.get_legend() for ax in fig.axes)
        (legend,) = fig.legends
        assert [t.get_text() for t in legend.get_texts()] == [f"layer {layer}" for layer in layers]
        box = legend.get_window_extent(renderer)
        assert all(box.y1 <= ax.get_tightbbox(renderer).y0 + 1 for ax in fig.axes if ax.axison)
        assert box.y0 >= fig.bbox.y0 - 1
        check_talk_ready(fig)
    fig = figures.mean_vectors_figure(np.zeros((13, 768)), {5: [308]}, title="average vector per layer, step 200000")
    renderer = drawn(fig)
    assert fig._suptitle.get_window_extent(renderer).y0 >= fig.legends[0].get_window_extent(renderer).y1 - 1
    assert fig.get_figheight() < 15
    fig = figures.accuracy_by_layer_figure([0, 1, 2], {"encoder": [0.9, 0.5, 0.2], "selectivity": [0.1, -0.05, -0.2]})
    assert fig.axes[0].get_ylim()[0] < -0.2 and fig.axes[0].get_ylim()[1] >= 1
    # magnitudes.png at 13 layers: peaks of 50 to 310 on a log axis, five series; the legend under the panel
    deep = list(range(25))  # and 25 layers (large): every other layer numbered, every layer ticked
    fig = figures.layer_panels_figure([{"title": "peaks", "ylabel": "|x|", "layers": layers, "log": True, "series": {
        f"top {k} peak": [50 + 20 * layer + k for layer in layers] for k in range(5)}},
        {"title": "deep", "ylabel": "cosine", "layers": deep, "series": {"raw": [0.5] * 25}}], columns=2)
    renderer = drawn(fig)
    for ax in fig.axes:
        legend = ax.get_legend().get_window_extent(renderer)
        assert legend.y1 <= ax.xaxis.label.get_window_extent(renderer).y0 + 1 and legend.y0 >= fig.bbox.y0 - 1
    labels = [t.get_text() for t in fig.axes[0].yaxis.get_ticklabels(which="both") if t.get_text()]
    assert "100" in labels and "200" in labels and not any("e" in label for label in labels), labels
    assert [t.get_text() for t in fig.axes[1].get_xticklabels()] == [str(k) for k in deep[::2]]
    assert sorted({*fig.axes[1].get_xticks(), *fig.axes[1].get_xticks(minor=True)}) == deep
    check_talk_ready(fig)


def test_the_position_rows_legend_sits_under_the_heatmap_not_on_it():
    """position_embeddings.png: the dashed outlier-dim mark's legend lies outside the heatmap (under its x label,
    above the curves' panel), where it covers no row of the table; the curves' legend lies under the curves."""
    fig = figures.position_rows_figure(np.random.default_rng(3).normal(size=(128, 384)), [20, 300], title=LONG)
    renderer = drawn(fig)
    top, bottom = [ax for ax in fig.axes if not hasattr(ax, "_colorbar")]
    legend = top.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["outlier dimension (number above)"]
    box, panel = legend.get_window_extent(renderer), top.get_window_extent(renderer)
    assert not box.overlaps(panel) and box.y1 <= top.xaxis.label.get_window_extent(renderer).y0 + 1
    assert box.y0 >= bottom.get_tightbbox(renderer).y1 - 1  # nor on the panel below
    curves = bottom.get_legend()  # the curves' legend: under the lower panel's x label, inside the figure
    assert [t.get_text() for t in curves.get_texts()] == ["dim 20", "dim 300", "mean |value| of all dims"]
    box = curves.get_window_extent(renderer)
    assert not box.overlaps(bottom.get_window_extent(renderer))
    assert box.y1 <= bottom.xaxis.label.get_window_extent(renderer).y0 + 1 and box.y0 >= 0
    check_talk_ready(fig)


def test_every_summary_panel_says_what_its_y_axis_is():
    from analyses.reports import summary_figure

    row = {"layer": 0, "anisotropy": {"raw": 0.3}, "self_similarity": {"raw": 0.8}, "isoscore": {"raw": 0.1},
           "sts_stsb_spearman": {"raw": 60.0}}
    fig = summary_figure({"figure6_layers": [row, {**row, "layer": 1}], "variants": ["raw"], "clipped_dims": []}, "m")
    labels = {ax.get_title(): ax.get_ylabel() for ax in fig.axes if ax.axison}
    assert labels == {"anisotropy (random token pairs)": "mean cosine", "self-similarity": "mean cosine",
                      "IsoScore": "IsoScore", "STS (stsb): Spearman x 100": "Spearman x 100"}


def shown_log_labels(axis) -> list[tuple[float, str]]:
    """(location, label) of each tick a drawn axis labels inside its view, major and minor, in order of location."""
    low, high = sorted(axis.get_view_interval())
    ticks = [*axis.get_major_ticks(len(axis.get_majorticklocs())), *axis.get_minor_ticks(len(axis.get_minorticklocs()))]
    return sorted((tick.get_loc(), tick.label1.get_text()) for tick in ticks
                  if low <= tick.get_loc() <= high and tick.label1.get_text())


def check_log_labels(axis) -> list[str]:
    """Each label reads apart from the others, and read as a number is its tick's location (two significant digits at
    least: within 5%), so the labels rise with the ticks."""
    labels = shown_log_labels(axis)
    texts = [text for _, text in labels]
    assert len(texts) >= 2 and len(set(texts)) == len(texts), texts
    assert all(float(text) == pytest.approx(location, rel=0.05) for location, text in labels), labels
    assert all(float(a) < float(b) for a, b in zip(texts, texts[1:])), texts
    return texts


@pytest.mark.parametrize("per_token, per_sequence, expected", [
    # a tiny random BERT's (tests/tiny.py, 80 sentences of data/austen.txt): within 0.01 of 2.87 in every layer
    ([2.870911, 2.874724, 2.870658, 2.872872], [2.876765, 2.880579, 2.876413, 2.87861], "2.872"),
    ([9.996, 10.001, 9.998, 10.003], [9.997, 10.004, 10.0, 10.002], "10"),  # around a decade's major tick
    ([22.1, 22.3, 22.0, 61.0], [11.2, 10.9, 27.9, 9.3], "20"),  # packaged MiniLM's: unchanged, two digits
])
def test_the_kurtosis_panel_of_magnitudes_png_labels_each_tick_once(per_token, per_sequence, expected):
    """magnitudes.png's kurtosis panel (a log axis): a kurtosis within 0.01 of 2.87 in every layer got matplotlib's
    linear fallback ticks 2.872, 2.874, ... on it, and two significant digits wrote each "2.9"; now each label reads
    apart from the others and is its tick's value. The live layer x step image's log colour bar, the same."""
    from analyses.outliers import magnitudes_png

    rows = [{"layer": layer, "kurtosis_mean": k, "kurtosis_sequence": s,
             "massive_activations": {"top": [{"value": 3.7}, {"value": 3.6}, {"value": 3.4}], "median_abs": 0.68}}
            for layer, (k, s) in enumerate(zip(per_token, per_sequence))]
    fig = magnitudes_png({"layers": rows, "massive_rule": {"rule": "ratio", "ratio": 20.0}}, SimpleNamespace(
        short_name="tiny"))
    drawn(fig)
    kurtosis = next(ax for ax in fig.axes if ax.get_title().startswith("kurtosis"))
    assert kurtosis.get_yscale() == "log" and expected in check_log_labels(kurtosis.yaxis)
    image = step_figures.layer_step_figure([{"title": "kurtosis", "colorbar": "kurtosis", "log": True,
                                             "values": [per_token, per_sequence]}], [0, 100, 200, 300], [0, 1])
    drawn(image)
    (bar,) = [ax for ax in image.axes if hasattr(ax, "_colorbar")]
    check_log_labels(bar.yaxis)
