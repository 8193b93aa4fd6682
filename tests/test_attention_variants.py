"""Clipped softmax and gated attention (Bondarenko et al. 2023; lightning_modules/attention.py) against attention
computed by hand from the layer's own input and weights, the export and checkpoint loaders, and the live attention
geometry on tiny runs of each variant.

    .venv/bin/pytest tests/test_attention_variants.py -q
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForMaskedLM

import train
from core.errors import UserError
from core.models import attention_projections
from core.tokenizers import tokenizer_files
from lightning_modules.attention import attention_settings, self_attentions
from lightning_modules.encoder import load_encoder, random_encoder
from lightning_modules.finetune import load_classifier
from lightning_modules.mlm import MLMModule, build_model, check_architecture, compile_step, export, mlm_step
from tests import test_callbacks as live

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
VOCAB, HIDDEN, LAYERS, HEADS, POSITIONS = 100, 32, 2, 4, 66


def tiny(attention: str = "softmax", position_embeddings: bool = True, **settings):
    return build_model(VOCAB, HIDDEN, LAYERS, HEADS, 64, POSITIONS, 0.0, position_embeddings,
                       attention=attention_settings(attention, **settings)).eval()


def twins(attention: str, position_embeddings: bool = True, **settings):
    """(softmax model, `attention` model) with the same weights (the variant's own ones as it initialised them)."""
    torch.manual_seed(0)
    plain = tiny("softmax", position_embeddings)
    variant = tiny(attention, position_embeddings, **settings)
    missing, unexpected = variant.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and all(".gate_" in key for key in missing)
    return plain, variant


def padded_batch(length: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(5, VOCAB, (3, length))
    mask = torch.ones_like(ids)
    mask[1, length - 9:] = 0  # padding: its keys must get no attention
    mask[2, length // 2:] = 0
    ids[mask == 0] = 1
    return ids, mask


def sharpen(model, factor: float = 6.0) -> None:
    """Larger queries: peaked attention, so that the clipped softmax clips some weights to exactly zero."""
    with torch.no_grad():
        for _, _, inner in self_attentions(model):
            inner.query.weight.mul_(factor)


def attention_io(model, ids, mask) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input x [batch, seq, hidden], output [batch, seq, hidden]) of each layer's self-attention module."""
    seen, handles = [], []
    for _, _, inner in self_attentions(model):
        handles.append(inner.register_forward_hook(
            lambda module, args, output: seen.append((args[0].detach(), output[0].detach()))))
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def by_hand(inner, x: torch.Tensor, mask: torch.Tensor, weights_of) -> tuple[torch.Tensor, int]:
    """Self-attention output [batch, seq, hidden] computed per sequence and head with plain matrix products, the
    padded keys left out; `weights_of(probabilities [keys])` turns each query's softmax into its attention weights.
    Also the number of weights that are exactly zero among the real keys."""
    heads, width = inner.num_attention_heads, inner.attention_head_size
    q, k, v = (layer(x).double() for layer in (inner.query, inner.key, inner.value))
    out, zeros = torch.zeros_like(q), 0
    for b in range(x.shape[0]):
        n = int(mask[b].sum())
        for h in range(heads):
            cols = slice(h * width, (h + 1) * width)
            scores = q[b, :, cols] @ k[b, :n, cols].T / math.sqrt(width)  # [seq, real keys]
            weights = weights_of(torch.softmax(scores, dim=-1))
            zeros += int((weights == 0).sum())
            out[b, :, cols] = weights @ v[b, :n, cols]
    return out, zeros


def real(tensor: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return tensor[mask.bool()]


# ---- the variants against their definitions ----

@pytest.mark.parametrize("position_embeddings", [True, False])
def test_clipped_softmax_with_gamma_0_and_zeta_1_is_softmax(position_embeddings):
    plain, clipped = twins("clipped_softmax", position_embeddings, gamma=0.0, zeta=1.0)
    assert clipped.config._attn_implementation == "clipped_softmax" and plain.config._attn_implementation == "sdpa"
    ids, mask = padded_batch()
    with torch.no_grad():
        want, got = plain(input_ids=ids, attention_mask=mask).logits, clipped(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(real(got, mask), real(want, mask), rtol=1e-5, atol=1e-5)


def test_clipped_softmax_equals_its_formula_and_clips_weights_to_zero():
    """Their default gamma -0.025, zeta 1: clip((zeta - gamma) p + gamma, 0, 1), by hand from each layer's input."""
    torch.manual_seed(0)
    model = tiny("clipped_softmax")
    assert (model.config.clip_softmax_gamma, model.config.clip_softmax_zeta) == (-0.025, 1.0)
    sharpen(model)
    ids, mask = padded_batch()
    zeros = 0
    for (_, _, inner), (x, output) in zip(self_attentions(model), attention_io(model, ids, mask), strict=True):
        want, count = by_hand(inner, x, mask, lambda p: ((1.025 * p - 0.025).clamp(0, 1)))
        zeros += count
        torch.testing.assert_close(real(output.double(), mask), real(want, mask), rtol=1e-4, atol=1e-5)
        softmax, _ = by_hand(inner, x, mask, lambda p: p)
        assert (real(softmax, mask) - real(want, mask)).abs().max() > 1e-3  # not softmax attention
    assert zeros > 100  # exact zeros: what softmax cannot give


@pytest.mark.parametrize("position_embeddings", [True, False])
def test_gated_attention_with_the_gate_at_one_is_plain_attention(position_embeddings):
    plain, gated = twins("gated", position_embeddings)
    with torch.no_grad():
        for _, _, inner in self_attentions(gated):
            inner.gate_weight.zero_()
            inner.gate_bias.fill_(1e4)  # sigmoid = 1 exactly in float32
    ids, mask = padded_batch()
    with torch.no_grad():
        want, got = plain(input_ids=ids, attention_mask=mask).logits, gated(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(real(got, mask), real(want, mask), rtol=1e-5, atol=1e-5)


def test_gated_attention_multiplies_each_head_by_sigmoid_of_a_linear_map_of_its_slice_of_the_input():
    torch.manual_seed(0)
    model = tiny("gated")
    width = HIDDEN // HEADS
    for _, _, inner in self_attentions(model):  # their init: bias logit(pi_init), weights within 1/sqrt(head_dim)
        torch.testing.assert_close(torch.sigmoid(inner.gate_bias), torch.full((HEADS,), 0.25))
        assert tuple(inner.gate_weight.shape) == (HEADS, width)
        assert inner.gate_weight.abs().max() <= 1 / math.sqrt(width) and inner.gate_weight.std() > 0.05
    with torch.no_grad():
        for _, _, inner in self_attentions(model):
            inner.gate_weight.normal_(0, 1.0)  # gates that differ by token and head
    ids, mask = padded_batch()
    for (_, _, inner), (x, output) in zip(self_attentions(model), attention_io(model, ids, mask), strict=True):
        plain, _ = by_hand(inner, x, mask, lambda p: p)
        gates = torch.stack([torch.sigmoid(x[..., h * width:(h + 1) * width].double() @ inner.gate_weight[h].double()
                                           + inner.gate_bias[h].double()) for h in range(HEADS)], -1)  # [b, s, H]
        assert gates.std() > 0.1
        want = (plain.unflatten(-1, (HEADS, width)) * gates[..., None]).flatten(-2)
        torch.testing.assert_close(real(output.double(), mask), real(want, mask), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["clipped_softmax", "gated"])
def test_the_compiled_step_equals_the_eager_one(attention):
    torch.manual_seed(0)
    model = tiny(attention).train()
    sharpen(model)
    torch.manual_seed(2)
    batch = {"input_ids": torch.randint(5, VOCAB, (4, 24)), "positions": torch.randint(0, 24, (4, 3)),
             "targets": torch.randint(5, VOCAB, (4, 3))}
    eager = mlm_step(model, batch, hidden_states=True)
    compiled = compile_step(model)(model, batch, True)
    torch.testing.assert_close(compiled.loss, eager.loss, rtol=1e-4, atol=1e-5)
    for got, want in zip(compiled.hidden, eager.hidden, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# ---- settings and refusals ----

def test_settings_fill_their_defaults_and_refuse_what_is_not_theirs():
    assert attention_settings() == {"attention": "softmax"}
    assert attention_settings("clipped_softmax") == {"attention": "clipped_softmax", "gamma": -0.025, "zeta": 1.0}
    assert attention_settings("gated") == {"attention": "gated", "gate_init": 0.25}
    for args, message in (
            (("sparsemax",), "--model.attention must be one of softmax, clipped_softmax, gated, got 'sparsemax'"),
            (("clipped_softmax", 0.1), "--model.clip_softmax_gamma must be at most 0"),
            (("clipped_softmax", None, 0.5), "--model.clip_softmax_zeta must be at least 1"),
            (("softmax", -0.1), "--model.clip_softmax_gamma is a parameter of --model.attention clipped_softmax, "
                                "not of softmax"),
            (("gated", None, None, 1.0), "--model.attention_gate_init is the initial gate probability"),
            (("softmax", None, None, 0.3), "--model.attention_gate_init is a parameter of --model.attention gated")):
        with pytest.raises(UserError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
            attention_settings(*args)


def test_resuming_with_another_variant_is_one_line():
    saved = {"attention": "clipped_softmax", "clip_softmax_gamma": None}
    current = {"attention": "clipped_softmax", "clip_softmax_gamma": -0.025, "clip_softmax_zeta": None,
               "attention_gate_init": None, "position_embeddings": True}
    check_architecture(saved, current, "the checkpoint")  # the default, given or not: the same
    check_architecture({}, {**current, "attention": "softmax", "clip_softmax_gamma": None}, "x")  # older: softmax
    with pytest.raises(UserError, match=r"^the checkpoint was trained with attention softmax but the config asks for "
                                        r"gated gate_init=0.25; resume with the matching --model.attention$"):
        check_architecture({}, {**current, "attention": "gated", "clip_softmax_gamma": None}, "the checkpoint")
    with pytest.raises(UserError, match="trained with attention clipped_softmax gamma=-0.025 zeta=1.0 but the config "
                                        "asks for clipped_softmax gamma=-0.05 zeta=1.0"):
        check_architecture(saved, {**current, "clip_softmax_gamma": -0.05}, "the checkpoint")


# ---- the export and the checkpoint rebuild the variant ----

def module_of(attention: str, roberta_tok, **settings) -> MLMModule:
    torch.manual_seed(0)
    keys = {"gamma": "clip_softmax_gamma", "zeta": "clip_softmax_zeta", "gate_init": "attention_gate_init"}
    module = MLMModule(vocab_size=len(roberta_tok), hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                       num_attention_heads=HEADS, intermediate_size=64, max_position_embeddings=POSITIONS, dropout=0.0,
                       attention=attention, **{keys[key]: value for key, value in settings.items()})
    sharpen(module.model)
    if attention == "gated":
        with torch.no_grad():
            for _, _, inner in self_attentions(module.model):
                inner.gate_weight.normal_(0, 1.0)
                inner.gate_bias.uniform_(-2, 2)
    return module.eval()


@pytest.mark.parametrize("attention", ["softmax", "clipped_softmax", "gated"])
def test_the_export_and_the_checkpoint_rebuild_the_variant_and_its_outputs(attention, roberta_tok, tmp_path):
    module = module_of(attention, roberta_tok)
    export(module, roberta_tok, tmp_path / "export")
    ckpt = tmp_path / "last.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams), "global_step": 1,
                "MLMDataModule": {"tokenizer_files": tokenizer_files(roberta_tok)}}, ckpt)
    config = (tmp_path / "export" / "config.json").read_text()
    assert ('"attention_variant"' in config) == (attention != "softmax")
    ids, mask = padded_batch()
    with torch.no_grad():
        want = module.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    variants = {"clipped_softmax": "clipped_softmax", "gated": "GatedRobertaSelfAttention"}
    for source in (tmp_path / "export", ckpt):
        encoder = load_encoder(source, device="cpu")
        inner = self_attentions(encoder.model)[0][2]
        assert {"clipped_softmax": encoder.model.config._attn_implementation,
                "gated": type(inner).__name__}.get(attention) == variants.get(attention)
        with torch.no_grad():
            got = encoder.model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        for layer, (g, w) in enumerate(zip(got, want.hidden_states, strict=True)):
            torch.testing.assert_close(real(g, mask), real(w, mask), rtol=1e-5, atol=1e-5, msg=f"{source} {layer}")
        twin = random_encoder(encoder, seed=0)  # the probes' control: the same architecture, the variant included
        assert twin.model.config.to_dict().get("attention_variant") == encoder.model.config.to_dict().get(
            "attention_variant") and type(self_attentions(twin.model)[0][2]) is type(inner)
        classifier, _ = load_classifier(str(source), ["a", "b"])  # fine-tuning from the run
        with torch.no_grad():
            states = classifier.eval().base_model(input_ids=ids, attention_mask=mask).last_hidden_state
        torch.testing.assert_close(real(states, mask), real(want.hidden_states[-1], mask), rtol=1e-5, atol=1e-5)
    # plain transformers: the softmax export is the same model; a variant's is not (docs/pretraining.md)
    plain = AutoModelForMaskedLM.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        logits = plain(input_ids=ids, attention_mask=mask).logits
    gap = (real(logits, mask) - real(want.logits, mask)).abs().max()
    assert (gap < 1e-4) == (attention == "softmax"), gap


def test_the_export_draws_no_progress_bar(roberta_tok, tmp_path, capfd):
    module = module_of("softmax", roberta_tok)
    module.model.save_pretrained(tmp_path / "plain")
    assert "Writing model shards" in capfd.readouterr().err  # what transformers draws on its own, for one shard
    export(module, roberta_tok, tmp_path / "export")
    assert "Writing model shards" not in capfd.readouterr().err
    assert (tmp_path / "export" / "model.safetensors").read_bytes() == (tmp_path / "plain" / "model.safetensors").read_bytes()


def test_a_gated_export_without_its_gate_weights_is_one_line(roberta_tok, tmp_path):
    from safetensors.torch import load_file, save_file

    export(module_of("gated", roberta_tok), roberta_tok, tmp_path / "export")
    path = tmp_path / "export" / "model.safetensors"
    weights = load_file(path)
    save_file({key: value for key, value in weights.items() if ".gate_" not in key}, path, metadata={"format": "pt"})
    with pytest.raises(UserError) as caught:
        load_encoder(tmp_path / "export", device="cpu")
    assert str(caught.value).startswith(f"{tmp_path / 'export'}: its config records gated attention but "
                                        "model.safetensors lacks gate weights ['encoder.layer.0.attention.self.gate_")
    path.unlink()  # its weights as pytorch_model.bin only: transformers loads them, the gates have no file to come from
    torch.save(weights, tmp_path / "export" / "pytorch_model.bin")
    with pytest.raises(UserError) as caught:
        load_encoder(tmp_path / "export", device="cpu")
    assert str(caught.value) == (f"{tmp_path / 'export'}: its config records gated attention but it has no "
                                 "model.safetensors (nor shards listed in a model.safetensors.index.json): a gated "
                                 "export's gates are read from those")


@pytest.mark.parametrize("pinned", [False, True])
def test_a_gated_export_loads_by_hub_id_at_its_revision_with_its_gates(pinned, roberta_tok, tmp_path, monkeypatch):
    """A gated export pushed to the hub and read back by its id (offline, from a hand-built hub cache holding it at
    refs/main, and another gated export at tag v1): the gates come from the snapshot the id resolves to, so the
    hidden states equal those of the export's own directory."""
    from tests.hub_cache import cache_model, hub_caches

    exports = []
    for seed in (1, 2):
        module = module_of("gated", roberta_tok)
        torch.manual_seed(seed)
        for name, parameter in module.model.named_parameters():
            if ".gate_" in name:  # gates far from their initial value, different in the two exports
                torch.nn.init.normal_(parameter, std=2.0)
        export(module, roberta_tok, tmp_path / f"export{seed}")
        exports.append(tmp_path / f"export{seed}")
    cache_model(tmp_path / "hub", "someorg/gated", exports[0], ref="v1")
    cache_model(tmp_path / "hub", "someorg/gated", exports[1], ref="main")
    monkeypatch.chdir(tmp_path / "hub")  # no local folder shadows the id
    ids, mask = padded_batch()
    with hub_caches(monkeypatch, tmp_path):
        by_id = load_encoder("someorg/gated@v1" if pinned else "someorg/gated", device="cpu")
    local = load_encoder(exports[0] if pinned else exports[1], device="cpu")
    other = load_encoder(exports[1] if pinned else exports[0], device="cpu")
    with torch.no_grad():
        got, want, wrong = (encoder.model(input_ids=ids, attention_mask=mask).last_hidden_state
                            for encoder in (by_id, local, other))
    gates = {name: p for name, p in by_id.model.named_parameters() if ".gate_" in name}
    assert gates and all(torch.equal(p, dict(local.model.named_parameters())[name]) for name, p in gates.items())
    torch.testing.assert_close(real(got, mask), real(want, mask), rtol=1e-6, atol=1e-6)
    assert (real(got, mask) - real(wrong, mask)).abs().max() > 1e-3  # the other revision is another model


# ---- tiny runs: the live attention geometry of each variant, and the run's export ----

def variant_attention(pl_module, batch) -> dict:
    """tests/test_callbacks.py's direct_attention for a variant: a copy of the model, the variant kept (transformers'
    eager attention would replace the clipped softmax), on the batch; each layer's query and key projection outputs
    [batch, seq, heads, head_dim] (forward hooks) and softmax(q k^T / sqrt(head_dim)) [batch, heads, seq, seq] from
    them by hand (the blocks are full: no padding), float64."""
    model = copy.deepcopy(pl_module.model).eval()
    outputs, handles = {}, []
    for layer, (query, key, heads) in enumerate(attention_projections(model), 1):
        for kind, module in (("query", query), ("key", key)):
            def keep(module, args, output, name=(layer, kind), heads=heads):
                outputs[name] = output.detach().double().unflatten(-1, (heads, -1))
            handles.append(module.register_forward_hook(keep))
    with torch.no_grad():
        model.roberta(input_ids=batch["input_ids"])
    for handle in handles:
        handle.remove()
    probabilities = []
    for layer in range(1, len(attention_projections(model)) + 1):
        q, k = outputs[layer, "query"].transpose(1, 2), outputs[layer, "key"].transpose(1, 2)  # [batch, heads, seq, d]
        probabilities.append(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1))
    return {"outputs": outputs, "probabilities": probabilities}


@pytest.fixture(scope="module", params=[("clipped_softmax", "true"), ("gated", "false")],
                ids=["clipped_softmax-PE", "gated-noPE"])
def variant_run(request, tmp_path_factory, corpus, cache):
    attention, position_embeddings = request.param
    root = tmp_path_factory.mktemp(attention)
    live.Recorder.made.clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(live, "direct_attention", variant_attention)
        assert train.cli_main(live.tiny_args(root, corpus, cache, *live.callbacks(), "--model.attention", attention,
                                             "--model.position_embeddings", position_embeddings)) == 0
    (recorder,) = live.Recorder.made
    return attention, live.wandb_run(root), recorder, root


@pytest.mark.slow
def test_attention_geometry_of_each_variant_equals_the_eager_projections_and_softmax(variant_run):
    """The queries, keys and entropy of the softmax the variant starts from, against an eager copy of the model
    (tests/test_callbacks.py's direct computation) on the same batches."""
    _, run, recorder, _ = variant_run
    assert sorted(recorder.attention) == [0, 2, 4]
    for step, record in recorder.attention.items():
        live.check_attention(live.logged(run, "attention", step), "attention", live.expected_attention([record], step))
    live.check_attention(live.logged(run, "val_attention", live.VAL_STEP), "val_attention",
                         live.expected_attention(recorder.val_attention, None))


@pytest.mark.slow
def test_a_variant_run_records_its_attention_and_its_export_reproduces_its_last_checkpoint(variant_run, tmp_path):
    attention, _, _, root = variant_run
    checkpoint = torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["hyper_parameters"]["attention"] == attention
    assert any(".gate_" in key for key in checkpoint["state_dict"]) == (attention == "gated")
    ids, mask = padded_batch(20)
    # the trained model rebuilt directly: the module from the checkpoint's hyper-parameters, its weights loaded strictly
    module = MLMModule(**{key: value for key, value in checkpoint["hyper_parameters"].items()
                          if not key.startswith("_")}).eval()  # (jsonargparse's _instantiator is no argument)
    module.load_state_dict(checkpoint["state_dict"], strict=True)
    with torch.no_grad():
        want = torch.stack(module.model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states)
        plain = AutoModelForMaskedLM.from_pretrained(root / "export").eval()  # softmax attention on the same weights
        softmax = plain(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    assert (real(softmax, mask) - real(want[-1], mask)).abs().max() > 1e-3  # the variant changes the states
    for source in (root / "export", root / "checkpoints" / "last.ckpt"):
        encoder = load_encoder(source, device="cpu")
        with torch.no_grad():
            got = torch.stack(encoder.model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states)
        assert got.shape == want.shape == (LAYERS + 1, *ids.shape, HIDDEN)
        torch.testing.assert_close(real(got.permute(1, 2, 0, 3), mask), real(want.permute(1, 2, 0, 3), mask),
                                   rtol=1e-5, atol=1e-5, msg=str(source))  # [tokens, layers, hidden], padding out


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["clipped_softmax", "gated"])
def test_two_process_ddp_trains_each_variant_as_one_process_does(attention, corpus, cache, tmp_path):
    """1 process × batch 8 against 2 DDP processes (gloo) × 4: the same losses and weights, the gates included."""
    from tests.test_train import checkpoint, fit, train_losses
    from tests.test_train import tiny_args as train_args

    extra = ("--model.dropout", "0.0", "--trainer.max_steps", "4", "--model.attention", attention)
    one, ddp = tmp_path / "one", tmp_path / "ddp"
    assert fit(one, corpus, cache, *extra) == 0
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(ROOT / "train.py"),
                             *train_args(ddp, corpus, cache, *extra, "--data.batch_size", "4", "--trainer.devices", "2",
                                         "--trainer.strategy", "ddp")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    reference, losses = train_losses(one), train_losses(ddp)
    assert len(reference) == 4 and losses.keys() == reference.keys()
    assert all(math.isclose(losses[s], reference[s], rel_tol=1e-5) for s in reference)
    weights = checkpoint(ddp)["state_dict"]
    trained = checkpoint(one)["state_dict"]
    assert any(".gate_" in name for name in trained) == (attention == "gated")
    for name, value in trained.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_a_gated_export_in_shards_loads_its_gates_from_every_shard(roberta_tok, tmp_path):
    """A gated export saved as shards (model.safetensors.index.json and its files, as a large export pushed to the hub
    is): the gates are read from the shards that hold them, the hidden states those of the single-file export."""
    import shutil

    module = module_of("gated", roberta_tok)
    for name, parameter in module.model.named_parameters():
        if ".gate_" in name:
            torch.nn.init.normal_(parameter, std=2.0)
    export(module, roberta_tok, tmp_path / "export")
    sharded = tmp_path / "sharded"
    shutil.copytree(tmp_path / "export", sharded)
    (sharded / "model.safetensors").unlink()
    module.model.save_pretrained(sharded, max_shard_size="20KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    holding = {file for key, file in index["weight_map"].items() if ".gate_" in key}
    assert len(holding) > 1 and not (sharded / "model.safetensors").exists()  # the gates spread over several shards
    ids, mask = padded_batch()
    with torch.no_grad():
        got, want = (load_encoder(source, device="cpu").model(input_ids=ids, attention_mask=mask).last_hidden_state
                     for source in (sharded, tmp_path / "export"))
    torch.testing.assert_close(real(got, mask), real(want, mask), rtol=1e-6, atol=1e-6)
