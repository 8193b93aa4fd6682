"""`analyze.py paper` end to end offline, with tiny local stand-ins for SST-2, QQP, WiC, STS, IMDB and SST-5, checked
against the single subcommands and the probes' own reports; and the splits rule on a local dataset with splits."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import datasets
import pytest
import torch
from scipy.stats import spearmanr

import analyze
from datamodules.probing import ClassificationDataModule, PositionDataModule
from datamodules.text import sample_texts
from datamodules.words import WORD
from tests.figure_data import panels, same, saved_figures
from tests.test_analyze_eval import STS
from tests.test_analyze_eval_inputs import PLANTED, plant, write_sts, write_wic
from tests.tiny import LAYERS, MAX_POSITIONS, corpus_sentences, save_tiny_encoder


def save_splits(path: Path, splits: dict[str, list[dict]]) -> Path:
    datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()}).save_to_disk(path)
    return path


def labelled(texts: list[str], classes: int, hidden: bool = False) -> list[dict]:
    """A label the encoder can see (the sentence's length class), or GLUE's hidden -1."""
    return [{"sentence": t, "label": -1 if hidden else min(len(t) // 40, classes - 1)} for t in texts]


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory, bert_tok) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("paper_data")
    texts = corpus_sentences(120, start=300)
    sources = {
        "sst2": save_splits(root / "sst2", {"train": labelled(texts[:60], 2), "validation": labelled(texts[60:75], 2),
                                            "test": labelled(texts[75:90], 2, hidden=True)}),
        "imdb": save_splits(root / "imdb", {"train": [{"text": r["sentence"], "label": r["label"]}
                                                      for r in labelled(texts[:50], 2)],
                                            "test": [{"text": r["sentence"], "label": r["label"]}
                                                     for r in labelled(texts[90:110], 2)]}),
        "sst5": save_splits(root / "sst5", {"train": labelled(texts[10:70], 3), "validation": labelled(texts[70:85], 3),
                                            "test": labelled(texts[85:105], 3)}),
        "wic": write_wic(root / "wic.jsonl"), "sts": write_sts(root / "sts.tsv"),
        # WiC with its own splits, as super_glue has them: the paper's default reads the training split
        "wic_splits": save_splits(root / "wic_splits", {
            "train": [json.loads(line) for line in write_wic(root / "wic_rows.jsonl").read_text().splitlines()],
            "validation": [json.loads(line) for line in write_wic(root / "wic_rows.jsonl").read_text().splitlines()[:3]]}),
        "encoder": save_tiny_encoder(root / "planted", "bert", bert_tok, plant=plant)}
    with (root / "qqp.csv").open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([("question1", "question2", "label"),
                                      *((a, b, 0) for a, b in zip(texts[:40], texts[40:80]))])
    sources["qqp"] = root / "qqp.csv"
    return sources


def document_counts(texts: list[str], tokenizer=None) -> dict[str, int]:
    """The sentences each word occurs in; with `tokenizer`, only where the tiny encoder reads them (the characters its
    MAX_POSITIONS tokens cover: a word past the cut has no vector)."""
    counts: dict[str, int] = {}
    for text in texts:
        read = len(text) if tokenizer is None else max(end for _, end in tokenizer(
            text, truncation=True, max_length=MAX_POSITIONS, return_offsets_mapping=True)["offset_mapping"])
        for word in {match.group().lower() for match in WORD.finditer(text) if match.end() <= read}:
            counts[word] = counts.get(word, 0) + 1
    return counts


@pytest.mark.slow
def test_paper_writes_tables_1_to_3_and_equals_the_single_commands(stand_ins, tmp_path, capsys, monkeypatch,
                                                                   bert_tok):
    from analyses import paper

    saved = saved_figures(monkeypatch, paper)
    common = ["--encoder", stand_ins["encoder"], "--no_progress", "--seed", "1", "--max_sentences", "40"]
    out = tmp_path / "paper"
    words = sorted({w.strip(".,") for a, b, _ in STS for w in f"{a} {b}".split()} - {"guitar"})  # one word unknown
    generator = torch.Generator().manual_seed(0)
    vectors = {word: torch.randn(5, generator=generator, dtype=torch.float64) for word in words}
    glove = tmp_path / "glove.txt"
    glove.write_text("".join(f"{w} {' '.join(f'{v:.17g}' for v in vectors[w].tolist())}\n" for w in words),
                     encoding="utf-8")
    code = analyze.main(["paper", *map(str, common), "--num_words", "4", "--min_sentences", "3", "--sst2",
                         str(stand_ins["sst2"]), "--qqp", str(stand_ins["qqp"]), "--outlier_sentences", "51",
                         "--wic", str(stand_ins["wic_splits"]), "--sts", str(stand_ins["sts"]), "--imdb",
                         str(stand_ins["imdb"]), "--sst5", str(stand_ins["sst5"]), "--epochs", "2",
                         "--static", str(glove), "--output_dir", str(out)])
    assert code == 0
    summary = json.loads((out / "paper.json").read_text())
    outliers = json.loads((out / "outliers" / "outliers.json").read_text())
    assert PLANTED in outliers["persistent_dims"] == summary["section3_outliers"]["persistent_dims"]
    # §3 on SST-2's and QQP's training sentences together (--outlier_sentences 51 of each: QQP's 40 are all it has,
    # used whole): the statistics equal the outliers subcommand on exactly those sentences
    assert summary["section3_sentences"] == outliers["sentences_from"] == {"sst2": 51, "qqp": 40}
    assert "on 51 sentences of SST-2 and 40 sentences of QQP (51 asked of each; QQP has only 40: used whole)" in \
        (out / "paper.md").read_text()
    train = datasets.load_from_disk(str(stand_ins["sst2"]))["train"]["sentence"]
    with (stand_ins["qqp"]).open(newline="", encoding="utf-8") as handle:
        questions = [row["question1"] for row in csv.DictReader(handle)]
    together = tmp_path / "together.txt"
    together.write_text("\n".join(sample_texts(iter(train), 51, 1) + questions) + "\n")
    assert analyze.main(["outliers", *map(str, common[:-2]), "--data", str(together), "--max_sentences", "0",
                         "--output_dir", str(tmp_path / "direct_outliers")]) == 0
    direct = json.loads((tmp_path / "direct_outliers" / "outliers.json").read_text())
    assert outliers["num_sentences"] == direct["num_sentences"] == 91
    assert outliers["layers"] == paper_keys(direct["layers"], outliers["layers"])
    # the clipping found there, written out per non-input layer, is the one every step used
    expected_clip = ",".join(f"{layer}:{'+'.join(map(str, outliers['persistent_dims']))}"
                             for layer in range(1, LAYERS + 1))
    assert summary["clip"] == expected_clip
    reports = {path.stem: json.loads(path.read_text()) for path in out.glob("*.json") if path.stem != "paper"}
    assert {name for name in reports} == {"anisotropy_sst2", "self_similarity_sst2", "anisotropy_qqp",
                                          "self_similarity_qqp", "wic", "sts_sts"}
    # --static: the STS sets' static-vector baseline (SentEval's bag of words, by hand here)
    def bag(sentence):
        return torch.stack([vectors[w] for w in (t.strip(".,") for t in sentence.split()) if w in vectors]).mean(0)

    static = [torch.nn.functional.cosine_similarity(bag(a), bag(b), dim=0).item() for a, b, _ in STS]
    assert reports["sts_sts"]["static_baseline"]["spearman"] == pytest.approx(
        100 * spearmanr(static, [score for _, _, score in STS]).statistic, abs=1e-4)
    for name, report in reports.items():
        assert report["clip"] == expected_clip and report["clipped_dims"] == outliers["persistent_dims"], name
        # the chance of the §3 detection that chose the clipping, as outliers.json has it (apart: the comparisons
        # below with single commands given that clipping as dims, which no detection chose)
        assert [row.pop("chance_bound") for row in report["layers"]] == [outliers["layers"][0]["chance_bound"]] * (
            LAYERS + 1) and report.pop("chance_warning") == outliers["chance_warning"], name
        assert report["clip_rule"] == summary["clip_rule"], name  # the rule that gave it, not "given dims"
    assert summary["clip_rule"].startswith(f"auto: persistent outlier dims (outliers in at least half of layers "
                                           f"1..{LAYERS}, a number of ours") and "sentences of" in summary["clip_rule"]
    # Figure 6 (right): self-similarity minus the same layer's anisotropy of the same variant, the unadjusted beside
    for name, texts in (("sst2", train), ("qqp", questions)):
        figure, selfsim = summary["figure6"][name], reports[f"self_similarity_{name}"]
        anisotropy = reports[f"anisotropy_{name}"]
        assert set(figure["self_similarity_adjusted"]) == {"raw", "clipped"}
        for key in ("raw", "clipped"):
            for layer in range(LAYERS + 1):
                unadjusted = selfsim["layers"][layer][key]["self_similarity"]
                assert figure["self_similarity"][key][layer] == unadjusted
                assert figure["self_similarity_adjusted"][key][layer] == pytest.approx(
                    unadjusted - anisotropy["layers"][layer][key], abs=2e-6)
                assert figure["anisotropy"][key][layer] == anisotropy["layers"][layer][key]
        # the words come from the whole training set (streamed): every word that occurs in 3 of its sentences where
        # the encoder reads it (the tiny one reads 64 tokens of a sentence)
        qualifying = {word for word, count in document_counts(texts, bert_tok).items() if count >= 3}
        assert len(qualifying) < len({word for word, count in document_counts(texts).items() if count >= 3})
        assert figure["words"]["num_candidates"] == len(qualifying) and set(selfsim["words"]) <= qualifying
        assert figure["words"]["pool_sentences"] == len(texts) and selfsim["adjusted_by"] == f"anisotropy_{name}.json"
    # clipping lowers the planted model's anisotropy, so it raises the adjusted self-similarity more than the raw one
    sst2 = summary["figure6"]["sst2"]
    assert all(sst2["self_similarity_adjusted"]["clipped"][layer] - sst2["self_similarity_adjusted"]["raw"][layer] >
               sst2["self_similarity"]["clipped"][layer] - sst2["self_similarity"]["raw"][layer]
               for layer in range(1, LAYERS + 1))
    # WiC: the training split of a dataset with splits, named with its pair count
    wic_rows = datasets.load_from_disk(str(stand_ins["wic_splits"]))
    assert reports["wic"]["split"] == summary["table1_wic"]["split"] == "train"
    assert summary["table1_wic"]["num_pairs"] == len(wic_rows["train"]) == 8
    markdown = (out / "paper.md").read_text()
    assert f"{stand_ins['wic_splits']}, its 'train' split: 8 pairs" in markdown
    assert "| layer | sst2 anisotropy raw | sst2 anisotropy clipped | sst2 adjusted self-sim raw |" in markdown
    lines = markdown.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| layer | sst2 anisotropy raw"))
    row = lines[header + 4]  # the header, its rule, layers 0 and 1, then layer 2
    assert row.startswith("| 2 |")
    assert f"{sst2['self_similarity_adjusted']['raw'][2]:.3f}" in row.split(" | ")[3]
    assert "Outliers (§3) detected on 51 sentences of SST-2 and 40 sentences of QQP" in markdown
    words = summary["figure6"]["sst2"]["words"]
    assert (f"SST-2: 4 words of the {words['num_candidates']} that occur in at least 3 of its 60 sentences, 3 contexts "
            f"each ({words['num_sentences']} sentences encoded; words lowercased (the tokenizer lowercases))") in markdown
    assert words["word_case"] == "lowercased (the tokenizer lowercases)"  # the tiny BERT's uncased WordPiece
    # each report equals the single subcommand run on the same data with the same clipping
    single = tmp_path / "single"
    assert analyze.main(["anisotropy", *map(str, common), "--data", str(stand_ins["sst2"]), "--clip", expected_clip,
                         "--output_dir", str(single / "anisotropy")]) == 0  # SST-2's train split, the same sample
    alone = json.loads((single / "anisotropy" / "anisotropy.json").read_text())
    assert alone["layers"] == reports["anisotropy_sst2"]["layers"]
    pairs = [str(option) for option in common[:-2]]  # wic reads every pair: no --max_sentences
    assert analyze.main(["wic", *pairs, "--data", str(stand_ins["wic_splits"]), "--clip", expected_clip,
                         "--output_dir", str(single / "wic")]) == 0
    wic = json.loads((single / "wic" / "wic.json").read_text())
    assert wic["layers"] == reports["wic"]["layers"] and summary["table1_wic"]["raw"] == wic["best"]

    # §3's position probe on SST-2's own splits, the classifiers with the paper's clipping
    probe = json.loads((out / "position_probe" / "position_probe.json").read_text())
    assert probe["splits_from"] == {split: f"{stand_ins['sst2']} split {name!r}" for split, name in
                                    (("train", "train"), ("val", "validation"), ("test", "test"))}
    assert probe["splits"]["test"]["sentences"] == 15 and probe["splits"]["train"]["sentences"] == 60  # all of it
    sst2 = json.loads((out / "classifier_sst2" / "classifier.json").read_text())
    assert "(its 'test' split is unlabelled)" in sst2["splits_from"]["test"]
    assert sst2["splits"]["test"]["sentences"] == 15 and sst2["clip"] == expected_clip
    assert sst2["clipped_dims_per_layer"] == {str(layer): outliers["persistent_dims"] for layer in range(1, LAYERS + 1)}
    imdb = json.loads((out / "classifier_imdb" / "classifier.json").read_text())
    assert imdb["splits_from"]["val"].startswith("10% of") and imdb["splits"]["test"]["sentences"] == 20
    for task, report in (("sst2", sst2), ("imdb", imdb)):
        row = summary["table3_classifiers"][task]
        best = max((r for r in report["layers"] if r["layer"] >= 1), key=lambda r: (r["val_accuracy"], -r["layer"]))
        assert (row["best_layer"], row["raw"], row["clipped"]) == (best["layer"], best["accuracy"],
                                                                   best["accuracy_clipped"])
        assert (row["control"], row["selectivity"]) == (best["control_accuracy"], best["selectivity"])
        assert row["selectivity"] == pytest.approx(row["raw"] - row["control"])
    # the control task beside the random-init encoder: per layer, selectivity = accuracy - control accuracy
    section = summary["section3_position_probe"]
    for entry, row in zip(section["layers"], probe["layers"], strict=True):
        assert (entry["control_accuracy"], entry["selectivity"]) == (row["control_accuracy"], row["selectivity"])
        assert entry["selectivity"] == pytest.approx(entry["accuracy"] - entry["control_accuracy"])
    markdown = (out / "paper.md").read_text()
    assert "| layer | accuracy | random-init encoder | control task | selectivity |" in markdown
    assert "| task | best layer (validation) | raw | clipped | control task | selectivity |" in markdown
    for heading in ("## §3 Outlier neurons", "## §3 Position probe", "## §4.1 Anisotropy", "## Table 1: WiC",
                    "## Table 2: STS", "## Table 3"):
        assert heading in markdown
    for figure in ("outliers/mean_vectors.png", "outliers/position_embeddings.png", "figure6.png",
                   "position_probe/outlier_contributions.png", "anisotropy_sst2.png", "wic.png"):
        assert (out / figure).read_bytes()[:4] == b"\x89PNG", figure
        assert figure.split("/")[-1] in markdown or figure in ("anisotropy_sst2.png", "wic.png")
    # Figure 6 as drawn: per set, the anisotropy and the adjusted self-similarity (self-similarity minus the same
    # layer's anisotropy, subtracted here) per layer, raw and clipped
    drawn = panels(saved["figure6.png"])
    assert [panel["title"] for panel in drawn] == ["anisotropy (sst2)", "self-similarity - anisotropy (sst2)",
                                                   "anisotropy (qqp)", "self-similarity - anisotropy (qqp)"]
    for index, name in enumerate(("sst2", "qqp")):
        anisotropy, selfsim = reports[f"anisotropy_{name}"]["layers"], reports[f"self_similarity_{name}"]["layers"]
        for key in ("raw", "clipped"):
            same(drawn[2 * index]["lines"][key], range(LAYERS + 1), [row[key] for row in anisotropy])
            same(drawn[2 * index + 1]["lines"][key], range(LAYERS + 1),
                 [own[key]["self_similarity"] - row[key] for own, row in zip(selfsim, anisotropy)], atol=2e-6)
        assert sorted(drawn[2 * index]["lines"]) == sorted(drawn[2 * index + 1]["lines"]) == ["clipped", "raw"]


def paper_keys(rows: list[dict], paper_rows: list[dict]) -> list[dict]:
    """`analyze.py outliers`' layer rows cut to the keys of the paper's (outliers alone adds massive activations,
    attention sinks and magnitude outliers, beyond the paper)."""
    assert len(paper_rows) == LAYERS + 1  # every hidden-state layer: an empty report compares equal to nothing
    return [{key: row[key] for key in paper_row} for row, paper_row in zip(rows, paper_rows, strict=True)]


def test_paper_refuses_bad_input_before_writing(stand_ins, tmp_path, capfd):
    out = tmp_path / "paper"
    unlabelled = tmp_path / "unlabelled.txt"  # sentences without labels: no option of paper names another column
    unlabelled.write_text("".join(f"{t}\n" for t in corpus_sentences(40, start=300)), encoding="utf-8")
    for argv, message in ((["--sst2", tmp_path / "missing"], "data path not found"),
                          (["--qqp", tmp_path / "missing.csv"], f"data path not found: {tmp_path / 'missing.csv'}"),
                          (["--outlier_sentences", "0"], "--outlier_sentences must be positive, got 0"),
                          (["--sst2", "none"], "--sst2 and --qqp are both none: the outliers (§3) need"),
                          # never a set named none (a preset and a file that is not there: refused before either is read)
                          (["--sts", "none", "stsb", tmp_path / "missing.tsv"], "--sts: none cannot be combined with "
                           f"other sets (got: none stsb {tmp_path / 'missing.tsv'})"),
                          (["--sts", "stsb", "none"], "--sts: none cannot be combined with other sets (got: stsb none)"),
                          (["--clip", "9:1"], "--clip layer 9 is outside the model's layers 0..3"),
                          (["--wic", stand_ins["sts"]], "is not in WiC format"),
                          (["--static", tmp_path / "missing.vec"], f"static vectors file not found: {tmp_path / 'missing.vec'}"),
                          (["--static_lowercase"], "--static_lowercase looks up the words of --static: give --static"),
                          (["--sst2", unlabelled], f"no label column 'label' in {unlabelled} (columns: ['text']); the "
                           "paper's classifier on --sst2 reads its labels from it (or --sst2 none)")):
        code = analyze.main(["paper", "--encoder", str(stand_ins["encoder"]), "--no_progress", "--num_words", "4",
                             "--min_sentences", "3", "--sst2", str(stand_ins["sst2"]), "--qqp", "none", "--sts",
                             "--imdb", "none", "--sst5", "none", "--wic", "none",
                             *map(str, argv), "--output_dir", str(out)])
        errors = [line for line in capfd.readouterr().err.splitlines() if "error:" in line]
        assert code == 2 and len(errors) == 1 and message in errors[0], (argv, errors)
        assert not out.exists()


@pytest.mark.slow
def test_paper_without_sst2_finds_the_outliers_on_qqp_alone(stand_ins, tmp_path):
    out = tmp_path / "paper"
    assert analyze.main(["paper", "--encoder", str(stand_ins["encoder"]), "--no_progress", "--num_words", "4",
                         "--min_sentences", "3", "--sst2", "none", "--qqp", str(stand_ins["qqp"]), "--wic", "none",
                         "--sts", "none", "--imdb", "none", "--sst5", "none", "--outlier_sentences", "30", "--seed",
                         "1", "--output_dir", str(out)]) == 0  # --sts none: as the other sets' none
    summary = json.loads((out / "paper.json").read_text())
    assert summary["section3_sentences"] == {"qqp": 30} and summary["section3_position_probe"] is None
    assert set(summary["figure6"]) == {"qqp"} and not (out / "position_probe").exists()
    with (stand_ins["qqp"]).open(newline="", encoding="utf-8") as handle:
        questions = [row["question1"] for row in csv.DictReader(handle)]
    together = tmp_path / "qqp.txt"
    together.write_text("\n".join(sample_texts(iter(questions), 30, 2)) + "\n")  # QQP's seed: --seed + 1
    assert analyze.main(["outliers", "--encoder", str(stand_ins["encoder"]), "--no_progress", "--data", str(together),
                         "--max_sentences", "0", "--output_dir", str(tmp_path / "direct")]) == 0
    direct = json.loads((tmp_path / "direct" / "outliers.json").read_text())
    outliers = json.loads((out / "outliers" / "outliers.json").read_text())
    assert outliers["layers"] == paper_keys(direct["layers"], outliers["layers"])
    markdown = (out / "paper.md").read_text()
    assert "(skipped: --sst2 none)" in markdown and "Outliers (§3) detected on 30 sentences of QQP (30 asked of each)" \
        in markdown
    assert "STS skipped (no --sts sets)" in markdown and not any(name.startswith("sts") for name in summary)


def test_splits_come_from_a_local_dataset_with_its_own_splits(stand_ins, tmp_path):
    """train / validation / test as the dataset has them; GLUE's hidden test labels make the classifier test on
    validation and carve its validation out of train; a dataset without validation gets 10% of train."""
    encoder = str(stand_ins["encoder"])
    positions = PositionDataModule(source=str(stand_ins["sst2"]), encoder=encoder, progress=False)
    split = positions.read_splits()
    rows = datasets.load_from_disk(str(stand_ins["sst2"]))
    assert {name: split.texts[name] for name in ("train", "val", "test")} == {
        "train": rows["train"]["sentence"], "val": rows["validation"]["sentence"], "test": rows["test"]["sentence"]}
    classes = ClassificationDataModule(source=str(stand_ins["sst2"]), encoder=encoder, progress=False).read_splits()
    assert classes.texts["test"] == rows["validation"]["sentence"]  # the unlabelled test split is replaced
    assert sorted(classes.texts["train"] + classes.texts["val"]) == sorted(rows["train"]["sentence"])
    assert len(classes.texts["val"]) == round(0.1 * 60)
    imdb = ClassificationDataModule(source=str(stand_ins["imdb"]), encoder=encoder, progress=False).read_splits()
    imdb_rows = datasets.load_from_disk(str(stand_ins["imdb"]))
    assert imdb.texts["test"] == imdb_rows["test"]["text"] and len(imdb.texts["val"]) == 5
    with pytest.raises(Exception, match="has no split 'dev'"):
        PositionDataModule(source=str(stand_ins["sst2"]), encoder=encoder, val_split="dev").read_splits()


def test_the_section_3_sample_takes_outlier_sentences_from_each_set_and_a_short_one_whole(tmp_path):
    """--outlier_sentences N from each of SST-2 and QQP (the paper's 10k of both): a seeded sample of each, SST-2's
    first; a set shorter than N is used whole and not topped up from the other (also when the other is none), and
    paper.md says how many were used."""
    from types import SimpleNamespace

    from analyses.paper import outlier_sample
    from analyses.paper_report import sample_line

    sst2, qqp = corpus_sentences(30, start=900), corpus_sentences(10, start=1000)
    (tmp_path / "sst2.txt").write_text("\n".join(sst2) + "\n", encoding="utf-8")
    with (tmp_path / "qqp.csv").open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([("question1", "question2"), *((q, "other") for q in qqp)])
    both = {"sst2": (str(tmp_path / "sst2.txt"), None), "qqp": (str(tmp_path / "qqp.csv"), "question1")}
    args = SimpleNamespace(outlier_sentences=12, seed=3)
    sentences, used = outlier_sample(args, both)
    assert used == {"sst2": 12, "qqp": 10}  # QQP has 10 of the 12 asked: all of them, nothing more
    assert sentences == sample_texts(iter(sst2), 12, 3) + qqp
    assert len(set(sentences[:12])) == 12 and set(sentences[:12]) <= set(sst2)
    assert sample_line(used, 12) == "12 sentences of SST-2 and 10 sentences of QQP (12 asked of each; QQP has only 10: " \
                                    "used whole)"
    alone, used = outlier_sample(args, {"qqp": both["qqp"]})  # SST-2 none: QQP is not topped up to 12 either
    assert used == {"qqp": 10} and alone == qqp
    assert sample_line({"sst2": 12, "qqp": 12}, 12) == "12 sentences of SST-2 and 12 sentences of QQP (12 asked of each)"


def test_text_column_names_sst2s_column_for_its_sentences_and_its_probes(tmp_path, bert_tok, monkeypatch):
    """`paper --text_column body`: SST-2's sentences (§3, §4.1) and its position probe and classifier read the column
    named, which auto-detection cannot find among several text columns (the error says to pass --text_column);
    IMDB and SST-5 still detect theirs."""
    from analyses import paper

    texts = corpus_sentences(8, start=400)
    sst2 = tmp_path / "sst2.csv"
    with sst2.open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([("body", "title", "label"), *((t, f"title {i}", i % 2)
                                                                     for i, t in enumerate(texts))])
    argv = ["paper", "--sst2", str(sst2), "--qqp", "none", "--wic", "none", "--imdb", "none", "--sts", "none",
            "--sst5", str(tmp_path / "sst5.jsonl"), "--output_dir", str(tmp_path / "out")]
    (tmp_path / "sst5.jsonl").write_text("".join(json.dumps({"text": t, "label": 1}) + "\n" for t in texts))
    args = analyze.build_parser().parse_args([*argv, "--text_column", "body"])
    analyze.validate(args)
    inputs = paper.read_inputs(args)
    assert sorted(inputs.sst2) == sorted(texts) and inputs.sources["sst2"] == (str(sst2), "body")
    read = {}

    def recorded(args, model, data, output_dir):
        read[Path(output_dir).name] = (data.hparams.source, data.hparams.text_column)
        return {}

    monkeypatch.setattr(paper, "train_probe", recorded)
    paper.probes(args, encoder=None, clip="none", stage=tmp_path)
    assert read == {"position_probe": (str(sst2), "body"), "classifier_sst2": (str(sst2), "body"),
                    "classifier_sst5": (str(tmp_path / "sst5.jsonl"), None)}
    detected = analyze.build_parser().parse_args(argv)
    analyze.validate(detected)
    with pytest.raises(analyze.UserError, match="no text column .* pass --text_column"):
        paper.read_inputs(detected)


@pytest.mark.parametrize("table", ["learned", "zeros"])
def test_paper_md_links_figures_3_4_only_when_there_is_a_position_table_to_draw(table, tmp_path, bert_tok,
                                                                                 sentences_file):
    """outlier_figures writes position_embeddings.png only for a model with a (non-zero) position table; paper.md links
    it then, and otherwise says why there is none instead of a link to a file that is not there."""
    from types import SimpleNamespace

    from analyses.paper_report import paper_markdown, paper_summary

    def zero_table(model):
        model.embeddings.position_embeddings.weight.zero_()

    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok, plant=zero_table if table == "zeros" else None)
    out = tmp_path / "outliers"
    assert analyze.main(["outliers", "--encoder", str(encoder), "--data", str(sentences_file), "--no_progress",
                         "--output_dir", str(out)]) == 0
    report = json.loads((out / "outliers.json").read_text())
    drawn = (out / "position_embeddings.png").exists()
    assert drawn is (table == "learned")
    args = SimpleNamespace(encoder=str(encoder), seed=0, sst2="sst2", qqp="none", wic="none", sts=[], imdb="none",
                           sst5="none")
    summary = paper_summary({"outliers": {**report, "sentences_from": {"sst2": 4}, "sentences_asked": 4}}, args,
                            "none", [])
    markdown = paper_markdown(summary)
    assert ("outliers/position_embeddings.png" in markdown) is drawn
    assert summary["section3_outliers"]["position_figure"] is drawn
    if not drawn:
        assert "(no Figures 3-4: the position-embedding table is all zeros" in markdown
