"""The families researchers bring beyond the six of tests/test_families.py, each a tiny random model of
transformers' own class: the encoder's padded batches against each sentence alone through transformers, the live
callbacks' hooks against `output_hidden_states`, the position mechanism the report names, and layernorm_zero
reaching every norm (core.norms.norm_affine).

    .venv/bin/pytest tests/test_more_families.py -q
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from core.capture import HiddenStateCapture
from core.models import hidden_state_sites, layer_norms, model_family
from lightning_modules.encoder import load_encoder
from lightning_modules.interventions import Intervention, intervene
from tests.tiny import corpus_sentences, save_planted

pytestmark = pytest.mark.usefixtures("one_thread")

WIDTH, DEPTH, POSITIONS = 16, 2, 40


def configs(vocab: int) -> dict:
    """kind -> (a config of transformers' class for it, the positions its report names)."""
    import transformers as tf

    ids = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2)
    common = dict(vocab_size=vocab, hidden_size=WIDTH, num_hidden_layers=DEPTH, num_attention_heads=2,
                  intermediate_size=32, max_position_embeddings=POSITIONS, **ids)
    gpt = dict(vocab_size=vocab, n_embd=WIDTH, n_layer=DEPTH, n_head=2, n_inner=32, n_positions=POSITIONS, **ids)
    grouped = dict(common, num_key_value_heads=1)
    table, rotary = "learned table", "rotary (RoPE)"
    relative, alibi = "relative biases (no table)", "ALiBi biases (no table)"
    return {
        "xlm-roberta": (tf.XLMRobertaConfig(**{**common, "max_position_embeddings": POSITIONS + 2}), table),
        "deberta": (tf.DebertaConfig(**common, relative_attention=True, position_biased_input=False), relative),
        "deberta-v2": (tf.DebertaV2Config(**common, relative_attention=True, position_biased_input=False,
                                          position_buckets=16, pos_att_type=["c2p", "p2c"],
                                          norm_rel_ebd="layer_norm", share_att_key=True), relative),
        "deberta-v2-conv": (tf.DebertaV2Config(**common, relative_attention=True, position_biased_input=False,
                                               position_buckets=16, norm_rel_ebd="layer_norm", type_vocab_size=0,
                                               conv_kernel_size=3), relative),  # deberta-v2-xlarge / xxlarge
        "megatron-bert": (tf.MegatronBertConfig(**common), table),  # pre-LN layers, a final norm: encoder.ln
        "xlm-roberta-xl": (tf.XLMRobertaXLConfig(**{**common, "max_position_embeddings": POSITIONS + 2}), table),
        "mpnet": (tf.MPNetConfig(**{**common, "max_position_embeddings": POSITIONS + 2}), table),
        "electra": (tf.ElectraConfig(**common, embedding_size=8), table),
        "esm": (tf.EsmConfig(**common, position_embedding_type="rotary", mask_token_id=3), rotary),
        "big_bird": (tf.BigBirdConfig(**common, attention_type="original_full"), table),
        "big_bird-sparse": (tf.BigBirdConfig(**common, block_size=8, num_random_blocks=3), table),  # google's: 64, 3
        "gpt_neo": (tf.GPTNeoConfig(vocab_size=vocab, hidden_size=WIDTH, num_layers=DEPTH, num_heads=2,
                                    intermediate_size=32, max_position_embeddings=POSITIONS,
                                    attention_types=[[["global", "local"], 1]], window_size=4, **ids), table),
        "gptj": (tf.GPTJConfig(**gpt, rotary_dim=4), rotary),
        "gpt_bigcode": (tf.GPTBigCodeConfig(**gpt), table),
        "codegen": (tf.CodeGenConfig(**gpt, n_ctx=POSITIONS, rotary_dim=4), rotary),
        "mistral": (tf.MistralConfig(**grouped, sliding_window=None), rotary),
        "qwen2": (tf.Qwen2Config(**grouped), rotary),
        "qwen3": (tf.Qwen3Config(**grouped, head_dim=8), rotary),
        "gemma": (tf.GemmaConfig(**grouped, head_dim=8), rotary),
        "gemma2": (tf.Gemma2Config(**grouped, head_dim=8), rotary),
        "gemma3_text": (tf.Gemma3TextConfig(**grouped, head_dim=8), rotary),
        "phi": (tf.PhiConfig(**common), rotary),
        "phi3": (tf.Phi3Config(**common), rotary),
        "stablelm": (tf.StableLmConfig(**common, num_key_value_heads=2), rotary),
        "olmo": (tf.OlmoConfig(**common), rotary),
        "olmo2": (tf.Olmo2Config(**common), rotary),  # its q_norm and k_norm span all heads: as wide as hidden
        "starcoder2": (tf.Starcoder2Config(**grouped), rotary),
        "falcon": (tf.FalconConfig(vocab_size=vocab, hidden_size=WIDTH, num_hidden_layers=DEPTH,
                                   num_attention_heads=2, max_position_embeddings=POSITIONS, **ids), rotary),
        "falcon-rw": (tf.FalconConfig(vocab_size=vocab, hidden_size=WIDTH, num_hidden_layers=DEPTH,
                                      num_attention_heads=2, max_position_embeddings=POSITIONS, alibi=True,
                                      parallel_attn=False, bias=True, **ids), alibi),  # falcon-rw-1b
        "bloom": (tf.BloomConfig(vocab_size=vocab, hidden_size=WIDTH, n_layer=DEPTH, n_head=2, **ids), alibi),
        "mpt": (tf.MptConfig(vocab_size=vocab, d_model=WIDTH, n_layers=DEPTH, n_heads=2, max_seq_len=POSITIONS,
                             **ids), alibi),
        "xglm": (tf.XGLMConfig(vocab_size=vocab, d_model=WIDTH, num_layers=DEPTH, attention_heads=2, ffn_dim=32,
                               max_position_embeddings=POSITIONS, **ids), "fixed sinusoids"),
    }


