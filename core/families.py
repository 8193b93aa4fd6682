"""Model families beyond BERT's layout, read off the model itself: decoders (GPT-2, Llama / Qwen, GPT-NeoX / Pythia,
OPT) and rotary encoders (ModernBERT, RoFormer).

    Family                     # causal or bidirectional, positions, norms, what layer L is (core.models.model_family)
    decoder_stack(model)       # Stack(blocks, final_norm) of a model whose layers sit in one flat list, or None
    hidden_state_sites(model)  # [(module, "input" | "output")]: where hidden_states[0..L] are read, by hooks
    position_table(model)      # (nn.Embedding, first row a token uses) of an absolute table, or None
    output_projection(model)   # a Linear after the stack to another width (OPT-350m's project_out), or None
    norm_placement(model, norm)   # (hidden-state layers, placement) of a LayerNorm / RMSNorm
    rotary_queries_keys(model) # (q, k) -> (q, k) rotated as the model's attention does (RoFormer), or None
    check_position_type(config, name)   # one line for a position_embedding_type transformers no longer implements

Layers follow transformers' `hidden_states`: 0 is the input of the first transformer layer (the embedding output),
l the output of layer l for l < L; for models with a final norm (GPT-2's ln_f, Llama's norm, GPT-NeoX's and OPT's
final_layer_norm, ModernBERT's final_norm) layer L is the last layer's output after that norm (transformers replaces
the last entry with `last_hidden_state`), except that a projection after the stack to another width (OPT-350m's
`project_out`) is not a layer: layer L is its input (`output_projection`). BERT-family encoders (post-LN: every
layer ends in its LayerNorm) have no final norm: layer L is the last layer's output. docs/families.md has the table.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torch import Tensor, nn

from core.errors import UserError, warn_once
from core.norms import feeding_norms, norm_affine

BLOCK_LISTS = ("h", "layers", "layer", "blocks")  # GPT-2 / Llama, NeoX, OPT, ModernBERT / BERT's encoder.layer / MPT
FINAL_NORMS = ("ln_f", "norm", "final_layer_norm", "final_norm", "final_layernorm", "norm_f")  # ... Phi, MPT
POSITION_TABLES = ("wpe", "embed_positions")  # GPT-2; OPT (offset 2). BERT's embeddings.position_embeddings: models.py
OUTPUT_PROJECTIONS = ("project_out",)  # OPT-350m: hidden size -> word_embed_proj_dim after the last layer


@dataclass(frozen=True)
class Stack:
    """A flat stack of transformer layers: `blocks` [L] and the norm after the last one (None: none)."""

    container: nn.Module
    blocks: nn.ModuleList
    final_norm: nn.Module | None


@dataclass(frozen=True)
class Family:
    """What the analyses need to know about a model's kind, for reports and for what a command can do."""

    model_type: str
    causal: bool  # each token sees only itself and the tokens before it
    positions: str  # "learned table" | "zero table (no positions)" | "rotary (RoPE)" | "fixed sinusoids" (XGLM) |
    # "fixed sinusoids (a frozen table)" (DistilBERT's sinusoidal_pos_embds) | "ALiBi biases (no table)" (BLOOM, MPT) |
    # "relative biases (no table)" (DeBERTa) | "no absolute table"
    norms: str  # "post-LN" | "pre-LN"
    last_layer: str  # what hidden_states[L] is

    def to_dict(self) -> dict:
        return asdict(self)


def _base(model: nn.Module) -> nn.Module:
    return getattr(model, "base_model", model)


