"""Evaluation inputs: a planted outlier clipped away, the WiC/STS/word-context/static-vector readers, every bad input
(one line, exit 2, nothing written), and `all` under 2-process DDP equal to one process."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from scipy.stats import spearmanr
from transformers import AutoModel, AutoTokenizer

import analyze
from analyses import semantic
from core.errors import UserError
from datamodules.pairs import read_sts, read_wic, target_problem, wic_source
from datamodules.words import WORD, Cuts, read_static_vectors, source_contexts, truncated, word_contexts
from tests.test_analyze_eval import STS, WIC, fitted
from tests.tiny import corpus_sentences, free_port, reports_close, save_tiny_encoder

ROOT = Path(__file__).resolve().parent.parent
PLANTED = 5


def plant(model) -> None:
    """A large constant on one dimension of every hidden state (embedding and block LayerNorm biases)."""
    model.embeddings.LayerNorm.bias[PLANTED] = 8.0
    for block in model.encoder.layer:
        block.output.LayerNorm.bias[PLANTED] = 8.0


@pytest.fixture
def planted(tmp_path, bert_tok) -> Path:
    return save_tiny_encoder(tmp_path / "planted", "bert", bert_tok, plant=plant)


@pytest.fixture
def sentences(tmp_path) -> Path:
    path = tmp_path / "sentences.txt"
    path.write_text("\n".join(corpus_sentences(60, start=200)) + "\n", encoding="utf-8")
    return path


def write_wic(path: Path, rows: list[dict] | None = None) -> Path:
    if rows is None:
        rows = []
        for word, s1, f1, s2, f2, label in WIC:
            a, b = s1.index(f1), s2.index(f2)
            rows.append({"word": word, "sentence1": s1, "sentence2": s2, "start1": a, "end1": a + len(f1),
                         "start2": b, "end2": b + len(f2), "label": label})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def write_sts(path: Path, pairs=STS) -> Path:
    path.write_text("sentence1\tsentence2\tscore\n" + "".join(f"{a}\t{b}\t{s}\n" for a, b, s in pairs),
                    encoding="utf-8")
    return path


def test_clipping_a_planted_outlier_lowers_anisotropy(planted, sentences, tmp_path):
    out = tmp_path / "out"
    assert analyze.main(["anisotropy", "--no_progress", "--encoder", str(planted), "--data", str(sentences),
                         "--max_sentences", "0", "--output_dir", str(out)]) == 0
    report = json.loads((out / "anisotropy.json").read_text())
    assert PLANTED in report["clipped_dims"] and report["num_pairs"] == 30
    for layer in report["layers"]:
        assert layer["raw"] > 0.5  # every token shares the planted direction
        if layer["layer"] == 0:  # --clip auto zeroes the non-input layers only
            assert layer["clipped"] == layer["raw"] and "0" not in report["clipped_dims_per_layer"]
        else:
            assert layer["clipped"] < layer["raw"] - 0.15  # what stays: random deep layers make tokens alike
            assert PLANTED in report["clipped_dims_per_layer"][str(layer["layer"])]
    assert analyze.main(["anisotropy", "--no_progress", "--encoder", str(planted), "--data", str(sentences),
                         "--max_sentences", "0", "--num_pairs", "7", "--output_dir", str(tmp_path / "few")]) == 0
    few = json.loads((tmp_path / "few" / "anisotropy.json").read_text())
    assert few["num_pairs"] == 7 and few["num_sentences"] == 60 and few["clipped_dims"] == report["clipped_dims"]


def test_word_contexts_are_exact_and_share_sentences():
    sentences = corpus_sentences(1500, start=100)
    contexts = word_contexts(sentences, num_words=100, min_sentences=10, seed=1)
    counts = {word: sum(word in {m.group().lower() for m in WORD.finditer(s)} for s in sentences)
              for word in contexts.words}
    assert len(set(contexts.words)) == 100 and min(counts.values()) >= 10
    seen = {word: 0 for word in range(100)}
    for sentence, spans in zip(contexts.sentences, contexts.spans):
        for word, start, end in spans:
            assert sentence[start:end].lower() == contexts.words[word]
            assert not re.search(rf"\b{re.escape(contexts.words[word])}\b", sentence[:start], re.IGNORECASE)
            seen[word] += 1
    assert set(seen.values()) == {10}
    assert len(contexts.sentences) < 100 * 10 / 2  # contexts shared between words


def planted_pool(lines: int = 3000) -> tuple[list[str], dict[str, int]]:
    """Sentences of digits (no words) with planted words: word k occurs in exactly counts[k] sentences, spread
    over the whole source, twice in some (only the first counts); the qualifying set is known by construction."""
    rng = random.Random(7)
    letters = "abcdefghijklmnopqrstuvwxyz"
    counts = {f"{letters[k % 26]}{letters[k // 26]}q": k % 25 + 1 for k in range(300)}  # 1..25 sentences each
    counts["zzq"] = 400  # beyond the reservoir of 10 x min_sentences
    places: list[list[str]] = [[] for _ in range(lines)]
    for word, count in counts.items():
        for index in rng.sample(range(lines), count):
            places[index].append(word)
    sentences = []
    for index, words in enumerate(places):
        if index % 50 == 0 and words:
            words = [*words, words[0].upper()]  # a repeat in another case: still one sentence
        sentences.append(" ".join([f"{index}.", *words, "42"]))
    return sentences, counts


def test_word_pool_streams_the_whole_source_and_counts_the_qualifying_words(tmp_path):
    sentences, counts = planted_pool()
    qualifying = {word for word, count in counts.items() if count >= 10}
    path = tmp_path / "pool.txt"
    path.write_text("\n".join(sentences) + "\n", encoding="utf-8")
    streamed = source_contexts(str(path), None, 0, 40, 10, seed=3)  # --pool_sentences 0: the whole file, streamed
    assert streamed.num_candidates == len(qualifying) == 300 * 16 // 25 + 1 and streamed.pool == len(sentences)
    assert set(streamed.words) <= qualifying and len(set(streamed.words)) == 40
    seen = {word: 0 for word in range(40)}
    for sentence, spans in zip(streamed.sentences, streamed.spans):
        assert sentence in sentences
        for word, start, end in spans:
            assert sentence[start:end] == streamed.words[word]  # the first occurrence (lowercase, before the repeat)
            seen[word] += 1
    assert set(seen.values()) == {10}
    listed = word_contexts(sentences, 40, 10, seed=3)  # the same passes over a list
    assert (listed.words, listed.sentences, listed.spans) == (streamed.words, streamed.sentences, streamed.spans)
    frequent = source_contexts(str(path), None, 0, len(qualifying), 10, seed=3)  # every qualifying word, zzq too
    assert set(frequent.words) == qualifying
    sample = source_contexts(str(path), None, 600, 5, 3, seed=3)  # a pool of 600 sentences finds fewer words
    assert sample.pool == 600 and sample.num_candidates < sum(count >= 3 for count in counts.values())
    calls = []

    def changing():  # a source whose third pass differs from the first two
        calls.append(1)
        return iter(sentences if len(calls) < 3 else sentences[1:])

    with pytest.raises(UserError, match=r"^the self-similarity source changed while it was read \(its passes"):
        word_contexts(changing, 40, 10, seed=3)


def test_word_counting_over_a_streamed_source_shows_a_bar_over_each_pass_and_counts_as_without(tmp_path, capsys):
    """Self-similarity's words of a whole streamed source (--pool_sentences 0 / --max_sentences 0: each pass reads the
    file again) with `progress`: a tqdm bar on stderr over each pass, as the encoder's, those after the first over all
    the source's sentences; the candidates, words and contexts equal those drawn without a bar (nothing on stderr),
    and the candidates those of a count by hand (each distinct sentence once, each word once a sentence, before and
    after a cut at 16 characters)."""
    from datamodules.words import source_words

    planted, _ = planted_pool()
    sentences = planted + planted[:40]  # repeats: a pass more, to take their words out again
    path = tmp_path / "pool.txt"
    path.write_text("\n".join(sentences) + "\n", encoding="utf-8")

    def visible(chunk):
        return [min(len(text), 16) for text in chunk]  # truncation cuts the long sentences: a recount where read

    def by_hand(limit: int | None) -> list[str]:
        counts = Counter(word for sentence in dict.fromkeys(sentences) for word in {
            match.group().lower() for match in WORD.finditer(sentence) if limit is None or match.end() <= limit})
        return sorted(word for word, count in counts.items() if count >= 10)

    drawn = {}
    for progress in (False, True):
        words = source_words(str(path), None, 0, 40, 10, seed=3, progress=progress)
        contexts = words.contexts(visible, progress)
        drawn[progress] = (words.candidates, contexts.words, contexts.sentences, contexts.spans,
                           contexts.num_candidates)
        err = capsys.readouterr().err
        if not progress:
            assert err == ""
    assert drawn[True] == drawn[False]
    assert drawn[True][0] == by_hand(None) and drawn[True][4] == len(by_hand(16)) < len(by_hand(None))
    assert set(drawn[True][1]) <= set(by_hand(16))
    assert re.search(r"counting words: 0 ?sent ", err), err  # the first pass: the source's size not yet known
    for desc in ("counting repeated sentences", "sentences the encoder reads", "counting words read",
                 "drawing contexts", "reading the contexts drawn"):
        assert re.search(rf"{desc}: +0%\|[^|]*\| 0/{len(sentences)} ", err), (desc, err)


def test_a_repeated_sentence_is_one_context_of_its_words(tmp_path):
    """A corpus with a line repeated (boilerplate, a file concatenated twice) gave the words of that line as many
    contexts as copies: they qualified on one sentence, drew identical vectors, and their self-similarity was 1. Now a
    repeat counts once: "copied" occurs in 1 distinct sentence and never qualifies; "spread" (in 12 distinct ones,
    each also repeated) qualifies, and its 10 contexts are 10 different sentences, streamed or listed alike."""
    distinct = [f"spread {index} digits" for index in range(12)]
    sentences = ["copied line of words"] * 12 + distinct + distinct[:6]
    for pool in (sentences, lambda: iter(sentences)):
        contexts = word_contexts(pool, num_words=2, min_sentences=10, seed=0)
        assert sorted(contexts.words) == ["digits", "spread"] and contexts.num_candidates == 2
        assert contexts.duplicates == 11 + 6 and contexts.pool == len(sentences)
        assert len(contexts.sentences) == len(set(contexts.sentences)) == 10
    with pytest.raises(UserError, match=r"only 0 words occur in at least 10 of the 1 distinct sentences \(11 more repeat them\)"):
        word_contexts(["copied line of words"] * 12, num_words=1, min_sentences=10)


def test_a_typographic_apostrophe_is_inside_a_word_as_an_ascii_one_is():
    ascii_text, typographic = "It's Anna's book, don't you think? 'Quoted' ends.", "It’s Anna’s book, don’t you think? ‘Quoted’ ends."
    words = [m.group() for m in WORD.finditer(typographic)]
    assert words == [w.replace("'", "’") for w in (m.group() for m in WORD.finditer(ascii_text))]
    assert words == ["It’s", "Anna’s", "book", "don’t", "you", "think", "Quoted", "ends"]


def test_wic_reads_the_training_split_by_default(tmp_path):
    """The preset `wic` is SuperGLUE's training split (the paper's footnote 5), resolved without the hub; a local
    dataset with splits is read at its train split too, a file whole; the report names which."""
    assert wic_source("wic") == {"data": "super_glue:wic:train", "split": "train"}
    assert wic_source("super_glue:wic:validation")["split"] == "validation"
    rows = [json.loads(line) for line in write_wic(tmp_path / "wic.jsonl").read_text().splitlines()]
    datasets.DatasetDict({"validation": datasets.Dataset.from_list(rows[:2]),
                          "train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "splits"))
    assert wic_source(str(tmp_path / "splits")) == {"data": str(tmp_path / "splits"), "split": "train"}
    items, _ = read_wic(str(tmp_path / "splits"))
    assert [item.sentence1 for item in items] == [row["sentence1"] for row in rows]  # train's 8, not validation's 2
    assert wic_source(str(tmp_path / "wic.jsonl"))["split"] is None


def test_word_list_too_small_names_the_count_found(tmp_path):
    sentences = corpus_sentences(50, start=100)
    found = sum(1 for word in {m.group().lower() for s in sentences for m in WORD.finditer(s)}
                if sum(word in {m.group().lower() for m in WORD.finditer(s)} for s in sentences) >= 10)
    with pytest.raises(UserError, match=f"only {found} words occur in at least 10 of the 50 sentences; "
                                        "self-similarity needs 1000") as error:
        word_contexts(sentences, 1000, 10)
    # the ways out are the options that change the count: the sampling option only when it sampled fewer sentences
    # than the source holds (a 5-line file read whole is not helped by a larger --max_sentences)
    assert "--min_sentences" in str(error.value) and "--pool_sentences" not in str(error.value)
    path = tmp_path / "fifty.txt"
    path.write_text("\n".join(sentences) + "\n", encoding="utf-8")
    with pytest.raises(UserError, match="of the 20 sentences;.* or --max_sentences 0 to search all of it"):
        source_contexts(str(path), None, 20, 1000, 10, 0, "--max_sentences")
    with pytest.raises(UserError, match=r"of the 50 sentences;.*more sentences: a larger source\)$"):
        source_contexts(str(path), None, 2000, 1000, 10, 0, "--max_sentences")


def test_target_offsets_checks():
    sentence = "They went to the bank, and the banks were closed."
    assert target_problem(sentence, "bank", (17, 21)) is None
    assert target_problem(sentence, "go", (5, 9)) is None  # irregular form: no word starts with "go"
    assert "not one whole word" in target_problem(sentence, "bank", (18, 22))
    assert "outside the sentence" in target_problem(sentence, "bank", (40, 60))
    assert "hold 'closed', not 'bank'" in target_problem(sentence, "bank", (42, 48))


@pytest.mark.parametrize("lemma, sentence, form, distractor", [
    ("go", "They went home for a good meal.", "went", "good"),
    ("hold", "She held the door of the house open.", "held", "house"),
    ("find", "At first he found nothing at all.", "found", "first"),
    ("see", "We saw seven birds on the roof.", "saw", "seven"),
])
def test_irregular_forms_are_kept_beside_words_sharing_the_lemmas_first_letters(lemma, sentence, form, distractor):
    start = sentence.index(form)
    assert distractor.startswith(lemma[:2]) and not form.startswith(lemma[:2])  # the case the old rule got wrong
    assert target_problem(sentence, lemma, (start, start + len(form))) is None


@pytest.mark.parametrize("lemma, sentence, span_word, regular", [
    ("carry", "The porter carried the bags upstairs.", "porter", "carried"),  # y -> i
    ("stop", "The bus stopped near the old station.", "bus", "stopped"),  # doubled consonant
    ("make", "She was making tea for the guests.", "tea", "making"),  # final e dropped
    ("bank", "The banks were closed on Monday.", "closed", "banks"),  # lemma + s
    ("walk", "He walked home.", "home", "walked"),
])
def test_a_span_beside_a_regular_form_of_the_lemma_is_misplaced(lemma, sentence, span_word, regular):
    start = sentence.index(span_word)
    problem = target_problem(sentence, lemma, (start, start + len(span_word)))
    assert problem is not None and f"hold {span_word!r}, not {lemma!r} (which is at {regular!r})" in problem
    at = sentence.index(regular)
    assert target_problem(sentence, lemma, (at, at + len(regular))) is None  # the regular form itself is the target


@pytest.mark.parametrize("pos", ["V", None])  # WiC's verbs; SuperGLUE files give no PoS
@pytest.mark.parametrize("lemma, sentence, form, distractor", [
    ("drive", "The driver drove the car.", "drove", "driver"),  # lemma + r: an agent noun, not an inflection
    ("run", "The runner ran past the gate.", "ran", "runner"),  # doubled consonant + er
    ("sing", "The singer sang all night.", "sang", "singer"),  # + er
    ("speak", "The speaker spoke slowly.", "spoke", "speaker"),
    ("be", "It was a bed of roses.", "was", "bed"),  # + d: "be" has no silent e
    ("be", "She was the best of them.", "was", "best"),  # e dropped + est
    ("be", "He was fond of beer.", "was", "beer"),  # + er
    ("see", "I saw the seed.", "saw", "seed"),  # + d after "ee" ("seen" is irregular)
])
def test_derived_and_unrelated_words_do_not_make_an_irregular_form_misplaced(lemma, sentence, form, distractor, pos):
    start = sentence.index(form)
    assert distractor.startswith(lemma[:2])  # a word of the sentence that shares the lemma's letters
    assert target_problem(sentence, lemma, (start, start + len(form)), pos) is None


def test_a_nouns_forms_are_its_plural_only():
    sentence = "She banked the cash at the shore."
    start = sentence.index("shore")
    assert target_problem(sentence, "bank", (start, start + 5), "N") is None  # "banked" is no form of the noun
    for pos in ("V", None):  # a verb's past tense (unknown PoS: verb and noun inflections)
        assert "(which is at 'banked')" in target_problem(sentence, "bank", (start, start + 5), pos)
    plural = "The banks were shut by the shore."
    assert "(which is at 'banks')" in target_problem(plural, "bank", (plural.index("shore"), plural.index("shore") + 5),
                                                     "N")


def test_sts_whitening_is_fit_on_the_pooled_sentences_of_the_pairs(tmp_path, bert_tok):
    """Su et al. (2021) whiten sentence embeddings: mu and the covariance of the pairs' mean-pooled sentences (80 of
    them, more than the hidden size 32 + 1), not of their tokens; against a direct computation."""
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    sentences = list(dict.fromkeys(s for s in corpus_sentences(600, start=300) if 4 <= len(s.split()) <= 10))[:80]
    scores = (torch.rand(40, generator=torch.Generator().manual_seed(0)) * 5).tolist()
    path = write_sts(tmp_path / "sts.tsv", [(sentences[2 * i], sentences[2 * i + 1], round(score, 3))
                                            for i, score in enumerate(scores)])
    out = tmp_path / "out"
    assert analyze.main(["sts", "--no_progress", "--encoder", str(encoder), "--data", str(path), "--clip", "none",
                         "--normalize", "whiten", "--batch_size", "8", "--output_dir", str(out)]) == 0
    report = json.loads((out / "sts.json").read_text())
    assert report["num_truncated"] == 0 and report["variants"] == ["raw", "whitened"]
    assert report["normalize_fit"] == "sentences" and report["normalize_fit_count"] == 80
    assert "normalize_warning" not in report
    tokenizer, model = AutoTokenizer.from_pretrained(encoder), AutoModel.from_pretrained(encoder).eval()
    with torch.no_grad():  # each sentence alone, no padding: [layers, seq, hidden]
        hidden = [torch.stack(model(**tokenizer(text, return_tensors="pt"), output_hidden_states=True)
                              .hidden_states)[:, 0].double() for text in sentences]
    pooled = torch.stack([h.mean(1) for h in hidden], 1)  # [layers, 80, hidden]

    def spearman_of(transform) -> np.ndarray:
        a, b = transform(pooled[:, 0::2]), transform(pooled[:, 1::2])
        cosines = torch.nn.functional.cosine_similarity(a, b, dim=-1)  # [layers, 40]
        return np.array([100 * spearmanr(layer, [round(s, 3) for s in scores]).statistic for layer in cosines])

    whitened = [row["whitened"] for row in report["layers"]]
    np.testing.assert_allclose(whitened, spearman_of(fitted(pooled, "whiten")), atol=1e-3)
    token_fit = spearman_of(fitted(torch.cat(hidden, 1), "whiten"))  # what a token fit would have given
    assert np.abs(np.array(whitened) - token_fit).max() > 1


def test_sts_whitening_on_fewer_sentences_than_dimensions_warns(tmp_path, bert_tok, capfd):
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    out = tmp_path / "out"
    assert analyze.main(["sts", "--no_progress", "--encoder", str(encoder), "--data", str(write_sts(tmp_path / "s.tsv")),
                         "--clip", "none", "--normalize", "whiten", "--output_dir", str(out)]) == 0
    report = json.loads((out / "sts.json").read_text())
    sentences = len({s for a, b, _ in STS for s in (a, b)})
    assert report["normalize_fit_count"] == sentences == 16  # <= hidden size 32 + 1: a simplex
    assert f"whitening fit on {sentences} sentences, not more than hidden size + 1 (33)" in report["normalize_warning"]
    assert report["normalize_warning"] in capfd.readouterr().err


def test_protocol_constants_are_the_issues():
    """Issue 6: WiC thresholds 0.1...0.9; anisotropy 2000 sentences -> 1000 pairs; self-similarity 1000 words in at
    least 10 sentences (the issue's numbers, not the code's)."""
    assert semantic.THRESHOLDS == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    parser = analyze.build_parser()
    for command in ("anisotropy", "all"):
        args = parser.parse_args([command])
        assert (args.max_sentences, args.num_pairs) == (2000, 1000), command
    for command in ("self-similarity", "all"):
        args = parser.parse_args([command])
        assert (args.num_words, args.min_sentences) == (1000, 10), command


def test_original_wic_release_and_datasets_directory(tmp_path):
    (tmp_path / "dev.data.txt").write_text(
        "bank\tN\t4-5\tHe sat on the bank, near water.\tShe went to the big bank today.\n"
        "run\tV\t1-0\tThey ran home.\tRun fast!\n", encoding="utf-8")
    (tmp_path / "dev.gold.txt").write_text("F\nT\n", encoding="utf-8")
    items, skipped = read_wic(str(tmp_path / "dev.data.txt"))
    assert skipped.count == 0 and [i.label for i in items] == [False, True] and [i.pos for i in items] == ["N", "V"]
    assert items[0].sentence1[slice(*items[0].span1)] == "bank" and items[0].sentence2[slice(*items[0].span2)] == "bank"
    assert items[1].sentence1[slice(*items[1].span1)] == "ran" and items[1].sentence2[slice(*items[1].span2)] == "Run"
    import datasets

    rows = {"word": ["bank"], "sentence1": ["He sat on the bank."], "sentence2": ["The bank is shut."],
            "start1": [14], "end1": [18], "start2": [4], "end2": [8], "idx": [0], "label": [1]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "wic_ds"))
    items, _ = read_wic(str(tmp_path / "wic_ds"))
    assert len(items) == 1 and items[0].label is True and items[0].span2 == (4, 8) and items[0].pos is None


def test_senteval_sts_files_and_static_vectors(tmp_path):
    (tmp_path / "STS.input.news.txt").write_text("A b.\tC d.\nE f.\tG h.\nI j.\tK l.\n", encoding="utf-8")
    (tmp_path / "STS.gs.news.txt").write_text("4.2\n\n1\n", encoding="utf-8")
    with pytest.warns(UserWarning, match="has only 2 scored pairs: a Spearman correlation needs at least 3"):
        pairs, unscored = read_sts(str(tmp_path / "STS.input.news.txt"))
    assert unscored == 1 and [(p.index, p.score) for p in pairs] == [(0, 4.2), (2, 1.0)]
    with pytest.warns(UserWarning, match="has only 2 scored pairs"):
        pairs, _ = read_sts(str(write_sts(tmp_path / "wide.tsv", [('"Quoted," he said.', "b", 7.5), ("c", "d", 1)])),
                            score_range=(0, 10))
    assert [(p.sentence1, p.score) for p in pairs] == [('"Quoted," he said.', 7.5), ("c", 1.0)]
    (tmp_path / "vectors.txt").write_text("3 2\nthe 1 0\ncat 0.5 0.25\nzebra 9 9\nat home 2 3\n", encoding="utf-8")
    vectors, dim = read_static_vectors(str(tmp_path / "vectors.txt"), {"the", "cat", "dog", "at home"})
    assert dim == 2 and set(vectors) == {"the", "cat", "at home"} and vectors["cat"].tolist() == [0.5, 0.25]
    assert vectors["at home"].tolist() == [2.0, 3.0]
    with pytest.raises(UserError, match="cannot load dataset 'mteb/stsbenchmark-sts'"):
        read_sts("stsb")  # the preset is a `datasets` name (offline here)


def test_static_vectors_are_looked_up_as_written_and_lowercased_only_when_asked(tmp_path):
    """SentEval's bag-of-words baseline (get_wordvec + batcher) looks each word up with its case as written: with a
    cased file holding "The" and "the" (different vectors), a sentence's vector is the mean of its words' exact-case
    vectors, every occurrence counted, unknown words left out; a word written twice in the file takes its last line,
    as there. --static_lowercase (ours) lowercases both sides and keeps the file's first case variant."""
    from datamodules.words import sentence_words, static_sentence_vector

    (tmp_path / "vectors.txt").write_text("The 1 0 0\nthe 0 2 0\ncat 0 0 4\nCat 8 8 8\nsat 3 3 3\nsat 6 0 6\n",
                                          encoding="utf-8")
    sentence = "The cat saw the cat."
    assert sentence_words(sentence) == {"The", "cat", "saw", "the"}
    vectors, dim = read_static_vectors(str(tmp_path / "vectors.txt"), sentence_words(sentence) | {"sat"})
    assert dim == 3 and set(vectors) == {"The", "the", "cat", "sat"} and vectors["sat"].tolist() == [6.0, 0.0, 6.0]
    by_hand = torch.tensor([(1 + 0 + 0 + 0) / 4, (0 + 0 + 2 + 0) / 4, (0 + 4 + 0 + 4) / 4])  # The, cat, the, cat
    assert torch.equal(static_sentence_vector(sentence, vectors, dim), by_hand)
    lowered, _ = read_static_vectors(str(tmp_path / "vectors.txt"), sentence_words(sentence, lowercase=True),
                                     lowercase=True)
    assert set(lowered) == {"the", "cat"}
    by_hand = torch.tensor([(1 + 0 + 1 + 0) / 4, 0.0, (0 + 4 + 0 + 4) / 4])  # "the" is The's line, the first variant
    assert torch.equal(static_sentence_vector(sentence, lowered, dim, lowercase=True), by_hand)


