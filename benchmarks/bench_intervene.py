"""Cost of `analyze.py intervene` with 10 controls against one `analyze.py outliers` pass, side by side in one run
(issue 26's target: at most 1 + 10 + 1 encoder passes over the data, plus 10%).

    python benchmarks/bench_intervene.py                   # packaged MiniLM, 2,000 sentences of the bundled corpus
    python benchmarks/bench_intervene.py --sentences 500   # fewer (a loaded machine)
    python benchmarks/bench_intervene.py --quick           # 500 sentences
    python benchmarks/bench_intervene.py --smoke           # 20 sentences, seconds (the test suite runs this)

Both commands run in this process through analyze.main, as a user runs them (reading, sampling, tokenising, loading
the encoder, writing the reports and figures): `outliers --no_attention_sinks` (one encoder pass: NeuronStatistics,
the massive activations and magnitude counts, the rule, the origins, the figures; the default adds an eager attention
pass for the sinks, about 2.2 passes in all, which would halve the ratio without intervene doing less) and
`intervene --interventions layernorm_zero --controls 10` (the baseline, the intervention and 10 controls: 12 passes
over the same padded batches, tokenised once, each with NeuronStatistics and the anisotropy sample; the packaged
MiniLM has no MLM head, so no masked pass). A warm-up `outliers` run on a few sentences comes first (imports, caches),
then outliers, intervene, outliers; the outliers cost is the mean of its two runs. One intra-op thread and process CPU
time: the work done, not the share of a busy machine this process happened to get.
Output: `RATIO intervene_10_controls_vs_outliers_pass <value> target <=13.2`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONTROLS = 10
TARGET = (1 + CONTROLS + 1) * 1.1


def timed(argv: list[str]) -> float:
    """Process CPU seconds of one analyze.py command (which must succeed)."""
    import analyze

    start = time.process_time()
    if analyze.main(argv) != 0:
        raise SystemExit(f"analyze.py {' '.join(argv)} failed")
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--quick", action="store_true", help="500 sentences")
    parser.add_argument("--smoke", action="store_true", help="20 sentences (tests)")
    parser.add_argument("--sentences", type=int, default=None, help="sentences of the bundled corpus (default 2000)")
    args = parser.parse_args()
    sentences = args.sentences or (20 if args.smoke else 500 if args.quick else 2000)

    import contextlib
    import io

    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        flags = ["--no_progress", "--device", "cpu"]
        common = [*flags, "--max_sentences", str(sentences)]
        quiet = io.StringIO()
        with contextlib.redirect_stdout(quiet):
            timed(["outliers", *flags, "--max_sentences", "20", "--output_dir", f"{folder}/warm"])
            first = timed(["outliers", *common, "--no_attention_sinks", "--output_dir", f"{folder}/outliers1"])
            intervene = timed(["intervene", *common, "--interventions", "layernorm_zero", "--controls", str(CONTROLS),
                               "--output_dir", f"{folder}/intervene"])
            second = timed(["outliers", *common, "--no_attention_sinks", "--output_dir", f"{folder}/outliers2"])
    outliers = (first + second) / 2
    print(f"MiniLM, {sentences} sentences: outliers {first:.1f} s and {second:.1f} s (CPU), intervene with "
          f"{CONTROLS} controls {intervene:.1f} s: {intervene / outliers:.2f} outliers passes against at most "
          f"{1 + CONTROLS + 1} + 10%")
    print(f"METRIC intervene_cpu_seconds {intervene:.2f}")
    print(f"METRIC outliers_cpu_seconds {outliers:.2f}")
    print(f"RATIO intervene_{CONTROLS}_controls_vs_outliers_pass {intervene / outliers:.3f} target <={TARGET:.1f}",
          flush=True)


if __name__ == "__main__":
    main()
