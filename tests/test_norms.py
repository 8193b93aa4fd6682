"""Norms read off their forward pass (core.norms.norm_affine): every transformers norm class a model may use
(DeBERTa's and OLMo's own LayerNorms, Gemma's 1 + weight RMSNorm), its gain and bias against each class's formula
written out by hand, and the origins report and layernorm_zero on models that use them.

    .venv/bin/pytest tests/test_norms.py -q
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.deberta.modeling_deberta import DebertaLayerNorm
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mobilebert.modeling_mobilebert import NoNorm
from transformers.models.olmo.modeling_olmo import OlmoLayerNorm

from core.models import layer_norms
from core.norms import norm_affine
from lightning_modules.interventions import Intervention, intervene, norm_sites
from metrics.origins import trace_origins

pytestmark = pytest.mark.usefixtures("one_thread")


def randomised(module: nn.Module) -> nn.Module:
    """`module` with random weight and bias (where it has them), seeded."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return module


# (module, its gain and its bias (None: it has none) by each class's own formula, centres)
NORMS = {
    "torch LayerNorm": lambda: (m := randomised(nn.LayerNorm(8)), m.weight, m.bias, True),
    "torch LayerNorm, odd width": lambda: (m := randomised(nn.LayerNorm(7)), m.weight, m.bias, True),
    "torch RMSNorm": lambda: (m := randomised(nn.RMSNorm(8)), m.weight, None, False),
    "Llama RMSNorm": lambda: (m := randomised(LlamaRMSNorm(8)), m.weight, None, False),
    "Gemma RMSNorm: 1 + weight": lambda: (m := randomised(GemmaRMSNorm(8)), 1 + m.weight, None, False),
    "DeBERTa LayerNorm": lambda: (m := randomised(DebertaLayerNorm(8)), m.weight, m.bias, True),
    "OLMo LayerNorm: no parameters": lambda: (OlmoLayerNorm(8), torch.ones(8), None, True),
}


@pytest.mark.parametrize("kind", NORMS)
def test_norm_affine_is_each_norms_own_formula(kind):
    module, gain, bias, centres = NORMS[kind]()
    width = gain.shape[0]
    affine = norm_affine(module, width)
    assert affine is not None and affine.centres is centres
    torch.testing.assert_close(affine.gain, gain.detach().float(), rtol=1e-5, atol=1e-6)
    if bias is None:
        assert affine.bias is None
    else:
        torch.testing.assert_close(affine.bias, bias.detach().float(), rtol=1e-5, atol=1e-6)
    # and the module's output on random inputs is gain * normalised + bias, written out once more
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(1)) * 3 + 1
    centred = x - x.mean(-1, keepdim=True) if centres else x
    expected = centred / centred.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * gain.detach()
    with torch.no_grad():
        torch.testing.assert_close(module(x), expected + (0 if bias is None else bias.detach()), rtol=1e-4,
                                   atol=1e-4)


@pytest.mark.parametrize("module, width", [
    (NoNorm(8), 8),  # MobileBERT's elementwise x * w + b: not scale-invariant, not a norm
    (nn.LayerNorm(8), 16),  # a norm over another width (ALBERT's embedding size)
    (nn.Linear(8, 8), 8),
    (nn.Sequential(nn.LayerNorm(8)), 8),  # a container: its leaf is the norm
], ids=["NoNorm", "other width", "Linear", "container"])
def test_what_is_not_a_norm_over_the_hidden_size(module, width):
    assert norm_affine(module, width) is None


