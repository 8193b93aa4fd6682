"""`probe.py fit` end to end on the packaged MiniLM against a direct computation, and every bad input."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from transformers import AutoModel, AutoTokenizer

import probe
from datamodules.probing import ClassificationDataModule, PositionDataModule
from lightning_modules.linear_probes import FeatureSpec
from lightning_modules.probes import PositionProbe, SentenceClassifier
from metrics.neuron_stats import NeuronStatistics
from metrics.outliers import detect_outliers, persistent_dims
from tests.figure_data import panels, same, saved_figures
from tests.tiny import LAYERS, corpus_sentences, save_tiny_encoder

ROOT = Path(__file__).resolve().parent.parent
QUIET = ["--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.accelerator", "cpu",
         "--trainer.enable_model_summary", "false", "--data.progress", "false"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matrices: one thread is faster


def run_cli(config: str, *argv) -> probe.ProbeCLI:
    return probe.cli_main(["fit", "--config", str(ROOT / "configs" / "probe" / f"{config}.yaml"), *QUIET,
                           *map(str, argv)])


def direct_hidden(model_path: str, texts: list[str], max_length: int) -> list[torch.Tensor]:
    """Each sentence's hidden states [layers, tokens, hidden] from transformers itself, one sentence at a time."""
    tokenizer, model = AutoTokenizer.from_pretrained(model_path), AutoModel.from_pretrained(model_path).eval()
    out = []
    with torch.no_grad():
        for text in texts:
            inputs = tokenizer(text, truncation=True, max_length=max_length, return_tensors="pt")
            out.append(torch.stack(model(**inputs, output_hidden_states=True).hidden_states)[:, 0])
    return out


def check_accuracy_figure(drawn: list[dict], series: dict, baselines: dict) -> None:
    """accuracy_by_layer.png: a line per series, the test accuracies computed directly, and the baselines dashed."""
    (panel,) = drawn
    assert list(panel["lines"]) == list(series)
    for name, values in series.items():
        same(panel["lines"][name], range(len(values)), values)
    assert [(label.split(" (")[0], y.tolist()) for label, _, y in panel["dashed"]] == \
        [(name, pytest.approx([value] * 2)) for name, value in baselines.items()]


