"""`analyze.py compare`: any number of `analyze.py outliers` reports side by side, layer by layer.

    python analyze.py compare runs/demo/tiny-pe/outliers/outliers.json runs/demo/tiny-nope/outliers/outliers.json
    python analyze.py compare minilm=runs/minilm/outliers.json pe=runs/pe/outliers.json nope=runs/nope/outliers.json

Each report keeps its own layers (a 6-layer and a 4-layer model: the 4-layer column ends with '-'), and its name: the
NAME= given, else the encoder's readable name (a run's directory for its export, the package for a packaged model).
Reads JSON only: no model, no torch. Dimensions are 0-indexed; layer 0 is the embedding output.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from core.errors import UserError
from core.sources import short_name
from core.tables import table_lines
from core.wording import plural
from metrics.summary import top_share

KEYS = ("encoder", "layers", "persistent_dims")  # what every outliers.json has (analyses/outliers.py)


def read_report(text: str) -> tuple[str | None, Path, dict]:
    """(NAME or None, path, report) of one `[NAME=]PATH` argument; one line when it is not an outliers report."""
    name, _, path = text.rpartition("=") if "=" in text and not Path(text).exists() else (None, "", text)
    path = Path(path)
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"report not found: {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"cannot read report {path}: {error}") from None
    if not isinstance(report, dict) or any(key not in report for key in KEYS) or not report["layers"]:
        raise UserError(f"{path} is not an outliers report of analyze.py outliers (no {', '.join(KEYS)})")
    return name or None, path, report


def names_of(items: list[tuple[str | None, Path, dict]]) -> list[str]:
    """Each report's name: its NAME=, else its encoder's short name; repeated names numbered (#2, #3)."""
    names = [given or short_name(report["encoder"]) for given, _, report in items]
    seen: dict[str, int] = {}
    unique = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        unique.append(name if names.count(name) == 1 else f"{name} #{seen[name]}")
    return unique


def cell(layer: dict | None) -> str:
    """The dim holding most tokens' max and its share, the same for the min, the layer's outlier dims (the first four
    and how many more)."""
    if layer is None:
        return "-"
    found = layer["outlier_dims"]
    dims = ",".join(map(str, found[:4])) + (f",…(+{len(found) - 4})" if len(found) > 4 else "")  # first 4 and a count
    return (f"max {layer['argmax_dim']:>4} {layer['argmax_share']:4.0%}  min {layer['argmin_dim']:>4} "
            f"{layer['argmin_share']:4.0%}  {dims or '-'}")


def comparison_lines(items: list[tuple[str | None, Path, dict]]) -> list[str]:
    names = names_of(items)
    reports = [report for _, _, report in items]
    by_layer = [{row["layer"]: row for row in report["layers"]} for report in reports]
    layers = sorted({layer for rows in by_layer for layer in rows})
    lines = ["", "outlier dimensions per layer (dims 0-indexed; layer 0 = embeddings); each cell: the dim holding "
                 "most tokens' max and its share, the same for the min, then the layer's outlier dims"]
    for name, report in zip(names, reports):
        tokens = f", {plural(report['num_tokens'], 'token', spec=',')}" if "num_tokens" in report else ""
        lines.append(f"  {name}: {report['encoder']} ({plural(len(report['layers']) - 1, 'layer')}{tokens})")
    rows = [[str(layer), *(cell(found.get(layer)) for found in by_layer)] for layer in layers]
    lines += table_lines(["layer", *names], rows, align=[">", *"<" * len(names)])  # each column as wide as its cells
    for name, report in zip(names, reports):
        note = (report.get("origins") or {}).get("position_embeddings_note") or "position table traced"
        found = report["layers"]  # the largest share of layers 1..L, as the persistent dims are read
        share = top_share([row["argmax_share"] for row in found], [row["argmin_share"] for row in found],
                          [row["layer"] for row in found])
        lines.append(f"{name}: persistent outlier dims {report['persistent_dims'] or 'none'}; largest max/min share "
                     f"of layers 1..L {share:.0%}; positional embeddings: {note}")
    return lines


def rule_of(report: dict) -> str | None:
    """The options that decide a report's outlier dims, in words (None for a report that does not record them)."""
    rule = report.get("rule")
    if not isinstance(rule, dict) or "min_share" not in rule:
        return None
    sigma = f", --sigma {rule['sigma']}" if rule.get("sigma") is not None else ""
    return f"--min_share {rule['min_share']}{sigma}, special tokens {report.get('special_tokens', 'included')}"


def rule_warning(items: list[tuple[str | None, Path, dict]]) -> str | None:
    """One line when the reports' outlier dims come from different rules (--min_share, --sigma, special tokens):
    side by side, their outlier and persistent dims then differ by the rule as well as the model."""
    rules = [rule_of(report) for _, _, report in items]
    if len({rule for rule in rules if rule is not None}) < 2:
        return None
    named = "; ".join(f"{name}: {rule or 'not recorded'}" for name, rule in zip(names_of(items), rules))
    return f"the reports' outlier dims come from different rules ({named}): they differ by the rule, not only the model"


def run_compare(args, rank: int = 0, world: int = 1) -> list[str]:
    """Print the reports side by side (and, when their rules differ, one warning line on stderr); returns the lines
    printed on stdout."""
    items = [read_report(text) for text in args.reports]
    lines = comparison_lines(items)
    print("\n".join(lines))
    if (warning := rule_warning(items)) is not None:
        print(f"warning: {warning}", file=sys.stderr)
    return lines
