"""Run every benchmarks/bench_*.py and print one table of the ratios each measured against its target.

    python benchmarks/run_all.py            # full sizes (make bench); on a GPU also roberta-base tokens/s and MFU
    python benchmarks/run_all.py --quick    # reduced sizes
    python benchmarks/run_all.py --smoke    # smallest sizes, seconds per script (tests/test_bench.py runs this)
    python benchmarks/run_all.py --only eval

Each script prints lines `RATIO <name> <value> target <op><number>` (side by side in its own run) and may print
`METRIC <name> <value>  (<note>)` lines for measurements without a target (tokens/s, model-FLOPs utilisation); this
runner collects both and prints the ratios against their targets, then the measurements. Every script takes
`--quick` and `--smoke`. Exit status 1 when a script fails or prints no ratio; a missed target is reported, not an
error. Nothing here times anything.
"""

from __future__ import annotations

import argparse
import math
import operator
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LINE = re.compile(r"^RATIO (\S+) (\S+) target (<=|>=|<|>)(\S+)$")
METRIC = re.compile(r"^METRIC (\S+) ([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)(?:\s+\((.*)\))?$")
OPS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt}


def parse(output: str) -> list[tuple[str, float, str, float]]:
    """(name, value, op, target) of every RATIO line."""
    rows = []
    for line in output.splitlines():
        match = LINE.match(line.strip())
        if match:
            name, value, op, target = match.groups()
            rows.append((name, float(value), op, float(target)))
    return rows


def parse_metrics(output: str) -> list[tuple[str, float, str]]:
    """(name, value, note) of every single-valued METRIC line (not the per-round values of a ratio)."""
    rows = []
    for line in output.splitlines():
        match = METRIC.match(line.strip())
        if match and not match.group(1).endswith("_per_round"):  # the rounds behind a RATIO, printed above
            rows.append((match.group(1), float(match.group(2)), match.group(3) or ""))
    return rows


def mode_flags(script: Path, mode: str | None) -> list[str]:
    if mode == "smoke" and "--smoke" not in script.read_text(encoding="utf-8"):
        print(f"note: {script.name} has no --smoke mode; running --quick", flush=True)
        mode = "quick"
    return [f"--{mode}"] if mode else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--quick", action="store_true", help="reduced sizes")
    sizes.add_argument("--smoke", action="store_true", help="smallest sizes, to check the scripts run (tests)")
    parser.add_argument("--only", default=None, help="run only scripts whose name contains this")
    args = parser.parse_args(argv)
    mode = "smoke" if args.smoke else "quick" if args.quick else None
    scripts = sorted(p for p in HERE.glob("bench_*.py") if args.only is None or args.only in p.name)
    table, measured, failed_scripts = [], [], []
    for script in scripts:
        start = time.perf_counter()
        flags = mode_flags(script, mode)
        print(f"== {script.name} {' '.join(flags)}".rstrip(), flush=True)
        done = subprocess.run([sys.executable, str(script), *flags], capture_output=True, text=True, cwd=HERE.parent)
        print(done.stdout, end="", flush=True)
        if done.returncode != 0:
            failed_scripts.append(script.name)
            print(done.stderr[-3000:], file=sys.stderr)
        rows = parse(done.stdout)
        if not rows and done.returncode == 0:
            failed_scripts.append(f"{script.name} (printed no RATIO lines)")
        table += [(script.stem, *row) for row in rows]
        measured += [(script.stem, *row) for row in parse_metrics(done.stdout)]
        print(f"   ({time.perf_counter() - start:.0f} s)", flush=True)
    print(f"\n{'script':<18} {'ratio':<40} {'value':>8}  {'target':<8} result")
    misses = 0
    for script, name, value, op, target in table:
        ok = math.isfinite(value) and OPS[op](value, target)
        misses += not ok
        print(f"{script:<18} {name:<40} {value:>8.3f}  {op}{target:<6g} {'ok' if ok else 'MISSED'}")
    if measured:
        print(f"\n{'script':<18} {'measurement (no target)':<40} {'value':>12}  note")
        for script, name, value, note in measured:
            print(f"{script:<18} {name:<40} {value:>12.6g}  {note}")
    if failed_scripts:
        print(f"scripts that failed: {', '.join(failed_scripts)}", file=sys.stderr)
    print(f"{len(table) - misses}/{len(table)} ratios within target" + (f" ({mode} mode: sizes too small to judge)"
                                                                         if mode else ""))
    return 1 if failed_scripts else 0


if __name__ == "__main__":
    sys.exit(main())
