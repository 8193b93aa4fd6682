"""Figures against the training step: trajectories, the study (analyses/) and the live callbacks, in core/figures.py's
style and with its helpers.

    over_steps_figure([{"title": "entropy", "series": {"layer 1": ([0, 100], [.9, .7])}}])       # live, over time
    over_steps_figure([{..., "series": {"arm": (steps, mean, low, high)}, "thresholds": {"arm": (steps, null)}}])
    layer_step_figure([{"title": "top share", "colorbar": "share", "values": [[.1, .6]]}], [0, 100], [1])
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import matplotlib.ticker as mticker
import numpy as np
from matplotlib.colors import LogNorm
from matplotlib.lines import Line2D

from core.figure_style import (
    SERIES,
    PlainLogFormatter,
    fill,
    finite,
    fit_title,
    legend_below,
    legend_rows,
    line_colors,
    margins,
    plain_log_axis,
    say_empty,
    subplots,
    suptitle,
)


def over_steps_figure(panels: Sequence[Mapping], title: str = "", columns: int = 3):
    """Statistics against the training step in side-by-side panels, one line per series (e.g. per layer).

    Each panel: {"title", "ylabel", "series": {name: (steps, values)}}, optionally "log": True (a log y axis) and
    "empty" (why a panel without values is empty). A series given as (steps, values, low, high) also draws the band
    from low to high (e.g. the range over seeds); a panel's "thresholds": {name: (steps, values)} draws a dashed line
    in the colour of the series of that name (e.g. the level above which it is beyond its null), and
    "threshold_label" names the dashed lines in the legend."""
    columns = max(1, min(columns, len(panels)))
    rows = (len(panels) + columns - 1) // columns
    width = 4.6 * columns
    names = list(dict.fromkeys(name for panel in panels for name in panel["series"]))  # one colour per name
    # layers are ordered (dark to light); arms and runs are not: a palette of distinct colours, as long as it lasts
    ordered = all(re.fullmatch(r"layer \d+", name) for name in names) or len(names) > len(SERIES)
    colors = dict(zip(names, line_colors(len(names)) if ordered else SERIES))
    threshold = next((panel["threshold_label"] for panel in panels if panel.get("thresholds")
                      and panel.get("threshold_label")), None)
    labels = names + ([threshold] if threshold else [])
    legend = legend_rows(labels, width)[1] if labels else 0.0  # below the panels: inside one it covered its lines
    fig, axes = subplots(rows, columns, figsize=(width, 3.2 * rows + 0.3 + legend), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        series = panel["series"]
        ax.set_title(fit_title(panel.get("title", ""), 4.4, 9), fontsize=9)
        if not any(finite(values) for _, values, *_ in series.values()):
            say_empty(ax, panel.get("empty", ""))
            continue
        for name, (steps, values, *band) in series.items():
            ax.plot(list(steps), [np.nan if v is None else v for v in values], marker="o", markersize=2.5,
                    linewidth=1, color=colors[name], label=name)
            if band:
                ax.fill_between(list(steps), np.asarray(band[0], dtype=float), np.asarray(band[1], dtype=float),
                                color=colors[name], alpha=0.2, linewidth=0)
            if name in panel.get("thresholds", {}):
                threshold_steps, threshold_values = panel["thresholds"][name]
                ax.plot(list(threshold_steps), [np.nan if v is None else v for v in threshold_values],
                        linestyle="--", linewidth=0.8, color=colors[name])
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel(panel.get("ylabel", ""), fontsize=8)
        ax.tick_params(labelsize=7, which="both")
        if panel.get("log"):
            plain_log_axis(ax)
        else:
            ax.locator_params(nbins=4)  # few tick labels: their text is most of the drawing time
    if any(ax.get_lines() for ax in axes.flat):  # one legend for every panel: a name has one colour in all of them
        handles = [Line2D([], [], color=colors[name], marker="o", markersize=2.5, linewidth=1) for name in names]
        if threshold:  # the dashed lines, in the colour of their series
            handles.append(Line2D([], [], color="0.3", linestyle="--", linewidth=0.8))
        legend_below(fig, handles, labels)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    lines = suptitle(fig, title, width)
    # fixed margins: tight_layout's measuring costs a third of the figure, made live during training
    margins(fig, 0.6, 0.15, 0.5 + legend, 0.35 + 0.2 * lines, wspace=0.3, hspace=0.55)
    return fig


def layer_step_figure(panels: Sequence[Mapping], steps: Sequence[int], layers: Sequence[int], title: str = ""):
    """Layer x step images side by side, one per statistic: rows are `layers`, columns the captured `steps`.

    Each panel: {"title", "colorbar" (the colour bar's label), "values": [layers, steps] (nan: not captured),
    "log": True for a log colour scale (optional)}."""
    width = 4.4 * len(panels) + 0.4
    fig, axes = subplots(1, len(panels), figsize=(width, max(2.6, 0.28 * len(layers) + 1.9)), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        values = np.asarray(panel["values"], dtype=float)
        ax.set_title(fit_title(panel["title"], 4.2, 9), fontsize=9)
        if not np.isfinite(values).any():
            say_empty(ax, panel.get("empty", "no capture yet"))
            continue
        positive = values[np.isfinite(values) & (values > 0)]
        norm = LogNorm(positive.min(), max(positive.max(), positive.min() * 1.01)) if panel.get("log") and \
            positive.size else None
        image = ax.imshow(values, aspect="auto", interpolation="nearest", cmap="viridis", norm=norm)
        bar = fig.colorbar(image, ax=ax, fraction=0.06, pad=0.03)
        bar.set_label(fill(panel["colorbar"], 28), fontsize=7)
        bar.ax.tick_params(labelsize=6, which="both")
        if norm is not None:
            bar.ax.yaxis.set_major_formatter(PlainLogFormatter())
            few = norm.vmax / norm.vmin < 30  # label the 2, 3, 5... ticks too, or a bar may show one number
            bar.ax.yaxis.set_minor_formatter(PlainLogFormatter(minor=True) if few else mticker.NullFormatter())
        ticks = np.arange(len(steps)) if len(steps) <= 8 else \
            np.unique(np.linspace(0, len(steps) - 1, 6).round().astype(int))
        ax.set_xticks(ticks, labels=[str(steps[i]) for i in ticks])
        ax.set_yticks(range(len(layers)), labels=[str(layer) for layer in layers])
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("layer", fontsize=8)
        ax.tick_params(labelsize=7)
    lines = suptitle(fig, title, width)
    margins(fig, 0.55, 0.75, 0.5, 0.35 + 0.2 * lines, wspace=0.55)
    return fig
