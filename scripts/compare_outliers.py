"""Two `analyze.py outliers` reports side by side, layer by layer (e.g. a model trained with and without PE).

    python scripts/compare_outliers.py runs/demo/tiny-pe/outliers/outliers.json runs/demo/tiny-nope/outliers/outliers.json

Dimensions are 0-indexed; layer 0 is the embedding output.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def label(report: dict, path: str) -> str:
    """The encoder's directory name; for a run's export/, the run's (tiny-pe, not export)."""
    encoder = Path(report["encoder"])
    return (encoder.parent.name if encoder.name == "export" else encoder.name) or path


def cell(layer: dict) -> str:
    dims = ",".join(map(str, layer["outlier_dims"][:4])) + ("…" if len(layer["outlier_dims"]) > 4 else "")
    return f"max {layer['argmax_dim']:>4} {layer['argmax_share']:4.0%}  min {layer['argmin_dim']:>4} " \
           f"{layer['argmin_share']:4.0%}  {dims or '-'}"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    try:
        reports = [json.loads(Path(path).read_text()) for path in argv]
    except (OSError, json.JSONDecodeError) as error:
        print(f"compare_outliers.py: error: cannot read report: {error}", file=sys.stderr)
        return 2
    width = 46
    names = [label(report, path) for report, path in zip(reports, argv)]
    print(f"\noutlier dimensions per layer (dims 0-indexed; layer 0 = embeddings; {reports[0]['num_tokens']:,} / "
          f"{reports[1]['num_tokens']:,} tokens)\neach cell: the dim holding most tokens' max and its share, the same "
          "for the min, then the layer's outlier dims")
    print(f"{'layer':>5}  {names[0]:<{width}}  {names[1]:<{width}}")
    for left, right in zip(reports[0]["layers"], reports[1]["layers"]):
        print(f"{left['layer']:>5}  {cell(left):<{width}}  {cell(right):<{width}}")
    for name, report in zip(names, reports):
        origins = report["origins"]
        note = origins.get("position_embeddings_note") or "position table traced"
        print(f"{name}: persistent outlier dims {report['persistent_dims'] or 'none'}; "
              f"largest argmax share {max(layer['argmax_share'] for layer in report['layers']):.0%}; "
              f"positional embeddings: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
