"""Interventions inside an encoder's forward pass: what the model computes when one part of it is removed, as
context managers that hook the forward pass and restore it on exit (STYLE.md 12).

    with intervene(encoder.model, Intervention("position_mean")):       # every forward inside sees the change
        batch = encoder(**inputs)
    with intervene(model, Intervention("layernorm_zero", dims=(223,))):  # gamma and beta of dim 223, every LayerNorm
    with intervene(model, Intervention("activation_mean", dims=(223,), layers=(1, 2), means=result.mean)):
    check_intervention(model, "token_type_zero", "MiniLM")   # one line (UserError) when the model lacks the part
    loss, count = masked_lm_loss(encoder, batch)              # the MLM loss, under whatever intervention is active

The interventions (`INTERVENTIONS`):
    position_mean     the usable rows of the absolute position table replaced by their mean row (position
                      information removed, the average offset kept)
    position_shuffle  the usable rows permuted (seeded)
    position_zero     the usable rows zeroed
    token_type_zero   the token-type (segment) embedding rows zeroed
    layernorm_zero    gamma and beta of `dims` zeroed in every LayerNorm over the hidden size (or in those that write
                      one of `layers`; core.models.layer_norms): those outputs are 0 (Kovaleva et al. 2021)
    activation_zero   the hidden state's `dims` set to 0 at each of `layers` (the output of the embeddings, layer 0, or
                      of transformer layer l), so that later layers see the change (Sun et al. 2024, set_zero)
    activation_mean   the same dims set to their mean over the data (`means` [layers, hidden]: the unmodified model's,
                      Sun et al.'s set_mean)

The usable rows of a position table are those a token can read (core.models.position_rows): positions offset ..
offset + max length - 1. RoBERTa numbers positions from padding_idx + 1, so its rows below that (padding's row,
which no counted token reads) are left as they are, and "the table's mean row" is the mean of the usable rows; for
BERT (offset 0) that is every row.

Every edit is a forward hook that returns the edited output, registered first (prepend), so it runs before
transformers' own output-recording hooks and the hidden states a model reports are the edited ones; the hooks are
removed on exit, even on error. No parameter is ever written: the model object, and the file on disk, stay
byte-identical. Each equals the model edited by hand (tests/test_intervene.py: the table overwritten, gamma and beta
zeroed, layers l + 1.. run on the zeroed hidden state).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.capture import layer_output
from core.errors import UserError
from core.models import (
    encoder_layers,
    layer_norms,
    mlm_head,
    model_max_length,
    position_embedding,
    position_offset,
    token_type_embedding,
)
from lightning_modules.encoder import FrozenEncoder
from lightning_modules.mlm import mlm_step

INTERVENTIONS = {
    "position_mean": "every usable row of the absolute position table replaced by their mean row",
    "position_shuffle": "the usable rows of the absolute position table permuted (seeded)",
    "position_zero": "the usable rows of the absolute position table zeroed",
    "token_type_zero": "the token-type embedding rows zeroed",
    "layernorm_zero": "gamma and beta of the dims zeroed in every LayerNorm over the hidden size (or those writing "
                      "--layers)",
    "activation_zero": "the dims of the hidden state set to 0 at --layers (later layers see the change)",
    "activation_mean": "the dims of the hidden state set to their mean over the data (the unmodified model's) at "
                       "--layers (later layers see the change)",
}
DIMENSION_BASED = ("layernorm_zero", "activation_zero", "activation_mean")


@dataclass(frozen=True, eq=False)
class Intervention:
    name: str
    dims: tuple[int, ...] = ()  # dimension-based interventions: the hidden dims (0-indexed)
    layers: tuple[int, ...] | None = None  # hidden-state layers (0 = embedding output) they act at; None: all
    seed: int = 0  # position_shuffle's permutation
    means: Tensor | None = None  # activation_mean: [layers, hidden], the per-dim means over the data

    @property
    def dimension_based(self) -> bool:
        return self.name in DIMENSION_BASED


def check_intervention(model: nn.Module, name: str, what: str = "the model") -> None:
    """One line (UserError) when `model` lacks the part intervention `name` acts on; nothing when it has it."""
    if name not in INTERVENTIONS:
        raise UserError(f"unknown intervention {name!r} (choose from {', '.join(INTERVENTIONS)})")
    if name.startswith("position_"):
        table = position_embedding(model)
        if table is None:
            raise UserError(f"{name} needs an absolute position-embedding table, and {what} has none (relative or "
                            "rotary positions, or none)")
        if not table.weight.detach().any():
            raise UserError(f"{name} needs an absolute position-embedding table, and that of {what} is all zeros "
                            "(trained without positional embeddings): there is no position information to remove")
    elif name == "token_type_zero":
        table = token_type_embedding(model)
        if table is None:
            raise UserError(f"token_type_zero needs token-type embeddings, and {what} has none")
        if not table.weight.detach().any():
            raise UserError(f"token_type_zero: the token-type rows of {what} are all zeros already: nothing to remove")
    elif name == "layernorm_zero" and not layer_norms(model):
        raise UserError(f"layernorm_zero needs LayerNorms over the hidden size, and {what} has none")
    elif name in ("activation_zero", "activation_mean"):
        encoder_layers(model)  # its own one line when the layers cannot be found


def position_rows_used(model: nn.Module) -> slice:
    """The rows of the absolute position table a token can read: offset .. offset + max length - 1."""
    offset = position_offset(model)
    rows = position_embedding(model).num_embeddings
    return slice(offset, min(rows, offset + model_max_length(model)))


def edited_position_table(model: nn.Module, name: str, seed: int = 0) -> Tensor:
    """A new [rows, width] tensor: the position table with its usable rows replaced as `name` says (the table itself
    is not touched)."""
    weight = position_embedding(model).weight.detach()
    used = position_rows_used(model)
    edited = weight.clone()
    rows = weight[used]
    if name == "position_mean":
        edited[used] = rows.double().mean(0).to(rows.dtype)
    elif name == "position_shuffle":
        order = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(seed))
        edited[used] = rows[order.to(rows.device)]
    elif name == "position_zero":
        edited[used] = 0
    else:
        raise ValueError(f"not a position intervention: {name}")
    return edited


def with_first(output, tensor: Tensor):
    """A module's output with its hidden-state tensor (itself, or the first element of a tuple / ModelOutput)
    replaced by `tensor`."""
    if isinstance(output, Tensor):
        return tensor
    if isinstance(output, tuple):
        return (tensor, *output[1:])
    if hasattr(output, "keys"):
        output[next(iter(output.keys()))] = tensor
        return output
    raise TypeError(f"cannot replace the hidden states in a layer output of type {type(output).__name__}")


def set_dims(hidden: Tensor, dims: Tensor, values: Tensor | float) -> Tensor:
    """A copy of hidden [..., hidden size] with hidden[..., dims] = values (a number or [len(dims)])."""
    edited = hidden.clone()
    edited[..., dims] = values if isinstance(values, float) else values.to(edited)
    return edited


def _hook(edit: Callable) -> Callable:
    """A forward hook (with kwargs) that returns the module's output edited: edit(output tensor, args, kwargs)."""
    def hook(module, args, kwargs, output):
        return with_first(output, edit(layer_output(output), args, kwargs))
    return hook


