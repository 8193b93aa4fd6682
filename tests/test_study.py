"""study.py: a tiny two-arm, two-seed study (PE and no PE, seeds 0 and 1, 4 steps each) end to end, against each run's
own analyses and the seed statistics by hand; re-runs skip finished runs; bad input is one line, exit 2, nothing
written.

    .venv/bin/pytest tests/test_study.py -q
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import statistics
from pathlib import Path

import pytest
import torch
import yaml

import analyze
import study
from analyses import session
from analyses.null import STATISTICS, SUMMARIES
from analyses.study import ARM_FILE, flat
from tests.figure_data import panels, same, same_band, saved_figures
from tests.tiny import corpus_sentences, reports_close

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
              "verdict": {"gaussian_samples": 2}, "trajectory": {"data": str(sentences), **TRAJECTORY}}
    (folder / "study.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return folder / "study.yaml"


@pytest.fixture(scope="module")
def finished(tmp_path_factory, corpus, cache) -> tuple[Path, Path, Path, dict, dict, str]:
    """The tiny study run once (--max_steps 4 over the config's 6, --seeds 0 1): (study file, output dir, sentences,
    study.json, {file name: figure} of the figures it wrote, what it printed)."""
    root = tmp_path_factory.mktemp("study")
    sentences = root / "sentences.txt"
    sentences.write_text("\n".join(corpus_sentences(40, start=300)) + "\n", encoding="utf-8")
    config = write_study(root / "config", corpus, cache, sentences)
    output = root / "out"
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        saved = saved_figures(patch, session)
        assert study.main(["--config", str(config), "--output_dir", str(output), "--max_steps", "4", "--seeds", "0",
                           "1"]) == 0
    return config, output, sentences, json.loads((output / "study.json").read_text()), saved, printed.getvalue()


def check_study_figure(drawn: list[dict], report: dict) -> None:
    """study.png against study.json: a panel per statistic (and the validation loss), a line per arm through the mean
    over seeds at each checkpoint that has one, shaded from the lowest to the highest seed's value; for the verdict's
    statistics a dashed line per arm at (1 + margin) x the mean of the seeds' nulls."""
    def points(arm: dict, get) -> list[tuple[int, dict]]:
        kept = [(point["step"], get(point)) for point in arm["checkpoints"]]
        return [(step, entry) for step, entry in kept
                if entry["mean"] is not None and any(v is not None for v in entry["seeds"].values())]

    getters = [lambda point, key=key: point["summary"][key] for key in SUMMARIES]
    if any(points(arm, lambda point: point["val_loss"]) for arm in report["arms"]):
        getters.append(lambda point: point["val_loss"])
    assert len(drawn) == len(getters)
    margin = report["null"]["margin"]
    for panel, get, key in zip(drawn, getters, [*SUMMARIES, "val_loss"]):
        if not any(points(arm, get) for arm in report["arms"]):  # nothing to draw: the panel says so instead
            assert panel["lines"] == {}, key
            continue
        assert list(panel["lines"]) == [arm["arm"] for arm in report["arms"]], key
        for arm, band in zip(report["arms"], panel["bands"], strict=True):
            kept = points(arm, get)
            same(panel["lines"][arm["arm"]], [step for step, _ in kept], [entry["mean"] for _, entry in kept])
            seeds = {step: [v for v in entry["seeds"].values() if v is not None] for step, entry in kept}
            same_band(band, {step: (min(values), max(values)) for step, values in seeds.items()})
        if key in STATISTICS:
            for arm, (_, x, y) in zip(report["arms"], panel["dashed"], strict=True):
                nulls = [(point["step"], [entry["null"] for entry in point["null"][key]["seeds"].values()
                                          if entry["null"]]) for point in arm["checkpoints"]]
                same((x, y), [step for step, values in nulls if values],
                     [(1 + margin) * sum(values) / len(values) for _, values in nulls if values])
        else:
            assert panel["dashed"] == [], key


