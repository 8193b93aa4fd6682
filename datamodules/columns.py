"""Which column of a table holds the text: the one given, else one decided over the rows of the whole source.

    column = TextColumn(None, "reviews.jsonl", "--data.text_column", exclude=("stars",))
    texts = [column(record) for record in iter_records("reviews.jsonl")]   # a str, "" (blank) or None (missing)

A source's text column is one column for all its rows. When none is given, it is the first of TEXT_COLUMNS the rows
have, else the one column whose values are strings; a missing value (JSON's null, a parquet or `datasets` None) says
nothing about which column that is, so such a row is a blank row, not a row without a text column, and two columns
holding strings (in one row, or one in some rows and another in others) are refused: the text of one row is never taken
from another column than the text of the next.
"""

from __future__ import annotations

from core.errors import UserError
from datamodules.characters import text_value

TEXT_COLUMNS = ("text", "sentence", "content", "document", "review")


class TextColumn:
    """The text of each record of one source (see the module docstring), stripped and without a leading byte-order
    mark ("" for a blank one, holding nothing visible: `clean_text`; None for a missing value); a value that is not a
    string (a number, a list of tokens) is refused, naming the column. Detection passes over the columns in `exclude`
    (the labels, a pair's second sentence: a csv's labels are strings too). `option` is the entry point's name for
    the text column, named when none is found."""

    def __init__(self, text_column: str | None, source, option: str = "--text_column",
                 exclude: tuple[str | None, ...] = ()) -> None:
        self.name, self.given = text_column, text_column is not None
        self.source, self.option, self.exclude = source, option, exclude
        self.strings: list[str] = []  # without a TEXT_COLUMNS name: the columns seen holding a string, in order

    def __call__(self, record: dict) -> str | None:
        if self.name is None and not self.strings:
            self.name = next((name for name in TEXT_COLUMNS if name in record and name not in self.exclude), None)
        if self.name is not None:
            if self.name not in record:
                raise UserError(f"text column {self.name!r} not in {self.source} (columns: {sorted(record)})")
            return self.value(record, self.name)
        candidates = [key for key in record if key not in self.exclude]
        self.strings += [key for key in candidates if isinstance(record[key], str) and key not in self.strings]
        if len(self.strings) > 1 or not self.strings and not any(record[key] is None for key in candidates):
            raise UserError(f"no text column in {self.source} (columns: {sorted(record)}); pass {self.option}")
        if not self.strings:  # only missing values so far: a blank row
            return None
        return self.value(record, self.strings[0]) if self.strings[0] in record else None

    def value(self, record: dict, column: str) -> str | None:
        value = record[column]
        if value is None:
            return None
        if isinstance(value, str):
            return text_value(value, self.source)
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise UserError(f"text column {column!r} of {self.source} holds a {type(value).__name__} ({shown}), not "
                        f"text; pass {self.option} to name the column holding the sentences")