@pytest.mark.slow
def test_position_probe_cli_on_minilm_matches_direct_computation(minilm_path, tmp_path, capsys, monkeypatch):
    from lightning_modules import probes

    saved = saved_figures(monkeypatch, probes)
    texts = corpus_sentences(40, start=3000)
    data = tmp_path / "s.txt"
    data.write_text("\n".join(texts) + "\n", encoding="utf-8")
    out = tmp_path / "run"
    cli = run_cli("position", "--model.encoder", minilm_path, "--data.source", data, "--data.max_length", 32,
                  "--data.batch_size", 8, "--trainer.max_epochs", 2, "--trainer.default_root_dir", out)
    report = json.loads((out / "position_probe.json").read_text())
    dm, model = cli.datamodule, cli.model
    assert report["encoder"] == minilm_path and report["max_positions"] == 300 and report["seed"] == 0
    assert sorted(sum(dm.texts.values(), [])) == sorted(texts)  # the splits partition the sentences
    assert {s: report["splits"][s]["sentences"] for s in dm.texts} == {s: len(t) for s, t in dm.texts.items()}

    # cached features = transformers' hidden states of the test sentences, token by token
    direct = torch.cat(direct_hidden(minilm_path, dm.texts["test"], 32), dim=1)  # [7, tokens, 384]
    cached = dm.stores["test"].features()  # [14 slots: 7 encoder layers then 7 random-init layers, tokens, 384]
    torch.testing.assert_close(cached[:7], direct, rtol=1e-4, atol=1e-4)
    positions = dm.stores["test"].labels
    lengths = [len(ids) for ids in AutoTokenizer.from_pretrained(minilm_path)(
        dm.texts["test"], truncation=True, max_length=32)["input_ids"]]
    assert positions.tolist() == [p for n in lengths for p in range(n)]

    weight = model.weight.detach()  # [21, 384, 300]: encoder, random-init, then the control task's probes
    control = dm.stores["test"].control  # a random position per token type (Hewitt & Liang)
    targets = torch.stack([positions] * 14 + [control] * 7)
    accuracy = (torch.einsum("sth,shp->stp", torch.cat([cached, cached[:7]]), weight).argmax(-1) == targets
                ).double().mean(1)
    assert [row["accuracy"] for row in report["layers"]] == pytest.approx(accuracy[:7].tolist())
    random = report["baselines"]["random_encoder"]["layers"]
    assert [row["accuracy"] for row in random] == pytest.approx(accuracy[7:14].tolist())
    assert [row["control_accuracy"] for row in report["layers"]] == pytest.approx(accuracy[14:].tolist())
    assert [row["selectivity"] for row in report["layers"]] == pytest.approx((accuracy[:7] - accuracy[14:]).tolist())
    majority = torch.bincount(dm.stores["train"].labels).argmax()
    assert report["baselines"]["majority"] == pytest.approx(float((positions == majority).double().mean()))

    contributions = np.load(out / "contributions.npy")
    by_position = np.load(out / "contributions_by_position.npy")
    c = (weight[:7][:, :, positions].transpose(1, 2) * cached[:7]).abs()  # [7, tokens, 384]
    np.testing.assert_allclose(contributions, c.mean(1).numpy(), rtol=1e-4, atol=1e-7)
    assert by_position.shape == (7, 300, 384)
    np.testing.assert_allclose(by_position[:, 3], c[:, positions == 3].mean(1).numpy(), rtol=1e-4, atol=1e-7)

    stats = NeuronStatistics(7, 384)
    stats.update(dm.stores["train"].features()[:7])
    detected = detect_outliers(stats.compute())  # the paper's rule; all 7 layers cached: index = layer
    assert report["outlier_dims"] == persistent_dims(detected)  # outliers of at least half of layers 1..6
    assert report["outlier_layers"] == {str(layer.layer): layer.outlier_dims for layer in detected}
    for row, vector in zip(report["layers"], contributions):
        assert row["top_contribution_dims"] == np.argsort(-vector, kind="stable")[:10].tolist()
        for dim, entry in row["outlier_dims"].items():
            assert entry["rank"] == 1 + int((vector > vector[int(dim)]).sum())
            assert entry["mean_contribution"] == pytest.approx(float(vector.mean()), rel=1e-5)
    # the figures, read back: accuracies and contributions as computed directly above
    assert sorted(saved) == sorted(p.name for p in out.glob("*.png")) == sorted(
        ["accuracy_by_layer.png", "contributions_by_layer.png", "contributions_by_position.png",
         "outlier_contributions.png"])
    check_accuracy_figure(panels(saved["accuracy_by_layer.png"]), {
        "encoder": accuracy[:7].tolist(), "random-init encoder": accuracy[7:14].tolist(),
        "control task (Hewitt & Liang)": accuracy[14:].tolist(),
        "selectivity (task - control)": (accuracy[:7] - accuracy[14:]).tolist()},
        {"majority": float((positions == majority).double().mean()),
         "chance": 1 / dm.stores["train"].labels.unique().numel()})
    (layers_image,) = panels(saved["contributions_by_layer.png"])[0]["images"]  # [layer, dim]
    np.testing.assert_allclose(layers_image, c.mean(1).numpy(), rtol=1e-4, atol=1e-7)
    seen = int(positions.max()) + 1  # the positions the test sentences hold: [layer][position, dim]
    drawn = panels(saved["contributions_by_position.png"])
    assert [panel["title"] for panel in drawn] == [f"layer {layer}" for layer in range(7)]
    for layer, panel in enumerate(drawn):
        (image,) = panel["images"]
        expected = torch.stack([c[layer, positions == p].mean(0) for p in range(seen)])
        np.testing.assert_allclose(image, expected.numpy(), rtol=1e-4, atol=1e-7)
    (panel,) = panels(saved["outlier_contributions.png"])
    outliers = report["outlier_dims"][:8]
    assert outliers and list(panel["lines"]) == [*(f"dim {d}" for d in outliers), "mean over neurons"]
    for d in outliers:
        same(panel["lines"][f"dim {d}"], range(7), c.mean(1)[:, d].tolist(), rtol=1e-4)
    same(panel["lines"]["mean over neurons"], range(7), c.mean(1).mean(1).tolist(), rtol=1e-4)
    printed = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(printed) if line.split()[:2] == ["layer", "accuracy"])
    assert printed[header].split()[-2:] == ["control", "selectivity"]
    for line, layer in zip(printed[header + 1:header + 8], range(7)):  # the console's table, against the direct probes
        cells = line.split()
        assert int(cells[0]) == layer and float(cells[1]) == pytest.approx(float(accuracy[layer]), abs=5e-4)
        assert float(cells[-2]) == pytest.approx(float(accuracy[14 + layer]), abs=5e-4)
        assert float(cells[-1]) == pytest.approx(float(accuracy[layer] - accuracy[14 + layer]), abs=1e-3)


