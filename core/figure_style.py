"""The one style of every figure (core/figures.py, core/step_figures.py): colours, titles wrapped to the figure,
legends under the panels, outlier dims numbered above a panel, plain numbers on log axes, layer ticks, fixed margins,
figures made without pyplot (drawable off the main thread).

    fig, axes = subplots(2, 1, figsize=(10, 6))      # a Figure and its axes, no pyplot state
    label_dims(ax, [300, 302, 557], extent=768)       # "300, 302" and "557" above the panel, a red tick at each column
    legend_below(fig, handles, labels)                # one legend for every panel, under them
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.ticker as mticker  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

OUTLIER_RED, BAR_BLUE, GREYS = "#c44e52", "#4c72b0", ("#777777", "#333333", "#aaaaaa")
MARKERS = "osd^v<>Ph*X"
SERIES = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#17becf"]  # tab10
# without its olive (#bcbd22), a yellow that does not read on white


def fit_title(text: str, width_inches: float, fontsize: float = 10) -> str:
    """`text` wrapped to a figure `width_inches` wide at `fontsize`: breaks at spaces, never inside (...) or [...]
    unless the bracket alone is wider than a line (then at its spaces)."""
    width = max(20, int(width_inches * 72 / (fontsize * 0.6)))
    words, depth, current = [], 0, ""
    for char in text:  # a space inside brackets joins its neighbours into one word
        if char in "([":
            depth += 1
        elif char in ")]" and depth:
            depth -= 1
        if char == " " and depth == 0:
            words.append(current)
            current = ""
        else:
            current += char
    words.append(current)
    pieces = [piece for word in words if word
              for piece in (fill(word, width).split("\n") if len(word) > width else [word])]
    lines, line = [], ""
    for piece in pieces:
        if line and len(line) + 1 + len(piece) > width:
            lines.append(line)
            line = piece
        else:
            line = f"{line} {piece}" if line else piece
    return "\n".join([*lines, line] if line else lines)


def fill(text: str, width: int) -> str:
    return textwrap.fill(text, width, break_on_hyphens=False)


def line_colors(count: int) -> np.ndarray:
    """`count` colours in order (e.g. layers), dark blue to orange: plasma without its pale yellow end."""
    return matplotlib.colormaps["plasma"](np.linspace(0, 0.78, max(count, 2)))[:count]


def plain_log_axis(ax, axis: str = "y") -> None:
    """A log axis labelled with plain numbers (0.01, 3.5, 100; not 10^-2 or 3.5x10^0); minor ticks labelled when the
    axis spans less than a decade (else there would be no label at all), their 2s and 5s when it spans less than 2.5
    decades (else one or two numbers on the whole axis)."""
    (ax.set_yscale if axis == "y" else ax.set_xscale)("log")
    target = ax.yaxis if axis == "y" else ax.xaxis
    low, high = ax.get_ylim() if axis == "y" else ax.get_xlim()
    target.set_major_formatter(PlainLogFormatter())
    within_decade = low > 0 and high / low < 10
    few_decades = low > 0 and high / low < 10 ** 2.5  # 3 to 60: 5, 10, 20, 50 rather than a lone 10
    target.set_minor_formatter(PlainLogFormatter(minor=True) if within_decade
                               else mticker.FuncFormatter(two_and_five) if few_decades else mticker.NullFormatter())


class PlainLogFormatter(mticker.Formatter):
    """plain_number labels for a log axis' ticks, with as many significant digits (2 at least) as the ticks shown
    need to read apart: on a narrow axis (a kurtosis of 2.871 to 2.881 in every layer) matplotlib's minor ticks fall
    back to linear ones, 2.872, 2.874, ..., which two digits all wrote "2.9". `minor`: a minor formatter, whose
    labels read apart from the major ones too (10.004 beside 10)."""

    def __init__(self, minor: bool = False) -> None:
        self.minor = minor

    def format_ticks(self, values) -> list[str]:
        low, high = sorted(self.axis.get_view_interval()) if self.axis is not None else (-np.inf, np.inf)
        shown = [v for v in [*values, *(self.axis.get_majorticklocs() if self.minor and self.axis is not None
                                        else [])] if low <= v <= high]
        digits = distinct_digits(shown)
        return [plain_number(value, digits=digits) for value in values]

    def __call__(self, value: float, pos=None) -> str:
        return plain_number(value)


def distinct_digits(values: Sequence[float], least: int = 2, most: int = 12) -> int:
    """The fewest significant digits, `least` at the fewest, that write `values` apart as plain_number does (values
    equal to `most` digits count as one)."""
    wanted = len({plain_number(value, digits=most) for value in values})
    return next((digits for digits in range(least, most) if len({plain_number(value, digits=digits)
                                                                   for value in values}) == wanted), most)


def plain_number(value: float, _=None, digits: int = 2) -> str:
    """A tick label of (at most) `digits` significant digits written out: 300, 0.35, 0.00001 (not 3e+02, 1e-05)."""
    return np.format_float_positional(value, precision=digits, fractional=False, trim="-")


def two_and_five(value: float, _=None) -> str:
    """A minor log tick's label when it is 2 or 5 times a power of ten (20, 0.5), else none."""
    mantissa = value / 10 ** np.floor(np.log10(value)) if value > 0 else 0
    return plain_number(value) if np.isclose(mantissa, 2) or np.isclose(mantissa, 5) else ""


