"""Every evaluation subcommand end to end on the packaged MiniLM, against a direct transformers computation
(one sentence at a time, no padding, everything materialised), and `all` against the single subcommands."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr
from transformers import AutoModel, AutoTokenizer

import analyze
from analyses import session
from datamodules.text import sample_texts
from datamodules.words import word_contexts
from metrics.isotropy import isoscore_star
from tests.figure_data import panels, same, saved_figures
from tests.test_geometry import isoscore_reference, one_thread
from tests.tiny import corpus_sentences

MAX_LENGTH = 128
WIC = [  # word, sentence1, form in 1, sentence2, form in 2, same sense
    ("bank", "He sat on the bank of the river.", "bank", "She deposited money at the bank.", "bank", False),
    ("run", "They ran to the station.", "ran", "He runs every morning.", "runs", True),
    ("play", "The children play in the garden.", "play", "We saw a play at the theatre.", "play", False),
    ("letter", "She wrote a long letter to her sister.", "letter", "He received a letter from his father.", "letter",
     True),
    ("light", "Turn on the light, please.", "light", "The box was light enough to carry.", "light", False),
    ("break", "We took a break after lunch.", "break", "They had a short break at noon.", "break", True),
    ("spring", "Flowers bloom in spring.", "spring", "The spring in the mattress broke.", "spring", False),
    ("cold", "It was a cold morning in winter.", "cold", "The night air was cold and damp.", "cold", True),
]
STS = [("A man is playing a guitar.", "A man plays the guitar.", 4.8),
       ("A woman is slicing an onion.", "A man is riding a horse.", 0.2),
       ("The cat sits on the mat.", "A cat is sitting on a mat.", 4.5),
       ("She walked to the shop.", "He drove to the market.", 1.6),
       ("The sun is shining.", "It is a sunny day.", 3.9),
       ("Two dogs run in a field.", "The dogs are running through grass.", 4.0),
       ("A child reads a book.", "The stock market fell today.", 0.0),
       ("He is cooking dinner.", "A man prepares a meal.", 3.9)]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eval_data")
    sentences = [s for s in corpus_sentences(600, start=5000) if 6 <= len(s.split()) <= 30][:40]
    (root / "sentences.txt").write_text("\n".join(sentences) + "\n", encoding="utf-8")
    rows = []
    for word, s1, f1, s2, f2, label in WIC:
        a, b = s1.index(f1), s2.index(f2)
        rows.append({"word": word, "sentence1": s1, "sentence2": s2, "start1": a, "end1": a + len(f1),
                     "start2": b, "end2": b + len(f2), "label": label})
    rows.append({**rows[3], "start1": rows[3]["start1"] + 1})  # offsets one character off: skipped and counted
    (root / "wic.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    (root / "sts.tsv").write_text("sentence1\tsentence2\tscore\n" + "".join(f"{a}\t{b}\t{s}\n" for a, b, s in STS),
                                  encoding="utf-8")
    generator = torch.Generator().manual_seed(0)
    words = sorted({w.strip(".,").lower() for a, b, _ in STS for w in (a + " " + b).split()} - {"guitar", "onion"})
    (root / "glove.txt").write_text("".join(f"{w} " + " ".join(f"{v:.5f}" for v in torch.randn(5, generator=generator)
                                                               .tolist()) + "\n" for w in words), encoding="utf-8")
    return {"root": root, "sentences": root / "sentences.txt", "wic": root / "wic.jsonl", "sts": root / "sts.tsv",
            "glove": root / "glove.txt", "sentence_list": sentences}


@pytest.fixture(scope="module")
def direct(minilm_path):
    """text -> (hidden states [layers, seq, hidden] float64 of that sentence alone, token character offsets)."""
    tokenizer, model = AutoTokenizer.from_pretrained(minilm_path), AutoModel.from_pretrained(minilm_path).eval()
    cache = {}

    def encode(text: str):
        if text not in cache:
            inputs = tokenizer(text, return_offsets_mapping=True, return_tensors="pt", truncation=True,
                               max_length=MAX_LENGTH)
            offsets = [tuple(o) for o in inputs.pop("offset_mapping")[0].tolist()]
            with torch.no_grad():
                hidden = torch.stack(model(**inputs, output_hidden_states=True).hidden_states)[:, 0]
            cache[text] = (hidden.double(), offsets)
        return cache[text]

    return encode


def span_vector(encode, text: str, span: tuple[int, int]) -> torch.Tensor:
    hidden, offsets = encode(text)
    tokens = [j for j, (a, b) in enumerate(offsets) if b > a and a < span[1] and b > span[0]]
    return hidden[:, tokens].mean(1)  # [layers, hidden]


def cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a, b, dim=-1)


def run(command: str, *argv) -> dict:
    out = Path(argv[argv.index("--output_dir") + 1])
    assert analyze.main([command, "--no_progress", "--max_length", str(MAX_LENGTH), *map(str, argv)]) == 0
    name = {"self-similarity": "self_similarity"}.get(command, command)
    return json.loads((out / f"{name}.json").read_text())


def random_token_vectors(encode, texts: list[str], seed: int) -> torch.Tensor:
    """One token per sentence, drawn by random.Random(seed * 1000003 + index), as the protocol says: [n, layers, h]."""
    vectors = []
    for index, text in enumerate(texts):
        hidden, _ = encode(text)
        vectors.append(hidden[:, random.Random(seed * 1_000_003 + index).randrange(hidden.shape[1])])
    return torch.stack(vectors)


def direct_anisotropy(vectors: torch.Tensor, seed: int, transforms: dict) -> dict[str, torch.Tensor]:
    """Pair the sampled tokens [n, layers, hidden] by random.Random(seed).shuffle: {variant: mean cosine [layers]}."""
    slots = list(range(len(vectors)))
    random.Random(seed).shuffle(slots)
    half = len(slots) // 2
    a, b = vectors[slots[:half]].transpose(0, 1), vectors[slots[half:2 * half]].transpose(0, 1)  # [layers, n, h]
    return {key: cos(transform(a), transform(b)).mean(1) for key, transform in transforms.items()}


def clipping(dims: list[int]):
    """--clip auto / given dims: zeroed in every non-input layer (x is [layers, ..., hidden]); layer 0 untouched."""
    def clip(x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x[1:, ..., dims] = 0
        return x
    return clip


def fitted(vectors: torch.Tensor, how: str):
    """The normalisation `how` estimated on materialised vectors [layers, N, hidden] in float64, as docs/analyses.md states
    it: standardize (x - mu) / sigma, a dimension with sigma <= 1e-6 x max(|mu|, 1) (constant up to float32 rounding)
    mapped to 0; whiten (x - mu) U Lambda^-1/2 (`whitening_matrix`). Returns x [layers, ..., hidden] -> transformed."""
    layers, _, hidden = vectors.shape
    mean = vectors.mean(1)
    cov = torch.stack([torch.cov(layer.T, correction=0) for layer in vectors])
    if how == "standardize":
        variance = cov.diagonal(dim1=1, dim2=2)
        keep = variance.sqrt() > 1e-6 * mean.abs().clamp_min(1)
        matrix = torch.diag_embed(torch.where(keep, variance.clamp_min(1e-300).rsqrt(), 0.0))
    else:
        matrix = torch.stack([whitening_matrix(c, m) for c, m in zip(cov, mean)])

    def transform(x: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x.reshape(layers, -1, hidden) - mean.unsqueeze(1), matrix).reshape(x.shape)
    return transform


def whitening_matrix(cov: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """Su et al.'s U Lambda^-1/2 of one layer's float64 covariance [hidden, hidden], as docs/analyses.md states it: a
    dimension with sigma <= 1e-6 x max(|mu|, 1) left out (its row 0), then the principal directions v of the others
    with variance <= 1e-5 x v^T diag(C) v mapped to 0 (zero columns)."""
    variance = cov.diagonal()
    dims = (variance.sqrt() > 1e-6 * mean.abs().clamp_min(1)).nonzero().flatten()
    eigenvalues, rotation = one_thread(torch.linalg.eigh, cov[dims][:, dims])
    keep = eigenvalues > 1e-5 * (rotation.pow(2) * variance[dims].unsqueeze(1)).sum(0)
    matrix = torch.zeros_like(cov)
    matrix[dims.unsqueeze(1), torch.arange(int(keep.sum()))] = rotation[:, keep] * eigenvalues[keep].rsqrt()
    return matrix


def token_matrix(encode, texts: list[str]) -> torch.Tensor:
    """Every token of `texts` (special tokens included): [layers, N, hidden]."""
    return torch.cat([encode(text)[0] for text in texts], dim=1)


def pooled_matrix(encode, texts: list[str]) -> torch.Tensor:
    """The mean-pooled embedding of each distinct text: [layers, texts, hidden]."""
    return torch.stack([encode(text)[0].mean(1) for text in dict.fromkeys(texts)], dim=1)


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


def values(report: dict, key: str, *path: str) -> list:
    out = []
    for row in report["layers"]:
        value = row[key]
        for step in path:
            value = value[step]
        out.append(value)
    return out


def check_layer_lines(panel: dict, report: dict, *path: str) -> None:
    """A per-layer panel of a report's figure draws one line per variant of the report, its value in each layer (none
    where the report has no value in any layer: IsoScore* of too few sentences, whose panel says so instead)."""
    if all(value is None for key in report["variants"] for value in values(report, key, *path)):
        assert panel["lines"] == {}, panel["title"]
        return
    assert sorted(panel["lines"]) == sorted(report["variants"]), panel["title"]
    for key in report["variants"]:
        same(panel["lines"][key], [row["layer"] for row in report["layers"]], values(report, key, *path))


FIGURE_PANELS = {"anisotropy": [()], "isotropy": [("isoscore",), ("isoscore_star",), ("sequence_energy_top1",)],
                 "self_similarity": [("self_similarity",), ("adjusted",), ("intra_sentence",),
                                     ("intra_sentence_adjusted",)], "wic": [("accuracy",)], "sts": [()]}


def check_report_figures(saved: dict, name: str, report: dict) -> None:
    """The figures of one evaluation report draw its values: each panel its per-layer lines (the paper's Figure 6 for
    this subcommand), WiC's and STS's baseline as a dashed line, and isotropy's spectra of each layer."""
    kind = "sts" if name.startswith("sts") else name
    drawn = panels(saved[f"{name}.png"])
    assert len(drawn) == len(FIGURE_PANELS[kind]), name
    for panel, path in zip(drawn, FIGURE_PANELS[kind]):
        check_layer_lines(panel, report, *path)
    if kind in ("wic", "sts"):
        baseline, label = ((report["baseline"], "all true") if kind == "wic" else
                           (report["static_baseline"]["spearman"], "static vectors"))
        ((drawn_label, _, level),) = drawn[0]["dashed"]
        assert drawn_label.startswith(label) and level.tolist() == pytest.approx([baseline] * 2), name
    if kind == "isotropy":
        for figure, key in (("spectrum.png", "corpus_spectra"), ("sequence_spectrum.png", "sequence_spectra")):
            spectra, drawn = report[key], panels(saved[figure])
            assert [panel["title"] for panel in drawn] == list(spectra)  # one panel per variant
            for panel, per_layer in zip(drawn, spectra.values()):
                assert list(panel["lines"]) == [f"layer {layer}" for layer in range(len(per_layer))]
                for layer, sigma in enumerate(per_layer):  # normalised singular values, zeroed ones at the floor
                    same(panel["lines"][f"layer {layer}"], range(1, len(sigma) + 1), [max(v, 1e-4) for v in sigma])


