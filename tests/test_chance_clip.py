"""The chance bound wherever outliers are detected on the user's sample to decide what to clip (--clip auto in the
evaluations, the probes), and counts that agree with their nouns (core/wording.py)."""

from __future__ import annotations

import json

import pytest

import analyze
from core.wording import plural
from metrics.null import chance_outlier_bound, verdict_text
from metrics.outliers import LayerOutliers, OutlierRule, chance_warning
from metrics.ranks import ranked
from tests.test_outliers import PE_DIM, plant
from tests.tiny import HIDDEN, LAYERS, MAX_POSITIONS, save_tiny_encoder

SHORT = ["the cat sat.", "the dog ran."]  # a dozen token vectors: chance alone flags a dim of 32 with p ~ 0.4


@pytest.fixture
def planted_bert(tmp_path, bert_tok):
    """A tiny BERT whose PE_DIM holds the max of nearly every token in every layer: outliers in all non-input layers."""
    return save_tiny_encoder(tmp_path / "bert", "bert", bert_tok, plant=lambda model: plant(model, 0))


def token_count(path, lines: list[str]) -> int:
    """The token vectors the rule counts, by the tokenizer itself: every token of every line, special ones included,
    a line cut at the model's MAX_POSITIONS."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return sum(min(len(ids), MAX_POSITIONS) for ids in tokenizer(lines)["input_ids"])


def run(command: str, encoder, data, out, *extra) -> dict:
    code = analyze.main([command, "--encoder", str(encoder), "--data", str(data), "--output_dir", str(out),
                         "--no_progress", *map(str, extra)])
    assert code == 0
    return json.loads((out / f"{command}.json").read_text())


def chance_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if "chance" in line]


def test_clip_auto_on_a_small_sample_reports_the_bound_and_warns_once_as_the_outliers_report_does(
        planted_bert, tmp_path, capsys):
    data = tmp_path / "short.txt"
    data.write_text("\n".join(SHORT) + "\n", encoding="utf-8")
    n = token_count(planted_bert, SHORT)
    bound = chance_outlier_bound(n, HIDDEN, 0.2)  # called directly on the same n, d, s
    assert bound > 0.01
    capsys.readouterr()
    report = run("anisotropy", planted_bert, data, tmp_path / "a", "--num_pairs", 1)
    assert PE_DIM in report["clipped_dims"]  # the detection chose the clipping
    assert [row["chance_bound"] for row in report["layers"]] == [bound] * (LAYERS + 1)
    assert f"rested on {n} token vectors" in report["chance_warning"] and f"up to {bound:.3g}" in report["chance_warning"]
    assert chance_lines(capsys) == [f"warning: {report['chance_warning']}"]  # one line, the report's
    outliers = run("outliers", planted_bert, data, tmp_path / "o")  # the outliers report: the same bound and line
    assert outliers["num_tokens"] == n and outliers["layers"][0]["chance_bound"] == bound
    assert outliers["chance_warning"] == report["chance_warning"]
    capsys.readouterr()
    unclipped = run("anisotropy", planted_bert, data, tmp_path / "n", "--num_pairs", 1, "--clip", "none")
    assert "chance_warning" not in unclipped and all("chance_bound" not in row for row in unclipped["layers"])
    assert chance_lines(capsys) == []  # no detection, nothing to warn about


def test_all_carries_the_bound_in_every_evaluation_and_warns_once(planted_bert, tmp_path, capsys):
    data = tmp_path / "short.txt"
    data.write_text("\n".join(SHORT) + "\n", encoding="utf-8")
    bound = chance_outlier_bound(token_count(planted_bert, SHORT), HIDDEN, 0.2)
    capsys.readouterr()
    code = analyze.main(["all", "--encoder", str(planted_bert), "--data", str(data), "--output_dir", str(tmp_path / "x"),
                         "--no_progress", "--num_pairs", "1", "--num_words", "1", "--min_sentences", "2"])
    assert code == 0
    said = chance_lines(capsys)
    warning = json.loads((tmp_path / "x" / "outliers.json").read_text())["chance_warning"]
    assert warning and said == [f"warning: {warning}"]
    for name in ("anisotropy", "isotropy", "self_similarity"):
        report = json.loads((tmp_path / "x" / f"{name}.json").read_text())
        assert [row["chance_bound"] for row in report["layers"]] == [bound] * (LAYERS + 1), name
        assert report["chance_warning"] == warning, name


def test_clip_auto_on_a_large_sample_reports_a_tiny_bound_and_no_warning(planted_bert, sentences_file, tmp_path,
                                                                         capsys):
    lines = [line for line in sentences_file.read_text().splitlines() if line.strip()]
    n = token_count(planted_bert, lines)
    capsys.readouterr()
    report = run("anisotropy", planted_bert, sentences_file, tmp_path / "a", "--num_pairs", 10)
    assert n > 500
    assert [row["chance_bound"] for row in report["layers"]] == [chance_outlier_bound(n, HIDDEN, 0.2)] * (LAYERS + 1)
    assert report["layers"][0]["chance_bound"] < 1e-20 and report["chance_warning"] is None
    assert chance_lines(capsys) == []


def test_probe_py_on_a_tiny_sample_warns_once(planted_bert, tmp_path, capsys):
    """The position probe's outliers, detected on a training split of a few short sentences: the report's bound is
    chance_outlier_bound of the cached training tokens, and probe.py prints the report's warning once, on stderr."""
    from tests.test_probe_cli import run_cli

    data = tmp_path / "s.txt"
    data.write_text("\n".join(["the cat sat.", "a dog ran.", "we go.", "it is.", "so it was."]) + "\n",
                    encoding="utf-8")
    capsys.readouterr()
    cli = run_cli("position", "--model.encoder", planted_bert, "--data.source", data, "--data.val_fraction", 0.2,
                  "--data.test_fraction", 0.2, "--data.random_baseline", "false", "--data.control_task", "false",
                  "--trainer.fast_dev_run", "true", "--trainer.default_root_dir", tmp_path / "out")
    report = json.loads((tmp_path / "out" / "position_probe.json").read_text())
    count = cli.datamodule.stores["train"].features().shape[1]  # the training split's token vectors
    assert report["outlier_chance_bound"] == chance_outlier_bound(count, HIDDEN, 0.2) > 0.01
    assert f"rested on {count} token vectors" in report["outlier_chance_warning"]
    assert chance_lines(capsys) == [f"warning: {report['outlier_chance_warning']}"]


