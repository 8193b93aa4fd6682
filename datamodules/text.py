"""Reading the user's text: plain files, csv/tsv/jsonl, `datasets` directories and `datasets` names, lazily.

    texts = iter_texts("core/corpus/austen.txt")                  # one sentence a line
    texts = iter_texts("reviews.csv", text_column="review")  # csv / tsv / jsonl with a text column (columns.py)
    texts = iter_texts("wikitext:wikitext-103-raw-v1:validation")  # a `datasets` name[:config][:split]
    sample = sample_texts(texts, limit=2000, seed=0)       # a seeded uniform sample, in corpus order

Every problem with the input raises `UserError` naming the file (and row), the one line the entry points print.
"""

from __future__ import annotations

import bz2
import csv
import gzip
import io
import json
import lzma
import os
import random
import re
from collections.abc import Iterator
from pathlib import Path

from core.defaults import DEFAULT_CORPUS  # noqa: F401  (the bundled corpus; used from here by the data modules)
from core.errors import UserError, first_line, warn_once
from core.sources import cannot_load, check_hub, looks_local, not_found
from datamodules.characters import NulFree, bad_byte, clean_text, replace_surrogates
from datamodules.columns import TextColumn

DATA_OPTION = "--data.text_column"  # the option's name in train.py and probe.py (LightningCLI data modules)
TABULAR_SUFFIXES = {".csv": ",", ".tsv": "\t"}
JSON_SUFFIXES = {".jsonl", ".json"}
SAVED_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")  # datasets' save_to_disk
MAX_FIELD = 16 * 2**20  # characters in one csv/tsv field: a long document, not csv's default 128 KiB
TABLE_SUFFIXES = {".parquet", ".arrow", ".csv", ".tsv", ".json", ".jsonl"}
# magic bytes -> opener (bzip2's: BZh, the level, then a block's or the stream end's magic: not a text's "BZh")
COMPRESSED = {rb"\x1f\x8b": gzip.open, rb"BZh[1-9](1AY&SY|\x17rE8P\x90)": bz2.open, rb"\xfd7zXZ\x00": lzma.open}
COMPRESSED_SUFFIXES = {".gz", ".gzip", ".bz2", ".xz"}
JSON_CHUNK = 2**20  # characters of a .json array read at a time
JSON_SPACE = re.compile(r"[ \t\r\n]*")
SENTENCE_END = re.compile(r"[.!?:;\"'”’)\]…。！？]$")  # a line closing a sentence (or a clause, a quotation)
# a sentence's end anywhere in a line (the text is prose): before a capitalised word, or at the line's end; not an
# abbreviation's point in a lowercased text (the Penn Treebank's "mr. <unk>", "nov. N": 1 line in 3 held one)
SENTENCE_INSIDE = re.compile(r"[.!?…][\"'”’)\]]*(?:\s+([^\W\d_])([^\W\d_])|$)|[。！？]")


def iter_texts(source: str | os.PathLike, text_column: str | None = None, option: str = "--text_column"
               ) -> Iterator[str]:
    """Yield the texts of `source` lazily: a txt/csv/tsv/jsonl file, a `datasets` directory, or a hub name.

    `source` that is not an existing path is read as `NAME[:CONFIG][:SPLIT]` with `datasets` (streaming);
    `glue/sst2` is tried as a repository first and then as name `glue`, config `sst2`. Texts are stripped (of a leading
    byte-order mark too); blank ones (nothing visible: `clean_text`) are skipped.
    `option` is the entry point's name for the text column, named when none is found (train.py and probe.py:
    `--data.text_column`).
    """
    column = TextColumn(text_column, source, option)
    for record in iter_records(source, columns=None):
        if text := column(record):
            yield text


def iter_records(source: str | os.PathLike, columns: tuple[str, ...] | None = None, split: str | None = None
                 ) -> Iterator[dict]:
    """Yield the rows of `source` as dicts (a plain text file gives {"text": line}); `split` picks a split of a
    datasets directory or name (default: the name's own `:SPLIT`, else "train", else the first)."""
    path = Path(source)
    if path.is_file():
        if split is not None:
            raise UserError(f"{source} is a single file: it has no split {split!r}")
        yield from _file_records(path)
    elif path.is_dir():
        check_datasets_directory(path)
        yield from _datasets_records(str(path), None, split, local=True)
    elif looks_local(source):
        raise not_found(source, "data")
    else:
        name, config, named = _parse_hub_name(str(source))
        if named is not None and split is not None and split != named:
            raise UserError(f"{source} names split {named!r}, not {split!r}")
        yield from _datasets_records(name, config, split or named, local=False)


