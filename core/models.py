"""What a transformers encoder is made of, read off the model itself (nothing is assumed about any architecture).

    encoder_layers(model)          # [embeddings, layer 1, ..., layer L]: the modules whose outputs are hidden states
    hidden_state_sites(model)      # [(module, "input" | "output")] for layers 0..L, any family (core/families.py)
    attention_projections(model)   # per transformer layer 1..L: (query Linear, key Linear, heads), read off its input
    position_embedding(model)      # the absolute position table (nn.Embedding) or None
    model_family(model)            # core.families.Family: causal or not, positions, norms, what layer L is
    position_offset(model)         # RoBERTa numbers positions from padding_idx + 1, BERT from 0
    model_max_length(model)        # the longest input: table size minus the offset
    position_rows(model)           # the rows a token can use, in the hidden space ([positions, hidden], note)
    token_type_embedding(model)    # the token-type (segment) table (nn.Embedding) or None
    mlm_head(masked_lm)            # hidden [..., hidden] -> logits [..., vocab rows] of a masked- or causal-LM's head
    layer_norms(model)             # (name, hidden-state layers it writes, module) for each LayerNorm / RMSNorm

Layers follow transformers' `hidden_states`: 0 is the embedding output, l the output of transformer layer l (for a
decoder with a final norm, layer L is after that norm: core/families.py).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable

import torch
from torch import Tensor, nn

from core import families
from core.errors import UserError
from core.norms import is_norm
from core.sources import short_name  # noqa: F401  (a readable name for a model path: the path rule's)


def base_model(model: nn.Module) -> nn.Module:
    """The bare encoder of a model with a head (`model.base_model`), or the model itself."""
    return getattr(model, "base_model", model)


def find_encoder(module: nn.Module) -> nn.Module | None:
    """The first transformers PreTrainedModel inside `module` (itself included), or None."""
    from transformers import PreTrainedModel

    return next((m for m in module.modules() if isinstance(m, PreTrainedModel)), None)


def hidden_size(config) -> int:
    """The hidden size of a transformers config (DistilBERT calls it `dim`)."""
    return int(getattr(config, "hidden_size", None) or config.dim)


def layer_stack(model: nn.Module) -> nn.Module | None:
    """The module of a transformers encoder (or a model holding one) that runs its layer list (`encoder` holding
    `encoder.layer`, or `transformer` holding `transformer.layer`) beside an `embeddings` module: its output's first
    element is the last layer's [batch, seq, hidden]. None when the encoder has no such pair."""
    base = base_model(find_encoder(model) or model)
    embeddings = getattr(base, "embeddings", None)
    for name in ("encoder", "transformer"):
        container = getattr(base, name, None)
        layers = getattr(container, "layer", None) if container is not None else None
        if isinstance(embeddings, nn.Module) and isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return container
    return None


def encoder_layers(model: nn.Module) -> list[nn.Module]:
    """[embeddings, layer 1, ..., layer L] of a transformers encoder (or a model holding one)."""
    stack = layer_stack(model)
    if stack is not None:
        return [base_model(find_encoder(model) or model).embeddings, *stack.layer]
    raise UserError(f"cannot capture the hidden states of {type(model).__name__}: it holds no transformers encoder "
                    "with an `embeddings` module and a layer list (`encoder.layer` or `transformer.layer`)")


