"""The study's seeds and null (ours): per arm and checkpoint, every statistic's mean and sd across seeds with each seed's
own value; each verdict statistic's null, its excess over it, and the verdict "beyond the null in k of n seeds".

    nulls = gaussian_nulls(args, report, sentences, samples=3, rank=0, world=1)   # Gaussian twins' trajectory points
    arms = seed_statistics(report, {"baseline": [(0, "baseline/seed0"), ...]}, nulls, margin=0.5)

The null of a statistic, for one run at one checkpoint, is the larger of
  (a) the same run at step 0 (its step-0 checkpoint: the model before any update; study.py saves one in every run), and
  (b) the largest over `samples` Gaussian twins (lightning_modules/null.py): seeded N(0, 1) hidden states of the same
      hidden size and layer count on the same sentences and tokens (so the same token count), analysed exactly as a
      checkpoint is (analyse in analyses/trajectory.py: NeuronStatistics and the paper's rule).
Each is taken layer by layer and summarised like the statistic (the largest over layers 1..L); a statistic that scales
with the activations (max |x|) is first brought to the checkpoint's own scale in each layer (metrics/null.py,
`rescaled`: times the checkpoint's scale over the null's, the scale being the median over dimensions of each
dimension's root mean square, which an outlier dimension does not move). A seed is "beyond the null" when its value exceeds (1 +
margin) times that null (metrics/null.py, `beyond`); the arm's verdict, at the last step every seed reached, counts
those seeds for each statistic of STATISTICS.
"""

from __future__ import annotations

import math

from analyses.session import collectively, open_encoder
from analyses.trajectory import Point, analyse, architecture, summary_of
from lightning_modules.null import gaussian_encoder
from metrics.null import across_seeds, beyond, rescaled, verdict_text

# The verdict's statistics -> whether they scale with the activations (then compared at the checkpoint's own scale):
# the paper's share, and Bondarenko et al.'s kurtosis and infinity-norm, per sequence (metrics/neuron_stats.py)
STATISTICS = {"top_share": False, "kurtosis_sequence": False, "inf_norm_sequence": True}
SUMMARIES = (*STATISTICS, "anisotropy", "isoscore_star")  # per checkpoint, as study.png draws them
POINT_KEYS = ("val_loss", "num_tokens")  # per checkpoint, besides the layers


def layer_value(row: dict, key: str) -> float | None:
    """A layer's value of a statistic; `top_share`: the dominant dimension's share of the max or the min."""
    if key == "top_share":
        return max(row["argmax_share"], row["argmin_share"])
    value = row.get(key)
    return None if value is None else float(value)


def worst(values: list[float | None]) -> float | None:
    """The largest over layers 1..L (layer 0 too when it is the only one)."""
    kept = [value for value in (values[1:] or values) if value is not None and not math.isnan(value)]
    return max(kept) if kept else None


def null_value(point: dict, null: dict, key: str) -> float | None:
    """The null point's statistic, layer by layer at `point`'s scale when it scales, summarised like the statistic."""
    values = []
    for row, reference in zip(point["layers"], null["layers"]):
        value = layer_value(reference, key)
        if value is not None and STATISTICS[key]:
            value = rescaled(value, reference.get("scale"), row.get("scale"))
        values.append(value)
    return worst(values)


def shape_of(run: dict) -> tuple:
    """What a Gaussian null must share with a run: the hidden size, the layer count, and the tokens (the same
    sentences, tokenizer and length)."""
    first = run["checkpoints"][0]
    return architecture(first["path"])["hidden_size"], len(first["layers"]), first["num_tokens"], run["max_length"]


def gaussian_nulls(args, report: dict, sentences: list[str], samples: int, rank: int = 0, world: int = 1) -> list[dict]:
    """For each group of runs of one shape: `samples` Gaussian twins of the group's first checkpoint, analysed on
    `sentences` as the runs were. [{"runs": labels, "samples": [trajectory points]}]."""
    groups: dict[tuple, list[dict]] = {}
    for run in report["runs"]:
        groups.setdefault(shape_of(run), []).append(run)
    nulls = []
    for runs in groups.values():
        args.encoder = runs[0]["checkpoints"][0]["path"]
        encoder = collectively(lambda: open_encoder(args))
        points = []
        for index in range(samples):
            seed = args.seed + index
            twin = gaussian_encoder(encoder, seed, rank)
            point, _ = analyse(args, Point(f"gaussian:{seed}", 0, "gaussian"), sentences, rank, world, encoder=twin)
            points.append({"seed": seed, **point})
        hidden = encoder.hidden_size
        del encoder
        if points and points[0]["num_tokens"] != runs[0]["checkpoints"][0]["num_tokens"]:
            raise RuntimeError("the Gaussian null counted other tokens than the runs")  # the same tokenizer and rules
        nulls.append({"runs": [run["label"] for run in runs], "hidden_size": hidden, "samples": points})
    return nulls


