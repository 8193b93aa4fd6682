"""`analyze.py trajectory`: every checkpoint of a tiny train.py run, in step order, equals a separate `analyze.py all`
of that checkpoint alone; `--encoders` by step (without steps, in the order given); the refusals.

    .venv/bin/pytest tests/test_trajectory.py -q
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

import analyze
import train
from analyses import session
from tests.figure_data import panels, same, saved_figures
from tests.tiny import corpus_sentences, save_tiny_encoder

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
COMMON = ["--no_progress", "--max_sentences", "0", "--num_pairs", "12", "--minibatch", "6", "--seed", "2"]


def tiny_run(root: Path, corpus, cache, *extra: str) -> None:
    """A tiny run with a checkpoint every 2 steps, all kept (--checkpoint.save_top_k -1)."""
    assert train.cli_main([
        "fit", "--model.hidden_size", "32", "--model.num_hidden_layers", "2", "--model.num_attention_heads", "4",
        "--model.intermediate_size", "64", "--model.max_position_embeddings", "34", "--model.warmup_steps", "2",
        "--model.lr", "3e-3", "--data.corpus", str(corpus), "--data.vocab_size", "600", "--data.block_length", "32",
        "--data.batch_size", "8", "--data.global_batch_size", "8", "--data.cache_dir", str(cache),
        "--trainer.accelerator", "cpu", "--trainer.max_steps", "6", "--trainer.logger", "false",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.num_sanity_val_steps", "0", "--trainer.default_root_dir", str(root),
        "--checkpoint.every_n_train_steps", "2", "--checkpoint.save_top_k", "-1", *extra]) == 0


TRAJECTORY_PANELS = ("argmax_share", "argmin_share", "kurtosis_mean", "max_abs", "anisotropy", "isoscore_star")


def check_trajectory_figure(drawn: list[dict], report: dict) -> None:
    """trajectory.png against trajectory.json: a panel per statistic, a line per layer through its value at each
    checkpoint's step."""
    points = report["checkpoints"]
    steps = [point["step"] for point in points]
    assert len(drawn) == len(TRAJECTORY_PANELS)
    for panel, key in zip(drawn, TRAJECTORY_PANELS):
        layers = range(len(points[0]["layers"]))
        assert list(panel["lines"]) == [f"layer {layer}" for layer in layers], key
        for layer in layers:
            same(panel["lines"][f"layer {layer}"], steps, [point["layers"][layer][key] for point in points],
                 atol=1e-6)


def check_runs_figure(drawn: list[dict], report: dict) -> None:
    """The figure of several runs against their report: a line per run through a number per checkpoint, written out
    here: the dominant dim's share of the max or the min, kurtosis and max |activation|, each the max over layers
    1..L; anisotropy and IsoScore*, the mean over them; the validation loss where a run's checkpoints record it."""
    def summary(point: dict, key: str) -> float:
        rows = point["layers"][1:]
        if key == "top_share":
            return max(max(row["argmax_share"], row["argmin_share"]) for row in rows)
        values = [row[key] for row in rows]
        return max(values) if key in ("kurtosis_mean", "max_abs") else sum(values) / len(values)

    keys = ("top_share", "kurtosis_mean", "max_abs", "anisotropy", "isoscore_star")
    validated = [run for run in report["runs"] if any(p["val_loss"] is not None for p in run["checkpoints"])]
    assert len(drawn) == len(keys) + bool(validated)
    for panel, key in zip(drawn, keys):
        assert list(panel["lines"]) == report["labels"], key
        for run in report["runs"]:
            same(panel["lines"][run["label"]], [p["step"] for p in run["checkpoints"]],
                 [summary(p, key) for p in run["checkpoints"]], atol=1e-6)
    if validated:
        assert list(drawn[-1]["lines"]) == [run["label"] for run in validated]
        for run in validated:
            kept = [p for p in run["checkpoints"] if p["val_loss"] is not None]
            same(drawn[-1]["lines"][run["label"]], [p["step"] for p in kept], [p["val_loss"] for p in kept])


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus, cache) -> tuple[Path, Path]:
    """A tiny run with a checkpoint every 2 steps, all kept (--checkpoint.save_top_k -1): steps 2, 4, 6, and
    last.ckpt (6) and previous.ckpt (4) beside them; and 40 sentences to analyse them on."""
    root = tmp_path_factory.mktemp("trajectory") / "run"
    tiny_run(root, corpus, cache)
    sentences = root.parent / "sentences.txt"
    sentences.write_text("\n".join(corpus_sentences(40, start=300)) + "\n", encoding="utf-8")
    return root, sentences


