"""Forward hooks that keep the hidden states a model computes anyway (no extra forward pass), always removed.

    with HiddenStateCapture(encoder_layers(model), layers=[0, 2, 4]) as capture:
        model(input_ids)
    capture.stack()                           # [layers, batch, seq, hidden], detached

Layer l is the output of `modules[l]` (core.models.encoder_layers: 0 = the embedding module, l = transformer layer l).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from core.errors import UserError


def layer_output(output) -> Tensor:
    """A layer's output tensor: itself, or the first element of a tuple / ModelOutput."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    first = next(iter(output.values()), None) if hasattr(output, "values") else None
    if isinstance(first, Tensor):
        return first
    raise TypeError(f"cannot read a hidden-state tensor from a layer output of type {type(output).__name__}")


class HiddenStateCapture:
    """Forward hooks on the chosen layers' modules that keep their (detached) outputs; always removed on exit."""

    def __init__(self, modules: list[nn.Module], layers: list[int]) -> None:
        self.modules, self.layers = modules, layers
        self.outputs: dict[int, Tensor] = {}
        self.handles: list = []

    def __enter__(self) -> HiddenStateCapture:
        self.outputs = {}
        for index, layer in enumerate(self.layers):
            self.handles.append(self.modules[layer].register_forward_hook(self._hook(index)))
        return self

    def _hook(self, index: int):
        def keep(module, args, output) -> None:
            if index not in self.outputs:  # the first call only (gradient checkpointing re-runs layers in backward)
                self.outputs[index] = layer_output(output).detach()
        return keep

    def __exit__(self, *exc) -> bool:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        return False

    def stack(self) -> Tensor:
        """[layers, batch, seq, hidden] in the order of `layers`."""
        missing = [self.layers[i] for i in range(len(self.layers)) if i not in self.outputs]
        if missing:
            raise UserError(f"layers {missing} produced no output during the captured forward pass")
        return torch.stack([self.outputs[i] for i in range(len(self.layers))])
