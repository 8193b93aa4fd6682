"""Reading user data and writing reports without leaving anything half-written.

    texts = iter_texts("data/austen.txt")                  # one sentence a line
    texts = iter_texts("reviews.csv", text_column="review")  # csv / tsv / jsonl with a text column
    texts = iter_texts("wikitext:wikitext-103-raw-v1:validation")  # a `datasets` name[:config][:split]
    with staged_output("runs/x") as stage: (stage / "report.json").write_text(...)

Every problem with the user's input raises `UserError`, whose message is the one line the entry points print
before exiting with status 2.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DEFAULT_CORPUS = Path(__file__).resolve().parent.parent / "data" / "austen.txt"
TEXT_COLUMNS = ("text", "sentence", "content", "document", "review")
TABULAR_SUFFIXES = {".csv": ",", ".tsv": "\t"}
JSON_SUFFIXES = {".jsonl", ".json"}


class UserError(Exception):
    """A problem with the user's input or environment: printed as one line, exit status 2."""


def iter_texts(source: str | os.PathLike, text_column: str | None = None) -> Iterator[str]:
    """Yield the texts of `source` lazily: a txt/csv/tsv/jsonl file, a `datasets` directory, or a hub name.

    `source` that is not an existing path is read as `NAME[:CONFIG][:SPLIT]` with `datasets` (streaming);
    `glue/sst2` is tried as a repository first and then as name `glue`, config `sst2`. Blank lines are skipped.
    """
    for record in iter_records(source, columns=None):
        text = _pick(record, text_column, source)
        if text is not None and text.strip():
            yield text.strip()


def iter_records(source: str | os.PathLike, columns: tuple[str, ...] | None = None) -> Iterator[dict]:
    """Yield the rows of `source` as dicts (a plain text file gives {"text": line})."""
    path = Path(source)
    if path.is_file():
        yield from _file_records(path)
    elif path.is_dir():
        yield from _datasets_records(str(path), None, None, local=True)
    elif _looks_like_path(str(source)):
        raise UserError(f"data path not found: {source}")
    else:
        name, config, split = _parse_hub_name(str(source))
        yield from _datasets_records(name, config, split, local=False)


def _pick(record: dict, text_column: str | None, source) -> str | None:
    if text_column is not None:
        if text_column not in record:
            raise UserError(f"text column {text_column!r} not in {source} (columns: {sorted(record)})")
        return record[text_column]
    for name in TEXT_COLUMNS:
        if name in record:
            return record[name]
    strings = [key for key, value in record.items() if isinstance(value, str)]
    if len(strings) == 1:
        return record[strings[0]]
    raise UserError(f"no text column in {source} (columns: {sorted(record)}); pass --text_column")


def _looks_like_path(source: str) -> bool:
    return source.startswith((".", "/", "~")) or Path(source).suffix.lower() in (
        {".txt", ".text"} | set(TABULAR_SUFFIXES) | JSON_SUFFIXES
    )


def _file_records(path: Path) -> Iterator[dict]:
    if path.stat().st_size == 0:
        raise UserError(f"data file is empty: {path}")
    with path.open("rb") as handle:
        head = handle.read(8192)
    if b"\x00" in head:
        raise UserError(f"data file looks binary (NUL bytes), expected UTF-8 text: {path}")
    suffix = path.suffix.lower()
    count = 0
    try:
        with path.open(encoding="utf-8", newline="") as handle:
            if suffix in TABULAR_SUFFIXES:
                # a .tsv is read without quote handling: quotes are text in GLUE / STS-B / WiC tsv files
                quoting = csv.QUOTE_NONE if suffix == ".tsv" else csv.QUOTE_MINIMAL
                rows = csv.DictReader(handle, delimiter=TABULAR_SUFFIXES[suffix], quoting=quoting)
                if not rows.fieldnames:
                    raise UserError(f"data file has no header row: {path}")
                for row in rows:
                    count += 1
                    yield row
            elif suffix in JSON_SUFFIXES:
                for number, line in enumerate(handle, 1):
                    if line.strip():
                        try:
                            row = json.loads(line)
                        except json.JSONDecodeError as error:
                            raise UserError(f"{path}:{number}: not a JSON object per line ({error.msg})") from None
                        if not isinstance(row, dict):
                            raise UserError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
                        count += 1
                        yield row
            else:
                for line in handle:
                    if line.strip():
                        count += 1
                        yield {"text": line.rstrip("\r\n")}
    except UnicodeDecodeError as error:
        raise UserError(f"data file is not UTF-8 text (bad byte at offset {error.start}): {path}") from None
    if count == 0:
        raise UserError(f"data file has no non-blank rows: {path}")


