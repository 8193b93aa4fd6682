"""The pretraining arms (lightning_modules/arms.py): causal and rotary RoBERTa-size stacks beside the paper's MLM, each
checked against a computation made another way (RoPE by hand, transformers' own losses and classes, planted inputs).

    .venv/bin/pytest tests/test_arms.py -q
"""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import train
from core.families import rotary_queries_keys
from core.models import model_family
from datamodules.masking import NextTokenCollator
from lightning_modules.arms import CLASSES
from lightning_modules.encoder import load_encoder
from lightning_modules.mlm import MLMModule, export, mlm_loss
from tests.test_callbacks import (
    LAYERS,
    STEPS,
    Recorder,
    callbacks,
    check_attention,
    check_outliers,
    check_probe,
    direct_magnitudes,
    direct_outliers,
    direct_probe,
    direct_sinks,
    expected_attention,
    logged,
    tiny_args,
    wandb_run,
)

ROOT = Path(__file__).resolve().parent.parent
TINY = dict(vocab_size=600, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=34, dropout=0.0)
ARMS = [("mlm", "learned"), ("mlm", "none"), ("causal", "learned"), ("causal", "none"), ("mlm", "rope"),
        ("causal", "rope")]
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")]


def arm(objective: str, positions: str, seed: int = 0) -> MLMModule:
    torch.manual_seed(seed)
    return MLMModule(objective=objective, positions=positions, **TINY).eval()


def states(module: MLMModule, ids: torch.Tensor, **kwargs):
    with torch.no_grad():
        return module.model.base_model(input_ids=ids, output_hidden_states=True, **kwargs)


def hand_rope(x: torch.Tensor) -> torch.Tensor:
    """RoPE by hand (Su et al. 2021): x [batch, seq, heads, d]; the pair of dimensions (2i, 2i + 1) at position p, as
    the complex number x_2i + i x_2i+1, times exp(i p 10000^(-2i/d))."""
    d, seq = x.shape[-1], x.shape[1]
    angle = torch.arange(seq, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64)
                                                                          / d)  # [seq, d/2]
    z = torch.complex(x[..., 0::2].double(), x[..., 1::2].double()) * torch.polar(torch.ones_like(angle), angle)[
        None, :, None]
    return torch.stack([z.real, z.imag], dim=-1).flatten(-2)


@pytest.mark.parametrize("objective", ["mlm", "causal"])
def test_rotary_arm_attention_equals_a_hand_computation_of_rope(objective):
    module = arm(objective, "rope")
    assert type(module.model).__name__ == CLASSES[objective, "rope"] and module.max_length == 34  # from position 0
    ids = torch.randint(5, 600, (2, 12))
    out = states(module, ids, output_attentions=True)
    inner = module.model.base_model.encoder.layer[0].attention.self
    heads, size = 4, 8
    hidden = out.hidden_states[0]
    q = inner.query(hidden).unflatten(-1, (heads, size)).detach()
    k = inner.key(hidden).unflatten(-1, (heads, size)).detach()
    rq, rk = hand_rope(q), hand_rope(k)
    scores = torch.einsum("bqhd,bkhd->bhqk", rq, rk) / math.sqrt(size)
    if objective == "causal":
        scores = scores.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(out.attentions[0].double(), scores.softmax(-1), rtol=1e-4, atol=1e-6)
    # the rotation the live AttentionGeometry applies is the same (core.families.rotary_queries_keys)
    mq, mk = rotary_queries_keys(module.model)(q, k)
    torch.testing.assert_close(mq.double(), rq, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mk.double(), rk, rtol=1e-5, atol=1e-6)
    # RoPE's point: the same query and key content scores by relative position only (a Toeplitz matrix)
    same = hand_rope(q[:, :1].expand(-1, 12, -1, -1))
    toeplitz = torch.einsum("bqhd,bkhd->bhqk", same, hand_rope(k[:, :1].expand(-1, 12, -1, -1)))
    torch.testing.assert_close(toeplitz[..., 1:, 1:], toeplitz[..., :-1, :-1])