def check_printed_study(printed: str, report: dict) -> None:
    """The summary study.py prints last, against study.json: a row per arm and checkpoint (each verdict statistic's
    mean over seeds to 3 significant digits ± its sd to 2, the count of seeds beyond the null out of the seeds, the
    validation loss to 4 digits, '-' where there is none); then per arm its verdict at the last step every seed reached:
    each statistic 'beyond the null in k of n seeds', k counted from the seeds' own flags."""
    def shown(entry: dict, digits: int = 3) -> str:
        if entry["mean"] is None:
            return "-"
        return format(entry["mean"], f".{digits}g") + ("" if entry["sd"] is None else "±" + format(entry["sd"], ".2g"))

    keys = list(STATISTICS)
    lines = printed.splitlines()
    start = max(i for i, line in enumerate(lines) if line.split()[:2] == ["arm", "step"])  # the last study printed
    assert lines[start].split() == ["arm", "step", *(word for key in keys for word in (key, "(beyond)")), "val", "loss"]
    rows = [(arm, point) for arm in report["arms"] for point in arm["checkpoints"]]
    for line, (arm, point) in zip(lines[start + 1:], rows, strict=False):
        cells = [arm["arm"], str(point["step"])]
        for key in keys:
            flags = [entry["beyond"] for entry in point["null"][key]["seeds"].values()]
            cells += [shown(point["summary"][key]), f"({sum(flags)}/{len(point['seeds'])})"]
        assert line.split() == [*cells, shown(point["val_loss"], 4)], line
    end = start + 1 + len(rows)
    assert lines[end:end + 2] == ["", f"verdicts (margin {report['null']['margin']:g}; docs/study.md):"]
    verdicts = lines[end + 2:end + 2 + len(report["arms"])]
    assert len(verdicts) == len(report["arms"])
    for line, arm in zip(verdicts, report["arms"]):
        complete = [point for point in arm["checkpoints"] if len(point["seeds"]) == len(arm["seeds"])]
        if not complete:
            assert line == f"  {arm['arm']}: no step every seed reached"
            continue
        final, seeds = complete[-1], len(arm["seeds"])
        said = {key: sum(entry["beyond"] for entry in final["null"][key]["seeds"].values()) for key in keys}
        assert line == f"  {arm['arm']} at step {final['step']}: " + "; ".join(
            f"{key} beyond the null in {said[key]} of {seeds} seed{'s' if seeds != 1 else ''}" for key in keys)


def steps_on_disk(run_dir: Path) -> list[int]:
    return sorted({torch.load(path, map_location="cpu", weights_only=True)["global_step"]
                   for path in (run_dir / "checkpoints").glob("*.ckpt")})


def logged_val_losses(logs: Path, position_embeddings: bool, seed: int) -> list[float]:
    """The val/loss values train.py's own validation logged (CSV) for the run with these positional embeddings and
    this seed (the runs log in the order the study trains them: baseline seeds 0, 1, then nope seeds 0, 1)."""
    versions = sorted((logs / "lightning_logs").glob("version_*"), key=lambda path: int(path.name.split("_")[1]))
    mine = [v for v in versions if yaml.safe_load((v / "hparams.yaml").read_text())["position_embeddings"] ==
            position_embeddings]
    with (mine[seed] / "metrics.csv").open() as handle:
        return [float(row["val/loss"]) for row in csv.DictReader(handle) if row.get("val/loss")]