TABLE_COLUMNS = {"anisotropy": [("", ())], "self_similarity": [("self-sim", ("self_similarity",)),
                                                                 ("adjusted", ("adjusted",)),
                                                                 ("intra-sent", ("intra_sentence",)),
                                                                 ("intra adj", ("intra_sentence_adjusted",))],
                 "isotropy": [("IsoScore", ("isoscore",)), ("IsoScore*", ("isoscore_star",)),
                              ("top-1 energy", ("corpus_energy_top1",)), ("seq top-1", ("sequence_energy_top1",))],
                 "wic": [("accuracy", ("accuracy",))], "sts": [("Spearman", ())]}


def check_printed_table(printed: str, name: str, report: dict) -> None:
    """The terminal table a subcommand prints: a row per layer, a column per measure and variant, each value of the
    report to 3 decimals (STS's Spearman x 100 to 2), '-' where it has none."""
    kind = "sts" if name.startswith("sts") else name
    lines = printed.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{name.replace('_', ' ')} of "))
    columns = [(f"{label} {key}".strip(), key, path) for label, path in TABLE_COLUMNS[kind] for key in report["variants"]]
    assert lines[start + 1].split() == " ".join(["layer", *(header for header, _, _ in columns)]).split()
    digits = 2 if kind == "sts" else 3
    for line, row in zip(lines[start + 2:], report["layers"], strict=False):
        shown = [str(row["layer"])]
        for _, key, path in columns:
            value = values({"layers": [row]}, key, *path)[0]
            shown.append("-" if value is None else f"{value:.{digits}f}")
        assert line.split() == shown, (name, line)
    assert len(lines) >= start + 2 + len(report["layers"])