def is_causal(config) -> bool:
    """A decoder: config.is_decoder (RoBERTa / RoFormer built as one), or a model type transformers has no masked-LM
    class for (GPT-2, Llama, GPT-NeoX, OPT, ...)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    return bool(getattr(config, "is_decoder", False)) or config.model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def decoder_stack(model: nn.Module) -> Stack | None:
    """The flat layer list of a model that is not BERT's `embeddings` + `encoder.layer` layout: GPT-2's `h`, Llama's,
    GPT-NeoX's and ModernBERT's `layers`, OPT's `decoder.layers`, MPT's `blocks`, with the final norm beside it (None
    when none). BERT's layout with a norm after its layers (pre-LN encoders: Megatron-BERT's `encoder.ln`, ESM's
    `encoder.emb_layer_norm_after`, XLM-RoBERTa-XL's `encoder.LayerNorm`) is a stack too: transformers' last hidden
    state is that norm's output; BERT's own layout (post-LN, no final norm) is None (core.models.layer_stack)."""
    base = _base(model)
    config = getattr(base, "config", None)
    hidden = getattr(config, "hidden_size", None)
    encoder = getattr(base, "encoder", None)
    if encoder is not None and getattr(base, "embeddings", None) is not None:
        blocks = getattr(encoder, "layer", None)
        if not isinstance(blocks, nn.ModuleList) or not blocks or _ends_in_norm(blocks[-1], hidden):
            return None  # post-LN (BERT, RoBERTa, DeBERTa: each layer's output goes through its own LayerNorm)
        norm = _final_norm(encoder, blocks, hidden)
        return Stack(encoder, blocks, norm) if norm is not None else None
    count = getattr(config, "num_hidden_layers", None)
    for container in (base, getattr(base, "decoder", None)):
        if not isinstance(container, nn.Module):
            continue
        lists = [getattr(container, name, None) for name in BLOCK_LISTS]
        lists += [child for child in container.children() if isinstance(child, nn.ModuleList)]  # any other name
        for blocks in lists:
            if isinstance(blocks, nn.ModuleList) and len(blocks) > 0 and (count is None or len(blocks) == count):
                return Stack(container, blocks, _final_norm(container, blocks, hidden))
    return None


def _ends_in_norm(layer: nn.Module, hidden: int | None) -> bool:
    """A BERT-layout layer whose output sub-module ends in a norm (`output.LayerNorm`): post-LN."""
    output = getattr(layer, "output", None)
    norms = [getattr(output, name, None) for name in ("LayerNorm", "layer_norm", "norm")]
    return hidden is None or any(isinstance(norm, nn.Module) and norm_affine(norm, hidden) is not None
                                 for norm in norms)


def _final_norm(container: nn.Module, blocks: nn.Module, hidden: int | None) -> nn.Module | None:
    """The norm after `blocks`: one of FINAL_NORMS, or else the last norm over the hidden size that `container`
    registers after its blocks and whose name does not say embedding (XGLM's `layer_norm`, ESM's
    `emb_layer_norm_after`, mBART's `layer_norm`, not its `layernorm_embedding`); None when there is none."""
    named = next((getattr(container, name) for name in FINAL_NORMS
                  if isinstance(getattr(container, name, None), nn.Module)), None)
    if named is not None or hidden is None:
        return named
    after, last = False, None
    for name, child in container.named_children():
        if after and "embed" not in name and norm_affine(child, hidden) is not None:
            last = child  # the last one: BART's layernorm_embedding comes after its layers too, and is not final
        after = after or child is blocks
    return last


def hidden_state_sites(model: nn.Module) -> list[tuple[nn.Module, str]] | None:
    """Where transformers reads hidden_states[0..L] of a decoder stack: the input of the first layer, the outputs of
    layers 1..L-1, and the final norm's output (or the last layer's, without one); None for other layouts."""
    stack = decoder_stack(model)
    if stack is None:
        return None
    blocks = list(stack.blocks)
    last = (stack.final_norm, "output") if stack.final_norm is not None else (blocks[-1], "output")
    return [(blocks[0], "input"), *((block, "output") for block in blocks[:-1]), last]


def output_projection(model: nn.Module) -> nn.Linear | None:
    """The Linear after a decoder stack (and its final norm, if any) that maps the hidden size to another width:
    OPT-350m's `decoder.project_out` (1024 -> word_embed_proj_dim 512, what its LM head reads); None without one.
    transformers' last hidden state is its output; the stack's own last state is its input (hidden_state_sites[L])."""
    stack = decoder_stack(model)
    projections = [getattr(stack.container, name, None) for name in OUTPUT_PROJECTIONS] if stack is not None else []
    return next((p for p in projections if isinstance(p, nn.Linear)), None)


def position_table(model: nn.Module) -> tuple[nn.Embedding, int] | None:
    """A decoder's absolute position table and the row of position 0: GPT-2's `wpe` (row 0), OPT's `embed_positions`
    (row 2: OPT numbers positions from 2); None when the model has none here (BERT's table: core.models)."""
    stack = decoder_stack(model)
    if stack is None:
        return None
    for name in POSITION_TABLES:
        table = getattr(stack.container, name, None)
        if isinstance(table, nn.Embedding):
            return table, int(getattr(table, "offset", 0) or 0)
    return None


def is_rotary(model: nn.Module) -> bool:
    """Rotary position embeddings inside attention: a `*Rotary*` module (Llama, Qwen, GPT-NeoX, ModernBERT) or
    RoFormer's rotary sinusoids (config.rotary_value); not when the config asks for ALiBi (Falcon builds its rotary
    module whatever `alibi` says, and with alibi true its attention never applies it: falcon-rw-1b)."""
    config = getattr(model, "config", None)
    if getattr(config, "alibi", False):
        return False
    return hasattr(config, "rotary_value") or any("Rotary" in type(m).__name__ for m in model.modules())


def attention_biases(model: nn.Module) -> str | None:
    """Positions that enter attention as biases, with no table and no rotation: "ALiBi" (BLOOM, MPT, Falcon's alibi
    option: a linear penalty by distance), "relative" (DeBERTa's relative_attention: learned distance embeddings);
    None otherwise (MPNet's relative biases come beside an absolute table, which is what the report names)."""
    base = _base(model)
    config = getattr(base, "config", None)
    alibi = getattr(config, "alibi", False) or getattr(getattr(config, "attn_config", None), "alibi", False)
    if alibi or any("alibi" in name.lower() for name in dir(type(base))):
        return "ALiBi"
    if getattr(config, "relative_attention", False):
        return "relative"
    return None


def is_sinusoidal(model: nn.Module) -> bool:
    """Fixed sinusoidal absolute positions added to the embeddings (XGLM's `embed_positions`), not rotary ones."""
    return not is_rotary(model) and any("Sinusoidal" in type(m).__name__ for m in model.modules())


def check_position_type(config, name: str, weights_of: str | None = None) -> None:
    """One line for a config whose `position_embedding_type` the installed transformers' model of its type never reads:
    a BERT-family checkpoint trained with transformers 4's relative positions ("relative_key", "relative_key_query";
    transformers 5 removed them from BERT, RoBERTa, ELECTRA, ...) loads without complaint, drops its trained distance
    embeddings and adds its absolute table, which transformers 4 built and never used (untrained). A model that reads
    the key passes with whatever value it gives it (ESM's "rotary"; Granite 4.0-H's "nope", which its model reads as
    "not rope": the value need not be written in its source), and so does "absolute" anywhere. With `weights_of` (the
    model's directory or hub id): a checkpoint whose safetensors hold no distance embedding and whose absolute table is
    trained (`_stale_table`) passes with a warning, the key stale (trained and saved by transformers 5)."""
    kind = getattr(config, "position_embedding_type", None)
    if not isinstance(kind, str) or kind == "absolute":
        return
    source = _modeling_source(config.model_type)
    if source is None or "position_embedding_type" in source:
        return
    import transformers

    unread = (f"its config asks for position_embedding_type {kind!r}, which transformers {transformers.__version__}'s "
              f"{config.model_type!r} model does not implement")
    trained = _stale_table(weights_of) if weights_of is not None else None
    if trained is not None and trained >= TRAINED_TABLE:
        warn_once(f"{name}: {unread}, but its weights hold no relative-position (distance_embedding) weights and its "
                  f"absolute position table is trained (adjacent positions' rows: mean cosine {trained:.2f}; an "
                  "untrained table's is near 0): the key is stale (a checkpoint transformers 5 trained and saved), so "
                  "it is read with that table")
        return
    raise UserError(f"cannot read {name}: {unread}: it would drop the checkpoint's relative-position weights and add "
                    "its absolute position table instead (untrained where the checkpoint used relative positions), so "
                    "its hidden states would not be the trained model's")


TRAINED_TABLE = 0.2  # the least mean cosine of adjacent rows of a trained table (ours; an untrained one's is ~0)


def _stale_table(source: str) -> float | None:
    """For a checkpoint whose safetensors hold no distance embedding (no relative positions: transformers 4 saved them
    as parameters), the mean cosine of adjacent rows of its absolute position table: near 0 where the table is the
    untrained one transformers 4 left (a relative checkpoint that transformers 5 only loaded and saved again, dropping
    its distance embeddings), high where a model trained it; None otherwise, or when the weights cannot be read (the
    refusal then stands)."""
    from safetensors import safe_open

    from core.sources import safetensors_of

    try:
        files, table = safetensors_of(source), None
        for path in files or ():
            with safe_open(str(path), framework="pt") as tensors:
                keys = list(tensors.keys())  # noqa: SIM118 (safe_open is not a mapping)
                if any("distance_embedding" in key for key in keys):
                    return None
                for key in keys:
                    if key.endswith("embeddings.position_embeddings.weight"):
                        table = tensors.get_tensor(key).double()
    except Exception:  # noqa: BLE001 (any failure to read the weights: the refusal, as without this check)
        return None
    if table is None or len(table) < 2:
        return None
    rows = table / table.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return float((rows[1:] * rows[:-1]).sum(1).mean())


def _modeling_source(model_type: str) -> str | None:
    """The source of transformers' modeling module for `model_type` (None when it cannot be read)."""
    import importlib
    import inspect

    from transformers.models.auto.configuration_auto import model_type_to_module_name

    module = model_type_to_module_name(model_type)
    try:
        return inspect.getsource(importlib.import_module(f"transformers.models.{module}.modeling_{module}"))
    except (ImportError, OSError, TypeError):
        return None


def pre_norm(model: nn.Module) -> bool:
    """Layers that normalise the input of attention and MLP (pre-LN: GPT-2, Llama, GPT-NeoX, OPT except OPT-350m's
    do_layer_norm_before false, ModernBERT), not their output (post-LN: BERT's layout)."""
    return decoder_stack(model) is not None and getattr(_base(model).config, "do_layer_norm_before", True) is not False


def norm_placement(model: nn.Module, module: nn.Module) -> tuple[list[int], str] | None:
    """(hidden-state layers, placement) of a norm of a decoder stack: "pre" inside layer l (it normalises the input of
    a sub-layer; the residual stream it reads is not its output), "sublayer_output" inside layer l of a pre-LN stack
    (it normalises a sub-layer's output before the residual stream adds it: Gemma 2/3's and OLMo-2's
    post_*_layernorm; core.norms.feeding_norms tells them apart), "post" inside layer l without pre-LN, "final" (it
    writes layer L), "embedding" (it writes layer 0: ModernBERT's embedding norm), "head" outside the model's body (no
    hidden state); None for BERT's layout (core.models.written_layers)."""
    stack = decoder_stack(model)
    if stack is None:
        return None
    if module is stack.final_norm:
        return [len(stack.blocks)], "final"
    for index, block in enumerate(stack.blocks):
        if any(inner is module for inner in block.modules()):
            if not pre_norm(model):
                return [index + 1], "post"
            hidden = getattr(getattr(_base(model), "config", None), "hidden_size", None)
            fed = feeding_norms(_base(model), stack.blocks, hidden) if hidden else None
            return [index + 1], "pre" if fed is None or id(module) in fed else "sublayer_output"
    if any(inner is module for inner in _base(model).modules()):
        return [0], "embedding"
    return [], "head"


def name_of(model: nn.Module, module: nn.Module) -> str:
    """The name of `module` inside the model's body."""
    return next((n for n, m in _base(model).named_modules() if m is module), type(module).__name__)


def rotary_queries_keys(model: nn.Module):
    """A function (queries, keys) [batch, seq, heads, head_dim] -> the same rotated by position as the model's own
    attention rotates them (RoFormer: transformers' `apply_rotary_position_embeddings` with its `embed_positions`
    sinusoids), or None for a model without rotary positions in BERT's layout."""
    base = _base(model)
    sinusoids = getattr(getattr(base, "encoder", None), "embed_positions", None)
    layers = getattr(getattr(base, "encoder", None), "layer", None)
    inner = getattr(getattr(layers[0], "attention", None), "self", None) if layers else None
    rotate = getattr(inner, "apply_rotary_position_embeddings", None)
    if sinusoids is None or rotate is None:
        return None

    def rotated(queries: Tensor, keys: Tensor) -> tuple[Tensor, Tensor]:
        batch, seq = queries.shape[:2]
        angles = sinusoids((batch, seq))[None, None].to(queries)  # [1, 1, seq, head_dim]
        q, k = rotate(angles, queries.transpose(1, 2), keys.transpose(1, 2))  # [batch, heads, seq, head_dim]
        return q.transpose(1, 2), k.transpose(1, 2)

    return rotated