def hidden_state_sites(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """Where hidden_states[0..L] are read by hooks, as (module, "input" | "output"): BERT's layout the outputs of
    `encoder_layers` (layer 0: of the embeddings' projection to the hidden size when there is one: ELECTRA's and
    RoFormer's `embeddings_project`; layer 1: of DeBERTa-v2's `encoder.conv` when there is one); a decoder stack
    (GPT-2, Llama, GPT-NeoX, OPT, ModernBERT) the first layer's input, the layers' outputs and the final norm's
    (core/families.py), as transformers' `hidden_states` holds them."""
    sites = families.hidden_state_sites(find_encoder(model) or model)
    if sites is not None:
        return sites
    shared = shared_layer_sites(find_encoder(model) or model)
    if shared is not None:
        return shared
    if layer_stack(model) is None:
        raise UserError(f"cannot capture the hidden states of {type(model).__name__}: it holds no transformers model "
                        "with BERT's layout (`embeddings` and `encoder.layer`) nor a flat layer list (`h`, `layers`, "
                        "`decoder.layers`)")
    modules = encoder_layers(model)
    project = getattr(base_model(find_encoder(model) or model), "embeddings_project", None)
    if isinstance(project, nn.Module):
        modules[0] = project
    conv = getattr(layer_stack(model), "conv", None)
    if isinstance(conv, nn.Module):  # DeBERTa-v2 xlarge / xxlarge: a convolution after layer 1 writes hidden_states[1]
        modules[1] = conv
    return [(module, "output") for module in modules]


def check_layer_groups(config, name: str) -> None:
    """ALBERT with inner_group_num > 1 in one line: transformers records every AlbertLayer, so its hidden_states holds
    layers x inner + 1 states, not one per layer as every analysis, hook and callback reads them."""
    inner = getattr(config, "inner_group_num", 1)
    if inner != 1:
        raise UserError(f"cannot read {name} with inner_group_num={inner} by layer: each of its "
                        f"{config.num_hidden_layers} layers runs {inner} sub-layers, and transformers' hidden_states "
                        "holds one state per sub-layer; only inner_group_num 1 (every released ALBERT) is read")


def shared_layer_sites(model: nn.Module) -> list[tuple] | None:
    """ALBERT's sites: layer 0 the output of `embedding_hidden_mapping_in`, layer l the output of the l-th call of its
    layer group's last layer within a forward pass, (module, "output", call): one module runs for several layers, so
    the hooks count its calls (core.capture.HiddenStateCapture, lightning_modules.interventions); None for others."""
    encoder = getattr(base_model(model), "encoder", None)
    groups = getattr(encoder, "albert_layer_groups", None)
    config = getattr(base_model(model), "config", None)
    if not isinstance(groups, nn.ModuleList) or not getattr(config, "num_hidden_groups", None):
        return None
    check_layer_groups(config, type(model).__name__)
    layers, count = config.num_hidden_layers, config.num_hidden_groups
    sites: list[tuple] = [(encoder.embedding_hidden_mapping_in, "output")]
    calls: dict[int, int] = {}
    for index in range(layers):
        group = int(index / (layers / count))  # transformers' AlbertTransformer
        sites.append((groups[group].albert_layers[-1], "output", calls.get(group, 0)))
        calls[group] = calls.get(group, 0) + 1
    return sites


def attention_projections(model: nn.Module) -> list[tuple[nn.Linear, nn.Linear, int]]:
    """(query, key, heads) of each transformer layer 1..L of a BERT-family encoder whose attention projects the layer's
    input directly (post-LayerNorm layers: BERT, RoBERTa, ELECTRA without an embedding projection, DistilBERT), so that
    layer l's queries and keys are query(hidden_states[l - 1]) and key(hidden_states[l - 1]); a UserError otherwise."""
    encoder = find_encoder(model) or model
    if families.pre_norm(encoder):
        raise UserError(f"cannot read the attention of {type(model).__name__}: its layers normalise their input before "
                        "the attention (pre-LN), so queries and keys are not projections of the hidden states")
    layers = encoder_layers(model)[1:]
    config = encoder.config
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_heads", None)
    size = hidden_size(config)
    name = type(model).__name__
    if getattr(base_model(encoder), "embeddings_project", None) is not None:
        raise UserError(f"cannot read the attention of {name}: its layers read a projection of the embedding output, "
                        "not the hidden states")
    relative_bias = getattr(getattr(base_model(encoder), "encoder", None), "relative_attention_bias", None)  # MPNet's
    if families.attention_biases(encoder) == "relative" or isinstance(relative_bias, nn.Module):
        raise UserError(f"cannot read the attention of {name}: its attention scores add relative-position terms to "
                        "the queries' and keys' products (DeBERTa's disentangled attention, MPNet's relative bias), "
                        "so queries and keys alone do not give its attention")
    found = []
    for number, layer in enumerate(layers, 1):
        attention = getattr(layer, "attention", None)
        inner = getattr(attention, "self", attention)  # BERT / RoBERTa: attention.self.query; DistilBERT: q_lin
        query = next((getattr(inner, n) for n in ("query", "q_lin") if isinstance(getattr(inner, n, None), nn.Linear)),
                     None)
        key = next((getattr(inner, n) for n in ("key", "k_lin") if isinstance(getattr(inner, n, None), nn.Linear)),
                   None)
        if query is None or key is None or not heads or query.in_features != size or key.in_features != size \
                or query.out_features % heads or query.out_features != key.out_features:
            raise UserError(f"cannot read the attention of {name}: transformer layer {number} has no query and key "
                            "projections of the hidden states (attention.self.query / key or attention.q_lin / k_lin) "
                            "with a number of heads that divides them")
        if isinstance(getattr(attention, "LayerNorm", None), nn.LayerNorm):
            raise UserError(f"cannot read the attention of {name}: its layers normalise their input before the "
                            "attention (pre-LayerNorm), so queries and keys are not projections of the hidden states")
        found.append((query, key, int(heads)))
    return found


def position_embedding(model: nn.Module) -> nn.Embedding | None:
    """The absolute position-embedding table of an encoder (BERT's embeddings.position_embeddings) or a decoder
    (GPT-2's wpe, OPT's embed_positions), or None when it has none (relative or rotary positions)."""
    table = getattr(getattr(base_model(model), "embeddings", None), "position_embeddings", None)
    if isinstance(table, nn.Embedding):
        return table
    found = families.position_table(model)
    return found[0] if found is not None else None


def model_family(model: nn.Module) -> families.Family:
    """The model's kind (see Family), for reports and the families table."""
    config = base_model(model).config
    table = position_embedding(model)
    if table is not None:
        positions = "learned table" if table.weight.detach().any() else "zero table (no positions)"
        if getattr(config, "sinusoidal_pos_embds", False):  # DistilBERT's option: a frozen table of sinusoids
            positions = "fixed sinusoids (a frozen table)"
    elif families.is_rotary(model):
        positions = "rotary (RoPE)"
    elif families.is_sinusoidal(model):
        positions = "fixed sinusoids"
    elif families.attention_biases(model):
        positions = f"{families.attention_biases(model)} biases (no table)"
    else:
        positions = "no absolute table"
    stack = families.decoder_stack(model)
    if stack is not None and stack.final_norm is not None:
        last = f"layer L's output after the final norm ({families.name_of(model, stack.final_norm)})"
    else:
        last = "layer L's output"
    projection = families.output_projection(model)
    if projection is not None:  # OPT-350m: transformers' last hidden state is project_out's, of another width
        last += f", before {families.name_of(model, projection)} (to width {projection.out_features})"
    norms = "pre-LN" if families.pre_norm(model) else "post-LN"
    return families.Family(config.model_type, families.is_causal(config), positions, norms, last)


def first_position_row(model: nn.Module) -> int:
    """The table row of position 0: RoBERTa's padding_idx + 1, OPT's 2, else 0."""
    found = families.position_table(model)
    return found[1] if found is not None else position_offset(model)


def position_offset(model: nn.Module) -> int:
    """RoBERTa-style embeddings number positions from padding_idx + 1; BERT-style from 0."""
    padding_idx = getattr(getattr(base_model(model), "embeddings", None), "padding_idx", None)
    return padding_idx + 1 if isinstance(padding_idx, int) else 0


def token_type_embedding(model: nn.Module) -> nn.Embedding | None:
    """The token-type (segment) embedding table of an encoder, or None when it has none (DistilBERT)."""
    table = getattr(getattr(base_model(model), "embeddings", None), "token_type_embeddings", None)
    return table if isinstance(table, nn.Embedding) else None


def mlm_head(masked_lm: nn.Module) -> Callable[[Tensor], Tensor] | None:
    """The LM head of a transformers masked-LM (or causal-LM) model as a function hidden [..., hidden] -> logits
    [..., vocab rows]: `lm_head` (RoBERTa and its kin; GPT-2, Llama, OPT: OPT-350m's after its `project_out`), `cls`
    (BERT, RoFormer), `predictions` (ALBERT), `embed_out` (GPT-NeoX), ModernBERT's head -> decoder, DistilBERT's
    vocab_transform -> activation -> vocab_layer_norm -> vocab_projector, ELECTRA's generator_predictions ->
    generator_lm_head; None for a layout not among these (or a bare encoder). What the model does to the head's
    output before its loss is done too (logit_transform: Gemma 2's soft-capping)."""
    for name in ("lm_head", "cls", "predictions", "embed_out"):
        head = getattr(masked_lm, name, None)
        if isinstance(head, nn.Module):
            projection = families.output_projection(masked_lm)  # OPT-350m's head reads project_out's output
            head = head if projection is None else nn.Sequential(projection, head)
            return transformed(head, logit_transform(getattr(masked_lm, "config", None)))
    transform, decoder = getattr(masked_lm, "head", None), getattr(masked_lm, "decoder", None)
    if isinstance(transform, nn.Module) and isinstance(decoder, nn.Linear):  # ModernBertForMaskedLM
        return lambda hidden: decoder(transform(hidden))
    parts = [getattr(masked_lm, name, None) for name in ("vocab_transform", "activation", "vocab_layer_norm",
                                                          "vocab_projector")]
    if all(isinstance(part, nn.Module) for part in parts):
        transform, activation, norm, projector = parts
        return lambda hidden: projector(norm(activation(transform(hidden))))
    predictions, head = getattr(masked_lm, "generator_predictions", None), getattr(masked_lm, "generator_lm_head", None)
    if isinstance(predictions, nn.Module) and isinstance(head, nn.Module):
        return lambda hidden: head(predictions(hidden))
    return None


def transformed(head: Callable[[Tensor], Tensor], transform: Callable[[Tensor], Tensor] | None
                ) -> Callable[[Tensor], Tensor]:
    """`head`, followed by `transform` when there is one."""
    return head if transform is None else lambda hidden: transform(head(hidden))


def logit_transform(config) -> Callable[[Tensor], Tensor] | None:
    """What a causal LM does to its head's logits before its loss, named in its config: Gemma 2's (and Gemma 3's, when
    set) `final_logit_softcapping` c (c * tanh(logits / c)), Cohere's `logit_scale` (times it), Granite's
    `logits_scaling` (divided by it); None when none is named."""
    cap, scale, divisor = (getattr(config, key, None) for key in ("final_logit_softcapping", "logit_scale",
                                                                     "logits_scaling"))
    if cap:
        return lambda logits: torch.tanh(logits / cap) * cap
    if isinstance(scale, (int, float)) and scale != 1:
        return lambda logits: logits * scale
    if isinstance(divisor, (int, float)) and divisor not in (0, 1):
        return lambda logits: logits / divisor
    return None


CONTEXT_LENGTHS = ("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx", "seq_length")  # config keys


def model_max_length(model: nn.Module, tokenizer=None) -> int:
    """The longest input the model takes: its position table size minus RoBERTa's padding offset, or the context its
    config names otherwise (MPT's `max_seq_len`: its ALiBi biases are built for that many positions); without one
    (BLOOM's ALiBi), the tokenizer's `model_max_length`, or 512."""
    positions = next((value for value in (getattr(model.config, key, None) for key in CONTEXT_LENGTHS)
                      if isinstance(value, int) and value > 0), None)
    if positions is None:
        limit = getattr(tokenizer, "model_max_length", 512) if tokenizer is not None else 512
        return int(limit) if limit < 1_000_000 else 512
    return positions - position_offset(model)


E_TO_H = ("encoder.embedding_hidden_mapping_in", "embeddings_project")  # ALBERT's, ELECTRA's (on the bare encoder)


def e_to_h_projection(model: nn.Module) -> tuple[str | None, nn.Linear | None]:
    """(its name, the Linear) mapping a factorised embedding output of width E to the hidden size H, or (None, None)."""
    for name in E_TO_H:
        module = base_model(model)
        for part in name.split("."):
            module = getattr(module, part, None)
        if isinstance(module, nn.Linear):
            return name.rsplit(".", 1)[-1], module
    return None, None


def position_rows(model: nn.Module) -> tuple[Tensor | None, str]:
    """The rows of the absolute position table a token can actually use, in the hidden space ([positions, hidden],
    float32 on the CPU), or None and why not.

    A factorised table [positions, E] narrower than the hidden size H (ALBERT's; ELECTRA's with embedding_size != H)
    has its rows traced into the hidden space through the model's E-to-H projection (E_TO_H: ALBERT's
    `encoder.embedding_hidden_mapping_in`, ELECTRA's `embeddings_project`; rows @ W.T, no bias), and the note says so.
    """
    table = position_embedding(model)
    if table is None:
        if families.is_rotary(model):
            return None, ("rotary position embeddings (RoPE) rotate queries and keys inside attention: no position "
                          "table to trace")
        if families.is_sinusoidal(model):
            return None, "fixed sinusoidal positions (Vaswani et al.), not learned: no table to trace"
        if families.attention_biases(model):
            return None, (f"{families.attention_biases(model)} position biases inside attention, no absolute table: "
                          "no position table to trace")
        return None, "no absolute position-embedding table"
    weight = table.weight.detach().float().cpu()  # [positions, width]
    if not weight.any():
        return None, "the position-embedding table is all zeros (trained without positional embeddings)"
    note, width, hidden = "", weight.shape[1], model.config.hidden_size
    if width != hidden:
        why = f"factorised embeddings: the position table has width E={width}, the hidden size is H={hidden}"
        name, projection = e_to_h_projection(model)
        if projection is None or tuple(projection.weight.shape) != (hidden, width):
            return None, f"{why}, and no E-to-H projection to trace its rows through"
        weight = weight @ projection.weight.detach().float().cpu().T  # [positions, E] @ [E, H] -> [positions, H]
        note = (f"{why}; rows traced into the hidden space through {name} (rows @ W.T, no bias; the embedding "
                "LayerNorm before it is not applied)")
    offset = first_position_row(model)
    return weight[offset: offset + model_max_length(model)], note


def written_layers(model: nn.Module, name: str) -> list[int]:
    """The hidden-state layers the module `name` writes: [l] for a module of transformer layer l - 1 (BERT's
    encoder.layer.{l-1}, DistilBERT's transformer.layer.{l-1}), [0] for one of the embeddings, every layer that runs
    the group for ALBERT's shared encoder.albert_layer_groups.{g} (layer i uses group i // (layers / groups)), [1] for
    DeBERTa-v2's `encoder.conv` (it writes hidden_states[1]: hidden_state_sites), and [] for anything else, which
    writes no hidden state (DeBERTa-v2's `encoder.LayerNorm` normalises its relative-position embeddings)."""
    group = re.search(r"layer_groups\.(\d+)\.", name + ".")
    if group:
        layers, groups = model.config.num_hidden_layers, model.config.num_hidden_groups
        return [i + 1 for i in range(layers) if int(i / (layers / groups)) == int(group.group(1))]
    match = re.search(r"layers?\.(\d+)\.", name + ".")
    if match:
        return [int(match.group(1)) + 1]
    if re.search(r"(^|\.)encoder\.conv\.", name):
        return [1]
    return [0] if "embed" in name else []


QUERY_KEY_NORMS = ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_norm", "key_norm", "q_ln", "k_ln")


def layer_norms(model: nn.Module) -> list[tuple[str, list[int], nn.Module]]:
    """(name, hidden-state layers it writes, module) for each LayerNorm or RMSNorm (a gain, no bias: Llama) over the
    hidden size, in model order. In a decoder stack the layers are those of core.families.norm_placement (a pre-LN
    norm inside layer l: [l]; the final norm: [L]); norms of a head outside the model's body are left out, and so are
    the norms of queries and keys (OLMo-2's `q_norm` over all heads is as wide as the hidden size, but its dims are a
    projection's, not the hidden state's) and norms that write no hidden state (DeBERTa-v2's `encoder.LayerNorm` of
    its relative-position embeddings: written_layers)."""
    hidden = model.config.hidden_size
    found = []
    for name, module in model.named_modules():
        if is_norm(module, hidden) and name.rsplit(".", 1)[-1] not in QUERY_KEY_NORMS:
            placed = families.norm_placement(model, module)
            written = placed[0] if placed is not None else written_layers(model, name)
            if written:
                found.append((name, written, module))
    return found


@contextlib.contextmanager
def quiet_transformers():
    """transformers' load report (a table on every load of a masked-LM checkpoint as a bare encoder) and its progress
    bars (loading weights, writing a one-shard export) silenced; lightning_modules.encoder's `check_loading`
    says what matters instead."""
    from transformers.utils import logging

    level, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()  # "Loading weights" for a few milliseconds: noise before a report or an error
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()
