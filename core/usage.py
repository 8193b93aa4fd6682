"""The project's own usage of the LightningCLI entry points (train.py, probe.py), shown before Lightning's, torch-free.

    python train.py --help        # this usage alone, at once (no torch, no Lightning imported)
    python train.py fit --help    # this usage first, then Lightning's list of every option with its default

train.py and probe.py call `help_first` before their heavy imports.
"""

from __future__ import annotations

import sys

SUBCOMMANDS = "fit (every run of this project), validate, test, predict"
OPTION_WIDTH = 42  # a longer option has its text on the next line (as argparse does), not every row pushed right


def usage_text(program: str, doc: str, overrides: list[tuple[str, str]]) -> str:
    """The docstring's opening (what it does, the commands), the common overrides, where every option is listed."""
    width = max((len(option) for option, _ in overrides if len(option) <= OPTION_WIDTH), default=OPTION_WIDTH)
    lines = [doc.strip(), "", "common overrides (after --config; any config key works the same way, "
                              "--<section>.<key> VALUE):"]
    for option, what in overrides:
        lines += [f"  {option:<{width}}  {what}"] if len(option) <= width else [f"  {option}", f"  {'':<{width}}  {what}"]
    lines += ["", f"subcommands: {SUBCOMMANDS}", f"`{program} fit --help` lists every option with its default "
                  "(Lightning's, after this usage)"]
    return "\n".join(lines)


def help_first(program: str, doc: str, overrides: list[tuple[str, str]], argv: list[str] | None = None) -> None:
    """`PROGRAM --help` alone: the usage, exit 0. `PROGRAM <subcommand> --help`: the usage, then Lightning's help
    (the caller goes on). Anything else: nothing."""
    argv = sys.argv[1:] if argv is None else argv
    if not any(arg in ("-h", "--help") for arg in argv):
        return
    print(usage_text(program, doc, overrides))
    if argv in (["-h"], ["--help"]):
        raise SystemExit(0)
    print(f"\n{'-' * 40} every option (Lightning's help) {'-' * 40}\n", flush=True)
