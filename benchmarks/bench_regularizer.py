"""Cost of the I-STAR regulariser: training step time with I-STAR against without, side by side in one run, on the tiny
MLM config and on MiniLM fine-tuning; and C0's pass (once an epoch) as a share of the epoch (issue 14).

    python benchmarks/bench_regularizer.py             # tiny MLM (configs/pretrain/tiny.yaml), MiniLM fine-tuning
                                                       # (configs/finetune/classify.yaml on 4000 labelled corpus lines)
    python benchmarks/bench_regularizer.py --quick     # fewer steps and rounds
    python benchmarks/bench_regularizer.py --smoke     # a 2-layer MLM and a tiny BERT, 2 timed steps (tests)

Each round trains each model twice from the same seed, with `--model.regularizer istar --model.reg_weight 0.5` (every
layer 1..L, zeta 0.2) and without, alternating which goes first; timed: optimizer steps 1..--steps (step 0 holds the
one-time set-up and C0's pass, which the C0 ratio measures on its own, in the first regularised run; the later ones
keep it to 2000 tokens). The step ratio is the median over rounds of the paired per-round ratio of wall times. C0's share: the time of its pass at the epoch's start (eval mode,
up to 250k training tokens: here the whole 3200-example training split) over that plus an epoch of the regularised
run's measured steps (100 steps of 32). One intra-op thread by default. Output: `RATIO istar_step_time_tiny_mlm`,
`RATIO istar_step_time_minilm_finetune` (target <= 1.15 each) and `RATIO c0_share_of_epoch_minilm` (target <= 0.35:
C0 is one forward pass over at most the epoch's own tokens, about a third of the epoch's forward and backward), with
METRIC lines: the projected share for an SST-2-sized epoch (60,614 examples).
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["WANDB_MODE"] = "offline"
os.environ.setdefault("WANDB_SILENT", "true")

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from bench_callbacks import QUICK  # noqa: E402

from lightning_modules.training import TrainingModule  # noqa: E402

ISTAR = ["--model.regularizer", "istar", "--model.reg_weight", "0.5"]


class ShrinkageTimer:
    """Wall time of every C0 pass that computed (TrainingModule.refresh_shrinkage), patched in for the run."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.tokens = 0
        self.original = TrainingModule.refresh_shrinkage

    def __enter__(self) -> ShrinkageTimer:
        timer = self

        def timed(module) -> None:
            before = module.regularizer.shrinkage
            start = time.perf_counter()
            timer.original(module)
            if module.regularizer.shrinkage is not before:
                timer.seconds.append(time.perf_counter() - start)
                timer.tokens = module.regularizer.shrinkage_tokens_used
        TrainingModule.refresh_shrinkage = timed
        return self

    def __exit__(self, *exc) -> None:
        TrainingModule.refresh_shrinkage = self.original


class WindowTimer(pl.Callback):
    """Wall and process CPU time from the start of optimizer step `start` to the end of step `start + steps - 1`
    (callbacks included: this one is appended last)."""

    def __init__(self, start: int, steps: int) -> None:
        self.start, self.stop = start, start + steps
        self.wall = self.cpu = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.start and self.wall is None:
            self.wall, self.cpu = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.stop and isinstance(self.wall, float) and not hasattr(self, "wall_s"):
            self.wall_s, self.cpu_s = time.perf_counter() - self.wall, time.process_time() - self.cpu


def fit(args: list[str], steps: int, start: int = 1) -> tuple[WindowTimer, ShrinkageTimer]:
    """train.py's CLI without running it (the finetune or the pretraining one, as the arguments say), then fit with a
    timer of steps start..start+steps-1; no export, no logger."""
    import train
    from callbacks.wandb_logging import use_root_dir

    warnings.filterwarnings("ignore", "LightningCLI's args parameter")
    args = [*args, "--trainer.max_steps", str(start + steps), "--model.decay_steps", str(start + steps),
            "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0", "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--checkpoint.every_n_train_steps", "100000000", "--trainer.callbacks", "[]"]
    finetune = (train.model_class_path(args) or "").endswith("FineTuneModule")
    cli_class, classes = (train.FineTuneCLI, (train.FineTuneModule, train.FineTuneDataModule)) if finetune else \
        (train.PretrainCLI, (train.MLMModule, train.MLMDataModule))
    options = {"subclass_mode_model": True, "subclass_mode_data": True} if finetune else {}
    cli = cli_class(*classes, run=False, seed_everything_default=0, trainer_defaults=train.TRAINER_DEFAULTS,
                    save_config_kwargs={"overwrite": True}, args=args, **options)
    timer = WindowTimer(start, steps)
    cli.trainer.callbacks.append(timer)
    cli.model.on_fit_end = lambda: None  # no export or evaluation in a timing run
    use_root_dir(cli.trainer)
    with ShrinkageTimer() as shrinkage:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return timer, shrinkage