@pytest.mark.slow
def test_classifier_cli_on_minilm_matches_direct_computation(minilm_path, tmp_path, monkeypatch):
    from lightning_modules import probes

    saved = saved_figures(monkeypatch, probes)
    texts = corpus_sentences(60, start=4000)
    median = sorted(map(len, texts))[30]
    data = tmp_path / "labelled.csv"
    with data.open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([("sentence", "kind"), *((t, "long" if len(t) > median else "short")
                                                               for t in texts)])
    out = tmp_path / "run"
    cli = run_cli("classify", "--model.encoder", minilm_path, "--data.source", data, "--data.label_column", "kind",
                  "--data.max_length", 32, "--data.batch_size", 16, "--trainer.max_epochs", 2,
                  "--trainer.default_root_dir", out)
    report = json.loads((out / "classifier.json").read_text())
    dm, model = cli.datamodule, cli.model
    assert report["classes"] == ["long", "short"] and report["clipped_dims_source"] == "detected"
    assert report["clip_rule"].startswith("auto: persistent")
    assert "(6 <= 12 layers, a threshold of ours" in report["clip_rule"]

    pooled = torch.stack([h.mean(1) for h in direct_hidden(minilm_path, dm.texts["test"], 32)], dim=1)  # [7, n, 384]
    cached = dm.stores["test"].features()
    torch.testing.assert_close(cached[:7], pooled, rtol=1e-4, atol=1e-4)
    labels = dm.stores["test"].labels
    truth = ["long" if len(t) > median else "short" for t in dm.texts["test"]]
    assert [report["classes"][i] for i in labels] == truth

    assert model.bias is None and report["bias"] is False  # the paper's classifiers have no bias
    weight = model.weight.detach()  # [28 slots, 384, 2]: encoder, random, clipped, control
    persistent = report["clipped_dims"]  # --clip auto: the persistent dims, zeroed in layers 1..6, never in 0
    assert report["clipped_dims_per_layer"] == {str(layer): persistent for layer in range(1, 7)} if persistent else {}
    keep = torch.ones(7, 1, 384)
    keep[1:, :, persistent] = 0
    features = torch.cat([cached, cached[:7] * keep, cached[:7]])
    targets = torch.stack([labels] * 21 + [dm.stores["test"].control] * 7)  # the control task: a class per sentence
    accuracy = (torch.einsum("snh,shc->snc", features, weight).argmax(-1) == targets).double().mean(1)
    assert [row["accuracy"] for row in report["layers"]] == pytest.approx(accuracy[:7].tolist())
    assert [row["accuracy_clipped"] for row in report["layers"]] == pytest.approx(accuracy[14:21].tolist())
    assert [row["control_accuracy"] for row in report["layers"]] == pytest.approx(accuracy[21:].tolist())
    assert [row["selectivity"] for row in report["layers"]] == pytest.approx((accuracy[:7] - accuracy[21:]).tolist())
    random = report["baselines"]["random_encoder"]["layers"]
    assert [row["accuracy"] for row in random] == pytest.approx(accuracy[7:14].tolist())
    majority = torch.bincount(dm.stores["train"].labels, minlength=2).argmax()
    assert report["majority_baseline"] == pytest.approx(float((labels == majority).double().mean()))
    assert (out / "accuracy_by_layer.png").read_bytes()[:4] == b"\x89PNG"
    check_accuracy_figure(panels(saved["accuracy_by_layer.png"]), {
        "encoder": accuracy[:7].tolist(), "encoder, outliers clipped": accuracy[14:21].tolist(),
        "random-init encoder": accuracy[7:14].tolist(), "control task (Hewitt & Liang)": accuracy[21:].tolist(),
        "selectivity (task - control)": (accuracy[:7] - accuracy[21:]).tolist()},
        {"majority": float((labels == majority).double().mean()), "chance": 0.5})  # both classes in training


