"""The characters of a text that are no text (datamodules/characters.py): a line of invisible characters is blank, a
byte-order mark starting a line other than the file's first (files joined with `cat`) is dropped, NUL bytes past the
8 KiB the reader sniffs are dropped with one warning. Every expectation is computed here from the lines written.

    .venv/bin/pytest tests/test_text_characters.py -q
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import unicodedata

import datasets
import pytest

import datamodules.characters as characters
from core.errors import UserError
from datamodules.text import iter_texts

INVISIBLE = ["\u200b", "\u2060", "\ufeff", "\u200e", "\u200b \u2060\u3000\u200f", "\x07", "\u00ad\u180e", "\ufeff\u200b"]
VISIBLE = ["a\u200bb", "\u200bleading zero-width space", "\ufeffSecond file's first line.", "  \ufeff  spaced",
           "\u00e9t\u00e9", "\u4e2d\u6587", "plain ASCII, the common case", "\ufeff\ufeff\u200bx"]


def visible(text: str) -> bool:
    """Something in `text` is not whitespace, a format character or a control character (Unicode categories)."""
    return any(unicodedata.category(char) not in ("Cf", "Cc", "Zs", "Zl", "Zp") for char in text)


def expected_texts(lines: list[str]) -> list[str]:
    """The sentences of `lines`: stripped, then without their leading BOMs (stripped again); none for a blank one."""
    return [line.strip().lstrip("\ufeff").strip() for line in lines if visible(line)]


def write(path, lines: list[str], column: str = "text") -> None:
    suffix = path.suffix
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps({column: line}, ensure_ascii=False) + "\n" for line in lines), "utf-8")
    elif suffix in (".csv", ".tsv"):
        buffer = io.StringIO()
        writer = csv.writer(buffer, delimiter="," if suffix == ".csv" else "\t", lineterminator="\n",
                            quoting=csv.QUOTE_MINIMAL if suffix == ".csv" else csv.QUOTE_NONE, escapechar="\\")
        writer.writerows([[column, "label"], *([line, 1] for line in lines)])
        path.write_text(buffer.getvalue(), "utf-8")
    else:
        path.write_text("".join(f"{line}\n" for line in lines), "utf-8")


@pytest.mark.parametrize("suffix", [".txt", ".csv", ".tsv", ".jsonl", "datasets"])
def test_a_text_of_invisible_characters_is_blank_and_a_leading_bom_is_dropped(tmp_path, suffix):
    """A line of only a zero-width space, a word joiner, a BOM, a left-to-right mark, a control character ... passed
    `str.strip` and became a sentence of [CLS] [SEP] alone; a BOM starting a line (the second file of a `cat`) stayed
    in the text. In every format the reader takes: plain lines, csv / tsv / jsonl fields, a `datasets` table."""
    lines = [line for pair in zip(VISIBLE, INVISIBLE, strict=True) for line in pair]
    assert all(not visible(line) for line in INVISIBLE) and all(visible(line) for line in VISIBLE)  # the plant
    if suffix == "datasets":
        path = tmp_path / "saved"
        datasets.Dataset.from_dict({"sentence": lines}).save_to_disk(str(path))
    else:
        path = tmp_path / f"lines{suffix}"
        write(path, lines)
    assert list(iter_texts(path)) == expected_texts(lines)


def test_files_joined_with_cat_lose_every_bom_and_a_file_of_invisible_lines_has_no_texts(tmp_path):
    parts = [b"\xef\xbb\xbf" + "".join(f"{line}\n" for line in lines).encode("utf-8")
             for lines in (["one", "two"], ["three"], ["four"])]
    joined = tmp_path / "joined.txt"
    joined.write_bytes(b"".join(parts))  # cat a.txt b.txt c.txt, each saved by Notepad
    assert list(iter_texts(joined)) == ["one", "two", "three", "four"]
    jsonl = tmp_path / "joined.jsonl"
    jsonl.write_bytes(b"".join(b"\xef\xbb\xbf" + json.dumps({"text": t}).encode() + b"\n" for t in ("a", "b")))
    assert list(iter_texts(jsonl)) == ["a", "b"]  # json.loads refused the second line's BOM
    blank = tmp_path / "blank.txt"
    write(blank, INVISIBLE)
    assert list(iter_texts(blank)) == expected_texts(INVISIBLE) == []  # each reader says so: "no sentences in ..."


def test_the_common_path_is_a_strip_and_only_other_texts_are_read_character_by_character(tmp_path, monkeypatch):
    """Every line of a corpus passes the blank test: one whose first character (after the strip) is printable, in any
    script, is never looked at character by character; one starting otherwise is, up to its first visible one."""
    calls = []

    class Counting:
        @staticmethod
        def category(char):
            calls.append(char)
            return unicodedata.category(char)

    monkeypatch.setattr(characters, "unicodedata", Counting)
    ascii_lines = [f"  Line {i}: words, digits 0-9 and (punctuation)! " for i in range(200)] + ["~", "!"]
    path = tmp_path / "ascii.txt"
    write(path, ascii_lines)
    assert list(iter_texts(path)) == expected_texts(ascii_lines) and calls == []
    other = ["\u4e2d\u6587 text", "\u200b\u200bx"]
    write(path, other)
    assert list(iter_texts(path)) == expected_texts(other)
    assert calls == ["\u200b", "\u200b", "x"]  # up to the first visible character; a first printable one is enough


def nul_body(head_lines: int = 300) -> tuple[bytes, list[str]]:
    """A text whose first 8 KiB hold no NUL (else it is refused as binary), then lines with NULs: inside words, a
    line of NULs only, a run of NULs longer than a read (a chunk of nothing but NULs)."""
    lines = [f"An ordinary line number {i} of the text." for i in range(head_lines)]
    lines += ["bro\x00ken word", "\x00\x00", "two\x00 NULs\x00 here", "\x00" * 20000 + "after a long run", "end"]
    body = "".join(f"{line}\n" for line in lines).encode("utf-8")
    assert b"\x00" not in body[:8192]
    return body, lines


@pytest.mark.parametrize("layout", ["txt", "gzip", "csv", "jsonl"])
def test_nul_bytes_past_the_sniffed_head_are_dropped_with_one_warning(tmp_path, layout):
    """A NUL past the first 8 KiB passed through (BERT's tokenizer drops it, a byte-level BPE makes it a token); in
    a JSON line it refused the file. Now it is dropped in every format, with one warning naming the file, the first
    NUL's line and the count; the sentences are the lines with their NULs removed."""
    body, lines = nul_body()
    expected = expected_texts([line.replace("\x00", "") for line in lines])
    first_line = body[:body.index(b"\x00")].count(b"\n") + 1
    path = tmp_path / f"damaged.{layout}"
    if layout == "gzip":
        path = tmp_path / "damaged.txt.gz"
        path.write_bytes(gzip.compress(body))
    elif layout == "txt":
        path.write_bytes(body)
    else:  # the NULs raw in the file (json.dumps would write them as the escape \u0000)
        header, row = ("text,label\n", '"{}",1\n') if layout == "csv" else ("", '{{"text": "{}"}}\n')
        path.write_text(header + "".join(row.format(line) for line in lines), "utf-8")
        raw = path.read_bytes()
        first_line = raw[:raw.index(b"\x00")].count(b"\n") + 1  # the header or JSON around each line
    with pytest.warns(UserWarning, match="NUL") as caught:
        texts = list(iter_texts(path))
    assert texts == expected
    assert len([w for w in caught if "NUL" in str(w.message)]) == 1
    count = body.count(b"\x00")
    assert str(caught[0].message) == (f"{path}, line {first_line}: a NUL byte (a damaged stretch of the file?) is no "
                                      f"text: dropped, {count} in all")


def test_a_reader_stopped_early_warns_of_the_nuls_of_the_part_read(tmp_path):
    body, lines = nul_body()
    path = tmp_path / "damaged.txt"
    path.write_bytes(body)
    texts = iter_texts(path)
    read = [next(texts) for _ in range(302)]  # past the first NUL's line (line 301)
    assert read == [text for text in (line.replace("\x00", "") for line in lines) if text.strip()][:302]
    with pytest.warns(UserWarning, match="damaged.txt, line 301: a NUL byte .* in the part read$") as caught:
        texts.close()
    assert len(caught) == 1
    with pytest.raises(UserError, match="looks binary"):  # in the first 8 KiB a NUL still refuses the file
        path.write_bytes(b"text\x00" + body)
        list(iter_texts(path))


@pytest.mark.parametrize("layout", ["jsonl", "datasets", "parquet"])
def test_nul_characters_a_parser_gives_are_dropped_with_one_warning(tmp_path, layout):
    """No NUL byte is in the file, but the parsed text holds NUL characters: JSON's \\u0000 escape (json.dumps writes a
    NUL so), a `datasets` table's or a parquet file's cell. They are dropped as a NUL byte is, one warning a source."""
    lines = ["bro\x00ken word", "\x00\x00", "two\x00 NULs\x00 here", "plain line", "\x00 \u200b"]
    if layout == "jsonl":
        path = tmp_path / "escaped.jsonl"
        write(path, lines)
        assert b"\x00" not in path.read_bytes() and b"\\u0000" in path.read_bytes()  # the plant: escapes, no bytes
    elif layout == "datasets":
        path = tmp_path / "saved"
        datasets.Dataset.from_dict({"text": lines}).save_to_disk(str(path))
    else:
        path = tmp_path / "table.parquet"
        datasets.Dataset.from_dict({"text": lines}).to_parquet(str(path))
    with pytest.warns(UserWarning, match="NUL characters") as caught:
        texts = list(iter_texts(path))
    assert texts == expected_texts([line.replace("\x00", "") for line in lines]) == ["broken word", "two NULs here",
                                                                                     "plain line"]
    assert len([w for w in caught if "NUL" in str(w.message)]) == 1


@pytest.mark.parametrize("suffix", [".csv", ".tsv"])
def test_a_header_repeated_by_cat_is_not_a_data_row(tmp_path, suffix):
    """`cat a.csv b.csv`: b's header (after its byte-order mark) became a data row, "label" a class of its own. It is
    skipped, with one warning naming its line; the rows are those of both files, labels as written. A one-column
    file keeps a row equal to its header (it may be a sentence)."""
    from datamodules.text import iter_records

    first, second = tmp_path / f"a{suffix}", tmp_path / f"b{suffix}"
    write(first, ["one sentence.", "another one."])
    write(second, ["a third.", "and a fourth."])
    joined = tmp_path / f"joined{suffix}"
    joined.write_bytes(first.read_bytes() + b"\xef\xbb\xbf" + second.read_bytes() + second.read_bytes())
    with pytest.warns(UserWarning, match=rf"{joined.name}, line 4: the header row again") as caught:
        records = list(iter_records(str(joined)))
    assert [(r["text"], r["label"]) for r in records] == [
        (text, "1") for text in ["one sentence.", "another one.", "a third.", "and a fourth.", "a third.",
                                 "and a fourth."]]
    assert len([w for w in caught if "header row again" in str(w.message)]) == 1
    single = tmp_path / f"single{suffix}"
    single.write_text("text\nfirst\ntext\nlast\n", "utf-8")
    assert list(iter_texts(single)) == ["first", "text", "last"]
