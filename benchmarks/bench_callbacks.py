"""Cost of the live statistics: training step time with OutlierStatistics + ContributionVectors + AttentionGeometry at
their default cadence against the same training without them, side by side in one run (issues 5 and 15).

    python benchmarks/bench_callbacks.py               # configs/pretrain/tiny.yaml's model and data, W&B offline
    python benchmarks/bench_callbacks.py --steps 1000  # the exact default cadence over a whole image period (slow)
    python benchmarks/bench_callbacks.py --quick       # a 2-layer, 32-dim model on 400 lines, for the test suite
    python benchmarks/bench_callbacks.py --smoke       # the same on 200 lines, one round of 4 steps (tests)

Each round trains the model twice from the same seed, with and without the three callbacks, alternating which goes
first; both log to an offline W&B run (scalars, images, the outlier table). Timed: optimizer steps 1..--steps (step 0, with
its one-time set-up, is left out: a real run amortises it over 200k steps). Captures run at the classes' default
every_n_steps (100); one image step closes the window (image_every_n_steps = --steps): with the default --steps 200
that is 5x more images than the default 1000 asks for, so the ratio is an upper bound of the default cadence's;
`--steps 1000` measures the default exactly. The ratio is the median over rounds of the paired per-round ratio of
wall times (robust to load from other jobs on a shared machine); process CPU times are printed too. One intra-op
thread by default. Output: `RATIO callback_overhead <value> target <=1.03` and METRIC lines.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
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
os.environ["WANDB_MODE"] = "offline"
os.environ.setdefault("WANDB_SILENT", "true")

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from callbacks.outlier_statistics import OutlierStatistics  # noqa: E402
from callbacks.wandb_logging import use_root_dir  # noqa: E402
from datamodules.mlm import MLMDataModule  # noqa: E402
from lightning_modules.mlm import MLMModule  # noqa: E402

DEFAULTS = {name: p.default for name, p in inspect.signature(OutlierStatistics.__init__).parameters.items()}
QUICK = {"model": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
                   "max_position_embeddings": 34},
         "data": {"vocab_size": 600, "block_length": 32, "batch_size": 8, "global_batch_size": 8, "max_texts": 400}}


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


def load_config(path: Path, quick: bool) -> dict:
    config = yaml.safe_load(path.read_text())
    if quick:
        for section, values in QUICK.items():
            config[section].update(values)
    return config


def run(config_path: Path, config: dict, root: Path, cache: Path, steps: int, cadence: tuple[int, int] | None,
        start: int = 1) -> WindowTimer:
    import train

    warnings.filterwarnings("ignore", "LightningCLI's args parameter")
    args = ["--config", str(config_path), "--seed_everything", "0", "--data.cache_dir", str(cache),
            "--trainer.default_root_dir", str(root), "--trainer.max_steps", str(start + steps),
            "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--checkpoint.every_n_train_steps", "100000000", "--model.decay_steps", str(start + steps),
            "--trainer.callbacks", json.dumps(live_callbacks(*cadence) if cadence else [])]
    for section in ("model", "data"):
        for key, value in config[section].items():
            args += [f"--{section}.{key}", json.dumps(value) if isinstance(value, list) else str(value)]
    cli = train.PretrainCLI(MLMModule, MLMDataModule, run=False, seed_everything_default=0,
                            trainer_defaults=train.TRAINER_DEFAULTS, save_config_kwargs={"overwrite": True}, args=args)
    timer = WindowTimer(start, steps)
    cli.trainer.callbacks.append(timer)
    cli.model.on_fit_end = lambda: None  # no export in a timing run
    use_root_dir(cli.trainer)  # W&B files under the run directory, as train.py does
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return timer


def live_callbacks(every: int, images: int) -> list[dict]:
    return [{"class_path": f"callbacks.{module}.{name}",
             "init_args": {"every_n_steps": every, "image_every_n_steps": images}}
            for module, name in (("outlier_statistics", "OutlierStatistics"),
                                 ("contribution_vectors", "ContributionVectors"),
                                 ("attention_geometry", "AttentionGeometry"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "pretrain" / "tiny.yaml"))
    parser.add_argument("--quick", action="store_true", help="small model and corpus, two rounds (for tests)")
    parser.add_argument("--smoke", action="store_true", help="smallest: one round of 4 steps (tests/test_bench.py)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2 * DEFAULTS["every_n_steps"],
                        help="optimizer steps timed per run, from step 1 (a multiple of every_n_steps)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1 keeps timings stable; 0: default)")
    args = parser.parse_args()
    for name in ("pytorch_lightning", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    every = DEFAULTS["every_n_steps"]
    if args.quick or args.smoke:
        args.rounds, args.steps, every = (1, 4, 2) if args.smoke else (2, 20, 10)
    if args.steps % every or args.steps > DEFAULTS["image_every_n_steps"]:
        parser.error(f"--steps must be a multiple of {every} and at most {DEFAULTS['image_every_n_steps']}")
    if args.threads:
        torch.set_num_threads(args.threads)
    cadence = (every, args.steps)
    config_path = Path(args.config)
    config = load_config(config_path, args.quick or args.smoke)
    results: dict[bool, list[WindowTimer]] = {True: [], False: []}
    print(f"METRIC cadence every_n_steps {every} image_every_n_steps {args.steps} (defaults "
          f"{DEFAULTS['every_n_steps']} / {DEFAULTS['image_every_n_steps']}), timed steps 1..{args.steps}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cache = tmp / "cache"
        if args.quick or args.smoke:
            corpus = tmp / "corpus.txt"
            with open(ROOT / "data" / "austen.txt", encoding="utf-8") as handle:
                corpus.write_text("".join(handle.readlines()[:200 if args.smoke else 400]), encoding="utf-8")
            config["data"]["corpus"] = str(corpus)
        for round_ in range(args.rounds):
            for live in ((True, False) if round_ % 2 == 0 else (False, True)):
                timer = run(config_path, config, tmp / f"{live}-{round_}", cache, args.steps, cadence if live else None)
                results[live].append(timer)
                print(f"round {round_}: {'with' if live else 'without':>7} callbacks  {timer.wall_s:8.2f} s wall  "
                      f"{timer.cpu_s:8.2f} s CPU  ({torch.get_num_threads()} threads)", flush=True)
    wall = [a.wall_s / b.wall_s for a, b in zip(results[True], results[False])]
    cpu = [a.cpu_s / b.cpu_s for a, b in zip(results[True], results[False])]
    print(f"METRIC step_time_without_callbacks_s {statistics.median(t.wall_s for t in results[False]) / args.steps:.4f}")
    print(f"METRIC callback_overhead_per_round {' '.join(f'{r:.3f}' for r in wall)}")
    print(f"METRIC callback_overhead_cpu {statistics.median(cpu):.3f}  (per round: {' '.join(f'{r:.3f}' for r in cpu)})")
    print(f"RATIO callback_overhead {statistics.median(wall):.3f} target <=1.03")


if __name__ == "__main__":
    main()