def test_plural_agrees_with_its_count_and_messages_of_one_say_it_in_the_singular():
    assert [plural(n, "sentence") for n in (0, 1, 2)] == ["0 sentences", "1 sentence", "2 sentences"]
    assert plural(12345, "token", spec=",") == "12,345 tokens" and plural(1, "token", spec=",") == "1 token"
    assert [plural(n, "mini-batch", "mini-batches") for n in (1, 3)] == ["1 mini-batch", "3 mini-batches"]
    assert [plural(n, "sentence was", "sentences were") for n in (1, 2)] == ["1 sentence was", "2 sentences were"]
    assert ranked(2, 1) == "rank 2, tied with 1 other dim" and ranked(1, 383) == "rank 1, tied with 383 other dims"
    assert verdict_text(1, 1) == "beyond the null in 1 of 1 seed"
    layers = [LayerOutliers(0, 0, 1.0, 1, 1.0, []), LayerOutliers(1, 0, 1.0, 1, 1.0, [0])]
    line = chance_warning(layers, 1, 4, OutlierRule())  # one token of width 4: the bound is capped at 1
    assert line.startswith("the outlier rule rested on 1 token vector: ") and "up to 1 (chance_bound" in line
    assert "the outliers of 1 non-input layer and the persistent dims" in line


def test_the_outliers_table_of_one_sentence_says_sentence(planted_bert, tmp_path, capsys):
    data = tmp_path / "one.txt"
    data.write_text("the cat sat.\n", encoding="utf-8")
    capsys.readouterr()
    report = run("outliers", planted_bert, data, tmp_path / "o")
    out = capsys.readouterr().out
    assert report["num_sentences"] == 1
    assert f"on {data}: 1 sentence, {token_count(planted_bert, ['the cat sat.'])} tokens (special" in out



def test_intervene_reports_and_prints_the_outliers_reports_chance_line_once(planted_bert, tmp_path, capsys):
    data = tmp_path / "short.txt"
    data.write_text("\n".join(SHORT) + "\n", encoding="utf-8")
    bound = chance_outlier_bound(token_count(planted_bert, SHORT), HIDDEN, 0.2)  # called directly on the same n, d, s
    outliers = run("outliers", planted_bert, data, tmp_path / "o")
    capsys.readouterr()
    report = run("intervene", planted_bert, data, tmp_path / "i", "--controls", 1, "--num_pairs", 1)
    assert PE_DIM in report["dims"]  # the detection chose what to intervene on
    assert report["chance_bound"] == bound and report["chance_warning"] == outliers["chance_warning"]
    assert chance_lines(capsys) == [f"warning: {report['chance_warning']}"]  # one line, the report's
