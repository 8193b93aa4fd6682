"""CPU time of isotropy's per-sequence spectra pass when the clipping zeroes nothing, side by side in one process.

    python benchmarks/bench_sequence_spectra.py            # packaged MiniLM, 16 texts of 512 tokens
    python benchmarks/bench_sequence_spectra.py --quick    # 8 texts
    python benchmarks/bench_sequence_spectra.py --smoke    # 4 texts of 64 tokens, seconds (the test suite runs this)

`analyze.py isotropy` (and `all`) takes tokenUni's per-sequence spectrum of every variant: an SVD of every sentence's
token matrix in every layer, which on long sentences costs about as much as the forward itself (in the reference pass
for the variants known before it; in one more pass for a clipping of detected outliers and a fitted --normalize).
`--clip auto` on a model without outlier dimensions (a randomly initialised or an outlier-free one) clips nothing, and
analyses/geometry.py's sequence_spectra then reuses the raw spectra instead of a second SVD of the same matrices.
Both sides run the same pass over the same texts, interleaved (reuse off: the "clipped" variant taken as any other,
as before; reuse on: the default), best of 2 rounds each; the spectra must be equal. Printed: the CPU time of each
and their ratio (target <= 0.8).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from analyses import geometry  # noqa: E402
from analyses.reference import Setting  # noqa: E402
from lightning_modules.encoder import default_encoder, load_encoder  # noqa: E402
from metrics.transforms import RAW, Clipping  # noqa: E402

SIZES = {"full": (16, 512), "quick": (8, 512), "smoke": (4, 64)}  # texts, tokens each


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--quick", action="store_true")
    sizes.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    count, tokens = SIZES["smoke" if args.smoke else "quick" if args.quick else "full"]
    torch.set_num_threads(1)
    encoder = load_encoder(default_encoder(), device="cpu")
    from benchmarks.bench_sinks_memory import long_texts

    texts = long_texts(count)
    setting = Setting(encoder, batch_size=count, max_length=tokens, progress=False)
    variants = [RAW, Clipping([], encoder.num_hidden_states)]
    times, results = {"off": [], "on": []}, {}
    for _ in range(2):
        for side in ("off", "on"):
            if side == "off":
                geometry.Clipping = type("Unrecognised", (), {})  # isinstance(..., Clipping) is False
            start = time.process_time()
            results[side] = geometry.sequence_spectra(setting, texts, variants)
            times[side].append(time.process_time() - start)
            geometry.Clipping = Clipping
    difference = max(float((results["off"]["clipped"][key] - results["on"]["clipped"][key]).abs().max())
                     for key in ("spectrum", "energy_top1", "cdf_auc"))
    off, on = min(times["off"]), min(times["on"])
    print(f"per-sequence spectra pass, packaged MiniLM, {count} texts of {tokens} tokens, raw + a clipping of no dims "
          "(1 thread)")
    print(f"reuse off (as before) {off:.1f} s CPU, reuse on {on:.1f} s CPU; largest difference of the spectra "
          f"{difference:.2e}")
    print(f"RATIO sequence_spectra_cpu_reuse_over_before {on / off:.3f} target <=0.8")


if __name__ == "__main__":
    main()
