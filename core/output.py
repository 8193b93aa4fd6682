"""Writing reports, exports and checkpoints without ever leaving anything half-written.

    with staged_output("runs/x") as stage:                 # files land in runs/x only if the block succeeds
        write_json(stage / "report.json", report)
    with staged_output("runs/x", owner="outliers") as stage:   # and the files an earlier `outliers` run wrote there
        ...                                                    # that this one does not write again are removed
    # (runs writing into one directory at once take turns: the .written_by record is changed under a flock);
    # staged_output(export, owner="export", legacy=export_weights): an export made before the record existed has its
    # transformers weight files (export_weights) cleaned as if it had recorded them
    # a staging directory is named .staging-<host>-<pid>-<random> (new_stage): one a killed run left (its pid gone from
    # this host) is removed by the next staged_output (or new_stage) into the same directory, with a warning; a live
    # run's never; new_stage(cache, FEATURES) names the probes' memory-mapped features (.features-<host>-<pid>-*) alike
    with atomic_file("runs/x/checkpoints/last.ckpt", keep_previous="runs/x/checkpoints/previous.ckpt") as handle:
        torch.save(state, handle)                          # the old last.ckpt becomes previous.ckpt
    check_writable("runs/x")                               # fail before a long computation, leave nothing behind
    write_error(error, "runs/x")    # a full disk (torch.save's and safetensors' own errors too) names the disk:
                                    # "No space left on device on the disk mounted at /scratch (1.0 TiB)"
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from core.errors import UserError
from core.signals import deferred_signals

try:
    import fcntl
except ImportError:  # not POSIX: no locks
    fcntl = None

OWNERS = ".written_by"  # in an output directory: {relative file: the `owner` (a command) that last wrote it}
OWNERS_LOCK = ".written_by.lock"  # beside it, flock-ed while a run reads, changes and writes the record (owners_lock)
WEIGHTS = {"model.safetensors": ".safetensors", "pytorch_model.bin": ".bin"}  # transformers' single weight files and
# the suffix of the shards their index (<name>.index.json) names
STAGING = ".staging-"  # a staging directory's prefix: .staging-<host>-<pid>-<mkdtemp's random part>
FEATURES = ".features-"  # the probes' memory-mapped features (datamodules/features.py): .features-<host>-<pid>-<random>
KINDS = {STAGING: "the staging directory", FEATURES: "the memory-mapped features directory"}  # prefix: what it is
STAGE_NAME = re.compile(r"(?P<prefix>\.staging-|\.features-)(?P<host>[A-Za-z0-9._-]+)-(?P<pid>\d+)-[a-z0-9_]+")


@contextlib.contextmanager
def staged_output(output_dir: str | os.PathLike, what: str = "report", owner: str | None = None,
                  legacy: Callable[[Path], set[str]] | None = None) -> Iterator[Path]:
    """Yield a staging directory whose files move into `output_dir` only if the block succeeds.

    The directory is created (and checked writable) up front; on any error the staged files are removed, and so are
    `output_dir` and every parent directory this call created, if they are left empty. Each file lands with an atomic
    `os.replace`, all of them before a Ctrl-C or SIGTERM that comes meanwhile stops the run (deferred_signals): the
    report lands whole, never half this run's files and half the earlier run's. With `owner` (e.g. analyze.py's
    subcommand), the files an earlier run of that owner wrote into
    `output_dir` and this run does not write again are removed once the new ones are in place (`remove_stale`): a
    second `outliers` run on a model without a position table leaves no position_embeddings.png of the first model
    beside its report, a second `all` with fewer --sts sets no sts_<set>.json of the first. The files move in and the
    record changes under `owners_lock`: runs writing into one directory at once take turns, and none loses another's
    record. `legacy`: a function of `output_dir` naming (relative paths) the files an earlier run of `owner` wrote
    there before the record existed (`export_weights`); read before the new files land (they may replace the index
    that names them), and taken as that owner's only while the record names no file of `owner`.
    """
    output = Path(output_dir)
    created = missing_directories(output)
    try:
        stage = new_stage(output)
    except OSError as error:
        remove_empty(created)
        raise UserError(f"cannot write to output directory {output}: {error.strerror or error}") from None
    try:
        yield stage
        written = [path.relative_to(stage) for path in sorted(stage.rglob("*")) if path.is_file()]
        with deferred_signals(), owners_lock(output) if owner is not None else contextlib.nullcontext():
            earlier = legacy(output) if legacy is not None and owner is not None else set()
            for name in written:
                target = output / name
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(stage / name, target)
            if owner is not None:
                remove_stale(output, owner, {name.as_posix() for name in written}, earlier)
    except Exception as error:  # an OSError, or a writer's own error around a full disk (torch.save, safetensors)
        if not isinstance(error, OSError) and not disk_full(error):
            raise
        raise UserError(f"cannot write {what} to {output}: {write_error(error, output)}") from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        remove_empty(created)


def new_stage(parent: str | os.PathLike, prefix: str = STAGING) -> Path:
    """A new staging directory in `parent` (created with its parents), named <prefix><host>-<pid>-<random>; the
    directories of that prefix that killed runs left in `parent` are removed first (remove_stale_stages). With
    STAGING: staged_output's, and the block and tokenizer caches' (datamodules/blocks.py), whose finished directory is
    then renamed into place; with FEATURES: the probes' memory-mapped features (datamodules/features.py), removed by
    their extractor's close() or at exit."""
    if prefix not in KINDS:
        raise ValueError(f"unknown staging prefix {prefix!r}: one of {sorted(KINDS)}")
    parent = Path(parent)
    remove_stale_stages(parent, prefix)
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{host_tag()}-{os.getpid()}-", dir=parent))


