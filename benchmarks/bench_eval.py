"""Peak memory of every evaluation at 1x and 10x data, side by side in one run (issue 6's streaming target).

    python benchmarks/bench_eval.py            # packaged MiniLM: 320 vs 3200 sentences, 64 vs 640 pairs
    python benchmarks/bench_eval.py --quick    # smaller
    python benchmarks/bench_eval.py --smoke    # anisotropy only, smallest (the test suite runs this)
    python benchmarks/bench_eval.py --quick --only self_similarity   # one evaluation

Each evaluation runs as `analyze.py <command>` in a fresh process on 1x and on 10x data (the 1x content repeated, so
sentence lengths, and with them the largest batch, are the same), with a fixed glibc mmap threshold (as
benchmarks/bench_outliers.py) so the peak resident set measures live memory, not heap fragmentation.
Its memory must not grow with the data beyond what its protocol samples, so the 10x peak must stay within 1.1x:
- anisotropy, isotropy: every sentence is encoded (--max_sentences 0) for the outlier statistics and the
  covariance, which stream; the token sample is fixed by the protocol (--num_pairs);
- self-similarity: the words are drawn from the whole file (--max_sentences 0, the default: three streamed passes),
  10x larger, and the contexts are fixed by the protocol (--num_words x --min_sentences);
- wic, sts: every pair is scored; the protocol keeps one cosine per pair and layer (8 bytes each), so those
  grow by design but stay far below the model's own memory.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WIC_WORDS = [("bank", "He sat on the {} of the river.", "She deposited money at the {}."),
             ("play", "The children {} in the garden.", "We saw a {} at the theatre."),
             ("light", "Turn on the {}, please.", "The box was {} enough to carry."),
             ("spring", "Flowers bloom in {}.", "The {} in the mattress broke.")]


def sentences(count: int) -> list[str]:
    from datamodules.text import DEFAULT_CORPUS

    lines = [line.strip() for line in DEFAULT_CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [lines[i % len(lines)].replace('"', "'") for i in range(count)]


def write_data(folder: Path, scale: int, base: int, pairs: int, pool: int) -> dict[str, Path]:
    """Sentence, pool, WiC and STS files: the 1x content repeated `scale` times, so the 10x data has the same
    sentence lengths (the same largest batch) and only its volume differs."""
    rng = random.Random(0)
    paths = {name: folder / f"{name}-{scale}x{suffix}" for name, suffix in
             (("sentences", ".txt"), ("pool", ".txt"), ("wic", ".jsonl"), ("sts", ".tsv"))}
    paths["sentences"].write_text("\n".join(sentences(base) * scale) + "\n", encoding="utf-8")
    paths["pool"].write_text("\n".join(sentences(pool) * scale) + "\n", encoding="utf-8")
    corpus = sentences(4 * pairs)
    rows = []
    for index in range(pairs):
        word, one, two = WIC_WORDS[index % len(WIC_WORDS)]
        s1, s2 = f"{corpus[2 * index][:80]} {one.format(word)}", f"{two.format(word)} {corpus[2 * index + 1][:80]}"
        start1, start2 = s1.rindex(word), s2.index(word)
        rows.append({"word": word, "sentence1": s1, "sentence2": s2, "start1": start1, "end1": start1 + len(word),
                     "start2": start2, "end2": start2 + len(word), "label": index % 3 == 0})
    paths["wic"].write_text("".join(json.dumps(row) + "\n" for row in rows * scale), encoding="utf-8")
    sts = [f"{corpus[2 * i][:120]}\t{corpus[2 * i + 1][:120]}\t{rng.uniform(0, 5):.2f}" for i in range(pairs)]
    paths["sts"].write_text("sentence1\tsentence2\tscore\n" + "\n".join(sts * scale) + "\n", encoding="utf-8")
    return paths


def commands(paths: dict[str, Path], quick: bool) -> dict[str, list[str]]:
    num_pairs, words = ("20", ["--num_words", "20", "--min_sentences", "3"]) if quick else (
        "100", ["--num_words", "100", "--min_sentences", "5"])
    return {
        # Every batch of these is full (most sentences reach 24 tokens), so the densest batch, and with it the
        # token-sized temporaries of the statistics, is the same at 1x and 10x: only accumulation would show.
        "anisotropy": ["anisotropy", "--data", str(paths["sentences"]), "--max_sentences", "0",
                       "--num_pairs", num_pairs, "--max_length", "24"],
        "isotropy": ["isotropy", "--data", str(paths["sentences"]), "--max_sentences", "0", "--num_pairs", num_pairs,
                     "--normalize", "whiten", "--max_length", "24"],
        "self_similarity": ["self-similarity", "--data", str(paths["pool"]), "--max_sentences", "0", *words,
                            "--max_length", "128"],
        "wic": ["wic", "--data", str(paths["wic"]), "--max_length", "128"],
        "sts": ["sts", "--data", str(paths["sts"]), "--max_length", "128"],
    }


def child(argv: list[str]) -> None:
    """One evaluation; prints its peak RSS (MiB) as JSON."""
    import torch

    import analyze

    torch.set_num_threads(1)
    code = analyze.main(argv)
    if code:
        raise SystemExit(code)
    print(json.dumps({"peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def analyze_peak_mib(argv: list[str]) -> float:
    """`analyze.py argv` in a fresh process (this script's --child): its peak RSS in MiB."""
    command = [sys.executable, __file__, "--child", "--", *argv]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    if done.returncode:
        raise SystemExit(f"{argv[0]} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_mib"]


def peak(argv: list[str], encoder: str, output: Path) -> float:
    return analyze_peak_mib([*argv, "--encoder", encoder, "--output_dir", str(output), "--no_progress", "--batch_size",
                             "32"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="anisotropy only, smallest sizes (tests)")
    parser.add_argument("--only", default=None, help="one evaluation (anisotropy, isotropy, self_similarity, wic, sts)")
    parser.add_argument("--encoder", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.child:
        return child([a for a in rest if a != "--"])
    if rest:  # only a child takes the analyze.py arguments after its --child
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    from lightning_modules.encoder import default_encoder

    encoder = args.encoder or default_encoder()
    # Whole batches of 32 at 1x too: a short last batch would make the 1x peak activation smaller than 10x's.
    base, pairs, pool = (32, 16, 100) if args.smoke else (64, 32, 400) if args.quick else (320, 64, 2000)
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        data = {scale: write_data(folder, scale, base, pairs, pool) for scale in (1, 10)}
        runs = {scale: commands(data[scale], args.quick or args.smoke) for scale in (1, 10)}
        for name in ([args.only] if args.only else ["anisotropy"] if args.smoke else runs[1]):
            small = peak(runs[1][name], encoder, folder / f"{name}-1x")
            large = peak(runs[10][name], encoder, folder / f"{name}-10x")
            print(f"{name}: 1x peak {small:.0f} MiB, 10x peak {large:.0f} MiB")
            print(f"RATIO eval_{name}_peak_memory_10x {large / small:.3f} target <=1.10", flush=True)


if __name__ == "__main__":
    main()
