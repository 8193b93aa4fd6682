"""The one exception a user's input raises, printed by every entry point as one line with exit status 2.

    raise UserError(f"data path not found: {source}")      # train.py / probe.py / analyze.py print it, exit 2
    first_line(error)                                      # a library's message, cut to one (whole) line
    plain_warnings()                                       # warnings print as "warning: <message>"
    warn_once("IsoScore* not computed: ...")               # a warning this process has not given yet (else nothing)
    exit_with(main)                                        # analyze.py / study.py: `| head` stops it without a traceback
                                                           # (and a run Ctrl-C stopped ends by SIGINT: core/signals.py)
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings

from core.signals import exit_status


class UserError(Exception):
    """A problem with the user's input or environment: printed as one line, exit status 2."""


REMOTE_CODE = ("it needs its own Python code (an auto_map in its config: a class transformers does not have), and this "
               "project never runs code from a model's files (trust_remote_code stays off)")


def library_line(error: BaseException) -> str:
    """first_line, or REMOTE_CODE when transformers refuses a model or tokenizer that needs its own code (every
    wording of that refusal says "custom code")."""
    text = first_line(error)
    return REMOTE_CODE if "custom code" in text else text


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (or its type name when it has none), with the lines that complete it
    when it ends in ':', ',' or ';' ("... from one of:" followed by a list), whitespace collapsed."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    text = lines[0]
    for more in lines[1:]:
        if not text.endswith((":", ",", ";", " or", " and")) or len(text) > 300:
            break
        text = f"{text} {more}"
    return " ".join(text.split())


_given: set[str] = set()


def warn_once(message: str, category: type[Warning] = UserWarning) -> None:
    """warnings.warn, unless this process gave the same message before (whatever the warnings filters say)."""
    if message not in _given:
        _given.add(message)
        warnings.warn(message, category, stacklevel=2)


def plain_warnings() -> None:
    """Show warnings as one line each, `warning: <message>`, as the entry points' own warnings are (they call this:
    a user reads these lines, not a developer; the file and line of the code that warned are left out)."""
    warnings.formatwarning = _one_line
    # Lightning's own use of a deprecated torch API: nothing a user can act on
    warnings.filterwarnings("ignore", r".*isinstance\(treespec, LeafSpec\).*", FutureWarning)
    # Lightning's lines that say nothing to act on (UNACTIONABLE: its tips, an advert for its cloud logger; "GPU
    # available: False" on a CPU; "Seed set to 0", the seed being in the config; why fit stopped, the run's summary
    # says; "Received SIGTERM: 15", the program's own line says what it did). At the loggers that make them, at the
    # package loggers (core.cli.HeldLogs hands held lines to those), and at the package loggers' handlers (which also
    # see what their child loggers propagate)
    for package in ("pytorch_lightning", "lightning_fabric", "lightning.pytorch", "lightning.fabric"):
        for name in (package, f"{package}.utilities.rank_zero", f"{package}.utilities.seed"):
            logger = logging.getLogger(name)
            for holder in [logger, *logger.handlers]:
                if not any(isinstance(f, _Unactionable) for f in holder.filters):
                    holder.addFilter(_Unactionable())


UNACTIONABLE = re.compile(r"💡 Tip|(GPU|TPU|HPU|IPU) available: False|Seed set to -?\d+$|`Trainer\.fit` stopped: "
                          r"`max_(steps|epochs)=\d+` reached\.$|(\[rank: \d+\] )?Received SIGTERM: \d+$")


class _Unactionable(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not UNACTIONABLE.match(str(record.msg))


def _one_line(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"


def exit_with(main, quick_under_torchrun: bool = False) -> None:
    """sys.exit(main()), where a reader that stopped early (`analyze.py compare a b | head`) ends the output quietly
    (exit status 141, as a process killed by SIGPIPE): the tables are printed after the reports are written, so only
    the rest of a table is lost. Python's own recipe: the rest of stdout goes to /dev/null, not to a traceback.

    With `quick_under_torchrun`, a process torchrun started (WORLD_SIZE > 1) ends with os._exit once its output is
    flushed: its process group is gone and its files are written, and the interpreter's teardown is where gloo's
    threads can abort it ("terminate called without an active exception", exit status 134) now and then. For an entry
    point that needs no atexit work (analyze.py: no W&B run). A run stopped by Ctrl-C ends by SIGINT, as Python ends
    any Ctrl-C'd program (core.signals.exit_status)."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 141
    if quick_under_torchrun and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 0 if code is None else 1)
    sys.exit(exit_status(code))
