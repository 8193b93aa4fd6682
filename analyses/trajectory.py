"""`analyze.py trajectory`: the outlier statistics, anisotropy and IsoScore* of every checkpoint of a training run, in
step order, on the same sentences: when the outliers emerge in our own runs (ours: the paper compares finished
models and has no trajectories).

    python analyze.py trajectory --run runs/pretrain/tiny --output_dir runs/pretrain/tiny/trajectory
    python analyze.py trajectory --run runs/pretrain/roberta-base-nope --data core/corpus/austen.txt --max_sentences 2000 \\
        --output_dir runs/trajectory/nope                     # train.py with --checkpoint.save_top_k -1 keeps them all
    python analyze.py trajectory --encoders ckpt_a ckpt_b hub/id-step_20k ... --output_dir D   # by step
    python analyze.py trajectory --run pe=runs/pretrain/tiny --run nope=runs/pretrain/tiny-nope --output_dir D
    compare_runs(args, [("pe", "runs/a"), ("nope", "runs/b")], "runs/study", stem="study")   # study.json, study.png

Each checkpoint is analysed as `analyze.py outliers` (NeuronStatistics + the outlier rule), `anisotropy --clip none`
(raw) and `isotropy --clip none` (raw IsoScore*) would analyse it, in one reference pass over the same sampled
sentences; one encoder is resident at a time (loaded, analysed, released), so the peak memory is that of one
analysis whatever the number of checkpoints. Checkpoints are read weights-only (lightning_modules/checkpoints.py).
Per layer, each point also holds the outlier magnitudes of NeuronStatistics (kurtosis_mean, kurtosis_max, max_abs,
top1_share; Bondarenko et al.'s kurtosis_sequence, inf_norm_sequence) and of analyses/magnitudes.py
(massive_activations, attention_sinks, magnitude_outliers, as in outliers.json; the sinks in one more pass with eager
attention, unless --no_attention_sinks) and the outlier rule's chance_bound (ours, as in outliers.json), and each
point the MLM validation loss its checkpoint records (val_loss, at val_loss_step; null when none) and its
chance_warning (ours, as in outliers.json; the first one printed). Several runs (`--run A --run B`, each `LABEL=DIR`
or labelled by its directory's name) are analysed on the same sentences and written together: one JSON holding each
run's own trajectory report, one figure with the runs as lines (compare_runs).
"""

from __future__ import annotations

import argparse
import gc
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from analyses.geometry import minibatch_isoscores, minibatch_shortfall, pair_anisotropy
from analyses.magnitudes import Magnitudes, rules_of
from analyses.reference import number, reference_pass
from analyses.reports import fmt
from analyses.session import collectively, finish, open_encoder, read_sentences, setting_of, warn_text_counts
from core.errors import UserError, library_line, warn_once
from core.models import model_family
from core.output import check_writable
from core.sources import cannot_load, local_path, pretrained, split_revision
from core.step_figures import over_steps_figure
from core.wording import plural
from lightning_modules.arms import arm_of
from lightning_modules.checkpoints import read_checkpoint
from lightning_modules.encoder import resolve_model_dir
from lightning_modules.mlm import ARCHITECTURE
from metrics.outliers import OutlierRule, chance_of, detect_outliers, persistent_dims
from metrics.summary import over_layers, top_share
from metrics.transforms import RAW

STEP = r"step[_=-]?(\d+)(k?)"  # a step in a name: step_20k, step=100, step3000
PREFERENCE = ("last.ckpt", "previous.ckpt")  # of two checkpoints of one step, a periodic one's name is kept first


@dataclass
class Point:
    source: str  # what load_encoder opens
    step: int
    step_from: str  # "checkpoint" (its global_step), "name" (step_20k, step=100), "order" (position in --encoders)


