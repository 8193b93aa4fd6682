"""Pretraining throughput: train.py's LightningModule + Trainer vs a bare PyTorch loop and vs transformers' Trainer.

    python benchmarks/bench_train.py            # tiny config (configs/pretrain/tiny.yaml) on the bundled corpus
    python benchmarks/bench_train.py --quick    # small sizes, one round
    python benchmarks/bench_train.py --smoke    # smallest sizes, seconds (the test suite runs this)
    python benchmarks/bench_train.py --gpu_only # only the roberta-base GPU lines (needs CUDA; benchmarks/gpu_train.py)

All three run side by side in one process, interleaved over --rounds; each ratio is the median over rounds of the
paired per-round ratio (robust to load from other jobs on a shared machine):
- lightning: train.py's PretrainCLI on the config (same model, data module, optimizer, clipping, logging);
- bare: a plain loop over the same model, the same DataLoader batches, the same AdamW + schedule + clipping and
  the same loss function (the framework-overhead limit), target >= 0.95x;
- hf_trainer: transformers.Trainer + DataCollatorForLanguageModeling on the same packed blocks and model config
  (the usual baseline), target >= 1.0x.
With CUDA it also runs benchmarks/gpu_train.py: the model of configs/pretrain/roberta-base-fast.yaml (or
--gpu_config) at sequence lengths 128 and 512 on synthetic blocks, the bare loop and the production configuration
side by side, eager and compiled: tokens/s per GPU, model-FLOPs utilisation (FLOPs per token 6 N (N = the encoder's
weight matrices) + 12 L d T (attention scores and values) + 6 (d^2 + d V) k / T (the LM head on the k masked
positions of T), times tokens/s, over the device's dense bf16 peak, looked up by device name or --peak_tflops), the
synchronisation warnings of ordinary steps and the projected hours of the paper's run on 4 and 8 such GPUs.
Without CUDA it prints a note instead.
Output: one `RATIO <name> <value> target >=<x>` line per ratio, and `METRIC <name> <value>` lines for the rest.
"""

from __future__ import annotations

import argparse
import json
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
os.environ.setdefault("WANDB_MODE", "disabled")

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from benchmarks.gpu_train import CONFIGS, PEAK_BF16_TFLOPS, model_flops_per_token, peak_tflops, run_gpu  # noqa: E402,F401
from datamodules.mlm import MLMDataModule  # noqa: E402
from lightning_modules.mlm import MLMModule, mlm_loss  # noqa: E402

QUICK = {"model": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
                   "max_position_embeddings": 34},
         "data": {"vocab_size": 600, "block_length": 32, "batch_size": 8, "global_batch_size": 8, "max_texts": 400}}


def load_config(path: Path, quick: bool) -> dict:
    config = yaml.safe_load(path.read_text())
    if quick:
        for section, values in QUICK.items():
            config[section].update(values)
    return config


def overrides(config: dict, root: Path, cache: Path, steps: int) -> list[str]:
    args = []
    for section in ("model", "data"):
        for key, value in config[section].items():
            args += [f"--{section}.{key}", json.dumps(value) if isinstance(value, list) else str(value)]
    return args + [
        "--seed_everything", "0", "--data.cache_dir", str(cache), "--trainer.default_root_dir", str(root),
        "--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
        "--checkpoint.every_n_train_steps", "1000000", "--trainer.enable_model_summary", "false",
        "--trainer.logger", json.dumps({"class_path": "pytorch_lightning.loggers.CSVLogger",
                                        "init_args": {"save_dir": str(root)}}),
        *[f"--trainer.{k}={v}" for k, v in config["trainer"].items() if k in ("accelerator", "devices", "precision",
                                                                             "gradient_clip_val", "log_every_n_steps")],
    ]