@pytest.mark.slow
def test_a_two_arm_study_writes_both_files_each_run_equal_to_its_own_analyses(finished, tmp_path):
    config, output, sentences, report, saved, printed = finished
    assert (output / "study.png").read_bytes()[:4] == b"\x89PNG"
    check_study_figure(panels(saved["study.png"]), report)
    check_printed_study(printed, report)
    assert report["labels"] == ["baseline/seed0", "baseline/seed1", "nope/seed0", "nope/seed1"]
    assert report["seeds"] == [0, 1] and [arm["arm"] for arm in report["arms"]] == ["baseline", "nope"]
    for run in report["runs"]:
        arm_name, seed = run["label"].split("/seed")
        position_embeddings, seed = arm_name == "baseline", int(seed)
        directory = output / arm_name / f"seed{seed}"
        # every checkpoint the run kept, once per step, the model before its first update included (step 0)
        assert [p["step"] for p in run["checkpoints"]] == steps_on_disk(directory) == [0, 2, 4]
        if seed == 0:
            continue  # the analyses below, once per arm (seed 1: the seed reached the run)
        # the run's part of study.json is the single-run trajectory of its run directory, key for key
        assert analyze.main(["trajectory", "--run", str(directory), "--data", str(sentences), *COMMON,
                             "--output_dir", str(tmp_path / run["label"])]) == 0
        assert {**run, "label": "seed1"} == json.loads(
            (tmp_path / run["label"] / "trajectory.json").read_text())  # (labelled by its directory's name there)
        # the last checkpoint's layers equal `analyze.py outliers` of that checkpoint alone
        last = run["checkpoints"][-1]
        assert analyze.main(["outliers", "--encoder", last["path"], "--data", str(sentences), *COMMON[:3], "--seed", "2",
                             "--output_dir", str(tmp_path / f"{run['label']}-outliers")]) == 0
        alone = json.loads((tmp_path / f"{run['label']}-outliers" / "outliers.json").read_text())
        for row, separate in zip(last["layers"], alone["layers"], strict=True):
            for key in ("argmax_dim", "argmax_share", "argmin_dim", "argmin_share", "outlier_dims"):
                assert row[key] == separate[key], key
            for key in ("kurtosis_mean", "max_abs", "kurtosis_sequence", "inf_norm_sequence"):
                assert row[key] == pytest.approx(separate[key], rel=1e-9), key
        # the validation loss the step-4 checkpoint records is the one train.py logged at the validation of step 4
        assert last["val_loss_step"] == 4 and run["checkpoints"][0]["val_loss"] is None
        assert last["val_loss"] == pytest.approx(logged_val_losses(config.parent / "logs", position_embeddings, seed)[1],
                                                 rel=1e-6)
        # the run trained what its settings say: no PE means an all-zero, untrained position table; the token-type
        # row is fairseq's (zero) in every run
        weights = torch.load(last["path"], map_location="cpu", weights_only=True)["state_dict"]
        table = weights["model.roberta.embeddings.position_embeddings.weight"]
        assert bool(table.abs().sum() > 0) == position_embeddings
        assert weights["model.roberta.embeddings.token_type_embeddings.weight"].abs().sum() == 0
    # the seed is the run's initialisation: one seed gives both arms the same step-0 weights (the position table
    # aside), another seed other ones
    initial = {label: torch.load(output / label / "checkpoints" / "epoch=0-step=0.ckpt", map_location="cpu",
                                 weights_only=True)["state_dict"] for label in report["labels"]}
    for name, value in initial["baseline/seed0"].items():
        if "position_embeddings" not in name:
            assert torch.equal(value, initial["nope/seed0"][name]), name
    word = "model.roberta.embeddings.word_embeddings.weight"
    assert not torch.equal(initial["baseline/seed0"][word], initial["baseline/seed1"][word])
    # the seed statistics: each seed's own value, their mean and sample sd, by hand from the runs' trajectories
    runs = {run["label"]: run for run in report["runs"]}
    for arm in report["arms"]:
        for index, point in enumerate(arm["checkpoints"]):
            own = [runs[f"{arm['arm']}/seed{seed}"]["checkpoints"][index] for seed in (0, 1)]
            assert point["step"] == own[0]["step"] == own[1]["step"]
            kurtosis = [max(row["kurtosis_sequence"] for row in p["layers"][1:]) for p in own]
            assert point["summary"]["kurtosis_sequence"]["seeds"] == {"0": kurtosis[0], "1": kurtosis[1]}
            assert point["summary"]["kurtosis_sequence"]["mean"] == pytest.approx(statistics.mean(kurtosis))
            assert point["summary"]["kurtosis_sequence"]["sd"] == pytest.approx(statistics.stdev(kurtosis))
            shares = [p["layers"][2]["argmin_share"] for p in own]
            assert point["layers"][2]["argmin_share"]["sd"] == pytest.approx(statistics.stdev(shares))
            # the kurtosis' nulls by hand (scale-free: no rescaling): (a) the run's own step 0, (b) the largest of the
            # Gaussian samples, each the largest over layers 1..L; beyond: above (1 + margin 0.5) x the larger of them
            samples = report["null"]["gaussian"][0]["samples"]
            noise = max(max(row["kurtosis_sequence"] for row in sample["layers"][1:]) for sample in samples)
            for seed, value in zip(("0", "1"), kurtosis):
                entry = point["null"]["kurtosis_sequence"]["seeds"][seed]
                step0 = runs[f"{arm['arm']}/seed{seed}"]["checkpoints"][0]
                assert step0["step"] == 0 and entry["value"] == pytest.approx(value)
                assert entry["null_step0"] == pytest.approx(max(row["kurtosis_sequence"] for row in step0["layers"][1:]))
                assert entry["null_gaussian"] == pytest.approx(noise)
                assert entry["null"] == pytest.approx(max(entry["null_step0"], noise))
                assert entry["beyond"] == (value > 1.5 * entry["null"])
            # every statistic: the null is the larger of its two, beyond and excess follow from it; at step 0 a
            # statistic is its own null (a), never beyond it
            for entry in point["null"].values():
                for seed in ("0", "1"):
                    own_entry = entry["seeds"][seed]
                    assert own_entry["null"] == max(own_entry["null_step0"], own_entry["null_gaussian"])
                    assert own_entry["excess"] == pytest.approx(own_entry["value"] - own_entry["null"])
                    assert own_entry["beyond"] == (own_entry["value"] > 1.5 * own_entry["null"])
                    if point["step"] == 0:
                        assert own_entry["null_step0"] == pytest.approx(own_entry["value"])
                        assert not own_entry["beyond"]
                assert entry["beyond"] == sum(entry["seeds"][seed]["beyond"] for seed in ("0", "1"))
        assert arm["verdict"]["step"] == 4 == arm["checkpoints"][-1]["step"]
        assert {key: arm["verdict"][key]["beyond"] for key in arm["checkpoints"][-1]["null"]} == \
            {key: entry["beyond"] for key, entry in arm["checkpoints"][-1]["null"].items()}
    # the Gaussian null: samples of the runs' token count, the same for every run (one tokenizer)
    null, = report["null"]["gaussian"]
    assert null["runs"] == report["labels"] and len(null["samples"]) == report["null"]["gaussian_samples"] == 2
    assert report["null"]["margin"] == 0.5  # the default
    assert {sample["num_tokens"] for sample in null["samples"]} == {report["runs"][0]["checkpoints"][0]["num_tokens"]}
    # the runs differ in their own settings (their arm, seed and directories) only
    configs = {label: flat(json.loads((output / label / ARM_FILE).read_text())["config"]) for label in report["labels"]}
    for first, second, expected in (("baseline/seed0", "nope/seed0", {"model.position_embeddings"}),
                                    ("baseline/seed0", "baseline/seed1", {"seed_everything", "data.seed"})):
        a, b = configs[first], configs[second]
        assert {key for key in a.keys() | b.keys() if a.get(key) != b.get(key)} == {*expected, "trainer.default_root_dir"}
    assert configs["nope/seed1"]["trainer.default_root_dir"] == str(output / "nope" / "seed1")
    assert configs["nope/seed1"]["trainer.max_steps"] == 4 and configs["nope/seed1"]["seed_everything"] == 1
    assert configs["nope/seed1"]["data.seed"] == 1  # its blocks' order and masks: its own, as its initialisation


