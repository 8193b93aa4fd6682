"""Cost of the attention variants (Bondarenko et al. 2023): the MLM training step with clipped softmax and with gated
attention against the softmax step, side by side in one run, on the tiny MLM config (issue 21).

    python benchmarks/bench_attention.py             # configs/pretrain/tiny.yaml (4 layers, 128 wide, blocks of 128)
    python benchmarks/bench_attention.py --quick     # fewer steps and rounds
    python benchmarks/bench_attention.py --smoke     # a 2-layer MLM, 2 timed steps (tests/test_bench.py)

Each round trains the three arms from the same seed (`--model.attention softmax`, `clipped_softmax`, `gated`, their
default parameters), in an order that rotates with the round; timed: optimizer steps 1..--steps (step 0 holds the
one-time set-up), no logger, no callbacks, no validation. A ratio is the median over rounds of the paired per-round
ratio of wall times to the round's softmax run. One intra-op thread by default. Output: `RATIO
clipped_softmax_step` and `RATIO gated_attention_step` (target <= 1.10 each), with the per-round ratios and the
median ratio of process CPU times as METRIC lines.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_regularizer import rotated_rounds, step_timing_options  # noqa: E402

ARMS = ("softmax", "clipped_softmax", "gated")
NAMES = {"clipped_softmax": "clipped_softmax_step", "gated": "gated_attention_step"}


def main() -> None:
    args = step_timing_options(__doc__.split("\n\n")[0], rounds=5, quick_rounds=3,
                               steps_help="timed optimizer steps per run")
    walls, cpus, _ = rotated_rounds(ARMS, lambda arm: ["--model.attention", arm], args)
    for arm, name in NAMES.items():
        ratios = [variant / plain for variant, plain in zip(walls[arm], walls["softmax"], strict=True)]
        print(f"METRIC {name}_per_round {' '.join(f'{r:.3f}' for r in ratios)}")
        cpu = [variant / plain for variant, plain in zip(cpus[arm], cpus["softmax"], strict=True)]
        print(f"METRIC {name}_cpu_time_ratio {statistics.median(cpu):.3f}  (process CPU time, median of the rounds: "
              "less sensitive to a busy machine than wall time)")
        print(f"RATIO {name} {statistics.median(ratios):.3f} target <=1.10")


if __name__ == "__main__":
    main()
