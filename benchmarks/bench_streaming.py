"""Streaming data: tokens/s of the streaming training loader (StreamingBlocks + MaskCollator in a DataLoader) with
1 loader worker against N, side by side in one run.

    python benchmarks/bench_streaming.py                # roberta-base shapes (blocks of 512, batch 32), N = 2
    python benchmarks/bench_streaming.py --workers 8    # on a GPU node with the cores to spare
    python benchmarks/bench_streaming.py --quick        # fewer batches, one round
    python benchmarks/bench_streaming.py --smoke        # blocks of 128 on 2000 lines, seconds (the test suite runs it)

With --data.streaming true every loader worker tokenises its own shard of the texts (datamodules/sampling.py), so N
workers tokenise in parallel where one could feed at most its own rate. A GPU pretraining roberta-base at ~0.8M
tokens/s needs that many tokens/s from its loader. Each round times both loaders (the order alternating between
rounds) from the end of a warm-up (the workers started and their first chunks tokenised) over --batches batches;
the ratio is the median over rounds of the paired per-round ratio. Corpus: the bundled core/corpus/austen.txt (4 MB of
text), a byte-level BPE of 8192 trained on it. Output: `RATIO streaming_N_vs_1_workers <value> target >=<x>` with
x = 0.75 N (a shared 2-core machine: N <= the free cores), and METRIC lines: tokens/s of each, and the workers a rank
needs for 0.8M tokens/s at the measured rate per worker.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker, as in a forked loader worker

import torch  # noqa: E402

from datamodules.masking import MaskCollator  # noqa: E402
from datamodules.sampling import StreamingBlocks  # noqa: E402
from datamodules.text import iter_texts  # noqa: E402
from datamodules.tokenizer import train_tokenizer  # noqa: E402

GPU_TOKENS_PER_S = 0.8e6  # roberta-base on one H100 in the fast recipe (the figure)


def loader(corpus: Path, tokenizer, block_length: int, batch_size: int, workers: int):
    dataset = StreamingBlocks(str(corpus), None, tokenizer, block_length, batch_size, rank=0, world=1, skip_texts=0,
                              workers=workers)
    return torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers, prefetch_factor=4,
                                       collate_fn=MaskCollator(tokenizer, block_length))


def tokens_per_second(corpus: Path, tokenizer, block_length: int, batch_size: int, workers: int, warmup: int,
                      batches: int) -> float:
    iterator = iter(loader(corpus, tokenizer, block_length, batch_size, workers))
    for _ in range(warmup):
        next(iterator)
    start = time.perf_counter()
    for batch in itertools.islice(iterator, batches):
        assert batch["input_ids"].shape == (batch_size, block_length)
    elapsed = time.perf_counter() - start
    del iterator  # shuts the workers down
    return batches * batch_size * block_length / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--workers", type=int, default=2, help="N, compared with 1")
    parser.add_argument("--block_length", type=int, default=512)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    lines = None
    if args.quick:
        args.batches, args.rounds = 20, 1
    if args.smoke:
        args.block_length, args.batches, args.rounds, lines = 128, 8, 1, 2000
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        with open(ROOT / "core" / "corpus" / "austen.txt", encoding="utf-8") as handle:
            corpus.write_text("".join(itertools.islice(handle, lines)), encoding="utf-8")
        tokenizer = train_tokenizer(iter_texts(corpus), vocab_size=2048 if args.smoke else 8192)
        results: dict[int, list[float]] = {1: [], args.workers: []}
        warmup = 2 * args.workers  # every worker's first batch (and chunk) done before the clock starts
        for round_ in range(args.rounds):
            for workers in (list(results) if round_ % 2 == 0 else list(reversed(results))):
                value = tokens_per_second(corpus, tokenizer, args.block_length, args.batch_size, workers, warmup,
                                          args.batches)
                results[workers].append(value)
                print(f"round {round_}: {workers} worker(s) {value:12.0f} tokens/s", flush=True)
    one, many = statistics.median(results[1]), statistics.median(results[args.workers])
    ratios = [b / a for a, b in zip(results[1], results[args.workers])]
    print(f"METRIC streaming_tokens_per_s_1_worker {one:.0f}  (blocks of {args.block_length}, batch {args.batch_size})")
    print(f"METRIC streaming_tokens_per_s_{args.workers}_workers {many:.0f}")
    print(f"METRIC streaming_workers_for_800k_tokens_per_s {math.ceil(GPU_TOKENS_PER_S / one)}  (at {one:.0f} "
          "tokens/s per worker, with a core each)")
    print(f"METRIC streaming_N_vs_1_workers_per_round {' '.join(f'{r:.3f}' for r in ratios)}")
    print(f"METRIC streaming_cpu_cores {os.cpu_count()}  (load average over the last minute at the end: "
          f"{os.getloadavg()[0]:.1f}; N workers need N free cores)")
    print(f"RATIO streaming_N_vs_1_workers {statistics.median(ratios):.3f} target >={0.75 * args.workers:g}")


if __name__ == "__main__":
    main()