def run_points(run: str) -> list[Point]:
    """The checkpoints of a train.py run directory (`checkpoints/*.ckpt`, or *.ckpt in the directory itself) by step,
    one per step."""
    path = local_path(run, "run directory")
    if path is None or not path.is_dir():
        raise UserError(f"run directory not found: {run}")
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    files = sorted(folder.glob("*.ckpt"), key=lambda f: (f.name in PREFERENCE, PREFERENCE.index(f.name)
                                                         if f.name in PREFERENCE else 0, f.name))
    if not files:
        raise UserError(f"no checkpoints in {folder} (train.py writes last.ckpt there; --checkpoint.save_top_k -1 "
                        "keeps the periodic ones)")
    points: dict[int, Point] = {}
    for file in files:
        step = read_checkpoint(file).get("global_step")
        if not isinstance(step, int):
            raise UserError(f"{file} holds no global_step")
        points.setdefault(step, Point(str(file), step, "checkpoint"))
    return [points[step] for step in sorted(points)]


def encoder_points(sources: list[str]) -> list[Point]:
    """--encoders by step, each step from a checkpoint's global_step or a name's step (step_20k, step=100; a hub id's
    revision before its name: Pythia's org/name@step3000), so that a shell glob's string order (step=1000 before
    step=250) is no trajectory's order; encoders without steps are kept in the order given, each at its position in the
    list."""
    points = []
    for index, source in enumerate(sources):
        resolved = resolve_model_dir(source)
        if resolved.endswith(".ckpt"):
            points.append(Point(source, int(read_checkpoint(resolved).get("global_step", index)), "checkpoint"))
            continue
        name, revision = split_revision(source)  # a hub id's revision names its step first (org/name@step3000)
        found = re.search(STEP, revision or "", re.IGNORECASE) or re.search(STEP, Path(name).name, re.IGNORECASE)
        points.append(Point(source, int(found.group(1)) * (1000 if found.group(2) else 1), "name") if found
                      else Point(source, index, "order"))
    check_steps(points)
    return sorted(points, key=lambda point: point.step)  # stable: positions in the list are already in order


def check_steps(points: list[Point]) -> None:
    """Steps of one kind: a position in the list is no step to plot beside a checkpoint's (an export after step-2 and
    step-6 checkpoints would stand at step 1), and one point per step (`checkpoints/*.ckpt` lists last.ckpt and
    previous.ckpt again beside their periodic twins)."""
    unstepped = next((point for point in points if point.step_from == "order"), None)
    stepped = next((point for point in points if point.step_from != "order"), None)
    if unstepped is not None and stepped is not None:
        raise UserError(f"--encoders: {unstepped.source} has no step (not a checkpoint, no step in its name such as "
                        f"step_20k) but {stepped.source} is at step {stepped.step}: give its checkpoint, or a name "
                        "with its step, or list only encoders without steps (kept in the order given)")
    seen: dict[int, Point] = {}
    for point in points:
        if point.step_from != "order" and point.step in seen:
            raise UserError(f"--encoders: {seen[point.step].source} and {point.source} are both at step {point.step}: "
                            "give one encoder per step (--run RUN_DIR keeps one checkpoint per step)")
        seen.setdefault(point.step, point)


def architecture(source: str) -> dict:
    """What makes two encoders comparable point by point: layers, sizes, heads, vocabulary, positions (and, for this
    project's checkpoints, positional embeddings or none)."""
    resolved = resolve_model_dir(source)
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "max_position_embeddings",
            "vocab_size")
    if resolved.endswith(".ckpt"):
        hparams = read_checkpoint(resolved)["hyper_parameters"]
        objective, positions = arm_of(hparams)
        return {"model_type": "roformer" if positions == "rope" else "roberta", "objective": objective,
                "positions": positions, **{key: hparams.get(key) for key in (*keys, *ARCHITECTURE)}}
    from transformers import AutoConfig

    try:
        config = pretrained(AutoConfig, resolved)
    except (OSError, ValueError) as error:
        raise cannot_load("encoder", source, library_line(error)) from None
    return {"model_type": config.model_type, **{key: getattr(config, key, None) for key in keys}}


