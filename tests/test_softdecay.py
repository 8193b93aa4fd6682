"""tokenUni's SoftDecay (`--normalize softdecay`, `--data.normalize softdecay`) against a direct SVD of each sentence's
own token matrix (numpy, float64, no padding), in every protocol it enters; its fixed point; its refusals.

    .venv/bin/pytest tests/test_softdecay.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr
from transformers import AutoModel, AutoTokenizer

import analyze
import probe
from metrics.transforms import soft_decay
from tests.test_analyze_eval import MAX_LENGTH, STS, cos, direct_anisotropy, random_token_vectors, run, values
from tests.test_geometry import isoscore_reference
from tests.tiny import corpus_sentences, save_tiny_encoder

ROOT = Path(__file__).resolve().parent.parent
ALPHA = -0.2


def direct_soft_decay(matrix: np.ndarray, alpha: float) -> np.ndarray:
    """The formula on one sentence's token matrix [tokens, hidden] (float64): s' = -log(1 - alpha (s + alpha)) / alpha,
    scaled so that max s' = max s; a singular value at rounding level (no direction of its own) stays 0."""
    u, s, vt = np.linalg.svd(matrix, full_matrices=False)
    significant = s > s[0] * max(matrix.shape) * np.finfo(np.float32).eps
    mapped = np.where(significant, -np.log(1 - alpha * (s + alpha)) / alpha, 0.0)
    return (u * mapped * s[0] / mapped[0]) @ vt


def test_soft_decay_equals_a_direct_svd_of_each_sentence_and_alpha_to_zero_changes_nothing():
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 5, 40, 16, generator=generator) * 2 + torch.randn(16, generator=generator) * 4
    lengths = [40, 23, 7, 1, 16]  # more tokens than dimensions, fewer, a single token
    mask = torch.arange(40)[None, :] < torch.tensor(lengths)[:, None]
    hidden[:, 4, 8:16] = hidden[:, 4, :8]  # a repeated half: rank 8 of 16 tokens, eight singular values at 0
    out = soft_decay(hidden, mask, ALPHA)
    for layer in range(3):
        for row, n in enumerate(lengths):
            expected = direct_soft_decay(hidden[layer, row, :n].double().numpy(), ALPHA)
            np.testing.assert_allclose(out[layer, row, :n].double().numpy(), expected, atol=2e-4, rtol=1e-5)
            assert torch.equal(out[layer, row, n:], hidden[layer, row, n:])  # padding is left as it is
            s = np.linalg.svd(out[layer, row, :n].double().numpy(), compute_uv=False)
            raw = np.linalg.svd(hidden[layer, row, :n].double().numpy(), compute_uv=False)
            assert s[0] == pytest.approx(raw[0], rel=1e-5)  # max s' = max s
            if n > 1 and row != 4:  # flatter: each other singular value rises towards the largest
                assert (s[1:] / s[0] > raw[1:] / raw[0] + 1e-6).all()
    np.testing.assert_allclose(soft_decay(hidden, mask, -1e-9).numpy(), hidden.numpy(), atol=2e-5 * hidden.abs().max())


@pytest.fixture(scope="module")
def minilm(minilm_path, tmp_path_factory):
    """(sentences file, the 32 sentences, text -> hidden states [layers, seq, hidden] float64 of that sentence
    alone) for the packaged MiniLM."""
    sentences = [s for s in corpus_sentences(600, start=5000) if 6 <= len(s.split()) <= 30][:32]
    path = tmp_path_factory.mktemp("softdecay") / "sentences.txt"
    path.write_text("\n".join(sentences) + "\n", encoding="utf-8")
    tokenizer, model = AutoTokenizer.from_pretrained(minilm_path), AutoModel.from_pretrained(minilm_path).eval()
    cache = {}

    def encode(text: str) -> torch.Tensor:
        if text not in cache:
            inputs = tokenizer(text, return_tensors="pt", truncation=True, max_length=MAX_LENGTH)
            with torch.no_grad():
                cache[text] = torch.stack(model(**inputs, output_hidden_states=True).hidden_states)[:, 0].double()
        return cache[text]

    return path, sentences, encode


def decayed(encode, text: str, alpha: float = ALPHA) -> torch.Tensor:
    """SoftDecay of one sentence alone, every layer: [layers, tokens, hidden]."""
    return torch.stack([torch.from_numpy(direct_soft_decay(layer.numpy(), alpha)) for layer in encode(text)])


