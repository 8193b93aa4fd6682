"""Interventions inside an encoder's or a decoder's forward pass: what the model computes when one part of it is
removed, as context managers that hook the forward pass and restore it on exit (STYLE.md 12).

    with intervene(encoder.model, Intervention("position_mean")):       # every forward inside sees the change
        batch = encoder(**inputs)
    with intervene(model, Intervention("layernorm_zero", dims=(223,))):  # gamma and beta of dim 223, every norm
    with intervene(model, Intervention("activation_mean", dims=(223,), layers=(1, 2), means=result.mean)):
    check_intervention(model, "token_type_zero", "MiniLM")   # one line (UserError) when the model lacks the part
    loss, count = masked_lm_loss(encoder, batch)              # the MLM loss, under whatever intervention is active
    total, count = next_token_loss(encoder, batch)            # a causal model's next-token loss (ours, for intervene)
    edit_sites(model)                                          # per layer 0..L: where activation_* acts, in words

The interventions (`INTERVENTIONS`):
    position_mean     the usable rows of the absolute position table replaced by their mean row (position
                      information removed, the average offset kept)
    position_shuffle  the usable rows permuted (seeded)
    position_zero     the usable rows zeroed
    token_type_zero   the token-type (segment) embedding rows zeroed
    layernorm_zero    gamma and beta of `dims` zeroed in every LayerNorm over the hidden size (an RMSNorm: its gain; it
                      has no bias), or in those of `layers` (core.models.layer_norms): those outputs are 0 (Kovaleva et
                      al. 2021)
    activation_zero   the hidden state's `dims` set to 0 at each of `layers` (where transformers reads hidden_states[l]:
                      core.models.hidden_state_sites), so that later layers see the change (Sun et al. 2024, set_zero)
    activation_mean   the same dims set to their mean over the data (`means` [layers, hidden]: the unmodified model's,
                      Sun et al.'s set_mean)

The usable rows of a position table are those a token can read (core.models.position_rows): positions offset ..
offset + max length - 1. RoBERTa numbers positions from padding_idx + 1 and OPT from 2, so their rows below that
(padding's row, which no counted token reads) are left as they are, and "the table's mean row" is the mean of the
usable rows; for BERT and GPT-2 (offset 0) that is every row. Rotary models (Llama, GPT-NeoX, ModernBERT, RoFormer)
have no table: the position interventions are refused in one line.

Decoders and pre-LN stacks (core/families.py): hidden state 0 is the first block's input (an edit there is a forward
pre-hook on that block), l < L a block's output (the residual stream the next block reads), and L the final norm's
output (what the LM head reads: no block after it). A pre-LN norm normalises a sub-layer's input, so layernorm_zero
there removes the dims from what that sub-layer reads, not from the residual stream.

Every edit is a forward hook (or pre-hook) that returns the edited output (or input), registered first (prepend), so it
runs before transformers' own output-recording hooks and the hidden states a model reports are the edited ones; the
hooks are removed on exit, even on error. No parameter is ever written: the model object, and the file on disk, stay
byte-identical. Each equals the model edited by hand (tests/test_intervene.py, tests/test_intervene_families.py: the
table overwritten, gamma and beta or the RMSNorm's gain zeroed, layers l + 1.. run on the zeroed hidden state).
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

from core import families
from core.capture import layer_output
from core.defaults import INTERVENTIONS
from core.errors import UserError
from core.models import (
    first_position_row,
    hidden_state_sites,
    layer_norms,
    mlm_head,
    model_max_length,
    position_embedding,
    token_type_embedding,
)
from lightning_modules.encoder import FrozenEncoder
from lightning_modules.mlm import mlm_step

DIMENSION_BASED = ("layernorm_zero", "activation_zero", "activation_mean")
HEAD_CHUNK = 4096  # tokens through a causal LM head at once (logits [chunk, vocab])


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
        if table is None and families.is_rotary(model):
            raise UserError(f"{name} needs an absolute position-embedding table, and {what} has rotary positions "
                            "(RoPE rotates queries and keys inside attention): there is no table to intervene on")
        if table is None:
            biases = families.attention_biases(model)  # ALiBi (BLOOM, MPT, Falcon-RW) or relative (DeBERTa)
            how = (f"{biases} position biases inside attention" if biases else "fixed sinusoidal positions"
                   if families.is_sinusoidal(model) else "relative positions, or none")
            raise UserError(f"{name} needs an absolute position-embedding table, and {what} has none ({how})")
        if not table.weight.detach().any():
            raise UserError(f"{name} needs an absolute position-embedding table, and that of {what} is all zeros "
                            "(trained without positional embeddings): there is no position information to remove")
    elif name == "token_type_zero":
        table = token_type_embedding(model)
        if table is None:
            raise UserError(f"token_type_zero needs token-type embeddings, and {what} has none (no token-type table "
                            f"in the embeddings of its {model.config.model_type!r} model)")
        if not table.weight.detach().any():
            raise UserError(f"token_type_zero: the token-type rows of {what} are all zeros already: nothing to remove")
    elif name == "layernorm_zero" and not layer_norms(model):
        raise UserError(f"layernorm_zero needs LayerNorms or RMSNorms over the hidden size, and {what} has none")
    elif name in ("activation_zero", "activation_mean"):
        hidden_state_sites(model)  # its own one line when the layers cannot be found


def position_rows_used(model: nn.Module) -> slice:
    """The rows of the absolute position table a token can read: offset .. offset + max length - 1 (offset: RoBERTa's
    padding_idx + 1, OPT's 2, else 0)."""
    offset = first_position_row(model)
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


def table_rows_read(table: nn.Embedding, args: tuple, kwargs: dict, output: Tensor) -> Tensor:
    """The rows a position table's forward just read: its input ids (nn.Embedding's own forward: BERT's, GPT-2's
    `wpe`), or OPT's `position_ids` + offset (its forward takes the attention mask and numbers positions from 2,
    padding -1). Checked against what the table returned, so a layout read wrongly is one line, never a wrong edit."""
    if type(table).forward is nn.Embedding.forward:
        ids = args[0] if args else kwargs["input"]
    else:
        positions = kwargs.get("position_ids", args[2] if len(args) > 2 else None)
        if positions is None:  # OPT's own rule, when the caller passes none
            mask = args[0] if args else kwargs["attention_mask"]
            positions = (torch.cumsum(mask, dim=1) * mask - 1).long()[:, mask.shape[1] - output.shape[1]:]
        ids = positions + int(getattr(table, "offset", 0) or 0)
    if ids.shape != output.shape[:-1] or not torch.equal(F.embedding(ids, table.weight), output):
        raise UserError(f"cannot tell which rows of the position table ({type(table).__name__}) a token reads, so the "
                        "position interventions cannot act on it")
    return ids


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


def _input_hook(edit: Callable) -> Callable:
    """A forward pre-hook (with kwargs) that edits the module's hidden-state input (its first argument, or
    `hidden_states`): edit(input tensor)."""
    def hook(module, args, kwargs):
        if args:
            return (edit(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": edit(kwargs["hidden_states"])}
    return hook


Hook = tuple[nn.Module, Callable, bool]  # (module, hook, runs before the module: a pre-hook on its input)


def hooks(model: nn.Module, intervention: Intervention) -> list[Hook]:
    """(module, hook, pre) triples that carry out `intervention` on `model`."""
    name = intervention.name
    check_intervention(model, name)
    wanted = None if intervention.layers is None else set(intervention.layers)
    if name.startswith("position_"):
        table = position_embedding(model)
        edited = edited_position_table(model, name, intervention.seed)

        def lookup(output, args, kwargs):  # the edited table read at the same rows
            return F.embedding(table_rows_read(table, args, kwargs, output), edited.to(output.device))
        return [(table, _hook(lookup), False)]
    if name == "token_type_zero":
        return [(token_type_embedding(model), _hook(lambda output, args, kwargs: torch.zeros_like(output)), False)]
    dims = torch.tensor(intervention.dims, dtype=torch.long)
    if name == "layernorm_zero":  # gamma_d x_hat_d + beta_d = 0 (an RMSNorm: gamma_d x_d / rms = 0): dims are 0
        return [(module, _hook(lambda output, args, kwargs: set_dims(output, dims.to(output.device), 0.0)), False)
                for _, written, module in layer_norms(model) if wanted is None or wanted & set(written)]
    sites = hidden_state_sites(model)
    layers = range(len(sites)) if wanted is None else sorted(wanted)
    if name == "activation_mean" and intervention.means is None:
        raise ValueError("activation_mean needs the per-dim means over the data (`means`)")

    def editor(layer: int) -> Callable[[Tensor], Tensor]:
        values = 0.0 if name == "activation_zero" else intervention.means[layer, dims]
        return lambda hidden: set_dims(hidden, dims.to(hidden.device), values)

    def at(layer: int) -> Hook:
        module, read = sites[layer][:2]
        if read == "input":
            return module, _input_hook(editor(layer)), True
        edit = editor(layer)
        return module, _hook(lambda output, args, kwargs: edit(output)), False
    shared: dict[nn.Module, dict[int, Callable]] = {}  # ALBERT: a module run for several layers, by call
    for layer in layers:
        if len(sites[layer]) > 2:
            shared.setdefault(sites[layer][0], {})[sites[layer][2]] = editor(layer)
    return [at(layer) for layer in layers if len(sites[layer]) == 2] + [
        hook for module, edits in shared.items() for hook in _by_call(module, edits, sites[0][0])]


def _by_call(module: nn.Module, edits: dict[int, Callable], first: nn.Module) -> list[Hook]:
    """The hooks that edit the output of `module`'s n-th call of each forward pass with edits[n] (ALBERT's layer
    group runs once per layer), and the pre-hook on `first` (the module each forward runs first) that restarts the
    count."""
    calls = [0]

    def restart(module, args, kwargs):
        calls[0] = 0

    def edit(output, args, kwargs):
        call, calls[0] = calls[0], calls[0] + 1
        return edits[call](output) if call in edits else output
    return [(first, restart, True), (module, _hook(edit), False)]


def edit_sites(model: nn.Module) -> list[str]:
    """Per hidden-state layer 0..L, where activation_zero / activation_mean act, in words (for reports)."""
    stack = families.decoder_stack(model)
    sites = hidden_state_sites(model)
    if stack is None:  # BERT's layout: the embeddings' and each layer's output
        return ["the embedding output (what layer 1 reads)"] + [
            f"the output of layer {layer}" + (f" (what layer {layer + 1} reads)" if layer < len(sites) - 1 else "")
            for layer in range(1, len(sites))]
    last = len(sites) - 1
    named = [families.name_of(model, module) for module, _ in sites]
    words = [f"the input of the first block ({named[0]}): the embedding output"]
    words += [f"the output of block {layer} ({named[layer]}): the residual stream block {layer + 1} reads"
              for layer in range(1, last)]
    words.append(f"the output of the final norm ({named[last]}): what the LM head reads, no block after it"
                 if stack.final_norm is not None else f"the output of the last block ({named[last]})")
    return words


def norm_sites(model: nn.Module, layers: tuple[int, ...] | None = None) -> list[dict]:
    """The norms layernorm_zero edits (those of `layers`, or all): name, hidden-state layers, placement in a pre-LN
    stack (core.families.norm_placement), and what is zeroed (an RMSNorm has no bias: its gain only)."""
    found = []
    for name, written, module in layer_norms(model):
        if layers is not None and not set(layers) & set(written):
            continue
        placed = families.norm_placement(model, module)
        if getattr(module, "weight", None) is None:  # OLMo's LayerNorm: zeroing its output is its gain set to 0
            zeroed = f"output ({type(module).__name__}: no parameters, gain 1)"
        elif getattr(module, "bias", None) is None:
            zeroed = f"gain ({type(module).__name__}: no bias)"
        else:
            zeroed = "gain and bias"
        found.append({"name": name, "layers": written, **({"placement": placed[1]} if placed else {}),
                      "zeroed": zeroed})
    return found


@contextlib.contextmanager
def intervene(model: nn.Module, intervention: Intervention | None) -> Iterator[None]:
    """Every forward pass of `model` inside the block carries out `intervention` (None: the model as it is). The
    hooks are removed on exit, even on error; no parameter is written."""
    handles = []
    try:
        for module, hook, pre in hooks(model, intervention) if intervention is not None else ():
            register = module.register_forward_pre_hook if pre else module.register_forward_hook
            handles.append(register(hook, prepend=True, with_kwargs=True))
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


@torch.no_grad()
def next_token_loss(encoder: FrozenEncoder, last_hidden: Tensor, input_ids: Tensor, attention_mask: Tensor
                    ) -> tuple[Tensor, Tensor]:
    """(summed cross-entropy, count) of predicting each real token after the first from the tokens before it, through
    a causal model's LM head (`encoder.causal_lm`), from the last hidden state the head reads ([batch, seq, hidden]:
    hidden_states[L], after the final norm) of right-padded sentences: padding is never a target. Logits past the
    tokenizer's vocabulary (an arm's padded head rows) are cut off; the head runs HEAD_CHUNK tokens at a time."""
    if encoder.causal_lm is None:
        raise UserError(f"{encoder.name} has {encoder.lm_note}: no next-token loss")
    head = mlm_head(encoder.causal_lm)
    targets = attention_mask[:, 1:].bool().to(last_hidden.device)  # a real token after a real one (right padding)
    hidden, wanted = last_hidden[:, :-1][targets], input_ids[:, 1:].to(last_hidden.device)[targets]
    total = torch.zeros((), dtype=torch.float64, device=last_hidden.device)
    for start in range(0, hidden.shape[0], HEAD_CHUNK):
        logits = head(hidden[start:start + HEAD_CHUNK])
        if encoder.mlm_vocab_size is not None:
            logits = logits[..., :encoder.mlm_vocab_size]
        total += F.cross_entropy(logits.float(), wanted[start:start + HEAD_CHUNK], reduction="sum").double()
    return total, torch.tensor(hidden.shape[0], device=last_hidden.device)