def check_summary_figure(saved: dict, summary: dict) -> None:
    """summary.png: a panel per measure of summary.json's figure6_layers, a line per variant."""
    rows = summary["figure6_layers"]
    measures = [measure for measure in rows[0] if measure != "layer"]
    drawn = panels(saved["summary.png"])
    assert len(drawn) == len(measures) == 6  # anisotropy, self-similarity, adjusted, IsoScore, WiC, STS
    for panel, measure in zip(drawn, measures):
        assert sorted(panel["lines"]) == sorted(summary["variants"]), measure
        for key in summary["variants"]:
            same(panel["lines"][key], [row["layer"] for row in rows], [row[measure][key] for row in rows])


@pytest.mark.slow
def test_anisotropy_and_clip_auto_match_the_outlier_report_and_a_direct_computation(data, direct, tmp_path,
                                                                                   monkeypatch, capsys):
    saved = saved_figures(monkeypatch, session)
    args = ["--data", data["sentences"], "--max_sentences", 0, "--batch_size", 7, "--seed", 3]
    report = run("anisotropy", *args, "--normalize", "whiten", "--output_dir", tmp_path / "a")
    outliers = run("outliers", *args, "--output_dir", tmp_path / "o")
    detected = sorted(outliers["persistent_dims"])  # --clip auto: the persistent dims, in every non-input layer
    assert report["clip"] == "auto" and report["clipped_dims"] == detected and detected
    assert report["clipped_dims_per_layer"] == {str(layer): detected for layer in range(1, 7)}
    union = sorted({d for layer in outliers["layers"] for d in layer["outlier_dims"]})
    assert set(detected) < set(union)  # not every layer's outliers: only the persistent ones
    assert report["num_sentences"] == 40 and report["num_pairs"] == 20 and report["num_truncated"] == 0
    assert report["normalize_fit"] == "tokens" and report["variants"] == ["raw", "clipped", "whitened"]
    whiten = fitted(token_matrix(direct, data["sentence_list"]), "whiten")  # all tokens of all 40 sentences
    expected = direct_anisotropy(random_token_vectors(direct, data["sentence_list"], 3), 3,
                                 {"raw": identity, "clipped": clipping(detected), "whitened": whiten})
    for key, atol in (("raw", 2e-5), ("clipped", 2e-5), ("whitened", 1e-3)):
        np.testing.assert_allclose(values(report, key), expected[key].numpy(), atol=atol, err_msg=key)
    assert (tmp_path / "a" / "anisotropy.png").read_bytes()[:4] == b"\x89PNG"
    check_report_figures(saved, "anisotropy", report)
    check_printed_table(capsys.readouterr().out, "anisotropy", report)


