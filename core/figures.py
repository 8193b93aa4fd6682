"""Matplotlib figures shared by analyze.py reports, the probes and the W&B callbacks (headless, Agg backend).

    fig = mean_vectors_figure(mean, outliers={layer: [dims]}, title="MiniLM")   # the paper's Figures 1-2
    position_rows_figure(rows, dims=[d1, d2])                                    # Figures 3-4
    save_figure(fig, "runs/x/mean_vectors.png")                                 # or figure_array(fig): RGB for loggers
    layer_panels_figure([{"title": "anisotropy", "layers": [0, 1], "series": {"raw": [.9, .8]}}])  # Figure 6
    over_steps_figure([{"title": "entropy", "series": {"layer 1": ([0, 100], [.9, .7])}}])       # live, over time
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker as mticker  # noqa: E402
import numpy as np  # noqa: E402


def mean_vectors_figure(mean, outliers: Mapping[int, Sequence[int]] | None = None, title: str = "",
                        layers: Sequence[int] | None = None):
    """The average hidden vector of each layer as bars over dimensions, outlier dimensions marked and labelled.

    mean: [layers, hidden] array or tensor.
    """
    mean = np.asarray(mean.detach().cpu() if hasattr(mean, "detach") else mean, dtype=float)
    layers = list(layers) if layers is not None else list(range(mean.shape[0]))
    outliers = outliers or {}
    fig, axes = plt.subplots(len(layers), 1, figsize=(10, 1.25 * len(layers) + 0.8), sharex=True, squeeze=False)
    edges = np.arange(mean.shape[1] + 1) - 0.5  # dimension d's bar spans d - 0.5 .. d + 0.5
    for ax, layer in zip(axes[:, 0], layers):
        values = mean[layer]
        # one filled step patch per layer draws the bars of width 1 (thousands of bar patches take seconds to draw at
        # 768 dimensions x 13 layers, an image the live callbacks make during training)
        ax.stairs(values, edges, baseline=0, fill=True, color="#4c72b0", linewidth=0)
        marked = [d for d in outliers.get(layer, []) if 0 <= d < len(values)]
        if marked:
            ax.scatter(marked, values[marked], color="#c44e52", s=14, zorder=3)
            for d in marked[:4]:
                ax.annotate(str(d), (d, values[d]), textcoords="offset points", xytext=(3, 0), fontsize=7,
                            color="#c44e52", va="center")
        ax.axhline(0, color="black", linewidth=0.4)
        ax.set_ylabel(f"layer {layer}", rotation=0, ha="right", va="center", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[-1, 0].set_xlabel("dimension (0-indexed)")
    axes[-1, 0].set_xlim(-1, mean.shape[1])
    fig.suptitle(title or "average vector per layer (outlier dimensions in red)", fontsize=10)
    fig.tight_layout()
    return fig


def position_rows_figure(rows, dims: Sequence[int], title: str = ""):
    """The positional-embedding rows (the paper's Figures 3-4): a heatmap positions x dimensions with the outlier
    dims marked, and each outlier dim's value against the position beside the mean |value| of all dims.

    rows: [positions, hidden] (the rows a token can use, in the hidden space)."""
    rows = np.asarray(rows.detach().cpu() if hasattr(rows, "detach") else rows, dtype=float)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), gridspec_kw={"height_ratios": [3, 2]})
    limit = np.percentile(np.abs(rows), 99.5) or 1.0
    image = top.imshow(rows, aspect="auto", interpolation="nearest", cmap="RdBu_r", vmin=-limit, vmax=limit)
    fig.colorbar(image, ax=top, fraction=0.025)
    for d in dims:
        top.axvline(d, color="black", linewidth=0.9, linestyle="--")
    marks = top.secondary_xaxis("top")
    marks.set_xticks(list(dims), labels=[str(d) for d in dims], fontsize=7)
    top.set_xlabel("dimension (0-indexed; the outlier dims dashed, labelled above)")
    top.set_ylabel("position")
    positions = np.arange(rows.shape[0])
    for d in list(dims)[:6]:
        bottom.plot(positions, rows[:, d], linewidth=1, label=f"dim {d}")
    bottom.plot(positions, np.abs(rows).mean(1), color="black", linestyle="--", linewidth=1, label="mean |value|")
    bottom.set_xlabel("position (0-indexed)")
    bottom.set_ylabel("value")
    bottom.legend(fontsize=7, ncol=4)
    fig.suptitle(textwrap.fill(title or "position-embedding rows", width=120), fontsize=10)
    fig.tight_layout()
    return fig


def heatmap_figure(matrix, xlabel: str, ylabel: str, title: str = "", cmap: str = "viridis"):
    """A labelled heatmap, e.g. contribution vectors [layers, hidden] or [positions, hidden]."""
    matrix = np.asarray(matrix.detach().cpu() if hasattr(matrix, "detach") else matrix, dtype=float)
    fig, ax = plt.subplots(figsize=(10, max(2.5, min(8.0, 0.3 * matrix.shape[0] + 1.5))))
    image = ax.imshow(matrix, aspect="auto", interpolation="nearest", cmap=cmap)
    fig.colorbar(image, ax=ax, fraction=0.025)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def accuracy_by_layer_figure(layers: Sequence[int], series: Mapping[str, Sequence[float]],
                             baselines: Mapping[str, float] | None = None, title: str = ""):
    """Probe accuracy per layer, one line per series (encoder, random encoder, ...), baselines as dashed lines."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, values), marker in zip(series.items(), "osd^v<>"):
        ax.plot(list(layers), list(values), marker=marker, label=name)
    for (name, value), color in zip((baselines or {}).items(), ("#888888", "#bbbbbb", "#444444")):
        ax.axhline(value, linestyle="--", linewidth=1, color=color, label=f"{name} ({value:.3f})")
    ax.set_xlabel("layer (0 = embedding output)")
    ax.set_ylabel("test accuracy")
    ax.set_xticks(list(layers))
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8)
    ax.set_title(title or "probe accuracy by layer", fontsize=10)
    fig.tight_layout()
    return fig


