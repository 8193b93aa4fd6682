"""`analyze.py --help` against `python -c "import torch"`, side by side in one run (issue 28): the help answers before
anything heavy is imported, so it must take a fraction of torch's import alone.

    python benchmarks/bench_help.py            # 7 paired rounds (each a fresh process, the two interleaved)
    python benchmarks/bench_help.py --quick    # 5 rounds
    python benchmarks/bench_help.py --smoke    # 3 rounds

Each round starts `python analyze.py --help` and `python -c "import torch"` as fresh processes, one after the other
(which goes first alternates), and takes their wall-clock times; the ratio is the median over rounds of help / torch.
Both pay the interpreter's own start, so the ratio of two processes that import nothing would be about 1 / (torch's
import / the interpreter's start); `train.py --help`, `probe.py --help` and `study.py --help` are timed the same way
and printed as measurements. Output: `RATIO analyze_help_vs_import_torch <value> target <=0.6`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROUNDS = {"full": 7, "quick": 5, "smoke": 3}


def wall(argv: list[str]) -> float:
    """Seconds a fresh `python argv...` takes, from start to exit, in the repository root."""
    start = time.perf_counter()
    subprocess.run([sys.executable, *argv], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--quick", action="store_true", help="5 rounds")
    sizes.add_argument("--smoke", action="store_true", help="3 rounds")
    args = parser.parse_args(argv)
    rounds = ROUNDS["smoke" if args.smoke else "quick" if args.quick else "full"]
    commands = {"analyze_help": ["analyze.py", "--help"], "import_torch": ["-c", "import torch"],
                "train_help": ["train.py", "--help"], "probe_help": ["probe.py", "--help"],
                "study_help": ["study.py", "--help"]}
    wall(commands["import_torch"])  # warm the file cache for both
    wall(commands["analyze_help"])
    times: dict[str, list[float]] = {name: [] for name in commands}
    for index in range(rounds):
        order = list(commands) if index % 2 == 0 else list(reversed(commands))
        for name in order:
            times[name].append(wall(commands[name]))
    ratios = [help_ / torch for help_, torch in zip(times["analyze_help"], times["import_torch"])]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"METRIC analyze_help_vs_import_torch_per_round {' '.join(f'{r:.3f}' for r in ratios)}")
    for name, values in times.items():
        print(f"METRIC {name}_seconds {statistics.median(values):.3f}  (median of {rounds} fresh processes; "
              f"load average {load:.1f})")
    print(f"RATIO analyze_help_vs_import_torch {statistics.median(ratios):.3f} target <=0.6")
    return 0


if __name__ == "__main__":
    sys.exit(main())
