"""tokenUni's SoftDecay as a layer inside a fine-tuned model (Yan, Gui, Li & He, UAI 2022): each sentence's token
matrix of the last layer transformed by the singular-value map, with alpha learned with the model (or fixed).

    python train.py fit --config configs/finetune/classify.yaml --data.source labelled.csv --model.softdecay true
    #   tokenUni's: inside the last layer, before its LayerNorm; an unconstrained learnable alpha from -0.2
    python train.py fit ... --model.softdecay true --model.softdecay_placement after_layernorm \\
        --model.softdecay_alpha_mode bounded        # ours: on the last layer's output, alpha = -sigmoid(theta)

    layer = SoftDecayLayer(alpha=-0.2, mode="learned", placement="before_layernorm")
    out = layer(hidden, mask)                   # [batch, seq, hidden], mask [batch, seq] -> [batch, seq, hidden]
    handles = wrap(model, layer, "bert-base")    # the encoder's last layer runs with the layer in place

The map is metrics/transforms.py's soft_decay, the one the post-hoc analyses (--normalize softdecay) use: per
sentence H = U S V^T, s' = -log(1 - alpha (s + alpha)) / alpha rescaled so that max s' = max s, H' = U S' V^T.

Placement `before_layernorm` (the default) is tokenUni's (hanqi-qi/tokenUni, src/transformers/models/bert/
modeling_bert.py, BertOutput with `apply_exrank add_last_beforeln`; their ExRank_gx layer, a dropout of 0.1 and then
the transformation): in the last layer, after the feed-forward output's dropout and the residual sum z = FFN(x) + x,
the layer computes LayerNorm(SoftDecay(dropout(z)) + x): as their code has it, the residual x enters the LayerNorm a
second time. The dropout's probability is --model.dropout when given, else their 0.1. Alpha is, as theirs, an
unconstrained learnable parameter initialised at --model.softdecay_alpha (mode `learned`; it may leave (-1, 0) while
training, as theirs may: at 0 or above the map is undefined and the step is non-finite, which the training module
reports). Placement `after_layernorm` (ours) transforms the last layer's output (its LayerNorm's), so the hidden state
the head pools is H' itself; mode `bounded` (ours) keeps a learned alpha in (-1, 0) as alpha = -sigmoid(theta); mode
`fixed` does not learn it.

Per unpadded sentence (ours, in every placement): tokenUni's SVD runs on the padded [batch, seq, hidden] matrix, so a
sentence's transformation depends on how much padding its batch gives it and the padding rows take part; here each
sentence's counted rows are transformed on their own (padding rows pass unchanged), which also keeps the repeated zero
singular values of zeroed padding rows, whose SVD gradients are undefined, out of the backward pass. A Python loop
over the batch.

`wrap` finds the last layer of the encoder's layer list (core.models.layer_stack: BERT's, RoBERTa's and ELECTRA's
`encoder.layer`, whose `output.LayerNorm` sums `output(intermediate, input_tensor)`; DistilBERT's `transformer.layer`,
whose `output_layer_norm` sums `ffn(x)` and x), so everything that reads hidden_states[L] (the head's pooling, the
regularisers on the last layer, the live statistics) reads the transformed last layer; layers 0..L-1 are untouched.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from core.errors import UserError
from core.models import layer_stack
from metrics.transforms import SOFTDECAY_ALPHA, check_softdecay_alpha, soft_decay

PLACEMENTS = ("before_layernorm", "after_layernorm")  # tokenUni's, ours
ALPHA_MODES = ("learned", "bounded", "fixed")  # tokenUni's unconstrained parameter, ours in (-1, 0), not learned
TOKENUNI_DROPOUT = 0.1  # their ExRank_gx: nn.Dropout(0.1) before the transformation


class SoftDecayLayer(nn.Module):
    """SoftDecay of each sentence's token matrix; alpha starts at `alpha` (in (-1, 0)) and is learned as an
    unconstrained parameter (`learned`, tokenUni's), learned as -sigmoid(theta) (`bounded`, ours), or `fixed`.
    `placement` says where `wrap` puts it; the `before_layernorm` placement applies `dropout` first (theirs)."""

    def __init__(self, alpha: float = SOFTDECAY_ALPHA, mode: str = "learned", placement: str = "before_layernorm",
                 dropout: float | None = None, option: str = "--model.softdecay_alpha") -> None:
        super().__init__()
        if mode not in ALPHA_MODES:
            raise UserError(f"--model.softdecay_alpha_mode must be one of {', '.join(ALPHA_MODES)}, got {mode!r}")
        if placement not in PLACEMENTS:
            raise UserError(f"--model.softdecay_placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
        self.initial = check_softdecay_alpha(alpha, option)
        self.mode, self.placement = mode, placement
        self.mask: Tensor | None = None  # the batch's token mask [batch, seq], set around the model's forward
        if mode == "learned":
            self.alpha_parameter = nn.Parameter(torch.tensor(float(self.initial)))
        elif mode == "bounded":
            self.theta = nn.Parameter(torch.tensor(math.log(-self.initial / (1 + self.initial))))
        probability = TOKENUNI_DROPOUT if dropout is None else dropout
        self.dropout = nn.Dropout(probability) if placement == "before_layernorm" else nn.Identity()

    @property
    def learn(self) -> bool:
        return self.mode != "fixed"

    @property
    def alpha(self) -> Tensor | float:
        """The alpha in use: a 0-dim tensor with a gradient when learned, the given float when fixed."""
        if self.mode == "learned":
            return self.alpha_parameter
        return -torch.sigmoid(self.theta) if self.mode == "bounded" else self.initial

    def value(self) -> float:
        alpha = self.alpha
        return float(alpha.detach()) if isinstance(alpha, Tensor) else alpha

    def forward(self, hidden: Tensor, mask: Tensor) -> Tensor:
        """hidden [batch, seq, hidden], mask [batch, seq] (the counted tokens) -> each sentence's counted rows
        replaced by their SoftDecay, the others (padding) as they are."""
        mask = mask.to(hidden.device).bool()
        counted = mask.nonzero()  # [n, 2] (row, position), row-major
        counts = torch.bincount(counted[:, 0], minlength=hidden.shape[0]).tolist()  # one read off the device
        out = hidden.clone()
        alpha = self.alpha
        for row, tokens in enumerate(counted[:, 1].split(counts)):
            if tokens.numel() == 0:
                continue
            matrix = hidden[row, tokens].unsqueeze(0)  # [1, count, hidden]
            full = torch.ones(1, tokens.numel(), dtype=torch.bool, device=hidden.device)
            out[row, tokens] = soft_decay(matrix, full, alpha)[0]
        return out

    def before_norm(self, summed: Tensor, residual: Tensor) -> Tensor:
        """tokenUni's placement: what the last layer's LayerNorm receives instead of z = FFN(x) + x (`summed`):
        SoftDecay(dropout(z)) + x (`residual`), both [batch, seq, hidden]."""
        return self(self.dropout(summed), self.current_mask(summed)) + residual

    def current_mask(self, hidden: Tensor) -> Tensor:
        if self.mask is None:
            raise RuntimeError("SoftDecay: the model ran without the batch's token mask")
        if hidden.shape[:2] != self.mask.shape:
            raise RuntimeError(f"SoftDecay: the last layer gave {tuple(hidden.shape)} for a mask {tuple(self.mask.shape)}")
        return self.mask


def _output_norm(layer: nn.Module) -> tuple[nn.Module, nn.Module, int, str] | None:
    """(the LayerNorm closing the feed-forward block of a transformer layer, the module whose input holds the residual
    x, that input's position and keyword) for BERT-style (`output.LayerNorm(dense(h) + input_tensor)`) and
    DistilBERT-style (`output_layer_norm(ffn(x) + x)`) layers; None for another layout."""
    output = getattr(layer, "output", None)
    if isinstance(getattr(output, "LayerNorm", None), nn.LayerNorm):
        return output.LayerNorm, output, 1, "input_tensor"
    if isinstance(getattr(layer, "output_layer_norm", None), nn.LayerNorm) and hasattr(layer, "ffn"):
        return layer.output_layer_norm, layer.ffn, 0, "input"
    return None


def wrap(model: nn.Module, layer: SoftDecayLayer, what: str) -> list[torch.utils.hooks.RemovableHandle]:
    """Put `layer` into the last layer of `model`'s layer list, where its `placement` says; a UserError (naming
    `what`, the encoder) when the model has no such place. The hooks read `layer.mask`, which the caller sets for
    each forward."""
    stack = layer_stack(model)
    if stack is None:
        raise UserError(f"--model.softdecay cannot wrap {what} ({type(model).__name__}): it has no layer stack whose "
                        "output is the last layer's token matrix (an `encoder.layer` or `transformer.layer` list "
                        "beside `embeddings`, as BERT, RoBERTa, DistilBERT, ELECTRA)")
    last = stack.layer[-1]
    if layer.placement == "after_layernorm":
        return [last.register_forward_hook(lambda module, args, output: _transform_output(layer, output))]
    found = _output_norm(last)
    if found is None:
        raise UserError(f"--model.softdecay_placement before_layernorm cannot find the LayerNorm closing the last "
                        f"layer's feed-forward block in {what} ({type(last).__name__}); --model.softdecay_placement "
                        "after_layernorm transforms the layer's output instead")
    norm, source, position, keyword = found
    residual: dict[str, Tensor] = {}

    def keep(module, args, kwargs):
        residual["x"] = args[position] if len(args) > position else kwargs[keyword]

    def transform(module, args):
        if "x" not in residual:
            raise RuntimeError("SoftDecay: the last layer's LayerNorm ran without the residual of its block")
        return (layer.before_norm(args[0], residual.pop("x")), *args[1:])

    return [source.register_forward_pre_hook(keep, with_kwargs=True), norm.register_forward_pre_hook(transform)]


def _transform_output(layer: SoftDecayLayer, output):
    """Our placement: the last layer's output (a tensor, a tuple or a ModelOutput whose first element is it)."""
    if isinstance(output, Tensor):
        return layer(output, layer.current_mask(output))
    first = output[0]
    transformed = layer(first, layer.current_mask(first))
    if isinstance(output, tuple):
        return (transformed, *output[1:])
    output[next(iter(output.keys()))] = transformed  # a transformers ModelOutput: last_hidden_state
    return output