@pytest.mark.parametrize("objective, positions", ARMS)
def test_a_causal_arms_token_states_do_not_change_when_later_tokens_change(objective, positions):
    module = arm(objective, positions)
    ids = torch.randint(5, 600, (2, 16))
    changed = ids.clone()
    changed[:, 10:] = torch.randint(5, 600, (2, 6))
    before, after = states(module, ids).hidden_states, states(module, changed).hidden_states
    same = [torch.allclose(a[:, :10], b[:, :10], atol=1e-6) for a, b in zip(before[1:], after[1:])]
    assert all(same) if objective == "causal" else not any(same)  # a bidirectional token sees the later ones


def test_no_pe_causal_tells_positions_apart_where_no_pe_mlm_cannot():
    """Planted: one token A, then B eleven times. Without any position table, an MLM's B tokens all see the same set
    {A, B x 11}, so their states are equal, and permuting any input permutes its states; a causal model's B at position
    p sees {A, B x p}, so every B state differs (positions are recoverable) and permutation changes more than order."""
    ids = torch.tensor([[7] + [9] * 11])
    random_ids, order = torch.randint(5, 600, (2, 16)), torch.randperm(16)
    for objective in ("mlm", "causal"):
        module = arm(objective, "none")
        for layer in states(module, ids).hidden_states[1:]:
            b = layer[0, 1:]  # [11, hidden]
            spread = torch.cdist(b, b)[~torch.eye(11, dtype=torch.bool)]
            assert (spread.max() < 1e-5) if objective == "mlm" else (spread.min() > 1e-4)  # float32 noise ~1e-6
        plain, permuted = states(module, random_ids).hidden_states, states(module, random_ids[:, order]).hidden_states
        equivariant = [torch.allclose(p[:, order], q, atol=1e-5) for p, q in zip(plain[1:], permuted[1:])]
        assert all(equivariant) if objective == "mlm" else not any(equivariant)


@pytest.mark.parametrize("objective, positions", ARMS)
def test_export_reloads_each_arm_in_plain_transformers_with_equal_hidden_states(objective, positions, roberta_tok,
                                                                                tmp_path):
    module = arm(objective, positions)
    export(module, copy.deepcopy(roberta_tok), tmp_path / "export")
    reloaded = getattr(transformers, CLASSES[objective, positions]).from_pretrained(tmp_path / "export").eval()
    ids = torch.randint(5, 600, (2, 14))
    expected = states(module, ids).hidden_states
    with torch.no_grad():
        got = reloaded.base_model(input_ids=ids, output_hidden_states=True).hidden_states
        logits = reloaded(input_ids=ids).logits
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a)
    with torch.no_grad():
        torch.testing.assert_close(logits, module.model(input_ids=ids).logits)
    encoder = load_encoder(str(tmp_path / "export"), device="cpu")  # analyze.py's and probe.py's route
    family = model_family(encoder.model)
    assert family.causal is (objective == "causal") and family.positions == {
        "learned": "learned table", "none": "zero table (no positions)", "rope": "rotary (RoPE)"}[positions]
    inputs, _ = encoder.tokenize(["It is a truth universally acknowledged."])
    with torch.no_grad():
        direct = module.model.base_model(input_ids=inputs["input_ids"], output_hidden_states=True).hidden_states
    torch.testing.assert_close(encoder(**inputs).hidden_states, torch.stack(direct))


