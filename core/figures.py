"""Matplotlib figures shared by analyze.py reports, the probes and the W&B callbacks (headless, Agg backend).

    fig = mean_vectors_figure(mean, outliers={layer: [dims]}, title="MiniLM")   # the paper's Figures 1-2
    position_rows_figure(rows, dims=[d1, d2])                                    # Figures 3-4
    save_figure(fig, "runs/x/mean_vectors.png")                                 # or figure_array(fig): RGB for loggers
    layer_panels_figure([{"title": "anisotropy", "layers": [0, 1], "series": {"raw": [.9, .8]}}])  # Figure 6
    layer_bands_figure([{..., "bands": {"raw": ([.8, .7], [1., .9], "controls")}}])   # the same, shaded bands

Figures against the training step (trajectories, the study, the live callbacks): core/step_figures.py.

Figures a researcher can put in a talk: every mark in a legend, every colour bar labelled, titles wrapped at word
boundaries (never inside a bracketed list) to the figure's width, plain numbers on log axes, line colours that read
on white (no yellow), and a panel with nothing to show says so in words.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from core.figure_style import (  # noqa: F401  (re-exported: core.figures.subplots, .SERIES, ... as before)
    BAR_BLUE,
    GREYS,
    MARKERS,
    OUTLIER_RED,
    SERIES,
    as_array,
    below_panel_legend,
    fill,
    finite,
    fit_title,
    label_dims,
    layer_ticks,
    layered,
    legend_below,
    legend_rows,
    line_colors,
    margins,
    plain_log_axis,
    plain_number,
    say_empty,
    subplots,
    suptitle,
    title_pad,
)


def mean_vectors_figure(mean, outliers: Mapping[int, Sequence[int]] | None = None, title: str = "",
                        layers: Sequence[int] | None = None):
    """The average hidden vector of each layer as bars over dimensions, outlier dimensions marked and labelled.

    mean: [layers, hidden] array or tensor.
    """
    mean = as_array(mean)
    layers = list(layers) if layers is not None else list(range(mean.shape[0]))
    outliers = outliers or {}
    panel = min(1.25, max(0.6, 12 / len(layers)))  # inches per layer: 13 layers 0.92, 25 layers 0.6 (15 in tall)
    fig, axes = subplots(len(layers), 1, figsize=(10, panel * len(layers) + 1.2), sharex=True, squeeze=False)
    edges = np.arange(mean.shape[1] + 1) - 0.5  # dimension d's bar spans d - 0.5 .. d + 0.5
    for ax, layer in zip(axes[:, 0], layers):
        values = mean[layer]
        # one filled step patch per layer draws the bars of width 1 (thousands of bar patches take seconds to draw at
        # 768 dimensions x 13 layers, an image the live callbacks make during training)
        ax.stairs(values, edges, baseline=0, fill=True, color=BAR_BLUE, linewidth=0)
        marked = [d for d in outliers.get(layer, []) if 0 <= d < len(values)]
        if marked:
            ax.scatter(marked, values[marked], color=OUTLIER_RED, s=14, zorder=3)
            for d in marked[:4]:
                ax.annotate(str(d), (d, values[d]), textcoords="offset points", xytext=(3, 0), fontsize=7,
                            color=OUTLIER_RED, va="center")
        ax.axhline(0, color="black", linewidth=0.4)
        ax.set_ylabel(f"layer {layer}", rotation=0, ha="right", va="center", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[-1, 0].set_xlabel("dimension (0-indexed)")
    axes[-1, 0].set_xlim(-1, mean.shape[1])
    handles = [Patch(color=BAR_BLUE, label="mean value of the dimension over the tokens"),
               Line2D([], [], marker="o", linestyle="", color=OUTLIER_RED, markersize=4,
                      label="outlier dimension of that layer (its number beside it, up to 4)")]
    lines = suptitle(fig, title or "average vector per layer", 10)
    legend_top = 0.12 + 0.2 * lines  # inches below the figure's top edge
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 1 - legend_top / fig.get_figheight()),
               ncol=2, fontsize=8, frameon=False)
    margins(fig, 0.85, 0.2, 0.5, legend_top + 0.35, hspace=0.25)
    return fig


def position_rows_figure(rows, dims: Sequence[int], title: str = ""):
    """The positional-embedding rows (the paper's Figures 3-4): a heatmap positions x dimensions with the outlier
    dims marked, and each outlier dim's value against the position beside the mean |value| of all dims.

    rows: [positions, hidden] (the rows a token can use, in the hidden space)."""
    rows = as_array(rows)
    fig, (top, bottom) = subplots(2, 1, figsize=(10, 7.4), gridspec_kw={"height_ratios": [3, 2]})
    limit = np.percentile(np.abs(rows), 99.5) or 1.0
    image = top.imshow(rows, aspect="auto", interpolation="nearest", cmap="RdBu_r", vmin=-limit, vmax=limit)
    fig.colorbar(image, ax=top, fraction=0.025).set_label("value (clipped at the 99.5th percentile of |value|)",
                                                           fontsize=8)
    for i, d in enumerate(dims):
        top.axvline(d, color="black", linewidth=0.9, linestyle="--",
                    label="outlier dimension (number above)" if i == 0 else None)
    label_dims(top, dims, rows.shape[1])
    top.set_xlabel("dimension (0-indexed)")
    below_panel_legend(top)  # under the x label: inside, it covered the last positions of the last dims
    top.set_ylabel("position")
    positions = np.arange(rows.shape[0])
    for d, color in zip(list(dims)[:6], SERIES):
        bottom.plot(positions, rows[:, d], linewidth=1, color=color, label=f"dim {d}")
    bottom.plot(positions, np.abs(rows).mean(1), color="black", linestyle="--", linewidth=1,
                label="mean |value| of all dims")
    bottom.set_xlabel("position (0-indexed)")
    bottom.set_ylabel("value")
    below_panel_legend(bottom)  # inside, it covered the curves
    suptitle(fig, title or "position-embedding rows", 10)
    fig.tight_layout()
    return fig


def heatmap_figure(matrix, xlabel: str, ylabel: str, title: str = "", cmap: str = "viridis", colorbar: str = "",
                   rows: Sequence[int] | None = None, marked: Sequence[int] = ()):
    """A labelled heatmap, e.g. contribution vectors [layers, hidden] or [positions, hidden]; `colorbar` labels the
    colour bar, `rows` the rows (default 0, 1, ...), `marked` columns (the outlier dims) numbered above it."""
    matrix = as_array(matrix)
    fig, ax = subplots(figsize=(10, max(2.5, min(8.0, 0.3 * matrix.shape[0] + 1.8))))
    image = ax.imshow(matrix, aspect="auto", interpolation="nearest", cmap=cmap)
    fig.colorbar(image, ax=ax, fraction=0.04, pad=0.02).set_label(fill(colorbar or "value", 30), fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if rows is not None and len(rows) <= 40:
        ax.set_yticks(range(len(rows)), labels=[str(row) for row in rows])
    numbers = label_dims(ax, marked, matrix.shape[1])
    lines = fit_title(title, 9, 10).count("\n") + 1 if title else 0
    if title:
        ax.set_title(fit_title(title, 9, 10), fontsize=10, pad=title_pad(numbers))
    margins(fig, 0.8, 0.6, 0.55, 0.15 + 0.2 * lines + (0.1 + 0.14 * numbers if numbers else 0))
    return fig


def accuracy_by_layer_figure(layers: Sequence[int], series: Mapping[str, Sequence[float]],
                             baselines: Mapping[str, float] | None = None, title: str = ""):
    """Probe accuracy per layer, one line per series (encoder, random encoder, ...), baselines as dashed lines."""
    fig, ax = subplots(figsize=(7, 4.3))
    for index, (name, values) in enumerate(series.items()):
        ax.plot(list(layers), list(values), marker=MARKERS[index % len(MARKERS)], color=SERIES[index % len(SERIES)],
                label=name, **layered(index))
    for (name, value), color in zip((baselines or {}).items(), GREYS):
        ax.axhline(value, linestyle="--", linewidth=1, color=color, label=f"{name} ({value:.3f})")
    ax.set_xlabel("layer (0 = embedding output)")
    ax.set_ylabel("test accuracy")
    layer_ticks(ax, list(layers))
    low = min([0.0, *(v for values in series.values() for v in values if v is not None and np.isfinite(v))])
    ax.set_ylim(low - 0.02 if low < 0 else 0, 1.02)  # a selectivity below 0 drawn, not cut off
    below_panel_legend(ax, 8)  # 6 entries inside covered the lines of a 13-layer probe
    ax.set_title(fit_title(title or "probe accuracy by layer", 6.5, 10), fontsize=10)
    fig.tight_layout()
    return fig


def layer_panels_figure(panels: Sequence[Mapping], title: str = "", columns: int = 2):
    """Per-layer curves in side-by-side panels (the paper's Figure 6: before / after clipping).

    Each panel: {"title", "ylabel", "layers": [..], "series": {name: [value per layer, None for missing]},
    "baselines": {name: value} (optional, dashed), "empty": why a panel without values is empty (optional)},
    optionally "log": True (a log y axis).
    """
    columns = max(1, min(columns, len(panels)))
    rows = (len(panels) + columns - 1) // columns
    width = 5.2 * columns + (1.2 if columns == 1 else 0)
    fig, axes = subplots(rows, columns, figsize=(width, 3.6 * rows + 0.4), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        layers = list(panel["layers"])
        ax.set_title(fit_title(panel.get("title", ""), width / columns, 9), fontsize=9)
        if not any(finite(values) for values in panel["series"].values()):
            say_empty(ax, panel.get("empty", ""))
            continue
        for index, (name, values) in enumerate(panel["series"].items()):
            ax.plot(layers, [np.nan if v is None else v for v in values], marker=MARKERS[index % len(MARKERS)],
                    color=SERIES[index % len(SERIES)], label=name, **layered(index))
        for (name, value), color in zip((panel.get("baselines") or {}).items(), GREYS):
            if value is not None:
                ax.axhline(value, linestyle="--", linewidth=1, color=color, label=f"{name} ({value:.3g})")
        ax.set_xlabel("layer (0 = embedding output)", fontsize=8)
        ax.set_ylabel(panel.get("ylabel", ""), fontsize=8)
        layer_ticks(ax, layers)
        ax.tick_params(labelsize=7, which="both")
        if panel.get("log"):
            plain_log_axis(ax)  # 20, 40, not 2x10^1, 4x10^1
        below_panel_legend(ax)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    suptitle(fig, title, width)
    fig.tight_layout()
    return fig


def layer_bands_figure(panels: Sequence[Mapping], title: str = "", columns: int = 2):
    """layer_panels_figure with shaded bands and one legend for all panels below them (the panels share their series):
    each panel may add "bands": {series name: (low, high, label)} (per-layer lists, None for missing), drawn in its
    series' colour.

    analyze.py intervene: before vs after per layer, the controls' mean ± sd as a band around each intervention."""
    fig = layer_panels_figure(panels, title, columns)
    entries: dict[str, object] = {}
    for ax, panel in zip(fig.axes, panels):
        colours = {line.get_label(): line.get_color() for line in ax.get_lines()}
        layers = list(panel["layers"])
        for name, (low, high, label) in (panel.get("bands") or {}).items():
            ax.fill_between(layers, [np.nan if v is None else v for v in low],
                            [np.nan if v is None else v for v in high], color=colours.get(name, "#888888"),
                            alpha=0.25, linewidth=0, label=label)
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
        if ax.get_legend() is not None:
            ax.get_legend().remove()
    legend = legend_rows(list(entries), fig.get_figwidth(), 8)[1]
    legend_below(fig, list(entries.values()), list(entries), 8)
    fig.tight_layout(rect=(0, min(0.4, legend / fig.get_figheight()), 1, 1))
    return fig


def spectrum_figure(spectra: Mapping[str, Sequence[Sequence[float]]], title: str = "", floor: float = 1e-4):
    """Normalised singular values (largest = 1) of each layer's token matrix, log scale, one panel per variant;
    values below `floor` (zeroed dimensions) are drawn at the floor."""
    width = 5.2 * len(spectra)
    count = max((len(layers) for layers in spectra.values()), default=0)
    labels = [f"layer {layer}" for layer in range(count)]
    legend = legend_rows(labels, width, 7)[1] if count else 0.0  # below: 13 or 25 layers' entries covered the curves
    fig, axes = subplots(1, len(spectra), figsize=(width, 3.9 + legend), squeeze=False, sharey=True)
    for ax, (name, layers) in zip(axes[0], spectra.items()):
        for layer, (values, color) in enumerate(zip(layers, line_colors(len(layers)))):
            values = np.clip(np.asarray(values, dtype=float), floor, None)
            ax.plot(np.arange(1, len(values) + 1), values, color=color, linewidth=1, label=f"layer {layer}")
        ax.set_ylim(floor / 2, 1.5)
        plain_log_axis(ax)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("singular value index", fontsize=8)
        ax.tick_params(labelsize=7, which="both")
    axes[0, 0].set_ylabel("singular value / largest", fontsize=8)
    if count:
        legend_below(fig, [Line2D([], [], color=color, linewidth=1) for color in line_colors(count)], labels)
    suptitle(fig, title or "singular-value spectrum of each layer's token matrix", max(width, 6))
    fig.tight_layout(rect=(0, legend / fig.get_figheight(), 1, 1))
    return fig


def heatmap_grid_figure(matrices: Sequence, titles: Sequence[str], xlabel: str, ylabel: str, title: str = "",
                        cmap: str = "viridis", columns: int = 4, colorbar: str = "", marked: Sequence[int] = ()):
    """One heatmap panel per matrix (e.g. contributions [positions, hidden] of each layer), each with its own colour
    scale and colour bar (labelled `colorbar`), in one figure; `marked` columns (the outlier dims) numbered above
    each panel."""
    matrices = [as_array(m) for m in matrices]
    columns = min(columns, len(matrices))
    rows = -(-len(matrices) // columns)
    width = 3.9 * columns
    fig, axes = subplots(rows, columns, figsize=(width, 2.7 * rows + 0.8), squeeze=False)
    for ax, matrix, name in zip(axes.flat, matrices, titles):
        image = ax.imshow(matrix, aspect="auto", interpolation="nearest", cmap=cmap)
        bar = fig.colorbar(image, ax=ax, fraction=0.05)
        bar.set_label(colorbar or "value", fontsize=6)
        bar.ax.tick_params(labelsize=5)
        ax.set_title(name, fontsize=8, pad=title_pad(label_dims(ax, marked, matrix.shape[1])))
        ax.tick_params(labelsize=6)
    for ax in axes.flat[len(matrices):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel(xlabel, fontsize=7)
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel, fontsize=7)
    suptitle(fig, title, width)
    fig.tight_layout()
    return fig


def save_figure(fig, path: str | Path, dpi: int = 120) -> Path:
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    return path


def figure_array(fig) -> np.ndarray:
    """A matplotlib figure as an RGB array [height, width, 3] (uint8)."""
    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()