def layer_ticks(ax, layers: Sequence[int]) -> None:
    """A tick at every layer, numbered up to 16 layers, every other one beyond (25 numbers ran into each other)."""
    layers = list(layers)
    ax.set_xticks(layers if len(layers) <= 16 else layers[::2])
    if len(layers) > 16:
        ax.set_xticks(layers, minor=True)


def say_empty(ax, reason: str = "") -> None:
    """Write in the panel that it has nothing to show, and why."""
    ax.text(0.5, 0.5, fill(f"nothing to show: {reason}" if reason else "nothing to show", 40), ha="center",
            va="center", transform=ax.transAxes, fontsize=9, color=GREYS[1])
    ax.set_xticks([])
    ax.set_yticks([])


def layered(index: int) -> dict:
    """Line width and marker size of the index-th series: each drawn a little thinner than the one before, so that a
    series equal to an earlier one (clipped = raw in a layer without outliers) leaves it visible around it."""
    return {"linewidth": max(1.0, 2.6 - 0.7 * index), "markersize": max(3.0, 6.5 - 1.5 * index)}


def finite(values) -> bool:
    """Whether any of `values` (None for missing) is a finite number."""
    array = np.asarray([np.nan if v is None else v for v in values], dtype=float)
    return bool(np.isfinite(array).any())


def suptitle(fig, title: str, width_inches: float, fontsize: float = 10) -> int:
    """The figure's title wrapped to its width; how many lines it takes (0 without a title)."""
    if not title:
        return 0
    text = fit_title(title, width_inches, fontsize)
    # 0.08 inch below the top edge at any figure height (matplotlib's default, 2% of the height, sinks into a tall
    # figure's legend: 0.35 inch down in a 13-layer mean_vectors.png)
    fig.suptitle(text, fontsize=fontsize, y=1 - 0.08 / fig.get_figheight(), va="top")
    return text.count("\n") + 1