@pytest.mark.slow
def test_a_rerun_skips_finished_runs_and_refuses_changed_settings(finished, capsys, tmp_path):
    config, output, _, report, _, _ = finished
    stamps = {path: path.stat().st_mtime_ns for path in output.rglob("*.ckpt")}
    assert study.main(["--config", str(config), "--output_dir", str(output), "--max_steps", "4", "--seeds", "0",
                       "1"]) == 0
    out = capsys.readouterr().out
    assert all(f"run {label} is finished" in out for label in report["labels"])
    assert {path: path.stat().st_mtime_ns for path in output.rglob("*.ckpt")} == stamps  # nothing retrained
    assert json.loads((output / "study.json").read_text()) == report  # the same comparison again
    # the same output directory with another step count: refused before anything runs
    before = sorted(str(p) for p in output.rglob("*"))
    assert study.main(["--config", str(config), "--output_dir", str(output), "--max_steps", "6", "--seeds", "0",
                       "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"study.py: error: arm baseline/seed0: {output / 'baseline' / 'seed0'} was trained with other " \
                  "settings (trainer.max_steps: 4 there, 6 now): use another --output_dir or remove it"
    assert sorted(str(p) for p in output.rglob("*")) == before
    # a run made before the zero token-type row and the step-0 checkpoint (its record lacks both keys): refused
    legacy = tmp_path / "legacy" / "baseline" / "seed0"
    legacy.mkdir(parents=True)
    record = json.loads((output / "baseline" / "seed0" / ARM_FILE).read_text())
    del record["config"]["model"]["token_type_embeddings"], record["config"]["checkpoint"]["save_initial"]
    record["config"]["trainer"]["default_root_dir"] = str(legacy)
    (legacy / ARM_FILE).write_text(json.dumps(record))
    assert study.main(["--config", str(config), "--output_dir", str(tmp_path / "legacy"), "--max_steps", "4",
                       "--arms", "baseline", "--seeds", "0"]) == 2
    assert capsys.readouterr().err.strip() == f"study.py: error: arm baseline/seed0: {legacy} was trained with other " \
        "settings (checkpoint.save_initial: False there, True now, and 1 more): use another --output_dir or remove it"
    # an arm directory of the one-seed layout: refused
    (tmp_path / "old" / "nope").mkdir(parents=True)
    (tmp_path / "old" / "nope" / ARM_FILE).write_text(json.dumps(record))
    assert study.main(["--config", str(config), "--output_dir", str(tmp_path / "old"), "--seeds", "0"]) == 2
    assert capsys.readouterr().err.strip() == f"study.py: error: arm nope/seed0: {tmp_path / 'old' / 'nope'} holds a " \
        "run of an older study.py (one seed, in the arm's directory itself): use another --output_dir or remove it"


def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, corpus, cache, capsys):
    sentences = tmp_path / "sentences.txt"
    sentences.write_text("one sentence.\n", encoding="utf-8")
    config = write_study(tmp_path / "config", corpus, cache, sentences)
    out = tmp_path / "out"
    cases = [
        (["--arms", "baseline", "gated"], "unknown arm 'gated' (the study's arms: baseline, nope)"),
        (["--max_steps", "0"], "--max_steps must be at least 1, got 0"),
        (["--seeds", "0", "0"], "seed 0 given twice"),
        (["--seeds", "-1"], "seeds must be one or more non-negative integers, got [-1]"),
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
            ({"a": {}}, {"no_such_option": 1}, "study trajectory options: unknown option --no_such_option"),
            # a value the datamodule checks as it is built, before any data work (not only when its tokenizer trains)
            ({"baseline": {}, "a": {"data.vocab_size": 10}}, {},
             "arm a: --data.vocab_size must be at least 261 for a byte-level BPE, got 10"),
            ({"a": {"seed_everything": 3}}, {},
             f"study config {config}: arm a may not set seed_everything (the study sets it for every arm)")):
        config.write_text(yaml.safe_dump({**changed, "arms": arms, "trajectory": trajectory}), encoding="utf-8")
        assert study.main(["--config", str(config), "--output_dir", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"study.py: error: {message}") and "\n" not in err
    config.write_text(yaml.safe_dump({**changed, "verdict": {"margin": -1}}), encoding="utf-8")
    assert study.main(["--config", str(config), "--output_dir", str(out)]) == 2
    assert capsys.readouterr().err.strip() == f"study.py: error: study config {config}: verdict.margin must be a number " \
                                              "of at least 0, got -1"
    assert study.main(["--config", str(tmp_path / "missing.yaml"), "--output_dir", str(out)]) == 2
    assert capsys.readouterr().err.strip() == f"study.py: error: cannot read study config {tmp_path / 'missing.yaml'}: " \
                                              "No such file or directory"
    assert not out.exists() and not (tmp_path / "config" / "logs").exists()
    # an arm directory that holds something else: refused, left as it was
    config.write_text(yaml.safe_dump(changed), encoding="utf-8")
    (tmp_path / "other" / "baseline").mkdir(parents=True)
    (tmp_path / "other" / "baseline" / "notes.txt").write_text("mine\n")
    assert study.main(["--config", str(config), "--output_dir", str(tmp_path / "other")]) == 2
    assert capsys.readouterr().err.strip() == f"study.py: error: arm baseline/seed0: {tmp_path / 'other' / 'baseline'} " \
                                              "holds notes.txt, not a study run (seed<k>/): choose another " \
                                              "--output_dir or remove it"
    assert sorted(p.name for p in (tmp_path / "other").rglob("*")) == ["baseline", "notes.txt"]


def test_an_arm_refused_with_its_data_leaves_nothing_and_a_rerun_with_it_changed_proceeds(tmp_path, corpus, cache,
                                                                                         capsys):
    """A bad input only the data shows (here a corpus too small for the arm's global batch: found when its blocks are
    made) stops the study at that arm with train.py's line; the study's record of the arm is not left behind, so the
    rerun with the arm changed is not refused as a run "trained with other settings"."""
    sentences = tmp_path / "sentences.txt"
    sentences.write_text("one sentence.\n", encoding="utf-8")
    config = write_study(tmp_path / "config", corpus, cache, sentences)
    changed = yaml.safe_load(config.read_text())
    out = tmp_path / "out"
    blocks = tmp_path / "blocks"  # a cache of its own: the blocks are made (and counted) in this run
    config.write_text(yaml.safe_dump({**changed, "arms": {"big": {"data.global_batch_size": 4096,
                                                                  "data.cache_dir": str(blocks)}}}), encoding="utf-8")
    assert study.main(["--config", str(config), "--output_dir", str(out), "--max_steps", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    made = json.loads(next(blocks.rglob("blocks.json")).read_text())["train"]  # the blocks, counted another way
    assert made < 4096 and err[-2] == f"train.py: error: {made} training blocks make no full global batch of 4096"
    assert err[-1] == ("study.py: error: arm big/seed0: train.py refused it before training (its error above, exit "
                       "status 2); nothing of it was kept: change the arm and rerun the study")
    assert not out.exists()
    config.write_text(yaml.safe_dump({**changed, "arms": {"big": {"data.global_batch_size": 16}}}), encoding="utf-8")
    from analyses.study import plan_study

    _, planned, _ = plan_study(config, out, study.parse_trajectory, max_steps=3)  # checked, not refused
    assert [arm.label for arm in planned] == ["big/seed0"] and not out.exists()


@pytest.mark.slow
def test_a_two_arm_study_under_torchrun_trains_both_arms_and_compares_as_one_process(tmp_path, corpus, cache, capsys):
    """`torchrun --nproc_per_node 2 study.py` (docs/study.md) with arms of 2 DDP processes: the second arm joins the
    process group the first kept (destroyed and made again on torchrun's store, it read the first group's stale
    addresses: "Gloo connectFullMesh failed", exit 1, the second arm untrained); exit 0, no abort at the teardown; the
    comparison, sharded over the 2 processes, equals each run's trajectory in one process. Without torchrun the same
    file is refused before anything is written (Lightning's launcher would start each arm's second process as a study
    of its own)."""
    import os
    import subprocess
    import sys

    from tests.tiny import free_port

    sentences = tmp_path / "sentences.txt"
    sentences.write_text("\n".join(corpus_sentences(24, start=300)) + "\n", encoding="utf-8")
    config = write_study(tmp_path / "config", corpus, cache, sentences, trainer__devices=2, trainer__strategy="ddp",
                         data__batch_size=4, data__val_fraction=0.1)  # a validation block for each process
    out = tmp_path / "out"
    root = Path(study.__file__).parent
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
               str(root / "study.py"), "--config", str(config), "--output_dir", str(out), "--max_steps", "2"]
    finished = subprocess.run(command, cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                              text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "Traceback" not in finished.stderr
    report = json.loads((out / "study.json").read_text())
    assert report["labels"] == ["baseline/seed0", "nope/seed0"]
    for run in report["runs"]:
        directory = out / run["label"]
        assert [p["step"] for p in run["checkpoints"]] == steps_on_disk(directory) == [0, 2]
        assert analyze.main(["trajectory", "--run", str(directory), "--data", str(sentences), *COMMON,
                             "--output_dir", str(tmp_path / run["label"])]) == 0
        alone = json.loads((tmp_path / run["label"] / "trajectory.json").read_text())
        reports_close({**run, "label": "seed0"}, alone, run["label"])  # sums of 2 shards: another order
    capsys.readouterr()
    assert study.main(["--config", str(config), "--output_dir", str(tmp_path / "one")]) == 2
    assert capsys.readouterr().err.strip() == (
        "study.py: error: arm baseline/seed0: --trainer.devices 2 x --trainer.num_nodes 1 is 2 processes: start the "
        "study under torchrun (torchrun --nproc_per_node 2 study.py ...; docs/study.md), whose processes every arm's "
        "run joins")
    assert not (tmp_path / "one").exists()


def test_the_shipped_study_files_read_as_written():
    from analyses.study import read_study

    for name, configs in (("study.yaml", ["base.yaml"]), ("study-bb.yaml", ["base.yaml", "bb.yaml"]),
                          ("roberta-base.yaml", ["../pretrain/roberta-base.yaml", "roberta-base-checkpoints.yaml"])):
        path = Path("configs/study") / name
        study_file = yaml.safe_load(path.read_text())
        read = read_study(path)
        assert read["seeds"] == [0, 1, 2] and list(read["arms"]) == list(study_file["arms"])
        assert {"baseline", "nope", "clipped_softmax", "gated"} <= set(read["arms"])  # the four of docs/study.md
        assert read["train_config"] == [str(path.parent / config) for config in configs]
        assert read["verdict"] == {"gaussian_samples": 3, "margin": 0.5}  # written out or the defaults, not lost
        assert set(study_file) <= {"train_config", "arms", "seeds", "verdict", "trajectory"}


@pytest.mark.parametrize("name", ["study.yaml", "study-bb.yaml", "roberta-base.yaml"])
def test_a_shipped_study_draws_every_isoscore_star_mini_batch_it_asks_for(name, tmp_path):
    """One random token per sentence feeds IsoScore*: the comparison's --max_sentences must fill --minibatches
    mini-batches of --minibatch tokens, or every checkpoint warns that fewer were averaged."""
    from types import SimpleNamespace

    from analyses.geometry import minibatch_isoscores, minibatch_shortfall
    from analyses.study import read_study, trajectory_arguments
    from metrics.transforms import RAW

    args = trajectory_arguments(read_study(Path("configs/study") / name)["trajectory"], tmp_path, study.parse_trajectory)
    assert args.max_sentences > 0
    sampled = min(args.max_sentences, 2 * args.num_pairs)  # the reference's token sample: one token of each sentence
    asked = args.minibatches
    assert sampled // args.minibatch >= asked  # by hand: whole mini-batches of one token per sentence
    # the protocol's own count, on a reference of that many sentences with a token each (1 layer, 4 dims)
    points = torch.randn(sampled, 1, 4, generator=torch.Generator().manual_seed(0))
    filled = torch.ones(sampled, dtype=torch.bool)
    reference = SimpleNamespace(sample=(points, filled), sample_of=lambda variant: (points, filled),
                                moments_of=lambda variant: (points.mean(0), torch.eye(4).expand(1, 4, 4)))
    _, _, batches = minibatch_isoscores(reference, RAW, args.seed, args.zeta, args.minibatch, asked)
    assert batches == asked
    assert minibatch_shortfall(batches, args.minibatch, asked, sampled, sampled, args.num_pairs,
                               args.max_sentences) is None


def test_an_arms_wandb_run_is_grouped_under_its_study_and_tagged_with_arm_and_seed(tmp_path, monkeypatch):
    """train_arm runs train.py with WANDB_RUN_GROUP = the study's directory name and WANDB_TAGS = arm, seed (what
    wandb.init reads: the run record of an offline run holds them), a group the user set wins, and the variables are
    as before once the arm is done."""
    from analyses.study import Arm, train_arm, wandb_grouping
    from callbacks.wandb_logging import AutoWandbLogger
    from tests.wandb_log import read_run

    seen = []

    def fake_fit(args, keep_process_group=False):
        seen.append({key: os.environ.get(key) for key in ("WANDB_RUN_GROUP", "WANDB_TAGS")})
        return 0

    monkeypatch.setattr("train.cli_main", fake_fit)
    monkeypatch.delenv("WANDB_RUN_GROUP", raising=False)
    monkeypatch.delenv("WANDB_TAGS", raising=False)
    arm = Arm("nope", 3, tmp_path / "my-study" / "nope" / "seed3", [], {})
    arm.run_dir.mkdir(parents=True)
    train_arm(arm)
    assert seen == [{"WANDB_RUN_GROUP": "my-study", "WANDB_TAGS": "nope,seed3"}]
    assert "WANDB_RUN_GROUP" not in os.environ and "WANDB_TAGS" not in os.environ
    monkeypatch.setenv("WANDB_RUN_GROUP", "mine")
    train_arm(arm)
    assert seen[-1] == {"WANDB_RUN_GROUP": "mine", "WANDB_TAGS": "nope,seed3"} and os.environ["WANDB_RUN_GROUP"] == "mine"
    monkeypatch.delenv("WANDB_RUN_GROUP")
    second = Arm("baseline", 0, tmp_path / "my-study" / "baseline" / "seed0", [], {})
    for each in (arm, second):  # two arms in one process, as study.py trains them: W&B reads its variables once
        with wandb_grouping(each):  # what the arm's logger makes of them
            logger = AutoWandbLogger(save_dir=str(each.run_dir), offline=True)
            assert logger.experiment is not None
            logger.finalize("success")
        (directory,) = (each.run_dir / "wandb").glob("offline-run-*")
        logged = read_run(directory)
        assert (logged.group, sorted(logged.tags)) == ("my-study", sorted([each.name, f"seed{each.seed}"]))
