"""The GPU half of benchmarks/bench_train.py: roberta-base tokens/s per GPU, MFU and the projected paper run, for the
bare model loop and the production configuration, eager and compiled, side by side (needs CUDA).

    python benchmarks/bench_train.py --gpu_only                       # configs/pretrain/roberta-base-fast.yaml
    python benchmarks/bench_train.py --gpu_only --gpu_config table4   # the paper's configs/pretrain/roberta-base.yaml
    python benchmarks/bench_train.py --gpu_only --peak_tflops 989     # a device the peak table does not know

For each sequence length (128 and 512, the same tokens per micro-batch) and each of eager / compiled:
- bare: the config's model (MLMModule.model), the same synthetic batches (BlockDataset + MaskCollator in the config's
  loader workers, pinned), fused AdamW + schedule + clipping, bf16 autocast, `mlm_step` (compiled whole when
  compiled), nothing else: the limit a framework can reach;
- production: Lightning's Trainer with the config's precision, clipping, logging interval, checkpoint callback and
  live-statistics callbacks (their own cadence: one capture in the 100 timed steps), W&B offline, progress bar on.
The timed window is steps [warm-up, warm-up + steps) of one epoch (the synthetic epoch holds them all), one
micro-batch a step (the 8-GPU case of a global batch of 256 × 512 with micro-batch 32, or 4 GPUs × 64), with
torch.cuda.synchronize only at its two ends. TF32 is on, as in train.py. During the production run's ordinary steps
(no capture, logging step or checkpoint) torch.cuda.set_sync_debug_mode("warn") is on and the synchronisation
warnings are counted (target 0). MFU = tokens/s × FLOPs per token / the device's dense bf16 peak; the projected
hours of the paper's 200k steps × 256 × 512 tokens on 4 and 8 GPUs of the measured kind assume linear scaling
(one GPU cannot measure DDP's all-reduce).
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import pytorch_lightning as pl
import torch
import yaml

from datamodules.masking import MaskCollator
from datamodules.sampling import BlockDataset, BlockSampler
from lightning_modules.mlm import MLMModule, mlm_step

ROOT = Path(__file__).resolve().parent.parent
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0,
                    "A10": 125.0, "4090": 165.0}
CONFIGS = {"fast": ["roberta-base", "roberta-base-fast"], "fast-nope": ["roberta-base", "roberta-base-fast",
                                                                        "roberta-base-fast-nope"],
           "table4": ["roberta-base"], "table4-nope": ["roberta-base", "roberta-base-nope"]}
PAPER_TOKENS = 200_000 * 256 * 512  # the paper's run: 200k steps of 256 blocks of 512 tokens
VOCAB = 50265  # RoBERTa's BPE
DEVICE, ACCELERATOR = "cuda", "gpu"  # (a dry run of this code on CPU swaps these and stubs torch.cuda)


def merged_config(name: str) -> dict:
    """The config as train.py merges its --config files: nested keys override, the rest is kept."""
    def merge(base: dict, override: dict) -> dict:
        out = dict(base)
        for key, value in override.items():
            out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        return out
    config: dict = {}
    for file in CONFIGS[name]:
        config = merge(config, yaml.safe_load((ROOT / "configs" / "pretrain" / f"{file}.yaml").read_text()))
    return config


def peak_tflops(name: str, override: float | None) -> float | None:
    if override:
        return override
    return next((value for key, value in PEAK_BF16_TFLOPS.items() if key in name), None)


def model_flops_per_token(module: MLMModule, seq: int, k: int) -> float:
    """Training FLOPs per input token: 6 N (the encoder's weight matrices, forward 2 + backward 4 per weight)
    + 12 L d T (attention scores and values) + 6 (d^2 + d V) k / T (the LM head on the k masked positions)."""
    h = module.hparams
    body = sum(layer.weight.numel() for layer in module.model.base_model.encoder.modules()  # RoBERTa, RoFormer (not
               if isinstance(layer, torch.nn.Linear))  # its sinusoid table, a 2-d buffer-like Embedding: no matmul)
    attention = 12 * h.num_hidden_layers * h.hidden_size * seq
    lm_head = 6 * (h.hidden_size ** 2 + h.hidden_size * h.vocab_size) * k / seq
    return 6 * body + attention + lm_head


class SyntheticTokenizer:
    """What MaskCollator needs of a tokenizer, for random blocks of a RoBERTa-sized vocabulary."""

    def __init__(self, vocab_size: int) -> None:
        self.all_special_ids, self.mask_token_id, self._vocab = [0, 1, 2, 3, 4], 4, vocab_size

    def get_vocab(self) -> dict:
        return {"<last>": self._vocab - 1}


class SyntheticData(pl.LightningDataModule):
    """Random blocks <s> ... </s> through the production data path: BlockDataset, BlockSampler, MaskCollator in
    `workers` loader workers, pinned memory; `num_blocks` blocks make one epoch."""

    def __init__(self, block_length: int, batch_size: int, num_blocks: int, workers: int) -> None:
        super().__init__()
        import datasets

        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(5, VOCAB, (num_blocks, block_length), generator=generator)
        ids[:, 0], ids[:, -1] = 0, 2
        self.blocks = BlockDataset(datasets.Dataset.from_dict({"input_ids": ids.numpy()}))
        self.collator = MaskCollator(SyntheticTokenizer(VOCAB), block_length)
        self.batch_size, self.block_length, self.workers = batch_size, block_length, workers

    def train_dataloader(self):
        sampler = BlockSampler(len(self.blocks), self.batch_size, group=self.batch_size)
        return torch.utils.data.DataLoader(self.blocks, sampler=sampler, batch_size=None, collate_fn=self.collator,
                                           num_workers=self.workers, pin_memory=True,
                                           persistent_workers=self.workers > 0,
                                           prefetch_factor=4 if self.workers else None)


class Window(pl.Callback):
    """Times optimizer steps [start, stop) with one synchronisation at each end, and turns the CUDA sync debug mode to
    "warn" over the ordinary steps (no capture, logging step or checkpoint) of the window, recording what it warns."""

    def __init__(self, start: int, stop: int, every_n_steps: int, log_every: int, save_every: int) -> None:
        self.start, self.stop, self.every, self.log_every, self.save_every = start, stop, every_n_steps, log_every, \
            save_every
        self.began = self.ended = None
        self.ordinary = 0
        self.caught: list[str] = []
        self._record = None

    def _ordinary(self, step: int) -> bool:
        return (self.start <= step < self.stop and step % self.every != 0 and (step + 1) % self.log_every != 0
                and (step + 1) % self.save_every != 0)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self.start and self.began is None:
            torch.cuda.synchronize()
            self.began = time.perf_counter()
        ordinary = self._ordinary(step)
        self.ordinary += ordinary
        torch.cuda.set_sync_debug_mode("warn" if ordinary else 0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.stop and self.ended is None:
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
            self.ended = time.perf_counter()

    def on_train_end(self, trainer, pl_module) -> None:
        torch.cuda.set_sync_debug_mode(0)


@contextlib.contextmanager
def sync_warnings(into: list[str]):
    """Collect the CUDA synchronisation warnings raised inside (every one, not once per place)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    into.extend(str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()
                and "prototype feature" not in str(w.message))  # torch's notice on turning the mode on, no sync


def build(config: dict, compiled: bool) -> MLMModule:
    pl.seed_everything(0, verbose=False)
    arguments = {**config["model"], "vocab_size": VOCAB, "warmup_steps": 10, "decay_steps": 10_000,
                 "compile": compiled}
    module = MLMModule(**arguments)
    assert module.model.config._attn_implementation == "sdpa"
    return module


def run_bare(config: dict, data: SyntheticData, compiled: bool, warmup: int, steps: int) -> tuple[float, MLMModule]:
    """tokens/s of the plain loop (see the module docstring)."""
    module = build(config, compiled).to(DEVICE)
    model = module.model.train()
    optimizers = module.configure_optimizers()  # fused AdamW (on the module's device) + schedule, as in training
    optimizer, scheduler = optimizers["optimizer"], optimizers["lr_scheduler"]["scheduler"]
    step_fn = module._compiled or mlm_step
    clip = config["trainer"].get("gradient_clip_val") or math.inf
    batches = iter(data.train_dataloader())
    began = None
    for step in range(warmup + steps):
        if step == warmup:
            torch.cuda.synchronize()
            began = time.perf_counter()
        batch = {key: value.to(DEVICE, non_blocking=True) for key, value in next(batches).items()}
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = step_fn(model, batch, False, VOCAB).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return data.batch_size * data.block_length * steps / (time.perf_counter() - began), module


def callbacks_of(config: dict) -> list[pl.Callback]:
    """The config's trainer.callbacks, instantiated from their class paths and arguments."""
    made = []
    for spec in config["trainer"].get("callbacks") or []:
        module, name = spec["class_path"].rsplit(".", 1)
        made.append(getattr(importlib.import_module(module), name)(**(spec.get("init_args") or {})))
    return made


def run_production(config: dict, data: SyntheticData, compiled: bool, warmup: int, steps: int, root: Path):
    """tokens/s of Lightning with the config's settings and callbacks; the sync warnings of its ordinary steps."""
    from callbacks.checkpointing import PretrainCheckpoint
    from callbacks.wandb_logging import AutoWandbLogger

    module = build(config, compiled)
    module.on_fit_end = lambda: None  # no export of a throughput run
    trainer_config, live = config["trainer"], callbacks_of(config)
    every = min((callback.every_n_steps for callback in live), default=10 ** 9)
    save_every = config.get("checkpoint", {}).get("every_n_train_steps", 10 ** 9)
    window = Window(warmup, warmup + steps, every, trainer_config.get("log_every_n_steps", 50), save_every)
    checkpoint = PretrainCheckpoint(dirpath=str(root / "checkpoints"), every_n_train_steps=save_every,
                                    save_last=True, save_top_k=0)
    logger = AutoWandbLogger(project="positional-artefacts", name="bench", save_dir=str(root), offline=True)
    trainer = pl.Trainer(accelerator=ACCELERATOR, devices=1, precision=trainer_config["precision"],
                         gradient_clip_val=trainer_config.get("gradient_clip_val"), max_steps=warmup + steps,
                         log_every_n_steps=trainer_config.get("log_every_n_steps", 50), logger=logger,
                         callbacks=[*live, checkpoint, window], enable_model_summary=False,
                         default_root_dir=str(root), use_distributed_sampler=False, num_sanity_val_steps=0,
                         limit_val_batches=0)
    import wandb

    mode = os.environ.get("WANDB_MODE")
    os.environ["WANDB_MODE"] = "offline"  # the config's logger, offline (bench_train.py disables W&B otherwise)
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        with sync_warnings(window.caught):
            trainer.fit(module, datamodule=data)
    finally:
        wandb.finish()  # Lightning leaves the run open: the next run must not log into this one
        if mode is None:
            os.environ.pop("WANDB_MODE", None)
        else:
            os.environ["WANDB_MODE"] = mode
    tokens = data.batch_size * data.block_length * steps / (window.ended - window.began)
    return tokens, module, window


def run_gpu(args) -> None:
    from torch._dynamo.utils import counters  # (here: bench_train's CPU runs need not import dynamo)

    torch.set_float32_matmul_precision("high")  # TF32 for the float32 matmuls, as train.py sets on CUDA
    device = torch.cuda.get_device_name(0)
    peak = peak_tflops(device, args.peak_tflops)
    if peak is None:
        print(f"note: no bf16 peak known for {device}: pass --peak_tflops for the MFU lines")
    config = merged_config(args.gpu_config)
    name = args.gpu_config.replace("-", "_")
    modes = (False,) if args.smoke else (False, True)
    lengths = ((128, args.gpu_batch_512 * 4),) if args.smoke else ((128, args.gpu_batch_512 * 4),
                                                                   (512, args.gpu_batch_512))
    workers = config["data"].get("num_workers", 4)
    projected: dict[str, float] = {}
    for seq, batch in lengths:
        data = SyntheticData(seq, batch, batch * (args.gpu_warmup + args.gpu_steps + 2), workers)
        k = data.collator.k
        for compiled in modes:
            for kind in ("bare", "production"):
                torch.cuda.reset_peak_memory_stats()
                torch._dynamo.reset()  # each run compiles its own graphs (and counts them), within the recompile limit
                counters.clear()  # reset() keeps dynamo's counters: each run's graph count is its own
                with tempfile.TemporaryDirectory() as root:
                    if kind == "bare":
                        tokens, module = run_bare(config, data, compiled, args.gpu_warmup, args.gpu_steps)
                        window = None
                    else:
                        tokens, module, window = run_production(config, data, compiled, args.gpu_warmup,
                                                                args.gpu_steps, Path(root))
                label = f"{name}_seq{seq}_{kind}_{'compiled' if compiled else 'eager'}"
                memory = torch.cuda.max_memory_allocated() / 2 ** 30
                print(f"METRIC {label}_tokens_per_s {tokens:.0f}  (per GPU, batch {batch}, {device}, peak memory "
                      f"{memory:.1f} GiB)", flush=True)
                if peak:
                    flops = model_flops_per_token(module, seq, k)
                    print(f"METRIC {label}_mfu {tokens * flops / (peak * 1e12):.3f}  ({flops / 1e6:.0f} MFLOP/token, "
                          f"peak {peak:.0f} TFLOP/s bf16)", flush=True)
                if compiled:
                    print(f"METRIC {label}_graphs {counters['stats']['unique_graphs']}  (compiled graphs: 1 bare, 2 "
                          "production, with and without hidden states; more would be recompiles)", flush=True)
                if window is not None:
                    where = f"; first: {window.caught[0]}" if window.caught else ""
                    print(f"METRIC {label}_sync_warnings {len(window.caught)}  (over {window.ordinary} ordinary "
                          f"steps, set_sync_debug_mode('warn'){where})", flush=True)
                if seq == 512:
                    projected[f"{kind}_{'compiled' if compiled else 'eager'}"] = tokens
                del module
                torch.cuda.empty_cache()
    for label, tokens in projected.items():
        for gpus in (4, 8):
            hours = PAPER_TOKENS / (tokens * gpus) / 3600
            print(f"METRIC {name}_paper_run_hours_{gpus}gpu_{label} {hours:.1f}  (200k x 256 x 512 tokens at the "
                  f"seq-512 rate, {gpus} x {device}, linear scaling assumed)")
    if projected:
        best = statistics.median(projected.values())
        print(f"note: median seq-512 rate here {best:.0f} tokens/s per GPU")