def split_names(source: str | os.PathLike) -> list[str] | None:
    """The splits of a datasets directory or name (["train", "validation", "test"], ...), or None for a single table:
    a file, a saved single Dataset, or a NAME:CONFIG:SPLIT that names its split."""
    path = Path(source)
    if path.is_file():
        return None
    if path.is_dir():
        return _open_datasets(str(path), None, local=True)[1]
    if looks_local(source):
        raise not_found(source, "data")
    name, config, split = _parse_hub_name(str(source))
    return None if split is not None else _open_datasets(name, config, local=False)[1]


def read_split(source: str | os.PathLike) -> str | None:
    """The split `iter_records(source)` reads: the name's own `:SPLIT`, else "train", else the first; None for a file
    or a single table (read whole)."""
    path = Path(source)
    if path.is_file():
        return None
    if not path.is_dir() and not looks_local(source):
        named = _parse_hub_name(str(source))[2]
        if named is not None:
            return named
    names = split_names(source)
    return None if names is None else _choose_split(names, None, str(source))


def check_datasets_directory(path: Path) -> None:
    """A directory is data only when it is a `datasets` directory: save_to_disk's output, or a dataset repository
    (table files: parquet, arrow, csv, tsv, json, jsonl; or a dataset card declaring its configs). Any other folder
    (a project, a folder of notes) would be read by `datasets` as loose text, a readme line for a sentence."""
    if any((path / marker).is_file() for marker in SAVED_MARKERS):
        return
    card = path / "README.md"
    if card.is_file() and re.match(r"---\s*\n(?:.*\n)*?(?:configs|dataset_info):", card.read_text("utf-8", "replace")):
        return
    seen = 0
    for directory, folders, files in os.walk(path):
        folders[:] = [name for name in folders if not name.startswith(".")]
        if any(Path(name).suffix.lower() in TABLE_SUFFIXES for name in files):
            return
        seen += len(files) + len(folders)
        if seen > 10_000 or Path(directory).relative_to(path).parts[2:]:
            break
    raise UserError(f"data directory {path} is not a datasets directory (save_to_disk output, or parquet, arrow, "
                    "csv, tsv or jsonl data files); give a text, csv, tsv or jsonl file instead")


def _opener(path: Path):
    """(open function, the format's suffix) of a data file: gzip, bzip2 or xz (by their magic bytes: C4's .json.gz,
    OSCAR's .jsonl.gz, a .txt.xz) are read through their decompressor, the format named by the inner suffix (or by the
    only suffix when the name has no compression suffix: a gzip file named corpus.jsonl)."""
    with path.open("rb") as handle:
        magic = handle.read(10)
    suffixes = [suffix.lower() for suffix in path.suffixes]
    for magic_bytes, opener in COMPRESSED.items():
        if re.match(magic_bytes, magic):
            if suffixes and suffixes[-1] not in COMPRESSED_SUFFIXES:
                return opener, suffixes[-1]
            return opener, suffixes[-2] if len(suffixes) > 1 else ""
    return open, path.suffix.lower()


