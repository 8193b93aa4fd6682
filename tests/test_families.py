"""Decoders (GPT-2, Llama, GPT-NeoX, OPT) and rotary encoders (ModernBERT, RoFormer) in the analyses, the probe and
the live callbacks' capture, each against transformers' own `output_hidden_states` (and, for the attention sinks, its
eager `attentions`), one sentence at a time.

    .venv/bin/pytest tests/test_families.py -q
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

import analyze
import probe
from core.capture import HiddenStateCapture
from core.errors import UserError
from core.models import attention_projections, hidden_state_sites, position_embedding
from core.norms import is_norm
from lightning_modules.encoder import load_encoder
from lightning_modules.pooling import mean_pool
from metrics.outliers import OutlierRule
from tests.tiny import HIDDEN, LAYERS, MAX_POSITIONS, corpus_sentences
from tests.tiny_families import DECODERS, FAMILIES, decoder_tokenizer, save_tiny_family

PLANTED = 7  # the dimension every test plants an outlier on
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def decoder_tok(tmp_path_factory):
    return decoder_tokenizer(tmp_path_factory.mktemp("decoder_tokenizer"))


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    texts = corpus_sentences(24, start=500)
    path = tmp_path_factory.mktemp("texts") / "s.txt"
    path.write_text("\n".join(texts) + "\n", encoding="utf-8")
    return texts, path


def plant(model) -> None:
    """Dimension PLANTED large everywhere: the input embedding's column, every norm's gain (and bias, where it has one),
    and, for a model with an absolute table, that table's usable rows (-3 on the rows no token uses)."""
    hidden = model.config.hidden_size
    model.get_input_embeddings().weight[:, PLANTED] += 3.0
    for module in model.modules():
        if is_norm(module, hidden):
            module.weight[PLANTED] = 8.0
            if getattr(module, "bias", None) is not None:
                module.bias[PLANTED] = 4.0
    table = position_embedding(model)
    if table is not None:
        first = getattr(table, "offset", 0)
        table.weight[:, PLANTED] = -3.0
        table.weight[first:, PLANTED] = 3.0


def direct_hidden(path, texts: list[str], max_length: int) -> list[torch.Tensor]:
    """Each sentence alone (no padding) through transformers: [layers, tokens, hidden]."""
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    with torch.no_grad():
        return [torch.stack(model(**tokenizer(text, truncation=True, max_length=max_length, return_tensors="pt"),
                                  output_hidden_states=True).hidden_states)[:, 0] for text in texts]


