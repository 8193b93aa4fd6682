"""The characters of the user's text that are no text: blank-looking texts, byte-order marks, NUL bytes, lone
surrogates, and where a byte that is not UTF-8 lies. datamodules/text.py reads every file through these.

    clean_text("\\ufeffHello \\n")          # "Hello": stripped, a leading byte-order mark dropped
    clean_text("\\u200b\\u2060")           # "": nothing visible (zero-width space, word joiner): a blank line
    handle, nuls = open_text(gzip.open, path)   # the file's text with NUL bytes dropped; nuls.report(path) warns once
"""

from __future__ import annotations

import codecs
import io
import re
import unicodedata
from pathlib import Path

from core.errors import warn_once

SURROGATE = re.compile("[\ud800-\udfff]")  # a lone one: JSON's "\\ud83d" escape without its pair (an emoji cut in two)
INVISIBLE = ("Cf", "Cc")  # format characters (U+200B zero-width space, U+2060 word joiner, U+FEFF, U+200E) and controls


def clean_text(text: str) -> str:
    """`text` stripped of surrounding whitespace and of a leading byte-order mark (U+FEFF: a file concatenated after
    one that began with one, `cat a.txt b.txt`, where a byte-level BPE makes it tokens); "" when nothing in it is
    visible: only whitespace, format characters (category Cf: zero-width space, word joiner, BOM, left-to-right mark)
    and control characters, which `str.strip` keeps (a line of a zero-width space was a sentence of [CLS] [SEP]).

    Cheap on the common path (every line of a corpus goes through it): a text whose first character is printable ASCII
    is visible and has no BOM, and costs one strip; only the others are looked at character by character, up to the
    first visible one."""
    text = text.strip()
    if text and "!" <= text[0] <= "~":
        return text
    if text.startswith("\ufeff"):
        text = text.lstrip("\ufeff").strip()
    for char in text:
        if not char.isspace() and unicodedata.category(char) not in INVISIBLE:
            return text
    return ""


class NulBytes(io.RawIOBase):
    """A binary stream with its NUL bytes dropped, counted, and the line of the first one noted. A NUL in a file's first
    8 KiB refuses it as binary (datamodules.text); further in, one is a damaged stretch of a text file: the tokenizers
    disagree on it (BERT's drops it, a byte-level BPE makes it a token), so it is dropped here, whatever the format,
    before any parser sees it, with one warning (`report`). NUL is never part of a UTF-8 sequence, so the text around
    it decodes as before."""

    def __init__(self, stream):
        super().__init__()
        self.stream, self.count, self.line, self.lines, self.ended = stream, 0, None, 0, False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while True:
            chunk = self.stream.read(len(buffer))
            if not chunk:
                self.ended = True
                return 0
            if b"\0" in chunk:
                if self.line is None:
                    self.line = self.lines + chunk.count(b"\n", 0, chunk.index(b"\0")) + 1
                self.count += chunk.count(b"\0")
                chunk = chunk.replace(b"\0", b"")
                if not chunk:  # NULs only: an empty read would say the file ended
                    continue
            elif self.line is None:
                self.lines += chunk.count(b"\n")
            buffer[:len(chunk)] = chunk
            return len(chunk)

    def close(self) -> None:
        super().close()
        self.stream.close()

    def report(self, path: Path) -> None:
        """One warning, when NULs were dropped: the file, the first one's line and how many (in the part read when the
        reader stopped before the end)."""
        if self.count:
            warn_once(f"{path}, line {self.line}: a NUL byte (a damaged stretch of the file?) is no text: dropped, "
                      f"{self.count} {'in all' if self.ended else 'in the part read'}")


def open_text(opener, path: Path) -> tuple[io.TextIOWrapper, NulBytes]:
    """The (decompressed) text of `path` as UTF-8 with its NUL bytes dropped, and their count. utf-8-sig: a byte-order
    mark (Excel's "CSV UTF-8", Notepad) is not part of the first header or line; newline="": csv reads the line ends."""
    nuls = NulBytes(opener(path, "rb"))
    return io.TextIOWrapper(io.BufferedReader(nuls), encoding="utf-8-sig", newline=""), nuls


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