def tiny(kind: str):
    """A tiny random model of `kind` (8 wide), its 1-d parameters randomised so each norm's gain differs."""
    import transformers as tf

    common = dict(vocab_size=50, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16,
                  max_position_embeddings=32)
    config = {"gemma": lambda: tf.GemmaConfig(**common, num_key_value_heads=1, head_dim=4),
              "deberta": lambda: tf.DebertaConfig(**common, relative_attention=True, position_biased_input=False),
              "olmo": lambda: tf.OlmoConfig(**common)}[kind]()
    torch.manual_seed(0)
    model = tf.AutoModel.from_config(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.normal_()
    return model


@pytest.mark.parametrize("kind, count, gain", [
    ("gemma", 2 * 2 + 1, lambda module: 1 + module.weight),  # input and post-attention norms per layer, the final
    ("deberta", 1 + 2 * 2, lambda module: module.weight),  # the embeddings' and two per layer
    ("olmo", 2 * 2 + 1, lambda module: torch.ones(8)),
])
def test_origins_trace_the_gain_each_norm_applies(kind, count, gain):
    model, dim = tiny(kind), 3
    norms = layer_norms(model)
    assert len(norms) == count
    entries = trace_origins(model, [dim])["layer_norms"][str(dim)]
    assert [entry["module"] for entry in entries] == [name for name, _, _ in norms]
    for entry, (_, _, module) in zip(entries, norms):
        expected = gain(module).detach()
        assert entry["weight"] == pytest.approx(float(expected[dim]), abs=1e-5)
        assert entry["weight_rank"] == 1 + int((expected.abs() > expected[dim].abs()).sum())


@pytest.mark.parametrize("kind", ["gemma", "deberta", "olmo"])
def test_layernorm_zero_zeroes_what_every_norm_writes(kind):
    """Every norm's output at the dims is 0 under layernorm_zero, so is the last hidden state's (Gemma's and OLMo's
    final norm writes it, DeBERTa's last layer's LayerNorm), and each norm says what was zeroed."""
    model, dims = tiny(kind), (2, 5)
    outputs: dict[str, torch.Tensor] = {}
    handles = [module.register_forward_hook(lambda m, a, out, name=name: outputs.__setitem__(name, out))
               for name, _, module in layer_norms(model)]
    ids = torch.tensor([[3, 7, 11, 4, 9]])
    with torch.no_grad():
        before = model(ids).last_hidden_state
        with intervene(model, Intervention("layernorm_zero", dims=dims)):
            after = model(ids).last_hidden_state
    for handle in handles:
        handle.remove()
    assert len(outputs) == len(layer_norms(model)) and all(
        float(out[..., list(dims)].abs().max()) == 0.0 for out in outputs.values())
    assert float(before[..., list(dims)].abs().min()) > 0 and float(after[..., list(dims)].abs().max()) == 0.0
    zeroed = {site["zeroed"].split(" ")[0] for site in norm_sites(model)}
    assert zeroed == {"gemma": {"gain"}, "deberta": {"gain"}, "olmo": {"output"}}[kind]


def test_reading_a_norm_runs_none_of_its_hooks_and_leaves_the_models_modes():
    """A capture's hook on a norm keeps its first output only (core.capture): norm_affine's probe must not reach it,
    and a hook bound to an object that cannot be copied (a lock) must not stop the reading; feeding_norms' pass
    leaves each module's train/eval mode as it found it (a module kept in eval inside a training model)."""
    import threading

    import transformers as tf

    from core.norms import _FEEDING, feeding_norms

    module = randomised(nn.LayerNorm(8))
    seen = []

    class Holder:
        lock = threading.Lock()

        def hook(self, *args):
            seen.append(args)
    module.register_forward_hook(lambda *args: seen.append(args))
    module.register_forward_pre_hook(Holder().hook)
    affine = norm_affine(module, 8)
    assert seen == [] and affine is not None
    torch.testing.assert_close(affine.gain, module.weight.detach(), rtol=1e-5, atol=1e-6)
    model = tf.AutoModel.from_config(tf.LlamaConfig(vocab_size=20, hidden_size=8, num_hidden_layers=2,
                                                    num_attention_heads=2, num_key_value_heads=1,
                                                    intermediate_size=16)).train()
    model.layers[0].eval()
    modes = {name: sub.training for name, sub in model.named_modules()}
    _FEEDING.pop(model, None)
    fed = {id(layer.input_layernorm) for layer in model.layers} | {id(layer.post_attention_layernorm)
                                                                 for layer in model.layers}
    assert feeding_norms(model, model.layers, 8) == fed  # Llama's: each feeds attention's or the MLP's projections
    assert {name: sub.training for name, sub in model.named_modules()} == modes



@pytest.mark.parametrize("kind, gain, applied", [
    ("gemma", lambda module: 1 + module.weight, True),
    ("deberta", lambda module: module.weight, False),
    ("olmo", lambda module: torch.ones(8), False),
])
def test_the_note_says_the_gain_is_not_the_stored_weight_only_where_it_is_not(kind, gain, applied):
    """Gemma's RMSNorm applies 1 + weight, and layer_norms_note says so; DeBERTa's LayerNorm applies its weight (its
    gain read off the forward pass to float32 rounding, ~1e-7), and the note does not claim otherwise where weights are
    near 0 (a relative tolerance alone read 1e-4 against 1e-4 + 1e-7 as another gain); OLMo's has no weight."""
    model = tiny(kind)
    with torch.no_grad():
        for _, _, module in layer_norms(model):
            if getattr(module, "weight", None) is not None:
                module.weight[::2] = 1e-4
    report = trace_origins(model, [2])
    assert [entry["weight"] for entry in report["layer_norms"]["2"]] == pytest.approx(
        [float(gain(module)[2]) for _, _, module in layer_norms(model)], abs=1e-6)
    assert ("not its stored weight" in report["layer_norms_note"]) is applied
