"""The hidden states a model computes anyway (no extra forward pass), by one of two routes.

    tap = HiddenStateTap()                    # a model that returns its own hidden states when asked (MLMModule)
    tap.request(owner)                        # before the forward: the model's next forward returns them...
    tap.keep(out.hidden_states)               # ...and hands them over (the model's code does this)
    tap.stack([0, 2, 4]); tap.release(owner)  # [layers, batch, seq, hidden], detached
    tap.request(loss_term, grad=True)         # a loss term (a regulariser) gets the same states with their graph:
    tap.live([2, 4])                          # [batch, seq, hidden] per layer, not detached; one forward serves all

    with HiddenStateCapture(hidden_state_sites(model), layers=[0, 2, 4]) as capture:   # any other model: hooks
        model(input_ids)
    capture.stack()                           # [layers, batch, seq, hidden], detached

Layer l is the output of `modules[l]` (core.models.encoder_layers: 0 = the embedding module, l = transformer layer l),
or, for an entry (module, "input"), the module's input (a decoder's hidden_states[0] is its first layer's input:
core.models.hidden_state_sites), the same as transformers' `hidden_states[l]`. The tap is what a compiled model needs: the request is a Python flag
the model passes into its (compiled) forward, so the graph returns the states itself, where forward hooks added
after compilation would be silently skipped (dynamo does not re-guard on hooks).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from core.errors import UserError


def check_finite(states, attention_mask: Tensor, what: str) -> Tensor:
    """attention_mask [batch, seq] as bool (the real tokens), after checking that no hidden state [batch, seq, hidden] of
    `states` (layers 0..L) holds inf or nan at a real token; one line (UserError) if one does: float16 past its range
    (65504: a massive activation, a residual stream) gives inf, and nan after the next norm, which every statistic would
    count (or crash on: the massive activations' histogram)."""
    real = attention_mask.bool()
    bad = torch.stack([((~state.isfinite()).any(-1) & real).any() for state in states])  # [layers]: one sync, no copy
    if bool(bad.any()):
        layer = int(bad.nonzero()[0])
        raise UserError(f"{what}: its hidden states hold inf or nan in {str(states[layer].dtype).removeprefix('torch.')} "
                        f"(from layer {layer}: activations past the dtype's range); use --dtype float32 or bfloat16")
    return real


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
    """Forward hooks on the chosen layers' modules that keep their (detached) outputs (or, for a (module, "input")
    entry, inputs; for a (module, "output", n) entry, the output of its n-th call: ALBERT's shared layers); always
    removed on exit. One forward pass per capture."""

    def __init__(self, modules: list[nn.Module | tuple], layers: list[int]) -> None:
        self.modules, self.layers = modules, layers
        self.outputs: dict[int, Tensor] = {}
        self.handles: list = []

    def __enter__(self) -> HiddenStateCapture:
        self.outputs = {}
        shared: dict[nn.Module, dict[int, int]] = {}  # a module run for several layers (ALBERT): call -> index
        for index, layer in enumerate(self.layers):
            entry = self.modules[layer] if isinstance(self.modules[layer], tuple) else (self.modules[layer], "output")
            module, read = entry[:2]
            if len(entry) > 2:
                shared.setdefault(module, {})[entry[2]] = index
            elif read == "input":
                self.handles.append(module.register_forward_pre_hook(self._input_hook(index), with_kwargs=True))
            else:
                self.handles.append(module.register_forward_hook(self._hook(index)))
        for module, indices in shared.items():
            self.handles.append(module.register_forward_hook(self._calls_hook(indices)))
        return self

    def _calls_hook(self, indices: dict[int, int]):
        """One hook on a module that runs for several layers: its n-th call since __enter__ is layer indices[n] (one
        forward pass per capture; the calls a checkpointed backward re-runs come after and are not kept)."""
        calls = [0]

        def keep(module, args, output) -> None:
            index = indices.get(calls[0])
            calls[0] += 1
            if index is not None and index not in self.outputs:
                self.outputs[index] = layer_output(output).detach()
        return keep

    def _input_hook(self, index: int):
        def keep(module, args, kwargs) -> None:
            if index not in self.outputs:
                self.outputs[index] = (args[0] if args else kwargs["hidden_states"]).detach()
        return keep

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


class HiddenStateTap:
    """The switch and mailbox between a model that can return its own hidden states and whoever wants them.

    Owners (live-statistics callbacks, a regulariser) `request` the states of the next forward passes; the model
    reads `active` (and `wants_grad`) before each forward (Python bools: a compiled model has one graph per setting,
    never a recompile per capture), passes what its forward returned to `keep` (all layers), and owners read
    `stack(layers)` (detached) or, having asked with `grad=True`, `live(layers)` (with their graph, for a loss term),
    and `release` once done. The states are dropped when the last owner releases (the live ones when the last owner
    that asked for them does).
    """

    def __init__(self) -> None:
        self.owners: set[int] = set()
        self.grad_owners: set[int] = set()
        self.hidden: tuple[Tensor, ...] | None = None  # all layers of the last forward: (embeddings, layer 1, ...)
        self.live_hidden: tuple[Tensor, ...] | None = None  # the same, not detached, while a grad owner holds them

    @property
    def active(self) -> bool:
        return bool(self.owners)

    @property
    def wants_grad(self) -> bool:
        """An owner needs the states with their graph (the forward must not detach them)."""
        return bool(self.grad_owners)

    def request(self, owner: object, grad: bool = False) -> None:
        self.owners.add(id(owner))
        if grad:
            self.grad_owners.add(id(owner))

    def release(self, owner: object) -> None:
        self.owners.discard(id(owner))
        self.grad_owners.discard(id(owner))
        if not self.grad_owners:
            self.live_hidden = None
        if not self.owners:
            self.hidden = None

    def keep(self, hidden) -> None:
        """The forward's hidden states [batch, seq, hidden] per layer (transformers' `hidden_states`)."""
        self.hidden = tuple(h.detach() for h in hidden)
        self.live_hidden = tuple(hidden) if self.grad_owners else None

    def stack(self, layers: list[int]) -> Tensor:
        """[layers, batch, seq, hidden] in the order of `layers`, from the last forward."""
        if self.hidden is None:
            raise UserError(f"layers {list(layers)} produced no output during the captured forward pass (the model "
                            "ran no forward pass since the states were requested)")
        return torch.stack([self.hidden[layer] for layer in layers])

    def live(self, layers: list[int]) -> list[Tensor]:
        """[batch, seq, hidden] of each of `layers` from the last forward, with their graph (a `grad=True` owner)."""
        if self.live_hidden is None:
            raise UserError(f"layers {list(layers)}: no hidden states with their graph (the model ran no forward "
                            "pass since they were requested with grad=True)")
        return [self.live_hidden[layer] for layer in layers]