def test_pair_and_vector_files_with_a_byte_order_mark_read_as_without(tmp_path):
    """Each release format written by an editor that adds a UTF-8 BOM (Notepad, Excel) reads exactly as without it: the
    BOM is not glued to the first sentence, WiC word, SICK header column or vector word."""
    def both(name: str, text: str) -> tuple[Path, Path]:
        (tmp_path / "bom").mkdir(exist_ok=True)
        (tmp_path / "plain").mkdir(exist_ok=True)
        (tmp_path / "bom" / name).write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
        (tmp_path / "plain" / name).write_text(text, encoding="utf-8")
        return tmp_path / "bom" / name, tmp_path / "plain" / name

    both("STS.gs.news.txt", "4.2\r\n1\r\n3\r\n")
    bom, plain = both("STS.input.news.txt", "A b.\tC d.\r\nE f.\tG h.\r\nI j.\tK l.\r\n")
    assert read_sts(str(bom)) == read_sts(str(plain)) and read_sts(str(bom))[0][0].sentence1 == "A b."
    bom, plain = both("SICK_trial.txt", "pair_ID\tsentence_A\tsentence_B\trelatedness_score\r\n"
                      + "".join(f"{i}\tA {i}.\tB {i}.\t{1 + i}\r\n" for i in range(3)))
    assert read_sts(str(bom), score_range=(1, 5)) == read_sts(str(plain), score_range=(1, 5))
    both("dev.gold.txt", "T\r\nF\r\n")
    bom, plain = both("dev.data.txt", "bank\tN\t4-1\tHe sat by the bank.\tThe bank shut.\r\n"
                      "run\tV\t1-0\tThey ran home.\tRun fast!\r\n")
    items, skipped = read_wic(str(bom))
    assert skipped.count == 0 and items == read_wic(str(plain))[0] and items[0].word == "bank"
    bom, _ = both("vectors.txt", "the 1 0\r\ncat 0.5 0.25\r\n")
    assert read_static_vectors(str(bom), {"the", "cat"})[0]["the"].tolist() == [1.0, 0.0]


