"""RoBERTa masked-language model pretrained from scratch, with or without positional embeddings (the paper's Table 4).

    python train.py fit --config configs/pretrain/tiny.yaml                                   # PE
    python train.py fit --config configs/pretrain/tiny.yaml --model.position_embeddings false # no PE
    python train.py fit --config configs/pretrain/tiny.yaml --model.attention gated           # or clipped_softmax
    python train.py fit --config configs/pretrain/tiny.yaml --model.objective causal --model.positions rope  # arms

`self.model` is a plain transformers `RobertaForMaskedLM` built from a config (random init). Without positional
embeddings its position table is all zeros and frozen (no gradient, not in the optimizer), so the model carries no
positional signal at all while keeping `position_embedding_type="absolute"`, i.e. transformers' fast SDPA attention;
an export loaded by plain `AutoModelForMaskedLM.from_pretrained` stays position-free. The token-type row is fairseq's
(the paper's trainer has none; transformers' conversion zeroes it): all zeros and frozen in every arm, so no constant
learned vector is added to every token; `--model.token_type_embeddings true` (ours) keeps transformers' learned row.
`--model.attention` trains
clipped softmax or gated attention instead of softmax (Bondarenko et al. 2023; lightning_modules/attention.py).
`--model.objective causal` and `--model.positions learned|none|rope` train the other arms on the same stack sizes
(RobertaForCausalLM, RoFormerForMaskedLM, RoFormerForCausalLM: lightning_modules/arms.py).

The loss projects only the masked positions through the LM head (`mlm_step`): the batch holds `positions`
[batch, k] and `targets` [batch, k], so no [batch, seq, vocab] logits are ever made. With `pad_vocab_to_multiple_of`
the embedding and LM head get extra rows (a matmul-friendly size) that no input uses and no loss predicts (their
logits are cut off); the export drops them again.

`--model.compile true` compiles `mlm_step` whole (embeddings, encoder, LM head, loss; fullgraph) into two graphs, one
that also returns every layer's hidden states (the steps a live-statistics callback captures, through
`hidden_state_tap`) and one that does not; validation runs eagerly. An ordinary training step never synchronises with
the host: the loss is summed on the device and logged at the logging interval, and a non-finite step is skipped on
the device by the fused AdamW and reported at the next logging step, checkpoint or end (lightning_modules/monitor.py).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from pytorch_lightning.utilities import rank_zero_only
from torch import Tensor
from torchmetrics import MeanMetric

from core.errors import UserError
from core.models import model_max_length, quiet_transformers
from core.output import export_weights, staged_output
from lightning_modules.arms import arm_of, lm_head, model_classes, resolve_arm
from lightning_modules.attention import attention_settings, install_attention
from lightning_modules.rotary import install_sdpa
from lightning_modules.training import (  # noqa: F401 (check_warmup, schedule_end, PolynomialSchedule: train.py, tests)
    PolynomialSchedule,
    TrainingModule,
    check_optimisation,
    check_warmup,
    schedule_end,
)

ARCHITECTURE = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "max_position_embeddings", "position_embeddings", "pad_vocab_to_multiple_of")
ATTENTION = ("attention", "clip_softmax_gamma", "clip_softmax_zeta", "attention_gate_init")  # softmax when absent


class MLMOutput(NamedTuple):
    loss: Tensor  # mean cross-entropy over the masked positions
    count: Tensor  # masked positions
    hidden: tuple[Tensor, ...] | None  # every layer's [batch, seq, hidden] (detached), when asked for


def mlm_step(model, batch: dict[str, Tensor], hidden_states: bool = False, vocab_size: int | None = None,
             grad_states: bool = False) -> MLMOutput:
    """The MLM loss of a batch, and (`hidden_states`) the hidden states of every layer of the same forward pass.

    batch: input_ids [batch, seq]; positions [batch, k] (indices into seq); targets [batch, k] (-100 = none). The
    causal arms' batches predict the next token: positions 0..seq-3, targets the tokens 1..seq-2 (the same code).
    Only the [batch, k, hidden] masked hidden states go through the LM head (the same result as the full logits);
    logits past `vocab_size` (padding rows of the LM head) are cut off, so they are never predicted. The hidden states
    are transformers' own `hidden_states` (0 = embedding output), detached, or with their graph (`grad_states`: a
    regulariser's term on them trains the model), from the same single forward.
    """
    out = model.base_model(input_ids=batch["input_ids"], output_hidden_states=hidden_states)
    hidden = out.last_hidden_state  # [batch, seq, hidden]
    positions = batch["positions"]
    picked = hidden.gather(1, positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))  # [batch, k, hidden]
    logits = lm_head(model)(picked)  # [batch, k, vocab rows]
    if vocab_size is not None and vocab_size < logits.shape[-1]:
        logits = logits[..., :vocab_size]
    targets = batch["targets"]
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
    states = tuple(state if grad_states else state.detach() for state in out.hidden_states) if hidden_states else None
    return MLMOutput(loss, (targets != -100).sum(), states)


def mlm_loss(model, batch: dict[str, Tensor], vocab_size: int | None = None) -> tuple[Tensor, Tensor]:
    """Mean cross-entropy over the masked positions, and their count (`mlm_step` without hidden states)."""
    loss, count, _ = mlm_step(model, batch, False, vocab_size)
    return loss, count


def padded_vocab(vocab_size: int, multiple: int) -> int:
    """Embedding rows: the vocabulary rounded up to a multiple of `multiple` (1: unchanged)."""
    return -(-vocab_size // max(multiple, 1)) * max(multiple, 1)


def build_model(vocab_size: int, hidden_size: int, num_hidden_layers: int, num_attention_heads: int,
                intermediate_size: int, max_position_embeddings: int, dropout: float, position_embeddings: bool,
                attn_implementation: str = "sdpa", pad_token_id: int = 1, bos_token_id: int = 0,
                eos_token_id: int = 2, attention: dict | None = None, objective: str = "mlm",
                positions: str | None = None, token_type_embeddings: bool = False):
    """A randomly initialised RobertaForMaskedLM; without PE, an all-zero frozen position table; without
    `token_type_embeddings` (the default, fairseq's RoBERTa), an all-zero frozen token-type row. `objective` causal
    and `positions` rope build the other arms (RobertaForCausalLM, RoFormerFor{MaskedLM,CausalLM}: lightning_modules/
    arms.py); positions None follows `position_embeddings`.

    The special ids are the tokenizer's (RoBERTa's 1/0/2 for the trained BPE): the pad id is the embedding's
    padding row and sets where RoBERTa's positions start (pad id + 1). `attention`: the attention variant's settings
    (lightning_modules/attention.py's `attention_settings`; None: softmax), recorded in the model's config.
    """
    objective, positions = resolve_arm(objective, positions, position_embeddings,
                                       (attention or {}).get("attention", "softmax"))
    if positions != "rope" and pad_token_id + 1 >= max_position_embeddings:  # nn.Embedding's assertion otherwise
        raise UserError(f"the tokenizer's pad id {pad_token_id} leaves no row of RoBERTa's position table "
                        f"(--model.max_position_embeddings {max_position_embeddings}): its positions run from pad id "
                        "+ 1, so it needs pad id + 1 + the block length rows; use a tokenizer whose pad token has a "
                        "small id (RoBERTa's 1, BERT's 0), or the rotary arm (--model.positions rope: positions from 0)")
    config_class, auto, implementation = model_classes(objective, positions)
    config = config_class(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads, intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings, hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout, type_vocab_size=1, layer_norm_eps=1e-5,
        pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
        **({"is_decoder": True, "use_cache": False} if objective == "causal" else {}),  # no key-value cache in training
    )
    model = auto.from_config(config, attn_implementation=implementation or attn_implementation)
    if positions == "rope" and attn_implementation == "sdpa":  # transformers' RoFormer attends eagerly only
        install_sdpa(model)
    if positions == "none":
        remove_position_embeddings(model)
    if not token_type_embeddings:
        zero_and_freeze(model.base_model.embeddings.token_type_embeddings)
    return install_attention(model, **(attention or {}))


def zero_and_freeze(embedding: torch.nn.Embedding) -> None:
    """An embedding table all zeros and frozen (no gradient, so not in the optimizer): it adds nothing, and an
    export still holds it, so plain transformers loads the same model."""
    with torch.no_grad():
        embedding.weight.zero_()
    embedding.weight.requires_grad_(False)


def remove_position_embeddings(model) -> None:
    """Zero and freeze the absolute position table: no positional signal, SDPA path kept."""
    zero_and_freeze(model.base_model.embeddings.position_embeddings)


class MLMModule(TrainingModule):
    """RobertaForMaskedLM + AdamW + linear warm-up and polynomial decay; logs train/loss, val/loss, val/perplexity.

    Args:
        position_embeddings: learned absolute positions (True) or none at all (False: zero, frozen table).
        objective: mlm (the paper's masked LM) or causal (the next token at every position, RobertaForCausalLM or
            RoFormerForCausalLM; ours, lightning_modules/arms.py).
        positions: learned, none or rope (RoFormer's rotary positions; ours); default: learned, or none with
            position_embeddings false.
        token_type_embeddings: transformers' learned token-type row (True; ours) or fairseq's none (False, the
            default: a zero, frozen row, as the paper's RoBERTa has). Checkpoints made before this option had a
            learned row and resume only with True.
        vocab_size: embedding rows (linked from the datamodule's tokenizer by train.py).
        hidden_size: the RoBERTa architecture's hidden size.
        num_hidden_layers: its transformer layers.
        num_attention_heads: its attention heads per layer.
        intermediate_size: its feed-forward width.
        max_position_embeddings: its position table's rows, RoBERTa's 2 offset rows included (block length + 2).
        dropout: hidden and attention dropout.
        lr: AdamW's peak learning rate (fused AdamW wherever the device has the kernels; default 1e-4, the paper's).
        betas: AdamW's (beta1, beta2) (default RoBERTa's (0.9, 0.98)).
        eps: AdamW's epsilon (default RoBERTa's 1e-6).
        weight_decay: AdamW's decoupled weight decay, on every trained parameter as fairseq (the paper's trainer)
            does (default 0.01); a frozen table is not trained at all.
        decay_bias_and_norm: False keeps biases and LayerNorm weights out of weight decay (BERT's and transformers'
            convention; not the paper's).
        warmup_steps: linear warm-up to `lr` over this many steps.
        decay_steps: the step at which the (1 - progress)^power decay reaches `end_lr` (default: the trainer's
            max_steps).
        end_lr: the learning rate at `decay_steps`.
        power: the decay's exponent (1: linear).
        compile: torch.compile the forward pass and the loss together (two graphs: with and without the hidden
            states the live-statistics callbacks capture); validation runs eagerly.
        attn_implementation: transformers attention backend ("sdpa"; "eager" only for debugging); the softmax inside
            gated attention uses it, clipped softmax brings its own.
        pad_vocab_to_multiple_of: embedding and LM-head rows rounded up to this multiple (64: tensor-core-friendly
            matmuls); the extra rows are never input nor predicted, and the export drops them.
        pad_token_id: the tokenizer's pad id (linked from the datamodule by train.py; default RoBERTa's 1).
        bos_token_id: the tokenizer's beginning-of-sequence id (linked likewise; default RoBERTa's 0).
        eos_token_id: the tokenizer's end-of-sequence id (linked likewise; default RoBERTa's 2).
        regularizer: an isotropy regulariser on the training forward's hidden states: none (default), istar or
            cosreg (lightning_modules/regularizers.py; docs/finetuning.md).
        reg_weight: its weight λ in the loss (λ > 0 towards isotropy, λ < 0 away).
        reg_layers: the hidden-state layers it acts on (default: every layer 1..L).
        zeta: I-STAR's shrinkage towards the covariance of the epoch's first tokens.
        reg_shrinkage_tokens: tokens of that covariance (C0).
        attention: softmax (the paper's), clipped_softmax or gated (Bondarenko et al. 2023;
            lightning_modules/attention.py).
        clip_softmax_gamma: clipped softmax's gamma in clip((zeta - gamma) softmax + gamma, 0, 1) (None: their
            BERT recipe's -0.025); only with attention clipped_softmax.
        clip_softmax_zeta: its zeta (None: 1).
        attention_gate_init: gated attention's initial gate probability sigmoid(bias) (None: 0.25); only with
            attention gated.
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
        decay_bias_and_norm: bool = True,
        warmup_steps: int = 10_000,
        decay_steps: int | None = None,
        end_lr: float = 0.0,
        power: float = 1.0,
        compile: bool = False,
        attn_implementation: str = "sdpa",
        pad_token_id: int = 1,
        bos_token_id: int = 0,
        eos_token_id: int = 2,
        pad_vocab_to_multiple_of: int = 1,
        regularizer: str = "none",
        reg_weight: float = 0.0,
        reg_layers: str | int | list[int] | None = None,
        zeta: float = 0.2,
        reg_shrinkage_tokens: int = 250_000,
        attention: str = "softmax",
        clip_softmax_gamma: float | None = None,
        clip_softmax_zeta: float | None = None,
        attention_gate_init: float | None = None,
        objective: str = "mlm",
        positions: str | None = None,
        token_type_embeddings: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        settings = attention_settings(attention, clip_softmax_gamma, clip_softmax_zeta, attention_gate_init)
        objective, positions = resolve_arm(objective, positions, position_embeddings, attention)
        self.hparams.positions = positions  # resolved: what the checkpoint records
        self.hparams.position_embeddings = positions == "learned"
        check_optimisation(self.hparams)
        self.make_regularizer()
        if hidden_size % num_attention_heads:
            raise UserError(f"--model.hidden_size {hidden_size} is not a multiple of num_attention_heads "
                            f"{num_attention_heads}")
        if pad_vocab_to_multiple_of < 1:
            raise UserError(f"--model.pad_vocab_to_multiple_of must be at least 1, got {pad_vocab_to_multiple_of}")
        rows = padded_vocab(vocab_size, pad_vocab_to_multiple_of)
        self.model = build_model(rows, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
                                 max_position_embeddings, dropout, position_embeddings, attn_implementation,
                                 pad_token_id, bos_token_id, eos_token_id, settings, objective, positions,
                                 token_type_embeddings)
        self.regularizer.bind(num_hidden_layers)
        self.val_loss = MeanMetric()
        self.last_val_loss: dict | None = None  # {"value", "step"} of the latest validation, saved in checkpoints
        self._compiled = compile_step(self.model) if compile else None

    # -- facts the datamodule and the CLI check against --

    @property
    def vocab_size(self) -> int:
        return self.hparams.vocab_size

    @property
    def max_length(self) -> int:
        """Longest input: the position table minus RoBERTa's padding offset (pad id + 1); RoFormer's, all of it."""
        return model_max_length(self.model)

    @property
    def objective(self) -> str:
        """mlm or causal: what the data module's batches predict."""
        return self.hparams.objective

    # -- steps --

    @property
    def uses_dropout(self) -> bool:
        return self.hparams.dropout > 0

    def forward(self, batch: dict[str, Tensor], hidden_states: bool = False, grad_states: bool = False) -> MLMOutput:
        """The loss (and every layer's hidden states when asked); compiled in training when `compile` is on."""
        step = self._compiled if self._compiled is not None and self.training else mlm_step
        return step(self.model, batch, hidden_states, self.hparams.vocab_size, grad_states)

    def _shared_step(self, batch: dict[str, Tensor], stage: str) -> Tensor:
        tap = self.hidden_state_tap
        if stage != "train":
            loss, count, hidden = self(batch, hidden_states=tap.active)
            if hidden is not None:
                tap.keep(hidden)
            self.val_loss.update(loss.detach(), count)
            return loss
        wanted = self.request_states()  # the regulariser's request (with the graph) and the callbacks', one forward
        try:
            loss, _, hidden = self(batch, hidden_states=wanted, grad_states=tap.wants_grad)
        except BaseException:
            tap.release(self.regularizer)
            raise
        return self.regularized(loss, hidden, None)  # blocks are full: every token counts

    def shrinkage_states(self, batch: dict) -> tuple[list[Tensor], Tensor | None]:
        """I-STAR's C0 pass: the regulariser's layers of unmasked training blocks (every token counts)."""
        states = self.model.base_model(input_ids=batch["input_ids"].to(self.device),
                                       output_hidden_states=True).hidden_states
        return [states[layer] for layer in self.regularizer.layers], None

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._shared_step(batch, "train")

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._shared_step(batch, "val")

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()  # token-weighted mean over every rank's blocks
        self.val_loss.reset()
        self.log_dict({"val/loss": loss, "val/perplexity": torch.exp(loss)}, prog_bar=True, sync_dist=True)
        if not self.trainer.sanity_checking:
            self.last_val_loss = {"value": float(loss), "step": self.trainer.global_step}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """The latest validation's loss and its step beside the weights (analyze.py trajectory reads it), after the
        base class's check that no step was non-finite."""
        super().on_save_checkpoint(checkpoint)
        if self.last_val_loss is not None:
            checkpoint["val_loss"] = dict(self.last_val_loss)

    # -- checkpoints and export --

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        check_architecture(checkpoint.get("hyper_parameters", {}), self.hparams, "the checkpoint")
        super().on_load_checkpoint(checkpoint)
        self.last_val_loss = checkpoint.get("val_loss")
        data = getattr(self._trainer, "datamodule", None)
        if hasattr(data, "adapt_checkpoint"):  # before Lightning restores its loops from the same dict
            data.adapt_checkpoint(checkpoint)

    def on_fit_end(self) -> None:
        if self.monitor is not None:
            self.monitor.check(self.trainer.strategy)  # a run that ends past a non-finite step exports nothing
        tokenizer = getattr(self.trainer.datamodule, "tokenizer", None)
        directory = Path(self.trainer.default_root_dir) / "export"
        export(self, tokenizer, directory)
        self.trainer.strategy.barrier("export")


