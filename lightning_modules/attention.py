"""Attention variants for MLM pretraining that let a head "do nothing" without pushing its softmax inputs up
(Bondarenko, Nagel & Blankevoort, "Quantizable Transformers: Removing Outliers by Helping Attention Heads Do
Nothing", NeurIPS 2023): clipped softmax and gated attention, on transformers' own RoBERTa.

    python train.py fit --config configs/pretrain/tiny.yaml --model.attention clipped_softmax   # gamma -0.025, zeta 1
    python train.py fit --config configs/pretrain/tiny.yaml --model.attention gated             # pi_init 0.25

    settings = attention_settings("clipped_softmax", gamma=None, zeta=None, gate_init=None)  # defaults, or one line
    install_attention(model, **settings)        # on a RoBERTa / BERT model built by transformers; recorded in config
    model = load_pretrained(AutoModel, "runs/x/export")   # save_pretrained's directory, the variant rebuilt

- clipped softmax: clip((zeta - gamma) * softmax(x) + gamma, 0, 1) in place of softmax(x), an attention function
  registered in transformers' AttentionInterface under "clipped_softmax" (its mask is SDPA's: boolean or none); gamma
  and zeta are read from the model's config. A padded key gets softmax 0, so gamma < 0 clips it to 0.
- gated attention: each head's output (before the output projection) times sigmoid(G_h(x_h)), where x_h is the head's
  slice of the layer's input x [batch, seq, heads, head_dim] and G_h a linear map head_dim -> 1 of its own (their
  "Linear" gate, `conditional_per_token` in their code); the bias starts at logit(pi_init). The softmax attention
  inside is transformers' own (SDPA by default): `GatedSelfAttention` subclasses RobertaSelfAttention and adds the
  parameters `gate_weight` [heads, head_dim] and `gate_bias` [heads].

The variant is recorded in the model's config (`attention_variant`, `clip_softmax_gamma`, `clip_softmax_zeta`,
`attention_gate_init`; nothing for softmax, whose config.json is unchanged), so save_pretrained's config.json says
what to rebuild, and `load_pretrained` rebuilds it. Plain `from_pretrained` does not: it loads a clipped-softmax
export as softmax attention and drops a gated export's gate weights (docs/pretraining.md).
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
from torch import Tensor, nn

from core.errors import UserError
from core.sources import pretrained, safetensors_of

VARIANTS = ("softmax", "clipped_softmax", "gated")
GAMMA, ZETA = -0.025, 1.0  # their BERT-base recipe: --attn_softmax "clipped(-.025:1)"
GATE_INIT = 0.25  # initial gate probability (their README's --attn_gate_init 0.25; their code's default is 0.5)
CLIPPED = "clipped_softmax"  # the name registered in transformers' AttentionInterface


def attention_settings(attention: str = "softmax", gamma: float | None = None, zeta: float | None = None,
                       gate_init: float | None = None) -> dict:
    """The variant and its parameters with the defaults filled in, or one line naming what is wrong: an unknown
    variant, gamma > 0, zeta < 1, a gate probability outside (0, 1), or a parameter the variant does not have."""
    if attention not in VARIANTS:
        raise UserError(f"--model.attention must be one of {', '.join(VARIANTS)}, got {attention!r}")
    given = {"clip_softmax_gamma": gamma, "clip_softmax_zeta": zeta, "attention_gate_init": gate_init}
    own = {"softmax": (), "clipped_softmax": ("clip_softmax_gamma", "clip_softmax_zeta"),
           "gated": ("attention_gate_init",)}[attention]
    stray = [name for name, value in given.items() if value is not None and name not in own]
    if stray:
        raise UserError(f"--model.{stray[0]} is a parameter of --model.attention "
                        f"{'gated' if stray[0] == 'attention_gate_init' else 'clipped_softmax'}, not of {attention}")
    settings: dict = {"attention": attention}
    if attention == "clipped_softmax":
        gamma = GAMMA if gamma is None else float(gamma)
        zeta = ZETA if zeta is None else float(zeta)
        if not gamma <= 0:
            raise UserError(f"--model.clip_softmax_gamma must be at most 0 (clip((zeta - gamma) softmax + gamma, 0, 1) "
                            f"reaches exact zeros only for gamma <= 0), got {gamma}")
        if not zeta >= 1:
            raise UserError(f"--model.clip_softmax_zeta must be at least 1 (an attention weight must be able to reach "
                            f"1), got {zeta}")
        if math.isinf(gamma) or math.isinf(zeta):
            raise UserError(f"--model.clip_softmax_gamma and clip_softmax_zeta must be finite, got {gamma}, {zeta}")
        settings.update(gamma=gamma, zeta=zeta)
    if attention == "gated":
        gate_init = GATE_INIT if gate_init is None else float(gate_init)
        if not 0 < gate_init < 1:
            raise UserError(f"--model.attention_gate_init is the initial gate probability, strictly between 0 and 1, "
                            f"got {gate_init}")
        settings.update(gate_init=gate_init)
    return settings


def clipped_softmax_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                              attention_mask: Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                              **kwargs) -> tuple[Tensor, Tensor]:
    """transformers' attention function with clip((zeta - gamma) softmax + gamma, 0, 1) for the softmax.

    query, key, value [batch, heads, seq, head_dim]; attention_mask boolean (True: attend) or additive, broadcastable
    to [batch, heads, seq, seq], or None -> (output [batch, seq, heads, head_dim], weights [batch, heads, seq, seq])."""
    config = module.config
    gamma, zeta = config.clip_softmax_gamma, config.clip_softmax_zeta
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    # the scale on the queries ([.., seq, head_dim]), not the scores ([.., seq, seq]); the stretch added in place:
    # as fast as SDPA's own math path on a CPU (benchmarks/bench_attention.py)
    scores = torch.matmul(query * scaling, key.transpose(-1, -2))  # [batch, heads, seq, seq]
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
    weights = scores.softmax(-1) if scores.dtype == torch.float32 else scores.softmax(-1, dtype=torch.float32)
    weights = (weights * (zeta - gamma)).add_(gamma).clamp(0, 1).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def register_clipped_softmax() -> None:
    """Make "clipped_softmax" an attention implementation transformers dispatches to (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    if CLIPPED not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionInterface.register(CLIPPED, clipped_softmax_attention)
        AttentionMaskInterface.register(CLIPPED, sdpa_mask)


@functools.cache
def gated_class(base: type) -> type:
    """`base` (a transformers self-attention class, RobertaSelfAttention) with the per-head linear gate."""

    class GatedSelfAttention(base):
        """Self-attention whose head h's output is multiplied by sigmoid(x_h . gate_weight[h] + gate_bias[h]), x_h
        the head's slice of the layer's input (Bondarenko et al. 2023, the "Linear" gate)."""

        def __init__(self, config, *args, **kwargs) -> None:
            super().__init__(config, *args, **kwargs)
            heads, width = self.num_attention_heads, self.attention_head_size
            self.gate_weight = nn.Parameter(torch.empty(heads, width))
            self.gate_bias = nn.Parameter(torch.empty(heads))

        def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, *args, **kwargs):
            output, weights = super().forward(hidden_states, attention_mask, *args, **kwargs)[:2]
            heads = hidden_states.unflatten(-1, (self.num_attention_heads, -1))  # [batch, seq, heads, head_dim]
            gate = torch.sigmoid((heads * self.gate_weight).sum(-1) + self.gate_bias)  # [batch, seq, heads]; faster
            # on a CPU than einsum's batched matmul for a head_dim -> 1 map
            return (output.unflatten(-1, (self.num_attention_heads, -1)) * gate.unsqueeze(-1)).flatten(-2), weights

    GatedSelfAttention.__name__ = GatedSelfAttention.__qualname__ = f"Gated{base.__name__}"
    return GatedSelfAttention