def test_fast_dev_run_reports_the_one_test_batch(tmp_path, bert_tok):
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    data = tmp_path / "s.txt"
    data.write_text("\n".join(corpus_sentences(40)) + "\n", encoding="utf-8")
    cli = run_cli("position", "--model.encoder", encoder, "--data.source", data, "--data.batch_size", 3,
                  "--trainer.fast_dev_run", "true", "--trainer.default_root_dir", tmp_path / "out")
    report = json.loads((tmp_path / "out" / "position_probe.json").read_text())
    features, positions, control = next(iter(cli.datamodule.test_dataloader()))  # fast_dev_run tests one batch
    layers = LAYERS + 1
    features = torch.cat([features, features[:layers]])  # the control task's probes read the encoder's features
    predicted = torch.einsum("sth,shp->stp", features, cli.model.weight.detach()).argmax(-1)
    accuracy = (predicted == torch.stack([positions] * (2 * layers) + [control] * layers)).double().mean(1)
    assert [row["accuracy"] for row in report["layers"]] == pytest.approx(accuracy[:layers].tolist())
    assert [row["control_accuracy"] for row in report["layers"]] == pytest.approx(accuracy[2 * layers:].tolist())


# The paper's settings (the issue, from Luo et al. 2021 §3 and §4.4): (model, data module, batch size, data source,
# held-out test split); every config trains 10 epochs with Adam; the position probe predicts 300 positions.
PAPER = {
    "position": (PositionProbe, PositionDataModule, 128, "glue/sst2"),
    "sst2": (SentenceClassifier, ClassificationDataModule, 768, "glue/sst2"),
    "imdb": (SentenceClassifier, ClassificationDataModule, 128, "imdb"),
    "sst5": (SentenceClassifier, ClassificationDataModule, 1536, "SetFit/sst5"),
    "classify": (SentenceClassifier, ClassificationDataModule, 128, None),
}


@pytest.mark.parametrize("config", sorted(PAPER))
def test_each_config_loads_through_the_cli_with_the_papers_settings(config, tmp_path):
    path = ROOT / "configs" / "probe" / f"{config}.yaml"
    cli = probe.cli_main(["--config", str(path), "--trainer.default_root_dir", str(tmp_path)], run=False)
    model_class, data_class, batch_size, source = PAPER[config]
    model, dm = cli.model, cli.datamodule
    assert type(model) is model_class and type(dm) is data_class
    assert (dm.hparams.batch_size, dm.hparams.source) == (batch_size, source)
    assert dm.hparams.val_split is None and dm.hparams.test_split is None  # the dataset's own splits
    assert cli.trainer.max_epochs == 10 and model.hparams.seed == dm.hparams.seed == 0
    assert cli.trainer.check_val_every_n_epoch == 1  # every epoch validated: the best epoch's weights are tested
    if model_class is SentenceClassifier:
        assert model.hparams.bias is False and model.hparams.clip == "auto"  # W in R^{hidden x n}, persistent dims
    else:
        assert dm.hparams.max_sentences == 0 and dm.max_positions == 300  # every sentence, 300 positions
    written = yaml.safe_load(path.read_text())  # every key of the file reached the objects it configures
    for key, value in written["model"]["init_args"].items():
        assert model.hparams[key] == value, (config, key)
    for key, value in written["data"]["init_args"].items():
        assert dm.hparams[key] == value, (config, key)
    classes = dm.set_classes({split: ["a", "b"] for split in ("train", "val", "test")})[0]
    if config == "position":
        assert classes == list(range(300))
    model.build(FeatureSpec(encoder="e", layers=[0, 1], hidden_size=4, num_classes=len(classes), classes=classes,
                            slots=[("encoder", 0), ("encoder", 1)], outlier_dims=[], outlier_source="given",
                            num_hidden_states=2))
    assert model.weight.shape[1:] == (4, len(classes))  # hidden -> classes, per layer (and clipped twin)
    optimizer = model.configure_optimizers()
    assert type(optimizer) is torch.optim.Adam and optimizer.defaults["lr"] == written["model"]["init_args"]["lr"]