def compile_step(model):
    """`mlm_step` compiled whole for `model` (fullgraph, static shapes): one graph with hidden states, one without.

    transformers installs its hidden-state hooks lazily, at the first forward that asks for hidden states, which
    cannot happen inside a graph: one eager two-token forward installs them now (inactive until asked for)."""
    training = model.training
    with torch.no_grad():
        model.eval()
        model.base_model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=model.device), output_hidden_states=True)
    model.train(training)
    return torch.compile(mlm_step, fullgraph=True, dynamic=False)


def check_architecture(saved: dict, current, what: str) -> None:
    """One clear line when a checkpoint's architecture (PE or not, sizes, vocabulary) differs from the config's."""
    if "position_embeddings" in saved and saved["position_embeddings"] != current["position_embeddings"]:
        def name(flag):
            return "with positional embeddings" if flag else "without positional embeddings (no-PE)"
        raise UserError(f"{what} was trained {name(saved['position_embeddings'])} but the config asks for a model "
                        f"{name(current['position_embeddings'])}; resume with the matching config")
    if "objective" in current and arm_of(saved) != arm_of(current):
        raise UserError(f"{what} was trained as the {'-'.join(arm_of(saved))} arm but the config asks for "
                        f"{'-'.join(arm_of(current))}; resume with the matching --model.objective and --model.positions")
    if "token_type_embeddings" in current and token_type_of(saved) != current["token_type_embeddings"]:
        def row(flag):
            return "a learned token-type row" if flag else "fairseq's zero, frozen token-type row"
        hint = " (made before the zero row became the default)" if "token_type_embeddings" not in saved else ""
        raise UserError(f"{what} was trained with {row(token_type_of(saved))}{hint} but the config asks for "
                        f"{row(current['token_type_embeddings'])}; resume with --model.token_type_embeddings "
                        f"{str(token_type_of(saved)).lower()}")
    if "attention" in current and attention_of(saved) != attention_of(current):
        raise UserError(f"{what} was trained with attention {describe(attention_of(saved))} but the config asks for "
                        f"{describe(attention_of(current))}; resume with the matching --model.attention")
    for key in ARCHITECTURE:
        if key in saved and saved[key] != current[key]:
            noun = "tokenizer vocabulary" if key == "vocab_size" else key
            raise UserError(f"{what} has {key}={saved[key]} but the config gives {current[key]} ({noun} mismatch)")