def _parse_hub_name(source: str) -> tuple[str, str | None, str | None]:
    parts = source.split(":")
    if len(parts) > 3 or not parts[0]:
        raise UserError(f"cannot read data source {source!r}: expected a file, a directory or NAME[:CONFIG][:SPLIT]")
    parts += [None] * (3 - len(parts))
    return parts[0], parts[1] or None, parts[2] or None


def _datasets_records(name: str, config: str | None, split: str | None, local: bool) -> Iterator[dict]:
    import datasets

    saved = local and any((Path(name) / marker).exists() for marker in ("dataset_info.json", "dataset_dict.json"))
    if saved:
        loaded = datasets.load_from_disk(name)
        if isinstance(loaded, datasets.DatasetDict):
            loaded = loaded[_choose_split(list(loaded), split, name)]
        yield from _nonempty(iter(loaded), name)
        return
    attempts = [(name, config)]
    if config is None and "/" in name and not local:
        head, tail = name.rsplit("/", 1)
        attempts.append((head, tail))
    errors = []
    for dataset_name, dataset_config in attempts:
        try:
            loaded = datasets.load_dataset(dataset_name, dataset_config, streaming=True)
        except Exception as error:  # datasets raises many types: not found, offline, bad config
            errors.append(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
            continue
        chosen = _choose_split(list(loaded), split, name)
        yield from _nonempty(iter(loaded[chosen]), f"{name}:{chosen}")
        return
    offline = " (offline: HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set)" if _offline() else ""
    raise UserError(f"cannot load dataset {name!r}{offline}: {errors[-1]}")


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


def _offline() -> bool:
    return any(os.environ.get(flag, "").lower() in ("1", "true", "yes") for flag in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


@contextlib.contextmanager
def staged_output(output_dir: str | os.PathLike) -> Iterator[Path]:
    """Yield a staging directory whose files move into `output_dir` only if the block succeeds.

    The directory is created (and checked writable) up front; on any error the staged files are removed, and so are
    `output_dir` and every parent directory this call created, if they are left empty. Each file lands with an atomic
    `os.replace`.
    """
    output = Path(output_dir)
    created = missing_directories(output)
    try:
        output.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=".staging-", dir=output))
    except OSError as error:
        remove_empty(created)
        raise UserError(f"cannot write to output directory {output}: {error.strerror or error}") from None
    try:
        yield stage
        for path in sorted(stage.rglob("*")):
            if path.is_file():
                target = output / path.relative_to(stage)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, target)
    except OSError as error:
        raise UserError(f"cannot write report to {output}: {error.strerror or error}") from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        remove_empty(created)


def missing_directories(path: str | os.PathLike) -> list[Path]:
    """`path` and those of its parents that do not exist yet, deepest first (what a mkdir -p would create)."""
    missing = []
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def remove_empty(directories: list[Path]) -> None:
    """Remove the given directories, deepest first, as long as they are empty (never anything with a file in it)."""
    for directory in directories:
        try:
            directory.rmdir()
        except FileNotFoundError:
            continue
        except OSError:  # not empty (or not ours to remove): neither are its parents
            return


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Any]:
    """Open a temporary file beside `path` for binary writing; on success it is flushed, fsynced and renamed onto
    `path` (`os.replace`, atomic on POSIX), so a reader or a crash sees the old file or the new one, never a part.

    On any error (or a kill: the temporary name `.NAME.*.tmp` is never read) `path` keeps its old content.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = tempfile.NamedTemporaryFile("wb", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False)
    try:
        with handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(handle.name, 0o666 & ~umask)  # as open() would have created it (mkstemp uses 0600)
        os.replace(handle.name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(handle.name)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


def write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")


def sample_texts(texts: Iterator[str], limit: int | None, seed: int) -> list[str]:
    """A uniform random sample of `limit` texts (all when limit is None or 0), in their original order.

    Reservoir sampling (Algorithm R) with a seeded generator: one pass, memory of `limit` texts.
    """
    import random

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


def check_writable(output_dir: str | os.PathLike) -> None:
    """Fail early, before any long computation, when `output_dir` cannot be created or written (leaving no
    directory behind that was not there before)."""
    with staged_output(output_dir):
        pass