class StepTimer(pl.Callback):
    """Wall time from the start of optimizer step `warmup` to the end of step `stop - 1`, synchronised only there."""

    def __init__(self, warmup: int, stop: int) -> None:
        self.warmup, self.stop, self.start, self.end = warmup, stop, None, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.start is None and trainer.global_step == self.warmup:
            _sync()
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.end is None and trainer.global_step == self.stop:
            _sync()
            self.end = time.perf_counter()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_lightning(config_path: Path, config: dict, root: Path, cache: Path, warmup: int, steps: int) -> float:
    import train

    warnings.filterwarnings("ignore", "LightningCLI's args parameter")  # this script's own argv is expected
    cli = train.PretrainCLI(MLMModule, MLMDataModule, run=False, seed_everything_default=0,
                            trainer_defaults=train.TRAINER_DEFAULTS, save_config_kwargs={"overwrite": True},
                            args=["--config", str(config_path), *overrides(config, root, cache, warmup + steps),
                                  "--trainer.enable_progress_bar", "false"])
    timer = StepTimer(warmup, warmup + steps)
    cli.trainer.callbacks.append(timer)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return tokens_per_step(config) * steps / (timer.end - timer.start)


def tokens_per_step(config: dict) -> int:
    data = config["data"]
    return (data.get("global_batch_size") or data["batch_size"]) * data["block_length"]


def datamodule(config: dict, cache: Path) -> MLMDataModule:
    data = MLMDataModule(**{**config["data"], "cache_dir": str(cache)})
    data.prepare_data()
    data.setup("fit")
    return data


def run_bare(config: dict, cache: Path, warmup: int, steps: int) -> float:
    """The same model, batches, optimizer, schedule, clipping and loss, with nothing around them."""
    data = datamodule(config, cache)
    pl.seed_everything(0, verbose=False)
    module = MLMModule(**{**config["model"], "vocab_size": data.model_vocab_size, "decay_steps": warmup + steps})
    model = module.model.train()
    optimizers = module.configure_optimizers()
    optimizer, scheduler = optimizers["optimizer"], optimizers["lr_scheduler"]["scheduler"]
    clip = config["trainer"].get("gradient_clip_val") or float("inf")
    accumulate = data.accumulation(1)
    batches = iter(data.train_dataloader())
    start = None
    for step in range(warmup + steps):
        if step == warmup:
            start = time.perf_counter()
        for _ in range(accumulate):
            loss, _ = mlm_loss(model, next(batches))
            (loss / accumulate).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return tokens_per_step(config) * steps / (time.perf_counter() - start)


