"""Run every benchmarks/bench_*.py and print one table of the ratios each measured against its target.

    python benchmarks/run_all.py            # full sizes (make bench)
    python benchmarks/run_all.py --quick    # reduced sizes (the test suite runs this so the scripts cannot rot)

Each script prints lines `RATIO <name> <value> target <op><number>`; this runner collects them. Ratios are
measured side by side inside each script's own run; nothing here times anything.
"""

from __future__ import annotations

import argparse
import operator
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LINE = re.compile(r"^RATIO (\S+) (\S+) target (<=|>=|<|>)(\S+)$")
OPS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt}


def parse(output: str) -> list[tuple[str, float, str, float]]:
    rows = []
    for line in output.splitlines():
        match = LINE.match(line.strip())
        if match:
            name, value, op, target = match.groups()
            rows.append((name, float(value), op, float(target)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="reduced sizes")
    parser.add_argument("--only", default=None, help="run only scripts whose name contains this")
    args = parser.parse_args(argv)
    scripts = sorted(p for p in HERE.glob("bench_*.py") if args.only is None or args.only in p.name)
    table, failed_scripts = [], []
    for script in scripts:
        start = time.perf_counter()
        print(f"== {script.name}{' --quick' if args.quick else ''}", flush=True)
        done = subprocess.run([sys.executable, str(script), *(["--quick"] if args.quick else [])],
                              capture_output=True, text=True, cwd=HERE.parent)
        print(done.stdout, end="", flush=True)
        if done.returncode != 0:
            failed_scripts.append(script.name)
            print(done.stderr[-3000:], file=sys.stderr)
        rows = parse(done.stdout)
        if not rows and done.returncode == 0:
            failed_scripts.append(f"{script.name} (printed no RATIO lines)")
        table += [(script.stem, *row, time.perf_counter() - start) for row in rows]
    print(f"\n{'script':<18} {'ratio':<40} {'value':>8}  {'target':<8} result")
    misses = 0
    for script, name, value, op, target, _ in table:
        ok = OPS[op](value, target)
        misses += not ok
        print(f"{script:<18} {name:<40} {value:>8.3f}  {op}{target:<6g} {'ok' if ok else 'MISSED'}")
    if failed_scripts:
        print(f"scripts that failed: {', '.join(failed_scripts)}", file=sys.stderr)
    print(f"{len(table) - misses}/{len(table)} ratios within target" + (" (quick mode: sizes too small to judge)"
                                                                         if args.quick else ""))
    return 1 if failed_scripts else 0


if __name__ == "__main__":
    sys.exit(main())