def test_senteval_lines_split_at_newlines_only(tmp_path):
    """A sentence holding a Unicode line separator (U+2028, U+0085, a form feed: web forum text) stays one pair, its
    gold score beside it; str.splitlines split it in two and refused the file (or shifted every later pair)."""
    odd = ["A b\u2028c.", "E\x85f.", "I\x0cj."]
    (tmp_path / "STS.input.forum.txt").write_text("".join(f"{s}\tX {i}.\r\n" for i, s in enumerate(odd)),
                                                  encoding="utf-8")
    (tmp_path / "STS.gs.forum.txt").write_text("1\n2\n3\n", encoding="utf-8")
    pairs, _ = read_sts(str(tmp_path / "STS.input.forum.txt"))
    assert [(p.sentence1, p.sentence2, p.score) for p in pairs] == [(s, f"X {i}.", i + 1.0) for i, s in enumerate(odd)]


def bad_inputs(tmp_path: Path, sentences: Path) -> dict[str, tuple[list, str]]:
    wic = write_wic(tmp_path / "wic.jsonl")
    rows = [json.loads(line) for line in wic.read_text().splitlines()]
    shifted = write_wic(tmp_path / "shifted.jsonl", [{**r, "start1": r["start1"] + 1} for r in rows[:2]])
    nolabel = write_wic(tmp_path / "nolabel.jsonl", [{**rows[0], "label": -1}])
    (tmp_path / "columns.jsonl").write_text(json.dumps({"word": "x", "sentence1": "y"}) + "\n", encoding="utf-8")
    (tmp_path / "empty.jsonl").write_text("", encoding="utf-8")
    (tmp_path / "a.data.txt").write_text("x\tN\t0-0\tx y\tx z\n" * 3, encoding="utf-8")
    (tmp_path / "a.gold.txt").write_text("T\nF\n", encoding="utf-8")
    (tmp_path / "STS.input.x.txt").write_text("a\tb\nc\td\ne\tf\n", encoding="utf-8")
    (tmp_path / "STS.gs.x.txt").write_text("1\n2\n", encoding="utf-8")
    high = write_sts(tmp_path / "high.tsv", [*STS[:3], ("x", "y", 7)])
    negative = write_sts(tmp_path / "negative.tsv", [("x", "y", -1)])
    text = write_sts(tmp_path / "text.tsv", [("x", "y", "high")])
    blank = write_sts(tmp_path / "blank.tsv", [(" ", "y", 2)])
    (tmp_path / "noscore.csv").write_text("sentence1,sentence2,topic\na,b,c\n", encoding="utf-8")
    (tmp_path / "ragged.txt").write_text("the 1 2\ncat 1\n", encoding="utf-8")
    (tmp_path / "unrelated.txt").write_text("zyzzyva 1 2\n", encoding="utf-8")
    sts = write_sts(tmp_path / "sts.tsv")
    one = tmp_path / "one.txt"
    one.write_text("Only one sentence here.\n", encoding="utf-8")
    return {
        "every target misplaced": (["wic", "--data", shifted], "no WiC item of"),
        "wic columns": (["wic", "--data", tmp_path / "columns.jsonl"], "is not in WiC format: missing"),
        "wic empty": (["wic", "--data", tmp_path / "empty.jsonl"], "data file is empty"),
        "wic unlabelled": (["wic", "--data", nolabel], "has no label (-1"),
        "wic counts": (["wic", "--data", tmp_path / "a.data.txt"], "has 3 pairs but"),
        "sts counts": (["sts", "--data", tmp_path / "STS.input.x.txt"], "has 3 pairs but"),
        "sts out of range": (["sts", "--data", high], "pair 3: score 7 is outside the declared range 0-5"),
        "sts negative": (["sts", "--data", negative], "(unlabelled test split?)"),
        "sts not a number": (["sts", "--data", text], "score 'high' is not a number"),
        "sts empty sentence": (["sts", "--data", blank], "has an empty sentence"),
        "sts columns": (["sts", "--data", tmp_path / "noscore.csv"], "has no score column"),
        "sts range": (["sts", "--data", sts, "--score_range", "5,1"], "LO must be below HI"),
        "static ragged": (["sts", "--data", sts, "--static", tmp_path / "ragged.txt"], "1 value, expected 2"),
        "static unrelated": (["sts", "--data", sts, "--static", tmp_path / "unrelated.txt"], "none of the"),
        "words too few": (["self-similarity", "--data", sentences], "only "),
        "empty sentences": (["anisotropy", "--data", tmp_path / "empty.jsonl"], "data file is empty"),
        "one sentence": (["anisotropy", "--data", one], "anisotropy needs at least 2 sentences with a token, got 1"),
        "clip text": (["anisotropy", "--data", sentences, "--clip", "big"], "--clip must be auto, per-layer, none"),
        "clip range": (["isotropy", "--data", sentences, "--clip", "3,99"],
                       "--clip dimensions [99] are outside the model's dimensions 0..31"),
        "clip layer range": (["isotropy", "--data", sentences, "--clip", "2-9:3"],
                             "--clip layer 4 is outside the model's layers 0..3"),
        "clip empty item": (["anisotropy", "--data", sentences, "--clip", "1-2:"], "--clip item '1-2:' is empty"),
        "clip empty": (["anisotropy", "--data", sentences, "--clip", " "], "--clip is empty"),
        "zeta": (["isotropy", "--data", sentences, "--zeta", "2"], "--zeta must lie in [0, 1]"),
        "minibatch of one token": (["isotropy", "--data", sentences, "--minibatch", "1"],
                                   "--minibatch must be at least 2 (a mini-batch's covariance needs 2 tokens), got 1"),
        "all bad wic": (["all", "--data", sentences, "--num_words", "5", "--wic", shifted], "no WiC item of"),
    }


