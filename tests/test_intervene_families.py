"""`analyze.py intervene` on decoders (GPT-2, Llama, OPT) and rotary encoders: each intervention against the model
edited by hand (GPT-2's and OPT's position tables overwritten, an RMSNorm's gain zeroed, a decoder's later blocks run on
the edited hidden state), the next-token loss (ours) against transformers' own loss, and the one-line refusals.

    .venv/bin/pytest tests/test_intervene_families.py -q
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, GPTNeoXForCausalLM, ModernBertForMaskedLM

import analyze
from core.capture import layer_output
from core.families import decoder_stack
from core.models import mlm_head
from lightning_modules.interventions import Intervention, intervene, norm_sites
from tests.test_intervene import data_file, edited_activation, hidden, snapshot, unchanged
from tests.tiny import LAYERS, MAX_POSITIONS, corpus_sentences
from tests.tiny_families import decoder_tokenizer, family_config, save_tiny_family

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    return AutoModel.from_config(family_config(kind, 600)).eval()


def padded_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of 12 random ids, the last right-padded after 7 tokens (as FrozenEncoder pads)."""
    ids = torch.randint(3, 600, (3, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[2, 7:], mask[2, 7:] = 1, 0
    return ids, mask


@pytest.mark.parametrize("kind, table, first", [("gpt2", "wpe", 0), ("opt", "decoder.embed_positions", 2)])
@pytest.mark.parametrize("name", ["position_mean", "position_shuffle", "position_zero"])
def test_position_interventions_equal_gpt2s_and_opts_table_overwritten_by_hand(kind, table, first, name):
    """GPT-2 reads wpe from row 0; OPT numbers positions from 2 (rows 0 and 1: never a real token's)."""
    model = tiny(kind)
    ids, mask = padded_inputs()
    before = snapshot(model)
    with intervene(model, Intervention(name, seed=3)):
        got = hidden(model, ids, mask)
    assert unchanged(model, before)
    edited = copy.deepcopy(model)
    with torch.no_grad():
        rows = edited.get_submodule(table).weight[first:]
        assert rows.shape[0] == MAX_POSITIONS
        order = torch.randperm(MAX_POSITIONS, generator=torch.Generator().manual_seed(3))
        rows.copy_({"position_mean": rows.mean(0).expand_as(rows), "position_zero": torch.zeros_like(rows),
                    "position_shuffle": rows[order]}[name])
    counted = mask.bool()
    torch.testing.assert_close(got[:, counted], hidden(edited, ids, mask)[:, counted], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got[:, counted], hidden(model, ids, mask)[:, counted], atol=1e-3)


def later_states(model, state: torch.Tensor, layer: int) -> list[torch.Tensor]:
    """hidden_states[layer + 1 .. L] of a decoder stack by hand: its blocks after `layer` run on `state`, the final
    norm after the last (Llama's blocks take the rotary angles of positions 0..seq-1; causal by their own mask)."""
    stack = decoder_stack(model)
    extra = {}
    if hasattr(model, "rotary_emb"):
        extra["position_embeddings"] = model.rotary_emb(state, torch.arange(state.shape[1])[None])
    states = []
    with torch.no_grad():
        for index in range(layer, LAYERS):
            state = layer_output(stack.blocks[index](state, **extra))
            states.append(stack.final_norm(state) if index == LAYERS - 1 else state)
    return states


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("layer", [0, 1, LAYERS])
@pytest.mark.parametrize("name", ["activation_zero", "activation_mean"])
def test_activation_at_layer_l_of_a_decoder_equals_its_later_blocks_run_by_hand(kind, layer, name):
    """Layer 0 is the first block's input, l < L a block's output (what the next block reads), L the final norm's
    output (nothing after it)."""
    model = tiny(kind)
    ids = torch.randint(3, 600, (2, 10), generator=torch.Generator().manual_seed(4))
    base, got, state = edited_activation(model, ids, name, layer)
    torch.testing.assert_close(torch.stack(later_states(model, base[layer], layer)) if layer < LAYERS else base[:0],
                               base[layer + 1:], atol=1e-5, rtol=1e-5)  # the hand loop reads the model as it runs
    expected = torch.stack([*base[:layer], state, *later_states(model, state, layer)[:LAYERS - layer]])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layers", [None, (2,)])
def test_layernorm_zero_zeroes_an_rmsnorms_gain_as_an_edited_copy_does(layers):
    """Llama's RMSNorms have a gain and no bias: gain_d = 0 makes output dim d 0 (--layers 2: the norms of block 2)."""
    model = tiny("llama")
    ids, mask = padded_inputs()
    dims = (5, 9)
    before = snapshot(model)
    with intervene(model, Intervention("layernorm_zero", dims, layers)):
        got = hidden(model, ids, mask)
    assert unchanged(model, before)
    edited = copy.deepcopy(model)
    zeroed = 0
    with torch.no_grad():
        for module_name, module in edited.named_modules():
            if type(module).__name__ == "LlamaRMSNorm" and (layers is None or module_name.startswith("layers.1.")):
                assert getattr(module, "bias", None) is None
                module.weight[list(dims)] = 0
                zeroed += 1
    assert zeroed == (2 * LAYERS + 1 if layers is None else 2)
    counted = mask.bool()
    torch.testing.assert_close(got[:, counted], hidden(edited, ids, mask)[:, counted], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got[:, counted], hidden(model, ids, mask)[:, counted], atol=1e-3)


def test_lm_heads_of_gpt_neox_and_modernbert_give_the_models_own_logits():
    """GPT-NeoX's `embed_out` and ModernBERT's head -> decoder, as core.models.mlm_head reads them."""
    ids = torch.randint(3, 600, (2, 9), generator=torch.Generator().manual_seed(5))
    for model_class, kind in ((GPTNeoXForCausalLM, "gpt_neox"), (ModernBertForMaskedLM, "modernbert")):
        torch.manual_seed(0)
        model = model_class(family_config(kind, 600)).eval()
        with torch.no_grad():
            logits = mlm_head(model)(model.base_model(input_ids=ids).last_hidden_state)
            torch.testing.assert_close(logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("kind, setting", [("Gemma2", dict(final_logit_softcapping=2.0, head_dim=8)),
                                           ("Cohere", dict(logit_scale=0.25)), ("Granite", dict(logits_scaling=4.0))])
def test_lm_heads_transform_their_logits_as_the_model_does(kind, setting):
    """Gemma 2 soft-caps its logits (c * tanh(logits / c)), Cohere scales them, Granite divides them: the head
    core.models.mlm_head reads (and the next-token loss of `intervene` with it) gives the model's own logits, which
    its bare lm_head does not."""
    import transformers as tf

    torch.manual_seed(0)
    config = getattr(tf, f"{kind}Config")(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                          num_key_value_heads=2, intermediate_size=32, **setting)
    model = getattr(tf, f"{kind}ForCausalLM")(config).eval()
    ids = torch.randint(3, 50, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # logits well beyond the cap
        hidden = model.base_model(input_ids=ids).last_hidden_state
        logits = model(input_ids=ids).logits
        torch.testing.assert_close(mlm_head(model)(hidden), logits)
        assert not torch.allclose(model.lm_head(hidden), logits, atol=1e-2)


def hand_next_token_loss(model, tokenizer, texts: list[str], max_length: int) -> tuple[float, int]:
    """Each sentence alone (no padding), transformers' own causal-LM loss (labels = the input ids: it shifts them),
    weighted by its number of predicted tokens."""
    total, count = 0.0, 0
    for text in texts:
        ids = tokenizer(text, truncation=True, max_length=max_length, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            total += model(input_ids=ids, labels=ids).loss.item() * (ids.shape[1] - 1)
        count += ids.shape[1] - 1
    return total / count, count


def test_next_token_loss_and_interventions_of_a_tiny_gpt2_equal_transformers_own_loss(tmp_path):
    """intervene on a GPT-2 with its LM head: the baseline's next-token loss (ours), and that under position_zero,
    against transformers' GPT2LMHeadModel loss sentence by sentence (the table zeroed by hand); where activation_zero
    acts and which norms layernorm_zero edits, in the report."""
    tokenizer = decoder_tokenizer(tmp_path / "tokenizer")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config("gpt2", len(tokenizer))).eval()
    model.save_pretrained(tmp_path / "gpt2")
    tokenizer.save_pretrained(tmp_path / "gpt2")
    out = tmp_path / "out"
    assert analyze.main(["intervene", "--no_progress", "--encoder", str(tmp_path / "gpt2"), "--data",
                         str(data_file(tmp_path, 12, start=60)), "--max_sentences", "0", "--max_length", "24",
                         "--batch_size", "5", "--num_pairs", "6", "--interventions", "position_zero", "layernorm_zero",
                         "activation_zero", "--dims", "4", "--layers", f"0,{LAYERS}", "--controls", "1",
                         "--output_dir", str(out)]) == 0
    report = json.loads((out / "intervene.json").read_text())
    texts = corpus_sentences(12, start=60)
    loss, count = hand_next_token_loss(model, tokenizer, texts, 24)
    assert report["lm"]["head"] is True and report["lm"]["tokens"] == count and "ours" in report["lm"]["loss"]
    assert report["mlm"]["head"] is False and "causal" in report["mlm"]["note"]
    assert report["baseline"]["tasks"]["lm_loss"] == pytest.approx(loss, abs=1e-5)
    assert report["baseline"]["tasks"]["mlm_loss"] is None
    with torch.no_grad():
        model.transformer.wpe.weight.zero_()
    edited, _ = hand_next_token_loss(model, tokenizer, texts, 24)
    result = report["interventions"]["position_zero"]
    assert result["tasks"]["lm_loss"] == pytest.approx(edited, abs=1e-5)
    assert result["effects"]["lm_loss"] == pytest.approx(edited - loss, abs=1e-5)
    acts = report["interventions"]["activation_zero"]["acts_at"]
    assert list(acts) == ["0", str(LAYERS)] and "first block (h.0)" in acts["0"] and "ln_f" in acts[str(LAYERS)]
    assert "lm_loss" in report["interventions"]["activation_zero"]["controls"]
    norms = report["interventions"]["layernorm_zero"]["norms"]  # --layers 0,L: no norm inside block 0's input; ln_f
    assert [(n["name"], n["placement"], n["zeroed"]) for n in norms][-1] == ("ln_f", "final", "gain and bias")
    assert {n["placement"] for n in norms} == {"pre", "final"} and all(n["layers"] == [LAYERS] for n in norms)


def test_what_a_family_cannot_take_is_one_line_and_writes_nothing(tmp_path, roberta_tok, capfd):
    tokenizer = decoder_tokenizer(tmp_path / "tokenizer")
    llama = save_tiny_family(tmp_path / "llama", "llama", tokenizer)
    roformer = save_tiny_family(tmp_path / "roformer", "roformer", roberta_tok)
    gpt2 = save_tiny_family(tmp_path / "gpt2", "gpt2", tokenizer)
    data = data_file(tmp_path, 4)
    capfd.readouterr()
    rotary = ("needs an absolute position-embedding table, and {} has rotary positions (RoPE rotates queries and keys "
              "inside attention): there is no table to intervene on")
    cases = [(llama, "position_shuffle", "position_shuffle " + rotary.format(llama)),
             (roformer, "position_mean", "position_mean " + rotary.format(roformer)),
             (gpt2, "token_type_zero", f"token_type_zero needs token-type embeddings, and {gpt2} has none (no "
                                       "token-type table in the embeddings of its 'gpt2' model)"),
             # GPT-2 has no norm before its first block: layer 0 has none to zero (it was measured as an effect of 0)
             (gpt2, "activation_zero --layers 0", f"layernorm_zero --layers 0: no LayerNorm or RMSNorm of {gpt2} "
                                                  "writes these layers, so nothing would be zeroed")]
    for index, (encoder, name, message) in enumerate(cases):
        out = tmp_path / f"out{index}"
        assert analyze.main(["intervene", "--no_progress", "--encoder", str(encoder), "--data", str(data),
                             "--interventions", "layernorm_zero", *name.split(), "--output_dir", str(out)]) == 2
        errors = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
        assert len(errors) == 1 and errors[0].startswith(f"analyze.py intervene: error: {message}"), errors
        assert not out.exists()
    assert [norm["name"] for norm in norm_sites(AutoModel.from_pretrained(gpt2), (0,))] == []  # what it would edit


def test_activation_at_layer_0_of_a_roformer_with_a_narrower_embedding_acts_after_its_projection():
    """RoFormer (as ELECTRA) may embed at a smaller width and project to the hidden size: hidden_states[0] is the
    projection's output, so the edit is made there and the encoder runs on it."""
    torch.manual_seed(0)
    model = AutoModel.from_config(family_config("roformer", 600, embedding_size=16)).eval()
    ids = torch.randint(3, 600, (2, 10), generator=torch.Generator().manual_seed(4))
    base = hidden(model, ids)
    with intervene(model, Intervention("activation_zero", (3, 17), (0,))):
        got = hidden(model, ids)
    state = base[0].clone()
    state[..., [3, 17]] = 0.0
    with torch.no_grad():
        expected = model.encoder(state, output_hidden_states=True).hidden_states
    torch.testing.assert_close(got, torch.stack(expected), atol=1e-5, rtol=1e-5)


def test_token_type_zero_on_roformer_equals_its_table_zeroed_by_hand():
    """RoFormer (rotary, BERT's embeddings) has token types, so token_type_zero acts there."""
    model = tiny("roformer")
    ids, mask = padded_inputs()
    with intervene(model, Intervention("token_type_zero")):
        got = hidden(model, ids, mask)
    edited = copy.deepcopy(model)
    with torch.no_grad():
        edited.embeddings.token_type_embeddings.weight.zero_()
    counted = mask.bool()
    torch.testing.assert_close(got[:, counted], hidden(edited, ids, mask)[:, counted], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got[:, counted], hidden(model, ids, mask)[:, counted], atol=1e-3)