@pytest.mark.slow
def test_anisotropy_subsamples_2x_num_pairs_sentences_and_standardizes_like_a_direct_computation(data, direct,
                                                                                               tmp_path):
    report = run("anisotropy", "--data", data["sentences"], "--max_sentences", 0, "--num_pairs", 7, "--seed", 5,
                 "--clip", "5,17", "--normalize", "standardize", "--output_dir", tmp_path / "a")
    assert report["num_sentences"] == 40 and report["num_pairs"] == 7
    texts = data["sentence_list"]
    chosen = sorted(random.Random(5).sample(range(40), 14))  # 2 x --num_pairs random sentences of the 40
    sample = random_token_vectors(direct, texts, 5)[chosen]  # one seeded random token of each
    standardize = fitted(token_matrix(direct, texts), "standardize")  # fit on every token of the 40, not the sample
    expected = direct_anisotropy(sample, 5, {"raw": identity, "clipped": clipping([5, 17]),
                                             "standardized": standardize})
    for key in ("raw", "clipped", "standardized"):
        np.testing.assert_allclose(values(report, key), expected[key].numpy(), atol=5e-5, err_msg=key)
    everything = direct_anisotropy(random_token_vectors(direct, texts, 5), 5, {"raw": identity})["raw"]
    assert not np.allclose(values(report, "raw"), everything.numpy(), atol=1e-3)  # the sample, not all 40


