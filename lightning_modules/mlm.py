"""RoBERTa masked-language model pretrained from scratch, with or without positional embeddings (the paper's Table 4).

    python train.py fit --config configs/pretrain/tiny.yaml                                   # PE
    python train.py fit --config configs/pretrain/tiny.yaml --model.position_embeddings false # no PE

`self.model` is a plain transformers `RobertaForMaskedLM` built from a config (random init). Without positional
embeddings its position table is all zeros and frozen (no gradient, not in the optimizer), so the model carries no
positional signal at all while keeping `position_embedding_type="absolute"`, i.e. transformers' fast SDPA attention;
an export loaded by plain `AutoModelForMaskedLM.from_pretrained` stays position-free.

The loss projects only the masked positions through the LM head (`mlm_loss`): the batch holds `positions`
[batch, k] and `targets` [batch, k], so no [batch, seq, vocab] logits are ever made.
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.utilities import rank_zero_only
from torch import Tensor
from torchmetrics import MeanMetric

from core.errors import UserError
from core.output import staged_output

ARCHITECTURE = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "max_position_embeddings", "position_embeddings")


def mlm_loss(model, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Mean cross-entropy over the masked positions, and their count.

    batch: input_ids [batch, seq]; positions [batch, k] (indices into seq); targets [batch, k] (-100 = none).
    Only the [batch, k, hidden] masked hidden states go through the LM head (the same result as the full logits).
    """
    hidden = model.roberta(input_ids=batch["input_ids"]).last_hidden_state  # [batch, seq, hidden]
    positions = batch["positions"]
    picked = hidden.gather(1, positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))  # [batch, k, hidden]
    logits = model.lm_head(picked)  # [batch, k, vocab]
    targets = batch["targets"]
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
    return loss, (targets != -100).sum()


def build_model(vocab_size: int, hidden_size: int, num_hidden_layers: int, num_attention_heads: int,
                intermediate_size: int, max_position_embeddings: int, dropout: float, position_embeddings: bool,
                attn_implementation: str = "sdpa", pad_token_id: int = 1, bos_token_id: int = 0,
                eos_token_id: int = 2):
    """A randomly initialised RobertaForMaskedLM; without PE, an all-zero frozen position table.

    The special ids are the tokenizer's (RoBERTa's 1/0/2 for the trained BPE): the pad id is the embedding's
    padding row and sets where RoBERTa's positions start (pad id + 1).
    """
    from transformers import AutoModelForMaskedLM, RobertaConfig

    config = RobertaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads, intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings, hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout, type_vocab_size=1, layer_norm_eps=1e-5,
        pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
    )
    model = AutoModelForMaskedLM.from_config(config, attn_implementation=attn_implementation)
    if not position_embeddings:
        remove_position_embeddings(model)
    return model


def remove_position_embeddings(model) -> None:
    """Zero and freeze the absolute position table: no positional signal, SDPA path kept."""
    table = model.roberta.embeddings.position_embeddings
    with torch.no_grad():
        table.weight.zero_()
    table.weight.requires_grad_(False)