def init_gate(module: nn.Module, gate_init: float) -> None:
    """Their init: nn.Linear's default weights (uniform within 1/sqrt(head_dim)), bias logit(pi_init)."""
    bound = 1 / math.sqrt(module.gate_weight.shape[1])
    with torch.no_grad():
        module.gate_weight.uniform_(-bound, bound)
        module.gate_bias.fill_(math.log(gate_init / (1 - gate_init)))


def self_attentions(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, self-attention module) of each layer of a BERT-family encoder (layer.attention.self)."""
    from core.models import encoder_layers

    found = []
    for layer in encoder_layers(model)[1:]:
        parent = getattr(layer, "attention", None)
        inner = getattr(parent, "self", None)
        if not isinstance(inner, nn.Module) or not hasattr(inner, "num_attention_heads"):
            raise UserError(f"attention variants need BERT-style layers (attention.self); {type(model).__name__} "
                            "has none")
        found.append((parent, "self", inner))
    return found


def install_attention(model: nn.Module, attention: str = "softmax", gamma: float | None = None,
                      zeta: float | None = None, gate_init: float | None = None, initialise: bool = True) -> nn.Module:
    """Turn a transformers BERT-family model's attention into `attention` (settings from `attention_settings`), in
    place, and record it in its config; the gates are initialised (`initialise`) or left for weights to be loaded."""
    if attention == "softmax":
        return model
    config = model.config
    config.attention_variant = attention
    if attention == "clipped_softmax":
        register_clipped_softmax()
        config.clip_softmax_gamma, config.clip_softmax_zeta = gamma, zeta
        model.set_attn_implementation(CLIPPED)
        return model
    config.attention_gate_init = gate_init
    for parent, name, inner in self_attentions(model):
        if hasattr(inner, "gate_weight"):
            continue
        parameter = inner.query.weight
        gated = gated_class(type(inner))(inner.config, is_causal=getattr(inner, "is_causal", False),
                                         layer_idx=getattr(inner, "layer_idx", None))
        gated.load_state_dict(inner.state_dict(), strict=False)
        gated.to(device=parameter.device, dtype=parameter.dtype).train(inner.training)
        if initialise:
            init_gate(gated, gate_init)
        setattr(parent, name, gated)
    return model


def recorded_settings(config) -> dict:
    """The variant a config records (softmax when it records none), checked like the command line's."""
    attention = getattr(config, "attention_variant", "softmax")
    return attention_settings(attention, getattr(config, "clip_softmax_gamma", None) if attention == CLIPPED else None,
                              getattr(config, "clip_softmax_zeta", None) if attention == CLIPPED else None,
                              getattr(config, "attention_gate_init", None) if attention == "gated" else None)