def direct_sinks(path, texts: list[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sentence alone through the model with eager attention (transformers' own `attentions`): per transformer
    layer, the attention each (sentence, head) gives the first token averaged over its queries ([layers, sentences x
    heads]: Gu et al.'s importance of key 0, the attention summed over the queries that see it, divided by their number,
    T for key 0 in a causal model as in an encoder), and the attention on the special tokens, per query, averaged
    ([layers]). A causal model's eager attention is checked to be causal on the way."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    special = torch.tensor(sorted(set(tokenizer.all_special_ids) - {tokenizer.pad_token_id}))
    first, mass = [[] for _ in range(LAYERS)], torch.zeros(LAYERS, dtype=torch.float64)
    for text in texts:
        inputs = tokenizer(text, truncation=True, max_length=max_length, return_tensors="pt")
        with torch.no_grad():
            attentions = model(**inputs, output_attentions=True).attentions  # per layer [1, heads, T, T]
        keys = torch.isin(inputs["input_ids"][0], special)
        for layer, weights in enumerate(attentions):
            weights = weights[0].double()
            seen = weights.shape[-1] - torch.arange(weights.shape[-1])  # Gu et al.'s `ratios`: queries that see key k
            if getattr(model.config, "layer_types", [None] * LAYERS)[layer] == "sliding_attention":
                seen = seen.clamp(max=model.config.local_attention // 2 + 1)  # ModernBERT's local layers: key 0 is
                # seen by the queries at most half a window after it (its count is the only one read below)
            if model.config.model_type in DECODERS:
                assert float(weights.triu(1).abs().max()) == 0.0  # no query sees a later key
            first[layer].append((weights / seen).sum(-2)[:, 0])
            mass[layer] += weights[..., keys].sum(-1).mean(-1).sum() / weights.shape[0]
    return torch.stack([torch.cat(f) for f in first]), mass / len(texts)


@pytest.fixture(scope="module")
def models(tmp_path_factory, decoder_tok, roberta_tok):
    root = tmp_path_factory.mktemp("families")
    return {kind: save_tiny_family(root / kind, kind, decoder_tok if kind in DECODERS else roberta_tok, plant=plant)
            for kind in FAMILIES}


def test_sinks_of_modernberts_local_layers_average_over_the_queries_inside_their_window(texts, roberta_tok, tmp_path):
    """ModernBERT's local layers attend within a window (128 tokens; 4 here): the queries further from the first token
    than half a window cannot see it and give it exactly 0, so Gu et al.'s importance of key 0 is the mean over the
    queries inside the window, not over the whole sentence (which was diluted by the sentence's length)."""
    sentences, data = texts
    path = save_tiny_family(tmp_path / "modernbert", "modernbert", roberta_tok, plant=plant, local_attention=4)
    assert AutoModel.from_pretrained(path).config.layer_types[1:] == ["sliding_attention"] * (LAYERS - 1)
    first, _ = direct_sinks(path, sentences, 24)
    epsilon = round(float(first.median()), 4)
    out = tmp_path / "report"
    assert analyze.main(["outliers", "--no_progress", "--encoder", str(path), "--data", str(data), "--output_dir",
                         str(out), "--max_length", "24", "--batch_size", "5", "--sink_epsilon", str(epsilon)]) == 0
    report = json.loads((out / "outliers.json").read_text())
    for row, heads in zip(report["layers"][1:], first):
        sinks = row["attention_sinks"]
        assert sinks["first_token_mass"] == pytest.approx(float(heads.mean()), abs=2e-6)
        assert sinks["sink_share"] == pytest.approx(float((heads > epsilon).double().mean()), abs=1e-6)
    assert first[1:].mean() > 1.5 * first[0].mean()  # inside the window: well above a whole sentence's mean


@pytest.mark.parametrize("kind", FAMILIES)
def test_outliers_report_matches_transformers_hidden_states_and_traces_each_familys_origins(kind, models, texts,
                                                                                          tmp_path):
    sentences, data = texts
    out = tmp_path / "report"
    first, special = direct_sinks(models[kind], sentences, 24)
    epsilon = round(float(first.median()), 4)  # Gu et al.'s 0.3 sees no sink in a random model: a share inside (0, 1)
    assert analyze.main(["outliers", "--no_progress", "--encoder", str(models[kind]), "--data", str(data),
                         "--output_dir", str(out), "--max_length", "24", "--batch_size", "5", "--sink_epsilon",
                         str(epsilon)]) == 0
    report = json.loads((out / "outliers.json").read_text())
    # attention sinks (Gu et al.) from the eager pass of padded batches, against each sentence alone by hand
    assert report["layers"][0]["attention_sinks"] is None
    for row, heads, on_special in zip(report["layers"][1:], first, special):
        sinks = row["attention_sinks"]
        assert sinks["first_token_mass"] == pytest.approx(float(heads.mean()), abs=2e-6)
        assert sinks["sink_share"] == pytest.approx(float((heads > epsilon).double().mean()), abs=1e-6)
        assert sinks["special_token_mass"] == pytest.approx(float(on_special), abs=5e-6)
    assert 0 < np.mean([row["attention_sinks"]["sink_share"] for row in report["layers"][1:]]) < 1

    tokens = torch.cat(direct_hidden(models[kind], sentences, 24), dim=1)  # [layers, tokens, hidden]
    assert report["num_tokens"] == tokens.shape[1] and len(report["layers"]) == LAYERS + 1
    rule = OutlierRule()
    for row, states in zip(report["layers"], tokens):
        top, bottom = states.argmax(-1), states.argmin(-1)
        shares_max = torch.bincount(top, minlength=states.shape[1]).double() / len(top)
        shares_min = torch.bincount(bottom, minlength=states.shape[1]).double() / len(top)
        assert row["argmax_dim"] == int(shares_max.argmax()) and row["argmax_share"] == pytest.approx(
            float(shares_max.max()), abs=1e-6)
        assert row["argmin_dim"] == int(shares_min.argmax())
        outliers = sorted(set(torch.nonzero(shares_max >= rule.min_share).flatten().tolist())
                          | set(torch.nonzero(shares_min >= rule.min_share).flatten().tolist()))
        assert sorted(row["outlier_dims"]) == outliers
    assert PLANTED in report["persistent_dims"]

    family, origins = report["model_family"], report["origins"]
    assert family["causal"] is (kind in DECODERS)
    table = origins["position_embeddings"]
    if kind in ("gpt2", "opt"):  # learned tables: GPT-2's wpe from row 0, OPT's embed_positions from row 2
        assert family["positions"] == "learned table" and table["num_positions"] == MAX_POSITIONS
        assert table["dims"][str(PLANTED)]["share_as_max"] == 1.0  # only the usable rows (OPT: not rows 0 and 1)
    else:
        assert table is None and "rotary" in origins["position_embeddings_note"] and family["positions"] == \
            "rotary (RoPE)"
    entries = origins["layer_norms"][str(PLANTED)]
    assert entries and all(entry["weight_rank"] == 1 for entry in entries)  # every planted gain ranks first
    if kind == "llama":  # RMSNorm: a gain and no bias
        assert all("bias" not in entry for entry in entries) and "RMSNorm" in origins["layer_norms_note"]
    if kind == "roformer":  # post-LN: each layer's last LayerNorm writes its hidden state, no placement
        assert family["norms"] == "post-LN" and all("placement" not in entry for entry in entries)
        assert sorted({entry["layer"] for entry in entries}) == list(range(LAYERS + 1))
    else:  # pre-LN: the final norm writes layer L, the others sit inside layers 1..L
        assert family["norms"] == "pre-LN" and "final norm" in family["last_layer"]
        final = [entry for entry in entries if entry["placement"] == "final"]
        assert len(final) == 1 and final[0]["layer"] == LAYERS
        inside = {entry["layer"] for entry in entries if entry["placement"] == "pre"}
        assert inside == set(range(1, LAYERS + 1))


@pytest.mark.parametrize("kind", ["gpt2", "llama", "modernbert"])
def test_position_probe_features_and_contribution_vectors_match_a_direct_computation(kind, models, texts, tmp_path):
    sentences, data = texts
    out = tmp_path / "probe"
    cli = probe.cli_main(["fit", "--config", "configs/probe/position.yaml", "--trainer.logger", "false",
                          "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
                          "--data.progress", "false", "--model.encoder", str(models[kind]), "--data.source", str(data),
                          "--data.max_length", "16", "--data.max_positions", "16", "--data.batch_size", "16",
                          "--data.random_baseline", "false", "--trainer.max_epochs", "1",
                          "--trainer.default_root_dir", str(out)])
    dm, model = cli.datamodule, cli.model
    direct = torch.cat(direct_hidden(models[kind], dm.texts["test"], 16), dim=1)  # no padding: one at a time
    cached = dm.stores["test"].features()
    torch.testing.assert_close(cached, direct, rtol=1e-4, atol=1e-4)
    positions = dm.stores["test"].labels
    weight = model.weight.detach()[:cached.shape[0]]  # [layers, hidden, positions]: the task probes (control ones after)
    c = (weight[:, :, positions].transpose(1, 2) * cached).abs()  # c(i) = |w_gold,i v_i|: [layers, tokens, hidden]
    np.testing.assert_allclose(np.load(out / "contributions.npy"), c.mean(1).numpy(), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "gpt_neox", "opt"])
def test_causal_mean_pooling_counts_every_real_token_and_no_padding(kind, models, decoder_tok):
    assert decoder_tok.pad_token_id is None  # GPT-2's and Llama's tokenizers have none: the batch pads with eos
    encoder = load_encoder(str(models[kind]), device="cpu")
    short, long = "She smiled.", "It is a truth universally acknowledged, that a single man must be in want of a wife."
    batch = encoder(**encoder.tokenize([short, long])[0])
    assert not batch.mask[0].all() and batch.mask[1].all()  # the short sentence is padded on the right
    pooled = mean_pool(batch.hidden_states, batch.mask)  # [layers, 2, hidden]
    for row, text in enumerate((short, long)):
        alone = direct_hidden(models[kind], [text], 64)[0]  # [layers, tokens, hidden]: what the model sees alone
        torch.testing.assert_close(pooled[:, row], alone.mean(1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", FAMILIES)
def test_hook_capture_of_the_live_callbacks_reads_transformers_hidden_states(kind, models):
    model = AutoModel.from_pretrained(models[kind]).eval()
    ids = torch.randint(3, 500, (2, 9))
    with torch.no_grad(), HiddenStateCapture(hidden_state_sites(model), list(range(LAYERS + 1))) as capture:
        expected = model(input_ids=ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(capture.stack(), torch.stack(expected))
    if kind == "roformer":  # post-LN, query and key projections of the hidden states: the attention is readable
        assert len(attention_projections(model)) == LAYERS
    else:  # one line saying why not
        with pytest.raises(UserError, match="pre-LN"):
            attention_projections(model)


def test_opt_350m_post_ln_with_project_out_reads_layer_l_before_the_projection_and_its_lm_loss_after_it(
        decoder_tok, texts, tmp_path, capsys, monkeypatch):
    """OPT-350m: post-LN (do_layer_norm_before false, no final norm) and project_out (hidden 32 -> 16 here) after the
    last layer, which transformers' last hidden state is. Layer L is project_out's input, the stack's last state, as
    the live hooks read it; the LM head reads project_out's output, so the next-token loss is the model's own."""
    from transformers import OPTForCausalLM

    from core import families
    from lightning_modules.interventions import next_token_loss
    from tests.tiny import save_planted
    from tests.tiny_families import family_config

    torch.manual_seed(0)
    model = OPTForCausalLM(family_config("opt", len(decoder_tok), word_embed_proj_dim=16, do_layer_norm_before=False))
    path = save_planted(model, decoder_tok, tmp_path / "opt350m", plant=plant)
    sentences, data = texts
    out = tmp_path / "report"
    assert analyze.main(["outliers", "--no_progress", "--encoder", str(path), "--data", str(data), "--output_dir",
                         str(out), "--max_length", "24", "--no_attention_sinks"]) == 0
    report = json.loads((out / "outliers.json").read_text())
    model.eval()
    kept = []  # project_out's input: the last layer's output (no final norm in a post-LN OPT)
    handle = model.model.decoder.project_out.register_forward_pre_hook(lambda module, args: kept.append(args[0][0]))
    with torch.no_grad():
        states = [model.model(**decoder_tok(text, truncation=True, max_length=24, return_tensors="pt"),
                              output_hidden_states=True).hidden_states for text in sentences]
    handle.remove()
    assert {state.shape[-1] for state in states[0]} == {16, HIDDEN}  # transformers' own: the last one projected
    tokens = torch.cat([torch.stack([*(layer[0] for layer in state[:-1]), last]) for state, last in zip(states, kept)],
                       dim=1)  # [layers, tokens, hidden]
    assert report["num_tokens"] == tokens.shape[1]
    for row, layer in zip(report["layers"], tokens, strict=True):
        shares = torch.bincount(layer.argmax(-1), minlength=HIDDEN).double() / layer.shape[0]
        assert (row["argmax_dim"], row["argmax_share"]) == (int(shares.argmax()), pytest.approx(float(shares.max())))
        assert row["max_abs"] == pytest.approx(float(layer.abs().max()), rel=1e-5)
    assert PLANTED in report["persistent_dims"]
    family = report["model_family"]
    assert family["norms"] == "post-LN" and "before decoder.project_out (to width 16)" in family["last_layer"]
    entries = report["origins"]["layer_norms"][str(PLANTED)]  # each layer's two LayerNorms, post-LN
    assert {(entry["layer"], entry["placement"]) for entry in entries} == {(layer, "post")
                                                                           for layer in range(1, LAYERS + 1)}

    encoder = load_encoder(str(path), device="cpu", masked_lm=True)
    inputs, _ = encoder.tokenize(sentences[:6], 24)
    batch = encoder(**inputs)
    total, count = next_token_loss(encoder, batch.hidden_states[-1], batch.input_ids, batch.attention_mask)
    own = []  # transformers' own loss, sentence by sentence, weighted by its targets
    for text in sentences[:6]:
        ids = decoder_tok(text, truncation=True, max_length=24, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            own.append((model(input_ids=ids, labels=ids).loss, ids.shape[1] - 1))
    assert int(count) == sum(n for _, n in own)
    assert float(total / count) == pytest.approx(sum(float(loss) * n for loss, n in own) / int(count), rel=1e-5)

    monkeypatch.setattr(families, "OUTPUT_PROJECTIONS", ())  # a projection this project does not know: one line
    out = tmp_path / "unknown"
    assert analyze.main(["outliers", "--no_progress", "--encoder", str(path), "--data", str(data),
                         "--output_dir", str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"analyze.py outliers: error: {path}: its hidden states have different widths ([16, 32]: a projection after "
        "the last layer), so its layers cannot be compared")
    assert not out.exists()
