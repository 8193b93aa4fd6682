"""Norms found by what they do, not by their class: a LayerNorm or an RMSNorm over the hidden size, its per-dimension
gain and bias read off its forward pass (Gemma's RMSNorm multiplies by 1 + weight; OLMo's LayerNorm has no
parameters), and which norms of a block feed its sub-layers (pre-LN) rather than normalise a sub-layer's output.

    affine = norm_affine(module, hidden)      # NormAffine(gain, bias | None, centres) or None: not a norm over hidden
    is_norm(module, hidden)
    feeding_norms(model, blocks, hidden)      # ids of the norms whose output a weight of their own block reads
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from torch import Tensor, nn

NORM_CLASSES = ("LayerNorm", "RMSNorm")  # class-name endings of transformers' own norms (DebertaLayerNorm, OLMo's)


@dataclass(frozen=True)
class NormAffine:
    """What a norm applies per dimension after normalising, read off its forward pass (norm_affine)."""

    gain: Tensor  # [hidden] the effective gain: Gemma's 1 + weight, 1 everywhere for OLMo's parameter-free LayerNorm
    bias: Tensor | None  # [hidden], or None when the module has no bias (an RMSNorm, Llama's or Gemma's)
    centres: bool  # subtracts the mean (a LayerNorm), not only divides by the RMS (an RMSNorm)


def _probe(width: int) -> Tensor:
    """+1, -1, +1, ... of mean 0 (an odd width ends in 0): a normalised vector for a LayerNorm and an RMSNorm alike."""
    import torch

    signs = torch.ones(width)
    signs[1::2] = -1.0
    if width % 2:
        signs[-1] = 0.0
    return signs


def norm_affine(module: nn.Module, hidden: int) -> NormAffine | None:
    """The per-dimension gain and bias `module` applies, when it is a norm over `hidden`: a leaf nn.LayerNorm /
    nn.RMSNorm or a transformers `*LayerNorm` / `*RMSNorm` whose output does not change when its input is scaled.
    Read from the module's own forward (float32, on the CPU), not its parameters: Gemma's RMSNorm multiplies by
    1 + weight, OLMo's LayerNorm has no parameters. None for anything else (MobileBERT's NoNorm, a norm over another
    width such as ALBERT's embedding size or Qwen3's per-head query norm)."""
    import copy

    import torch

    name = type(module).__name__
    if next(module.children(), None) is not None or not (
            isinstance(module, (nn.LayerNorm, getattr(nn, "RMSNorm", nn.LayerNorm))) or name.endswith(NORM_CLASSES)):
        return None
    weight = getattr(module, "weight", None)
    if isinstance(weight, Tensor) and tuple(weight.shape) != (hidden,):
        return None
    # a copy without the module's hooks: a capture's or an intervention's hook must not see the probe, and a hook
    # bound to an object (a lock, a trainer) must not be deep-copied
    memo = {id(value): type(value)() for name, value in vars(module).items()
            if "hooks" in name and isinstance(value, dict)}
    probe = copy.deepcopy(module, memo).to("cpu", torch.float32)
    signs = _probe(hidden)
    scale = 1e3  # |x| >> eps: the output is the gain to float32 precision, whatever eps the norm adds

    def out(x: Tensor) -> Tensor | None:
        try:
            with torch.no_grad():
                y = probe(x[None])
        except (RuntimeError, TypeError, ValueError):
            return None
        return y[0].float() if isinstance(y, Tensor) and tuple(y.shape) == (1, hidden) else None

    up, down, twice, shifted = (out(scale * signs), out(-scale * signs), out(2 * scale * signs),
                                out(scale * (signs + 1)))
    if up is None or down is None or twice is None or shifted is None:
        return None
    tolerance = 1e-4 * (float(up.abs().max()) + 1e-6)
    if not torch.allclose(twice, up, atol=tolerance, rtol=0):  # not scale-invariant: not a norm
        return None
    gain = (up - down) / 2 * signs.pow(2).mean().sqrt()
    if hidden % 2:  # the last dimension is 0 in the probe: read it from the probe shifted by one
        other = torch.roll(signs, 1)
        gain[-1] = float((out(scale * other)[-1] - out(-scale * other)[-1]) / 2 * other.pow(2).mean().sqrt() / other[-1])
    gain = gain * torch.where(signs == 0, torch.ones_like(signs), signs)  # divide by the probe's signs
    bias = (up + down) / 2 if isinstance(getattr(module, "bias", None), Tensor) else None
    return NormAffine(gain, bias, centres=torch.allclose(shifted, up, atol=tolerance, rtol=0))


def is_norm(module: nn.Module, hidden: int) -> bool:
    """A LayerNorm or an RMSNorm over the hidden size (norm_affine: torch's, or any transformers norm that behaves
    as one)."""
    return norm_affine(module, hidden) is not None


_FEEDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> ids of its feeding norms


def feeding_norms(model: nn.Module, blocks: nn.ModuleList, hidden: int) -> set[int] | None:
    """The ids of the norms inside `blocks` whose output a weight-bearing module of the same block reads as its input
    (a pre-LN norm: Llama's input_layernorm feeds q_proj), found in one forward pass of four tokens with hooks, and
    kept per model. The other norms of a block normalise a sub-layer's output before the residual stream adds it
    (Gemma 2/3's and OLMo-2's post_*_layernorm), or the block's output (a post-LN layer). None when the pass fails.
    The pass runs the model with every hook it holds: call it outside captures and interventions (core.families'
    norm_placement does, before any is registered), once per model."""
    import torch

    if model in _FEEDING:
        return _FEEDING[model]
    norms = {id(module) for block in blocks for module in block.modules() if is_norm(module, hidden)}
    outputs: dict[int, tuple[int, Tensor]] = {}  # data_ptr -> (norm id, its output, kept alive: no address reuse)
    fed: set[int] | None = set()

    def keep(module, args, output) -> None:
        if isinstance(output, Tensor):
            outputs[output.data_ptr()] = (id(module), output)

    def read(module, args, kwargs) -> None:
        value = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(value, Tensor) and value.data_ptr() in outputs and fed is not None:
            fed.add(outputs[value.data_ptr()][0])
    handles = []
    for block in blocks:
        for module in block.modules():
            if id(module) in norms:
                handles.append(module.register_forward_hook(keep))
            elif next(module.children(), None) is None and isinstance(getattr(module, "weight", None), Tensor) \
                    and module.weight.ndim >= 2:
                handles.append(module.register_forward_pre_hook(read, with_kwargs=True))
    parameter = next(model.parameters())
    vocab = int(getattr(model.config, "vocab_size", 4) or 4)
    training = {module: module.training for module in model.modules()}  # restored module by module
    try:
        model.eval()
        with torch.no_grad():
            model(input_ids=(torch.arange(4, device=parameter.device) % vocab + min(3, vocab - 1)).clamp(
                max=vocab - 1)[None])
    except Exception:  # noqa: BLE001  (a model that cannot run four tokens: unknown, said by None)
        fed = None
    finally:
        for module, mode in training.items():
            module.training = mode
        for handle in handles:
            handle.remove()
    _FEEDING[model] = fed
    return fed