def _file_records(path: Path) -> Iterator[dict]:
    if path.stat().st_size == 0:
        raise UserError(f"data file is empty: {path}")
    if path.suffix.lower() == ".parquet":
        yield from _parquet_records(path)
        return
    opener, suffix = _opener(path)
    try:
        with opener(path, "rb") as handle:
            head = handle.read(8192)
    except (OSError, EOFError, lzma.LZMAError) as error:  # a torn or corrupt archive
        if opener is open:
            raise
        reason = first_line(error) or type(error).__name__
        raise UserError(f"data file cannot be decompressed ({reason}): {path}") from None
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):  # Windows PowerShell's `>` and Notepad's "Unicode"
        raise UserError(f"data file is UTF-16 text (its byte-order mark says so), expected UTF-8: {path}; save it as "
                        "UTF-8 (e.g. iconv -f UTF-16 -t UTF-8)")
    if b"\x00" in head:
        raise UserError(f"data file looks binary (NUL bytes), expected UTF-8 text: {path}")
    count, seen = 0, []  # seen: the first row whose lone surrogates were replaced (one warning, there)
    try:
        # utf-8-sig: a byte-order mark (Excel's "CSV UTF-8", Notepad) is not part of the first header or line
        with opener(path, "rt", encoding="utf-8-sig", newline="") as handle:
            reader = NulFree(handle)  # NULs past the head dropped, with one warning (reader.report)
            if suffix in TABULAR_SUFFIXES:
                # a .tsv is read without quote handling: quotes are text in GLUE / STS-B / WiC tsv files
                quoting = csv.QUOTE_NONE if suffix == ".tsv" else csv.QUOTE_MINIMAL
                delimiter = TABULAR_SUFFIXES[suffix] if suffix == ".tsv" else _csv_delimiter(head)
                csv.field_size_limit(MAX_FIELD)
                rows = csv.DictReader(reader, delimiter=delimiter, quoting=quoting)
                if not rows.fieldnames:
                    raise UserError(f"data file has no header row: {path}")
                first, repeats = rows.fieldnames[0] if len(rows.fieldnames) > 1 else None, 0  # one column: ambiguous
                for row in rows:
                    if first and row[first] and row[first].lstrip("\ufeff") == first and _repeats_header(row, rows):
                        if not repeats:  # the header of a second file joined with `cat`: no data row; one warning
                            warn_once(f"{path}, line {rows.line_num}: the header row again (files joined with cat?) "
                                      "is not a data row: skipped, here and in any later repeat")
                        repeats += 1
                        continue
                    count += 1
                    if None in row and suffix == ".csv":  # DictReader's restkey: more fields than the header
                        raise UserError(f"{path}: data row {count} has {len(rows.fieldnames) + len(row[None])} fields "
                                        f"but the header {len(rows.fieldnames)}: quote the fields that hold a "
                                        f"{delimiter!r}")
                    yield row
            elif suffix == ".json" and head.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"["):
                for row in _json_array(reader, path):  # pandas' to_json(orient="records"), json.dump of a list
                    count += 1
                    yield replace_surrogates(row, path, f"item {count}", seen)
            elif suffix in JSON_SUFFIXES:
                for number, line in enumerate(handle, 1):
                    if "\0" in line:
                        line = reader.drop(line)
                    if line := clean_text(line):  # a blank line, or one of invisible characters; a BOM of `cat`
                        try:
                            row = json.loads(line)
                        except json.JSONDecodeError as error:
                            raise UserError(f"{path}:{number}: not a JSON object per line ({error.msg})") from None
                        if not isinstance(row, dict):
                            raise UserError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
                        count += 1
                        yield replace_surrogates(row, path, f"line {number}", seen)
            else:
                breaks = LineBreaks()
                for line in handle:  # NUL-free lines of `reader`, without its generator
                    if "\0" in line:
                        line = reader.drop(line)
                    breaks.see(line := line.strip())
                    if line:  # TextColumn's clean_text finds it blank if nothing in it is visible
                        count += 1
                        yield {"text": line}
                breaks.check(path)
    except GeneratorExit:  # the reader stopped early (a --max_texts prefix): the NULs of the part read
        reader.report(opener, path, ended=False)
        raise
    except UnicodeDecodeError:  # its offset is in the chunk being decoded, not in the file: find the byte again
        raise UserError(f"data file is not UTF-8 text ({bad_byte(opener, path)}; Latin-1 or Windows-1252? convert it "
                        f"with iconv -f WINDOWS-1252 -t UTF-8): {path}") from None
    except csv.Error as error:  # a malformed row (an unclosed quote running to the end, ...)
        raise UserError(f"{path}: row {count + 1} is not {suffix[1:]} ({error})") from None
    except (EOFError, lzma.LZMAError, OSError) as error:  # an archive cut short or corrupt after its first block
        if opener is open:
            raise
        reason = first_line(error) or type(error).__name__
        raise UserError(f"data file cannot be decompressed after row {count} ({reason}): {path}") from None
    reader.report(opener, path)
    if count == 0:
        raise UserError(f"data file has no non-blank rows: {path}")