def test_word_contexts_are_drawn_where_the_encoder_reads_them():
    """A word's contexts are drawn among its occurrences that `visible` says the encoder reads (truncation cuts a long
    sentence): 'lamp' is in 3 short sentences and, past a cut at 12 characters, in 20 long ones (which the draw
    preferred, as they hold 'house' too); a word qualifies by the sentences where it is read."""
    short = ["lamp house a", "lamp house b", "lamp house c"]
    long = [f"{chr(97 + n) * 2} house 12 34 56 78 lamp" for n in range(20)]  # house read, lamp (at 21) not
    cut = 12

    def visible(chunk):
        return [min(len(text), cut) for text in chunk]

    before = word_contexts(short + long, num_words=2, min_sentences=3, seed=0)  # every occurrence readable
    after = word_contexts(short + long, num_words=2, min_sentences=3, seed=0, visible=visible)
    assert sorted(before.words) == sorted(after.words) == ["house", "lamp"]
    for contexts in (before, after):
        assert all(text[start:end] == contexts.words[word] for text, spans in zip(contexts.sentences, contexts.spans)
                   for word, start, end in spans)
        assert sorted(len([1 for spans in contexts.spans for word, _, _ in spans if word == w])
                      for w in range(2)) == [3, 3]  # 3 contexts of each word
    assert any(start >= cut for spans in before.spans for _, start, _ in spans)  # some drawn past the cut
    assert all(end <= cut for spans in after.spans for _, _, end in spans)
    lamp = after.words.index("lamp")
    assert sorted(text for text, spans in zip(after.sentences, after.spans) if lamp in {w for w, _, _ in spans}) == short
    assert word_contexts(short[:1] + long, num_words=2, min_sentences=3, seed=0).words  # lamp in 21 sentences...
    with pytest.raises(UserError, match=r"^only 1 word occur in at least 3 of the 21 sentences where the encoder reads "
                                        r"them \(20 sentences were truncated at --max_length"):  # ... read in 1
        word_contexts(short[:1] + long, num_words=2, min_sentences=3, seed=0, visible=visible)


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_readable_tokenises_only_what_may_be_cut_and_equals_the_encoders_reading(kind, tmp_path, bert_tok,
                                                                                  roberta_tok):
    """analyses.session.readable (the characters of each sentence the encoder reads) leaves a sentence of fewer bytes
    than the tokens left beside the special tokens untokenised: equal to FrozenEncoder.tokenize's own `covered` on
    every prefix of a text of several scripts, emoji and combining marks, at lengths where some are cut."""
    from analyses.session import readable
    from lightning_modules.encoder import load_encoder

    tokenizer = bert_tok if kind == "bert" else roberta_tok
    encoder = load_encoder(save_tiny_encoder(tmp_path / kind, kind, tokenizer), device="cpu")
    text = "a 😀 é́ 中文 word, שלום 👨‍👩‍👧 the ﬃ end of it all ok"
    texts = [text[:n].strip() or "x" for n in range(1, len(text) + 1)]
    for max_length in (4, 8, 16, 32):
        expected = encoder.tokenize(texts, max_length, offsets=True)[0]["covered"]
        assert any(c < len(t) for c, t in zip(expected, texts)) or max_length == 32
        assert readable(encoder, max_length)(texts) == expected