def mlm_args(root: Path, cache: Path, small: dict | None, corpus: Path | None) -> list[str]:
    args = ["--config", str(ROOT / "configs" / "pretrain" / "tiny.yaml"), "--seed_everything", "0",
            "--data.cache_dir", str(cache), "--trainer.default_root_dir", str(root)]
    for section, values in (small or {}).items():
        args += [item for key, value in values.items() for item in (f"--{section}.{key}", str(value))]
    return args + (["--data.corpus", str(corpus)] if corpus else [])


def finetune_args(root: Path, data: Path, encoder: str | None, smoke: bool) -> list[str]:
    args = ["--config", str(ROOT / "configs" / "finetune" / "classify.yaml"), "--data.source", str(data),
            "--trainer.default_root_dir", str(root)]
    if encoder:
        args += ["--model.encoder", encoder]
    return args + (["--data.max_length", "32", "--data.batch_size", "8"] if smoke else [])


def labelled_file(path: Path, lines: int) -> Path:
    """Corpus lines labelled dialogue (a quotation mark) or narration, as in docs/finetuning.md's example."""
    texts = [line.strip() for line in open(ROOT / "core" / "corpus" / "austen.txt", encoding="utf-8") if line.strip()]
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text", "label"])
        for text in random.Random(0).sample(texts, lines):
            writer.writerow([text, "dialogue" if '"' in text else "narration"])
    return path


def compare(name: str, make_args, steps: int, rounds: int) -> tuple[float, dict]:
    results: dict[bool, list] = {True: [], False: []}
    for round_ in range(rounds):
        for istar in ((True, False) if round_ % 2 == 0 else (False, True)):
            # C0's pass is timed in the first regularised run; the others keep it short (step 0 is not timed)
            cheap = ["--model.reg_shrinkage_tokens", "2000"] if istar and results[True] else []
            timer, c0 = fit(make_args(f"{istar}-{round_}") + (ISTAR + cheap if istar else []), steps)
            results[istar].append((timer, c0))
            print(f"{name} round {round_}: {'with' if istar else 'without':>7} I-STAR  {timer.wall_s:8.2f} s wall  "
                  f"{timer.cpu_s:8.2f} s CPU" + (f"  C0 {c0.seconds[0]:.2f} s ({c0.tokens} tokens)" if c0.seconds
                                                  and not cheap else ""), flush=True)
    ratios = [a.wall_s / b.wall_s for (a, _), (b, _) in zip(results[True], results[False])]
    print(f"METRIC {name}_per_round {' '.join(f'{r:.3f}' for r in ratios)}")
    step = statistics.median(t.wall_s for t, _ in results[True]) / steps
    first = results[True][0][1]
    return statistics.median(ratios), {"step_s": step, "c0_s": first.seconds[0], "c0_tokens": first.tokens}