class MLMModule(pl.LightningModule):
    """RobertaForMaskedLM + AdamW + linear warm-up and polynomial decay; logs train/loss, val/loss, val/perplexity.

    Args:
        position_embeddings: learned absolute positions (True) or none at all (False: zero, frozen table).
        vocab_size: embedding rows (linked from the datamodule's tokenizer by train.py).
        hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, max_position_embeddings: the
            RoBERTa architecture (max_position_embeddings includes RoBERTa's 2 offset rows).
        dropout: hidden and attention dropout.
        lr, betas, eps, weight_decay: AdamW (fused on CUDA); no decay on biases, LayerNorms, or a frozen table.
        warmup_steps, decay_steps, end_lr, power: linear warm-up to `lr`, then (1 - progress)^power decay to
            `end_lr` at `decay_steps` (default: the trainer's max_steps).
        compile: torch.compile the loss computation.
        attn_implementation: transformers attention backend ("sdpa"; "eager" only for debugging).
        pad_token_id, bos_token_id, eos_token_id: the tokenizer's (linked from the datamodule by train.py).
    """

    def __init__(
        self,
        position_embeddings: bool = True,
        vocab_size: int = 50265,
        hidden_size: int = 768,
        num_hidden_layers: int = 12,
        num_attention_heads: int = 12,
        intermediate_size: int = 3072,
        max_position_embeddings: int = 514,
        dropout: float = 0.1,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.98),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        warmup_steps: int = 10_000,
        decay_steps: int | None = None,
        end_lr: float = 0.0,
        power: float = 1.0,
        compile: bool = False,
        attn_implementation: str = "sdpa",
        pad_token_id: int = 1,
        bos_token_id: int = 0,
        eos_token_id: int = 2,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_optimisation(self.hparams)
        if hidden_size % num_attention_heads:
            raise UserError(f"--model.hidden_size {hidden_size} is not a multiple of num_attention_heads "
                            f"{num_attention_heads}")
        self.model = build_model(vocab_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
                                 max_position_embeddings, dropout, position_embeddings, attn_implementation,
                                 pad_token_id, bos_token_id, eos_token_id)
        self.val_loss = MeanMetric()
        self._loss_fn = torch.compile(mlm_loss) if compile else mlm_loss
        self._seed = 0
        self._last_loss: Tensor | None = None

    # -- facts the datamodule and the CLI check against --

    @property
    def vocab_size(self) -> int:
        return self.hparams.vocab_size

    @property
    def max_length(self) -> int:
        """Longest input: the position table minus RoBERTa's padding offset (pad id + 1)."""
        return self.hparams.max_position_embeddings - (self.model.config.pad_token_id + 1)

    # -- steps --

    def forward(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        return self._loss_fn(self.model, batch)

    def _shared_step(self, batch: dict[str, Tensor], stage: str) -> Tensor:
        loss, count = self(batch)
        if stage == "train":
            self._last_loss = loss.detach()
            self.log("train/loss", loss, prog_bar=True, sync_dist=True, batch_size=batch["input_ids"].shape[0])
        else:
            self.val_loss.update(loss.detach(), count)
        return loss

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._shared_step(batch, "train")

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._shared_step(batch, "val")

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()  # token-weighted mean over every rank's blocks
        self.val_loss.reset()
        self.log_dict({"val/loss": loss, "val/perplexity": torch.exp(loss)}, prog_bar=True, sync_dist=True)

    # -- randomness: dropout depends on (seed, rank, batch), so a resumed run draws what a straight one would --

    def on_fit_start(self) -> None:
        self._seed = int(os.environ.get("PL_GLOBAL_SEED", 0))

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        if self.hparams.dropout > 0:
            index = self.trainer.fit_loop.epoch_loop.batch_progress.total.ready  # micro-batches so far, restored on resume
            torch.manual_seed((self._seed * 1_000_003 + self.global_rank * 7_919 + index * 104_729) % (2**63))

    # -- optimisation --

    def configure_optimizers(self):
        decay, no_decay = [], []
        for name, parameter in self.model.named_parameters():
            if not parameter.requires_grad:
                continue  # the frozen zero position table of a no-PE model
            (no_decay if parameter.ndim < 2 or "LayerNorm" in name or "layer_norm" in name else decay).append(parameter)
        h = self.hparams
        groups = [{"params": decay, "weight_decay": h.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=h.lr, betas=tuple(h.betas), eps=h.eps,
                                      fused=self.device.type == "cuda")
        end = schedule_end(h.decay_steps, None if h.decay_steps else self.trainer.max_steps)  # a trainer if needed
        schedule = PolynomialSchedule(h.warmup_steps, end, h.end_lr / h.lr, h.power)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Clip by global norm and stop on a non-finite loss or gradient before the optimizer step touches anything."""
        parameters = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(parameters, gradient_clip_val or math.inf, foreach=True)
        loss = self._last_loss
        bad = not torch.isfinite(norm) or (loss is not None and not torch.isfinite(loss))
        if bad:
            raise UserError(f"non-finite training loss ({float(loss) if loss is not None else float('nan')}) or "
                            f"gradient norm ({float(norm)}) at step {self.global_step}: stopped before the optimizer "
                            "step; the last checkpoint is the last good one")
        self.log("train/grad_norm", norm, sync_dist=False)

    # -- checkpoints and export --

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        check_architecture(checkpoint.get("hyper_parameters", {}), self.hparams, "the checkpoint")
        data = getattr(self._trainer, "datamodule", None)
        if hasattr(data, "adapt_checkpoint"):  # before Lightning restores its loops from the same dict
            data.adapt_checkpoint(checkpoint)

    def on_fit_end(self) -> None:
        tokenizer = getattr(self.trainer.datamodule, "tokenizer", None)
        directory = Path(self.trainer.default_root_dir) / "export"
        export(self, tokenizer, directory)
        self.trainer.strategy.barrier("export")


def schedule_end(decay_steps: int | None, max_steps: int | None) -> int:
    """The step where the learning rate reaches its end: --model.decay_steps, else --trainer.max_steps."""
    end = decay_steps or max_steps
    if end is None or end <= 0:
        raise UserError("set --trainer.max_steps or --model.decay_steps: the learning-rate schedule needs an end")
    return end


def check_optimisation(h) -> None:
    """The optimiser's and schedule's arguments, before any logger or directory exists (AdamW, made when training
    starts, would otherwise stop the run with a traceback after its files are written)."""
    def number(value) -> bool:
        return isinstance(value, (int, float)) and math.isfinite(value)

    checks = [("lr", number(h.lr) and h.lr > 0, "a positive number"),
              ("end_lr", number(h.end_lr) and 0 <= h.end_lr <= h.lr, "between 0 and --model.lr"),
              ("eps", number(h.eps) and h.eps > 0, "a positive number"),
              ("weight_decay", number(h.weight_decay) and h.weight_decay >= 0, "at least 0"),
              ("dropout", number(h.dropout) and 0 <= h.dropout < 1, "in [0, 1)"),
              ("power", number(h.power) and h.power > 0, "a positive number"),
              ("betas", len(h.betas) == 2 and all(number(b) and 0 <= b < 1 for b in h.betas), "two numbers in [0, 1)"),
              ("warmup_steps", h.warmup_steps >= 0, "at least 0"),
              ("decay_steps", h.decay_steps is None or h.decay_steps > 0, "positive (or null: --trainer.max_steps)")]
    for name, good, expected in checks:
        if not good:
            raise UserError(f"--model.{name} must be {expected}, got {getattr(h, name)}")


def check_warmup(warmup_steps: int, decay_steps: int | None, max_steps: int | None) -> None:
    """One warning (not an error: a short smoke run of a full-size config is a fair thing to start) when the warm-up
    does not end before the schedule does (the rate never decays), or when the run stops inside the warm-up of a
    longer schedule (to be resumed). The schedule must have an end."""
    end = schedule_end(decay_steps, max_steps)
    if warmup_steps >= end:
        source = "--model.decay_steps" if decay_steps else "--trainer.max_steps"
        warnings.warn(f"--model.warmup_steps {warmup_steps} does not end before the learning-rate schedule does "
                      f"(step {end}, {source}): the rate never decays; lower --model.warmup_steps for a whole "
                      "schedule", stacklevel=2)
    elif max_steps is not None and 0 < max_steps <= warmup_steps:
        warnings.warn(f"this run stops at step {max_steps} (--trainer.max_steps), inside the warm-up of "
                      f"{warmup_steps} steps: the learning rate stays below --model.lr until a resumed run goes on",
                      stacklevel=2)


class PolynomialSchedule:
    """LR multiplier: step/warmup during warm-up, then end + (1 - end)(1 - progress)^power, held at `end` after."""

    def __init__(self, warmup_steps: int, decay_steps: int, end_ratio: float = 0.0, power: float = 1.0) -> None:
        self.warmup_steps, self.decay_steps, self.end_ratio, self.power = warmup_steps, decay_steps, end_ratio, power

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        span = max(1, self.decay_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.end_ratio + (1 - self.end_ratio) * (1 - progress) ** self.power


def check_architecture(saved: dict, current, what: str) -> None:
    """One clear line when a checkpoint's architecture (PE or not, sizes, vocabulary) differs from the config's."""
    if "position_embeddings" in saved and saved["position_embeddings"] != current["position_embeddings"]:
        def name(flag):
            return "with positional embeddings" if flag else "without positional embeddings (no-PE)"
        raise UserError(f"{what} was trained {name(saved['position_embeddings'])} but the config asks for a model "
                        f"{name(current['position_embeddings'])}; resume with the matching config")
    for key in ARCHITECTURE:
        if key in saved and saved[key] != current[key]:
            noun = "tokenizer vocabulary" if key == "vocab_size" else key
            raise UserError(f"{what} has {key}={saved[key]} but the config gives {current[key]} ({noun} mismatch)")


@rank_zero_only
def export(module: MLMModule, tokenizer, directory: Path) -> None:
    """config.json + model.safetensors + tokenizer files that AutoModelForMaskedLM / AutoTokenizer load."""
    if tokenizer is None:
        raise UserError("no tokenizer to export with the model (train with MLMDataModule)")
    tokenizer.model_max_length = module.max_length
    with staged_output(directory, "the export") as stage:
        module.model.save_pretrained(stage)
        tokenizer.save_pretrained(stage)
        umask = os.umask(0)
        os.umask(umask)
        for path in stage.iterdir():  # readable by the group like any other file (some writers use 0600)
            path.chmod(0o666 & ~umask)