def seed_values(points: dict[int, dict], get) -> dict:
    """{"mean", "sd", "seeds": {seed: value}} of `get(point)` over the seeds' points."""
    values = {str(seed): get(point) for seed, point in points.items()}
    return {**across_seeds(list(values.values())), "seeds": values}


def layer_statistics(points: dict[int, dict]) -> list[dict]:
    """Per layer, every number of the trajectory rows across seeds (mean, sd, each seed's); dimensions per seed."""
    first = next(iter(points.values()))
    layers = []
    for index, row in enumerate(first["layers"]):
        out = {"layer": row["layer"]}
        for key, value in row.items():
            if key == "layer":
                continue
            if key.endswith(("_dim", "_dims")) or not isinstance(value, (int, float)) and value is not None:
                out[key] = {"seeds": {str(seed): point["layers"][index][key] for seed, point in points.items()}}
            else:
                out[key] = seed_values(points, lambda point, key=key, index=index: point["layers"][index][key])
        layers.append(out)
    return layers


def null_statistics(points: dict[int, dict], initial: dict[int, dict | None], gaussian: dict[int, list[dict]],
                    margin: float) -> dict:
    """Per verdict statistic: each seed's value, its nulls (step 0, Gaussian), excess, ratio and whether it is beyond;
    the excess across seeds and the count of seeds beyond."""
    out = {}
    for key in STATISTICS:
        seeds = {}
        for seed, point in points.items():
            value = worst([layer_value(row, key) for row in point["layers"]])
            step0 = null_value(point, initial[seed], key) if initial.get(seed) is not None else None
            noise = [null_value(point, sample, key) for sample in gaussian[seed]]
            noise = max((v for v in noise if v is not None), default=None)
            null = max((v for v in (step0, noise) if v is not None), default=None)
            seeds[str(seed)] = {"value": value, "null_step0": step0, "null_gaussian": noise, "null": null,
                                "excess": None if value is None or null is None else value - null,
                                "ratio": None if value is None or not null else value / null,
                                "beyond": beyond(value, null, margin)}
        count = sum(entry["beyond"] for entry in seeds.values())
        out[key] = {"excess": across_seeds([entry["excess"] for entry in seeds.values()]), "beyond": count,
                    "of": len(seeds), "verdict": verdict_text(count, len(seeds)), "seeds": seeds}
    return out


def seed_statistics(report: dict, arms: dict[str, list[tuple[int, str]]], nulls: list[dict], margin: float
                    ) -> list[dict]:
    """Per arm (`arms`: name -> [(seed, run label)]), per checkpoint step: the statistics across seeds and the null;
    and the arm's verdict at the last step every seed reached."""
    runs = {run["label"]: run for run in report["runs"]}
    samples = {label: null["samples"] for null in nulls for label in null["runs"]}
    out = []
    for arm, members in arms.items():
        by_step: dict[int, dict[int, dict]] = {}
        initial, gaussian = {}, {}
        for seed, label in members:
            run = runs[label]
            for point in run["checkpoints"]:
                by_step.setdefault(point["step"], {})[seed] = point
            initial[seed] = next((point for point in run["checkpoints"] if point["step"] == 0), None)
            gaussian[seed] = samples.get(label, [])
        checkpoints = []
        for step in sorted(by_step):
            points = by_step[step]
            checkpoints.append({
                "step": step, "seeds": sorted(points),
                "summary": {key: seed_values(points, lambda point, key=key: summary_value(point, key))
                            for key in SUMMARIES},
                **{key: seed_values(points, lambda point, key=key: point.get(key)) for key in POINT_KEYS},
                "persistent_dims": {str(seed): point["persistent_dims"] for seed, point in points.items()},
                "null": null_statistics(points, initial, gaussian, margin),
                "layers": layer_statistics(points)})
        complete = [point for point in checkpoints if len(point["seeds"]) == len(members)]
        final = complete[-1] if complete else None
        out.append({"arm": arm, "seeds": [seed for seed, _ in members], "runs": [label for _, label in members],
                    "checkpoints": checkpoints,
                    "verdict": None if final is None else {
                        "step": final["step"],
                        **{key: {name: final["null"][key][name] for name in ("beyond", "of", "verdict")}
                           for key in STATISTICS}}})
    return out


def summary_value(point: dict, key: str) -> float | None:
    """A checkpoint's summary: a verdict statistic's largest over layers 1..L, a geometry measure's mean (summary_of)."""
    if key in STATISTICS:
        return worst([layer_value(row, key) for row in point["layers"]])
    value = summary_of(point, key)
    return None if math.isnan(value) else value