def check_architectures(points: list[Point]) -> None:
    """One line naming the first two points whose architectures differ (on a key both report)."""
    first = architecture(points[0].source)
    for point in points[1:]:
        other = architecture(point.source)
        for key in first:
            if key in other and first[key] != other[key]:
                raise UserError(f"checkpoints of different architectures in one trajectory: {points[0].source} has "
                                f"{key}={first[key]} but {point.source} has {key}={other[key]}")


def analyse(args, point: Point, sentences: list[str], rank: int, world: int, encoder=None) -> tuple[dict, int]:
    """One checkpoint: outlier statistics, raw anisotropy and raw IsoScore* per layer, from one reference pass; and the
    encoder's maximum length. `encoder`: one already open (the study's Gaussian null) instead of `point.source`."""
    opened = encoder is None
    if opened:
        args.encoder = point.source
        encoder = collectively(lambda: open_encoder(args))
    setting = setting_of(args, encoder, rank, world)
    magnitudes = Magnitudes.of(args, encoder, attention=opened)  # a Gaussian twin has no attention to read
    reference = reference_pass(setting, sentences, rule=OutlierRule(args.min_share, args.sigma), statistics=True,
                               covariance=True, sample=2 * args.num_pairs, desc=f"step {point.step}",
                               magnitudes=magnitudes)
    magnitudes.attention_pass(setting, sentences)
    if reference.statistics.num_tokens == 0:
        raise UserError("no tokens counted for the outlier statistics (all special tokens excluded?)")
    rule, tokens = OutlierRule(args.min_share, args.sigma), reference.statistics.num_tokens
    layers = detect_outliers(reference.statistics, rule)
    chance = chance_of(layers, tokens, encoder.hidden_size, rule)  # ours: metrics/outliers.py, metrics/null.py
    statistics, more = reference.statistics.magnitudes(), magnitudes.layers()
    anisotropy, pairs = pair_anisotropy(reference.sample, [RAW], args.seed)
    if pairs == 0:
        raise UserError(f"anisotropy needs at least 2 sentences with a token, got {int(reference.sample[1].sum())}")
    star, _, batches = minibatch_isoscores(reference, RAW, args.seed, args.zeta, args.minibatch, args.minibatches)
    shortfall = minibatch_shortfall(batches, args.minibatch, args.minibatches, int(reference.sample[1].sum()),
                                    reference.num_sentences, args.num_pairs, args.max_sentences)
    if shortfall and rank == 0:
        warn_once(shortfall)  # the same sentences at every checkpoint: said once
    result = {"step": point.step, "step_from": point.step_from, "path": point.source,
              "encoder_commit": encoder.commit,  # the hub commit `path` was read at; None for a checkpoint, a path
              "persistent_dims": persistent_dims(layers), "num_tokens": tokens,
              "chance_warning": chance["chance_warning"],
              **reference.counts(), "num_pairs": pairs, "num_minibatches": batches,
              "model_family": model_family(encoder.model).to_dict(),  # causal or not, positions (a causal / rotary arm)
              "layers": [{"layer": layer.layer, "argmax_dim": layer.argmax_dim, "argmax_share": layer.argmax_share,
                          "argmin_dim": layer.argmin_dim, "argmin_share": layer.argmin_share,
                          "outlier_dims": layer.outlier_dims, "chance_bound": chance["chance_bound"],
                          **statistics[layer.layer], **more[layer.layer],
                          "scale": number(reference.statistics.layer_scale[layer.layer]),
                          "anisotropy": number(anisotropy["raw"][layer.layer]),
                          "isoscore_star": number(star[layer.layer])} for layer in layers]}
    max_length = args.max_length or encoder.max_length
    del encoder, setting, reference, magnitudes  # one encoder resident at a time
    if opened:  # (one handed in stays the caller's)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return result, max_length


