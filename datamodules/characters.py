"""The characters of the user's text that are no text: blank-looking texts, byte-order marks, NUL bytes, lone
surrogates, and where a byte that is not UTF-8 lies. datamodules/text.py reads every file through these.

    clean_text("\\ufeffHello \\n")          # "Hello": stripped, a leading byte-order mark dropped
    clean_text("\\u200b\\u2060")           # "": nothing visible (zero-width space, word joiner): a blank line
    text, offset = text_value_offsets(raw, source)   # NULs dropped too; offset(i): raw offset i in `text` (WiC spans)
    text = NulFree(handle)                  # its lines (or read chunks) without NULs; text.report(path) warns once
"""

from __future__ import annotations

import bisect
import codecs
import re
import unicodedata
from collections.abc import Callable, Iterator
from pathlib import Path

from core.errors import warn_once

SURROGATE = re.compile("[\ud800-\udfff]")  # a lone one: JSON's "\\ud83d" escape without its pair (an emoji cut in two)
INVISIBLE = ("Cf", "Cc")  # format characters (U+200B zero-width space, U+2060 word joiner, U+FEFF, U+200E) and controls


def clean_text(text: str) -> str:
    """`text` stripped of surrounding whitespace and of a leading byte-order mark (U+FEFF: a file concatenated after
    one that began with one, `cat a.txt b.txt`, where a byte-level BPE makes it tokens); "" when nothing in it is
    visible: only whitespace, format characters (category Cf: zero-width space, word joiner, BOM, left-to-right mark)
    and control characters, which `str.strip` keeps (a line of a zero-width space was a sentence of [CLS] [SEP]).

    Cheap on the common path (every line of a corpus goes through it): a text whose first character is printable (in
    any script) is visible and has no BOM, and costs a strip and one test; only the others are looked at character by
    character, up to the first visible one."""
    text = text.strip()
    if text and text[0].isprintable():  # not whitespace (stripped), not Cf, Cc (nor unassigned, private use)
        return text
    if text.startswith("\ufeff"):
        text = text.lstrip("\ufeff").strip()
    for char in text:
        if not char.isspace() and unicodedata.category(char) not in INVISIBLE:
            return text
    return ""


def text_value(value: str, source) -> str:
    """`clean_text` of a value a parser gave (a JSON string, a `datasets` or parquet cell), without its NUL characters:
    JSON's "\\u0000" escape, or a table's cell, holds one that no NUL byte of the file showed (`NulFree`), and the
    tokenizers disagree on it as on a byte. One warning per source; the common path is one `in` test."""
    if "\0" in value:
        warn_once(f"{source}: a text holds NUL characters, which are no text: dropped")
        value = value.replace("\0", "")
    return clean_text(value)


def text_value_offsets(value: str, source) -> tuple[str, Callable[[int], int]]:
    """`text_value(value, source)` and a map of character offsets of `value` into it, for offsets a source gives into
    its raw text (WiC's target spans): the dropped characters (NULs anywhere; the surrounding whitespace and a leading
    byte-order mark `clean_text` strips) before an offset shift it back by as many, so that it stays on the same
    character (an offset inside a stripped end moves to the nearest kept one)."""
    text = text_value(value, source)
    nuls = [index for index, char in enumerate(value) if char == "\0"] if "\0" in value else []
    start = len((value.replace("\0", "") if nuls else value).rstrip()) - len(text)  # clean_text strips the ends only

    def offset(index: int) -> int:
        return min(max(index - bisect.bisect_left(nuls, index) - start, 0), len(text))

    return text, offset


class NulFree:
    """A text handle's text with its NUL characters dropped and counted: its lines (`for line in`: csv's reader) or its
    chunks (`read`: a JSON array). A NUL in a file's first 8 KiB refuses it as binary (datamodules.text); further in,
    one is a damaged stretch of a text file that the tokenizers disagree on (BERT's drops it, a byte-level BPE makes
    it a token), so it is dropped here, whatever the format, before any parser sees it, with one warning (`report`).
    The common path is one `in` test a line (a loop over the handle's lines makes it itself and calls `drop`, saving a
    generator's step: plain text, JSON lines)."""

    def __init__(self, handle):
        self.handle, self.count = handle, 0

    def __iter__(self) -> Iterator[str]:
        for line in self.handle:
            yield self.drop(line) if "\0" in line else line

    def read(self, size: int) -> str:
        while True:
            chunk = self.handle.read(size)
            if "\0" not in chunk:
                return chunk
            if chunk := self.drop(chunk):  # NULs only: an empty chunk would say the file ended
                return chunk

    def drop(self, text: str) -> str:
        self.count += text.count("\0")
        return text.replace("\0", "")

    def report(self, opener, path: Path, ended: bool = True) -> None:
        """One warning, when NULs were dropped: the file, the first one's line (found again in the file: the common
        path counts no lines) and how many (in the part read when the reader stopped before the end)."""
        if self.count:
            warn_once(f"{path}, line {nul_line(opener, path)}: a NUL byte (a damaged stretch of the file?) is no text: "
                      f"dropped, {self.count} {'in all' if ended else 'in the part read'}")


def nul_line(opener, path: Path) -> int:
    """The line of the first NUL byte of the (decompressed) file (0 when it has none)."""
    line = 1
    with opener(path, "rb") as handle:
        while chunk := handle.read(2**20):
            if (at := chunk.find(b"\0")) >= 0:
                return line + chunk.count(b"\n", 0, at)
            line += chunk.count(b"\n")
    return 0


def replace_surrogates(row: dict, path: Path, where: str, seen: list) -> dict:
    """`row` with each lone surrogate of its strings replaced by U+FFFD, warning at the first row that has one: JSON
    lets "\\ud83d" stand alone (a tweet or web page cut inside an emoji), but it is no character, and a tokenizer (and
    Arrow, and UTF-8) refuses the whole text."""
    cut = [key for key, value in row.items() if isinstance(value, str) and SURROGATE.search(value)]
    if not cut:
        return row
    if not seen:
        seen.append(where)
        warn_once(f"{path}, {where}: a lone surrogate escape (half of a \\ud83d\\ude00 pair: an emoji cut in two?) "
                  f"in {cut[0]!r} is no character: replaced by U+FFFD, here and in any later row")
    return {**row, **{key: SURROGATE.sub("\ufffd", row[key]) for key in cut}}


def bad_byte(opener, path: Path) -> str:
    """Where the first byte that is not UTF-8 lies in the (decompressed) file: 'byte 0xe9 at offset 18519, line 241'."""
    decoder, offset, line, newline = codecs.getincrementaldecoder("utf-8")(), 0, 1, b"\n"
    with opener(path, "rb") as handle:
        while True:
            chunk = handle.read(2**20)
            pending = len(decoder.getstate()[0])  # the bytes of a character cut by the last chunk's end
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as error:  # error.start counts from the pending bytes
                at = error.start - pending
                line += chunk.count(newline, 0, max(at, 0))
                return f"byte {error.object[error.start]:#04x} at offset {offset + at}, line {line}"
            if not chunk:
                return f"offset {offset}"  # not reached: the text reader failed on the same bytes
            offset, line = offset + len(chunk), line + chunk.count(newline)