def test_readable_measures_the_text_a_normalizing_tokenizer_reads(tmp_path):
    """A SentencePiece Unigram with NFKC (as XLM-R's and ALBERT's) writes '½' (2 bytes) as '1⁄2', three tokens: "½½½ a"
    (8 bytes) is 12 tokens with [CLS] and [SEP], cut at 11 before 'a'. analyses.session.readable measures the text as
    normalized, so it equals FrozenEncoder.tokenize's own `covered` (the raw bytes said the 11 tokens read it whole)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from analyses.session import readable
    from lightning_modules.encoder import load_encoder

    pieces = [c for c in "abcdefghijklmnopqrstuvwxyz0123456789.,⁄"]
    vocab = [(token, 0.0) for token in ("<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]")] + [("\u2581", -1.0)]
    vocab += [(piece, -2.0) for piece in pieces] + [("\u2581" + piece, -2.0) for piece in pieces]
    backend = Tokenizer(models.Unigram(vocab, unk_id=1, byte_fallback=False))
    backend.normalizer, backend.pre_tokenizer = normalizers.NFKC(), pre_tokenizers.Metaspace()
    backend.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                           special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                        cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]", model_max_length=64)
    encoder = load_encoder(save_tiny_encoder(tmp_path / "unigram", "bert", tokenizer), device="cpu")
    ids = tokenizer("½½½ a")["input_ids"]
    assert len(ids) == 12 and len("½½½ a".encode()) == 8  # 3 x (▁1 ⁄ 2) ▁a, beside [CLS] [SEP]
    assert max(end for _, end in tokenizer("½½½ a", truncation=True, max_length=11,
                                           return_offsets_mapping=True)["offset_mapping"]) == 3  # 'a' is cut
    text = "½½½ a ﷽ b ½ c ﬃ d"
    texts = [text[:n].strip() or "x" for n in range(1, len(text) + 1)]
    for max_length in (8, 11, 16, 24):
        expected = encoder.tokenize(texts, max_length, offsets=True)[0]["covered"]
        assert readable(encoder, max_length)(texts) == expected
    assert readable(encoder, 11)(["½½½ a"]) == [3]


def test_self_similarity_draws_no_context_past_the_truncation(tmp_path, bert_tok):
    """analyze.py self-similarity draws each word's contexts among the occurrences its encoder reads at --max_length:
    'house' is in 2 short lines and 12 long ones, past the 16 tokens of the cut in each. Expected from the tokenizer
    (which lines' house its truncated tokens cover) and the model (the cosine of house's two vectors per layer)."""
    numbers = " ".join(str(n) for n in range(30))  # no words: digits; each line distinct
    lines = ["house 1", "2 house"] + [f"{n} {numbers} house" for n in range(100, 112)]
    data = tmp_path / "long.txt"
    data.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    readable = []
    for line in lines:
        encoded = bert_tok(line, truncation=True, max_length=16, return_offsets_mapping=True)
        if line.rindex("house") + len("house") <= max(end for _, end in encoded["offset_mapping"]):
            readable.append(line)
    assert readable == lines[:2]
    out = tmp_path / "out"
    assert analyze.main(["self-similarity", "--encoder", str(encoder), "--data", str(data), "--num_words", "1",
                         "--min_sentences", "2", "--max_length", "16", "--num_pairs", "2", "--no_progress",
                         "--output_dir", str(out)]) == 0
    report = json.loads((out / "self_similarity.json").read_text())
    assert report["words"] == ["house"] and report["num_words"] == 1
    assert report["contexts_lost_to_truncation"] == 0 and report["num_sentences"] == len(readable)
    model = AutoModel.from_pretrained(encoder).eval()
    vectors = []
    for line in readable:
        encoded = bert_tok(line, return_tensors="pt")
        index = encoded["input_ids"][0].tolist().index(bert_tok.convert_tokens_to_ids("house"))
        with torch.no_grad():
            vectors.append(torch.stack(model(**encoded, output_hidden_states=True).hidden_states)[:, 0, index])
    expected = torch.cosine_similarity(vectors[0], vectors[1], dim=-1)
    np.testing.assert_allclose([row["raw"]["self_similarity"] for row in report["layers"]], expected.numpy(), atol=1e-5)


def test_self_similarity_of_contexts_drawn_past_the_truncation_says_why_its_table_is_empty(tmp_path, bert_tok, capfd):
    """Contexts drawn without the encoder's reading (word_contexts without `visible`, as a library user may) and all
    cut at --max_length 4 leave no word with 2 contexts: the table is '-', and the warning says why."""
    from analyses.geometry import Baseline, self_similarity
    from analyses.reference import Setting
    from lightning_modules.encoder import load_encoder
    from metrics.transforms import RAW

    encoder = load_encoder(save_tiny_encoder(tmp_path / "bert", "bert", bert_tok), device="cpu")
    contexts = word_contexts(["one two three four five house", "six seven eight nine ten house"], 1, 2)
    layers = [{"layer": layer, RAW.key: 0.0} for layer in range(encoder.num_hidden_states)]
    report = self_similarity(Setting(encoder, max_length=4, progress=False), contexts, [RAW],
                             Baseline({"num_pairs": 1, "num_sentences": 2, "layers": layers}, "none"))
    assert report["words"] == ["house"] and report["num_words"] == 0 and report["contexts_lost_to_truncation"] == 2
    assert all(row[RAW.key]["self_similarity"] is None for row in report["layers"])
    assert report["self_similarity_warning"] == ("self-similarity not computed ('-'): no word of the 1 sampled kept 2 "
                                                 "of its contexts (2 contexts lost to truncation: a larger --max_length "
                                                 "keeps them)")


def test_self_similarity_refuses_words_that_truncation_cuts_from_every_context(tmp_path, bert_tok, capfd):
    # "house" is the one word in 2 sentences, 6 words in: --max_length 4 cuts it from both (so it is in none where the
    # encoder reads it: one line, exit 2, nothing written), 32 keeps it
    data = tmp_path / "late.txt"
    data.write_text("one two three four five house\nsix seven eight nine ten house\n", encoding="utf-8")
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    out = tmp_path / "out32"
    assert analyze.main(["self-similarity", "--encoder", str(encoder), "--data", str(data), "--num_words", "1",
                         "--min_sentences", "2", "--max_length", "32", "--no_progress", "--output_dir", str(out)]) == 0
    kept = json.loads((out / "self_similarity.json").read_text())
    assert kept["words"] == ["house"] and kept["num_words"] == 1 and "self_similarity_warning" not in kept
    assert all(row["raw"]["self_similarity"] is not None for row in kept["layers"])
    capfd.readouterr()
    assert analyze.main(["self-similarity", "--encoder", str(encoder), "--data", str(data), "--num_words", "1",
                         "--min_sentences", "2", "--max_length", "4", "--no_progress",
                         "--output_dir", str(tmp_path / "out4")]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err == ["analyze.py self-similarity: error: only 0 words occur in at least 2 of the 2 sentences where the "
                   "encoder reads them (2 sentences were truncated at --max_length, and the words past the cut have "
                   "no vector); self-similarity needs 1 (fewer words: --num_words, fewer contexts per word: "
                   "--min_sentences, a larger --max_length, or more sentences: a larger source)"]
    assert not (tmp_path / "out4").exists()


def test_isotropy_counts_its_truncated_sentences_as_anisotropy_does(tmp_path, bert_tok, capfd):
    """isotropy.json says how many sentences --max_length cut (counted here with the tokenizer), and says so on stderr."""
    sentences = corpus_sentences(30, start=700)
    data = tmp_path / "s.txt"
    data.write_text("".join(f"{s}\n" for s in sentences), encoding="utf-8")
    longer = sum(len(ids) > 12 for ids in bert_tok(sentences)["input_ids"])
    assert 0 < longer < len(sentences)
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    reports = {}
    for command, extra in (("isotropy", ["--minibatch", "4"]), ("anisotropy", [])):
        assert analyze.main([command, "--encoder", str(encoder), "--data", str(data), "--max_length", "12", *extra,
                             "--no_progress", "--output_dir", str(tmp_path / command)]) == 0
        reports[command] = json.loads((tmp_path / command / f"{command}.json").read_text())
    assert reports["isotropy"]["num_truncated"] == reports["anisotropy"]["num_truncated"] == longer
    assert (f"warning: {longer} of {len(sentences)} sentences were longer than 12 tokens and were truncated "
            "(counted in the report as num_truncated)") in capfd.readouterr().err


def test_sts_whose_sentences_all_pool_to_one_vector_says_why_and_names_no_best_layer(tmp_path, bert_tok, capfd):
    # --max_length 2 leaves [CLS] [SEP] of every sentence: one pooled vector, every cosine 1, Spearman undefined
    sts, encoder = write_sts(tmp_path / "sts.tsv"), save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    reports = {}
    for length in (2, 32):
        out = tmp_path / f"out{length}"
        assert analyze.main(["sts", "--encoder", str(encoder), "--data", str(sts), "--max_length", str(length),
                             "--no_progress", "--output_dir", str(out)]) == 0
        reports[length] = json.loads((out / "sts.json").read_text())
    kept, cut = reports[32], reports[2]
    assert kept["best"]["layer"] >= 1 and kept["best"]["spearman"] is not None and "spearman_warning" not in kept
    assert all(row[key] is None for row in cut["layers"] for key in ("raw", "clipped"))
    assert cut["best"] == cut["best_clipped"] == {"spearman": None, "layer": None}
    assert cut["spearman_warning"] == ("Spearman not computed ('-') for raw, clipped: every pair's cosine is the same "
                                       "in every layer (the sentences' vectors do not differ: does --max_length leave "
                                       "only the special tokens?)")
    assert cut["spearman_warning"] in capfd.readouterr().err


def test_bad_inputs_give_one_line_and_write_nothing(tmp_path, bert_tok, sentences, capfd):
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    for case, (argv, message) in bad_inputs(tmp_path, sentences).items():
        out = tmp_path / f"out-{case.replace(' ', '-')}"
        code = analyze.main([*map(str, argv), "--encoder", str(encoder), "--output_dir", str(out), "--no_progress"])
        errors = [line for line in capfd.readouterr().err.splitlines() if "error:" in line]
        assert code == 2, case
        assert len(errors) == 1 and message in errors[0], (case, errors)
        assert not out.exists(), case


def test_pair_commands_read_every_pair_and_take_no_sentence_sample_or_text_column(tmp_path, bert_tok, capfd):
    """wic and sts score every pair of their data (the paper's protocol: WiC's 5,428 training pairs), in the columns
    of their formats: a --max_sentences (shown as 'default 2000' before) or --text_column they would ignore is
    refused in one line, not taken and dropped."""
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    wic, sts = write_wic(tmp_path / "wic.jsonl"), write_sts(tmp_path / "sts.tsv")
    common = ["--encoder", str(encoder), "--no_progress", "--clip", "none"]
    for command, data, pairs in (("wic", wic, len(WIC)), ("sts", sts, len(STS))):
        out = tmp_path / command
        assert analyze.main([command, "--data", str(data), "--output_dir", str(out), *common]) == 0
        report = json.loads((out / f"{command}.json").read_text())
        assert report["num_pairs"] == pairs > 2
        for option, value in (("--max_sentences", "2"), ("--text_column", "sentence1")):
            refused = tmp_path / f"{command}{option}"
            with pytest.raises(SystemExit) as stop:
                analyze.main([command, "--data", str(data), "--output_dir", str(refused), option, value, *common])
            assert stop.value.code == 2
            assert f"unknown option {option} for this subcommand" in capfd.readouterr().err
            assert not refused.exists()


@pytest.mark.slow
def test_all_under_two_process_ddp_equals_one_process(tmp_path, planted, sentences):
    wic, sts = write_wic(tmp_path / "wic.jsonl"), write_sts(tmp_path / "sts.tsv")
    args = ["--encoder", planted, "--data", sentences, "--max_sentences", 0, "--pool_sentences", 0, "--num_words", 5,
            "--min_sentences", 3, "--wic", wic, "--sts", sts, "--batch_size", 4, "--minibatch", 6, "--no_progress",
            "--normalize", "standardize"]  # STS refits it on the pairs' pooled sentences (one more synced pass)
    assert analyze.main(["all", *map(str, args), "--output_dir", str(tmp_path / "single")]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(ROOT / "analyze.py"), "all", *map(str, args), "--output_dir",
               str(tmp_path / "ddp")]
    finished = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    for name in ("summary", "anisotropy", "isotropy", "self_similarity", "wic", "sts_sts"):
        single = json.loads((tmp_path / "single" / f"{name}.json").read_text())
        ddp = json.loads((tmp_path / "ddp" / f"{name}.json").read_text())
        reports_close(single, ddp, name, rel=0, abs=1e-4)  # padding differs between shardings


def test_clip_none_reports_only_raw_and_the_best_is_the_per_layer_maximum(planted, tmp_path):
    out = tmp_path / "none"
    assert analyze.main(["wic", "--no_progress", "--encoder", str(planted), "--data", str(write_wic(tmp_path / "w.jsonl")),
                         "--clip", "none", "--output_dir", str(out)]) == 0
    report = json.loads((out / "wic.json").read_text())
    assert report["variants"] == ["raw"] and report["clipped_dims"] == [] and "best_clipped" not in report
    assert torch.tensor([row["raw"]["accuracy"] for row in report["layers"]]).max().item() == report["best"]["accuracy"]


@pytest.mark.parametrize("command", ["self-similarity", "all", "paper"])
def test_too_few_words_are_refused_before_the_encoders_weights_are_read(command, tmp_path, bert_tok, capfd,
                                                                        monkeypatch):
    """The self-similarity words are drawn with the encoder's tokenizer loaded alone (its special tokens): too few
    words is refused before the model's weights are read (a hub id's multi-GB download), here an encoder whose
    model.safetensors is torn. Planted: "alpha" in all 12 sentences, "beta" in 11, every other word in one, so 2
    words qualify at --min_sentences 10. Asked for 3: the words' refusal (exit 2, nothing written); asked for 2: the
    words pass and the torn weights are what refuses, so they are read only then, and the tokenizer loaded once."""
    import transformers

    lines = [f"alpha {'beta ' if i else ''}{'k' * (i + 1)} here{'z' * i}" for i in range(12)]
    data = tmp_path / "words.txt"
    data.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    counts = Counter(word for line in lines for word in {m.group().lower() for m in WORD.finditer(line)})
    assert sorted(word for word, n in counts.items() if n >= 10) == ["alpha", "beta"]
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    (encoder / "model.safetensors").write_bytes(b"torn")
    loads = []
    load = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *args, **kwargs: loads.append(args[0]) or load(*args, **kwargs))
    sources = ["--sst2", data, "--qqp", "none", "--wic", "none", "--sts", "none", "--imdb", "none", "--sst5", "none"] \
        if command == "paper" else ["--data", data, "--max_sentences", "0"]
    for num_words, message in ((3, "only 2 words occur in at least 10 of the 12 sentences; self-similarity needs 3"),
                               (2, "model.safetensors is truncated or corrupt")):
        loads.clear()
        out = tmp_path / f"out{num_words}"
        code = analyze.main([command, "--encoder", str(encoder), *map(str, sources), "--num_words", str(num_words),
                             "--min_sentences", "10", "--no_progress", "--output_dir", str(out)])
        errors = [line for line in capfd.readouterr().err.splitlines() if "error:" in line]
        assert code == 2 and len(errors) == 1 and message in errors[0], (num_words, errors)
        assert not out.exists() and loads == [str(encoder)]


def planted_wic(raw: str, form: str, before: str, inside: bool) -> tuple[str, int, int]:
    """`raw` with `before` (a byte-order mark, spaces) at its start, a NUL before the target `form` and, with `inside`,
    one in it; the target's offsets into the planted sentence (it holds the NULs: offsets count them)."""
    at = raw.index(form)
    target = form[:2] + "\0" + form[2:] if inside else form
    planted = before + raw[:at] + "\0" + target + raw[at + len(form):]
    start = len(before) + at + 1
    return planted, start, start + len(target)


