"""Reading this project's MLM checkpoints back: a .ckpt as a RobertaForMaskedLM (or its arm's class: RobertaForCausalLM,
RoFormerForMaskedLM, RoFormerForCausalLM) with its tokenizer.

    checkpoint = read_checkpoint("runs/tiny/checkpoints/last.ckpt")      # weights-only, or one line naming what is wrong
    masked_lm, tokenizer = load_checkpoint_model("runs/tiny/checkpoints/last.ckpt")   # weights + embedded tokenizer
    tokenizer = checkpoint_tokenizer("runs/tiny/checkpoints/last.ckpt")   # the tokenizer alone (no weight read)

A checkpoint embeds its tokenizer as files (JSON and text), so a .ckpt alone is a complete encoder. It is read
weights-only (core/safe_load.py): a crafted checkpoint is refused before any of it runs.
"""

from __future__ import annotations

from pathlib import Path

from core.errors import UserError, first_line
from core.models import model_max_length
from core.safe_load import load_weights_only
from core.tokenizers import load_tokenizer, tokenizer_from_files
from lightning_modules.arms import arm_of
from lightning_modules.mlm import ARCHITECTURE, attention_of, build_model, padded_vocab, token_type_of

KINDS = {"mlm": ("MLM pretraining", "MLMModule", "position_embeddings"),  # what a checkpoint of each is, and the
         "finetune": ("fine-tuning", "FineTuneModule", "classes")}  # hyper-parameter only its module has


def read_checkpoint(path: str | Path, kind: str = "mlm") -> dict:
    """A .ckpt of this project's MLM pretraining (or `kind` "finetune": fine-tuning), read weights-only
    (memory-mapped), or one line naming the file and what is wrong: empty, truncated or corrupt, needing code to
    unpickle, or not this project's (hyper-parameters without the architecture)."""
    checkpoint = load_weights_only(path, mmap=True)
    hparams = checkpoint.get("hyper_parameters") if isinstance(checkpoint, dict) else None
    what, module, key = KINDS[kind]
    if not isinstance(hparams, dict) or "state_dict" not in checkpoint or key not in hparams:
        raise UserError(f"{path} is not a checkpoint of this project's {what} (no {module} hyper-parameters and "
                        "state_dict)")
    if kind != "mlm":
        return checkpoint
    missing = [key for key in ARCHITECTURE if key not in hparams and key != "pad_vocab_to_multiple_of"]  # default 1
    if missing:
        raise UserError(f"{path} is not a checkpoint of this project's MLM pretraining: its hyper-parameters lack "
                        f"{', '.join(missing)}")
    return checkpoint


def load_checkpoint_model(path: str | Path, tokenizer=None):
    """(RobertaForMaskedLM or the arm's class, tokenizer) from this project's .ckpt: hyper-parameters (the attention
    variant and the arm included), weights, embedded tokenizer (`tokenizer`: that one, read already by
    `checkpoint_tokenizer`, and not built again)."""
    checkpoint = read_checkpoint(path)
    hparams = checkpoint["hyper_parameters"]
    keys = [key for key in ARCHITECTURE if key not in ("position_embeddings", "pad_vocab_to_multiple_of")]
    specials = {key: hparams.get(key, default) for key, default in
                (("pad_token_id", 1), ("bos_token_id", 0), ("eos_token_id", 2))}  # older checkpoints: RoBERTa's
    rows = padded_vocab(hparams["vocab_size"], hparams.get("pad_vocab_to_multiple_of", 1))
    attention = attention_of(hparams)  # softmax for a checkpoint made before the attention variants
    try:
        objective, positions = arm_of(hparams)  # RoBERTa's MLM for a checkpoint made before the arms
        # the run's own dropout, as its export's config has it (eval mode here; fine-tuning from it trains with it)
        model = build_model(**{key: hparams[key] for key in keys if key != "vocab_size"}, vocab_size=rows,
                            dropout=hparams.get("dropout", 0.1), position_embeddings=hparams["position_embeddings"],
                            **specials,
                            attention=attention, objective=objective, positions=positions,
                            token_type_embeddings=token_type_of(hparams))
    except (TypeError, ValueError, RuntimeError, UserError) as error:  # sizes or an arm that describe no model
        raise UserError(f"{path}: its hyper-parameters describe no model ({first_line(error)})") from None
    state = {key.removeprefix("model."): value for key, value in checkpoint["state_dict"].items()
             if key.startswith("model.")}
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as error:  # a weight of another shape
        raise UserError(f"{path}: weights do not fit the model its hyper-parameters describe "
                        f"({first_line(error).removeprefix('Error(s) in loading state_dict for RobertaForMaskedLM:')})"
                        ) from None
    if unexpected or {key for key in missing if not key.endswith(("decoder.weight", "decoder.bias"))}:  # tied
        raise UserError(f"{path}: weights do not fit the model its hyper-parameters describe "
                        f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    if rows != hparams["vocab_size"]:  # the padding rows of the fast recipe: dropped, as in the export
        model.resize_token_embeddings(hparams["vocab_size"], mean_resizing=False)
    tokenizer = tokenizer if tokenizer is not None else checkpoint_tokenizer(path, checkpoint)
    tokenizer.model_max_length = model_max_length(model)
    return model.eval(), tokenizer


def checkpoint_tokenizer(path: str | Path, checkpoint: dict | None = None):
    """The tokenizer embedded in this project's .ckpt (else the one exported beside it), without building the model:
    the checkpoint is read weights-only and memory-mapped, so its weights are never read (`checkpoint`: read
    already)."""
    checkpoint = read_checkpoint(path) if checkpoint is None else checkpoint
    files = next((value.get("tokenizer_files") for value in checkpoint.values()
                  if isinstance(value, dict) and "tokenizer_files" in value), None)
    return tokenizer_from_files(files, f"the tokenizer embedded in {path}") if files else _tokenizer_beside(Path(path))


def _tokenizer_beside(path: Path):
    for candidate in (path.parent.parent / "export", path.parent / "export"):
        if (candidate / "tokenizer_config.json").exists():
            return load_tokenizer(candidate, mask=False, pad=False)  # as exported: an analysis needs no mask
    raise UserError(f"no tokenizer in {path} nor in an export/ beside it")
