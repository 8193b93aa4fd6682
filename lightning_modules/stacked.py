"""Linear probes on many layers at once: one weight [slots, hidden, classes], one batched matmul, one fused loss.

    probe = StackedProbe([("encoder", 0), ("encoder", 1)], hidden=384, classes=300, seed=0)
    loss = probe.loss(features, positions)       # features [slots, items, hidden], positions [items]
    logits = probe(features)                     # [slots, items, classes]

Used by the probe.py probes (lightning_modules/probes.py) and by the online probe of the ContributionVectors
callback: training the slots together equals training each alone (each slot's own seeded initial weights, each
slot's own mean loss).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

_INIT_KIND = {"encoder": 0, "clipped": 0, "softdecay": 0, "random": 1, "control": 2}  # clipped, SoftDecay: the raw twin's


def pad_weight(weight: Tensor, multiple: int = 64) -> Tensor:
    """weight [slots, hidden, classes] → [slots, hidden, width]: with 64 classes or more the class dim is zero-padded
    to a multiple of `multiple` (CPU BLAS runs 300 columns slower than 320)."""
    slots, hidden, classes = weight.shape
    width = -(-classes // multiple) * multiple if classes >= multiple else classes
    if width == classes:
        return weight
    padded = weight.new_zeros(slots, hidden, width)
    padded[:, :, :classes] = weight
    return padded


def padded_logits(x: Tensor, weight: Tensor, bias: Tensor | None = None, classes: int | None = None) -> Tensor:
    """x [slots, items, hidden] @ weight [slots, hidden, classes] (+ bias [slots, classes]) → [slots, items, width].

    The weight is padded by `pad_weight` (or already is, with `classes` its true number of classes) and the padding
    columns of the logits are -inf, so a softmax over the padded logits is the true one.
    """
    padded = pad_weight(weight) if classes is None else weight
    classes = weight.shape[2] if classes is None else classes
    logits = torch.bmm(x.to(padded.dtype), padded)
    if bias is not None:
        logits[:, :, :classes] += bias.unsqueeze(1)
    logits[:, :, classes:] = float("-inf")
    return logits


class StackedLinearCrossEntropy(torch.autograd.Function):
    """Sum over slots of each slot's mean cross-entropy of x @ weight (+ bias), with the gradient formed in the
    forward pass: chunk by chunk of items, the softmax is taken once, turned into the logits' gradient in place
    (softmax - one-hot) and folded into the weight (and bias) gradient; the features' gradient is never formed.
    Nothing of size [slots, items, classes] is kept for backward, and on CPU the chunks (`chunk_elements` logits,
    4 MiB) reuse the same memory where whole-batch logits would fault in fresh pages every step. Equal to
    F.cross_entropy through autograd (tested), faster on CPU. The returned loss saturates at -log(smallest float)
    for a token whose gold probability underflows; the gradient is exact. `classes`: the true number of classes when
    `weight` is already padded (StackedProbe(pad=True)): its gradient is then the padded one, zero in the padding
    columns, and no padded copy of the weight is made."""

    # logits per chunk on CPU; None: the whole batch in one chunk, as always on GPUs (their allocator reuses memory)
    chunk_elements: int | None = 2 ** 20

    @staticmethod
    def forward(ctx, x: Tensor | tuple[Tensor, ...], weight: Tensor, bias: Tensor | None, target: Tensor,
                classes: int | None = None) -> Tensor:
        """x [slots, items, hidden], or a tuple of parts [slots_k, items, hidden] whose slots follow each other (the
        weight's first slots are the first part's: no stacked copy of the features is made); weight [slots, hidden,
        classes (or padded)]; target [items] or [slots, items]."""
        parts = tuple(x) if isinstance(x, (tuple, list)) else (x,)
        slots, items, device = sum(part.shape[0] for part in parts), parts[0].shape[1], parts[0].device
        prepadded = classes is not None and classes != weight.shape[2]
        classes = weight.shape[2] if classes is None else classes
        padded = weight if prepadded else pad_weight(weight)  # [slots, hidden, width]
        width = padded.shape[2]
        chunk_elements = StackedLinearCrossEntropy.chunk_elements
        one_piece = device.type == "cuda" or chunk_elements is None
        rows = max(items, 1) if one_piece else max(1, chunk_elements // (slots * width))  # an empty batch: no chunk
        scale = 1.0 / max(items, 1)  # each slot's mean over items
        # the first chunk overwrites (beta 0), so the gradient needs no zeroing unless there is no chunk
        grad_weight = (torch.empty if items else torch.zeros)(padded.shape, dtype=torch.float32, device=device)
        grad_bias = torch.zeros(slots, width, device=device) if bias is not None else None
        loss = torch.zeros((), device=device)
        bounds = [0]
        for part in parts:
            bounds.append(bounds[-1] + part.shape[0])
        for start in range(0, items, rows):
            for part, first, last in zip(parts, bounds, bounds[1:]):
                chunk = part[:, start:start + rows].to(padded.dtype)  # [part slots, rows, hidden]
                probs = torch.softmax(padded_logits(chunk, padded[first:last],
                                                    bias[first:last] if bias is not None else None, classes),
                                      -1).float()  # [part slots, rows, width]
                index = (target[first:last, start:start + rows] if target.dim() == 2 else
                         target[start:start + rows].view(1, -1).expand(last - first, -1)).unsqueeze(-1)
                loss -= probs.gather(2, index).clamp_min(torch.finfo(probs.dtype).tiny).log().sum()
                probs.scatter_add_(2, index, torch.full(index.shape, -1.0, device=probs.device))  # d loss / d logits
                with torch.autocast(device.type, enabled=False):  # the gradient in float32, as autograd's would be
                    grad_weight[first:last].baddbmm_(chunk.float().transpose(1, 2), probs, beta=1 if start else 0,
                                                     alpha=scale)
                if grad_bias is not None:
                    grad_bias[first:last] += probs.sum(1)
        # kept on ctx, not saved for backward: backward scales them in place and hands them over (no copies)
        ctx.grad_weight = grad_weight if prepadded else grad_weight[:, :, :classes].contiguous()
        ctx.grad_bias = grad_bias[:, :classes] * scale if grad_bias is not None else None
        ctx.dtype = weight.dtype
        return loss * scale

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad_weight, grad_bias = ctx.grad_weight, ctx.grad_bias
        ctx.grad_weight = ctx.grad_bias = None  # backward runs once (no retain_graph: the graph holds no tensors)
        # the loss itself backpropagated (grad 1): no pass over the gradient; read on CPU only (a GPU would sync)
        if grad.is_cuda or float(grad) != 1.0:
            grad_weight.mul_(grad)
            grad_bias = grad_bias.mul_(grad) if grad_bias is not None else None
        return (None, grad_weight.to(ctx.dtype), grad_bias.to(ctx.dtype) if grad_bias is not None else None, None,
                None)


def slot_seed(seed: int, kind: str, layer: int) -> int:
    """The initial-weight seed of one probe: the same whichever other probes train beside it."""
    return (seed * 1_000_003 + _INIT_KIND[kind] * 10_007 + layer) % (2 ** 63)


class StackedProbe(nn.Module):
    """One linear probe per slot, stacked: weight [slots, hidden, classes] (+ bias [slots, classes]).

    Each slot's initial weights come from its own seeded generator (nn.Linear's range, seeds by `slot_seed`), so a
    probe starts the same whichever other probes train beside it. `loss` is the sum over slots of each slot's mean
    cross-entropy, so every slot gets exactly the gradient it would get alone. With `pad`, the weight parameter is
    stored padded, [slots, hidden, width] by `pad_weight` (no padded copy per step); its padding columns stay zero
    (their gradient is exactly zero, and Adam does not move a parameter whose gradient has always been zero), and
    `weights` is the [slots, hidden, classes] view.
    """

    def __init__(self, slots: Sequence[tuple[str, int]], hidden: int, classes: int, seed: int = 0,
                 bias: bool = False, pad: bool = False) -> None:
        super().__init__()
        bound = 1.0 / math.sqrt(hidden)  # nn.Linear's default initialisation range
        weights, biases = [], []
        for kind, layer in slots:
            generator = torch.Generator().manual_seed(slot_seed(seed, kind, layer))
            weights.append(torch.empty(hidden, classes).uniform_(-bound, bound, generator=generator))
            biases.append(torch.empty(classes).uniform_(-bound, bound, generator=generator))
        self.classes = classes
        weight = torch.stack(weights)  # [slots, hidden, classes]
        self.weight = nn.Parameter(pad_weight(weight) if pad else weight)
        self.bias = nn.Parameter(torch.stack(biases)) if bias else None  # [slots, classes]

    @property
    def weights(self) -> Tensor:
        """[slots, hidden, classes] (a view of the padded parameter with pad)."""
        return self.weight[:, :, :self.classes]

    def forward(self, x: Tensor) -> Tensor:
        """x [slots, items, hidden] → logits [slots, items, classes]."""
        prepadded = self.weight.shape[2] != self.classes
        return padded_logits(x, self.weight, self.bias, self.classes if prepadded else None)[:, :, :self.classes]

    def loss(self, x: Tensor | tuple[Tensor, ...], target: Tensor) -> Tensor:
        """The sum over slots of each slot's mean cross-entropy of x [slots, items, hidden] (or its parts, slots
        following each other, never stacked into one copy) against target [items] (every slot's) or [slots, items]
        (each slot's own: a control task beside the task)
        (StackedLinearCrossEntropy: the gradient is formed in the forward pass, x's is never made)."""
        return StackedLinearCrossEntropy.apply(x, self.weight, self.bias, target, self.classes)
