"""Data sources (txt, csv, tsv, jsonl, `datasets` directories and names) and staged, all-or-nothing outputs."""

from __future__ import annotations

import csv
import gzip
import io
import json
import re

import datasets
import pytest

from core.errors import UserError
from core.output import staged_output
from datamodules.text import iter_records, iter_texts, sample_texts

TEXTS = ["The first sentence.", "A second, longer sentence here.", "Third."]
TABULAR = {".csv": ",", ".tsv": "\t"}


def test_plain_text_skips_blank_lines(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text(f"{TEXTS[0]}\n\n  \n{TEXTS[1]}\r\n{TEXTS[2]}", encoding="utf-8")
    assert list(iter_texts(path)) == TEXTS


@pytest.mark.parametrize("suffix", [".txt", ".csv", ".tsv", ".jsonl"])
def test_a_byte_order_mark_is_not_text(tmp_path, suffix):
    """Excel's "CSV UTF-8" and Notepad write a UTF-8 BOM: it must not become part of the first header (then no text
    column is found) or of the first sentence (then a token the model never saw), nor break the first JSON line."""
    if suffix == ".jsonl":
        body = "".join(json.dumps({"text": t}) + "\r\n" for t in TEXTS)
    elif suffix == ".txt":
        body = "\r\n".join(TEXTS) + "\r\n"
    else:
        buffer = io.StringIO()
        csv.writer(buffer, delimiter=TABULAR[suffix], lineterminator="\r\n").writerows([["text", "label"],
                                                                                      *([t, 1] for t in TEXTS)])
        body = buffer.getvalue()
    path = tmp_path / f"bom{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + body.encode("utf-8"))
    assert list(iter_texts(path)) == TEXTS


@pytest.mark.parametrize("suffix,delimiter", [(".csv", ","), (".tsv", "\t")])
def test_tabular_detects_or_takes_the_text_column(tmp_path, suffix, delimiter):
    path = tmp_path / f"a{suffix}"
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, delimiter=delimiter)
        writer.writerow(["id", "sentence", "label"])
        writer.writerows([[i, text, i % 2] for i, text in enumerate(TEXTS)])
    assert list(iter_texts(path)) == TEXTS
    assert list(iter_texts(path, text_column="label")) == ["0", "1", "0"]
    with pytest.raises(UserError, match="text column 'body' not in"):
        list(iter_texts(path, text_column="body"))


@pytest.mark.parametrize("delimiter", [";", "\t", ","])
def test_a_csv_is_read_with_the_delimiter_of_its_header(tmp_path, delimiter):
    """Excel writes ; where the comma is the decimal mark: such a .csv was read as one column, each text carrying its
    label (';1') and cut at its first comma, silently. The header's delimiter is used."""
    path = tmp_path / "excel.csv"
    with path.open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle, delimiter=delimiter, lineterminator="\r\n").writerows(
            [["text", "label"], *([text, i % 2] for i, text in enumerate(TEXTS))])
    assert list(iter_texts(path)) == TEXTS and [r["label"] for r in iter_records(path)] == ["0", "1", "0"]


@pytest.mark.parametrize("header,delimiter,names", [
    ('"review (good; bad; ugly)",stars', ",", ["review (good; bad; ugly)", "stars"]),
    ('"a, b";"c, d";label', ";", ["a, b", "c, d", "label"]),
    ('"text\twith tab, ok";label', ";", ["text\twith tab, ok", "label"])])
def test_the_delimiter_is_read_from_the_header_as_csv_not_counted_in_quoted_names(tmp_path, header, delimiter, names):
    """A quoted header name holding ';' or ',' counted as delimiters: '"review (good; bad; ugly)",stars' was split on
    ';' into one column, each text carrying its ',5', silently. The delimiter is the one that parses the header (as
    csv) into the most fields: the names written by hand here."""
    rows = [["Fine, really; mostly.", *["x"] * (len(names) - 2), "5"], ["Bad; awful, yes", *["y"] * (len(names) - 2), "1"]]
    path = tmp_path / "quoted.csv"
    with path.open("w", newline="", encoding="utf-8") as handle:
        handle.write(header + "\n")
        csv.writer(handle, delimiter=delimiter).writerows(rows)
    assert [record for record in iter_records(path)] == [dict(zip(names, row, strict=True)) for row in rows]