def test_wic_sentences_are_cleaned_and_their_offsets_follow_the_target(tmp_path):
    """WiC sentences cleaned as every text is read (datamodules/characters.py): a leading byte-order mark and spaces
    stripped, NULs (JSON's \\u0000) dropped, one warning for the source; the offsets, which count the dropped
    characters, move with them: the target found is the raw one without its NUL, and every item equals the item of
    the unplanted file. A sentence with nothing visible in it (a zero-width space) is skipped as blank."""
    import warnings

    clean_rows, rows = [], []
    for n, (word, s1, f1, s2, f2, label) in enumerate(WIC):
        a, b = s1.index(f1), s2.index(f2)
        clean_rows.append({"word": word, "sentence1": s1, "sentence2": s2, "start1": a, "end1": a + len(f1),
                           "start2": b, "end2": b + len(f2), "label": label})
        p1, start1, end1 = planted_wic(s1, f1, "\ufeff", inside=n % 2 == 0)
        p2, start2, end2 = planted_wic(s2, f2, "  \ufeff", inside=n % 2 == 1)
        assert p1[start1:end1].replace("\0", "") == f1 and p2[start2:end2].replace("\0", "") == f2  # the plant
        rows.append({"word": "\ufeff" + word, "sentence1": p1, "sentence2": p2, "start1": start1, "end1": end1,
                     "start2": start2, "end2": end2, "label": label})
    blank = {**clean_rows[0], "sentence2": "\u200b\u2060"}
    expected, _ = read_wic(str(write_wic(tmp_path / "clean.jsonl", clean_rows)))
    planted = write_wic(tmp_path / "planted.jsonl", [*rows, blank])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        items, skipped = read_wic(str(planted))
    assert [str(w.message) for w in caught if "NUL" in str(w.message)] == [
        f"{planted}: a text holds NUL characters, which are no text: dropped"]
    assert items == expected and len(items) == len(WIC)
    for item, (_, _, f1, _, f2, _) in zip(items, WIC, strict=True):
        assert item.sentence1[slice(*item.span1)] == f1 and item.sentence2[slice(*item.span2)] == f2
    assert skipped.count == 1 and skipped.examples[0]["reason"] == "sentence2: blank (nothing visible in it)"

    def release(name: str, plant: bool) -> str:  # the original release: word, PoS, token indices, sentences; gold
        lines = []
        for word, s1, f1, s2, f2, _ in WIC:
            fields = []
            for sentence, form in ((s1, f1), (s2, f2)):
                tokens = sentence.split(" ")
                index = next(i for i, token in enumerate(tokens) if form in token)
                if plant:
                    tokens[index] = tokens[index].replace(form, f"\0{form[:2]}\0{form[2:]}", 1)
                fields.append((index, ("\ufeff" if plant else "") + " ".join(tokens)))
            lines.append(f"{word}\tN\t{fields[0][0]}-{fields[1][0]}\t{fields[0][1]}\t{fields[1][1]}\n")
        (tmp_path / f"{name}.data.txt").write_text("".join(lines), encoding="utf-8")
        (tmp_path / f"{name}.gold.txt").write_text("".join("T\n" if row[-1] else "F\n" for row in WIC))
        return str(tmp_path / f"{name}.data.txt")

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        items, skipped = read_wic(release("planted", plant=True))
    assert items == read_wic(release("clean", plant=False))[0] and skipped.count == 0
    for item, (_, s1, f1, s2, f2, _) in zip(items, WIC, strict=True):
        assert (item.sentence1, item.sentence2) == (s1, s2)
        assert item.sentence1[slice(*item.span1)] == f1 and item.sentence2[slice(*item.span2)] == f2