@pytest.mark.slow
def test_isotropy_matches_the_isoscore_algorithm_and_svd_on_materialised_tokens(data, direct, tmp_path, monkeypatch,
                                                                                capsys):
    saved = saved_figures(monkeypatch, session)
    report = run("isotropy", "--data", data["sentences"], "--max_sentences", 0, "--normalize", "whiten",
                 "--minibatch", 8, "--output_dir", tmp_path / "i")
    tokens = torch.cat([direct(text)[0] for text in data["sentence_list"]], dim=1)  # [layers, N, hidden]
    assert report["num_tokens"] == tokens.shape[1] and report["variants"] == ["raw", "clipped", "whitened"]
    dims = report["clipped_dims"]
    assert dims  # else "clipped" would equal "raw" and check nothing of the clipping
    sample = random_token_vectors(direct, data["sentence_list"], 0).transpose(0, 1)  # [layers, 40, hidden]
    order = torch.randperm(40, generator=torch.Generator().manual_seed(0))
    for layer, row in enumerate(report["layers"]):
        points = tokens[layer].numpy()
        assert row["raw"]["isoscore"] == pytest.approx(isoscore_reference(points), abs=1e-4)
        clipped = points.copy()
        if layer > 0:  # --clip auto leaves the embedding output as it is
            clipped[:, dims] = 0
        assert row["clipped"]["isoscore"] == pytest.approx(isoscore_reference(clipped), abs=1e-4)
        mean = points.mean(0)
        matrix = whitening_matrix(torch.from_numpy(np.cov(points.T, bias=True)), torch.from_numpy(mean)).numpy()
        whitened = (points - mean) @ matrix  # dropped directions: zero columns
        assert row["whitened"]["isoscore"] == pytest.approx(isoscore_reference(whitened), abs=1e-3)
        sigma = one_thread(torch.linalg.svdvals, tokens[layer])  # the corpus-wide token matrix
        np.testing.assert_allclose(report["corpus_spectra"]["raw"][layer][:20], (sigma / sigma[0])[:20].numpy(),
                                   atol=1e-5)
        assert row["raw"]["corpus_energy_top1"] == pytest.approx((sigma[0] ** 2 / sigma.pow(2).sum()).item(), abs=1e-5)
        # tokenUni's per-sequence spectrum: each sentence's own token matrix, alone (no padding), pooled
        for key, transform in (("raw", identity), ("clipped", clipping(dims))):
            per_sentence = [one_thread(torch.linalg.svdvals, transform(direct(text)[0])[layer])
                            for text in data["sentence_list"]]
            energy = np.mean([(v[0] ** 2 / v.pow(2).sum()).item() for v in per_sentence])
            assert row[key]["sequence_energy_top1"] == pytest.approx(energy, abs=1e-4)
            pooled = torch.cat([v / v[0] for v in per_sentence])
            assert row[key]["sequence_cdf_auc"] == pytest.approx(1 - pooled.mean().item(), abs=1e-4)
            for k in (0, 1, 5):
                mean_k = np.mean([(v[k] / v[0]).item() for v in per_sentence if len(v) > k])
                assert report["sequence_spectra"][key][layer][k] == pytest.approx(mean_k, abs=1e-4)
        full = torch.cov(tokens[layer].T, correction=0)
        star = torch.stack([isoscore_star(sample[layer, order[i:i + 8]], 0.2, full) for i in range(0, 32, 8)])
        assert row["raw"]["isoscore_star"] == pytest.approx(star.mean().item(), abs=1e-4)
    assert sorted(saved) == ["isotropy.png", "sequence_spectrum.png", "spectrum.png"]
    assert all((tmp_path / "i" / name).read_bytes()[:4] == b"\x89PNG" for name in saved)
    assert all(row["raw"]["isoscore_star"] is not None for row in report["layers"])  # its panel has lines here
    check_report_figures(saved, "isotropy", report)
    check_printed_table(capsys.readouterr().out, "isotropy", report)


