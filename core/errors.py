"""The one exception a user's input raises, printed by every entry point as one line with exit status 2.

    raise UserError(f"data path not found: {source}")      # train.py / probe.py / analyze.py print it, exit 2
    first_line(error)                                      # a library's message, cut to one line
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input or environment: printed as one line, exit status 2."""


def first_line(error: BaseException) -> str:
    """The first line of an exception's message, or its type name when it has none."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
