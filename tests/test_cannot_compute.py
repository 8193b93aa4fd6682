"""A statistic that cannot be computed on the data given says so, once, in one warning line with what it needs:
IsoScore* with fewer sentences than its mini-batches need (one random token per sentence), anisotropy with fewer
sentences than its random token pairs need."""

from __future__ import annotations

import json

import pytest

import analyze
from tests.tiny import corpus_sentences, save_tiny_encoder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, bert_tok):
    root = tmp_path_factory.mktemp("cannot_compute")
    sentences = [s for s in corpus_sentences(200) if s.strip()][:30]
    (root / "s.txt").write_text("\n".join(sentences) + "\n", encoding="utf-8")
    return save_tiny_encoder(root / "bert", "bert", bert_tok), root / "s.txt", len(sentences)


def isotropy(tiny, tmp_path, capsys, *argv) -> tuple[dict, list[str]]:
    encoder, data, _ = tiny
    out = tmp_path / "out"
    assert analyze.main(["isotropy", "--encoder", str(encoder), "--data", str(data), "--max_sentences", "0",
                         "--max_length", "32", "--no_progress", "--clip", "none", "--output_dir", str(out),
                         *argv]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")
                and "were truncated" not in line]  # most of these sentences pass 32 tokens: said and tested elsewhere
    return json.loads((out / "isotropy.json").read_text()), warnings


def test_isoscore_star_with_too_few_sentences_says_what_it_needs_once(tiny, tmp_path, capsys):
    _, _, sentences = tiny  # 30 sentences, each with tokens: 30 random tokens, fewer than one mini-batch of 250
    report, warnings = isotropy(tiny, tmp_path, capsys)
    expected = (f"IsoScore* not computed ('-'): --minibatches 4 of --minibatch 250 tokens need 1000 sentences with a "
                f"token (one random token each), got {sentences}; lower --minibatch or give --data with more sentences "
                f"(all {sentences} of its sentences are read)")  # --max_sentences 0: the source is what limits it
    assert warnings == [f"warning: {expected}"]  # one line, once (not once per variant or layer)
    assert report["isoscore_star_warning"] == expected and report["num_minibatches"] == 0
    assert all(row["raw"]["isoscore_star"] is None for row in report["layers"])


def test_isoscore_star_over_fewer_mini_batches_than_asked_says_so(tiny, tmp_path, capsys):
    _, _, sentences = tiny
    report, warnings = isotropy(tiny, tmp_path, capsys, "--minibatch", "8")
    batches = sentences // 8  # 3 whole mini-batches of 8 of the 30 random tokens
    assert report["num_minibatches"] == batches < 4
    assert warnings == [f"warning: IsoScore* averaged over {batches} mini-batches, not 4: --minibatches 4 of "
                        f"--minibatch 8 tokens need 32 sentences with a token (one random token each), got {sentences}; "
                        f"lower --minibatch or give --data with more sentences (all {sentences} of its sentences are "
                        "read)"]
    assert all(row["raw"]["isoscore_star"] is not None for row in report["layers"])
    report, warnings = isotropy(tiny, tmp_path / "enough", capsys, "--minibatch", "7")  # 4 x 7 = 28 <= 30: all
    assert report["num_minibatches"] == 4 and "isoscore_star_warning" not in report and warnings == []


@pytest.mark.parametrize("argv, sampled, advice", [
    # 2 x --num_pairs = 10 of the 30 sentences: --num_pairs caps the sample, more sentences would not help
    (["--num_pairs", "5"], 10, "raise --num_pairs (the sample is one random token from each of 2 x --num_pairs = 10 "
                               "sentences)"),
    # --max_sentences 12 of the 30, under 2 x 1000: --max_sentences caps it
    (["--max_sentences", "12"], 12, "give more sentences (--max_sentences 12)"),
    # all 30 sentences = 2 x --num_pairs 15: both caps bind, raising one alone would not help
    (["--num_pairs", "15"], 30, "raise --num_pairs (the sample is one random token from each of 2 x --num_pairs = 30 "
                                "sentences) and give --data with more sentences (all 30 of its sentences are read)"),
])
def test_isoscore_star_advice_names_the_cap_that_limits_the_sample(tiny, tmp_path, capsys, argv, sampled, advice):
    """IsoScore*'s tokens are one random token from each of min(2 x --num_pairs, sentences read) sentences: the advice
    names whichever of --num_pairs, --max_sentences and the source's size is the smaller (it said --max_sentences even
    where --num_pairs held the sample down)."""
    report, warnings = isotropy(tiny, tmp_path, capsys, *argv)
    expected = (f"IsoScore* not computed ('-'): --minibatches 4 of --minibatch 250 tokens need 1000 sentences with a "
                f"token (one random token each), got {sampled}; lower --minibatch or {advice}")
    assert warnings == [f"warning: {expected}"] and report["isoscore_star_warning"] == expected


def test_anisotropy_from_fewer_pairs_than_asked_says_so_once(tiny, tmp_path, capsys):
    """A text shorter than the protocol's 2 x --num_pairs sentences gives floor(n / 2) pairs, each sentence's random
    token used once; the report and one warning line say so (it was silent: 15 pairs reported as the paper's 1000)."""
    encoder, data, sentences = tiny
    common = ["anisotropy", "--encoder", str(encoder), "--data", str(data), "--max_sentences", "0", "--max_length",
              "32", "--no_progress", "--clip", "none"]
    assert analyze.main([*common, "--output_dir", str(tmp_path / "a")]) == 0
    report = json.loads((tmp_path / "a" / "anisotropy.json").read_text())
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: anisotropy")]
    expected = (f"anisotropy from {sentences // 2} random token pairs, not --num_pairs 1000: one random token from "
                f"each of 2000 sentences needs 2000 sentences with a token, got {sentences}")
    assert report["num_pairs"] == sentences // 2 and report["anisotropy_warning"] == expected
    assert warnings == [f"warning: {expected}"]
    assert analyze.main([*common, "--num_pairs", str(sentences // 2), "--output_dir", str(tmp_path / "b")]) == 0
    report = json.loads((tmp_path / "b" / "anisotropy.json").read_text())
    assert report["num_pairs"] == sentences // 2 and "anisotropy_warning" not in report
    assert not [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: anisotropy")]