def install_recorded(model: nn.Module, initialise: bool = True) -> nn.Module:
    """The variant the model's config records, installed (a model from `from_config` or `from_pretrained`)."""
    return install_attention(model, **recorded_settings(model.config), initialise=initialise)


def load_pretrained(auto_class, source: str, **kwargs):
    """`auto_class.from_pretrained(source, **kwargs)` with the attention variant of its config.json rebuilt: the
    clipped softmax's attention function, the gates with their saved weights (read from model.safetensors); softmax
    models load exactly as `from_pretrained` loads them. `output_loading_info=True` returns (model, info) as usual,
    the gate weights no longer among the unexpected keys (a gated model's load report is silenced: the gates are not
    unexpected; weights missing from the file are one line of transformers' log instead, unless the info is asked
    for)."""
    from transformers import AutoConfig

    config = pretrained(AutoConfig, source)
    settings = recorded_settings(config)
    if settings["attention"] == CLIPPED:
        register_clipped_softmax()
        kwargs.setdefault("attn_implementation", CLIPPED)
    if settings["attention"] != "gated":
        loaded = pretrained(auto_class, source, **kwargs)
        install_attention(loaded[0] if isinstance(loaded, tuple) else loaded, **settings, initialise=False)
        return loaded
    # gated: transformers' load report would call the gates unexpected (they are loaded next); it is silenced, and
    # anything else it would have reported is one warning
    wanted = kwargs.pop("output_loading_info", False)
    with _quiet():
        model, info = pretrained(auto_class, source, output_loading_info=True, **kwargs)
    install_attention(model, **settings, initialise=False)
    load_gates(model, source)
    info["unexpected_keys"] = {key for key in info.get("unexpected_keys", ()) if ".gate_" not in key}
    if not wanted and (info.get("missing_keys") or info.get("mismatched_keys")):  # at transformers' own verbosity
        from transformers.utils import logging

        logging.get_logger("transformers").warning(
            f"{source}: weights not in the checkpoint or of another shape, randomly initialised: "
            f"{sorted(info.get('missing_keys', ()))[:3]} {sorted(info.get('mismatched_keys', ()))[:3]}")
    return (model, info) if wanted else model


@contextlib.contextmanager
def _quiet():
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def load_gates(model: nn.Module, source: str) -> None:
    """The gate weights of a gated export's safetensors (model.safetensors, or the shards of its index) into `model` (a
    bare encoder or one with a head): a local directory's files, or a hub id's at its revision (`org/name@v1`)."""
    from safetensors import safe_open

    files = safetensors_of(source)
    if files is None:
        raise UserError(f"{source}: its config records gated attention but it has no model.safetensors (nor shards "
                        "listed in a model.safetensors.index.json): a gated export's gates are read from those")
    wanted = {name: parameter for name, parameter in model.named_parameters() if ".gate_" in name}
    found = set()
    for path in files:
        with safe_open(str(path), framework="pt") as tensors:
            for key in tensors.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if ".gate_" not in key:
                    continue
                for name in (key, key.split(".", 1)[1] if "." in key else key, f"{model.base_model_prefix}.{key}"):
                    if name in wanted:
                        with torch.no_grad():
                            wanted[name].copy_(tensors.get_tensor(key))
                        found.add(name)
                        break
    if found != set(wanted):
        raise UserError(f"{source}: its config records gated attention but model.safetensors lacks gate weights "
                        f"{sorted(set(wanted) - found)[:2]}")
