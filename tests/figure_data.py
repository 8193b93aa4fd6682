"""Test helper: what a saved figure draws, read back from its artists (not its pixels), so that a test compares the
figure an entry point wrote with the report it wrote beside it.

    saved = saved_figures(monkeypatch, analyses.session)   # {file name: figure} of every save_figure of the run
    (panel,) = panels(saved["anisotropy.png"])              # [{"title", "lines": {label: (x, y)}, "dashed", "bands"}]
    same(panel["lines"]["raw"], layers, [row["raw"] for row in report["layers"]])
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
from matplotlib.collections import PolyCollection


def saved_figures(monkeypatch, *modules) -> dict:
    """{file name: figure} of every figure the modules' `save_figure` writes while the test runs (still written)."""
    saved = {}
    for module in modules:
        def record(fig, path, *args, real=module.save_figure, **kwargs):
            saved[Path(path).name] = fig
            return real(fig, path, *args, **kwargs)
        monkeypatch.setattr(module, "save_figure", record)
    return saved


def panels(fig) -> list[dict]:
    """The figure's data panels in order (colour bars and switched-off axes left out): the title (line breaks as
    spaces), the solid lines by label {label: (x, y)}, the dashed lines in drawing order [(label, x, y)], the shaded
    bands in drawing order [{x: (low, high)}] and the images' arrays (heatmaps)."""
    out = []
    for ax in fig.axes:
        if hasattr(ax, "_colorbar") or not ax.axison:
            continue
        lines, dashed = {}, []
        for line in ax.get_lines():
            data = (np.asarray(line.get_xdata(), dtype=float), np.asarray(line.get_ydata(), dtype=float))
            if line.get_linestyle() == "--":
                dashed.append((line.get_label(), *data))
            else:
                assert line.get_label() not in lines, f"two lines labelled {line.get_label()!r}"
                lines[line.get_label()] = data
        bands = []
        for collection in ax.collections:
            if isinstance(collection, PolyCollection):
                at = defaultdict(list)
                for path in collection.get_paths():
                    for x, y in path.vertices:
                        at[float(x)].append(float(y))
                bands.append({x: (min(ys), max(ys)) for x, ys in at.items()})
        out.append({"title": ax.get_title().replace("\n", " "), "lines": lines, "dashed": dashed, "bands": bands,
                    "images": [np.asarray(image.get_array()) for image in ax.get_images()]})
    return out


def same(drawn: tuple, x, y, rtol: float = 1e-6, atol: float = 1e-12) -> None:
    """A drawn line (x, y) against the values it should show (None where nothing is drawn: NaN); `atol` for values
    compared with a report's, rounded to 6 decimals when written."""
    np.testing.assert_allclose(drawn[0], np.asarray(x, dtype=float))
    np.testing.assert_allclose(drawn[1], np.asarray([np.nan if v is None else v for v in y], dtype=float), rtol=rtol,
                               atol=atol)


def same_band(drawn: dict, expected: dict, atol: float = 1e-12) -> None:
    """A drawn band {x: (low, high)} against the bounds it should shade at each x."""
    assert sorted(drawn) == sorted(expected), (sorted(drawn), sorted(expected))
    np.testing.assert_allclose([drawn[x] for x in expected], list(expected.values()), rtol=1e-6, atol=atol)
