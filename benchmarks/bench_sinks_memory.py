"""Peak memory of the attention sinks' pass on long sentences, whole batches against slices of their rows, side by side.

    python benchmarks/bench_sinks_memory.py            # packaged MiniLM, 32 texts cut to 512 tokens, batch 32
    python benchmarks/bench_sinks_memory.py --quick    # 16 texts
    python benchmarks/bench_sinks_memory.py --smoke    # 4 texts of 128 tokens, seconds (the test suite runs this)

`analyze.py outliers` and `trajectory` read the sinks off the model's attention probabilities (output_attentions), which
transformers returns for every layer at once: [layers, batch, heads, seq, seq] floats, 2.4 GB for MiniLM at 32 x 512
tokens, 4.8 GB for bert-base. analyses/magnitudes.py encodes a batch whose probabilities pass ATTENTION_BUDGET (512 MiB)
a few of its padded rows at a time. Each side runs in a fresh process (the same texts, batches and model): `whole`
with the budget lifted (every batch in one call: the pass before the slicing), `sliced` with the default. Printed: the
peak resident set each added to the loaded model, their ratio (target <= 0.5), the CPU time ratio (no target), and
the largest difference of the sinks (float rounding: the same rows, encoded in smaller calls).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SIZES = {"full": (32, 512), "quick": (16, 512), "smoke": (4, 128)}  # texts, tokens each (batch = all texts)


def long_texts(count: int) -> list[str]:
    """`count` texts of about 600 words each: consecutive lines of the bundled corpus joined (cut to the tokens)."""
    from datamodules.text import DEFAULT_CORPUS

    words = Path(DEFAULT_CORPUS).read_text(encoding="utf-8").split()
    return [" ".join(words[i * 600:(i + 1) * 600]) for i in range(count)]


def child(side: str, size: str) -> None:
    import torch

    from analyses import magnitudes
    from analyses.reference import Setting
    from lightning_modules.encoder import default_encoder, load_encoder

    torch.set_num_threads(1)
    count, tokens = SIZES[size]
    encoder = load_encoder(default_encoder(), device="cpu")
    texts = long_texts(count)
    if side == "whole":
        magnitudes.ATTENTION_BUDGET = 1 << 62  # no slicing: every batch in one call, as before
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    metrics = magnitudes.Magnitudes(encoder)
    start = time.process_time()
    metrics.attention_pass(Setting(encoder, batch_size=count, max_length=tokens, progress=False), texts)
    cpu = time.process_time() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = metrics.sinks.compute()
    print(json.dumps({"added_mb": (peak - loaded) / 1024, "cpu": cpu,
                      "sinks": {key: value.tolist() for key, value in result.items()
                                if isinstance(value, torch.Tensor)}}))


def run(side: str, size: str) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", side, "--size", size], capture_output=True, text=True,
                          cwd=ROOT, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(done.stdout.strip().splitlines()[-1])


def largest_difference(a, b) -> float:
    if isinstance(a, list):
        return max((largest_difference(x, y) for x, y in zip(a, b, strict=True)), default=0.0)
    return abs(a - b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--quick", action="store_true")
    sizes.add_argument("--smoke", action="store_true")
    parser.add_argument("--child", choices=("whole", "sliced"), help=argparse.SUPPRESS)
    parser.add_argument("--size", default="full", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.size)
        return
    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    count, tokens = SIZES[size]
    whole, sliced = run("whole", size), run("sliced", size)
    difference = max(largest_difference(whole["sinks"][key], sliced["sinks"][key]) for key in whole["sinks"])
    print(f"attention sinks' pass, packaged MiniLM, {count} texts of {tokens} tokens in one batch (1 thread)")
    print(f"{'':8}{'added peak RSS (MB)':>22}{'CPU (s)':>10}")
    for name, side in (("whole", whole), ("sliced", sliced)):
        print(f"{name:8}{side['added_mb']:>22.0f}{side['cpu']:>10.1f}")
    print(f"largest difference of the sinks: {difference:.2e}")
    print(f"METRIC sinks_pass_cpu_sliced_over_whole {sliced['cpu'] / whole['cpu']:.3f}  (CPU time, no target)")
    print(f"RATIO sinks_pass_peak_rss_sliced_over_whole {sliced['added_mb'] / max(whole['added_mb'], 1):.3f} "
          "target <=0.5")


if __name__ == "__main__":
    main()