KINDS = list(configs(10))


@pytest.fixture(scope="module")
def saved(tmp_path_factory, roberta_tok):
    """kind -> the directory of its tiny random model (1-d weights randomised: every norm's gain differs)."""
    root, found = tmp_path_factory.mktemp("more_families"), {}

    def plant(model):
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.normal_()
    for kind, (config, _) in configs(len(roberta_tok)).items():
        torch.manual_seed(0)
        found[kind] = save_planted(AutoModel.from_config(config), roberta_tok, root / kind, plant)
    return found


TEXTS = corpus_sentences(5, start=40)


@pytest.mark.parametrize("kind", KINDS)
def test_padded_batches_are_each_sentence_alone(kind, saved, roberta_tok):
    """The encoder's right-padded batches (causal or bidirectional, ALiBi, rotary, relative) equal each sentence run
    alone, unpadded, through transformers' own model, at every layer."""
    encoder = load_encoder(str(saved[kind]), device="cpu")
    model = AutoModel.from_pretrained(saved[kind]).eval()
    batches = list(encoder.batches(TEXTS, batch_size=5, max_length=POSITIONS - 8, progress=False))
    assert len(batches) == 1 and not batches[0].mask.all()  # padded: the sentences differ in length
    for index, text in enumerate(TEXTS):
        row = batches[0].rows.index(index)  # a batch is sorted by length
        ids = roberta_tok(text, truncation=True, max_length=POSITIONS - 8, return_tensors="pt")
        with torch.no_grad():
            alone = torch.stack(model(**ids, output_hidden_states=True).hidden_states)[:, 0]
        kept = batches[0].mask[row]
        torch.testing.assert_close(batches[0].hidden_states[:, row, kept].float(), alone, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_hooks_read_the_hidden_states_and_the_report_names_the_positions(kind, saved, roberta_tok):
    model = AutoModel.from_pretrained(saved[kind]).eval()
    ids = torch.randint(3, len(roberta_tok), (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = torch.stack(model(input_ids=ids, output_hidden_states=True).hidden_states)
        with HiddenStateCapture(hidden_state_sites(model), list(range(len(expected)))) as capture:
            model(input_ids=ids)
    torch.testing.assert_close(capture.stack(), expected)
    named = configs(10)[kind][1]
    assert model_family(model).positions == named


@pytest.mark.parametrize("kind", KINDS)
def test_layernorm_zero_reaches_every_norm(kind, saved):
    """Every norm over the hidden size (its class whatever it is) writes 0 at the dims under layernorm_zero; the
    norms found are every leaf module called *LayerNorm / *RMSNorm over the hidden size that transformers runs."""
    model, dims = AutoModel.from_pretrained(saved[kind]).eval(), [3, 11]
    norms = layer_norms(model)
    outputs: dict[str, torch.Tensor] = {}
    handles = [module.register_forward_hook(lambda m, a, out, name=name: outputs.__setitem__(name, out))
               for name, _, module in norms]
    named = {name for name, module in model.named_modules()  # OLMo-2's query and key norms are as wide, not hidden
             if type(module).__name__.endswith(("LayerNorm", "RMSNorm")) and not name.endswith(("q_norm", "k_norm"))
             and tuple(getattr(module, "weight", torch.ones(WIDTH)).shape) == (WIDTH,)
             and not (kind.startswith("deberta-v2") and name == "encoder.LayerNorm")}  # of its relative positions
    with torch.no_grad(), intervene(model, Intervention("layernorm_zero", dims=tuple(dims))):
        model(input_ids=torch.tensor([[5, 9, 14, 7]]))
    for handle in handles:
        handle.remove()
    assert norms and {name for name, _, _ in norms} == named and set(outputs) == named
    assert all(float(out[..., dims].abs().max()) == 0.0 and float(out.abs().max()) > 0 for out in outputs.values())


@pytest.mark.parametrize("kind, instead", [("bloom", "ALiBi position biases inside attention"),
                                            ("falcon-rw", "ALiBi position biases inside attention"),
                                            ("deberta-v2", "relative position biases inside attention"),
                                            ("xglm", "fixed sinusoidal positions")])
def test_position_interventions_name_what_a_family_has_instead_of_a_table(kind, instead, saved, tmp_path, capsys):
    """A family without an absolute table is refused in one line that names what it has, before anything is written."""
    import analyze
    from core.models import position_embedding

    assert position_embedding(AutoModel.from_pretrained(saved[kind])) is None
    data = tmp_path / "s.txt"
    data.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    capsys.readouterr()
    assert analyze.main(["intervene", "--no_progress", "--encoder", str(saved[kind]), "--data", str(data),
                         "--output_dir", str(tmp_path / "out"), "--interventions", "position_mean"]) == 2
    assert f"position_mean needs an absolute position-embedding table, and {saved[kind]} has none ({instead})" in \
        capsys.readouterr().err and not (tmp_path / "out").exists()


def test_attention_geometry_of_relative_position_biases_is_one_line_that_says_why(saved):
    """DeBERTa and MPNet add relative-position terms to q k^T: MPNet's attention weights are not the softmax of its
    queries' and keys' products (computed here from its first layer's projections of hidden_states[0]), so the live
    AttentionGeometry, which reads queries and keys, refuses both and says why."""
    from core.errors import UserError
    from core.models import attention_projections

    model = AutoModel.from_pretrained(saved["mpnet"], attn_implementation="eager").eval()
    with torch.no_grad():
        output = model(input_ids=torch.tensor([[0, 9, 14, 7, 21, 2]]), output_hidden_states=True,
                       output_attentions=True)
        attention = model.encoder.layer[0].attention.attn
        queries, keys = (projection(output.hidden_states[0]).view(1, 6, 2, WIDTH // 2).transpose(1, 2)
                         for projection in (attention.q, attention.k))
        products = (queries @ keys.transpose(-1, -2) / (WIDTH // 2) ** 0.5).softmax(-1)
    assert not torch.allclose(products, output.attentions[0], atol=1e-3)
    for kind in ("mpnet", "deberta-v2"):
        with pytest.raises(UserError, match="add relative-position terms to the queries' and keys' products"):
            attention_projections(AutoModel.from_pretrained(saved[kind]))


def test_deberta_v2_norms_are_traced_at_the_hidden_states_they_write(saved):
    """DeBERTa-v2 xlarge / xxlarge add a convolution after layer 1, whose LayerNorm writes hidden_states[1]; the
    encoder's own LayerNorm normalises the relative-position embeddings and writes no hidden state: each traced norm
    whose output is one of transformers' hidden states is traced at that layer, and that norm is not traced."""
    model = AutoModel.from_pretrained(saved["deberta-v2-conv"]).eval()
    outputs: dict[str, torch.Tensor] = {}
    handles = [module.register_forward_hook(lambda m, a, out, name=name: outputs.__setitem__(name, out))
               for name, module in model.named_modules() if type(module).__name__.endswith("LayerNorm")]
    with torch.no_grad():
        states = model(input_ids=torch.tensor([[5, 9, 14, 7, 21]]), output_hidden_states=True).hidden_states
    for handle in handles:
        handle.remove()
    writes = {name: [layer for layer, state in enumerate(states)
                     if out.shape == state.shape and torch.allclose(out, state)] for name, out in outputs.items()}
    traced = {name: layers for name, layers, _ in layer_norms(model)}
    assert writes["encoder.LayerNorm"] == [] and "encoder.LayerNorm" not in traced
    assert writes["encoder.conv.LayerNorm"] == traced["encoder.conv.LayerNorm"] == [1]
    assert all(traced[name] == layers for name, layers in writes.items() if layers)
    assert len(traced) == len(outputs) - 1  # every other norm is traced


def test_falcon_sinks_are_not_measured_rather_than_wrong(saved, tmp_path):
    """transformers cannot switch Falcon's attention to eager once loaded with SDPA, and the weights it then returns
    (output_attentions) are not its attention: `outliers` measures no sinks and says why, as for Longformer."""
    import json

    import analyze

    ids = torch.tensor([[5, 9, 14, 7, 21]])
    with torch.no_grad():
        under_sdpa = AutoModel.from_pretrained(saved["falcon"]).eval()(input_ids=ids, output_attentions=True)
        eager = AutoModel.from_pretrained(saved["falcon"], attn_implementation="eager").eval()(
            input_ids=ids, output_attentions=True)
    assert float(eager.attentions[0][0, :, 0, 1:].abs().max()) == 0.0  # causal: the first query sees itself only
    assert float(under_sdpa.attentions[0][0, :, 0, 1:].min()) > 0.0  # what the sinks would have read
    data = tmp_path / "s.txt"
    data.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    with pytest.warns(UserWarning, match="attention sinks not measured: transformers cannot switch FalconModel"):
        assert analyze.main(["outliers", "--no_progress", "--encoder", str(saved["falcon"]), "--data", str(data),
                             "--output_dir", str(tmp_path / "out"), "--max_length", "24"]) == 0
    report = json.loads((tmp_path / "out" / "outliers.json").read_text())
    assert [row["attention_sinks"] for row in report["layers"]] == [None] * (DEPTH + 1)


@pytest.mark.parametrize("groups", [1, 2])
def test_albert_shared_layers_are_told_apart_by_their_calls(groups, roberta_tok):
    """ALBERT runs one module for several layers: the hooks count its calls. The live callbacks' capture reads
    transformers' hidden_states, and activation_zero at one layer changes that layer and, through the shared module,
    only the layers after it, as the group run by hand on the edited state gives; twice in one context, the same."""
    import transformers as tf

    from core.capture import HiddenStateCapture

    torch.manual_seed(0)
    model = AutoModel.from_config(tf.AlbertConfig(vocab_size=len(roberta_tok), embedding_size=8, hidden_size=WIDTH,
                                                  num_hidden_layers=4, num_hidden_groups=groups,
                                                  num_attention_heads=2, intermediate_size=32)).eval()
    ids = torch.tensor([[5, 9, 14, 7, 21]])
    with torch.no_grad():
        expected = torch.stack(model(input_ids=ids, output_hidden_states=True).hidden_states)
        with HiddenStateCapture(hidden_state_sites(model), list(range(5))) as capture:
            model(input_ids=ids)
    torch.testing.assert_close(capture.stack(), expected)

    dims, layer = (3, 11), 2
    with torch.no_grad(), intervene(model, Intervention("activation_zero", dims=dims, layers=(layer,))):
        first = torch.stack(model(input_ids=ids, output_hidden_states=True).hidden_states)
        second = torch.stack(model(input_ids=ids, output_hidden_states=True).hidden_states)
    edited = expected[layer].clone()
    edited[..., list(dims)] = 0.0
    group = model.encoder.albert_layer_groups[int(layer / (4 / groups))]
    with torch.no_grad():
        after = group(edited)
        after = after[0] if isinstance(after, tuple) else after
    torch.testing.assert_close(first[:layer], expected[:layer])
    torch.testing.assert_close(first[layer], edited)
    torch.testing.assert_close(first[layer + 1], after, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second, first)


def test_albert_with_inner_layers_is_refused_by_the_hooks_and_the_analyses(roberta_tok, tmp_path, capsys):
    """ALBERT with inner_group_num 2: transformers' hidden_states holds one state per sub-layer (layers x 2 + 1), not
    one per layer as the hooks' sites would, so the live callbacks' layers and an intervention's means would name other
    states than the analyses' hidden_states: one line instead; the analyses (which read hidden_states sized by
    num_hidden_layers) refuse it at load, with nothing written."""
    import transformers as tf

    from core.errors import UserError

    torch.manual_seed(0)
    model = AutoModel.from_config(tf.AlbertConfig(vocab_size=len(roberta_tok), embedding_size=8, hidden_size=WIDTH,
                                                  num_hidden_layers=3, num_hidden_groups=1, inner_group_num=2,
                                                  num_attention_heads=2, intermediate_size=32)).eval()
    with torch.no_grad():
        states = model(input_ids=torch.tensor([[5, 9, 14]]), output_hidden_states=True).hidden_states
    assert len(states) == 3 * 2 + 1  # not num_hidden_layers + 1
    with pytest.raises(UserError, match="inner_group_num=2"):
        hidden_state_sites(model)
    with pytest.raises(UserError, match="inner_group_num=2"), intervene(model, Intervention("activation_zero",
                                                                                            dims=(3,), layers=(1,))):
        pass
    path = save_planted(model, roberta_tok, tmp_path / "albert")
    with pytest.raises(UserError, match="inner_group_num=2"):
        load_encoder(str(path), device="cpu")
    assert "inner_group_num=2" in outliers_refusal(path, tmp_path, capsys)


def test_windowed_attention_has_no_sinks_to_read_and_the_report_says_so(roberta_tok, tmp_path):
    """Longformer's attention weights are [seq, window + 1] per query, not a query x key matrix: `outliers` runs,
    measures no sinks (every layer's null), and says why in the report and in one warning."""
    import json

    import transformers as tf

    import analyze

    torch.manual_seed(0)
    model = AutoModel.from_config(tf.LongformerConfig(vocab_size=len(roberta_tok), hidden_size=WIDTH,
                                                      num_hidden_layers=DEPTH, num_attention_heads=2,
                                                      intermediate_size=32, max_position_embeddings=POSITIONS + 2,
                                                      attention_window=4, pad_token_id=1))
    path = save_planted(model, roberta_tok, tmp_path / "longformer")
    data = tmp_path / "s.txt"
    data.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    with pytest.warns(UserWarning, match="attention sinks not measured: .* returns attention weights of shape"):
        assert analyze.main(["outliers", "--no_progress", "--encoder", str(path), "--data", str(data),
                             "--output_dir", str(tmp_path / "out"), "--max_length", "24"]) == 0
    report = json.loads((tmp_path / "out" / "outliers.json").read_text())
    assert "Longformer's windowed" in report["attention_sinks_note"]
    assert [row["attention_sinks"] for row in report["layers"]] == [None] * (DEPTH + 1)
    assert report["num_tokens"] == sum(min(len(roberta_tok(text)["input_ids"]), 24) for text in TEXTS)


def test_block_sparse_bigbird_is_read_and_its_missing_attention_weights_are_said(saved, tmp_path):
    """BigBird's released checkpoints are block-sparse; a sentence shorter than its sparse pattern (704 tokens for
    google's) switches it to full attention, after which transformers returns no attention weights: `outliers` reads
    the hidden states and says why the sinks are not measured, instead of failing."""
    import json

    import analyze

    model = AutoModel.from_pretrained(saved["big_bird-sparse"]).eval()
    with torch.no_grad():
        assert model(input_ids=torch.tensor([[5, 9, 14, 7, 21]]), output_attentions=True).attentions == ()
    data = tmp_path / "s.txt"
    data.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    with pytest.warns(UserWarning, match="attention sinks not measured: .* returns no attention weights"):
        assert analyze.main(["outliers", "--no_progress", "--encoder", str(saved["big_bird-sparse"]), "--data",
                             str(data), "--output_dir", str(tmp_path / "out"), "--max_length", "24"]) == 0
    report = json.loads((tmp_path / "out" / "outliers.json").read_text())
    assert [row["attention_sinks"] for row in report["layers"]] == [None] * (DEPTH + 1)
    assert report["num_tokens"] == sum(min(len(AutoTokenizer.from_pretrained(saved["big_bird-sparse"])(text)[
        "input_ids"]), 24) for text in TEXTS)


def test_a_model_without_attention_is_one_line(roberta_tok, tmp_path):
    """RWKV (recurrent) has a block list and norms, but no attention: it is refused before anything is read."""
    import transformers as tf

    from core.errors import UserError

    torch.manual_seed(0)
    model = AutoModel.from_config(tf.RwkvConfig(vocab_size=len(roberta_tok), hidden_size=WIDTH,
                                                num_hidden_layers=DEPTH, attention_hidden_size=WIDTH,
                                                intermediate_size=32, context_length=POSITIONS))
    path = save_planted(model, roberta_tok, tmp_path / "rwkv")
    with pytest.raises(UserError, match="is a 'rwkv' model whose config names no attention heads"):
        load_encoder(str(path), device="cpu")



def test_a_multimodal_model_is_one_line_that_says_so(roberta_tok, tmp_path, capsys):
    """Gemma 3 from 4B (Gemma3ForConditionalGeneration) names its heads in text_config, not at the top of its config:
    it is refused as the multimodal model it is, not as one without attention, with nothing written."""
    import transformers as tf

    import analyze

    text = tf.Gemma3TextConfig(vocab_size=len(roberta_tok), hidden_size=WIDTH, num_hidden_layers=DEPTH,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=32)
    vision = tf.SiglipVisionConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    config = tf.Gemma3Config(text_config=text, vision_config=vision)
    assert not getattr(config, "num_attention_heads", None) and config.get_text_config().num_attention_heads == 2
    config.save_pretrained(tmp_path / "gemma3")
    roberta_tok.save_pretrained(tmp_path / "gemma3")
    data = tmp_path / "s.txt"
    data.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    capsys.readouterr()
    assert analyze.main(["outliers", "--no_progress", "--encoder", str(tmp_path / "gemma3"), "--data", str(data),
                         "--output_dir", str(tmp_path / "out")]) == 2
    assert "is a 'gemma3' multimodal model (its language model's config is its text_config)" in \
        capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_bert_with_transformers_4_relative_key_positions_is_one_line(roberta_tok, tmp_path, capsys):
    """A BERT trained with transformers 4's position_embedding_type relative_key (its file holds each layer's
    distance_embedding, and the absolute table transformers 4 built and never added): transformers 5's BertModel never
    reads the key, so it drops the distance embeddings and adds the table (shown here against the embeddings computed
    by hand), a model other than the trained one: refused in one line, exit 2, nothing written. ESM's rotary type,
    which its model reads, loads (test_padded_batches_are_each_sentence_alone)."""
    import transformers as tf
    from safetensors.torch import load_file, save_file

    from core.errors import UserError

    config = tf.BertConfig(vocab_size=len(roberta_tok), hidden_size=WIDTH, num_hidden_layers=DEPTH,
                           num_attention_heads=2, intermediate_size=32, max_position_embeddings=POSITIONS,
                           position_embedding_type="relative_key")
    torch.manual_seed(0)
    path = save_planted(tf.BertModel(config), roberta_tok, tmp_path / "bert")
    weights = load_file(path / "model.safetensors")
    for layer in range(DEPTH):  # transformers 4's relative_key weights: [2 x positions - 1, head size]
        weights[f"encoder.layer.{layer}.attention.self.distance_embedding.weight"] = torch.randn(2 * POSITIONS - 1, 8)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    model = AutoModel.from_pretrained(path).eval()
    ids = torch.tensor([[0, 9, 14, 30, 2]])
    with torch.no_grad():
        states = model(input_ids=ids, output_hidden_states=True).hidden_states
    embeddings = model.embeddings
    by_hand = embeddings.LayerNorm(embeddings.word_embeddings.weight[ids[0]] + embeddings.position_embeddings.weight[:5]
                                   + embeddings.token_type_embeddings.weight[0])
    torch.testing.assert_close(states[0][0], by_hand)  # the absolute table is added; no distance embedding is read
    assert not any("distance" in name for name in model.state_dict())
    with pytest.raises(UserError, match="position_embedding_type 'relative_key', which transformers .*'bert' model "
                                        "does not implement"):
        load_encoder(str(path), device="cpu")
    error = outliers_refusal(path, tmp_path, capsys)
    assert "its config asks for position_embedding_type 'relative_key'" in error and len(error.splitlines()) == 1


def test_a_bert_saved_by_transformers_5_with_a_stale_relative_key_is_read_with_its_trained_table(roberta_tok, tmp_path):
    """The same config key in a checkpoint transformers 5 saved (its weights hold no distance embedding: the model it
    trained added the absolute table it then saved): read with a one-line warning, as plain transformers reads it (the
    hidden states of AutoModel, and the embeddings by hand with the saved table); the same key beside distance
    embeddings stays refused (above)."""
    import warnings

    import transformers as tf
    from safetensors import safe_open

    from core.errors import UserError

    config = tf.BertConfig(vocab_size=len(roberta_tok), hidden_size=WIDTH, num_hidden_layers=DEPTH,
                           num_attention_heads=2, intermediate_size=32, max_position_embeddings=POSITIONS,
                           position_embedding_type="relative_key")
    torch.manual_seed(0)
    model = tf.BertModel(config)
    # a transformers 4 relative checkpoint loaded and saved again by transformers 5: no distance embedding either, but
    # the absolute table is the untrained one (adjacent rows uncorrelated): still refused
    resaved = save_planted(model, roberta_tok, tmp_path / "resaved")
    with pytest.raises(UserError, match="position_embedding_type 'relative_key', which transformers"):
        load_encoder(str(resaved), device="cpu")
    with torch.no_grad():  # a trained table: smooth in the position, as a learned one becomes
        angles = torch.arange(POSITIONS)[:, None] * torch.linspace(0.01, 0.2, WIDTH)[None] + torch.rand(WIDTH) * 6.28
        model.embeddings.position_embeddings.weight.copy_(0.05 * torch.sin(angles))
    path = save_planted(model, roberta_tok, tmp_path / "bert")
    with safe_open(str(path / "model.safetensors"), framework="pt") as saved:
        assert not any("distance" in key for key in saved.keys())  # noqa: SIM118
        table = saved.get_tensor("embeddings.position_embeddings.weight")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        encoder = load_encoder(str(path), device="cpu")
    stale = [str(w.message) for w in caught if "stale" in str(w.message)]
    assert len(stale) == 1 and "its weights hold no relative-position (distance_embedding) weights" in stale[0]
    rows = torch.nn.functional.normalize(table.double(), dim=1)  # the cosine the warning names, computed directly
    assert f"mean cosine {(rows[1:] * rows[:-1]).sum(1).mean():.2f}" in stale[0]
    ids = torch.tensor([[0, 9, 14, 30, 2]])
    plain = AutoModel.from_pretrained(path).eval()
    with torch.no_grad():
        ours = encoder.model(input_ids=ids, output_hidden_states=True).hidden_states
        theirs = plain(input_ids=ids, output_hidden_states=True).hidden_states
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b)
    embeddings = plain.embeddings
    by_hand = embeddings.LayerNorm(embeddings.word_embeddings.weight[ids[0]] + table[:5]
                                   + embeddings.token_type_embeddings.weight[0])
    torch.testing.assert_close(ours[0][0], by_hand)


def outliers_refusal(encoder, tmp_path, capsys) -> str:
    """`analyze.py outliers` on `encoder`: exit 2 and nothing written; what it printed to stderr."""
    import analyze

    data = tmp_path / "s.txt"
    data.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    capsys.readouterr()
    assert analyze.main(["outliers", "--no_progress", "--encoder", str(encoder), "--data", str(data),
                         "--output_dir", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()
    return capsys.readouterr().err


def test_a_position_type_its_model_reads_passes_whatever_its_value():
    """Granite 4.0-H checkpoints (granitemoehybrid) ship position_embedding_type "nope": their model reads the key
    ("rope" builds the rotary embedding, anything else none), though "nope" is written nowhere in its source. It is
    no transformers 4 relative type dropped silently and loads: the model it builds is the one of None (no rotary
    embedding), as transformers' own code decides. BERT's relative_key, a key BertModel never reads, stays refused."""
    import transformers as tf

    from core.errors import UserError
    from core.families import check_position_type

    tiny = dict(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, layer_types=["attention", "attention"], num_local_experts=0,
                shared_intermediate_size=16, mamba_n_heads=2, mamba_d_head=16, mamba_n_groups=1)
    nope = tf.GraniteMoeHybridConfig(**tiny, position_embedding_type="nope")
    check_position_type(nope, "granite-4.0-h")
    built = {kind: tf.GraniteMoeHybridModel(tf.GraniteMoeHybridConfig(**tiny, position_embedding_type=kind)).rotary_emb
             for kind in ("nope", None, "rope")}
    assert built["nope"] is None and built[None] is None and built["rope"] is not None
    with pytest.raises(UserError, match="position_embedding_type 'relative_key_query'"):
        check_position_type(tf.BertConfig(position_embedding_type="relative_key_query"), "bert")
    check_position_type(tf.BertConfig(position_embedding_type="absolute"), "bert")
    check_position_type(tf.EsmConfig(vocab_size=33, position_embedding_type="rotary"), "esm")