@pytest.mark.slow
def test_every_protocol_takes_its_vectors_from_each_sentences_transformed_matrix(minilm, tmp_path):
    """`all --normalize softdecay`: anisotropy (random tokens of H'), isotropy (IsoScore of all tokens of H', the
    per-sequence spectrum of H', lower top-1 energy than raw) and STS (mean-pooled H') equal a direct computation."""
    path, sentences, encode = minilm
    sts = tmp_path / "sts.tsv"
    sts.write_text("sentence1\tsentence2\tscore\n" + "".join(f"{a}\t{b}\t{s}\n" for a, b, s in STS), encoding="utf-8")
    assert analyze.main(["all", "--no_progress", "--max_length", str(MAX_LENGTH), "--data", str(path),
                         "--max_sentences", "0", "--pool_sentences", "0", "--num_words", "3", "--min_sentences", "3",
                         "--num_pairs", "16", "--minibatch", "8", "--clip", "none", "--normalize", "softdecay",
                         "--sts", str(sts), "--output_dir", str(tmp_path / "all")]) == 0
    reports = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "all").glob("*.json")}
    anisotropy, isotropy = reports["anisotropy"], reports["isotropy"]
    assert anisotropy["variants"] == ["raw", "softdecay"] and anisotropy["softdecay_alpha"] == ALPHA
    assert anisotropy["normalize"] == "softdecay" and anisotropy["normalize_fit"] is None
    assert "softdecay (tokenUni's SoftDecay, alpha -0.2" in (tmp_path / "all" / "summary.md").read_text()
    raw_sample = random_token_vectors(lambda text: (encode(text), None), sentences, 0)  # one seeded token each
    decayed_sample = random_token_vectors(lambda text: (decayed(encode, text), None), sentences, 0)
    expected = direct_anisotropy(raw_sample, 0, {"raw": lambda x: x})["raw"]
    np.testing.assert_allclose(values(anisotropy, "raw"), expected.numpy(), atol=2e-5)
    expected = direct_anisotropy(decayed_sample, 0, {"softdecay": lambda x: x})["softdecay"]
    np.testing.assert_allclose(values(anisotropy, "softdecay"), expected.numpy(), atol=1e-4)
    assert not np.allclose(values(anisotropy, "softdecay"), values(anisotropy, "raw"), atol=1e-3)
    everything = torch.cat([decayed(encode, text) for text in sentences], dim=1)  # [layers, all tokens, hidden]
    for layer, row in enumerate(isotropy["layers"]):
        assert row["softdecay"]["isoscore"] == pytest.approx(isoscore_reference(everything[layer].numpy()), abs=1e-4)
        spectra = [torch.linalg.svdvals(decayed(encode, text)[layer]) for text in sentences]
        energy = np.mean([(v[0] ** 2 / v.pow(2).sum()).item() for v in spectra])
        assert row["softdecay"]["sequence_energy_top1"] == pytest.approx(energy, abs=1e-4)
        pooled = torch.cat([v / v[0] for v in spectra])
        assert row["softdecay"]["sequence_cdf_auc"] == pytest.approx(1 - pooled.mean().item(), abs=1e-4)
        assert row["softdecay"]["sequence_energy_top1"] < row["raw"]["sequence_energy_top1"] - 0.01  # flatter
    gold = [score for _, _, score in STS]
    pooled = [(decayed(encode, a).mean(1), decayed(encode, b).mean(1)) for a, b, _ in STS]
    cosines = torch.stack([cos(u, v) for u, v in pooled])  # [pairs, layers]
    expected = [100 * spearmanr(cosines[:, layer], gold).statistic for layer in range(cosines.shape[1])]
    np.testing.assert_allclose(values(reports["sts_sts"], "softdecay"), expected, atol=1e-3)


@pytest.mark.slow
def test_alpha_towards_zero_reports_the_raw_values_beyond_rounding(minilm, tmp_path):
    path = minilm[0]
    report = run("isotropy", "--data", path, "--max_sentences", 0, "--clip", "none", "--normalize", "softdecay",
                 "--softdecay_alpha=-1e-9", "--minibatch", 8, "--output_dir", tmp_path / "i")
    for row in report["layers"]:
        for key, value in row["raw"].items():
            assert row["softdecay"][key] == pytest.approx(value, abs=2e-4), key
    for raw, decay in zip(report["sequence_spectra"]["raw"], report["sequence_spectra"]["softdecay"]):
        np.testing.assert_allclose(decay, raw, atol=1e-4)