@pytest.mark.slow
def test_self_similarity_matches_all_pairs_of_contexts(data, direct, tmp_path, capsys):
    """Self-similarity of every pair of a word's contexts, adjusted by the paper's anisotropy protocol on the same
    source: equal to `analyze.py anisotropy` run directly on 2 x --num_pairs random sentences of --data (raw and the
    same given clipping), and for the standardisation fitted on the self-similarity's tokens, to a direct
    computation on those sentences."""
    report = run("self-similarity", "--data", data["sentences"], "--max_sentences", 0, "--num_words", 6,
                 "--min_sentences", 3, "--clip", "5,17", "--normalize", "standardize", "--num_pairs", 8,
                 "--output_dir", tmp_path / "s")
    protocol = run("anisotropy", "--data", data["sentences"], "--max_sentences", 16, "--num_pairs", 8, "--clip", "5,17",
                   "--output_dir", tmp_path / "a")
    assert report["baseline_pairs"] == protocol["num_pairs"] == 8 and report["baseline_sentences"] == 16
    assert report["baseline_note"] is None and "the paper's §4.1 protocol" in report["adjusted_by"]
    for key in ("raw", "clipped"):
        np.testing.assert_allclose(values(report, key, "anisotropy"), values(protocol, key), atol=1e-6)
    assert report["clip"] == "5,17" and report["clipped_dims"] == [5, 17]
    assert report["clipped_dims_per_layer"] == {str(layer): [5, 17] for layer in range(1, 7)}
    contexts = word_contexts(data["sentence_list"], 6, 3, seed=0)
    assert report["words"] == contexts.words and report["num_words"] == 6
    per_word = {w: [] for w in range(6)}
    for text, spans in zip(contexts.sentences, contexts.spans):
        for word, start, end in spans:
            per_word[word].append(span_vector(direct, text, (start, end)))
    assert all(len(v) == 3 for v in per_word.values())
    transforms = {"raw": identity, "clipped": clipping([5, 17]),
                  "standardized": fitted(token_matrix(direct, contexts.sentences), "standardize")}
    sample = sample_texts(iter(data["sentence_list"]), 16, 0)  # the protocol's sentences: --seed's sample of --data
    baselines = direct_anisotropy(random_token_vectors(direct, sample, 0), 0, transforms)
    for key, transform in transforms.items():
        vectors = {w: [transform(v) for v in vs] for w, vs in per_word.items()}
        similarity = torch.stack([torch.stack([cos(v[i], v[j]) for i in range(3) for j in range(i + 1, 3)]).mean(0)
                                  for v in vectors.values()]).mean(0)
        baseline = baselines[key]
        np.testing.assert_allclose(values(report, key, "self_similarity"), similarity.numpy(), atol=2e-5)
        np.testing.assert_allclose(values(report, key, "anisotropy"), baseline.numpy(), atol=2e-5)
        np.testing.assert_allclose(values(report, key, "adjusted"), (similarity - baseline).numpy(), atol=4e-5)
        # Ethayarajh's intra-sentence similarity of the same sentences: every token's cosine with their mean
        intra = torch.stack([torch.stack([cos(word, words.mean(1)) for word in words.unbind(1)]).mean(0)
                             for words in (transform(direct(text)[0]) for text in contexts.sentences)]).mean(0)
        np.testing.assert_allclose(values(report, key, "intra_sentence"), intra.numpy(), atol=2e-5)
        np.testing.assert_allclose(values(report, key, "intra_sentence_adjusted"), (intra - baseline).numpy(),
                                   atol=4e-5)
    assert report["intra_sentence_sentences"] == len(contexts.sentences)
    check_printed_table(capsys.readouterr().out, "self_similarity", report)


def direct_wic(direct, transforms: dict) -> tuple[dict, torch.Tensor]:
    cosines = {key: [] for key in transforms}
    for _, s1, f1, s2, f2, _ in WIC:
        a = span_vector(direct, s1, (s1.index(f1), s1.index(f1) + len(f1)))
        b = span_vector(direct, s2, (s2.index(f2), s2.index(f2) + len(f2)))
        for key, transform in transforms.items():
            cosines[key].append(cos(transform(a), transform(b)))
    return {k: torch.stack(v) for k, v in cosines.items()}, torch.tensor([row[-1] for row in WIC])


@pytest.mark.slow
def test_wic_matches_a_threshold_loop_and_counts_the_misplaced_target(data, direct, tmp_path, capsys):
    report = run("wic", "--data", data["wic"], "--normalize", "standardize", "--output_dir", tmp_path / "w")
    assert report["num_pairs"] == 8 and report["num_scored"] == 8
    assert report["skipped"]["count"] == 1 and report["skipped"]["examples"][0]["index"] == 8
    assert "not one whole word" in report["skipped"]["examples"][0]["reason"]
    assert report["thresholds"] == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]  # the 0.1...0.9
    sentences = [s for _, s1, _, s2, _, _ in WIC for s in (s1, s2)]
    assert report["normalize_fit"] == "tokens" and report["clipped_dims"]  # some dims clipped: "clipped" differs
    cosines, labels = direct_wic(direct, {"raw": identity, "clipped": clipping(report["clipped_dims"]),
                                          "standardized": fitted(token_matrix(direct, list(dict.fromkeys(sentences))),
                                                                 "standardize")})
    assert report["baseline"] == pytest.approx(labels.double().mean().item())
    for key in ("raw", "clipped", "standardized"):
        best = (-1.0, None, None)
        for layer in range(cosines[key].shape[1]):
            accuracies = [((cosines[key][:, layer] >= t) == labels).double().mean().item() for t in report["thresholds"]]
            t = int(np.argmax(accuracies))
            assert report["layers"][layer][key] == {"accuracy": pytest.approx(accuracies[t]),
                                                    "threshold": report["thresholds"][t]}
            if layer >= 1 and accuracies[t] > best[0]:  # the best of layers 1..L; layer 0 is reported only
                best = (accuracies[t], layer, report["thresholds"][t])
        found = report["best" if key == "raw" else f"best_{key}"]
        assert (found["accuracy"], found["layer"], found["threshold"]) == (pytest.approx(best[0]), best[1], best[2])
    check_printed_table(capsys.readouterr().out, "wic", report)