@pytest.mark.slow
def test_the_trajectory_of_three_checkpoints_equals_three_separate_analyses(run, tmp_path, monkeypatch):
    root, sentences = run
    saved = saved_figures(monkeypatch, session)
    checkpoints = root / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("*.ckpt")) == [
        "epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt", "previous.ckpt"]
    assert analyze.main(["trajectory", "--run", str(root), "--data", str(sentences), *COMMON,
                         "--output_dir", str(tmp_path / "t")]) == 0
    report = json.loads((tmp_path / "t" / "trajectory.json").read_text())
    assert (tmp_path / "t" / "trajectory.png").read_bytes()[:4] == b"\x89PNG"
    check_trajectory_figure(panels(saved["trajectory.png"]), report)
    assert report["run"] == str(root) and report["data"] == str(sentences) and report["num_sentences"] == 40
    points = report["checkpoints"]  # last.ckpt and previous.ckpt repeat steps 6 and 4: one point per step
    assert [(p["step"], Path(p["path"]).name) for p in points] == [
        (2, "epoch=0-step=2.ckpt"), (4, "epoch=0-step=4.ckpt"), (6, "epoch=0-step=6.ckpt")]
    for point in points:
        out = tmp_path / f"all-{point['step']}"
        assert analyze.main(["all", "--encoder", point["path"], "--data", str(sentences), *COMMON, "--clip", "none",
                             "--pool_sentences", "0", "--num_words", "2", "--min_sentences", "3",
                             "--output_dir", str(out)]) == 0
        outliers, anisotropy, isotropy = (json.loads((out / f"{name}.json").read_text())
                                          for name in ("outliers", "anisotropy", "isotropy"))
        assert point["persistent_dims"] == outliers["persistent_dims"]
        assert point["num_tokens"] == outliers["num_tokens"] and point["num_pairs"] == anisotropy["num_pairs"] == 12
        assert len(point["layers"]) == 3  # the embedding output and 2 layers
        for row, separate, cosines, iso in zip(point["layers"], outliers["layers"], anisotropy["layers"],
                                               isotropy["layers"], strict=True):
            assert {key: row[key] for key in ("layer", "argmax_dim", "argmin_dim", "outlier_dims")} == \
                {key: separate[key] for key in ("layer", "argmax_dim", "argmin_dim", "outlier_dims")}
            assert row["argmax_share"] == pytest.approx(separate["argmax_share"], abs=1e-9)
            assert row["argmin_share"] == pytest.approx(separate["argmin_share"], abs=1e-9)
            assert row["anisotropy"] == pytest.approx(cosines["raw"], abs=1e-9)
            assert row["isoscore_star"] == pytest.approx(iso["raw"]["isoscore_star"], abs=1e-9)
    # the magnitudes beyond the paper: as `analyze.py outliers` of the same checkpoint reports them
    assert analyze.main(["outliers", "--encoder", points[0]["path"], "--data", str(sentences), *COMMON[:3],
                         *COMMON[-2:], "--output_dir", str(tmp_path / "o")]) == 0
    outliers = json.loads((tmp_path / "o" / "outliers.json").read_text())
    assert report["massive_rule"] == outliers["massive_rule"] and report["magnitude_rule"] == outliers["magnitude_rule"]
    for row, separate in zip(points[0]["layers"], outliers["layers"], strict=True):
        for key in ("kurtosis_sequence", "inf_norm_sequence", "massive_activations", "attention_sinks",
                    "magnitude_outliers"):
            assert row[key] == separate[key], key
    assert points[0]["layers"][1]["attention_sinks"]["first_token_mass"] > 0
    # the weights moved: the points differ
    assert points[0]["layers"][2]["anisotropy"] != points[2]["layers"][2]["anisotropy"]
    # --encoders: any list, analysed by step, each step read from its checkpoint
    assert analyze.main(["trajectory", "--encoders", points[2]["path"], points[0]["path"], "--data", str(sentences),
                         *COMMON, "--output_dir", str(tmp_path / "e")]) == 0
    listed = json.loads((tmp_path / "e" / "trajectory.json").read_text())
    assert listed["run"] is None and [p["step"] for p in listed["checkpoints"]] == [2, 6]
    assert [p["step_from"] for p in listed["checkpoints"]] == ["checkpoint", "checkpoint"]
    assert listed["checkpoints"][0]["layers"] == points[0]["layers"]


