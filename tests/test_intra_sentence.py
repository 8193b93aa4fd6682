"""Ethayarajh's intra-sentence similarity (metrics/intra_sentence.py): planted sentences by hand, a tiny encoder's
padded batches against a float64 loop over sentences encoded alone, and `analyze.py self-similarity`'s report of it for
every variant against the same loop on raw, clipped and standardised vectors (its DDP check: test_geometry.py's
2-process test)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModel, AutoTokenizer

import analyze
from analyses import session
from datamodules.words import word_contexts
from lightning_modules.encoder import load_encoder
from metrics.intra_sentence import IntraSentenceSimilarity, sentence_tokens
from tests.figure_data import panels, same, saved_figures
from tests.tiny import corpus_sentences, save_tiny_encoder

PLANTED = 5


def plant(model) -> None:
    """A large constant on one dimension of every hidden state: every token leans one way, so the intra-sentence
    similarity is high until that dimension is clipped."""
    model.embeddings.LayerNorm.bias[PLANTED] = 8.0
    for block in model.encoder.layer:
        block.output.LayerNorm.bias[PLANTED] = 8.0


def direct_intra(per_sentence: list[torch.Tensor]) -> torch.Tensor:
    """The definition, a float64 loop: for each sentence's word vectors [layers, n, hidden], (1/n) sum_i cos(w_i,
    mean w), averaged over the sentences: [layers]."""
    values = []
    for words in per_sentence:
        words = words.double()
        mean = words.mean(1, keepdim=True)
        values.append(torch.stack([torch.nn.functional.cosine_similarity(words[:, i], mean[:, 0], dim=-1)
                                   for i in range(words.shape[1])]).mean(0))
    return torch.stack(values).mean(0)


def test_planted_sentences_by_hand():
    """All words of a sentence equal: 1; two orthogonal words of equal norm: each at 45 degrees to their mean, 1/sqrt 2;
    a padded position holding anything counts for nothing."""
    same_words = torch.tensor([[3.0, 4.0, 0.0]] * 3)  # [3 words, hidden 3]
    orthogonal = torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [1e6, -1e6, 7.0]])  # the third position is padding
    hidden = torch.stack([same_words, orthogonal]).unsqueeze(0)  # [layers 1, batch 2, seq 3, hidden 3]
    mask = torch.tensor([[True, True, True], [True, True, False]])
    metric = IntraSentenceSimilarity(1)
    metric.update(hidden, mask)
    result = metric.compute()
    assert result.mean.shape == (1,) and int(result.num_sentences) == 2
    assert result.mean.item() == pytest.approx((1 + 1 / math.sqrt(2)) / 2, abs=1e-7)
    for sentence, expected in ((0, 1.0), (1, 1 / math.sqrt(2))):
        alone = IntraSentenceSimilarity(1)
        alone.update(hidden[:, sentence:sentence + 1], mask[sentence:sentence + 1])
        assert alone.compute().mean.item() == pytest.approx(expected, abs=1e-7)
    empty = IntraSentenceSimilarity(1)  # a row with no counted token is no sentence
    empty.update(hidden[:, :1], torch.zeros(1, 3, dtype=torch.bool))
    assert int(empty.compute().num_sentences) == 0 and math.isnan(empty.compute().mean.item())


def test_padded_states_and_token_vectors_give_the_float64_loop():
    """Random sentences of uneven lengths padded with garbage: the padded form, the counted tokens with their rows
    (`sentence_tokens`, streamed in two updates of whole sentences) and the float64 loop over each sentence alone
    agree, and the garbage changes nothing."""
    generator = torch.Generator().manual_seed(4)
    layers, hidden, lengths = 3, 8, [5, 1, 7, 3, 2]
    sentences = [torch.randn(layers, n, hidden, generator=generator) + 0.5 for n in lengths]
    states = 1e4 * torch.randn(layers, len(lengths), max(lengths), hidden, generator=generator)  # padding: garbage
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.bool)
    for row, words in enumerate(sentences):
        states[:, row, :lengths[row]] = words
        mask[row, :lengths[row]] = True
    expected = direct_intra(sentences)
    padded = IntraSentenceSimilarity(layers)
    padded.update(states[:, :2], mask[:2])
    padded.update(states[:, 2:], mask[2:])
    tokens = IntraSentenceSimilarity(layers)
    vectors, rows = sentence_tokens(states, mask)
    assert vectors.shape[1] == sum(lengths) and rows.tolist() == [r for r, n in enumerate(lengths) for _ in range(n)]
    tokens.update(vectors, sentences=rows)
    for metric in (padded, tokens):
        result = metric.compute()
        assert int(result.num_sentences) == len(lengths)
        torch.testing.assert_close(result.mean, expected, rtol=0, atol=1e-6)


def test_a_tiny_encoders_batches_give_the_loop_over_sentences_encoded_alone(tmp_path, bert_tok):
    """The encoder's padded batches (any batch size) against each sentence encoded alone by transformers, float64:
    the words are the tokens the mask counts, [CLS] and [SEP] included, or not with --exclude_special."""
    path = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    texts = [text for text in corpus_sentences(40, start=300) if 3 <= len(text.split()) <= 14][:7]
    model, tokenizer = AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    alone = []
    with torch.no_grad():
        for text in texts:
            inputs = tokenizer(text, return_tensors="pt")
            alone.append(torch.stack(model(**inputs, output_hidden_states=True).hidden_states)[:, 0])
    for exclude in (False, True):
        encoder = load_encoder(path, device="cpu", exclude_special=exclude)
        expected = direct_intra([states[:, 1:-1] if exclude else states for states in alone])
        results = []
        for batch_size in (1, 3, 7):  # padded differently each time
            metric = IntraSentenceSimilarity(encoder.num_hidden_states)
            for batch in encoder.batches(texts, batch_size=batch_size, progress=False):
                metric.update(batch.hidden_states, batch.mask)
            results.append(metric.compute())
            torch.testing.assert_close(results[-1].mean, expected, rtol=0, atol=2e-6)
            assert int(results[-1].num_sentences) == len(texts)
        assert (results[0].mean - results[2].mean).abs().max() < 1e-6  # padding does not change it


def standardize(tokens: torch.Tensor):
    """--normalize standardize fit on token vectors [layers, N, hidden] in float64: (x - mu) / sigma, a dimension with
    sigma <= 1e-6 x max(|mu|, 1) mapped to 0 (docs/analyses.md)."""
    mean, sigma = tokens.mean(1, keepdim=True), tokens.std(1, correction=0, keepdim=True)
    scale = torch.where(sigma > 1e-6 * mean.abs().clamp_min(1), 1 / sigma.clamp_min(1e-300), 0.0)
    return lambda x: (x - mean) * scale


def test_the_self_similarity_report_has_it_for_every_variant_as_a_direct_computation(tmp_path, bert_tok, monkeypatch,
                                                                                      capsys):
    """`analyze.py self-similarity` reports the intra-sentence similarity of the sentences it encodes (the same pass)
    for raw, clipped and standardised vectors, equal to the float64 loop over those sentences encoded alone with the
    same transformation; clipping the planted dimension lowers it in every non-input layer, by what the loop on
    clipped vectors says; its adjusted value is it minus the same anisotropy as self-similarity's; the table and the
    figure show it."""
    saved = saved_figures(monkeypatch, session)
    encoder = save_tiny_encoder(tmp_path / "planted", "bert", bert_tok, plant=plant)
    texts = [text for text in corpus_sentences(300, start=200) if 4 <= len(text.split()) <= 14][:40]
    data, out = tmp_path / "sentences.txt", tmp_path / "out"
    data.write_text("\n".join(texts) + "\n", encoding="utf-8")
    assert analyze.main(["self-similarity", "--encoder", str(encoder), "--data", str(data), "--num_words", "4",
                         "--min_sentences", "3", "--clip", str(PLANTED), "--normalize", "standardize", "--num_pairs",
                         "8", "--batch_size", "5", "--no_progress", "--output_dir", str(out)]) == 0
    report = json.loads((out / "self_similarity.json").read_text())
    assert report["variants"] == ["raw", "clipped", "standardized"]
    contexts = word_contexts(texts, 4, 3, seed=0)  # the sentences the self-similarity pass encoded
    assert report["words"] == contexts.words
    assert report["intra_sentence_sentences"] == report["num_sentences"] == len(contexts.sentences)
    model, tokenizer = AutoModel.from_pretrained(encoder).eval(), AutoTokenizer.from_pretrained(encoder)
    with torch.no_grad():
        alone = [torch.stack(model(**tokenizer(text, return_tensors="pt"), output_hidden_states=True).hidden_states)
                 [:, 0].double() for text in contexts.sentences]

    def clip(x: torch.Tensor) -> torch.Tensor:  # --clip 5: zeroed in every non-input layer
        x = x.clone()
        x[1:, ..., PLANTED] = 0
        return x

    transforms = {"raw": lambda x: x, "clipped": clip, "standardized": standardize(torch.cat(alone, dim=1))}
    expected = {key: direct_intra([transform(states) for states in alone]) for key, transform in transforms.items()}
    rows = report["layers"]
    for key in transforms:
        got = torch.tensor([row[key]["intra_sentence"] for row in rows], dtype=torch.float64)
        torch.testing.assert_close(got, expected[key], rtol=0, atol=1e-5 if key != "standardized" else 1e-4)
        for row in rows:
            assert row[key]["intra_sentence_adjusted"] == pytest.approx(
                row[key]["intra_sentence"] - row[key]["anisotropy"], abs=2e-6)
    assert rows[0]["clipped"]["intra_sentence"] == rows[0]["raw"]["intra_sentence"]  # layer 0 is not clipped
    assert all(row["raw"]["intra_sentence"] - row["clipped"]["intra_sentence"] > 0.05 for row in rows[1:])
    printed = capsys.readouterr().out.splitlines()
    title = next(i for i, line in enumerate(printed) if line.startswith("self similarity of "))
    columns = [f"{label} {key}" for label in ("self-sim", "adjusted", "intra-sent", "intra adj")
               for key in report["variants"]]
    assert printed[title + 1].split() == " ".join(["layer", *columns]).split()
    for line, row in zip(printed[title + 2:title + 2 + len(rows)], rows, strict=True):
        assert line.split()[1 + 2 * 3:] == [f"{row[key][name]:.3f}" for name in ("intra_sentence",
                                            "intra_sentence_adjusted") for key in report["variants"]]
    drawn = panels(saved["self_similarity.png"])
    assert [panel["title"].split(":")[0] for panel in drawn][2:] == [
        "intra-sentence similarity (Ethayarajh)", "intra-sentence similarity - anisotropy"]
    for panel, name in zip(drawn[2:], ("intra_sentence", "intra_sentence_adjusted")):
        for key in report["variants"]:
            same(panel["lines"][key], [row["layer"] for row in rows], [row[key][name] for row in rows])


def test_softdecay_and_exclude_special_take_each_sentences_own_counted_tokens(tmp_path, bert_tok):
    """The per-sentence variant (SoftDecay of each sentence's token matrix) and --exclude_special: the report's
    intra-sentence similarity is the loop over the sentences encoded alone, [CLS] and [SEP] dropped, each sentence's
    matrix transformed on its own (soft_decay of one unpadded sentence)."""
    from metrics.transforms import SOFTDECAY_ALPHA, soft_decay

    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    texts = [text for text in corpus_sentences(300, start=200) if 4 <= len(text.split()) <= 14][:40]
    data, out = tmp_path / "sentences.txt", tmp_path / "out"
    data.write_text("\n".join(texts) + "\n", encoding="utf-8")
    assert analyze.main(["self-similarity", "--encoder", str(encoder), "--data", str(data), "--num_words", "3",
                         "--min_sentences", "3", "--clip", "none", "--normalize", "softdecay", "--exclude_special",
                         "--num_pairs", "8", "--batch_size", "6", "--no_progress", "--output_dir", str(out)]) == 0
    report = json.loads((out / "self_similarity.json").read_text())
    assert report["variants"] == ["raw", "softdecay"] and report["special_tokens"] == "excluded"
    contexts = word_contexts(texts, 3, 3, seed=0)
    model, tokenizer = AutoModel.from_pretrained(encoder).eval(), AutoTokenizer.from_pretrained(encoder)
    with torch.no_grad():
        alone = [torch.stack(model(**tokenizer(text, return_tensors="pt"), output_hidden_states=True).hidden_states)
                 [:, 0, 1:-1] for text in contexts.sentences]  # [CLS] and [SEP] dropped
    decayed = [soft_decay(states.unsqueeze(1), torch.ones(1, states.shape[1], dtype=torch.bool), SOFTDECAY_ALPHA)[:, 0]
               for states in alone]
    for key, sentences in (("raw", alone), ("softdecay", decayed)):
        got = torch.tensor([row[key]["intra_sentence"] for row in report["layers"]], dtype=torch.float64)
        torch.testing.assert_close(got, direct_intra(sentences), rtol=0, atol=2e-5)
    assert any(abs(row["raw"]["intra_sentence"] - row["softdecay"]["intra_sentence"]) > 1e-3 for row in report["layers"])
