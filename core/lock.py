"""One live run per run directory: a lock file naming its owner (program, pid, host), held while the run lives.

    lock = RunLock("runs/pretrain/tiny", "train.py")
    lock.acquire()          # UserError "runs/pretrain/tiny is in use by train.py (pid 4242 on node7, since ...)"
    ...                     # the run: checkpoints, export, reports
    lock.release()          # the lock file goes; so does the directory if acquire created it and it stayed empty

The lock is `<directory>/.run.lock`, a JSON line {program, pid, host, started, slurm_job}, held with an exclusive
flock(2) for the life of the process: the kernel drops it when the process ends in any way (kill -9 included), so a
lock file whose flock can be taken again is stale and is taken over, with a note naming the run that left it. Where
the filesystem has no flock (some cluster filesystems), a lock file counts as stale when its pid is gone from this
host, or when it is this SLURM job's own (a requeued job); a lock of another host's live process is never broken.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path

from core.errors import UserError
from core.output import flock, missing_directories, pid_alive, remove_empty, same_file, write_error

LOCK_NAME = ".run.lock"


class RunLock:
    """The lock of one run directory (see the module docstring); `acquire` refuses one line naming the owner."""

    def __init__(self, directory: str | os.PathLike, program: str) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self.program = program
        self._fd: int | None = None
        self._created: list[Path] = []

    def acquire(self) -> None:
        self._created = missing_directories(self.directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            remove_empty(self._created)
            raise UserError(f"cannot write to output directory {self.directory}: {error.strerror or error}") from None
        try:
            self._take()
        except BaseException:
            remove_empty(self._created)
            raise

    def _take(self) -> None:
        owner: dict = {}
        for _ in range(20):  # another run may replace or remove the file between our open and our lock
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as error:
                raise UserError(f"cannot write to output directory {self.directory}: {error.strerror}") from None
            held = flock(fd)
            if held is False:  # a live process holds it (give one that has just taken it a moment to write)
                owner = _read(fd)
                for _ in range(10):
                    if owner:
                        break
                    time.sleep(0.1)
                    owner = _read(fd)
                os.close(fd)
                raise UserError(in_use(self.directory, owner))
            if not same_file(fd, self.path):
                os.close(fd)
                continue
            owner = _read(fd)
            if owner and held is None and _alive(owner):  # no flock here: trust the pid and host
                os.close(fd)
                raise UserError(in_use(self.directory, owner))
            if owner:
                print(f"note: {self.directory} was locked by {describe(owner)}, which is no longer running: taking "
                      "the lock over", file=sys.stderr)
            try:
                _write(fd, {"program": self.program, "pid": os.getpid(), "host": socket.gethostname(),
                            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "slurm_job": os.environ.get("SLURM_JOB_ID")})
            except OSError as error:  # a full disk: the lock file goes (we hold it), one line
                with contextlib.suppress(OSError):
                    self.path.unlink()
                os.close(fd)
                raise UserError(f"cannot write to output directory {self.directory}: "
                                f"{write_error(error, self.directory)}") from None
            self._fd = fd
            return
        raise UserError(in_use(self.directory, owner))  # its lock file kept changing hands: other runs are starting

    def release(self) -> None:
        """Remove the lock file (while still holding it) and the directories acquire created, if left empty."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            if same_file(self._fd, self.path):
                self.path.unlink()
        os.close(self._fd)
        self._fd = None
        remove_empty(self._created)


def _read(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 65536).decode("utf-8", "replace").strip()
    try:
        owner = json.loads(text) if text else {}
    except json.JSONDecodeError:
        return {"program": "an unknown run"}  # a torn or foreign lock file: only flock can tell whether it lives
    return owner if isinstance(owner, dict) else {"program": "an unknown run"}


def _write(fd: int, owner: dict) -> None:
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, (json.dumps(owner) + "\n").encode("utf-8"))
    os.fsync(fd)


def _alive(owner: dict) -> bool:
    """Without flock: whether the owner may still run (its pid on this host, or another host's: assumed alive,
    unless it is this very SLURM job, requeued)."""
    job = os.environ.get("SLURM_JOB_ID")
    if job and owner.get("slurm_job") == job:
        return False
    if owner.get("host") != socket.gethostname():
        return True
    try:
        pid = int(owner.get("pid", -1))
    except (TypeError, ValueError):
        return False
    return pid_alive(pid) if pid > 0 else True  # no pid of its own to check: assumed alive


def describe(owner: dict) -> str:
    where = f"pid {owner.get('pid', '?')} on {owner.get('host', '?')}"
    since = f", since {owner['started']}" if owner.get("started") else ""
    return f"{owner.get('program', 'a run')} ({where}{since})"


def in_use(directory: Path, owner: dict) -> str:
    return (f"{directory} is in use by another run: {describe(owner)}; wait for it to end, or choose another "
            "--trainer.default_root_dir")