def test_encoders_with_steps_are_analysed_by_step_not_in_a_globs_string_order(tmp_path):
    from analyses.trajectory import encoder_points

    def exports(*names: str) -> list[str]:
        for name in names:
            (tmp_path / name).mkdir()
            (tmp_path / name / "config.json").write_text(json.dumps({"model_type": "roberta"}))
        return [str(tmp_path / name) for name in names]

    globbed = sorted(exports("step=1000", "step=250", "step=500", "step_2k"))  # a shell glob's order: by string
    assert [Path(source).name for source in globbed] == ["step=1000", "step=250", "step=500", "step_2k"]
    points = encoder_points(globbed)
    assert [(Path(p.source).name, p.step, p.step_from) for p in points] == [
        ("step=250", 250, "name"), ("step=500", 500, "name"), ("step=1000", 1000, "name"), ("step_2k", 2000, "name")]
    unstepped = exports("zeta", "alpha")  # no step anywhere: the order given, each at its position
    assert [(Path(p.source).name, p.step, p.step_from) for p in encoder_points(unstepped)] == [
        ("zeta", 0, "order"), ("alpha", 1, "order")]


@pytest.mark.slow
def test_a_run_with_one_checkpoint_says_so_and_still_reports_it(run, tmp_path, capsys):
    root, sentences = run
    single = tmp_path / "single"
    (single / "checkpoints").mkdir(parents=True)
    shutil.copy(root / "checkpoints" / "last.ckpt", single / "checkpoints" / "last.ckpt")
    assert analyze.main(["trajectory", "--run", str(single), "--data", str(sentences), *COMMON,
                         "--output_dir", str(tmp_path / "t")]) == 0
    captured = capsys.readouterr()
    assert f"note: {single} has a single checkpoint (step 6): the trajectory has one point" in captured.err
    report = json.loads((tmp_path / "t" / "trajectory.json").read_text())
    assert [point["step"] for point in report["checkpoints"]] == [6]
    # 40 sentences make no IsoScore* mini-batches of 250 tokens: null in the report, "-" in the table, as its warning says
    assert analyze.main(["trajectory", "--run", str(single), "--data", str(sentences), *COMMON, "--minibatch", "250",
                         "--output_dir", str(tmp_path / "u")]) == 0
    captured = capsys.readouterr()
    last = json.loads((tmp_path / "u" / "trajectory.json").read_text())["checkpoints"][0]["layers"][-1]
    assert last["isoscore_star"] is None
    assert captured.out.strip().splitlines()[-1].endswith(f", {last['anisotropy']:.4f}, -")


def test_torchrun_passes_run_dir_to_trajectory_where_it_takes_run_for_its_own_run_path():
    """`torchrun ... analyze.py trajectory --run DIR` stops in torchrun's parser (--run abbreviates its --run-path and
    --run_path); --run_dir is the same option, and torchrun hands it to analyze.py."""
    from torch.distributed.run import get_args_parser

    launcher = get_args_parser()
    with pytest.raises(SystemExit):
        launcher.parse_args(["--nproc_per_node", "2", "analyze.py", "trajectory", "--run", "runs/t"])
    given = launcher.parse_args(["--nproc_per_node", "2", "analyze.py", "trajectory", "--run_dir", "runs/t"])
    assert given.training_script == "analyze.py"
    args = analyze.build_parser().parse_args(given.training_script_args)
    assert args.run_dir == ["runs/t"] == analyze.build_parser().parse_args(["trajectory", "--run", "runs/t"]).run_dir