def hooks(model: nn.Module, intervention: Intervention) -> list[tuple[nn.Module, Callable]]:
    """(module, forward hook) pairs that carry out `intervention` on `model`."""
    name = intervention.name
    check_intervention(model, name)
    wanted = None if intervention.layers is None else set(intervention.layers)
    if name.startswith("position_"):
        table = position_embedding(model)
        edited = edited_position_table(model, name, intervention.seed)

        def lookup(output, args, kwargs):  # the edited table read at the same position ids
            ids = args[0] if args else kwargs["input"]
            return F.embedding(ids, edited.to(output.device))
        return [(table, _hook(lookup))]
    if name == "token_type_zero":
        return [(token_type_embedding(model), _hook(lambda output, args, kwargs: torch.zeros_like(output)))]
    dims = torch.tensor(intervention.dims, dtype=torch.long)
    if name == "layernorm_zero":  # gamma_d x_hat_d + beta_d = 0 for each chosen d: the output's dims are 0
        return [(module, _hook(lambda output, args, kwargs: set_dims(output, dims.to(output.device), 0.0)))
                for _, written, module in layer_norms(model) if wanted is None or wanted & set(written)]
    modules = encoder_layers(model)
    layers = range(len(modules)) if wanted is None else sorted(wanted)
    if name == "activation_zero":
        return [(modules[layer], _hook(lambda output, args, kwargs: set_dims(output, dims.to(output.device), 0.0)))
                for layer in layers]
    if intervention.means is None:
        raise ValueError("activation_mean needs the per-dim means over the data (`means`)")

    def to_mean(layer: int) -> Callable:
        values = intervention.means[layer, dims]
        return _hook(lambda output, args, kwargs: set_dims(output, dims.to(output.device), values))
    return [(modules[layer], to_mean(layer)) for layer in layers]


@contextlib.contextmanager
def intervene(model: nn.Module, intervention: Intervention | None) -> Iterator[None]:
    """Every forward pass of `model` inside the block carries out `intervention` (None: the model as it is). The
    hooks are removed on exit, even on error; no parameter is written."""
    handles = []
    try:
        for module, hook in hooks(model, intervention) if intervention is not None else ():
            handles.append(module.register_forward_hook(hook, prepend=True, with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def masked_lm_loss(encoder: FrozenEncoder, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """(mean cross-entropy over the masked positions, their count) of a padded batch through the encoder's MLM head
    (`encoder.masked_lm`, load_encoder(masked_lm=True)): batch holds input_ids and attention_mask [batch, seq] and
    positions and targets [batch, k] (-100: none; datamodules.masking.SentenceMasker). It is lightning_modules.mlm's
    `mlm_step` (only the masked positions go through the head; logits past the vocabulary are cut off), its base
    model given the batch's attention mask (sentences are padded; pretraining blocks are not)."""
    if encoder.masked_lm is None:
        raise UserError(f"{encoder.name} has {encoder.head_note}: no MLM loss")
    device = encoder.device
    attention_mask = batch["attention_mask"].to(device)
    model = SimpleNamespace(base_model=functools.partial(encoder.model, attention_mask=attention_mask),
                            lm_head=mlm_head(encoder.masked_lm))
    with torch.no_grad():
        loss, count, _ = mlm_step(model, {key: batch[key].to(device) for key in ("input_ids", "positions", "targets")},
                                  vocab_size=encoder.mlm_vocab_size)
    return loss, count