def run_hf_trainer(config: dict, cache: Path, root: Path, warmup: int, steps: int) -> float:
    """transformers.Trainer with DataCollatorForLanguageModeling over the same packed blocks (full-vocab logits)."""
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainerCallback, TrainingArguments

    data = datamodule(config, cache)
    blocks = data.train_blocks.blocks.with_format("torch")
    model_config = config["model"]
    pl.seed_everything(0, verbose=False)
    model = MLMModule(**{**model_config, "vocab_size": data.model_vocab_size}).model  # same RobertaForMaskedLM
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            _sync()
            times.append(time.perf_counter())

    batch = data.hparams.batch_size
    args = TrainingArguments(
        output_dir=str(root), per_device_train_batch_size=batch,
        gradient_accumulation_steps=(data.hparams.global_batch_size or batch) // batch, max_steps=warmup + steps + 1,
        learning_rate=model_config.get("lr", 1e-4), warmup_steps=model_config.get("warmup_steps", 0),
        weight_decay=model_config.get("weight_decay", 0.01), adam_beta1=model_config.get("betas", [0.9, 0.98])[0],
        adam_beta2=model_config.get("betas", [0.9, 0.98])[1], adam_epsilon=model_config.get("eps", 1e-6),
        max_grad_norm=config["trainer"].get("gradient_clip_val") or 0.0, lr_scheduler_type="linear",
        logging_steps=config["trainer"].get("log_every_n_steps", 50), save_strategy="no", report_to=[],
        dataloader_num_workers=data.hparams.num_workers, disable_tqdm=True, seed=0,
        bf16=config["trainer"].get("precision") == "bf16-mixed", use_cpu=not torch.cuda.is_available(),
    )
    collator = DataCollatorForLanguageModeling(data.tokenizer, mlm_probability=data.hparams.mlm_probability)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Trainer(model=model, args=args, train_dataset=blocks, data_collator=collator, callbacks=[Timer()]).train()
    return tokens_per_step(config) * steps / (times[warmup + steps - 1] - times[warmup - 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--config", default=str(ROOT / "configs" / "pretrain" / "tiny.yaml"))
    parser.add_argument("--quick", action="store_true", help="small model and corpus, one round")
    parser.add_argument("--smoke", action="store_true", help="smallest model and corpus, two timed steps (tests)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads for all three runs (1 keeps timings stable on a shared machine; 0: torch's default)")
    parser.add_argument("--gpu_only", action="store_true")
    parser.add_argument("--gpu_config", choices=sorted(CONFIGS), default="fast",
                        help="fast: roberta-base.yaml + roberta-base-fast.yaml; table4: roberta-base.yaml (+ -nope)")
    parser.add_argument("--gpu_warmup", type=int, default=10)
    parser.add_argument("--gpu_steps", type=int, default=100, help="timed steps (one capture in 100 at the default)")
    parser.add_argument("--gpu_batch_512", type=int, default=64,
                        help="micro-batch at length 512 (the fast config's); length 128 takes 4x as many blocks")
    parser.add_argument("--peak_tflops", type=float, default=None, help="the device's dense bf16 peak (TFLOP/s)")
    args = parser.parse_args()
    if args.quick or args.smoke:
        args.rounds, args.warmup, args.steps = (1, 1, 2) if args.smoke else (1, 2, 4)
        args.gpu_warmup, args.gpu_steps = (2, 4) if args.smoke else (5, 20)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.gpu_only:
        run_cpu_comparison(args)
    if torch.cuda.is_available():
        run_gpu(args)
    else:
        print("note: no CUDA device: roberta-base tokens/s and MFU (bare loop and production configuration, eager and "
              "compiled, sequence lengths 128 and 512) are measured on a GPU only")


def run_cpu_comparison(args) -> None:
    config_path = Path(args.config)
    config = load_config(config_path, args.quick or args.smoke)
    results: dict[str, list[float]] = {"lightning": [], "bare": [], "hf_trainer": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cache = tmp / "cache"
        if args.quick or args.smoke:
            corpus = tmp / "corpus.txt"
            with open(ROOT / "core" / "corpus" / "austen.txt", encoding="utf-8") as handle:
                corpus.write_text("".join(handle.readlines()[:200 if args.smoke else 400]), encoding="utf-8")
            config["data"]["corpus"] = str(corpus)
        datamodule(config, cache)  # prepare the tokenizer and blocks once, outside the timings
        for round_ in range(args.rounds):
            order = list(results) if round_ % 2 == 0 else list(reversed(results))  # no method always goes first
            for name in order:
                root = tmp / f"{name}-{round_}"
                if name == "lightning":
                    value = run_lightning(config_path, config, root, cache, args.warmup, args.steps)
                elif name == "bare":
                    value = run_bare(config, cache, args.warmup, args.steps)
                else:
                    value = run_hf_trainer(config, cache, root, args.warmup, args.steps)
                results[name].append(value)
                print(f"round {round_}: {name:>10} {value:10.0f} tokens/s  ({torch.get_num_threads()} threads)",
                      flush=True)
    for name, values in results.items():
        print(f"METRIC {name}_tokens_per_s {statistics.median(values):.0f}")
    # The machine may be shared: runs of one round are seconds apart, so each round gives a paired ratio and the
    # median over rounds is reported (a burst of load elsewhere moves one round, not the result).
    for other, target in (("bare", 0.95), ("hf_trainer", 1.0)):
        ratios = [a / b for a, b in zip(results["lightning"], results[other])]
        label = "bare_loop" if other == "bare" else other
        print(f"METRIC lightning_vs_{label}_per_round {' '.join(f'{r:.3f}' for r in ratios)}")
        print(f"RATIO lightning_vs_{label} {statistics.median(ratios):.3f} target >={target}")


if __name__ == "__main__":
    main()