@pytest.mark.slow
def test_no_checkpoints_or_other_architectures_are_one_line_exit_2_and_write_nothing(run, tmp_path, capsys):
    root, sentences = run
    empty = tmp_path / "empty"
    (empty / "checkpoints").mkdir(parents=True)
    out = tmp_path / "out"
    assert analyze.main(["trajectory", "--run", str(empty), "--data", str(sentences), "--output_dir", str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"analyze.py trajectory: error: no checkpoints in {empty / 'checkpoints'} (train.py writes last.ckpt there; "
        "--checkpoint.save_top_k -1 keeps the periodic ones)"]
    wider = tmp_path / "wider.ckpt"  # the same run's checkpoint, its hyper-parameters claiming another width
    checkpoint = torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    checkpoint["hyper_parameters"]["hidden_size"] = 48
    torch.save(checkpoint, wider)
    first = root / "checkpoints" / "epoch=0-step=2.ckpt"
    assert analyze.main(["trajectory", "--encoders", str(first), str(wider), "--data", str(sentences),
                         "--output_dir", str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"analyze.py trajectory: error: checkpoints of different architectures in one trajectory: {first} has "
        f"hidden_size=32 but {wider} has hidden_size=48"]
    # --encoders: a position in the list beside checkpoints' steps, and two encoders at one step (a shell glob of
    # checkpoints/ lists last.ckpt beside its periodic twin): refused, the steps read from the checkpoints themselves
    last, six = root / "checkpoints" / "last.ckpt", root / "checkpoints" / "epoch=0-step=6.ckpt"
    steps = {path: torch.load(path, map_location="cpu", weights_only=True)["global_step"] for path in (first, last, six)}
    assert steps == {first: 2, last: 6, six: 6}
    unstepped = tmp_path / "final"  # an export-like directory: no checkpoint, no step in its name
    unstepped.mkdir()
    (unstepped / "config.json").write_text(json.dumps({"model_type": "roberta"}))
    for encoders, message in (
            ([first, unstepped, last], f"--encoders: {unstepped} has no step (not a checkpoint, no step in its name "
                                       f"such as step_20k) but {first} is at step {steps[first]}: give its checkpoint, or "
                                       "a name with its step, or list only encoders without steps (kept in the order "
                                       "given)"),
            ([first, six, last], f"--encoders: {six} and {last} are both at step {steps[six]}: give one encoder per step "
                                 "(--run RUN_DIR keeps one checkpoint per step)")):
        assert analyze.main(["trajectory", "--encoders", *map(str, encoders), "--data", str(sentences),
                             "--output_dir", str(out)]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"analyze.py trajectory: error: {message}"]
    assert analyze.main(["trajectory", "--run", str(tmp_path / "nowhere"), "--data", str(sentences),
                         "--output_dir", str(out)]) == 2
    assert capsys.readouterr().err.strip() == f"analyze.py trajectory: error: run directory path not found: " \
                                              f"{tmp_path / 'nowhere'}"
    assert not out.exists()


@pytest.fixture(scope="module")
def nope_run(tmp_path_factory, corpus, cache) -> Path:
    """A second tiny run, without positional embeddings, validated every 2 steps (so its checkpoints record a
    validation loss: the one of the validation of their step, after which train.py saves them again)."""
    root = tmp_path_factory.mktemp("trajectory-nope") / "nope"
    tiny_run(root, corpus, cache, "--model.position_embeddings", "false", "--trainer.val_check_interval", "2",
             "--trainer.check_val_every_n_epoch", "null")
    return root


def validate_directly(checkpoint_path: Path) -> float:
    """val/loss of a checkpoint's weights over its run's validation blocks, by Lightning's own validate loop."""
    import pytorch_lightning as pl

    from datamodules.mlm import MLMDataModule
    from lightning_modules.mlm import MLMModule

    checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
    def arguments(hparams: dict) -> dict:  # LightningCLI's own bookkeeping (_instantiator, _class_path) left out
        return {key: value for key, value in hparams.items() if not key.startswith("_")}

    module = MLMModule(**arguments(checkpoint["hyper_parameters"]))
    module.load_state_dict(checkpoint["state_dict"])
    data = MLMDataModule(**arguments(checkpoint["datamodule_hyper_parameters"]))
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    (result,) = trainer.validate(module, datamodule=data, verbose=False)
    return result["val/loss"]


@pytest.mark.slow
def test_several_runs_together_each_equal_its_own_trajectory(run, nope_run, tmp_path, monkeypatch):
    root, sentences = run
    saved = saved_figures(monkeypatch, session)
    common = ["--data", str(sentences), *COMMON]
    assert analyze.main(["trajectory", "--run", f"pe={root}", "--run", str(nope_run), *common,
                         "--output_dir", str(tmp_path / "both")]) == 0
    both = json.loads((tmp_path / "both" / "trajectory.json").read_text())
    assert (tmp_path / "both" / "trajectory.png").read_bytes()[:4] == b"\x89PNG"
    check_runs_figure(panels(saved["trajectory.png"]), both)
    assert both["labels"] == ["pe", "nope"] and [r["label"] for r in both["runs"]] == ["pe", "nope"]
    for label, directory, report in zip(("pe", "nope"), (root, nope_run), both["runs"], strict=True):
        assert analyze.main(["trajectory", "--run", f"{label}={directory}", *common,
                             "--output_dir", str(tmp_path / label)]) == 0
        alone = json.loads((tmp_path / label / "trajectory.json").read_text())
        assert report == alone  # the run's own single-run report, key for key
    pe, nope = both["runs"]
    assert pe["checkpoints"][0]["layers"] != nope["checkpoints"][0]["layers"]  # two different runs
    # each point's magnitudes equal the outlier report of that checkpoint alone
    point = nope["checkpoints"][-1]
    assert analyze.main(["outliers", "--encoder", point["path"], *common[:2], "--no_progress", "--max_sentences", "0",
                         "--seed", "2", "--output_dir", str(tmp_path / "o")]) == 0
    outliers = json.loads((tmp_path / "o" / "outliers.json").read_text())
    for row, separate in zip(point["layers"], outliers["layers"], strict=True):
        for key in ("kurtosis_mean", "kurtosis_max", "max_abs", "top1_share"):
            assert row[key] == pytest.approx(separate[key], rel=1e-9), key
    # the validation loss each checkpoint records: the validation of its own step, equal to validating its weights
    # directly; the PE run never validated (no val_check_interval reached)
    assert [(p["step"], p["val_loss_step"]) for p in nope["checkpoints"]] == [(2, 2), (4, 4), (6, 6)]
    for p in nope["checkpoints"]:
        assert p["val_loss"] == pytest.approx(validate_directly(Path(p["path"])), rel=1e-5)
    assert all(p["val_loss"] is None for p in pe["checkpoints"])


@pytest.mark.slow
def test_several_runs_refuse_bad_input_in_one_line_and_write_nothing(run, nope_run, tmp_path, capsys):
    root, sentences = run
    empty = tmp_path / "empty"
    (empty / "checkpoints").mkdir(parents=True)
    out = tmp_path / "out"
    common = ["--data", str(sentences), "--output_dir", str(out)]
    assert analyze.main(["trajectory", "--run", str(root), "--run", f"bare={empty}", *common]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"analyze.py trajectory: error: no checkpoints in {empty / 'checkpoints'} (train.py writes last.ckpt there; "
        "--checkpoint.save_top_k -1 keeps the periodic ones)"]
    assert analyze.main(["trajectory", "--run", f"a={root}", "--run", f"a={nope_run}", *common]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "analyze.py trajectory: error: duplicate run label 'a' in --run (label each run: --run NAME=RUN_DIR)"]
    assert analyze.main(["trajectory", "--run", f"{root}", "--run", f"{root}", *common]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "analyze.py trajectory: error: duplicate run label 'run' in --run (label each run: --run NAME=RUN_DIR)"]
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("objective, positions", [("causal", "learned"), ("mlm", "rope")])
def test_the_trajectory_of_a_causal_and_a_rotary_arms_run_reads_each_checkpoint_as_the_arm_computes(
        objective, positions, corpus, cache, tmp_path):
    """`trajectory --run` on a causal arm (RobertaForCausalLM) and a rotary one (RoFormerForMaskedLM): each point's
    family, its outlier shares and its attention sinks against the checkpoint's own model, one sentence at a time (the
    sinks from its eager attention: causal for the causal arm, rotated for the rotary one)."""
    from lightning_modules.encoder import load_encoder

    root = tmp_path / "run"
    tiny_run(root, corpus, cache, "--model.objective", objective, "--model.positions", positions,
             "--trainer.max_steps", "4")
    texts = corpus_sentences(12, start=300)
    sentences = tmp_path / "sentences.txt"
    sentences.write_text("\n".join(texts) + "\n", encoding="utf-8")
    assert analyze.main(["trajectory", "--run", str(root), "--data", str(sentences), *COMMON,
                         "--output_dir", str(tmp_path / "t")]) == 0
    points = json.loads((tmp_path / "t" / "trajectory.json").read_text())["checkpoints"]
    assert [point["step"] for point in points] == [2, 4]
    for point in points:
        family = point["model_family"]
        assert family["causal"] is (objective == "causal")
        assert family["positions"] == ("rotary (RoPE)" if positions == "rope" else "learned table")
        encoder = load_encoder(point["path"], device="cpu")
        model, tokenizer = encoder.model, encoder.tokenizer
        model.set_attn_implementation("eager")
        first, tokens = [[] for _ in range(2)], [[] for _ in range(3)]
        for text in texts:
            inputs = tokenizer(text, truncation=True, max_length=encoder.max_length, return_tensors="pt")
            with torch.no_grad():
                out = model(**inputs, output_attentions=True, output_hidden_states=True)
            for layer, weights in enumerate(out.attentions):  # [1, heads, T, T]
                if objective == "causal":
                    assert float(weights.triu(1).abs().max()) == 0.0
                first[layer].append(weights[0, :, :, 0].double().mean(-1))  # every query sees the first token
            for layer, states in enumerate(out.hidden_states):
                tokens[layer].append(states[0])
        for row, heads in zip(point["layers"][1:], first, strict=True):
            assert row["attention_sinks"]["first_token_mass"] == pytest.approx(float(torch.cat(heads).mean()),
                                                                              abs=2e-6)
        for row, states in zip(point["layers"], tokens, strict=True):
            top = torch.cat(states).argmax(-1)
            assert row["argmax_share"] == pytest.approx(float((top == row["argmax_dim"]).double().mean()), abs=1e-6)
            assert row["argmax_dim"] == int(torch.bincount(top).argmax())


def test_a_trajectory_of_truncated_sentences_says_how_many_were_cut(bert_tok, tmp_path, capsys):
    """--max_length 12 cuts the sentences longer than 12 tokens (counted here with the tokenizer): each point's
    num_truncated, and one warning line, as every other analysis says it."""
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    texts = corpus_sentences(30, start=700)
    data = tmp_path / "s.txt"
    data.write_text("".join(f"{t}\n" for t in texts), encoding="utf-8")
    longer = sum(len(ids) > 12 for ids in bert_tok(texts)["input_ids"])
    assert 0 < longer < len(texts)
    assert analyze.main(["trajectory", "--encoders", str(encoder), str(encoder), "--data", str(data), *COMMON,
                         "--max_length", "12", "--output_dir", str(tmp_path / "t")]) == 0
    report = json.loads((tmp_path / "t" / "trajectory.json").read_text())
    assert [point["num_truncated"] for point in report["checkpoints"]] == [longer, longer]
    for point in report["checkpoints"]:  # hundreds of tokens: no chance outlier (ours: metrics/null.py)
        assert all(row["chance_bound"] < 1e-10 for row in point["layers"]) and point["chance_warning"] is None
    assert [line for line in capsys.readouterr().err.splitlines() if "truncated" in line] == [
        f"warning: {longer} of {len(texts)} sentences were longer than 12 tokens and were truncated (counted in the "
        "report as num_truncated)"]


@pytest.mark.filterwarnings("ignore:IsoScore\\* not computed")
def test_a_trajectory_of_two_short_sentences_says_once_that_its_outliers_could_be_chance(bert_tok, tmp_path, capsys):
    """Two sentences of a few tokens: a dim planted in every LayerNorm is persistent at both points, but on so few
    tokens chance alone would flag some dim too: each layer's chance_bound is 2 x 32 x the binomial tail summed here
    (capped at 1), each point holds its chance_warning, and one line on stderr says it for both."""
    def plant(model):
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.bias[7] = 8.0

    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok, plant=plant)
    data = tmp_path / "s.txt"
    data.write_text("Yes.\nNo.\n", encoding="utf-8")
    capsys.readouterr()
    assert analyze.main(["trajectory", "--encoders", str(encoder), str(encoder), "--data", str(data), *COMMON,
                         "--output_dir", str(tmp_path / "t")]) == 0
    points = json.loads((tmp_path / "t" / "trajectory.json").read_text())["checkpoints"]
    for point in points:
        n = point["num_tokens"]
        tail = sum(math.comb(n, k) * 32.0 ** -k * (31 / 32) ** (n - k) for k in range(math.ceil(0.2 * n), n + 1))
        assert [row["chance_bound"] for row in point["layers"]] == pytest.approx([min(1.0, 64 * tail)] * 4, rel=1e-12)
        assert 7 in point["persistent_dims"] and f"rested on {n} token vectors" in point["chance_warning"]
    said = [line for line in capsys.readouterr().err.splitlines() if "chance" in line]
    assert said == [f"warning: at step {points[0]['step']} (and 1 more checkpoint), {points[0]['chance_warning']}"]