def test_sts_sentences_are_cleaned_and_one_with_nothing_visible_is_refused(tmp_path):
    """STS sentences cleaned as every text is read: a leading byte-order mark and spaces stripped, NULs dropped (one
    warning for the source): the pairs equal those of the unplanted file. A sentence with nothing visible in it is
    an empty sentence, refused in one line as an empty one is."""
    import warnings

    def write(path, pairs):
        path.write_text("".join(json.dumps({"sentence1": a, "sentence2": b, "score": s}) + "\n" for a, b, s in pairs),
                        encoding="utf-8")
        return path

    planted = [(f"\ufeff {a[:3]}\0{a[3:]}", f"{b}\0 ", score) for a, b, score in STS]
    expected, _ = read_sts(str(write(tmp_path / "clean.jsonl", STS)))
    path = write(tmp_path / "planted.jsonl", planted)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pairs, unscored = read_sts(str(path))
    assert pairs == expected and unscored == 0 and [p.sentence1 for p in pairs] == [a for a, _, _ in STS]
    assert sum("NUL" in str(w.message) for w in caught) == 1
    invisible = write(tmp_path / "invisible.jsonl", [*STS[:3], ("\u200b\u2060", "A man plays.", 2.0)])
    with pytest.raises(UserError, match=r"pair 3 has an empty sentence \(nothing visible in it\)"):
        read_sts(str(invisible))