def direct_sts(direct, transforms: dict) -> dict[str, torch.Tensor]:
    gold = [score for _, _, score in STS]
    out = {}
    for key, transform in transforms.items():
        cosines = []
        for a, b, _ in STS:
            u, v = direct(a)[0].mean(1), direct(b)[0].mean(1)  # [layers, hidden], no padding
            cosines.append(cos(transform(u), transform(v)))
        cosines = torch.stack(cosines)
        out[key] = torch.tensor([100 * spearmanr(cosines[:, layer], gold).statistic for layer in range(cosines.shape[1])])
    return out


def sentence_fit(direct, how: str):
    """--normalize on STS: fit on the mean-pooled embeddings of the pairs' distinct sentences (Su et al. 2021)."""
    return fitted(pooled_matrix(direct, [s for a, b, _ in STS for s in (a, b)]), how)


@pytest.mark.slow
def test_sts_matches_scipy_spearman_of_mean_pooled_cosines_and_the_static_baseline(data, direct, tmp_path, capsys):
    # Standardisation fit on the 16 pooled sentences (whitening them would map 16 points in 384 dimensions to a
    # simplex; test_analyze_eval_inputs checks sentence whitening on a tiny encoder with more sentences than dims).
    report = run("sts", "--data", data["sts"], "--static", data["glove"], "--batch_size", 3, "--normalize",
                 "standardize", "--output_dir", tmp_path / "t")
    assert report["normalize_fit"] == "sentences" and report["normalize_fit_count"] == 16
    assert report["variants"] == ["raw", "clipped", "standardized"] and report["clipped_dims"]
    expected = direct_sts(direct, {"raw": identity, "clipped": clipping(report["clipped_dims"]),
                                   "standardized": sentence_fit(direct, "standardize")})
    for key in ("raw", "clipped", "standardized"):
        np.testing.assert_allclose(values(report, key), expected[key].numpy(), atol=1e-3, err_msg=key)
        layer = 1 + int(expected[key][1:].argmax())  # the best of layers 1..L
        assert report["best" if key == "raw" else f"best_{key}"]["layer"] == layer
    vectors = {line.split()[0]: torch.tensor([float(v) for v in line.split()[1:]])
               for line in data["glove"].read_text().splitlines()}

    def bag(sentence):
        return torch.stack([vectors[w] for w in (t.strip(".,") for t in sentence.split()) if w in vectors]).mean(0)

    static = [cos(bag(a), bag(b)).item() for a, b, _ in STS]
    baseline = report["static_baseline"]
    assert baseline["spearman"] == pytest.approx(100 * spearmanr(static, [s for _, _, s in STS]).statistic, abs=1e-4)
    assert 0 < baseline["word_coverage"] < 1 and baseline["word_case"] == "as written (SentEval's lookup)"
    lowered = run("sts", "--data", data["sts"], "--static", data["glove"], "--static_lowercase", "--batch_size", 8,
                  "--output_dir", tmp_path / "lower")["static_baseline"]  # ours: "The" finds the file's "the"

    def lower_bag(sentence):
        return torch.stack([vectors[w] for w in (t.strip(".,").lower() for t in sentence.split()) if w in vectors]).mean(0)

    static = [cos(lower_bag(a), lower_bag(b)).item() for a, b, _ in STS]
    assert lowered["spearman"] == pytest.approx(100 * spearmanr(static, [s for _, _, s in STS]).statistic, abs=1e-4)
    assert lowered["word_case"] == "lowercased (--static_lowercase, ours)"
    assert lowered["word_coverage"] > baseline["word_coverage"]
    check_printed_table(capsys.readouterr().out, "sts", report)  # the first run's: the report above