def parse_runs(texts: list[str]) -> list[tuple[str, str]]:
    """--run [LABEL=]RUN_DIR, given once or more -> [(label, run directory)]; the label defaults to the directory's
    name. A text with "=" is LABEL=DIR unless the label part holds a path separator or the whole text is a directory."""
    runs = []
    for text in texts:
        label, sep, run = text.partition("=")
        if not sep or "/" in label or "\\" in label or not label or Path(text).is_dir():
            label, run = Path(text.rstrip("/\\")).name or text, text
        if not run:
            raise UserError(f"--run {text}: no run directory after the label")
        runs.append((label, run))
    labels = [label for label, _ in runs]
    duplicate = next((label for label in labels if labels.count(label) > 1), None)
    if duplicate is not None:
        raise UserError(f"duplicate run label {duplicate!r} in --run (label each run: --run NAME=RUN_DIR)")
    return runs


def validation_loss(point: Point) -> dict | None:
    """The MLM validation loss a checkpoint of this project records (the latest validation's, at its own step);
    None for other encoders and for checkpoints without one."""
    if point.step_from != "checkpoint" or not point.source.endswith(".ckpt"):
        return None
    recorded = read_checkpoint(point.source).get("val_loss")
    return recorded if isinstance(recorded, dict) else None


def trajectory_of(args, points: list[Point], sentences: list[str], rank: int, world: int, run: str | None = None,
                  label: str | None = None) -> dict:
    """The trajectory report of `points` (a run's checkpoints, or --encoders), analysed on `sentences`."""
    analysed = [analyse(args, point, sentences, rank, world) for point in points]
    checkpoints = [result for result, _ in analysed]
    for point, result in zip(points, checkpoints):
        loss = validation_loss(point)
        result["val_loss"] = None if loss is None else number(loss["value"])
        result["val_loss_step"] = None if loss is None else loss["step"]
    return {"run": str(run) if run else None, "label": label, "encoders": None if run else list(args.encoders),
            "data": str(args.data), "max_length": analysed[0][1], "dtype": getattr(args, "dtype", "float32"),
            "special_tokens": "excluded" if args.exclude_special else "included", "seed": args.seed,
            "indexing": "0-indexed dimensions; layer 0 = embedding output", "num_sentences": len(sentences),
            "rule": {"min_share": args.min_share, "sigma": args.sigma}, "zeta": args.zeta,
            "minibatch_tokens": args.minibatch, "anisotropy": "raw: mean cosine of random token pairs",
            "kurtosis": "Pearson (not excess) kurtosis of each token vector's components: mean and max over tokens",
            "kurtosis_sequence": "Bondarenko et al.'s: the kurtosis of each sequence's flattened tokens x hidden "
                                 "values (mu4 / (s^4 + 1e-6)), averaged over sequences; inf_norm_sequence: each "
                                 "sequence's max |x|, averaged",
            **rules_of(args),
            "checkpoints": checkpoints}


def note_single(name: str, points: list[Point], rank: int) -> None:
    if len(points) == 1 and rank == 0:
        print(f"note: {name} has a single checkpoint (step {points[0].step}): the trajectory has one point",
              file=sys.stderr)


def run_trajectory(args, rank: int, world: int) -> dict:
    """`analyze.py trajectory`: one run or --encoders (trajectory.json / .png as always), or several runs together
    (compare_runs)."""
    if args.run_dir is not None:
        runs = collectively(lambda: parse_runs(args.run_dir))
        if len(runs) > 1:
            return compare_runs(args, runs, args.output_dir, "trajectory", rank, world)
        (label, run), = runs
    else:
        label, run = None, None

    def plan():
        points = run_points(run) if run else encoder_points(args.encoders)
        check_architectures(points)
        sentences = read_sentences(args)
        if rank == 0:
            check_writable(args.output_dir)
        return points, sentences

    points, sentences = collectively(plan)
    note_single(run or args.encoders[0], points, rank)
    report = trajectory_of(args, points, sentences, rank, world, run, label)
    finish(args, rank, {"trajectory.json": report}, {"trajectory.png": lambda: trajectory_figure(report)})
    if rank == 0:
        print_trajectory(report)  # the same sentences and tokenizer at every point: one count (each point keeps its own)
        warn_text_counts({"trajectory": {**report, **{key: max(point[key] for point in report["checkpoints"])
                                                      for key in ("num_truncated", "num_unknown")}}})
        warn_chance(report["checkpoints"])
    return report