@pytest.mark.parametrize("kind, words, case", [
    # cased (RoBERTa's byte-level BPE): "The" (lines 1, 3) and "the" (line 2 only) are two words; "the" is too rare
    ("roberta", ["The", "cat", "dog", "ran", "sat"], "as written (a cased tokenizer: 'The' and 'the' are two words)"),
    # uncased (BERT's lowercasing WordPiece): one word "the", in lines 1-3
    ("bert", ["cat", "dog", "ran", "sat", "the"], "lowercased (the tokenizer lowercases)"),
])
def test_self_similarity_words_keep_their_case_unless_the_tokenizer_lowercases(kind, words, case, tmp_path, bert_tok,
                                                                              roberta_tok):
    """Ethayarajh's words are the tokenizer's own strings (his code indexes bert-base-cased's tokens, case kept): a
    cased model's "The" and "the" are not pooled, an uncased model's are. The words qualifying in 2 of these 4
    lines, by hand."""
    data = tmp_path / "case.txt"
    lines = ["The dog ran", "the dog sat", "The cat ran", "a cat sat"]
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    encoder = save_tiny_encoder(tmp_path / kind, kind, bert_tok if kind == "bert" else roberta_tok)
    out = tmp_path / "out"
    assert analyze.main(["self-similarity", "--encoder", str(encoder), "--data", str(data), "--num_words", "5",
                         "--min_sentences", "2", "--no_progress", "--output_dir", str(out)]) == 0
    report = json.loads((out / "self_similarity.json").read_text())
    assert sorted(report["words"]) == words and report["num_candidates"] == 5 and report["word_case"] == case
    contexts = source_contexts(str(data), None, 0, 5, 2, seed=0, lowercase=kind == "bert")  # the same words
    assert sorted(contexts.words) == words
    word = "The" if kind == "roberta" else "the"  # cased: lines 1 and 3 exactly; uncased: 2 of lines 1-3, any case
    texts = sorted(contexts.sentences[i][s:e] for i, row in enumerate(contexts.spans) for w, s, e in row
                   if contexts.words[w] == word)
    assert len(texts) == 2 and (texts == ["The", "The"] if kind == "roberta" else {t.lower() for t in texts} == {"the"})


def test_cuts_are_the_truncated_sentences_limits_in_twelve_bytes_each():
    """`truncated` keeps, for a streamed source, only the sentences the encoder cuts: the same mapping a dict by hand
    gives, looked up by index, at 12 bytes a cut sentence (not a dict entry's ~100)."""
    sentences = [f"sentence {i} " + "x" * (i % 7) for i in range(2000)]
    visible = lambda chunk: [min(len(s), 13) for s in chunk]  # noqa: E731  (the encoder reads 13 characters)
    cuts = truncated(iter(sentences), visible)
    by_hand = {i: 13 for i, s in enumerate(sentences) if len(s) > 13}
    assert len(cuts) == len(by_hand) > 0
    assert all(cuts.get(i) == by_hand.get(i) for i in range(len(sentences))) and cuts.get(5000, 7) == 7
    assert cuts.index.itemsize + cuts.limit.itemsize == 12
    broken = Cuts()
    broken.add(3, 1)
    with pytest.raises(ValueError, match="sentence 2 added after sentence 3"):
        broken.add(2, 1)
