"""tokenUni's SoftDecay as a layer inside a fine-tuned model (Yan, Gui, Li & He, UAI 2022): the last layer's token
matrix of each sentence transformed before the head pools it, alpha fixed or learned with the model.

    python train.py fit --config configs/finetune/classify.yaml --data.source labelled.csv --model.softdecay true \\
        --model.softdecay_learn_alpha true            # alpha learned from -0.2 (--model.softdecay_alpha)

    layer = SoftDecayLayer(alpha=-0.2, learn=True)
    out = layer(hidden, mask)                   # [batch, seq, hidden], mask [batch, seq] -> [batch, seq, hidden]
    handle = wrap(model, layer, "bert-base")    # the encoder's last layer returns layer(its output, mask)

The formula is metrics/transforms.py's soft_decay, the one the post-hoc analyses (--normalize softdecay) use: per
sentence H = U S V^T (padding excluded), s' = -log(1 - alpha (s + alpha)) / alpha rescaled so that max s' = max s,
H' = U S' V^T. Here it runs one unpadded sentence at a time, so that its SVD has no repeated zero singular values from
the padding (their gradients are undefined). A learned alpha is kept in (-1, 0) by its parametrisation
alpha = -sigmoid(theta) (ours: the tokenUni paper learns alpha without saying how it stays in range).

`wrap` hooks the last layer of the encoder's layer list (core.models.layer_stack: BERT's and RoBERTa's
`encoder.layer`, DistilBERT's `transformer.layer`), so the head's pooling ([CLS], the pooler, mean pooling) reads the
transformed last layer, and so does everything else that reads hidden_states[L]: the regularisers on the last layer
and the live statistics (the model's own last hidden state is the transformed one; layers 0..L-1 are untouched).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from core.errors import UserError
from core.models import layer_stack
from metrics.transforms import SOFTDECAY_ALPHA, check_softdecay_alpha, soft_decay


class SoftDecayLayer(nn.Module):
    """SoftDecay of each sentence's token matrix with alpha in (-1, 0): fixed, or learned (alpha = -sigmoid(theta),
    theta initialised so that alpha starts at `alpha`)."""

    def __init__(self, alpha: float = SOFTDECAY_ALPHA, learn: bool = False,
                 option: str = "--model.softdecay_alpha") -> None:
        super().__init__()
        self.initial = check_softdecay_alpha(alpha, option)
        self.learn = learn
        self.mask: Tensor | None = None  # the batch's token mask [batch, seq], set around the model's forward
        if learn:
            self.theta = nn.Parameter(torch.tensor(math.log(-self.initial / (1 + self.initial))))

    @property
    def alpha(self) -> Tensor | float:
        """The alpha in use: a 0-dim tensor with a gradient when learned, the given float when fixed."""
        return -torch.sigmoid(self.theta) if self.learn else self.initial

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


def wrap(model: nn.Module, layer: SoftDecayLayer, what: str) -> torch.utils.hooks.RemovableHandle:
    """Hook `layer` onto the output of the last layer of `model`'s layer list; a UserError (naming `what`, the
    encoder) when the model has none. The hook reads `layer.mask`, which the caller sets for each forward."""
    stack = layer_stack(model)
    if stack is None:
        raise UserError(f"--model.softdecay cannot wrap {what} ({type(model).__name__}): it has no layer stack whose "
                        "output is the last layer's token matrix (an `encoder.layer` or `transformer.layer` list "
                        "beside `embeddings`, as BERT, RoBERTa, DistilBERT, ELECTRA)")

    def transform(module, args, output):
        mask = layer.mask
        if mask is None:
            raise RuntimeError("SoftDecay: the model ran without the batch's token mask")
        if isinstance(output, Tensor):
            return layer(output, mask)
        first = output[0]
        if first.shape[:2] != mask.shape:
            raise RuntimeError(f"SoftDecay: the last layer returned {tuple(first.shape)} for a mask "
                               f"{tuple(mask.shape)}")
        if isinstance(output, tuple):
            return (layer(first, mask), *output[1:])
        output[next(iter(output.keys()))] = layer(first, mask)  # a transformers ModelOutput: last_hidden_state
        return output

    return stack.layer[-1].register_forward_hook(transform)