def warn_chance(points: list[dict]) -> None:
    """One line on stderr for the checkpoints whose outliers could be chance (ours): the first one's chance_warning."""
    warned = [point for point in points if point.get("chance_warning")]
    if warned:
        more = f" (and {plural(len(warned) - 1, 'more checkpoint')})" if len(warned) > 1 else ""
        print(f"warning: at step {warned[0]['step']}{more}, {warned[0]['chance_warning']}", file=sys.stderr)


def compare_runs(args, runs: list[tuple[str, str]], output_dir: str, stem: str = "trajectory", rank: int = 0,
                 world: int = 1) -> dict:
    """Several runs' trajectories on the same sentences, drawn together: `{stem}.json` (per run, exactly the
    single-run trajectory.json of that run) and `{stem}.png` (the runs as lines against the step). `runs`: [(label,
    run directory)], labels distinct; `args`: the options of `analyze.py trajectory` (data, sampling, rule, IsoScore*,
    ...), e.g. `analyze.build_parser().parse_args(["trajectory", "--run", RUN_DIR, ...])`. Every run is checked
    (its checkpoints, one architecture within it) before anything is analysed or written."""
    report, _ = run_trajectories(args, runs, output_dir, rank, world)
    target = argparse.Namespace(output_dir=output_dir)
    finish(target, rank, {f"{stem}.json": report}, {f"{stem}.png": lambda: runs_figure(report)})
    if rank == 0:
        for single in report["runs"]:
            print_trajectory(single)
    return report


def run_trajectories(args, runs: list[tuple[str, str]], output_dir: str, rank: int = 0, world: int = 1
                     ) -> tuple[dict, list[str]]:
    """compare_runs' report, written nowhere, and the sentences it was analysed on (the study adds its null and seed
    statistics before writing)."""
    labels = [label for label, _ in runs]
    if len(set(labels)) != len(labels):
        raise UserError(f"duplicate run label {next(x for x in labels if labels.count(x) > 1)!r} in --run (label each "
                        "run: --run NAME=RUN_DIR)")

    def plan():
        planned = []
        for _, run in runs:
            points = run_points(run)
            check_architectures(points)
            planned.append(points)
        sentences = read_sentences(args)
        if rank == 0:
            check_writable(output_dir)
        return planned, sentences

    planned, sentences = collectively(plan)
    for (_, run), points in zip(runs, planned):
        note_single(run, points, rank)
    reports = [trajectory_of(args, points, sentences, rank, world, run, label)
               for (label, run), points in zip(runs, planned)]
    report = {"runs": reports, "labels": labels, "data": str(args.data), "num_sentences": len(sentences),
              "seed": args.seed, "indexing": "0-indexed dimensions; layer 0 = embedding output",
              "summary": {"top_share": "max over layers 1..L of the dominant dimension's argmax or argmin share",
                          "kurtosis": "max over layers 1..L of the mean (over tokens) Pearson kurtosis",
                          "max_abs": "max over layers 1..L of max |activation|",
                          "anisotropy": "mean over layers 1..L", "isoscore_star": "mean over layers 1..L"}}
    return report, sentences


def summary_of(point: dict, key: str) -> float:
    """One number per checkpoint for the runs figure: an outlier measure's max over the non-input layers, a geometry
    measure's mean over them (layer 0 too when it is the only layer): metrics/summary.py, as the live W&B summary."""
    rows = point["layers"]
    layers = [row["layer"] for row in rows]
    if key == "top_share":
        return top_share([row["argmax_share"] for row in rows], [row["argmin_share"] for row in rows], layers)
    how = "max" if key in ("kurtosis_mean", "max_abs") else "mean"
    return over_layers([row[key] for row in rows], layers, how)


YLABELS = {"top_share": "share of tokens", "argmax_share": "share of tokens", "argmin_share": "share of tokens",
           "kurtosis_mean": "kurtosis", "max_abs": "max |activation|", "anisotropy": "mean cosine",
           "isoscore_star": "IsoScore*"}  # each panel's y axis