def test_a_config_with_an_unknown_key_is_an_error(tmp_path, capfd):
    text = (ROOT / "configs" / "probe" / "position.yaml").read_text()
    assert "    max_positions: 300" in text
    typo = tmp_path / "typo.yaml"
    typo.write_text(text.replace("    max_positions: 300", "    max_position: 300"))
    with pytest.raises(SystemExit) as exited:
        probe.cli_main(["--config", str(typo), "--trainer.default_root_dir", str(tmp_path / "out")], run=False)
    assert exited.value.code == 2 and "max_position" in capfd.readouterr().err


def test_the_usage_names_the_class_help_and_it_gives_every_option_its_text(capsys):
    """`probe.py fit --model.help lightning_modules.probes.PositionProbe` (and each --model.help / --data.help that
    probe.py's usage names): every option of the class, each followed by the help text of its docstring's Args:."""
    import docstring_parser

    named = [option.split() for option, _ in probe.OVERRIDES if option.startswith(("--model.help", "--data.help"))]
    assert ["--model.help", "lightning_modules.probes.PositionProbe"] in named
    assert ["--model.help", "lightning_modules.probes.SentenceClassifier"] in named
    for flag, class_path in named:
        with pytest.raises(SystemExit) as exited:
            probe.cli_main(["fit", flag, class_path])
        assert exited.value.code == 0
        text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help texts
        module, _, name = class_path.rpartition(".")
        cls = getattr(sys.modules[module], name)
        described = {param.arg_name: " ".join(param.description.split()) for klass in cls.__mro__
                     if klass.__module__.startswith(("datamodules.", "lightning_modules."))
                     for param in docstring_parser.parse(klass.__doc__ or "").params}
        section = flag[2:].split(".")[0]
        options = set(re.findall(rf"--{section}\.(\w+) ", text)) - {"help"}
        assert options and options <= set(described), options - set(described)
        for option in options:  # the option and its metavar (a list's appending form too), then its help text
            assert re.search(rf"--{section}\.{option} \S+(, --\S+ \S+)? {re.escape(described[option][:50])}", text), \
                (name, option)
        if name == "PositionProbe":
            assert "--model.top_k TOP_K contributing dims listed per layer in the report" in text


def _bad_inputs(tmp_path: Path, encoder: Path) -> dict[str, tuple[str, list, str]]:
    good = tmp_path / "good.txt"
    good.write_text("\n".join(corpus_sentences(20)) + "\n", encoding="utf-8")
    few = tmp_path / "few.txt"
    few.write_text("\n".join(corpus_sentences(4)) + "\n", encoding="utf-8")
    labelled = tmp_path / "labelled.csv"
    labelled.write_text("text,label\n" + "".join(f"{t.replace(',', ' ')},{i % 3}\n"
                                                 for i, t in enumerate(corpus_sentences(30))), encoding="utf-8")
    unlabelled = tmp_path / "unlabelled.csv"
    unlabelled.write_text("text,label\nsome words,pos\nmore words,\n", encoding="utf-8")
    return {
        "missing data": ("position", ["--data.source", tmp_path / "nope.txt"], "data path not found"),
        "missing encoder": ("position", ["--model.encoder", tmp_path / "no-model", "--data.source", good],
                            "encoder path not found"),
        "too long": ("position", ["--data.source", good, "--data.max_length", 999],
                     "--data.max_length 999 exceeds the 64 positions"),  # probe.py's option, as the user wrote it
        "empty split": ("position", ["--data.source", few, "--data.test_fraction", 0.1], "split is empty"),
        "missing label": ("classify", ["--data.source", unlabelled], "row 2 has no label"),
        "label outside fixed classes": ("classify", ["--data.source", labelled, "--data.classes", "[0, 1]"],
                                        "unknown label(s) ['2']"),
        "no label column": ("classify", ["--data.source", good], "no label column 'label'"),
        "no steps per block": ("position", ["--data.source", good, "--data.steps_per_block", 0],
                               "--data.steps_per_block must be at least 1, got 0"),
    }