def layer_panels_figure(panels: Sequence[Mapping], title: str = "", columns: int = 2):
    """Per-layer curves in side-by-side panels (the paper's Figure 6: before / after clipping).

    Each panel: {"title", "ylabel", "layers": [..], "series": {name: [value per layer, None for missing]},
    "baselines": {name: value} (optional, dashed)}.
    """
    columns = max(1, min(columns, len(panels)))
    rows = (len(panels) + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 3.6 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        layers = list(panel["layers"])
        for (name, values), marker in zip(panel["series"].items(), "osd^v<>"):
            ax.plot(layers, [np.nan if v is None else v for v in values], marker=marker, markersize=4, label=name)
        for (name, value), color in zip((panel.get("baselines") or {}).items(), ("#888888", "#444444", "#bbbbbb")):
            if value is not None:
                ax.axhline(value, linestyle="--", linewidth=1, color=color, label=f"{name} ({value:.3g})")
        ax.set_title(panel.get("title", ""), fontsize=9)
        ax.set_xlabel("layer (0 = embedding output)", fontsize=8)
        ax.set_ylabel(panel.get("ylabel", ""), fontsize=8)
        ax.set_xticks(layers)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if title:
        fig.suptitle(textwrap.fill(title, width=int(10 * 5.2 * columns)), fontsize=10)
    fig.tight_layout()
    return fig


def over_steps_figure(panels: Sequence[Mapping], title: str = "", columns: int = 3):
    """Statistics against the training step in side-by-side panels, one line per series (e.g. per layer).

    Each panel: {"title", "ylabel", "series": {name: (steps, values)}}, optionally "log": True (a log y axis). A series
    given as (steps, values, low, high) also draws the band from low to high (e.g. the range over seeds); a panel's
    "thresholds": {name: (steps, values)} draws a dashed line in the colour of the series of that name (e.g. the level
    above which it is beyond its null), and "threshold_label" names the dashed lines in the legend."""
    columns = max(1, min(columns, len(panels)))
    rows = (len(panels) + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 3.2 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        series = panel["series"]
        colors = plt.cm.viridis(np.linspace(0, 1, max(len(series), 2)))
        for (name, (steps, values, *band)), color in zip(series.items(), colors):
            ax.plot(list(steps), list(values), marker="o", markersize=2.5, linewidth=1, color=color, label=name)
            if band:
                ax.fill_between(list(steps), np.asarray(band[0], dtype=float), np.asarray(band[1], dtype=float),
                                color=color, alpha=0.2, linewidth=0)
            if name in panel.get("thresholds", {}):
                steps, values = panel["thresholds"][name]
                label = panel.get("threshold_label") if name == next(iter(panel["thresholds"])) else None
                ax.plot(list(steps), list(values), linestyle="--", linewidth=0.8, color=color, label=label)
        ax.set_title(panel.get("title", ""), fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel(panel.get("ylabel", ""), fontsize=8)
        ax.tick_params(labelsize=7)
        if panel.get("log"):
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(mticker.FormatStrFormatter("%g"))  # 3.4, not 3.4 x 10^0
            ax.yaxis.set_minor_formatter(mticker.FormatStrFormatter("%g"))
        else:
            ax.locator_params(nbins=4)  # few tick labels: their text is most of the drawing time
    axes.flat[0].legend(fontsize=6, ncol=2)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if title:
        fig.suptitle(textwrap.fill(title, width=int(10 * 4.6 * columns)), fontsize=10)
    # fixed margins: tight_layout's measuring costs a third of the figure, made live during training
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.1, top=0.88 if title else 0.95, wspace=0.3, hspace=0.45)
    return fig


def spectrum_figure(spectra: Mapping[str, Sequence[Sequence[float]]], title: str = "", floor: float = 1e-4):
    """Normalised singular values (largest = 1) of each layer's token matrix, log scale, one panel per variant;
    values below `floor` (zeroed dimensions) are drawn at the floor."""
    fig, axes = plt.subplots(1, len(spectra), figsize=(5.2 * len(spectra), 3.6), squeeze=False, sharey=True)
    for ax, (name, layers) in zip(axes[0], spectra.items()):
        colors = plt.cm.viridis(np.linspace(0, 1, max(len(layers), 2)))
        for layer, (values, color) in enumerate(zip(layers, colors)):
            values = np.clip(np.asarray(values, dtype=float), floor, None)
            ax.plot(np.arange(1, len(values) + 1), values, color=color, linewidth=1, label=f"layer {layer}")
        ax.set_yscale("log")
        ax.set_ylim(floor / 2, 1.5)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("singular value index", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0, 0].set_ylabel("singular value / largest", fontsize=8)
    axes[0, -1].legend(fontsize=6, ncol=2)
    fig.suptitle(title or "singular-value spectrum of each layer's token matrix", fontsize=10)
    fig.tight_layout()
    return fig


def heatmap_grid_figure(matrices: Sequence, titles: Sequence[str], xlabel: str, ylabel: str, title: str = "",
                        cmap: str = "viridis", columns: int = 4):
    """One heatmap panel per matrix (e.g. contributions [positions, hidden] of each layer), each with its own colour
    scale (its maximum in the panel title), in one figure."""
    matrices = [np.asarray(m.detach().cpu() if hasattr(m, "detach") else m, dtype=float) for m in matrices]
    columns = min(columns, len(matrices))
    rows = -(-len(matrices) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.6 * columns, 2.6 * rows + 0.6), squeeze=False)
    for ax, matrix, name in zip(axes.flat, matrices, titles):
        ax.imshow(matrix, aspect="auto", interpolation="nearest", cmap=cmap)
        ax.set_title(f"{name} (max {matrix.max():.3g})", fontsize=8)
        ax.tick_params(labelsize=6)
    for ax in axes.flat[len(matrices):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel(xlabel, fontsize=7)
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel, fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def save_figure(fig, path: str | Path, dpi: int = 120) -> Path:
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def figure_array(fig) -> np.ndarray:
    """A matplotlib figure as an RGB array [height, width, 3] (uint8); the figure is closed."""
    try:
        fig.canvas.draw()
        return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    finally:
        plt.close(fig)