class LineBreaks:
    """Whether a text file is hard-wrapped (a licence, a Project Gutenberg book, a README at 70-80 columns): a text file
    is read as one sentence a line, so each wrapped line would be a fragment of a sentence (and a pretraining corpus
    would get a document end every line). A break falls inside a sentence when its line ends without closing
    punctuation and the next starts in lowercase: 0-4% of the breaks of a sentence-a-line file (the bundled corpus:
    1 of 30,855), 56-86% of wrapped prose, about 30% of source code and roff. Over half of at least 20 (ours): one
    warning, for prose only: text where fewer than 1 line in 20 holds a sentence's end anywhere (a synthetic language,
    an unpunctuated corpus a sentence a line) has no sentences to cut. A blank line is a paragraph's end."""

    def __init__(self) -> None:
        self.previous, self.breaks, self.inside, self.lines, self.ending = "", 0, 0, 0, 0

    def see(self, line: str) -> None:
        """The next line, stripped ("" for a blank one)."""
        self.lines += bool(line)
        self.ending += any(end[1] is None or end[1].isupper() and end[2].islower()
                           for end in SENTENCE_INSIDE.finditer(line))
        if line and self.previous:
            self.breaks += 1
            self.inside += line[0].islower() and not SENTENCE_END.search(self.previous)
        self.previous = line

    def check(self, path: Path) -> None:
        if self.breaks >= 20 and 2 * self.inside > self.breaks and 20 * self.ending >= self.lines:
            warn_once(f"{path}: {self.inside} of its {self.breaks} line breaks fall inside a sentence (the line ends "
                      "without closing punctuation, the next starts in lowercase): a text file is read as one sentence "
                      "a line, so this hard-wrapped text gives fragments; join each paragraph into one line, or give "
                      "a csv or jsonl with a text column")


def _repeats_header(row: dict, rows: csv.DictReader) -> bool:
    """`row` is the header again (its first cell may keep the second file's byte-order mark)."""
    return None not in row and [(value or "").lstrip("\ufeff") for value in row.values()] == rows.fieldnames


def _parquet_records(path: Path) -> Iterator[dict]:
    """The rows of one parquet file (a hub dataset's shard), streamed in record batches."""
    import pyarrow.parquet as parquet

    try:
        table = parquet.ParquetFile(path)
    except Exception as error:  # pyarrow raises ArrowInvalid, OSError ... on a torn or foreign file
        raise UserError(f"data file is not a readable parquet file ({first_line(error)}): {path}") from None
    if table.metadata.num_rows == 0:
        raise UserError(f"data file has no non-blank rows: {path}")
    for batch in table.iter_batches(batch_size=1024):
        yield from batch.to_pylist()


def _csv_delimiter(head: bytes) -> str:
    """The delimiter of a .csv: the one of , ; and tab that splits its header row into the most fields (Excel writes ;
    where the comma is the decimal mark), a comma on ties (a single column). The header is parsed as csv, so a quoted
    name holding a ';' or ',' ("review (good; bad)") is one field."""
    text = head.decode("utf-8", "replace").lstrip("\ufeff")
    fields = {}
    for delimiter in ",;\t":
        try:
            fields[delimiter] = len(next(csv.reader(io.StringIO(text), delimiter=delimiter), []))
        except csv.Error:  # a header cut by the head's end inside a quoted field: that delimiter is not ruled out
            fields[delimiter] = 0
    return max(fields, key=lambda delimiter: (fields[delimiter], delimiter == ","))


