"""Ctrl-C (SIGINT) and SIGTERM: the run stops where it is, every `finally` runs (staging directories, the run's lock,
W&B), and the program ends with one line and the shell's status for that signal (130, 143).

    with stop_on_signals(signal.SIGINT, signal.SIGTERM):   # analyze.py, study.py, probe.py; train.py: SIGINT only
        ...                                                 # (its SIGTERM saves a checkpoint first: callbacks/)
    except Interrupted as stop:                             # the signal raised it in the main thread
        print(f"analyze.py outliers: {stop}; ...", file=sys.stderr); return stop.status
    with deferred_signals():                                # core/output.py: a report's files move in all or none
        ...
    sys.exit(exit_status(status))                           # the end of a program: a Ctrl-C'd one ends by SIGINT
    quiet_start("train.py")                                 # before the heavy imports: a Ctrl-C is one line there too
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

STOPS = (signal.SIGINT, signal.SIGTERM)
STOPPED = tuple(128 + signum for signum in STOPS)  # the statuses of a run they stopped: 130, 143


class Interrupted(BaseException):
    """Raised in the main thread by a signal `stop_on_signals` handles. A BaseException as KeyboardInterrupt is (no
    `except Exception` takes it for an error of its own), but not a KeyboardInterrupt, which Lightning turns into exit
    status 1 after its own line; Lightning's on_exception hooks and teardown run for it as for any error.

    `status`: the shell's status for the signal (128 + its number); `detail`: what the run adds to the line (train.py's
    checkpoint callback: the step and the checkpoint to resume from)."""

    def __init__(self, signum: int) -> None:
        self.signum, self.status = signum, 128 + signum
        self.name = signal.Signals(signum).name
        self.detail = ""
        super().__init__(f"stopped by {self.name}")


_owner: int | None = None  # the process that installed the handlers (forked loader workers inherit them)


def _stop(signum, frame) -> None:
    if os.getpid() != _owner:  # a forked child (a loader worker): the signal does what it would by default there
        if signum == signal.SIGINT:
            raise KeyboardInterrupt  # (torch's worker loop ends quietly on it; the main process decides)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise Interrupted(signum)


@contextlib.contextmanager
def stop_on_signals(*signums: int) -> Iterator[None]:
    """Inside the block, each of `signums` raises Interrupted in the main thread; the handlers before are restored on
    exit. Outside the main thread (where Python runs no handlers) nothing changes."""
    global _owner
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    owner, _owner = _owner, os.getpid()
    previous = {signum: signal.signal(signum, _stop) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        _owner = owner


@contextlib.contextmanager
def deferred_signals(signums: tuple[int, ...] = STOPS) -> Iterator[None]:
    """SIGINT and SIGTERM held back while the block runs (a report's files moving into place, a checkpoint's two
    renames), then delivered to the handlers before, in the order they came: the block ends whole, then the signal
    stops the run as it would have. Main thread only (elsewhere the block runs as it is); a handler set outside
    Python (signal.getsignal gives None) is left in place."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {}
    for signum in signums:
        if signal.getsignal(signum) is not None:
            previous[signum] = signal.signal(signum, lambda number, frame: pending.append(number))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(pending):
            signal.raise_signal(signum)


def quiet_start(program: str) -> None:
    """Before the program's main takes over (and after it is done): a Ctrl-C while it imports its libraries (seconds:
    torch, Lightning), when nothing is written yet, ends it at once with one line, by SIGINT, instead of a traceback
    through the import machinery."""
    def stop(signum, frame) -> None:
        os.write(2, f"{program}: stopped by SIGINT (exit status 130)\n".encode())
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGINT, stop)


def first_process() -> bool:
    """Whether this is the process that speaks for the run: not a rank above 0 that torchrun (RANK) or Lightning's own
    launcher (LOCAL_RANK) started; a terminal's Ctrl-C reaches every one of them."""
    return os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0"


def exit_status(status: int | None) -> int | None:
    """`status`, for sys.exit (a console script is sys.exit(function())), except for a run Ctrl-C stopped (130):
    KeyboardInterrupt leaves the program, shown by nothing (its line is printed already), so that Python, once its
    exit handlers have run (W&B's, temporary files'), ends the process by SIGINT itself, as it does for any Ctrl-C.
    The shell reports 130 either way, but only a process ended by SIGINT stops a shell loop around the command
    (`for f in ...; do python analyze.py ...; done`); one that exits with 130 lets the loop go on to the next item."""
    if status != 128 + signal.SIGINT or threading.current_thread() is not threading.main_thread():
        return status
    sys.stdout.flush()
    sys.stderr.flush()
    hook = sys.excepthook
    sys.excepthook = lambda kind, value, trace: None if kind is KeyboardInterrupt else hook(kind, value, trace)
    raise KeyboardInterrupt
