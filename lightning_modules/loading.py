"""What loading a model checks: is it a model the project reads, did its weights load, does it have an MLM head.

    check_is_encoder(config, "bert-base-uncased", decoders=True)   # a one-line UserError for a model it cannot read
    check_loading(source, info, model)       # weights missing or of another shape: refused (or warned, when allowed)
    head_note, base_info = split_head(masked_lm, info)   # a masked- (or causal-) LM load's report: its head, its base's
    load_failure(error, "its weights")       # a library's loading error as one line
    config = checked_config(model_dir, source); tokenizer = tokenizer_of(model_dir, source)   # read, checked, one line

lightning_modules/encoder.py's load_encoder and lightning_modules/finetune.py call these.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from pathlib import Path

from torch import nn

from core.errors import REMOTE_CODE, UserError, library_line
from core.families import check_position_type
from core.models import check_layer_groups, mlm_head
from core.sources import cannot_load, pretrained
from core.tokenizers import check_tokenizer_files


def split_head(model: nn.Module, info: Mapping, what: str = "MLM head") -> tuple[str | None, dict]:
    """A masked-LM (or causal-LM: `what` "LM head") model's load report split in two: (None when its head's weights
    were all in the checkpoint, else why it has no head; the report of its base model alone, key prefixes stripped,
    for `check_loading`)."""
    prefix = f"{model.base_model_prefix}."
    base, head = {}, []
    for kind in ("missing_keys", "mismatched_keys"):
        keys = [key[0] if isinstance(key, tuple) else key for key in info.get(kind, ())]
        head += [str(key) for key in keys if not str(key).startswith(prefix)]
        base[kind] = [str(key).removeprefix(prefix) for key in keys if str(key).startswith(prefix)]
    if mlm_head(model) is None:
        return f"no {what} ({type(model).__name__}: a head layout this project does not know)", base
    if head:
        shown = ", ".join(sorted(head)[:3]) + (", ..." if len(head) > 3 else "")
        return f"no {what} (its weights are not in the checkpoint: {shown})", base
    return None, base


def load_failure(error: Exception, what: str) -> str:
    """A library's loading error as one line; a torn file (safetensors' "incomplete metadata, file not fully
    covered", a JSON file cut short) says what it belongs to and that it is truncated or corrupt."""
    text = library_line(error)
    if type(error).__name__ == "SafetensorError":
        return f"model.safetensors is truncated or corrupt ({text})"
    if isinstance(error, json.JSONDecodeError) or "EOF while parsing" in text:
        return f"{what}: a JSON file is truncated or corrupt ({text})"
    return text if type(error).__module__ == "builtins" or text == REMOTE_CODE else f"{type(error).__name__}: {text}"


def check_loading(source, info: Mapping, model: nn.Module, allow: bool = False,
                  option: str = "--allow_random_weights") -> None:
    """Encoder weights that were not in the checkpoint or had another shape there would be randomly initialised: one
    line naming how many, or with `allow` (`option` on the command line), a warning naming them. The pooler (unused:
    hidden states only) and a checkpoint's task heads (`lm_head`, `cls`, ...: unexpected keys) are expected when a
    masked-LM checkpoint is loaded as an encoder and are not counted."""
    missing = sorted(key for key in info.get("missing_keys", ()) if not key.split(".")[0] == "pooler")
    mismatched = sorted(str(key[0] if isinstance(key, tuple) else key) for key in info.get("mismatched_keys", ()))
    if (missing or mismatched) and not allow:
        total = sum(1 for key in model.state_dict() if key.split(".")[0] != "pooler")
        parts = ([f"{len(missing)} of its {total} weights are not in the checkpoint"] if missing else []) + \
                ([f"{len(mismatched)} have another shape there"] if mismatched else [])
        raise UserError(f"encoder {source}: {' and '.join(parts)} (e.g. {(missing + mismatched)[0]}): its weights do "
                        "not match its config.json (another architecture's?), so they would be randomly "
                        f"initialised; {option} analyses such a partly random model")
    _warn_about_loading(source, missing, mismatched)


def _warn_about_loading(source, missing: list[str], mismatched: list[str]) -> None:
    """One warning naming the encoder weights that were randomly initialised (allowed by the user)."""
    for what, keys in (("not in the checkpoint (randomly initialised)", missing),
                       ("of another shape in the checkpoint (randomly initialised)", mismatched)):
        if keys:
            shown = ", ".join(keys[:5]) + (f", ... ({len(keys)} in all)" if len(keys) > 5 else "")
            warnings.warn(f"encoder {source}: weights {what}: {shown}", stacklevel=3)


def has_masked_lm(config) -> bool:
    """Whether transformers has a masked-LM class for the config's model type (a decoder's config is_decoder)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    return config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False)


def check_is_encoder(config, source, decoders: bool = False, weights_of: str | None = None) -> None:
    """A masked-LM encoder (or, with `decoders`, also a decoder-only causal LM), else one line; an encoder-decoder
    (T5, BART) never. `weights_of`: the model's directory or hub id, whose weights' names tell a stale
    position_embedding_type from a trained one (core.families.check_position_type)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    decoder = getattr(config, "is_decoder", False) or config.model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES
    if getattr(config, "is_encoder_decoder", False):
        raise UserError(f"{source} is a {config.model_type!r} encoder-decoder model; only encoders and decoder-only "
                        "models are analysed")
    if decoder and not decoders:
        raise UserError(f"{source} is a {config.model_type!r} model, not a BERT-family (masked-LM) encoder")
    if config.get_text_config() is not config:  # Gemma 3 from 4B, Llama 4, Mistral 3, Qwen2.5-VL
        raise UserError(f"{source} is a {config.model_type!r} multimodal model (its language model's config is its "
                        "text_config): only text encoders and decoder-only models are analysed")
    if not getattr(config, "num_attention_heads", None):
        raise UserError(f"{source} is a {config.model_type!r} model whose config names no attention heads "
                        "(num_attention_heads: a recurrent or state-space model has none): only transformers are analysed")
    if decoder and config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(f"{source} is a {config.model_type!r} model, neither a masked-LM encoder nor a decoder-only "
                        "causal LM")
    check_layer_groups(config, str(source))
    check_position_type(config, str(source), weights_of)


def checked_config(model_dir: str, source):
    """The model's config (one line when it cannot be read), of an encoder or decoder this project reads, from a
    directory that holds tokenizer files or a hub id (at its revision: `org/name@v1.0`)."""
    from transformers import AutoConfig

    try:
        config = pretrained(AutoConfig, model_dir)
    except (OSError, ValueError) as error:
        raise cannot_load("encoder", source, library_line(error)) from None
    check_is_encoder(config, source, decoders=True, weights_of=model_dir)
    if Path(model_dir).is_dir():
        check_tokenizer_files(Path(model_dir), f"encoder {str(source)!r}")
    return config


def tokenizer_of(model_dir: str, source):
    """The tokenizer of a model directory or hub id (at its revision; one line when it cannot be loaded)."""
    from transformers import AutoTokenizer

    # a truncated or corrupt file of the user's raises OSError, ValueError, JSONDecodeError, SafetensorError, the
    # tokenizers library's plain Exception, torch's RuntimeError for a torn pytorch_model.bin: one line each
    try:
        return pretrained(AutoTokenizer, model_dir)
    except Exception as error:
        raise cannot_load("encoder", source, load_failure(error, 'its tokenizer')) from None
