"""A count and its noun, agreeing: what every message that says how many of something uses.

    plural(1, "sentence")                           # '1 sentence'
    plural(0, "sentence"), plural(2, "sentence")    # '0 sentences', '2 sentences'
    plural(12345, "token", spec=",")                # '12,345 tokens': the count formatted as f"{count:,}"
    plural(1, "sentence was", "sentences were")     # '1 sentence was': an irregular plural, or a verb that agrees
"""

from __future__ import annotations


def plural(count: int, noun: str, many: str | None = None, spec: str = "") -> str:
    """`count` (formatted by the format spec `spec`) and `noun`, singular for exactly 1 and otherwise (0 too) `many`,
    by default `noun` + "s"."""
    return f"{count:{spec}} {noun if count == 1 else many or noun + 's'}"