def host_tag() -> str:
    """This host's name as a staging directory's name holds it (characters other than letters, digits, '.', '_' and
    '-' as '_')."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "_"


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs on this host (another user's live process counts: it cannot be signalled)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    return True


def remove_stale_stages(output: Path, prefix: str = STAGING) -> list[Path]:
    """Remove the directories named <prefix>* (new_stage's) in `output` that a run on this host left when it was
    killed (its pid, in the directory's name, no longer running), one warning line each on stderr naming it and its
    size; the removed ones. A live run's (its pid running, this process's own included), another host's (its pid
    cannot be checked from here) and one whose name does not say its pid (an earlier version's) are left as they
    are."""
    removed, kind = [], KINDS[prefix]
    try:
        candidates = sorted(path for path in output.iterdir() if path.name.startswith(prefix))
    except OSError:  # not there (yet), or not a directory: nothing staged in it
        return removed
    for path in candidates:
        match = STAGE_NAME.fullmatch(path.name)
        if not match or match["host"] != host_tag() or pid_alive(int(match["pid"])) or path.is_symlink() \
                or not path.is_dir():
            continue
        try:  # another run cleaning the same directory may remove files (or all of it) under us
            size = sum(file.lstat().st_size for file in path.rglob("*") if file.is_file() and not file.is_symlink())
            shutil.rmtree(path)
        except FileNotFoundError:  # another run removed it first
            continue
        except OSError as error:
            print(f"warning: cannot remove {path}, {kind} a killed run (pid {match['pid']}) left: "
                  f"{error.strerror or error}", file=sys.stderr)
            continue
        print(f"warning: removed {path} ({human_bytes(size)}), {kind} of a run that ended without "
              f"finishing (pid {match['pid']} on {match['host']}, no longer running)", file=sys.stderr)
        removed.append(path)
    return removed


def remove_stale(output: Path, owner: str, written: set[str], legacy: set[str] = frozenset()) -> None:
    """Remove the files of `output` that `owner` wrote last time (its OWNERS record) and not this time (`written`,
    relative paths), and the directories they leave empty; then record `written` as `owner`'s. A file another owner
    wrote since is that owner's, never removed here; a record that is not this format, or names a path outside
    `output`, removes nothing. `legacy`: files taken as `owner`'s last time when the record names none of `owner`'s
    (a run made before the record existed) and no other owner's. Called under `owners_lock(output)`
    (staged_output)."""
    record = output / OWNERS
    try:
        owners = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        owners = {}
    if not isinstance(owners, dict):
        owners = {}
    if owner not in owners.values():
        owners.update({name: owner for name in legacy if name not in owners})
    root = output.resolve()
    for name, wrote in list(owners.items()):
        if wrote != owner or name in written:
            continue
        del owners[name]
        path = output / name
        if Path(name).is_absolute() or ".." in Path(name).parts or not path.resolve().is_relative_to(root):
            continue
        with contextlib.suppress(OSError):  # gone already, or made a directory since: left as it is
            path.unlink()
        remove_empty([parent for parent in (output / name).parents if parent.resolve() != root
                      and parent.resolve().is_relative_to(root)])
    owners.update(dict.fromkeys(sorted(written), owner))
    with atomic_file(record) as handle:
        handle.write((json.dumps(owners, indent=1, sort_keys=True) + "\n").encode("utf-8"))


def export_weights(directory: Path) -> set[str]:
    """The weight files of a transformers export in `directory` that from_pretrained would load, by name: the single
    files (model.safetensors, pytorch_model.bin), their indexes (<name>.index.json) and the shards an index names in
    its weight_map, each a plain file name in `directory` with the index's own suffix (.safetensors, .bin). Nothing
    else: no path into or out of `directory`, no file of another kind an index may name, no shard no index names
    (pytorch_model-mine.bin), no other file of the user's. An export made before the OWNERS record existed cleans
    these (staged_output's `legacy`): a re-export in another shard layout then leaves no old shard or single file
    that transformers would load instead of, or beside, the new weights."""
    found = set()
    for single, suffix in WEIGHTS.items():
        index = f"{single}.index.json"
        found.update(name for name in (single, index) if (directory / name).is_file())
        try:
            weight_map = json.loads((directory / index).read_text(encoding="utf-8")).get("weight_map")
        except (OSError, ValueError, AttributeError):  # none, unreadable, not an object
            continue
        if isinstance(weight_map, dict):
            found.update(name for name in weight_map.values() if isinstance(name, str) and name.endswith(suffix)
                         and name != suffix and Path(name).name == name and "\\" not in name
                         and (directory / name).is_file())
    return found


@contextlib.contextmanager
def owners_lock(output: Path) -> Iterator[None]:
    """Hold the lock of `output`'s OWNERS record: an exclusive flock(2) on OWNERS_LOCK beside it, waited for, so that
    runs writing into one directory at once read, change and write the record one after the other. The lock file is
    removed while still held; a run that opened it meanwhile finds it gone once it gets the lock, and takes a new one.
    Where the filesystem has no flock, nothing is locked (as core/lock.py's RunLock)."""
    path = output / OWNERS_LOCK
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            held = flock(fd, wait=True)
        except BaseException:
            os.close(fd)
            raise
        if held is None or same_file(fd, path):
            break
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if held is None or same_file(fd, path):
                path.unlink()
        os.close(fd)


def flock(fd: int, wait: bool = False) -> bool | None:
    """Take an exclusive flock(2) on `fd`, waiting for it with `wait`. True: locked; False: held by another process
    (without `wait`); None: this filesystem (or system) has no flock."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as error:
        if error.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return None
        raise


def same_file(fd: int, path: Path) -> bool:
    """Whether the open `fd` is the file `path` names now (not one removed or replaced since it was opened)."""
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except OSError:
        return False


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
def atomic_file(path: str | os.PathLike, keep_previous: str | os.PathLike | None = None) -> Iterator[Any]:
    """Open a temporary file beside `path` for binary writing; on success it is flushed, fsynced and renamed onto
    `path` (`os.replace`, atomic on POSIX), so a reader or a crash sees the old file or the new one, never a part.

    On any error (or a kill: the temporary name `.NAME.*.tmp` is never read) `path` keeps its old content. With
    `keep_previous`, the old `path` (whole: it was written this way) is renamed there just before the new one lands.
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
        with deferred_signals():  # a Ctrl-C between the two renames would leave previous.ckpt without last.ckpt
            if keep_previous is not None and path.exists():
                os.replace(path, keep_previous)
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


def publish_directory(staged: Path, target: Path) -> None:
    """Move a finished directory into place atomically; if another process won the race, keep theirs."""
    try:
        os.replace(staged, target)
    except OSError:
        if not target.exists():
            raise


def write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")


def check_writable(output_dir: str | os.PathLike) -> None:
    """Fail early, before any long computation, when `output_dir` cannot be created or written (leaving no
    directory behind that was not there before)."""
    with staged_output(output_dir):
        pass


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full(error: BaseException | None) -> OSError | bool:
    """Whether `error`, or an error it was raised from or while handling, is a full disk (or a full quota): an OSError
    ENOSPC / EDQUOT (returned, to name its file), torch.save's `RuntimeError: [enforce fail at inline_container.cc]
    unexpected pos` around one, safetensors' `No space left on device (os error 28)`."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in DISK_FULL:
            return error
        if any(text in str(error) for text in ("No space left on device", "Disk quota exceeded", "os error 28")):
            return True
        error = error.__cause__ or error.__context__
    return False


def write_error(error: BaseException, path: str | os.PathLike) -> str:
    """What went wrong writing under `path`, for a one-line message: a full disk names the disk (its mount point,
    free and total space), any other OSError its strerror."""
    full = disk_full(error)
    if full:
        reason = full.strerror if isinstance(full, OSError) and full.strerror else "No space left on device"
        return f"{reason} on {disk_of(path)}"
    return getattr(error, "strerror", None) or " ".join(str(error).split()) or type(error).__name__


def disk_of(path: str | os.PathLike) -> str:
    """'the disk mounted at /scratch (1.0 TiB)': the filesystem that holds `path` (or its nearest existing parent),
    and its size (not its free space: the partial file is gone by the time the message is written)."""
    place = Path(os.path.abspath(path))
    while not place.exists() and place != place.parent:
        place = place.parent
    mount = place
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    try:
        stat = os.statvfs(place)
    except OSError:
        return f"the disk mounted at {mount}"
    return f"the disk mounted at {mount} ({human_bytes(stat.f_blocks * stat.f_frsize)})"


def human_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def failed_file(error: BaseException | None) -> str | None:
    """The file an OSError in `error`'s chain names (the target of a rename), if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and (error.filename2 or error.filename):
            return str(error.filename2 or error.filename)
        error = error.__cause__ or error.__context__
    return None