@pytest.mark.parametrize("objective, positions", [("causal", "learned"), ("causal", "rope"), ("mlm", "rope")])
def test_the_arms_loss_equals_transformers_own_loss_of_the_same_class(objective, positions):
    module = arm(objective, positions)
    blocks = torch.randint(5, 600, (3, 20))
    if objective == "causal":  # the data module's batch: the blocks unmasked, every next token a target but the
        batch = NextTokenCollator()({"blocks": blocks.numpy(), "keys": np.arange(3)})  # block's closing </s>
        assert torch.equal(batch["input_ids"], blocks) and torch.equal(batch["targets"], blocks[:, 1:-1])
        labels = blocks.clone()  # transformers' causal LMs shift the labels themselves
        labels[:, -1] = -100
    else:
        positions_ = torch.tensor([[2, 5, 11]] * 3)
        batch = {"input_ids": blocks.scatter(1, positions_, 4), "positions": positions_,
                 "targets": blocks.gather(1, positions_)}
        labels = torch.full_like(blocks, -100).scatter(1, positions_, batch["targets"])
    with torch.no_grad():
        ours, count = mlm_loss(module.model, batch)
        reference = module.model(input_ids=batch["input_ids"], labels=labels).loss
    assert int(count) == (3 * 18 if objective == "causal" else 9)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    if objective == "causal":  # --data.next_token_share 0.15: as many predictions as the MLM's, drawn per block key
        keys = np.array([4, 9, 4])
        batch = NextTokenCollator(0.15, seed=3)({"blocks": blocks.numpy(), "keys": keys})
        assert batch["positions"].shape == (3, round(0.15 * 18)) and torch.equal(batch["positions"][0],
                                                                                  batch["positions"][2])  # same key
        assert torch.equal(batch["targets"], blocks.gather(1, batch["positions"] + 1))
        labels = torch.full_like(blocks, -100).scatter(1, batch["positions"] + 1, batch["targets"])
        with torch.no_grad():
            torch.testing.assert_close(mlm_loss(module.model, batch)[0],
                                       module.model(input_ids=blocks, labels=labels).loss, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("objective, positions", [("causal", "none"), ("causal", "rope")])  # mlm-rope: causal-rope less its mask
def test_live_callbacks_and_the_online_probe_of_each_arm_equal_a_direct_computation(objective, positions, corpus,
                                                                                   cache, tmp_path):
    Recorder.made.clear()
    root = tmp_path / "run"
    assert train.cli_main(tiny_args(root, corpus, cache, *callbacks(), "--model.objective", objective,
                                    "--model.positions", positions, "--trainer.max_steps", "4",
                                    "--trainer.limit_val_batches", "0")) == 0
    run, (recorder,) = wandb_run(root), Recorder.made
    assert sorted(recorder.train) == [0, 2]
    for step, (hidden, weight) in recorder.train.items():
        if objective == "causal":  # unmasked blocks: the batch's input ids are the block itself
            assert hidden.shape[2] == 32
        check_outliers(logged(run, "outliers", step), "outliers", direct_outliers(hidden, False))
        check_probe(logged(run, "position_probe", step), "position_probe", direct_probe(hidden, weight))
        check_attention(logged(run, "attention", step), "attention",
                        expected_attention([recorder.attention[step]], step, causal=objective == "causal"))
        # the live attention sinks: from the attention the arm computes (causal, rotated), its eager copy's by hand
        probabilities = recorder.attention[step]["probabilities"][:LAYERS - 1]
        row = logged(run, "sinks", step)
        for layer, want in enumerate(direct_sinks(probabilities, recorder.ids[step], (0, 2)), 1):
            for name, value in want.items():
                assert row[f"sinks_by_layer/layer_{layer}/{name}"] == pytest.approx(value, abs=1e-5), (step, layer, name)
        row = logged(run, "outliers", step)  # massive activations and Bondarenko's statistics, live, by hand
        for layer, want in enumerate(direct_magnitudes(hidden)):
            key = f"outliers_by_layer/layer_{layer}"
            for name in ("kurtosis_sequence", "inf_norm_sequence"):
                assert row[f"{key}/{name}"] == pytest.approx(want[name], rel=1e-4), (step, key, name)
            assert row[f"{key}/massive_ratio"] == pytest.approx(want["massive_ratio"], rel=0.02)  # the histogram
            assert row[f"{key}/massive_dim"] == want["massive_dim"]
    # the run's checkpoint reads as its export does (analyze.py trajectory's route): the arm rebuilt from the .ckpt
    checkpoint, exported = (load_encoder(str(path), device="cpu") for path in (root / "checkpoints" / "last.ckpt",
                                                                                root / "export"))
    inputs, _ = exported.tokenize(["It is a truth universally acknowledged."])
    torch.testing.assert_close(checkpoint(**inputs).hidden_states, exported(**inputs).hidden_states)
    assert type(checkpoint.model).__name__ == CLASSES[objective, positions].replace("ForCausalLM", "Model")


@pytest.mark.slow
def test_two_process_ddp_equals_one_process_for_the_causal_rope_arm(corpus, cache, tmp_path):
    """The causal-rope arm, 1 process x batch 8 against 2 DDP processes x 4: the same losses and weights."""
    extra = ("--model.dropout", "0.0", "--trainer.max_steps", "3", "--model.objective", "causal",
             "--model.positions", "rope", "--trainer.limit_val_batches", "0")
    one, ddp = tmp_path / "one", tmp_path / "ddp"
    assert train.cli_main(tiny_args(one, corpus, cache, *extra, logger="csv")) == 0
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(ROOT / "train.py"),
                             *tiny_args(ddp, corpus, cache, *extra, "--data.batch_size", "4", "--trainer.devices", "2",
                                        "--trainer.strategy", "ddp", logger="csv")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    load = lambda root: torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)  # noqa: E731
    reference, other = load(one), load(ddp)
    assert reference["hyper_parameters"]["objective"] == "causal" and reference["global_step"] == 3
    for name, value in reference["state_dict"].items():
        torch.testing.assert_close(other["state_dict"][name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert STEPS > 3


@pytest.mark.parametrize("extra, message", [
    (("--model.positions", "alibi"), "--model.positions must be one of learned, none, rope, got 'alibi'"),
    (("--model.objective", "prefix"), "--model.objective must be one of mlm, causal, got 'prefix'"),
    (("--model.position_embeddings", "false", "--model.positions", "learned"),
     "--model.position_embeddings false contradicts --model.positions learned; give one of them (--model.positions "
     "none is the no-PE arm)"),
    (("--model.objective", "causal", "--data.next_token_share", "0"),
     "--data.next_token_share must lie in (0, 1], got 0.0"),
    (("--model.positions", "rope", "--model.attention", "gated"),
     "--model.attention gated is RoBERTa's (--model.positions learned or none); the rotary arm (RoFormer) has softmax "
     "attention only"),
])
def test_bad_arm_options_are_one_line_exit_2_and_write_nothing(extra, message, corpus, cache, tmp_path, capsys):
    root = tmp_path / "run"
    assert train.cli_main(tiny_args(root, corpus, cache, *extra, logger="csv")) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"train.py: error: {message}"
    assert not root.exists()


@pytest.mark.parametrize("objective", ["mlm", "causal"])
def test_the_rotary_arms_sdpa_attention_equals_rope_by_hand_and_roformers_eager_attention(objective):
    """lightning_modules/rotary.py: the arm's SDPA self-attention gives RoPE attention by hand (padding masked), and
    the whole model the hidden states of the same weights under transformers' eager RoFormer attention."""
    from transformers.models.roformer.modeling_roformer import RoFormerSelfAttention

    from lightning_modules.rotary import SdpaRoFormerSelfAttention

    module = arm(objective, "rope")
    inner = module.model.base_model.encoder.layer[0].attention.self
    assert type(inner) is SdpaRoFormerSelfAttention
    ids, mask = torch.randint(5, 600, (2, 12)), torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0  # the second sentence padded after 8 tokens
    ours = states(module, ids, attention_mask=mask)
    hidden = ours.hidden_states[0]
    q, k, v = (projection(hidden).unflatten(-1, (4, 8)).detach() for projection in (inner.query, inner.key,
                                                                                     inner.value))
    scores = torch.einsum("bqhd,bkhd->bhqk", hand_rope(q), hand_rope(k)) / math.sqrt(8)
    scores = scores.masked_fill(~mask.bool()[:, None, None, :], float("-inf"))
    if objective == "causal":
        scores = scores.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
    by_hand = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.double()).flatten(-2)
    blocked = ~mask.bool()[:, None, None, :] | (torch.ones(12, 12, dtype=torch.bool).triu(1) if objective == "causal"
                                                else torch.zeros(12, 12, dtype=torch.bool))
    additive = torch.zeros(blocked.shape).masked_fill(blocked, torch.finfo(torch.float32).min)  # RoFormerModel's form
    with torch.no_grad():
        positions = module.model.base_model.encoder.embed_positions(ids.shape)[None, None]
        context, weights = inner(hidden, attention_mask=additive, sinusoidal_pos=positions)
    assert weights is None  # SDPA: no weights materialised
    torch.testing.assert_close(context[:, :8].double(), by_hand[:, :8], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(context[0].double(), by_hand[0], rtol=1e-4, atol=1e-5)
    # the same weights under RoFormer's eager attention: the same hidden states, padding aside
    for layer in module.model.base_model.encoder.layer:
        layer.attention.self.__class__ = RoFormerSelfAttention
    eager = states(module, ids, attention_mask=mask)
    for a, b in zip(ours.hidden_states, eager.hidden_states, strict=True):
        torch.testing.assert_close(a[mask.bool()], b[mask.bool()], rtol=1e-5, atol=1e-5)


def test_the_rotary_arms_rotation_is_roformers_and_rope_by_hand_with_its_gradients():
    """lightning_modules/rotary.py's rotation (three kernels a tensor, in the inputs' dtype) against transformers'
    `apply_rotary_position_embeddings` and RoPE by hand: queries, keys and values, forward and backward; in bfloat16,
    within bfloat16's rounding of the float32 result."""
    from transformers.models.roformer.modeling_roformer import (
        RoFormerSelfAttention,
        RoFormerSinusoidalPositionalEmbedding,
    )

    from lightning_modules.rotary import SdpaRoFormerSelfAttention

    torch.manual_seed(0)
    table = RoFormerSinusoidalPositionalEmbedding(40, 16)
    table.weight.data = table.create_weight()
    sinusoids = table((3, 40))[None, None]  # [1, 1, seq, d]
    q, k, v = (torch.randn(3, 40, 2, 16).transpose(1, 2).requires_grad_() for _ in range(3))  # [batch, heads, seq, d]
    ours = SdpaRoFormerSelfAttention.apply_rotary_position_embeddings(sinusoids, q, k, v)
    theirs = RoFormerSelfAttention.apply_rotary_position_embeddings(sinusoids, q, k, v)
    for mine, reference, x in zip(ours, theirs, (q, k, v), strict=True):
        torch.testing.assert_close(mine, reference, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(mine.double(), hand_rope(x.transpose(1, 2)).transpose(1, 2), rtol=1e-5, atol=1e-5)
    weights = [torch.randn_like(x) for x in ours]
    mine = torch.autograd.grad(sum((o * w).sum() for o, w in zip(ours, weights)), (q, k, v))
    reference = torch.autograd.grad(sum((o * w).sum() for o, w in zip(theirs, weights)), (q, k, v))
    for a, b in zip(mine, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert len(SdpaRoFormerSelfAttention.apply_rotary_position_embeddings(sinusoids, q, k)) == 2
    low = SdpaRoFormerSelfAttention.apply_rotary_position_embeddings(sinusoids, q.bfloat16(), k.bfloat16())
    for half, full in zip(low, theirs[:2], strict=True):
        assert half.dtype == torch.bfloat16
        torch.testing.assert_close(half.float(), full, rtol=2e-2, atol=2e-2)


def test_the_causal_arms_predict_a_texts_end_but_never_the_blocks_closing_separator():
    from datamodules.blocks import pack_blocks

    texts = [[7, 8, 9], [10, 11], [12, 13, 14, 15, 16], [17, 18]]  # each text followed by </s> (2) in the stream
    blocks, _ = pack_blocks(texts, block_length=6, bos=0, eos=2)  # <s> 4 tokens </s>
    blocks = np.asarray(blocks)
    batch = NextTokenCollator()({"blocks": blocks, "keys": np.arange(len(blocks))})
    stream = [token for text in texts for token in (*text, 2)]
    expected = [stream[i * 4:(i + 1) * 4] for i in range(len(blocks))]  # by hand: each block's piece, the targets
    assert batch["targets"].tolist() == expected
    assert (batch["targets"] == 2).sum() == sum(piece.count(2) for piece in expected) > 0  # a text's own end is one
    assert int(batch["positions"].max()) == blocks.shape[1] - 3  # no query predicts the packing's </s> at seq - 1
    shared = NextTokenCollator(0.5, seed=1)({"blocks": blocks, "keys": np.arange(len(blocks))})
    assert shared["positions"].shape[1] == round(0.5 * 4) and int(shared["positions"].max()) <= blocks.shape[1] - 3