def runs_figure(report: dict):
    """The runs as lines against the step: top outlier share, kurtosis, max |activation| (max over layers 1..L),
    anisotropy and IsoScore* (mean over layers 1..L), and the MLM validation loss when the checkpoints record it."""
    measures = [("top_share", "top outlier share (max over layers)", False),
                ("kurtosis_mean", "kurtosis, mean over tokens (max over layers)", True),
                ("max_abs", "max |activation| (max over layers)", True),
                ("anisotropy", "anisotropy (mean over layers)", False),
                ("isoscore_star", "IsoScore* (mean over layers)", False)]
    panels = [{"title": title, "ylabel": YLABELS[key], "log": log, "series": {
        run["label"]: ([p["step"] for p in run["checkpoints"]], [summary_of(p, key) for p in run["checkpoints"]])
        for run in report["runs"]}} for key, title, log in measures]
    losses = {run["label"]: ([p["step"] for p in run["checkpoints"] if p["val_loss"] is not None],
                             [p["val_loss"] for p in run["checkpoints"] if p["val_loss"] is not None])
              for run in report["runs"]}
    if any(steps for steps, _ in losses.values()):
        panels.append({"title": "validation loss: masked or next token, by the run (latest at each checkpoint)", "ylabel": "cross-entropy",
                       "series": {label: values for label, values in losses.items() if values[0]}})
    return over_steps_figure(panels, title=f"outliers and anisotropy over training: {', '.join(report['labels'])}",
                             columns=3)


def trajectory_figure(report: dict):
    """Per layer against the step: the dominant dimensions' shares of the max and the min, kurtosis, max |activation|,
    anisotropy, IsoScore*."""
    checkpoints = report["checkpoints"]
    steps = [point["step"] for point in checkpoints]
    layers = [row["layer"] for row in checkpoints[0]["layers"]]
    empty = (f"IsoScore* needs mini-batches of {report.get('minibatch_tokens')} tokens, one per sentence: "
             f"{plural(report.get('num_sentences') or 0, 'sentence')} here")
    panels = [{"title": title, "ylabel": YLABELS[key], "log": key in ("kurtosis_mean", "max_abs"), "series": {
        f"layer {layer}": (steps, [
            point["layers"][layer][key] if point["layers"][layer][key] is not None else float("nan")
            for point in checkpoints]) for layer in layers}, "empty": empty if key == "isoscore_star" else ""}
        for key, title in (("argmax_share", "share of tokens whose max the dominant dim holds"),
                           ("argmin_share", "share of tokens whose min the dominant dim holds"),
                           ("kurtosis_mean", "kurtosis of token vectors (mean over tokens)"),
                           ("max_abs", "max |activation|"),
                           ("anisotropy", "anisotropy (random token pairs)"), ("isoscore_star", "IsoScore*"))]
    source = report["label"] or report["run"] or f"{len(checkpoints)} encoders"
    return over_steps_figure(panels, title=f"outliers and anisotropy over training: {source}", columns=3)


def print_trajectory(report: dict) -> None:
    name = report["label"] if report["label"] and report["run"] and report["label"] != Path(report["run"]).name \
        else None
    print(f"\ntrajectory of {report['run'] or ', '.join(report['encoders'])}{f' ({name})' if name else ''} on "
          f"{report['data']} ({plural(report['num_sentences'], 'sentence')}; dims 0-indexed)")
    print(f"{'step':>8}  {'persistent dims':<20} last layer: argmax dim (share), kurtosis, max |x|, anisotropy, "
          "IsoScore*")
    for point in report["checkpoints"]:
        last = point["layers"][-1]
        print(f"{point['step']:>8}  {str(point['persistent_dims'] or '-'):<20} {last['argmax_dim']} "
              f"({last['argmax_share']:.1%}), {last['kurtosis_mean']:.2f}, {last['max_abs']:.3g}, "
              f"{fmt(last['anisotropy'], 4)}, {fmt(last['isoscore_star'], 4)}")  # '-': not computed (null)
