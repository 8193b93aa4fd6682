"""Cost of the streaming outlier statistics, measured side by side in one run (issue 2's targets).

    python benchmarks/bench_outliers.py            # packaged MiniLM, 200 vs 2000 sentences
    python benchmarks/bench_outliers.py --quick    # smaller
    python benchmarks/bench_outliers.py --smoke    # smallest, seconds (the test suite runs this)

1. Peak memory: the whole `analyze.py outliers` statistics pipeline (read, sample, tokenise, encode, update) runs
   in a fresh process on N and on 10×N sentences; the peak resident set of the 10×N run must stay within 1.1× of
   the N run (the statistics stream: fixed-size states, nothing kept per token).
2. Time: the same pre-tokenised batches through the bare transformers forward (output_hidden_states=True) and
   through FrozenEncoder + NeuronStatistics.update, interleaved; the statistics may add at most 10%.
3. Measured, no target (issues 26-27): the same with the massive activations and the magnitude criterion added
   (`analyze.py outliers`' reference pass), and the attention sinks' pass (eager attention, output_attentions,
   AttentionSinks) against the bare SDPA forward.
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

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from datamodules.text import DEFAULT_CORPUS, iter_texts, sample_texts  # noqa: E402
from lightning_modules.encoder import default_encoder, load_encoder  # noqa: E402
from metrics.magnitude import MagnitudeCounts  # noqa: E402
from metrics.massive import MassiveActivations  # noqa: E402
from metrics.neuron_stats import NeuronStatistics  # noqa: E402
from metrics.sinks import AttentionSinks  # noqa: E402


def child(encoder_path: str, sentences: int, max_length: int, batch_size: int) -> None:
    """One statistics run; prints its peak RSS (MiB) and the metric's state size as JSON."""
    encoder = load_encoder(encoder_path, device="cpu")
    texts = sample_texts(iter_texts(DEFAULT_CORPUS), sentences, seed=0)
    stats = NeuronStatistics(encoder.num_hidden_states, encoder.hidden_size)
    tokens = 0
    for batch in encoder.batches(texts, batch_size, max_length, progress=False):
        stats.update(batch.hidden_states, batch.mask)
        tokens += int(batch.mask.sum())
    stats.compute()
    state_bytes = sum(s.numel() * s.element_size() for s in stats.metric_state.values())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"peak_mib": peak, "tokens": tokens, "state_bytes": state_bytes}))


def measure_memory(encoder_path: str, base: int, max_length: int, batch_size: int) -> tuple[dict, dict]:
    runs = []
    for n in (base, 10 * base):
        command = [sys.executable, __file__, "--child", str(n), "--encoder", encoder_path,
                   "--max_length", str(max_length), "--batch_size", str(batch_size)]
        # A fixed mmap threshold stops glibc from raising it after large frees, so freed tensors go back to the
        # OS and the peak RSS measures live memory rather than heap fragmentation.
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT, env=env)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return runs[0], runs[1]


def measure_time(encoder_path: str, num_batches: int, max_length: int, batch_size: int, repeats: int
                 ) -> tuple[float, float, float, float]:
    """CPU seconds of: the bare forward, + NeuronStatistics, + massive activations and magnitude counts, and the
    attention sinks' eager pass."""
    encoder = load_encoder(encoder_path, device="cpu")
    texts = sample_texts(iter_texts(DEFAULT_CORPUS), num_batches * batch_size, seed=1)
    batches = [encoder.tokenize(texts[i:i + batch_size], max_length)[0] for i in range(0, len(texts), batch_size)]
    layers, hidden = encoder.num_hidden_states, encoder.hidden_size
    stats = NeuronStatistics(layers, hidden)
    massive, counts = MassiveActivations(layers, hidden), MagnitudeCounts(layers, hidden)
    sinks = AttentionSinks(encoder.num_layers, encoder.model.config.num_attention_heads)

    @torch.no_grad()
    def bare(inputs):
        encoder.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                      output_hidden_states=True)

    def with_statistics(inputs):
        batch = encoder(**inputs)
        stats.update(batch.hidden_states, batch.mask)

    def with_magnitudes(inputs):
        batch = encoder(**inputs)
        stats.update(batch.hidden_states, batch.mask)
        massive.update(batch.hidden_states, batch.mask, batch.input_ids)
        counts.update(batch.hidden_states, batch.mask)

    def sink_pass(inputs):
        with encoder.attention_weights():
            batch = encoder(**inputs)
        sinks.update(batch.attention_mass, batch.mask)

    # Interleaved batch by batch, so a load change on the machine hits every side alike; per batch the fastest of
    # `repeats` tries counts (the usual defence against interference), summed over batches. One intra-op thread
    # and process CPU time: the work done, not the share of a busy machine this process happened to get.
    sides = (bare, with_statistics, with_magnitudes, sink_pass)
    totals = dict.fromkeys(sides, 0.0)
    for inputs in batches:
        best = dict.fromkeys(sides, float("inf"))
        for _ in range(repeats + 1):  # the first round warms up
            for fn in sides:
                start = time.process_time()
                fn(inputs)
                best[fn] = min(best[fn], time.process_time() - start)
        for fn in totals:
            totals[fn] += best[fn]
    return tuple(totals[fn] for fn in sides)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="smallest sizes (tests)")
    parser.add_argument("--encoder", default=None)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--max_length", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=32)
    args = parser.parse_args()
    encoder = args.encoder or default_encoder()
    torch.set_num_threads(1)
    if args.child is not None:
        return child(encoder, args.child, args.max_length, args.batch_size)
    base, batches, repeats = (8, 1, 1) if args.smoke else (40, 4, 3) if args.quick else (200, 24, 5)
    small, large = measure_memory(encoder, base, args.max_length, args.batch_size)
    print(f"memory: {base} sentences ({small['tokens']} tokens) peak {small['peak_mib']:.0f} MiB; "
          f"{10 * base} sentences ({large['tokens']} tokens) peak {large['peak_mib']:.0f} MiB; "
          f"metric state {large['state_bytes'] / 1024:.0f} KiB")
    bare, stats, magnitudes, sinks = measure_time(encoder, batches, args.max_length, args.batch_size, repeats)
    print(f"CPU time over {batches} batches of {args.batch_size} (1 thread): bare forward {bare:.3f}s, "
          f"forward + statistics {stats:.3f}s, + massive activations and magnitude counts {magnitudes:.3f}s, "
          f"attention sinks' eager pass {sinks:.3f}s")
    print(f"RATIO outlier_stats_peak_memory_10x {large['peak_mib'] / small['peak_mib']:.3f} target <=1.10")
    print(f"RATIO outlier_stats_time_overhead {stats / bare:.3f} target <=1.10")
    print(f"METRIC outlier_magnitudes_time_ratio {magnitudes / bare:.3f} (forward + NeuronStatistics + "
          "MassiveActivations + MagnitudeCounts vs the bare forward)")
    print(f"METRIC attention_sinks_pass_time_ratio {sinks / bare:.3f} (the sinks' pass, eager attention with "
          "output_attentions + AttentionSinks, vs the bare SDPA forward)")


if __name__ == "__main__":
    main()