def rotated_rounds(arms: tuple[str, ...], extra_args, args) -> tuple[dict, dict, dict | None]:
    """Every arm (train.py's tiny MLM config plus `extra_args(arm)`) trained `args.steps` timed steps in each of
    `args.rounds` rounds, the arms' order rotating with the round (bench_attention's and bench_arms' comparisons):
    wall and CPU seconds per arm and round, and the small sizes used with --smoke (None otherwise)."""
    walls: dict[str, list[float]] = {arm: [] for arm in arms}
    cpus: dict[str, list[float]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus, small = None, None
        if args.smoke:
            corpus = tmp / "corpus.txt"
            corpus.write_text("".join(open(ROOT / "core" / "corpus" / "austen.txt", encoding="utf-8").readlines()[:200]))
            small = {"model": QUICK["model"], "data": QUICK["data"]}
        for round_ in range(args.rounds):
            shift = round_ % len(arms)
            for arm in arms[shift:] + arms[:shift]:
                timer, _ = fit(mlm_args(tmp / f"{arm}-{round_}", tmp / "cache", small, corpus) + extra_args(arm),
                               args.steps)
                walls[arm].append(timer.wall_s)
                cpus[arm].append(timer.cpu_s)
                print(f"round {round_}: {arm:>15}  {timer.wall_s:8.2f} s wall  {timer.cpu_s:8.2f} s CPU  "
                      f"({timer.wall_s / args.steps * 1000:.1f} ms a step)", flush=True)
    return walls, cpus, small


def step_timing_options(description: str, rounds: int, steps_help: str, quick_rounds: int):
    """The paired step-time benchmarks' options (this script's and bench_attention's), parsed and applied: quieter
    Lightning, --quick / --smoke sizes, the thread count."""
    parser = argparse.ArgumentParser(description=description, allow_abbrev=False)
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    parser.add_argument("--smoke", action="store_true", help="smallest models, 2 timed steps (tests/test_bench.py)")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--steps", type=int, default=30, help=steps_help)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1 keeps timings stable; 0: default)")
    args = parser.parse_args()
    for name in ("pytorch_lightning", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if args.quick or args.smoke:
        args.rounds, args.steps = (1, 2) if args.smoke else (quick_rounds, 15)
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def main() -> None:
    args = step_timing_options(__doc__.split("\n\n")[0], rounds=3, quick_rounds=2,
                               steps_help="timed steps of the tiny MLM (MiniLM: a third)")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus, small, encoder = None, None, None
        if args.smoke:
            from tests.tiny import bert_tokenizer, save_tiny_encoder

            corpus = tmp / "corpus.txt"
            corpus.write_text("".join(open(ROOT / "core" / "corpus" / "austen.txt", encoding="utf-8").readlines()[:200]))
            small = {"model": QUICK["model"], "data": QUICK["data"]}
            encoder = str(save_tiny_encoder(tmp / "bert", "bert", bert_tokenizer(tmp / "tokenizer")))
        mlm, _ = compare("istar_step_time_tiny_mlm",  # named as its RATIO line: METRIC <name>_per_round
                         lambda tag: mlm_args(tmp / f"mlm-{tag}", tmp / "cache", small, corpus), args.steps, args.rounds)
        data = labelled_file(tmp / "labelled.csv", 400 if args.smoke else 4000)
        minilm_steps = max(2, args.steps // 3)
        finetune, measured = compare("istar_step_time_minilm_finetune",
                                     lambda tag: finetune_args(tmp / f"ft-{tag}", data, encoder, args.smoke),
                                     minilm_steps, args.rounds)
    epoch_steps = (320 if args.smoke else 3200) // (8 if args.smoke else 32)
    share = measured["c0_s"] / (measured["c0_s"] + epoch_steps * measured["step_s"])
    # SST-2 (60,614 training sentences, ~13 tokens each): C0 reads its cap of 250k tokens
    sst2_c0 = measured["c0_s"] * 250_000 / max(measured["c0_tokens"], 1)
    sst2 = sst2_c0 / (sst2_c0 + 60614 // 32 * measured["step_s"])
    print(f"METRIC c0_pass_s {measured['c0_s']:.2f}  ({measured['c0_tokens']} tokens: the whole training split, under "
          "the 250k cap)")
    print(f"METRIC regularised_step_s {measured['step_s']:.3f}  ({epoch_steps} steps an epoch)")
    print(f"METRIC c0_share_of_epoch_sst2_size {sst2:.3f}  (projected: 250k tokens against {60614 // 32} steps of "
          "this step time)")
    print(f"RATIO istar_step_time_tiny_mlm {mlm:.3f} target <=1.15")
    print(f"RATIO istar_step_time_minilm_finetune {finetune:.3f} target <=1.15")
    print(f"RATIO c0_share_of_epoch_minilm {share:.3f} target <=0.35")


if __name__ == "__main__":
    main()