@pytest.mark.slow
def test_all_writes_the_summary_and_equals_the_single_subcommands(data, direct, tmp_path, monkeypatch):
    saved = saved_figures(monkeypatch, session)
    common = ["--no_progress", "--max_length", str(MAX_LENGTH), "--data", str(data["sentences"]), "--max_sentences",
              "0", "--num_words", "6", "--min_sentences", "3"]
    assert analyze.main(["all", *common[:-4], "--pool_sentences", "0", *common[-4:], "--wic", str(data["wic"]),
                         "--sts", str(data["sts"]), "--static", str(data["glove"]), "--normalize", "standardize",
                         "--output_dir", str(tmp_path / "all")]) == 0
    out = tmp_path / "all"
    summary = json.loads((out / "summary.json").read_text())
    reports = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert sorted(saved) == sorted(p.name for p in out.glob("*.png"))  # every figure written, and read back here
    assert all((out / name).read_bytes()[:4] == b"\x89PNG" for name in saved)
    for name in ("anisotropy", "isotropy", "self_similarity", "wic", "sts_sts"):
        check_report_figures(saved, name, reports[name])
    check_summary_figure(saved, summary)
    detected = sorted(reports["outliers"]["persistent_dims"])
    assert summary["clipped_dims"] == detected == reports["wic"]["clipped_dims"]
    single = run("anisotropy", "--data", data["sentences"], "--max_sentences", 0, "--normalize", "standardize",
                 "--output_dir", tmp_path / "a")
    assert reports["anisotropy"]["layers"] == single["layers"]
    # STS standardises on its pairs' pooled sentences, the token-level evaluations on the tokens of --data.
    assert summary["normalize_fit"] == {"anisotropy": "tokens", "isotropy": "tokens", "self_similarity": "tokens",
                                        "wic": "tokens", "sts_sts": "sentences"}
    assert reports["sts_sts"]["normalize_fit"] == "sentences" and reports["wic"]["normalize_fit"] == "tokens"
    expected = direct_sts(direct, {"standardized": sentence_fit(direct, "standardize")})["standardized"]
    np.testing.assert_allclose(values(reports["sts_sts"], "standardized"), expected.numpy(), atol=1e-3)
    for layer, row in enumerate(summary["figure6_layers"]):
        assert row["anisotropy"] == {k: reports["anisotropy"]["layers"][layer][k]
                                     for k in ("raw", "clipped", "standardized")}
        assert row["isoscore"]["clipped"] == reports["isotropy"]["layers"][layer]["clipped"]["isoscore"]
        assert row["wic_accuracy"]["raw"] == reports["wic"]["layers"][layer]["raw"]["accuracy"]
        assert row["sts_sts_spearman"]["clipped"] == reports["sts_sts"]["layers"][layer]["clipped"]
    wic = reports["wic"]
    assert summary["table1_wic"]["raw"] == wic["best"] and summary["table1_wic"]["baseline"] == wic["baseline"]
    assert summary["table2_sts"][0]["clipped"] == reports["sts_sts"]["best_clipped"]
    markdown = (out / "summary.md").read_text()
    best = wic["best"]
    assert f"| raw | {best['accuracy']:.3f} | {best['layer']} | {best['threshold']} |" in markdown
    assert "## Figure 6" in markdown and f"| {len(summary['figure6_layers']) - 1} |" in markdown


@pytest.mark.slow
def test_all_without_pair_data_skips_wic_and_sts_with_a_note(data, tmp_path, capsys):
    assert analyze.main(["all", "--no_progress", "--data", str(data["sentences"]), "--max_sentences", "12",
                         "--pool_sentences", "0", "--num_words", "3", "--min_sentences", "3", "--clip", "none",
                         "--output_dir", str(tmp_path / "all")]) == 0
    printed = capsys.readouterr().out
    assert "note: WiC skipped: no --wic file given" in printed and "note: STS skipped" in printed
    summary = json.loads((tmp_path / "all" / "summary.json").read_text())
    assert summary["table1_wic"] is None and summary["table2_sts"] == [] and summary["variants"] == ["raw"]
    assert not (tmp_path / "all" / "wic.json").exists()


def test_a_source_too_short_for_the_anisotropy_protocol_says_so_in_the_report():
    """The self-similarity's baseline names its pairs and sentences, and when the source has fewer sentences than the
    protocol's 2 x --num_pairs, why it has fewer pairs."""
    from analyses.geometry import Baseline

    short = Baseline({"num_pairs": 20, "num_sentences": 41, "layers": []}, "anisotropy of 41 sentences", 1000)
    assert short.describe() == {"adjusted_by": "anisotropy of 41 sentences", "baseline_pairs": 20,
                                "baseline_sentences": 41, "baseline_note": "the source has 41 sentences with a token, "
                                "not the protocol's 2000: 20 pairs instead of 1000"}
    assert Baseline({"num_pairs": 1000, "num_sentences": 2000, "layers": []}, "x", 1000).describe()["baseline_note"] is None