def test_classifier_features_are_sentences_pooled_from_their_transformed_matrices(bert_tok, tmp_path):
    from datamodules.probing import ClassificationDataModule

    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    texts = corpus_sentences(40)
    rows = "".join(f'"{t.replace(chr(34), "")}",{i % 2}\n' for i, t in enumerate(texts))
    (tmp_path / "c.csv").write_text("text,label\n" + rows, encoding="utf-8")
    data = ClassificationDataModule(source=str(tmp_path / "c.csv"), encoder=str(encoder), random_baseline=False,
                                    normalize="softdecay", softdecay_alpha=-0.5, progress=False, max_length=24)
    data.setup("fit")
    layers = data.spec.layers
    assert data.spec.slots == [("encoder", layer) for layer in layers] + [("softdecay", layer) for layer in layers]
    tokenizer, model = AutoTokenizer.from_pretrained(encoder), AutoModel.from_pretrained(encoder).eval()
    store, seen = data.stores["train"], data.texts["train"]
    features = store.features()  # [slots, sentences, hidden]
    for index in (0, 5, len(seen) - 1):
        inputs = tokenizer(seen[index], return_tensors="pt", truncation=True, max_length=24)
        with torch.no_grad():
            hidden = torch.stack(model(**inputs, output_hidden_states=True).hidden_states)[:, 0].double()
        raw = hidden.mean(1)
        softened = torch.stack([torch.from_numpy(direct_soft_decay(h.numpy(), -0.5)).mean(0) for h in hidden])
        np.testing.assert_allclose(features[:len(layers), index].double().numpy(), raw.numpy(), atol=1e-5)
        np.testing.assert_allclose(features[len(layers):, index].double().numpy(), softened.numpy(), atol=1e-4)
        assert not torch.allclose(softened.float(), raw.float(), atol=1e-3)


