"""MLM pretraining of RoBERTa with or without positional embeddings (LightningCLI).

    python train.py fit --config configs/pretrain/tiny.yaml                                  # CPU, minutes
    python train.py fit --config configs/pretrain/tiny.yaml --model.position_embeddings false \\
        --trainer.default_root_dir runs/pretrain/tiny-nope
    python train.py fit --config configs/pretrain/roberta-base.yaml --trainer.devices 4      # the paper's Table 4
    torchrun --nproc_per_node 4 train.py fit --config configs/pretrain/roberta-base-nope.yaml --trainer.devices 4
    python train.py fit --config configs/pretrain/roberta-base.yaml --ckpt_path last         # exact resume
    sbatch scripts/slurm_pretrain.sh configs/pretrain/roberta-base.yaml                      # multi-node

Checkpoints go to <default_root_dir>/checkpoints (last.ckpt every --checkpoint.every_n_train_steps and at the end);
the model is exported to <default_root_dir>/export (AutoModelForMaskedLM.from_pretrained and analyze.py read it).
The global batch (--data.global_batch_size) stays fixed: gradient accumulation is derived from devices × nodes.
Errors in the input are one line on stderr and exit status 2.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.cli import LightningCLI
from pytorch_lightning.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from datamodules.io import UserError
from datamodules.mlm import MLMDataModule
from datamodules.tokenizer import fingerprint
from lightning_modules.mlm import MLMModule, check_architecture

TRAINER_DEFAULTS = {"use_distributed_sampler": False}  # the datamodule shards batches itself (same global batch)


class PretrainCheckpoint(ModelCheckpoint):
    """ModelCheckpoint that also saves last.ckpt when training ends between two periodic saves."""

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        if self.save_last and not self._should_skip_saving_checkpoint(trainer) and \
                self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


def checkpoint_dir(root: str | None) -> str:
    return str(Path(root or os.getcwd()) / "checkpoints")


def last_checkpoint(directory: str | Path) -> Path | None:
    """The checkpoint `--ckpt_path last` resumes from: the newest *last*.ckpt of the checkpoint directory."""
    found = sorted(Path(directory).glob("*last*.ckpt"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def check_resume(path: Path, model: MLMModule, data: MLMDataModule) -> None:
    """Before anything is written: the checkpoint's architecture (PE or not) and tokenizer must match the config."""
    try:
        checkpoint = torch.load(str(path), map_location="cpu", weights_only=False, mmap=True)
    except Exception as error:  # torch raises many types for a bad file
        raise UserError(f"cannot read checkpoint {path}: {str(error).splitlines()[0] if str(error) else error}") from None
    check_architecture(checkpoint.get("hyper_parameters", {}), model.hparams, f"checkpoint {path}")
    saved = checkpoint.get(type(data).__qualname__, {}).get("tokenizer_fingerprint")
    tokenizer = data.cached_tokenizer()
    if saved is not None and tokenizer is not None and fingerprint(tokenizer) != saved:
        raise UserError(f"the tokenizer does not match checkpoint {path} (its vocabulary or merges differ); "
                        "resume with the tokenizer the run was started with")


class PretrainCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(PretrainCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.save_top_k": 0,
                             "checkpoint.every_n_train_steps": 1000})
        parser.link_arguments("trainer.default_root_dir", "checkpoint.dirpath", compute_fn=checkpoint_dir)
        parser.link_arguments("data.model_vocab_size", "model.vocab_size", apply_on="instantiate")

    def before_fit(self) -> None:
        """Cheap checks before any process group, cache or file: global batch, block length, resume target."""
        data, model, trainer = self.datamodule, self.model, self.trainer
        if data.hparams.block_length > model.max_length:
            raise UserError(f"--data.block_length {data.hparams.block_length} exceeds the model's {model.max_length} "
                            "positions (--model.max_position_embeddings - 2)")
        data.check_trainer(trainer, apply=False)
        ckpt_path = self.config_init[self.subcommand].get("ckpt_path")
        if ckpt_path == "last":
            path = last_checkpoint(trainer.checkpoint_callback.dirpath)
        elif ckpt_path and ckpt_path not in ("best", "hpc", "registry"):
            path = Path(ckpt_path)
            if not path.is_file():
                raise UserError(f"checkpoint not found: {ckpt_path}")
        else:
            path = None
        if path is not None:
            check_resume(path, model, data)

    def _run_subcommand(self, subcommand: str) -> None:
        try:
            super()._run_subcommand(subcommand)
        except BaseException:
            launcher = getattr(self.trainer.strategy, "launcher", None)
            if isinstance(launcher, _SubprocessScriptLauncher):  # workers Lightning started (not torchrun's)
                launcher.kill(getattr(signal, "SIGKILL", signal.SIGTERM))
            raise


def cli_main(args: list[str] | None = None) -> int:
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")
    try:
        PretrainCLI(MLMModule, MLMDataModule, seed_everything_default=0, trainer_defaults=TRAINER_DEFAULTS,
                    save_config_kwargs={"overwrite": True}, args=args)
    except UserError as error:
        print(f"train.py: error: {error}", file=sys.stderr)
        return 2
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
