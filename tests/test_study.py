"""study.py: a tiny two-arm study (PE and no PE, 4 steps each) end to end, against each arm's own analyses; re-runs
skip finished arms; bad input is one line, exit 2, nothing written.

    .venv/bin/pytest tests/test_study.py -q
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
import yaml

import analyze
import study
from analyses.study import ARM_FILE, flat
from tests.tiny import corpus_sentences

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
TRAJECTORY = {"max_sentences": 0, "num_pairs": 12, "minibatch": 6, "seed": 2, "no_progress": True}
COMMON = ["--no_progress", "--max_sentences", "0", "--num_pairs", "12", "--minibatch", "6", "--seed", "2"]


def write_study(folder: Path, corpus: Path, cache: Path, sentences: Path, **base_changes) -> Path:
    """A tiny study: train.py's config (a 2-layer RoBERTa, checkpoint and validation every 2 steps, CSV logs) and two
    arms, baseline and no PE."""
    folder.mkdir(parents=True, exist_ok=True)
    base = {
        "seed_everything": 0,
        "model": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
                  "max_position_embeddings": 34, "warmup_steps": 2, "lr": 3e-3, "dropout": 0.0},
        "data": {"corpus": str(corpus), "vocab_size": 600, "block_length": 32, "batch_size": 8,
                 "global_batch_size": 8, "cache_dir": str(cache)},
        "trainer": {"accelerator": "cpu", "max_steps": 6, "val_check_interval": 2, "check_val_every_n_epoch": None,
                    "num_sanity_val_steps": 0, "enable_progress_bar": False, "enable_model_summary": False,
                    "log_every_n_steps": 1,
                    "logger": {"class_path": "pytorch_lightning.loggers.CSVLogger",
                               "init_args": {"save_dir": str(folder / "logs"), "name": "lightning_logs"}}},
        "checkpoint": {"every_n_train_steps": 2},
    }
    for key, value in base_changes.items():
        group, name = key.split("__")
        base[group][name] = value
    (folder / "base.yaml").write_text(yaml.safe_dump(base), encoding="utf-8")
    config = {"train_config": "base.yaml", "arms": {"baseline": {}, "nope": {"model.position_embeddings": False}},
              "trajectory": {"data": str(sentences), **TRAJECTORY}}
    (folder / "study.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return folder / "study.yaml"


@pytest.fixture(scope="module")
def finished(tmp_path_factory, corpus, cache) -> tuple[Path, Path, Path, dict]:
    """The tiny study run once (--max_steps 4 over the config's 6): (study file, output dir, sentences, study.json)."""
    root = tmp_path_factory.mktemp("study")
    sentences = root / "sentences.txt"
    sentences.write_text("\n".join(corpus_sentences(40, start=300)) + "\n", encoding="utf-8")
    config = write_study(root / "config", corpus, cache, sentences)
    output = root / "out"
    assert study.main(["--config", str(config), "--output_dir", str(output), "--max_steps", "4"]) == 0
    return config, output, sentences, json.loads((output / "study.json").read_text())


def steps_on_disk(run_dir: Path) -> list[int]:
    return sorted({torch.load(path, map_location="cpu", weights_only=True)["global_step"]
                   for path in (run_dir / "checkpoints").glob("*.ckpt")})


def logged_val_losses(logs: Path, position_embeddings: bool) -> list[float]:
    """The val/loss values train.py's own validation logged (CSV) for the arm with these positional embeddings."""
    for version in sorted((logs / "lightning_logs").glob("version_*")):
        hparams = yaml.safe_load((version / "hparams.yaml").read_text())
        if hparams["position_embeddings"] == position_embeddings:
            with (version / "metrics.csv").open() as handle:
                return [float(row["val/loss"]) for row in csv.DictReader(handle) if row.get("val/loss")]
    raise AssertionError(f"no CSV log with position_embeddings={position_embeddings}")


@pytest.mark.slow
def test_a_two_arm_study_writes_both_files_each_arm_equal_to_its_own_analyses(finished, tmp_path):
    config, output, sentences, report = finished
    assert (output / "study.png").read_bytes()[:4] == b"\x89PNG"
    assert report["labels"] == ["baseline", "nope"]
    for run, position_embeddings in zip(report["runs"], (True, False)):
        arm = output / run["label"]
        # every checkpoint the arm kept, once per step, --max_steps 4 over the config's 6
        assert [p["step"] for p in run["checkpoints"]] == steps_on_disk(arm) == [2, 4]
        # the arm's part of study.json is the single-run trajectory of its run directory, key for key
        assert analyze.main(["trajectory", "--run", f"{run['label']}={arm}", "--data", str(sentences), *COMMON,
                             "--output_dir", str(tmp_path / run["label"])]) == 0
        assert run == json.loads((tmp_path / run["label"] / "trajectory.json").read_text())
        # the last checkpoint's layers equal `analyze.py outliers` of that checkpoint alone
        last = run["checkpoints"][-1]
        assert analyze.main(["outliers", "--encoder", last["path"], "--data", str(sentences), *COMMON[:3], "--seed", "2",
                             "--output_dir", str(tmp_path / f"{run['label']}-outliers")]) == 0
        alone = json.loads((tmp_path / f"{run['label']}-outliers" / "outliers.json").read_text())
        for row, separate in zip(last["layers"], alone["layers"], strict=True):
            for key in ("argmax_dim", "argmax_share", "argmin_dim", "argmin_share", "outlier_dims"):
                assert row[key] == separate[key], key
            for key in ("kurtosis_mean", "max_abs"):
                assert row[key] == pytest.approx(separate[key], rel=1e-9), key
        # the validation loss the step-4 checkpoint records is the one train.py logged at the validation before it
        assert last["val_loss_step"] == 2
        assert last["val_loss"] == pytest.approx(logged_val_losses(config.parent / "logs", position_embeddings)[0],
                                                 rel=1e-6)
        # the arm trained what its settings say: no PE means an all-zero, untrained position table
        weights = torch.load(last["path"], map_location="cpu", weights_only=True)
        table = weights["state_dict"]["model.roberta.embeddings.position_embeddings.weight"]
        assert bool(table.abs().sum() > 0) == position_embeddings
    # the two arms differ in their own setting (and their directories) only
    configs = [json.loads((output / arm / ARM_FILE).read_text())["config"] for arm in ("baseline", "nope")]
    flats = [flat(c) for c in configs]
    differ = {key for key in flats[0].keys() | flats[1].keys() if flats[0].get(key) != flats[1].get(key)}
    assert differ == {"model.position_embeddings", "trainer.default_root_dir"}
    assert flats[1]["trainer.default_root_dir"] == str(output / "nope") and flats[1]["trainer.max_steps"] == 4


@pytest.mark.slow
def test_a_rerun_skips_finished_arms_and_refuses_changed_settings(finished, capsys):
    config, output, _, report = finished
    stamps = {path: path.stat().st_mtime_ns for path in output.rglob("*.ckpt")}
    assert study.main(["--config", str(config), "--output_dir", str(output), "--max_steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "arm baseline is finished" in out and "arm nope is finished" in out
    assert {path: path.stat().st_mtime_ns for path in output.rglob("*.ckpt")} == stamps  # nothing retrained
    assert json.loads((output / "study.json").read_text()) == report  # the same comparison again
    # the same output directory with another step count: refused before anything runs
    before = sorted(str(p) for p in output.rglob("*"))
    assert study.main(["--config", str(config), "--output_dir", str(output), "--max_steps", "6"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"study.py: error: arm baseline: {output / 'baseline'} was trained with other settings " \
                  "(trainer.max_steps: 4 there, 6 now): use another --output_dir or remove it"
    assert sorted(str(p) for p in output.rglob("*")) == before


def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, corpus, cache, capsys):
    sentences = tmp_path / "sentences.txt"
    sentences.write_text("one sentence.\n", encoding="utf-8")
    config = write_study(tmp_path / "config", corpus, cache, sentences)
    out = tmp_path / "out"
    cases = [
        (["--arms", "baseline", "gated"], "unknown arm 'gated' (the study's arms: baseline, nope)"),
        (["--max_steps", "0"], "--max_steps must be at least 1, got 0"),
    ]
    for extra, message in cases:
        assert study.main(["--config", str(config), "--output_dir", str(out), *extra]) == 2
        assert capsys.readouterr().err.strip() == f"study.py: error: {message}"
    changed = yaml.safe_load(config.read_text())
    for arms, trajectory, message in (
            ({"gated": {"model.attention_kind": "gated"}}, {}, "arm gated: unknown option 'model.attention_kind'"),
            # values train.py checks as it builds the model and the trainer (issue 31): before any arm trains
            ({"baseline": {}, "gated": {"model.attention": "sparsemax"}}, {},
             "arm gated: --model.attention must be one of softmax, clipped_softmax, gated, got 'sparsemax'"),
            ({"a": {"trainer.val_check_interval": 0}}, {}, "arm a: --trainer.val_check_interval must be a number of "
                                                           "training batches"),
            ({"a": {"trainer.default_root_dir": "x"}}, {},
             f"study config {config}: arm a may not set trainer.default_root_dir (the study sets it for every arm)"),
            ({"a": {}}, {"no_such_option": 1}, "study trajectory options: unknown option --no_such_option")):
        config.write_text(yaml.safe_dump({**changed, "arms": arms, "trajectory": trajectory}), encoding="utf-8")
        assert study.main(["--config", str(config), "--output_dir", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"study.py: error: {message}") and "\n" not in err
    assert study.main(["--config", str(tmp_path / "missing.yaml"), "--output_dir", str(out)]) == 2
    assert capsys.readouterr().err.strip() == f"study.py: error: cannot read study config {tmp_path / 'missing.yaml'}: " \
                                              "No such file or directory"
    assert not out.exists() and not (tmp_path / "config" / "logs").exists()
    # an arm directory that holds something else: refused, left as it was
    config.write_text(yaml.safe_dump(changed), encoding="utf-8")
    (tmp_path / "other" / "baseline").mkdir(parents=True)
    (tmp_path / "other" / "baseline" / "notes.txt").write_text("mine\n")
    assert study.main(["--config", str(config), "--output_dir", str(tmp_path / "other")]) == 2
    assert capsys.readouterr().err.strip() == f"study.py: error: arm baseline: {tmp_path / 'other' / 'baseline'} holds " \
                                              "files but no study_arm.json (not a study arm): choose another " \
                                              "--output_dir or remove it"
    assert sorted(p.name for p in (tmp_path / "other").rglob("*")) == ["baseline", "notes.txt"]
