"""Reading this project's MLM checkpoints back: a .ckpt as a RobertaForMaskedLM with its tokenizer.

    checkpoint = read_checkpoint("runs/tiny/checkpoints/last.ckpt")      # or one line naming what is wrong
    masked_lm, tokenizer = load_checkpoint_model("runs/tiny/checkpoints/last.ckpt")   # weights + embedded tokenizer

A checkpoint embeds its tokenizer as files (JSON and text), so a .ckpt alone is a complete encoder.
"""

from __future__ import annotations

from pathlib import Path

import torch

from core.errors import UserError
from core.tokenizers import load_tokenizer, tokenizer_from_files
from lightning_modules.mlm import build_model, padded_vocab


def read_checkpoint(path: str | Path) -> dict:
    """A .ckpt of this project's MLM pretraining (memory-mapped), or one line naming the file and what is wrong."""
    if Path(path).is_file() and Path(path).stat().st_size == 0:
        raise UserError(f"cannot read checkpoint {path}: the file is empty")
    try:
        checkpoint = torch.load(str(path), map_location="cpu", weights_only=False, mmap=True)
    except Exception as error:  # torch raises many types for a bad file; its messages run over several sentences
        text = str(error).splitlines()[0] if str(error) else type(error).__name__
        reason = "not a torch.save zip archive" if "mmap can only be used" in text else text.split(". ")[0]
        raise UserError(f"cannot read checkpoint {path}: truncated or corrupt ({reason})") from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint or \
            "position_embeddings" not in (checkpoint.get("hyper_parameters") or {}):
        raise UserError(f"{path} is not a checkpoint of this project's MLM pretraining (no MLMModule "
                        "hyper-parameters and state_dict)")
    return checkpoint


def load_checkpoint_model(path: str | Path):
    """(RobertaForMaskedLM, tokenizer) from this project's .ckpt: hyper-parameters, weights, embedded tokenizer."""
    checkpoint = read_checkpoint(path)
    hparams = checkpoint["hyper_parameters"]
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
            "max_position_embeddings")
    specials = {key: hparams.get(key, default) for key, default in
                (("pad_token_id", 1), ("bos_token_id", 0), ("eos_token_id", 2))}  # older checkpoints: RoBERTa's
    rows = padded_vocab(hparams["vocab_size"], hparams.get("pad_vocab_to_multiple_of", 1))
    model = build_model(**{key: hparams[key] for key in keys if key != "vocab_size"}, vocab_size=rows, dropout=0.0,
                        position_embeddings=hparams["position_embeddings"], **specials)
    state = {key.removeprefix("model."): value for key, value in checkpoint["state_dict"].items()
             if key.startswith("model.")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.decoder.weight", "lm_head.decoder.bias"}:
        raise UserError(f"{path}: weights do not fit the model its hyper-parameters describe "
                        f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    if rows != hparams["vocab_size"]:  # the padding rows of the fast recipe: dropped, as in the export
        model.resize_token_embeddings(hparams["vocab_size"], mean_resizing=False)
    files = next((value.get("tokenizer_files") for value in checkpoint.values()
                  if isinstance(value, dict) and "tokenizer_files" in value), None)
    tokenizer = tokenizer_from_files(files) if files else _tokenizer_beside(Path(path))
    tokenizer.model_max_length = hparams["max_position_embeddings"] - (model.config.pad_token_id + 1)
    return model.eval(), tokenizer


def _tokenizer_beside(path: Path):
    for candidate in (path.parent.parent / "export", path.parent / "export"):
        if (candidate / "tokenizer_config.json").exists():
            return load_tokenizer(candidate)
    raise UserError(f"no tokenizer in {path} nor in an export/ beside it")