def _json_array(handle, path: Path) -> Iterator[dict]:
    """The objects of a .json file holding one JSON array, parsed one item at a time: a file of any size is read in
    the memory of a chunk and an item (json.load would hold the whole file and every row). The caller has seen '['."""
    decoder = json.JSONDecoder()
    text, at, line = "", 0, 1  # the text read and not yet parsed from `at`; the line of text[0]

    def more() -> bool:  # read on (at least as much again as is held: an item longer than a chunk costs O(its size))
        nonlocal text, at, line
        chunk = handle.read(max(JSON_CHUNK, len(text) - at))
        if not chunk:
            return False
        line += text.count("\n", 0, at)
        text, at = text[at:] + chunk, 0
        return True

    def next_char() -> str:  # the next character that is not JSON whitespace ("" at the end of the file)
        nonlocal at
        while (at := JSON_SPACE.match(text, at).end()) == len(text):
            if not more():
                return ""
        return text[at]

    def fail(message: str, position: int):
        raise UserError(f"{path}:{line + text.count(chr(10), 0, position)}: not a JSON array of objects ({message})")

    next_char()
    at += 1  # the '['
    closed = next_char() == "]"
    at += closed
    number = 0
    while not closed:
        number += 1
        next_char()
        while True:
            try:
                row, end = decoder.raw_decode(text, at)
                break
            except json.JSONDecodeError as error:  # an item cut by the chunk's end, or a malformed one
                if not more():
                    fail(error.msg, error.pos)
        if not isinstance(row, dict):
            raise UserError(f"{path}: item {number} of the JSON array is a {type(row).__name__}, expected an object")
        at = end
        yield row
        after = next_char()
        if after not in (",", "]"):
            fail("expected ',' or ']' after an item" if after else "the array is not closed", at)
        at += 1
        closed = after == "]"
    if next_char():
        fail("extra data after the array", at)


def _parse_hub_name(source: str) -> tuple[str, str | None, str | None]:
    parts = source.split(":")
    if len(parts) > 3 or not parts[0]:
        raise UserError(f"cannot read data source {source!r}: expected a file, a directory or NAME[:CONFIG][:SPLIT]")
    parts += [None] * (3 - len(parts))
    return parts[0], parts[1] or None, parts[2] or None


def _open_datasets(name: str, config: str | None, local: bool):
    """(the loaded dataset or dict of splits, its split names or None for a single Dataset): a directory saved with
    `save_to_disk` is read from disk; a hub name or a data-files directory is streamed (`glue/sst2` is tried as a
    repository, then as name `glue` with config `sst2`)."""
    import datasets

    saved = local and any((Path(name) / marker).exists() for marker in SAVED_MARKERS[:2])
    if saved:
        loaded = datasets.load_from_disk(name)
        return loaded, list(loaded) if isinstance(loaded, datasets.DatasetDict) else None
    if not local:
        check_hub(name, "dataset")
    attempts = [(name, config)]
    if config is None and "/" in name and not local:
        head, tail = name.rsplit("/", 1)
        attempts.append((head, tail))
    errors = []
    for dataset_name, dataset_config in attempts:
        try:
            loaded = datasets.load_dataset(dataset_name, dataset_config, streaming=True)
        except Exception as error:  # datasets raises many types: not found, offline, bad config
            errors.append(f"{type(error).__name__}: {first_line(error)}")
            continue
        return loaded, list(loaded)
    raise cannot_load("dataset", name, errors[-1])


def _datasets_records(name: str, config: str | None, split: str | None, local: bool) -> Iterator[dict]:
    loaded, splits = _open_datasets(name, config, local)
    if splits is None:
        if split is not None:
            raise UserError(f"dataset {name} has no split {split!r} (it is a single table)")
        yield from _nonempty(iter(loaded), name)
        return
    chosen = _choose_split(splits, split, name)
    yield from _nonempty(iter(loaded[chosen]), f"{name}:{chosen}")


def _choose_split(splits: list[str], wanted: str | None, name: str) -> str:
    if wanted is not None:
        if wanted not in splits:
            raise UserError(f"dataset {name} has no split {wanted!r} (splits: {splits})")
        return wanted
    return "train" if "train" in splits else splits[0]


def _nonempty(rows: Iterator[dict], name: str) -> Iterator[dict]:
    count = 0
    for row in rows:
        count += 1
        yield row
    if count == 0:
        raise UserError(f"dataset {name} is empty")


def sample_texts(texts: Iterator[str], limit: int | None, seed: int) -> list[str]:
    """A uniform random sample of `limit` texts (all when limit is None or 0), in their original order.

    Reservoir sampling (Algorithm R) with a seeded generator: one pass, memory of `limit` texts.
    """
    if not limit:
        return list(texts)
    rng = random.Random(seed)
    reservoir: list[tuple[int, str]] = []
    for index, text in enumerate(texts):
        if index < limit:
            reservoir.append((index, text))
        else:
            slot = rng.randint(0, index)
            if slot < limit:
                reservoir[slot] = (index, text)
    return [text for _, text in sorted(reservoir)]