def test_a_csv_row_with_more_fields_than_its_header_is_refused(tmp_path):
    """An unquoted comma in a text splits it: the rest went under DictReader's None key, silently lost."""
    path = tmp_path / "hand.csv"
    path.write_text("text,label\nFine.,1\nHello, world.,0\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"hand.csv: data row 2 has 3 fields but the header 2: quote the fields that "
                                        r"hold a ','"):
        list(iter_texts(path))


def test_tsv_quotes_are_text_as_in_glue_files(tmp_path):
    raw = ['"Quoted," he said.', 'an "inner" quote', "a lone \" mark"]
    path = tmp_path / "glue.tsv"
    path.write_text("sentence\tlabel\n" + "".join(f"{text}\t1\n" for text in raw), encoding="utf-8")
    assert list(iter_texts(path)) == raw  # byte for byte, not csv-unquoted or merged across lines


def test_jsonl_and_missing_text_column(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(json.dumps({"text": t, "n": i}) for i, t in enumerate(TEXTS)), encoding="utf-8")
    assert list(iter_texts(path)) == TEXTS
    ambiguous = tmp_path / "b.jsonl"
    ambiguous.write_text(json.dumps({"question": "q?", "answer": "a."}) + "\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"no text column .*\['answer', 'question'\].*--text_column"):
        list(iter_texts(ambiguous))


@pytest.mark.parametrize("value", [123, 4.5, ["a", "tokenised", "sentence"], {"nested": "text"}, True])
def test_a_text_that_is_not_a_string_is_refused_in_one_line(tmp_path, value):
    """A jsonl / datasets text column holding numbers or token lists is refused, naming the column and the type (it
    raised AttributeError: 'int' object has no attribute 'strip' in analyze.py); a null is a blank row."""
    path = tmp_path / "odd.jsonl"
    rows = [{"text": TEXTS[0]}, {"text": None}, {"text": value}, {"text": TEXTS[1]}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    with pytest.raises(UserError, match=f"text column 'text' of .*odd.jsonl holds a {type(value).__name__} "
                                        r"\(.*\), not text; pass --text_column"):
        list(iter_texts(path))
    path.write_text("".join(json.dumps(row) + "\n" for row in rows[:2] + rows[3:]), encoding="utf-8")
    assert list(iter_texts(path)) == TEXTS[:2]


@pytest.mark.parametrize("indent", [None, 2])
def test_a_json_array_file_reads_as_its_objects(tmp_path, indent):
    """A .json holding one array of objects (pandas' to_json(orient="records") on one line, json.dump(indent=2) over
    many) reads as the same rows as JSON lines; an array item that is not an object is refused in one line."""
    path = tmp_path / "a.json"
    path.write_text(json.dumps([{"text": t, "n": i} for i, t in enumerate(TEXTS)], indent=indent), encoding="utf-8")
    assert list(iter_texts(path)) == TEXTS and [r["n"] for r in iter_records(path)] == [0, 1, 2]
    path.write_text(json.dumps([{"text": TEXTS[0]}, TEXTS[1]], indent=indent), encoding="utf-8")
    with pytest.raises(UserError, match=r"a.json: item 2 of the JSON array is a str, expected an object"):
        list(iter_texts(path))
    path.write_text('[{"text": "unclosed"}', encoding="utf-8")
    with pytest.raises(UserError, match=r"a.json:1: not a JSON array of objects"):
        list(iter_texts(path))


@pytest.mark.parametrize("compress", ["gzip", "bz2", "lzma"])
@pytest.mark.parametrize("suffix", [".txt", ".jsonl", ".csv"])
def test_compressed_files_read_as_the_file_inside(tmp_path, compress, suffix):
    """C4's .json.gz, OSCAR's .jsonl.gz, a .txt.xz: read through their decompressor as the inner suffix's format (they
    were refused as 'binary (NUL bytes)'); an archive cut short is one line."""
    import bz2
    import gzip
    import lzma

    module = {"gzip": gzip, "bz2": bz2, "lzma": lzma}[compress]
    body = {".txt": "\r\n".join(TEXTS) + "\r\n", ".jsonl": "".join(json.dumps({"text": t}) + "\n" for t in TEXTS),
            ".csv": "id,text\n" + "".join(f'{i},"{t}"\n' for i, t in enumerate(TEXTS))}[suffix]
    path = tmp_path / f"corpus{suffix}.{ {'gzip': 'gz', 'bz2': 'bz2', 'lzma': 'xz'}[compress]}"
    packed = module.compress(("\ufeff" + body).encode("utf-8"))
    path.write_bytes(packed)
    assert list(iter_texts(path)) == TEXTS
    path.write_bytes(packed[:len(packed) // 2])
    with pytest.raises(UserError, match=f"data file cannot be decompressed.*{path.name}"):
        list(iter_texts(path))


def test_a_compressed_file_without_a_compression_suffix_reads_as_its_own_suffix(tmp_path):
    """A gzip file named corpus.jsonl (no .gz) was read as plain text, each JSON line a sentence, silently: its format
    is its own suffix. A plain text that begins with 'BZh' (bzip2's first bytes) is text, not a torn archive."""
    import gzip

    path = tmp_path / "corpus.jsonl"
    path.write_bytes(gzip.compress("".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(TEXTS)).encode()))
    assert list(iter_texts(path)) == TEXTS
    plain = tmp_path / "names.txt"
    plain.write_text("BZh9 is a line.\nAnother.\n", encoding="utf-8")
    assert list(iter_texts(plain)) == ["BZh9 is a line.", "Another."]


def test_a_json_array_is_parsed_item_by_item(tmp_path, monkeypatch):
    """A .json array was read whole (json.load: the file and every row in memory); it is parsed one item at a time.
    With 5-character chunks every item is cut somewhere, and the rows are json.load's (strings holding ] , { and
    newlines); rows before a malformed item are given before its one-line error (json.load gave none), which names
    the item's line."""
    import datamodules.text as text

    monkeypatch.setattr(text, "JSON_CHUNK", 5, raising=False)
    rows = [{"text": 'a "quoted" ], {bracket}', "n": [1, {"x": None}]}, {"text": "line\nbreak, é ☃"}, {}]
    path = tmp_path / "big.json"
    for indent in (None, 2):
        path.write_text(json.dumps(rows, indent=indent, ensure_ascii=False) + "\n", encoding="utf-8")
        assert list(iter_records(path)) == json.loads(path.read_text(encoding="utf-8"))
    path.write_text('[\n {"text": "one"},\n {"text": "two"},\n {"text": "three"\n]', encoding="utf-8")
    records = iter_records(path)
    assert next(records) == {"text": "one"} and next(records) == {"text": "two"}
    with pytest.raises(UserError, match=r"big.json:5: not a JSON array of objects \(Expecting ',' delimiter\)"):
        next(records)
    for bad, message in [('[{"text": "a"} {"text": "b"}]', "expected ',' or ']' after an item"),
                         ('[{"text": "a"}, ', "Expecting value"), ('[{"text": "a"}] x', "extra data after the array"),
                         ('[{"text": "a"}', "the array is not closed")]:
        path.write_text(bad, encoding="utf-8")
        with pytest.raises(UserError, match=f"big.json:1: not a JSON array of objects \\({message}"):
            list(iter_records(path))


def test_a_single_parquet_file_reads_as_its_rows(tmp_path):
    """One parquet shard of a hub dataset, given as a file (a directory of them already read): its rows, nulls blank;
    it was refused as binary text. A torn one is one line."""
    import pyarrow as pa
    import pyarrow.parquet as parquet

    path = tmp_path / "train-00000-of-00001.parquet"
    parquet.write_table(pa.table({"sentence": [TEXTS[0], None, *TEXTS[1:]], "label": [1, 0, 1, 0]}), path)
    assert list(iter_texts(path)) == TEXTS and [r["label"] for r in iter_records(path)] == [1, 0, 1, 0]
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(UserError, match="data file is not a readable parquet file"):
        list(iter_texts(path))


def test_datasets_directory_and_saved_dataset(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "train.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in TEXTS), encoding="utf-8")
    (folder / "test.jsonl").write_text(json.dumps({"text": "held out"}), encoding="utf-8")
    assert list(iter_texts(folder)) == TEXTS  # load_dataset on a local folder, the `datasets` code path
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"sentence": TEXTS}).save_to_disk(str(saved))
    assert list(iter_texts(saved)) == TEXTS


@pytest.mark.parametrize("content,message", [
    (b"", "data file is empty"),
    (b"\n\n  \n", "no non-blank rows"),
    (b"abc\x00\x01\x02", "looks binary"),
    (b"caf\xe9 au lait\n", "not UTF-8 text"),
    ("\ufeffone\r\ntwo\r\n".encode("utf-16-le"), "data file is UTF-16 text .*expected UTF-8"),  # PowerShell's `>`
    ("\ufeffone\ntwo\n".encode("utf-16-be"), "data file is UTF-16 text"),
    (b"{not json}\n", "not a JSON object per line"),
])
def test_bad_files(tmp_path, content, message):
    path = tmp_path / ("bad.jsonl" if b"{" in content else "bad.txt")
    path.write_bytes(content)
    with pytest.raises(UserError, match=message):
        list(iter_texts(path))


def test_missing_paths_and_offline_hub_names(tmp_path):
    with pytest.raises(UserError, match="data path not found"):
        list(iter_texts(tmp_path / "missing.txt"))
    with pytest.raises(UserError, match=r"cannot load dataset 'no-such-org/no-such-data' \(offline"):
        list(iter_records("no-such-org/no-such-data:default:train"))
    with pytest.raises(UserError, match="expected a file, a directory or NAME"):
        list(iter_records("a:b:c:d"))


def test_sample_is_uniform_seeded_and_ordered():
    population = [f"s{i}" for i in range(1000)]
    first = sample_texts(iter(population), 50, seed=3)
    assert first == sample_texts(iter(population), 50, seed=3) != sample_texts(iter(population), 50, seed=4)
    assert first == sorted(first, key=population.index) and len(set(first)) == 50
    assert sample_texts(iter(population), 0, seed=3) == population
    # Uniformity: over many seeds every position is drawn about 50/1000 of the time.
    hits = [0] * 10
    for seed in range(400):
        for text in sample_texts(iter(population), 50, seed=seed):
            hits[int(text[1:]) // 100] += 1
    assert all(abs(h / (400 * 50) - 0.1) < 0.01 for h in hits)  # sd about 0.002 a bucket
    # Exactly uniform, by hand: each of 5 texts is in a sample of 2 with probability 2/5 (a reservoir that draws its
    # slot from 0..index-1 instead of 0..index keeps the first text with probability 0 when the limit is 1)
    for limit in (1, 2):
        counts = [0] * 5
        for seed in range(3000):
            for text in sample_texts(iter(population[:5]), limit, seed=seed):
                counts[int(text[1:])] += 1
        assert all(abs(count / 3000 - limit / 5) < 0.04 for count in counts), (limit, counts)  # sd at most 0.009


def test_staged_output_is_all_or_nothing(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError), staged_output(target) as stage:
        (stage / "report.json").write_text("{}")
        raise RuntimeError("failed half-way")
    assert not target.exists()  # created by the call, so removed again
    with staged_output(target) as stage:
        (stage / "report.json").write_text("{}")
        (stage / "figure.png").write_bytes(b"png")
    assert sorted(p.name for p in target.iterdir()) == ["figure.png", "report.json"]
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError, match="cannot write to output directory"), staged_output(blocker / "sub"):
        pass


KILLED_WRITER = """
import sys, time
from core.output import staged_output
with staged_output(sys.argv[1]) as stage:
    (stage / "features.bin").write_bytes(bytes(4096))  # a feature cache being built
    print(stage, flush=True)
    time.sleep(120)
"""


def test_a_later_run_removes_the_staging_directory_of_a_killed_run_and_no_live_one(tmp_path, capsys):
    """A run killed while it stages (kill -9: no cleanup runs) leaves .staging-<host>-<pid>-*; the next staged_output
    into that directory removes it, with one warning line naming it, and leaves a live run's (this process's), another
    host's and an unnamed one (an earlier version's: whose it is cannot be told) as they are."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from core.output import host_tag

    target = tmp_path / "out"
    root = Path(__file__).resolve().parent.parent
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(target)], cwd=root, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(root)})
    dead = Path(writer.stdout.readline().strip())
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=30)
    writer.stdout.close()
    assert dead.name.startswith(f".staging-{host_tag()}-{writer.pid}-") and (dead / "features.bin").is_file()
    live = target / f".staging-{host_tag()}-{os.getpid()}-abc123"  # a concurrent run's: this live process's pid
    other_host = target / f".staging-{host_tag()}x-{writer.pid}-def456"  # its pid means nothing here
    unnamed = target / ".staging-k2j4_x9q"
    for directory in (live, other_host, unnamed):
        directory.mkdir()
        (directory / "part.bin").write_bytes(b"x")
    with staged_output(target, owner="outliers") as stage:
        (stage / "report.json").write_text("{}")
    assert not dead.exists()
    assert all((directory / "part.bin").read_bytes() == b"x" for directory in (live, other_host, unnamed))
    assert sorted(path.name for path in target.iterdir()) == sorted(
        [".written_by", "report.json", live.name, other_host.name, unnamed.name])  # this run's own stage gone too
    assert capsys.readouterr().err.splitlines() == [
        f"warning: removed {dead} (4.0 KiB), the staging directory of a run that ended without finishing (pid "
        f"{writer.pid} on {host_tag()}, no longer running)"]
    with staged_output(target) as stage:  # nothing stale left: no warning
        pass
    assert capsys.readouterr().err == ""


def test_a_second_run_of_an_owner_removes_what_its_first_wrote_and_not_others_files(tmp_path):
    """The files one owner (an analyze.py subcommand) wrote last time and does not write again go; a file another owner
    wrote since, a user's own file and a recorded path outside the directory stay."""
    from core.output import OWNERS

    target = tmp_path / "out"

    def write(owner, *names):
        with staged_output(target, owner=owner) as stage:
            for name in names:
                (stage / name).parent.mkdir(parents=True, exist_ok=True)
                (stage / name).write_text(owner)

    write("outliers", "outliers.json", "mean_vectors.png", "position_embeddings.png", "sub/deep.json")
    write("all", "outliers.json", "sts_a.json", "sts_b.json")  # outliers.json is all's from now on
    (target / "mine.txt").write_text("the user's")
    write("outliers", "mean_vectors.png")
    files = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.name != OWNERS)
    assert files == ["mean_vectors.png", "mine.txt", "outliers.json", "sts_a.json", "sts_b.json"]  # sub/ gone too
    assert (target / "outliers.json").read_text() == "all"
    write("all", "outliers.json", "sts_a.json")
    assert not (target / "sts_b.json").exists() and (target / "mean_vectors.png").read_text() == "outliers"
    outside = tmp_path / "outside.txt"
    outside.write_text("x")
    (target / OWNERS).write_text(json.dumps({"../outside.txt": "all", str(outside): "all", "sts_a.json": "all"}))
    write("all", "outliers.json")
    assert outside.read_text() == "x" and not (target / "sts_a.json").exists()
    (target / OWNERS).write_text("not json")  # an unreadable record removes nothing and is written anew
    write("all", "summary.json")
    assert (target / "outliers.json").exists() and json.loads((target / OWNERS).read_text())["summary.json"] == "all"


RECORD_WRITER = """
import sys, time
from pathlib import Path
from core.output import staged_output
target, name, count = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
while not (target / "go").exists():  # both writers start together
    time.sleep(0.001)
for index in range(count):
    with staged_output(target, owner=f"{name}-{index}") as stage:
        (stage / f"{name}-{index}.json").write_text(name)
"""


def test_two_runs_writing_into_one_directory_at_once_lose_none_of_each_others_records(tmp_path):
    """Two processes, each running 60 staged_output calls of its own owners into one directory at the same time: the
    .written_by record names all 120 files with their owners (read, changed and written under a lock; before, a run
    that read the record while the other wrote it dropped the other's entries, and that run's files were never
    cleaned), and the lock file is not left behind."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from core.output import OWNERS

    target, count = tmp_path / "out", 60
    target.mkdir()
    root = Path(__file__).resolve().parent.parent
    writers = [subprocess.Popen([sys.executable, "-c", RECORD_WRITER, str(target), name, str(count)], cwd=root,
                                env={**os.environ, "PYTHONPATH": str(root)}) for name in ("a", "b")]
    (target / "go").write_text("")
    assert [writer.wait(timeout=120) for writer in writers] == [0, 0]
    expected = {f"{name}-{index}.json": f"{name}-{index}" for name in ("a", "b") for index in range(count)}
    assert json.loads((target / OWNERS).read_text()) == expected
    assert sorted(path.name for path in target.iterdir()) == sorted([*expected, OWNERS, "go"])


@pytest.mark.parametrize("module", ["classify", "finetune"])
def test_the_label_column_is_not_taken_for_the_text_column(tmp_path, module):
    """A csv's labels are strings too: with --data.label_column stars, a csv of body and stars has one text column
    left, body, which the labelled readers (probe.py's classifiers, fine-tuning) detect; the labels stay labels."""
    from datamodules.finetune import FineTuneDataModule
    from datamodules.probing import ClassificationDataModule

    path = tmp_path / "reviews.csv"
    stars = ["good", "bad", "good"]
    with path.open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([("body", "stars"), *zip(TEXTS, stars)])
    if module == "classify":
        texts, labels = ClassificationDataModule(source=str(path), label_column="stars").read_split(str(path), None)
    else:
        pairs, labels = FineTuneDataModule(source=str(path), label_column="stars").read(str(path), None)
        texts = [text for text, _ in pairs]
    assert (texts, labels) == (TEXTS, stars)
    with pytest.raises(UserError, match=r"no text column .*\['body', 'stars'\].*--text_column"):
        list(iter_texts(path))  # without a label column named, the two string columns stay ambiguous


@pytest.mark.parametrize("world_size, torn_down", [("2", False), ("1", True)])
def test_a_torchrun_worker_of_analyze_py_ends_without_the_interpreters_teardown(world_size, torn_down, tmp_path):
    """Under torchrun (WORLD_SIZE > 1) exit_with(..., quick_under_torchrun=True) ends the process with os._exit once
    its output is flushed (gloo's threads can abort a worker in the interpreter's teardown): an atexit handler, run
    by the teardown, leaves its file only in a single process; the exit status and the printed output are kept."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    marker = tmp_path / "teardown-ran"
    script = ("import atexit, sys\n"
              "from core.errors import exit_with\n"
              f"atexit.register(lambda: open({str(marker)!r}, 'w').close())\n"
              "def main():\n"
              "    print('the report', end='')\n"
              "    return 3\n"
              "exit_with(main, quick_under_torchrun=True)\n")
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "WORLD_SIZE": world_size, "PYTHONPATH": str(root)}
    finished = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                              timeout=60)
    assert finished.returncode == 3 and finished.stdout == "the report"
    assert marker.exists() is torn_down


@pytest.mark.parametrize("layout", ["past the first read", "a lead byte at the 1 MiB chunk's end", "gzip"])
def test_a_byte_that_is_not_utf8_is_named_where_it_lies_in_the_file(tmp_path, layout):
    """The text reader decodes 8 KiB at a time: its error's offset counted from that chunk (a Latin-1 'é' at byte
    18,519 was reported 'at offset 2135'). The offset and line are those of the file, found here by hand."""
    line = b"An ordinary sentence of plain ASCII text.\n"
    if layout == "a lead byte at the 1 MiB chunk's end":  # \xe9 is a 3-byte lead: held over to the next chunk
        body = b"a" * (2**20 - 1) + b"\xe9 next\n"
    else:
        body = line * 500 + "Café ".encode("latin-1") + b"au lait\n"
    path = tmp_path / "corpus.txt"
    if layout == "gzip":
        path = tmp_path / "corpus.txt.gz"
        path.write_bytes(gzip.compress(body))
    else:
        path.write_bytes(body)
    offset = body.index(b"\xe9")
    lines = body[:offset].split(b"\n")
    expected = f"byte 0xe9 at offset {offset}, line {len(lines)}"
    with pytest.raises(UserError, match=re.escape(expected)):
        list(iter_texts(path))


def test_a_lone_surrogate_escape_in_json_is_replaced_with_one_warning(tmp_path):
    """JSON may hold "\\ud83d" without its pair (text cut inside an emoji); it is no character, and the tokenizer
    refused the whole batch with a TypeError. Now it is U+FFFD, with one warning; a whole pair stays the emoji."""
    rows = ['{"text": "a whole pair \\ud83d\\ude00 stays"}', '{"text": "cut \\ud83d here", "n": 1}',
            '{"text": "and \\udc00 here"}']
    expected = ["a whole pair \U0001f600 stays", "cut \ufffd here", "and \ufffd here"]
    jsonl, array = tmp_path / "web.jsonl", tmp_path / "web.json"
    jsonl.write_text("\n".join(rows) + "\n", encoding="utf-8")
    array.write_text("[" + ",\n".join(rows) + "]", encoding="utf-8")
    for path, where in ((jsonl, "line 2"), (array, "item 2")):
        with pytest.warns(UserWarning, match=f"{where}: a lone surrogate") as caught:
            texts = list(iter_texts(path))
        assert texts == expected and len(caught) == 1
        assert "".join(texts).encode("utf-8").decode("utf-8") == "".join(expected)  # valid UTF-8 throughout


def test_a_detected_text_column_holds_for_every_row_and_a_null_is_a_blank_row(tmp_path):
    """A table whose text column has no known name ("body") is read by its one string column; a null in it is a blank
    row, wherever it is. Detection was per row: a null after 60 rows (or in the first) left no string column in that
    row, and the whole source was refused as having none; and a row whose only string was another column was read from
    that one. Now a second column holding strings, in any row, is refused."""
    import pyarrow as pa
    import pyarrow.parquet as parquet

    rows = [{"body": None, "id": 0}, *({"body": t, "id": i} for i, t in enumerate(TEXTS, 1)), {"body": None, "id": 9}]
    jsonl, table = tmp_path / "a.jsonl", tmp_path / "a.parquet"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    parquet.write_table(pa.table({"body": [r["body"] for r in rows], "id": [r["id"] for r in rows]}), table)
    assert list(iter_texts(jsonl)) == list(iter_texts(table)) == TEXTS
    mixed = tmp_path / "mixed.jsonl"  # the text in "title" in one row, in "body" in the next: which is it?
    mixed.write_text(json.dumps({"title": TEXTS[0], "body": None}) + "\n"
                     + json.dumps({"title": None, "body": TEXTS[1]}) + "\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"no text column in .*mixed.jsonl \(columns: \['body', 'title'\]\); "
                                        "pass --text_column"):
        list(iter_texts(mixed))
    assert list(iter_texts(mixed, text_column="body")) == [TEXTS[1]]
    later = tmp_path / "later.jsonl"  # the detected column holding a number further down: refused, not skipped
    later.write_text(json.dumps({"body": TEXTS[0], "id": 1}) + "\n" + json.dumps({"body": 7, "id": 2}) + "\n",
                     encoding="utf-8")
    with pytest.raises(UserError, match="text column 'body' of .*later.jsonl holds a int"):
        list(iter_texts(later))


def test_a_hard_wrapped_text_file_is_said_to_give_fragments_once(tmp_path):
    """A text file is one sentence a line; a licence or a book wrapped at 60 columns gave every wrapped line as a
    sentence, silently. Planted: 30 sentences wrapped at 60 columns, whose line breaks all fall inside a sentence (the
    next line in lowercase) but the 29 between two sentences, counted by hand; one warning, whatever the reads. The
    same sentences one a line, or wrapped paragraphs between blank lines: no warning."""
    import textwrap
    import warnings

    sentences = [f"the {n}th sentence of this paragraph runs on and on past the sixty columns of a wrapped line, "
                 f"number {n}." for n in range(30)]
    wrapped = [piece for sentence in sentences for piece in textwrap.wrap(sentence, 60)]
    breaks = len(wrapped) - 1
    inside = sum(1 for a, b in zip(wrapped, wrapped[1:]) if not a.endswith(".") and b[0].islower())
    assert inside == breaks - 29 and 2 * inside > breaks  # every break but those between two sentences
    path = tmp_path / "wrapped.txt"
    path.write_text("\n".join(wrapped) + "\n", encoding="utf-8")
    with pytest.warns(UserWarning, match=rf"wrapped.txt: {inside} of its {breaks} line breaks fall inside a sentence "
                                         r"\(the line ends without closing punctuation") as said:
        assert list(iter_texts(path)) == wrapped
        assert list(iter_texts(path)) == wrapped  # read again (a tokenizer, then the blocks): said once
    assert len(said) == 1
    lines = tmp_path / "lines.txt"
    lines.write_text("\n".join(sentences) + "\n\n" + "\n\n".join(wrapped[:40]) + "\n", encoding="utf-8")
    with warnings.catch_warnings():  # a sentence a line, and wrapped lines between blank lines (paragraphs): quiet
        warnings.simplefilter("error")
        assert list(iter_texts(lines)) == sentences + wrapped[:40]
    symbols = [" ".join("a" + chr(97 + (7 * n + k) % 26) for k in range(30)) for n in range(40)]
    synthetic = tmp_path / "symbols.txt"  # a toy language a sequence a line (scripts/bigram_backcopy.py): no prose
    synthetic.write_text("\n".join(symbols) + "\n", encoding="utf-8")
    assert all(line[0].islower() and not line.endswith(".") for line in symbols)  # every break looks 'inside'
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(iter_texts(synthetic)) == symbols


PENN_TREEBANK = [  # the Penn Treebank's language-modelling text (ptb.train.txt's style): lowercased, a sentence a
    'aer banknote berlitz calloway centrust cluett fromstein gitano guterman hydro-quebec ipo kia memotec mlx nahb punts rake regatta rubens sim snack-food ssangyong swapo wachter',
    'pierre <unk> N years old will join the board as a nonexecutive director nov. N',
    'mr. <unk> is chairman of <unk> n.v. the dutch publishing group',
    'rudolph <unk> N years old and former chairman of consolidated gold fields plc was named a nonexecutive director of this british industrial conglomerate',
    'a form of asbestos once used to make kent cigarette filters has caused a high percentage of cancer deaths among a group of workers exposed to it more than N years ago researchers reported',
    'the asbestos fiber <unk> is unusually <unk> once it enters the <unk> with even brief exposures to it causing symptoms that show up decades later researchers said',
    '<unk> inc. the unit of new york-based <unk> corp. that makes kent cigarettes stopped using <unk> in its <unk> cigarette filters in N',
    "although preliminary findings were reported more than a year ago the latest results appear in today 's new england journal of medicine a forum likely to bring new attention to the problem",
    'a <unk> <unk> said this is an old story',
    "we 're talking about years ago before anyone heard of asbestos having any questionable properties",
    'there is no asbestos in our products now',
    'neither <unk> nor the researchers who studied the workers were aware of any research on smokers of the kent cigarettes',
    "we have no useful information on whether users are at risk said james a. <unk> of boston 's <unk> cancer institute",
    'dr. <unk> led a team of researchers from the national cancer institute and the medical schools of harvard university and boston university',
    'the <unk> spokeswoman said asbestos was a <unk> material and used in making paper-thin filters',
    "mr. <unk> said the company 's results for the quarter ended sept. N were in line with expectations",
    'the u.s. trade deficit widened in august as imports rose to a record',
    'shares of the company closed at $ N a share down N cents in new york stock exchange composite trading',
    'the company said it expects to report net income of $ N million or N cents a share for the year',
    'analysts said the move by the fed was widely expected',
    'the dow jones industrial average fell N points to N',
    'prices of treasury bonds rose in quiet trading',
    'the plan would allow the company to buy back as many as N million shares',
]  # line, its final points dropped, numbers as N, abbreviations keeping their points


def test_a_lowercased_sentence_a_line_corpus_with_abbreviations_is_not_said_to_be_hard_wrapped(tmp_path):
    """The Penn Treebank (lowercased, a sentence a line, no final point) has every break 'inside' a sentence by the
    line test, and an abbreviation's point ("mr. <unk>", "nov. N", "corp. that") in 7 of these 23 lines: read as
    sentence ends, they made it prose, and it was said to be hard-wrapped. A sentence's end inside a line is one before
    a capitalised word (or at the line's end); the same lines with their sentences capitalised and wrapped in pairs
    are still said to be."""
    import textwrap
    import warnings

    assert sum(". " in line for line in PENN_TREEBANK) == 7
    assert all((line[0].islower() or line.startswith("<unk>")) and not line.endswith(".") for line in PENN_TREEBANK)
    path = tmp_path / "ptb.train.txt"
    path.write_text("".join(f" {line} \n" for line in PENN_TREEBANK), encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(iter_texts(path)) == PENN_TREEBANK
    prose = [line[0].upper() + line[1:] + "." for line in PENN_TREEBANK]  # sentences, two to a paragraph, wrapped
    joined = [" ".join(prose[i:i + 2]) for i in range(0, len(prose), 2)]
    wrapped = [piece for paragraph in joined for piece in textwrap.wrap(paragraph, 50)]
    path = tmp_path / "wrapped.txt"
    path.write_text("\n".join(wrapped) + "\n", encoding="utf-8")
    with pytest.warns(UserWarning, match="line breaks fall inside a sentence"):
        assert list(iter_texts(path)) == wrapped