def token_type_of(hparams) -> bool:
    """Whether an MLMModule's hyper-parameters train a learned token-type row: a checkpoint made before the option
    did (transformers' row); since, the default is fairseq's zero, frozen row."""
    return bool(hparams.get("token_type_embeddings", True))


def attention_of(hparams) -> dict:
    """The attention variant of an MLMModule's hyper-parameters, defaults filled in (softmax for a checkpoint made
    before the variants)."""
    return attention_settings(hparams.get("attention") or "softmax", *(hparams.get(key) for key in ATTENTION[1:]))


def describe(settings: dict) -> str:
    return " ".join([settings["attention"], *(f"{key}={value}" for key, value in settings.items() if key != "attention")])


@rank_zero_only
def export(module: MLMModule, tokenizer, directory: Path) -> None:
    """config.json + model.safetensors + tokenizer files that AutoModelForMaskedLM / AutoTokenizer load."""
    if tokenizer is None:
        raise UserError("no tokenizer to export with the model (train with MLMDataModule)")
    tokenizer.model_max_length = module.max_length
    model = module.model
    if model.config.vocab_size != module.vocab_size:  # padding rows dropped: the tokenizer's size, the same logits
        model = copy.deepcopy(model).cpu()
        model.resize_token_embeddings(module.vocab_size, mean_resizing=False)
    # owner: the files an earlier export wrote there and this one does not (another shard layout: a stale
    # model.safetensors beside a new index is what transformers would load) are removed; legacy: of an export made
    # before the record existed, its transformers weight files alone (core.output.export_weights)
    with staged_output(directory, "the export", owner="export", legacy=export_weights) as stage, \
            quiet_transformers():  # no bar: one shard
        model.save_pretrained(stage)
        tokenizer.save_pretrained(stage)
        umask = os.umask(0)
        os.umask(umask)
        for path in stage.iterdir():  # readable by the group like any other file (some writers use 0600)
            path.chmod(0o666 & ~umask)
