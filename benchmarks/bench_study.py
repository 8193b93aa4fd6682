"""The study's comparison of n seeds x arms against n x arms single-run trajectory passes, side by side in one process
(issue 27): seeds multiply training, not the comparison's set-up. Target: at most 10% more.

    python benchmarks/bench_study.py            # 4 arms x 3 seeds x 11 checkpoints of the study's model, 500 sentences
    python benchmarks/bench_study.py --quick    # 4 arms x 3 seeds x 4 checkpoints, 200 sentences
    python benchmarks/bench_study.py --smoke    # 2 arms x 2 seeds x 2 checkpoints of a 2-layer model, 30 sentences

The runs are checkpoints written as train.py writes them (hyper-parameters, `model.` weights, global_step, the
tokenizer embedded), each with its own random weights, in <arm>/seed<k>/checkpoints. Baseline: the n x arms
trajectory passes as `analyze.py trajectory --run A --run B ...` makes them (compare_runs: every run on the same
sentences, one JSON, one figure), in this process. Study: the study's comparison of the same runs
(analyses/study_report.py: the same trajectory passes, then the Gaussian null's samples, the statistics across seeds,
the verdicts, study.json and study.png). Rounds alternate the two; the ratio is the median of the rounds' ratios of
CPU time (the machine is shared). Output: `RATIO study_comparison_vs_trajectories <value> target <=1.10`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_trajectory import tokenizer  # noqa: E402  (the same small BPE)

# hidden, layers, heads, intermediate; arms, seeds, checkpoints per run, sentences, rounds
SIZES = {"full": ((128, 4, 4, 512), 4, 3, 11, 500, 2), "quick": ((128, 4, 4, 512), 4, 3, 4, 200, 2),
         "smoke": ((64, 2, 4, 128), 2, 2, 2, 30, 1)}


def write_runs(folder: Path, size: str) -> list[tuple[str, int, str]]:
    import torch

    from core.tokenizers import tokenizer_files
    from lightning_modules.mlm import build_model

    (hidden, layers, heads, intermediate), arms, seeds, checkpoints, _, _ = SIZES[size]
    tok = tokenizer(folder / "tokenizer")
    hparams = {"vocab_size": len(tok), "hidden_size": hidden, "num_hidden_layers": layers,
               "num_attention_heads": heads, "intermediate_size": intermediate, "max_position_embeddings": 66,
               "position_embeddings": True, "pad_vocab_to_multiple_of": 1}
    runs = []
    for arm in range(arms):
        for seed in range(seeds):
            run = folder / f"arm{arm}" / f"seed{seed}"
            (run / "checkpoints").mkdir(parents=True)
            for index in range(checkpoints):
                torch.manual_seed(1000 * arm + 100 * seed + index)
                model = build_model(len(tok), hidden, layers, heads, intermediate, 66, dropout=0.0,
                                    position_embeddings=True)
                step = 100 * index
                torch.save({"state_dict": {f"model.{key}": value for key, value in model.state_dict().items()},
                            "hyper_parameters": hparams, "global_step": step,
                            "MLMDataModule": {"tokenizer_files": tokenizer_files(tok)}},
                           run / "checkpoints" / f"epoch=0-step={step}.ckpt")
            runs.append((f"arm{arm}", seed, str(run)))
    return runs


def trajectory_args(run: str, data: Path, sentences: int, output: Path):
    import analyze

    args = analyze.build_parser().parse_args(["trajectory", "--run", run, "--data", str(data), "--max_sentences",
                                              str(sentences), "--output_dir", str(output), "--no_progress",
                                              "--device", "cpu"])
    analyze.validate(args)
    return args


def cpu_seconds(work) -> float:
    """CPU seconds of `work()`, its tables and "wrote" lines kept off the terminal (both sides print theirs)."""
    start = time.process_time()
    with contextlib.redirect_stdout(io.StringIO()):
        work()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="smallest sizes (tests)")
    args = parser.parse_args()
    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    _, arms, seeds, checkpoints, sentences, rounds = SIZES[size]

    from analyses.study_report import compare_study
    from analyses.trajectory import compare_runs
    from core.errors import plain_warnings
    from datamodules.text import DEFAULT_CORPUS

    plain_warnings()
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        runs = write_runs(folder / "runs", size)
        data = folder / "sentences.txt"
        lines = [line for line in DEFAULT_CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()]
        data.write_text("\n".join(lines[2000:2000 + sentences]) + "\n", encoding="utf-8")

        def singles(index: int) -> None:
            output = folder / f"trajectories{index}"
            compare_runs(trajectory_args(runs[0][2], data, sentences, output),
                         [(f"{arm}/seed{seed}", run) for arm, seed, run in runs], str(output))

        def study(index: int) -> None:
            compare_study(trajectory_args(runs[0][2], data, sentences, folder / f"study{index}"), runs,
                          str(folder / f"study{index}"), {"gaussian_samples": 3, "margin": 0.5})

        ratios = []
        for index in range(rounds):
            single = cpu_seconds(lambda index=index: singles(index))
            together = cpu_seconds(lambda index=index: study(index))
            ratios.append(together / single)
            print(f"round {index + 1}: {len(runs)} runs' trajectories {single:.1f} s CPU, the study's comparison "
                  f"{together:.1f} s CPU: {together / single:.3f}", flush=True)
    print(f"{arms} arms x {seeds} seeds x {checkpoints} checkpoints, {sentences} sentences, 3 Gaussian samples")
    print(f"METRIC study_comparison_vs_trajectories_per_round {' '.join(f'{r:.3f}' for r in ratios)}")
    print(f"RATIO study_comparison_vs_trajectories {statistics.median(ratios):.3f} target <=1.10", flush=True)


if __name__ == "__main__":
    main()