def legend_rows(labels: Sequence[str], width_inches: float, fontsize: float = 7) -> tuple[int, float]:
    """The columns of a legend of `labels` laid out across `width_inches`, and the height in inches it takes."""
    entry = 0.5 + max((len(label) for label in labels), default=1) * fontsize * 0.55 / 72  # marker + text + gap
    columns = max(1, min(len(labels), int((width_inches - 0.3) // entry)))
    return columns, -(-len(labels) // columns) * fontsize * 1.45 / 72 + 0.1


def below_panel_legend(ax, fontsize: float = 7) -> None:
    """The panel's legend under its x label, centred, in as many columns as fit (inside, 'best' still covered the
    peaks of a 13-layer magnitudes.png); tight_layout makes room for it."""
    handles, labels = ax.get_legend_handles_labels()
    if not labels:
        return
    width = ax.get_position().width * ax.figure.get_figwidth()
    height = max(ax.get_position().height * ax.figure.get_figheight(), 0.5)
    columns, _ = legend_rows(labels, width + 0.6, fontsize)
    ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.42 / height), ncol=columns,
              fontsize=fontsize, frameon=False)


def legend_below(fig, handles: Sequence, labels: Sequence[str], fontsize: float = 7) -> None:
    """One legend for every panel, centred under them (it never covers data): the figure's bottom margin must hold
    legend_rows' height."""
    columns, _ = legend_rows(labels, fig.get_figwidth(), fontsize)
    fig.legend(list(handles), list(labels), loc="lower center", bbox_to_anchor=(0.5, 0.04 / fig.get_figheight()),
               ncol=columns, fontsize=fontsize, frameon=False)


def label_dims(ax, dims: Sequence[int], extent: int) -> int:
    """Each of `dims` (columns of an x axis 0..extent) marked with a red tick above the panel and numbered there; dims
    closer than 2% of the axis share one label ("300, 302"), and labels that would touch are stacked in rows (at 768
    dims a number is as wide as 10 columns). Returns the rows of labels (0 without dims): title_pad gives the title's
    pad above them."""
    dims = sorted({int(d) for d in dims if 0 <= d < extent})
    if not dims:
        return 0
    width = max(ax.get_position().width * ax.figure.get_figwidth(), 0.5)  # the panel's width in inches
    per_char = 7 * 0.62 / 72 / width * extent  # a digit at 7 points, in columns
    ax.vlines(dims, 1, 1 + 3 / (72 * max(ax.get_position().height * ax.figure.get_figheight(), 0.3)),
              transform=ax.get_xaxis_transform(), colors=OUTLIER_RED, linewidth=1, clip_on=False)
    clusters: list[list[int]] = []
    for d in dims:
        if clusters and d - clusters[-1][-1] < 0.02 * extent:
            clusters[-1].append(d)
        else:
            clusters.append([d])
    ends: list[float] = []  # per row, where its last label ends (columns)
    for cluster in clusters:
        text = ", ".join(map(str, cluster))
        x, half = (cluster[0] + cluster[-1]) / 2, (len(text) + 1) * per_char / 2
        row = next((k for k, end in enumerate(ends) if end < x - half), len(ends))
        ends[row:row + 1] = [x + half]
        ax.annotate(text, xy=(x, 1), xycoords=("data", "axes fraction"), xytext=(0, 4 + 10 * row),
                    textcoords="offset points", ha="center", va="bottom", fontsize=7, color=OUTLIER_RED)
    return len(ends)


def title_pad(rows: int) -> float:
    """The title's pad (points) above label_dims' `rows` rows of numbers."""
    return 6 + 10 * rows + (4 if rows else 0)


def margins(fig, left: float, right: float, bottom: float, top: float, **space) -> None:
    """Fixed margins in inches (the live figures: tight_layout's measuring costs as much as the drawing)."""
    width, height = fig.get_figwidth(), fig.get_figheight()
    fig.subplots_adjust(left=left / width, right=1 - right / width, bottom=bottom / height, top=1 - top / height,
                        **space)


def as_array(values) -> np.ndarray:
    return np.asarray(values.detach().cpu() if hasattr(values, "detach") else values, dtype=float)



def subplots(*args, figsize: tuple[float, float], **kwargs):
    """A figure and its axes, as pyplot.subplots makes them, without pyplot: no global state, so that a figure can
    be made and drawn off the main thread (callbacks/media.py)."""
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(*args, **kwargs)
