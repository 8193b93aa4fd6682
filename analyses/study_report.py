"""The study's comparison: every run's trajectory on the same sentences, the null, the statistics across seeds and
the verdicts (analyses/null.py), written as <output_dir>/study.json and study.png, and printed per arm.

    report = compare_study(trajectory_args, runs, "runs/study", {"gaussian_samples": 3, "margin": 0.5})

`runs`: [(arm, seed, run directory)]. study.json holds compare_runs' report (`runs`: each run's own trajectory,
labelled <arm>/seed<k>), and `seeds`, `null` (its definition, margin, statistics and the Gaussian samples' points) and
`arms` (per arm: per checkpoint the statistics across seeds and the null; the verdict).
"""

from __future__ import annotations

import argparse

from analyses.null import STATISTICS, SUMMARIES, gaussian_nulls, seed_statistics
from analyses.session import finish
from analyses.trajectory import run_trajectories
from core.step_figures import over_steps_figure
from core.wording import plural

NULL_DEFINITION = ("a statistic's null at a checkpoint is the larger of (a) the same run at step 0 and (b) the largest "
                   "over the Gaussian samples (N(0, 1) hidden states of the same size on the same tokens), each "
                   "summarised like the statistic (max over layers 1..L), scale-dependent statistics at the "
                   "checkpoint's scale per layer (median over dimensions of their RMS); beyond the null: value > (1 + margin) x null")
TITLES = {"top_share": "top outlier share (max over layers)",
          "kurtosis_sequence": "kurtosis per sequence (max over layers)",
          "inf_norm_sequence": "max |activation| per sequence (max over layers)", "anisotropy": "anisotropy (mean over layers)",
          "isoscore_star": "IsoScore* (mean over layers)"}
LABELS = {"top_share": "share of tokens", "kurtosis_sequence": "kurtosis", "inf_norm_sequence": "max |activation|",
          "anisotropy": "mean cosine", "isoscore_star": "IsoScore*"}


def compare_study(args, runs: list[tuple[str, int, str]], output_dir: str, null: dict, rank: int = 0,
                  world: int = 1) -> dict:
    """Analyse every run, add the null and the seed statistics, write study.json / study.png (rank 0)."""
    report, sentences = run_trajectories(args, [(f"{arm}/seed{seed}", run) for arm, seed, run in runs], output_dir,
                                         rank, world)
    nulls = gaussian_nulls(args, report, sentences, null["gaussian_samples"], rank, world)
    arms: dict[str, list[tuple[int, str]]] = {}
    for arm, seed, _ in runs:
        arms.setdefault(arm, []).append((seed, f"{arm}/seed{seed}"))
    report["seeds"] = sorted({seed for _, seed, _ in runs})
    report["null"] = {"definition": NULL_DEFINITION, "margin": null["margin"],
                      "gaussian_samples": null["gaussian_samples"], "statistics": list(STATISTICS),
                      "scaled": [key for key, scaled in STATISTICS.items() if scaled], "gaussian": nulls}
    report["arms"] = seed_statistics(report, arms, nulls, null["margin"])
    finish(argparse.Namespace(output_dir=output_dir), rank, {"study.json": report},
           {"study.png": lambda: study_figure(report)})
    if rank == 0:
        print_study(report)
    return report


def band(arm: dict, get) -> tuple[list, list, list, list]:
    """(steps, means, lows, highs) of one arm: the mean over seeds and the seeds' range."""
    steps, means, lows, highs = [], [], [], []
    for point in arm["checkpoints"]:
        entry = get(point)
        values = [value for value in entry["seeds"].values() if value is not None]
        if entry["mean"] is None or not values:
            continue
        steps.append(point["step"])
        means.append(entry["mean"])
        lows.append(min(values))
        highs.append(max(values))
    return steps, means, lows, highs


def study_figure(report: dict):
    """Per statistic, each arm's mean over seeds against the step with the seeds' range as a band; for the verdict's
    statistics, a dashed line per arm at (1 + margin) x its null (mean over seeds): above it is beyond the null."""
    margin = report["null"]["margin"]
    panels = []
    for key in SUMMARIES:
        panel = {"title": TITLES.get(key, f"{key} (max over layers)"), "ylabel": LABELS.get(key, key),
                 "log": key in STATISTICS and key != "top_share",
                 "series": {arm["arm"]: band(arm, lambda point, key=key: point["summary"][key])
                            for arm in report["arms"]}}
        if key in STATISTICS:
            panel["thresholds"] = {}
            for arm in report["arms"]:
                steps, values = [], []
                for point in arm["checkpoints"]:
                    nulls = [entry["null"] for entry in point["null"][key]["seeds"].values() if entry["null"]]
                    if nulls:
                        steps.append(point["step"])
                        values.append((1 + margin) * sum(nulls) / len(nulls))
                panel["thresholds"][arm["arm"]] = (steps, values)
            panel["threshold_label"] = f"(1 + {margin:g}) x null"
        panels.append(panel)
    if any(band(arm, lambda point: point["val_loss"])[0] for arm in report["arms"]):
        panels.append({"title": "validation loss: masked or next token, by the arm (latest at each checkpoint)", "ylabel": "cross-entropy",
                       "series": {arm["arm"]: band(arm, lambda point: point["val_loss"]) for arm in report["arms"]}})
    seeds = report["seeds"]
    return over_steps_figure(panels, columns=3, title=f"outlier study: mean over {plural(len(seeds), 'seed')} "
                             f"({', '.join(map(str, seeds))}), band: the seeds' range")


def number(entry: dict, digits: int = 3) -> str:
    mean, sd = entry["mean"], entry["sd"]
    if mean is None:
        return "-"
    return f"{mean:.{digits}g}" + (f"±{sd:.2g}" if sd is not None else "")


def print_study(report: dict) -> None:
    """Per arm and checkpoint: each verdict statistic's mean ± sd over seeds with its count of seeds beyond the null,
    the validation loss; then each arm's verdicts."""
    keys = list(STATISTICS)
    print(f"\n{'arm':<16} {'step':>6}  " + " ".join(f"{key + ' (beyond)':<26}" for key in keys) + f" {'val loss':>12}")
    for arm in report["arms"]:
        for point in arm["checkpoints"]:
            cells = [f"{number(point['summary'][key])} "
                     f"({point['null'][key]['beyond']}/{point['null'][key]['of']})" for key in keys]
            print(f"{arm['arm']:<16} {point['step']:>6}  " + " ".join(f"{cell:<26}" for cell in cells)
                  + f" {number(point['val_loss'], 4):>12}")
    print(f"\nverdicts (margin {report['null']['margin']:g}; docs/study.md):")
    for arm in report["arms"]:
        verdict = arm["verdict"]
        if verdict is None:
            print(f"  {arm['arm']}: no step every seed reached")
            continue
        print(f"  {arm['arm']} at step {verdict['step']}: "
              + "; ".join(f"{key} {verdict[key]['verdict']}" for key in keys))

