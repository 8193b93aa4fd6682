"""Pretraining arms beyond RoBERTa's MLM: the objective (masked or causal) and the positions (learned, none, rotary),
on the same stack sizes with everything else equal, each one of transformers' own classes, so an export loads in plain
transformers.

    python train.py fit --config configs/pretrain/tiny.yaml --model.objective causal                     # causal-learned
    python train.py fit --config configs/pretrain/tiny.yaml --model.objective causal --model.positions none
    python train.py fit --config configs/pretrain/tiny.yaml --model.positions rope                       # mlm-rope
    python train.py fit --config configs/pretrain/tiny.yaml --model.objective causal --model.positions rope

    objective  positions  class (what loads the export)  hidden states
    mlm        learned    RobertaForMaskedLM             the paper's RoBERTa (the default, unchanged)
    mlm        none       RobertaForMaskedLM             the position table all zeros and frozen (Table 4's no-PE)
    causal     learned    RobertaForCausalLM             RoBERTa's stack with is_decoder: a token sees itself and
    causal     none       RobertaForCausalLM             the tokens before it (transformers' causal mask, SDPA)
    mlm        rope       RoFormerForMaskedLM            BERT's post-LN stack with rotary positions (Su et al.)
    causal     rope       RoFormerForCausalLM            the same, causal

RoFormer against RoBERTa, at the same sizes: the same embeddings (word + token type, LayerNorm, dropout) without the
absolute table, the same post-LN layers (LayerNorm eps 1e-5 as given, GELU, the same dropout), the same LM head
(dense, GELU, LayerNorm, decoder tied to the word embeddings) and initialisation (normal, std 0.02). What differs:
queries and keys are rotated by position in every layer (RoFormer's sinusoids, base 10000, on pairs of adjacent
dimensions of each head; Llama rotates the two halves instead: the same rotation up to a permutation of a head's
dimensions), positions are numbered from 0 (RoBERTa's from pad id + 1, so RoFormer takes --model.max_position_embeddings
positions, 2 more), and RoFormer's attention runs through SDPA (lightning_modules/rotary.py: transformers' RoFormer
attends eagerly only, which doubles a GPU step; an export loads with that eager attention, the same hidden states). The attention variants (clipped softmax, gated) are RoBERTa's only.

The causal objective is the next token's cross-entropy at every position of the same packed blocks (no masking):
the data module serves the blocks as they are, with `positions` 0..T-3 and `targets` the tokens 1..T-2, the block's
closing </s> left out (its place is fixed: predicting it would teach position; datamodules/masking.py
NextTokenCollator), so `mlm_step` computes both objectives.
"""

from __future__ import annotations

from core.errors import UserError

OBJECTIVES = ("mlm", "causal")
POSITIONS = ("learned", "none", "rope")
CLASSES = {("mlm", "learned"): "RobertaForMaskedLM", ("mlm", "none"): "RobertaForMaskedLM",
           ("causal", "learned"): "RobertaForCausalLM", ("causal", "none"): "RobertaForCausalLM",
           ("mlm", "rope"): "RoFormerForMaskedLM", ("causal", "rope"): "RoFormerForCausalLM"}


def resolve_arm(objective: str, positions: str | None, position_embeddings: bool, attention: str = "softmax"
                ) -> tuple[str, str]:
    """(objective, positions) checked: positions default to learned, or none with --model.position_embeddings false
    (which means no absolute table: none or rope); one line for an unknown value, a contradiction or an attention
    variant RoFormer does not have."""
    if objective not in OBJECTIVES:
        raise UserError(f"--model.objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if positions is None:
        positions = "learned" if position_embeddings else "none"
    if positions not in POSITIONS:
        raise UserError(f"--model.positions must be one of {', '.join(POSITIONS)}, got {positions!r}")
    if not position_embeddings and positions == "learned":
        raise UserError("--model.position_embeddings false contradicts --model.positions learned; give one of them "
                        "(--model.positions none is the no-PE arm)")
    if positions == "rope" and attention != "softmax":
        raise UserError(f"--model.attention {attention} is RoBERTa's (--model.positions learned or none); the rotary "
                        "arm (RoFormer) has softmax attention only")
    return objective, positions


def arm_of(hparams) -> tuple[str, str]:
    """(objective, positions) of an MLMModule's hyper-parameters; a checkpoint made before the arms: RoBERTa's MLM."""
    return resolve_arm(hparams.get("objective") or "mlm", hparams.get("positions"),
                       bool(hparams.get("position_embeddings", True)), hparams.get("attention") or "softmax")


def model_classes(objective: str, positions: str):
    """(config class, auto model class, attention implementation or None for transformers' default) of an arm."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, RobertaConfig, RoFormerConfig

    auto = AutoModelForCausalLM if objective == "causal" else AutoModelForMaskedLM
    return (RoFormerConfig, auto, "eager") if positions == "rope" else (RobertaConfig, auto, None)


def lm_head(model):
    """The prediction head of an arm's model: RoBERTa's `lm_head`, RoFormer's `cls` (hidden -> vocabulary logits)."""
    head = getattr(model, "lm_head", None)
    return head if head is not None else model.cls


def describe_arm(objective: str, positions: str) -> str:
    """"causal-none (RobertaForCausalLM)": the arm's name and the transformers class that loads its export."""
    return f"{objective}-{positions} ({CLASSES[objective, positions]})"
