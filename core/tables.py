"""Terminal tables whose columns are as wide as their widest cell (analyze.py's per-layer tables, compare, intervene).

    for line in table_lines(["layer", "accuracy"], [["0", "0.913"], ["12", "0.402"]], align=">"):
        print(line)
    shown_token({"token": "Ġs", "text": " s"})    # "' s'": a report's token for a table, quoted, spaces visible

Torch-free: `analyze.py compare` reads JSON only.
"""

from __future__ import annotations

from collections.abc import Sequence


def table_lines(headers: Sequence[str], rows: Sequence[Sequence[str]], align: str | Sequence[str] = "<",
                gap: str = "  ") -> list[str]:
    """The header line, then one line per row. Each column is as wide as its widest cell (its header included), every
    cell padded to that width (`align`: "<" left, ">" right, or one of them per column) and joined by `gap`, so each
    column starts at the same offset on every line; trailing spaces are cut."""
    aligns = [align] * len(headers) if isinstance(align, str) else list(align)
    if len(aligns) != len(headers) or any(len(row) != len(headers) for row in rows):
        raise ValueError(f"a table of {len(headers)} columns needs as many alignments and cells per row")
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows)]
    return [gap.join(f"{cell:{a}{width}}" for cell, a, width in zip(line, aligns, widths)).rstrip()
            for line in (headers, *rows)]


def shown_token(entry: dict) -> str:
    """A report entry's token as a table shows it: its readable `text` (core.tokenizers.readable_token), quoted so that
    spaces show ("' s'", control characters escaped), or, in a report without one, its raw `token`; "-" for none."""
    text = entry.get("text", entry.get("token"))
    return "-" if text is None else repr(text)