def test_bad_inputs_give_one_line_exit_2_and_write_nothing(tmp_path, bert_tok, capfd):
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    for case, (config, argv, message) in _bad_inputs(tmp_path, encoder).items():
        out = tmp_path / f"out-{case.replace(' ', '-')}"
        if "--model.encoder" not in argv:
            argv = ["--model.encoder", encoder, *argv]
        with pytest.raises(SystemExit) as exited:
            run_cli(config, *argv, "--trainer.default_root_dir", out)
        assert exited.value.code == 2, case
        errors = [line for line in capfd.readouterr().err.splitlines() if "error:" in line]
        assert len(errors) == 1 and errors[0].startswith("probe.py: error:") and message in errors[0], (case, errors)
        assert not out.exists() or not any(out.iterdir()), case


@pytest.mark.slow
def test_console_script_exit_status(tmp_path):
    finished = subprocess.run([sys.executable, str(ROOT / "probe.py"), "fit", "--config",
                               str(ROOT / "configs" / "probe" / "position.yaml"), "--data.source",
                               str(tmp_path / "missing.txt"), "--trainer.default_root_dir", str(tmp_path / "out")],
                              capture_output=True, text=True, cwd=ROOT)
    assert finished.returncode == 2
    assert finished.stderr.strip().splitlines()[-1].startswith("probe.py: error: data path not found")


def test_truncated_sentences_are_said_on_the_console_and_counted_in_the_report(tmp_path, bert_tok):
    """Sentences over --data.max_length tokens are truncated: one warning and the report's num_truncated, both the
    number of sentences whose tokenisation (special tokens included) is longer, counted with the tokenizer directly."""
    import warnings

    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    texts = [text * (1 + i % 3) for i, text in enumerate(corpus_sentences(40))]  # some long, some short
    data = tmp_path / "labelled.csv"
    with data.open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([("text", "label"), *((text, i % 2) for i, text in enumerate(texts))])
    longer = sum(len(bert_tok(text)["input_ids"]) > 32 for text in texts)
    assert 0 < longer < len(texts)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_cli("classify", "--model.encoder", encoder, "--data.source", data, "--data.max_length", 32,
                "--data.random_baseline", "false", "--data.control_task", "false", "--trainer.max_epochs", 1,
                "--trainer.default_root_dir", tmp_path / "out")
    said = [str(w.message) for w in caught if "were truncated" in str(w.message)]
    assert said == [f"{longer} sentences were longer than 32 tokens and were truncated (counted in the report as "
                    "num_truncated)"]
    assert json.loads((tmp_path / "out" / "classifier.json").read_text())["num_truncated"] == longer


def test_a_refusal_in_the_probes_own_setup_writes_nothing(tmp_path, bert_tok, capfd):
    """A clip that zeroes every dim of a layer is refused when the classifier is built, in its setup, after the data
    module's: Lightning would have written config.yaml by then (core/cli.py's AtomicSaveConfig writes it when the stage
    starts), so the run directory stayed with it."""
    narrow = save_tiny_encoder(tmp_path / "narrow", "bert", bert_tok, hidden_size=4, num_attention_heads=1,
                               num_hidden_layers=1, intermediate_size=4)
    labelled = tmp_path / "labelled.csv"
    labelled.write_text("text,label\n" + "".join(f"{t.replace(',', ' ')},{i % 2}\n"
                                                 for i, t in enumerate(corpus_sentences(30))), encoding="utf-8")
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exited:
        run_cli("classify", "--model.encoder", narrow, "--data.source", labelled, "--model.clip", "0,1,2,3",
                "--data.random_baseline", "false", "--trainer.default_root_dir", out)
    assert exited.value.code == 2
    errors = [line for line in capfd.readouterr().err.splitlines() if "error:" in line]
    assert errors == ["probe.py: error: --clip 0,1,2,3 zeroes all 4 dims of layer 1: nothing is left to compare; use "
                      "--clip none or fewer dims"]
    assert not out.exists() or not any(out.rglob("*")), sorted(out.rglob("*"))


