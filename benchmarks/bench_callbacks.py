"""Cost of the live statistics: training time with OutlierStatistics + ContributionVectors + AttentionGeometry at
their default cadence against the same training without them, side by side in one run, W&B offline and W&B disabled
(issues 5, 15 and 29).

    python benchmarks/bench_callbacks.py               # configs/pretrain/tiny.yaml's model and data
    python benchmarks/bench_callbacks.py --max_rounds 40 --margin 0.02   # settle tighter
    python benchmarks/bench_callbacks.py --quick       # a 2-layer, 32-dim model on 400 lines, fewer rounds
    python benchmarks/bench_callbacks.py --smoke       # the same on 200 lines, 2 rounds of 4-step windows (tests)

One training run per W&B mode (offline, then disabled), each alternating windows with the callbacks on and off inside
the same process, so both arms share the model, the data, the allocator and the machine's load of that minute.
A window is `every_n_steps` (100) optimizer steps from a capture step; a round is four windows: two with the
callbacks (two captures, the first with every image: 5x the default image rate of one per 1000
steps, so an upper bound) and two without (no capture: the callbacks' hooks return at once), the pair that goes first
alternating between rounds. Step 0 and its window (the one-time set-up) are left out. Per window: wall time, the
process's CPU time (every thread) and the CPU time of its child processes (W&B's wandb-core writes the offline log
there; psutil), so that work moved off the main thread or to W&B's process is still counted.

The ratio of a round is (CPU time with) / (CPU time without), process + children: CPU time counts the work done
whatever the other jobs on the machine are doing, where wall time on a shared machine moves with them (printed
beside it). The reported ratio is the median over rounds; its spread is the half-width of the distribution-free 95%
confidence interval of that median (order statistics of the rounds' ratios). Rounds go on until the spread is below
--margin (default the target's: 1.03 - 1 = 0.03) or --max_rounds is reached (then the line says "not settled").
Weighting the same windows as the default cadence takes them (one image window and nine plain ones per
ten) gives the ratio at the default cadence (`_default_cadence`, with its spread: noisier, a plain window counts 9x).
The load average is printed before and after. Output: `RATIO callback_overhead <value> target <=1.03` (W&B offline,
train.py's default) and `RATIO callback_overhead_wandb_disabled ...`, METRIC lines with the spreads and the rounds.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_SILENT", "true")

import psutil  # noqa: E402
import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from callbacks.live import LiveCallback  # noqa: E402
from callbacks.outlier_statistics import OutlierStatistics  # noqa: E402
from callbacks.wandb_logging import use_root_dir  # noqa: E402
from datamodules.mlm import MLMDataModule  # noqa: E402
from lightning_modules.mlm import MLMModule  # noqa: E402

DEFAULTS = {name: p.default for name, p in inspect.signature(OutlierStatistics.__init__).parameters.items()}
TARGET = 1.03
QUICK = {"model": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
                   "max_position_embeddings": 34},
         "data": {"vocab_size": 600, "block_length": 32, "batch_size": 8, "global_batch_size": 8, "max_texts": 400}}


def cpu_now() -> tuple[float, float, float]:
    """(wall, this process's CPU time over all its threads, its children's CPU time) in seconds."""
    children = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
            children += times.user + times.system
        except psutil.Error:  # ended in between
            pass
    return time.perf_counter(), time.process_time(), children


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """The distribution-free confidence interval of the median: order statistics (k, n + 1 - k) of the sorted values
    with the largest k whose binomial(n, 1/2) coverage is at least `level` ((-inf, inf) when n is too small)."""
    n, ordered = len(values), sorted(values)
    best = None
    for k in range(1, n // 2 + 1):
        coverage = 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n
        if coverage >= level:
            best = k
    return (ordered[best - 1], ordered[n - best]) if best else (-math.inf, math.inf)


class Alternator(pl.Callback):
    """Gates the live callbacks window by window and times each window (listed first, so that its hooks run before
    theirs): captures happen only in `on` windows, images only at the first capture of a round."""

    def __init__(self, every: int, live: list[LiveCallback], margin: float, min_rounds: int, max_rounds: int,
                 label: str) -> None:
        self.every, self.live, self.margin, self.label = every, live, margin, label
        self.min_rounds, self.max_rounds = min_rounds, max_rounds
        self.marks: dict[int, tuple[float, float, float]] = {}  # window start step -> cpu_now()
        self.rounds: list[dict] = []
        for callback in live:
            self._gate(callback)

    def window(self, step: int) -> tuple[int, int]:
        """(round, window 0..3 within it) of the window holding `step`; windows start at every_n_steps."""
        index = step // self.every - 1
        return index // 4, index % 4

    def on(self, step: int) -> bool:
        round_, window = self.window(step)
        return step >= self.every and (window < 2) == (round_ % 2 == 0)

    def _gate(self, callback: LiveCallback) -> None:
        start = callback.on_train_batch_start

        def gated(trainer, pl_module, batch, batch_idx):
            if self.on(trainer.global_step):
                start(trainer, pl_module, batch, batch_idx)

        callback.on_train_batch_start = gated
        callback.due_images = lambda step: self.on(step) and self.window(step)[1] in (0, 2)  # a round's first capture

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step
        if step % self.every or step < self.every or step in self.marks:
            return
        self.marks[step] = cpu_now()
        round_, window = self.window(step)
        if window == 0 and round_ > 0:  # round_ - 1 is complete
            self.close_round(round_ - 1, trainer)

    def close_round(self, round_: int, trainer) -> None:
        first = self.every * (1 + 4 * round_)
        marks = [self.marks[first + i * self.every] for i in range(5)]
        spans = [[b - a for a, b in zip(marks[i], marks[i + 1])] for i in range(4)]  # [wall, process, children]
        on = [sum(spans[i][k] for i in range(4) if self.on(first + i * self.every)) for k in range(3)]
        off = [sum(spans[i][k] for i in range(4) if not self.on(first + i * self.every)) for k in range(3)]
        cpu = [spans[i][1] + spans[i][2] for i in range(4)]  # the image window comes first of its pair
        image, plain = (cpu[0], cpu[1]) if self.on(first) else (cpu[2], cpu[3])
        # the default cadence (images at every 10th capture): 1 image window and 9 plain ones per 10 windows
        default = (image + 9 * plain) / (5 * (off[1] + off[2]))
        self.rounds.append({"on": on, "off": off, "ratio": (on[1] + on[2]) / (off[1] + off[2]),
                            "wall_ratio": on[0] / off[0], "default": default, "windows": cpu})
        last = self.rounds[-1]
        low, high = median_interval([r["ratio"] for r in self.rounds])
        print(f"{self.label} round {round_}: with {on[1]:6.2f} s + {on[2]:5.2f} s W&B process, without "
              f"{off[1]:6.2f} s + {off[2]:5.2f} s CPU  ratio {last['ratio']:.3f}  (wall {on[0]:6.1f} / {off[0]:6.1f} s"
              f" = {last['wall_ratio']:.3f})  median so far {statistics.median(r['ratio'] for r in self.rounds):.3f}"
              f" [{low:.3f}, {high:.3f}]; windows {' '.join(f'{c:.2f}' for c in cpu)} s, default cadence "
              f"{default:.3f}", flush=True)
        settled = len(self.rounds) >= self.min_rounds and (high - low) / 2 < self.margin
        if settled or len(self.rounds) >= self.max_rounds:
            trainer.should_stop = True


def load_config(path: Path, quick: bool) -> dict:
    config = yaml.safe_load(path.read_text())
    if quick:
        for section, values in QUICK.items():
            config[section].update(values)
    return config


def run(config_path: Path, config: dict, root: Path, cache: Path, every: int, args, label: str) -> Alternator:
    import train

    warnings.filterwarnings("ignore", "LightningCLI's args parameter")
    steps = every * (1 + 4 * args.max_rounds) + 1
    callbacks = [{"class_path": f"callbacks.{module}.{name}",
                  "init_args": {"every_n_steps": every, "image_every_n_steps": 2 * every}}
                 for module, name in (("outlier_statistics", "OutlierStatistics"),
                                      ("contribution_vectors", "ContributionVectors"),
                                      ("attention_geometry", "AttentionGeometry"))]
    cli_args = ["--config", str(config_path), "--seed_everything", "0", "--data.cache_dir", str(cache),
                "--trainer.default_root_dir", str(root), "--trainer.max_steps", str(steps),
                "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
                "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
                "--checkpoint.every_n_train_steps", "100000000", "--model.decay_steps", str(steps),
                "--trainer.callbacks", json.dumps(callbacks)]
    for section in ("model", "data"):
        for key, value in config[section].items():
            cli_args += [f"--{section}.{key}", json.dumps(value) if isinstance(value, list) else str(value)]
    cli = train.PretrainCLI(MLMModule, MLMDataModule, run=False, seed_everything_default=0,
                            trainer_defaults=train.TRAINER_DEFAULTS, save_config_kwargs={"overwrite": True},
                            args=cli_args)
    live = [callback for callback in cli.trainer.callbacks if isinstance(callback, LiveCallback)]
    alternator = Alternator(every, live, args.margin, args.min_rounds, args.max_rounds, label)
    cli.trainer.callbacks.insert(0, alternator)
    cli.model.on_fit_end = lambda: None  # no export in a timing run
    use_root_dir(cli.trainer)  # W&B files under the run directory, as train.py does
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return alternator


def report(name: str, alternator: Alternator, margin: float) -> None:
    ratios = [r["ratio"] for r in alternator.rounds]
    walls = [r["wall_ratio"] for r in alternator.rounds]
    low, high = median_interval(ratios)
    spread = (high - low) / 2
    print(f"METRIC {name}_per_round {' '.join(f'{r:.3f}' for r in ratios)}")
    print(f"METRIC {name}_wall_per_round {' '.join(f'{r:.3f}' for r in walls)}")
    print(f"METRIC {name}_spread {spread:.4f}  (half-width of the 95% interval of the median, {len(ratios)} rounds; "
          f"{'settled' if spread < margin else 'not settled'}: margin {margin:g})")
    print(f"METRIC {name}_wall {statistics.median(walls):.3f}  (median of the rounds' wall-time ratios)")
    defaults = [r["default"] for r in alternator.rounds]
    low, high = median_interval(defaults)
    print(f"METRIC {name}_default_cadence {statistics.median(defaults):.3f}  (the same windows weighted to images at "
          f"every 10th capture; spread {(high - low) / 2:.3f})")
    with_ = statistics.median(sum(r["on"][1:]) for r in alternator.rounds) / (2 * alternator.every)
    without = statistics.median(sum(r["off"][1:]) for r in alternator.rounds) / (2 * alternator.every)
    print(f"METRIC {name}_step_cpu_s {without:.4f}  (with the callbacks {with_:.4f}; median per step)")
    print(f"RATIO {name} {statistics.median(ratios):.3f} target <={TARGET}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--config", default=str(ROOT / "configs" / "pretrain" / "tiny.yaml"))
    parser.add_argument("--quick", action="store_true", help="small model and corpus, windows of 20 steps (tests)")
    parser.add_argument("--smoke", action="store_true", help="smallest: windows of 4 steps, 2 rounds (tests)")
    parser.add_argument("--margin", type=float, default=TARGET - 1,
                        help="stop once the ratio's spread is below this (default 0.03: the target's margin)")
    parser.add_argument("--min_rounds", type=int, default=6, help="rounds before the spread may stop it (default 6)")
    parser.add_argument("--max_rounds", type=int, default=24, help="rounds at most per W&B mode (default 24)")
    parser.add_argument("--modes", default="offline,disabled", help="W&B modes, in order (default offline,disabled)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1 keeps timings stable; 0: default)")
    args = parser.parse_args()
    for name in ("pytorch_lightning", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    every = DEFAULTS["every_n_steps"]
    if args.smoke:
        every, args.min_rounds, args.max_rounds = 4, 2, 2
    elif args.quick:
        every, args.min_rounds, args.max_rounds = 20, 4, 6
    if args.threads:
        torch.set_num_threads(args.threads)
    config_path = Path(args.config)
    config = load_config(config_path, args.quick or args.smoke)
    print(f"METRIC load_average_start {os.getloadavg()[0]:.2f}  ({os.cpu_count()} CPUs; 1, 5, 15 min: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())})")
    print(f"METRIC cadence every_n_steps {every}, images at every 2nd capture (defaults {DEFAULTS['every_n_steps']} / "
          f"{DEFAULTS['image_every_n_steps']}), {torch.get_num_threads()} thread(s)", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.quick or args.smoke:
            corpus = tmp / "corpus.txt"
            with open(ROOT / "core" / "corpus" / "austen.txt", encoding="utf-8") as handle:
                corpus.write_text("".join(handle.readlines()[:200 if args.smoke else 400]), encoding="utf-8")
            config["data"]["corpus"] = str(corpus)
        for mode in args.modes.split(","):
            os.environ["WANDB_MODE"] = mode
            results[mode] = run(config_path, config, tmp / mode, tmp / "cache", every, args, f"W&B {mode}")
    print(f"METRIC load_average_end {os.getloadavg()[0]:.2f}  (1, 5, 15 min: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())})")
    for mode, alternator in results.items():
        report("callback_overhead" if mode == "offline" else f"callback_overhead_wandb_{mode}", alternator, args.margin)


if __name__ == "__main__":
    main()