@pytest.mark.parametrize("alpha", ["0", "0.3", "-1", "-2.5"])
def test_softdecay_alpha_outside_minus_one_to_zero_is_one_line_exit_2_and_writes_nothing(alpha, minilm_path,
                                                                                         sentences_file, tmp_path,
                                                                                         capsys):
    out = tmp_path / "out"
    assert analyze.main(["anisotropy", "--encoder", minilm_path, "--data", str(sentences_file), "--normalize",
                         "softdecay", "--softdecay_alpha", alpha, "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"analyze.py anisotropy: error: --softdecay_alpha must lie in (-1, 0) (SoftDecay needs alpha < 0, "
                   f"and alpha <= -1 takes the log of a non-positive number for small singular values), got "
                   f"{float(alpha)}"]
    assert not out.exists()


@pytest.mark.parametrize("option, value, message", [
    ("--data.softdecay_alpha", "0.0", "--data.softdecay_alpha must lie in (-1, 0) (SoftDecay needs alpha < 0"),
    ("--data.normalize", "whiten", "--data.normalize must be none or softdecay (the classifiers' per-sentence"),
])
def test_bad_softdecay_settings_of_the_classifiers_are_one_line_exit_2(option, value, message, tmp_path, capsys):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        probe.cli_main(["fit", "--config", str(ROOT / "configs" / "probe" / "classify.yaml"), "--data.source",
                        str(ROOT / "core" / "corpus" / "austen.txt"),
                        "--data.normalize", "softdecay", option, value, "--trainer.default_root_dir", str(out)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("probe.py: error: ") and message in err[0]
    assert not out.exists()


# ---- SoftDecay as a layer inside fine-tuning (lightning_modules/softdecay.py) ----------------------------------------

@pytest.mark.parametrize("mode", ["fixed", "learned", "bounded"])
def test_the_fine_tuning_layer_equals_the_post_hoc_transformation_and_a_direct_svd(mode):
    """The layer on a padded batch [batch, seq, hidden]: each sentence's counted rows equal the post-hoc SoftDecay
    (metrics.transforms.soft_decay on the padded batch) and the numpy formula on that sentence alone, at the same
    alpha; padding stays; a learned alpha (tokenUni's unconstrained one, or our bounded one) starts at the given one
    and gets a finite gradient."""
    from lightning_modules.softdecay import SoftDecayLayer

    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(4, 30, 16, generator=generator) + torch.randn(16, generator=generator) * 3
    lengths = [30, 12, 5, 1]
    mask = torch.arange(30)[None, :] < torch.tensor(lengths)[:, None]
    layer = SoftDecayLayer(-0.3, mode=mode)
    assert layer.value() == pytest.approx(-0.3, abs=1e-7)
    out = layer(hidden, mask)
    post_hoc = soft_decay(hidden, mask, layer.value())
    for row, n in enumerate(lengths):
        expected = direct_soft_decay(hidden[row, :n].double().numpy(), layer.value())
        np.testing.assert_allclose(out[row, :n].detach().double().numpy(), expected, atol=2e-4, rtol=1e-5)
        torch.testing.assert_close(out[row, :n], post_hoc[row, :n], atol=1e-4, rtol=1e-5)
        assert torch.equal(out[row, n:], hidden[row, n:])
    parameters = list(layer.parameters())
    if mode == "fixed":
        assert parameters == []
    else:
        weights = torch.randn(16, generator=generator)
        (out[mask] @ weights).pow(2).sum().backward()  # a loss on the transformed tokens
        (parameter,) = parameters
        assert parameter.grad is not None and torch.isfinite(parameter.grad) and parameter.grad != 0
        parameter.grad = None  # the gradient equals a central finite difference of the same loss (float64 states)

        def loss(shift: float = 0.0) -> torch.Tensor:
            with torch.no_grad():
                parameter.add_(shift)
            try:
                return (layer(hidden.double(), mask)[mask] @ weights.double()).pow(2).sum()
            finally:
                with torch.no_grad():
                    parameter.sub_(shift)

        loss().backward()
        with torch.no_grad():
            numeric = (loss(1e-4) - loss(-1e-4)).item() / 2e-4
        assert parameter.grad.item() == pytest.approx(numeric, rel=2e-3)
        if mode == "learned":  # tokenUni's: alpha is the parameter itself, nothing keeps it in (-1, 0)
            assert layer.alpha is layer.alpha_parameter


def tokenuni_soft_decay(matrix: np.ndarray, alpha: float) -> np.ndarray:
    """tokenUni's map as their soft_expand.py writes it (with its eps in the log), on one sentence [tokens, hidden]."""
    u, s, vt = np.linalg.svd(matrix, full_matrices=False)
    mapped = -np.log(1 - alpha * (s + alpha) + 1e-7) / alpha
    return (u * (mapped / (mapped.max() / s.max()))) @ vt


@pytest.mark.parametrize("kind", ["bert", "distilbert"])
def test_tokenunis_placement_equals_a_hand_computation_of_their_layer(kind, bert_tok, tmp_path):
    """The default placement, by hand (dropout off): in the last layer, z = FFN output + residual x, each sentence's
    unpadded rows of z through their SoftDecay formula (numpy, float64), then the layer's LayerNorm of that plus x
    again (their modeling_bert.py, apply_exrank add_last_beforeln); layers 0..L-1 unchanged, and the hooks gone the
    model is its own again."""
    from lightning_modules.softdecay import SoftDecayLayer, wrap

    model = AutoModel.from_pretrained(save_tiny_encoder(tmp_path / kind, kind, bert_tok)).eval()
    batch = bert_tok(corpus_sentences(5, start=700), padding=True, truncation=True, max_length=24,
                     return_tensors="pt")
    batch.pop("token_type_ids") if kind == "distilbert" else None
    last = model.encoder.layer[-1] if kind == "bert" else model.transformer.layer[-1]
    seen = {}

    def bert_block(module, args, output):  # BertOutput(intermediate, input_tensor)
        seen["x"], seen["z"] = args[1], module.dense(args[0]) + args[1]

    def distilbert_block(module, args, output):  # ffn(x), summed with x before output_layer_norm
        seen["x"], seen["z"] = args[0], output + args[0]

    block, norm = (last.output, last.output.LayerNorm) if kind == "bert" else (last.ffn, last.output_layer_norm)
    handle = block.register_forward_hook(bert_block if kind == "bert" else distilbert_block)
    with torch.no_grad():
        plain = model(**batch, output_hidden_states=True).hidden_states
    handle.remove()
    alpha, mask = -0.35, batch["attention_mask"].bool()
    decayed = seen["z"].double().clone()
    for row, n in enumerate(mask.sum(1).tolist()):
        decayed[row, :n] = torch.from_numpy(tokenuni_soft_decay(decayed[row, :n].numpy(), alpha))
    expected = torch.nn.functional.layer_norm(decayed + seen["x"].double(), norm.normalized_shape,
                                              norm.weight.double(), norm.bias.double(), norm.eps)
    layer = SoftDecayLayer(alpha).eval()  # tokenUni's: before the LayerNorm, learnable alpha, dropout (off in eval)
    handles = wrap(model, layer, "tiny")
    layer.mask = batch["attention_mask"]
    wrapped = model(**batch, output_hidden_states=True).hidden_states
    torch.testing.assert_close(wrapped[-1][mask].double(), expected[mask], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(wrapped[-1][mask], plain[-1][mask], atol=1e-2)
    for before, after in zip(plain[:-1], wrapped[:-1], strict=True):
        assert torch.equal(before, after)
    # alpha learns through the hooks: its gradient equals a central finite difference of the same loss
    model.double()
    layer.double()
    weights = torch.randn(wrapped[-1].shape[-1], generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def loss() -> torch.Tensor:
        return (model(**batch).last_hidden_state[mask] @ weights).pow(2).sum()

    def shifted(shift: float) -> float:
        with torch.no_grad():
            layer.alpha_parameter.add_(shift)
            value = loss().item()
            layer.alpha_parameter.sub_(shift)
        return value

    loss().backward()
    numeric = (shifted(1e-2) - shifted(-1e-2)) / 2e-2  # a wide step: SoftDecay's SVD runs in float32
    assert layer.alpha_parameter.grad.item() == pytest.approx(numeric, rel=5e-3) and numeric != 0
    model.float()
    layer.float()
    for hook in handles:
        hook.remove()
    with torch.no_grad():
        assert torch.equal(model(**batch).last_hidden_state, plain[-1])