@pytest.mark.parametrize("subcommand", ["test", "validate", "predict"])
def test_a_subcommand_other_than_fit_is_refused_rather_than_scoring_untrained_probes(tmp_path, bert_tok, capfd,
                                                                                     subcommand):
    """The probes' weights are kept nowhere: `probe.py test` (validate, predict) would score freshly initialised probes
    and print their accuracies as results (Lightning's table, exit 0). One line, exit 2, nothing written."""
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    good = tmp_path / "good.txt"
    good.write_text("\n".join(corpus_sentences(20)) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exited:
        probe.cli_main([subcommand, "--config", str(ROOT / "configs" / "probe" / "position.yaml"), *QUIET,
                        "--model.encoder", str(encoder), "--data.source", str(good),
                        "--trainer.default_root_dir", str(out)])
    assert exited.value.code == 2
    errors = [line for line in capfd.readouterr().err.splitlines() if "error:" in line]
    assert errors == [f"probe.py: error: probe.py {subcommand} is not supported: the probes are trained, validated, "
                      "tested and reported in one probe.py fit run (their weights are not kept): run probe.py fit"]
    assert not out.exists()


def test_the_shuffle_of_each_epoch_is_torchs_random_sampler_and_follows_from_the_epoch_alone():
    """ShuffledBatches: the batches RandomSampler(generator seeded) + BatchSampler give, epoch after epoch (the order
    every probe run trained in before); and epoch e's from a new sampler told the epoch (a resumed run's)."""
    from torch.utils.data import BatchSampler, RandomSampler

    from datamodules.sampling import ShuffledBatches

    torchs = BatchSampler(RandomSampler(range(23), generator=torch.Generator().manual_seed(5)), 4, drop_last=False)
    epochs = [list(torchs) for _ in range(3)]
    ours = ShuffledBatches(23, 4, seed=5)
    assert [list(ours) for _ in range(3)] == epochs and len(ours) == len(torchs) == 6
    resumed = ShuffledBatches(23, 4, seed=5)
    resumed.set_epoch(2)
    assert list(resumed) == epochs[2] and epochs[2] != epochs[1]


@pytest.mark.slow
def test_a_probe_run_resumed_from_an_epoch_checkpoint_reports_what_the_uninterrupted_run_does(tmp_path, bert_tok):
    """probe.py fit with its checkpoints on (--trainer.enable_checkpointing true), 1 epoch, then --ckpt_path that
    epoch's checkpoint to 3: the report of 3 epochs straight. Before, the resumed run read epoch 0's order again and
    forgot each probe's best validation so far (tested with an epoch's weights the straight run did not choose)."""
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    data = tmp_path / "s.txt"
    data.write_text("\n".join(corpus_sentences(60)) + "\n", encoding="utf-8")

    def fit(root: Path, epochs: int, *extra) -> dict:
        run_cli("position", "--model.encoder", encoder, "--data.source", data, "--data.batch_size", 8,
                "--trainer.max_epochs", epochs, "--trainer.enable_checkpointing", "true", "--model.lr", "0.2",
                "--trainer.default_root_dir", root, *extra)
        return json.loads((root / "position_probe.json").read_text())

    straight = fit(tmp_path / "straight", 3)
    fit(tmp_path / "resumed", 1)
    [first] = (tmp_path / "resumed" / "checkpoints").glob("epoch=0-*.ckpt")
    resumed = fit(tmp_path / "resumed", 3, "--ckpt_path", first)
    assert resumed == straight
    assert 0 in {row["best_epoch"] for row in straight["layers"]}  # some probe's best epoch is the one before the stop
