"""The argparse side of the entry points (analyze.py, study.py), torch-free so that `--help` answers at once.

    parser = OneLineArgumentParser(prog="analyze.py", formatter_class=HelpFormatter)
    sub.set_defaults(run="analyses.outliers:run_outliers")    # a subcommand's runner, imported after parsing
    run = load_runner(args.run)                               # the function itself

An error is one line (no usage), an unknown option names the closest one; an option is never abbreviated (`--enc` is
an unknown option, not --encoder: allow_abbrev off, in every subcommand's parser too). HelpFormatter shows every option's default
(appended as "(default: X)" unless the help text already says it) and keeps the description's line breaks.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
from collections.abc import Callable


class OneLineArgumentParser(argparse.ArgumentParser):
    """An argparse parser whose error is one line (no usage), an unknown option with the closest one; no option is
    taken abbreviated (its subcommands' parsers are of this class, and refuse them too)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)  # argparse's default would read --enc as --encoder, silently
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        unknown = re.search(r"unrecognized arguments: (--[^\s=]+)", message)
        if unknown:
            options = _options(self)
            longer = sorted(option for option in options if option.startswith(unknown.group(1)))  # an abbreviation's
            close = difflib.get_close_matches(unknown.group(1), longer or sorted(options - {unknown.group(1)}), n=1,
                                              cutoff=0 if longer else 0.6)
            if unknown.group(1) in options:  # another subcommand's: "did you mean" itself would be no help
                message = (f"unknown option {unknown.group(1)} for this subcommand (another subcommand takes it; "
                           f"{self.prog} <subcommand> --help lists each one's options)")
            else:
                message = f"unknown option {unknown.group(1)}" + (f" (did you mean {close[0]}?)" if close else "")
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def _options(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of `parser` and its subcommands' parsers."""
    options = set()
    for action in parser._actions:
        options.update(option for option in action.option_strings if option.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                options |= _options(sub)
    return options


def shown_default(value) -> str:
    """A default as --help shows it: none, off / on, a list space-separated."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value)) or "none"
    return str(value)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's default shown ("(default: X)" appended unless its help already names its default); the
    description's own line breaks kept."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS or "default" in text.lower():
            return text
        return f"{text} (default: {shown_default(action.default)})".replace("%", "%%").strip()


def load_runner(reference: str | Callable) -> Callable:
    """The function a "package.module:function" string names (imported now), or the callable itself."""
    if callable(reference):
        return reference
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)
