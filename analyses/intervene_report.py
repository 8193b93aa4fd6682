"""intervene.json, intervene.png and the printed table of `analyze.py intervene` (the runner: analyses/intervene.py).

    report = report_of(args, encoder, run, baseline, results, dims, outliers, rule, controls)
    print_intervene(report); intervention_figure(report, "MiniLM")

The JSON's shape, for scripts (docs/interventions.md): top-level `baseline` and `interventions` (name -> result); the
baseline and each result hold `stats` (`share`: {dim as a string: per-layer share of the token vectors whose max or
min is that dim, layers 0..L}, for the tracked dims (`--dims` and the unmodified model's outliers); `kurtosis`,
`max_abs`, `anisotropy`: per-layer lists) and `tasks` (`mlm_loss`, `sts`, `probe`: null when not measured); each
result also holds `effects` (metric -> after - before: a per-layer list, its mean over layers 1..L as `<metric>_mean`,
and the MLM loss's change) and, for the dimension-based interventions with controls, `controls` (metric -> `mean`,
`sd`, `p_value` of the same intervention on random non-outlier dims: metrics/controls.py). A result without dims to
act on holds only `skipped`. A causal model's tasks hold `lm_loss` (ours: its next-token loss) where an MLM's hold
`mlm_loss`; activation_zero / activation_mean say where each layer's edit acts (`acts_at`) and layernorm_zero which
norms it edits (`norms`: an RMSNorm's gain, it has no bias).
"""

from __future__ import annotations

import sys

from torch import Tensor

from analyses.reference import number
from analyses.reports import report_warnings
from analyses.session import run_header
from core.defaults import INTERVENE_PROBE, INTERVENTIONS
from core.figures import layer_bands_figure
from core.tables import table_lines
from core.wording import plural
from lightning_modules.interventions import DIMENSION_BASED, edit_sites, norm_sites
from metrics.outliers import all_outlier_dims, chance_of, persistent_dims

PROBE = INTERVENE_PROBE  # --probe's quick settings (ours; the paper trains 10 epochs): core/defaults.py
LABELS = {"outlier_share": "summed share of the dims", "kurtosis": "kurtosis (per token, mean)",
          "max_abs": "max |activation|", "anisotropy": "anisotropy", "sts": "STS Spearman x 100",
          "probe": "position probe accuracy", "mlm_loss": "MLM loss", "lm_loss": "next-token loss (ours)"}
LOSSES = ("mlm_loss", "lm_loss")
LM_LOSS = ("ours, a causal model's task effect where an MLM's is the MLM loss: the mean cross-entropy of each real "
           "token after the first given the tokens before it, through the model's LM head, on the same sentences "
           "(padding never a target; no masking), from the same pass as the statistics")
EFFECTS_NOTE = ("effects are after - before (the unmodified model): per layer 0..L, `<metric>_mean` their mean over "
                "the non-input layers 1..L; outlier_share is the summed share of `dims`; controls: the same "
                "intervention on random sets of as many non-outlier dims, the mean and sd of their effects and the "
                "p-value (1 + controls with |effect| >= |observed|) / (controls + 1)")


def listed(value: Tensor):
    """A number (0-d) or a per-layer list, nan as null."""
    return number(value) if value.dim() == 0 else [number(v) for v in value]


def stats_of(measured, tracked: list[int]) -> dict:
    share = measured.share.cpu()
    statistics = measured.statistics
    return {"share": {str(d): listed(share[:, d]) for d in tracked}, "kurtosis": listed(statistics.kurtosis_mean),
            "max_abs": listed(statistics.layer_max_abs), "anisotropy": listed(measured.anisotropy)}


def tasks_of(measured) -> dict:
    return {"mlm_loss": None if measured.mlm_loss is None else number(measured.mlm_loss),
            "lm_loss": None if measured.lm_loss is None else number(measured.lm_loss),
            "sts": None if measured.sts is None else listed(measured.sts),
            "probe": None if measured.probe is None else listed(measured.probe)}


def report_of(args, encoder, run, baseline, results: dict, dims: list[int], outliers, rule, controls) -> dict:
    tracked = sorted(set(dims) | set(all_outlier_dims(outliers)))
    entries = {}
    for name, entry in results.items():
        if "skipped" in entry:
            entries[name] = {"description": INTERVENTIONS[name], **entry}
            continue
        dimensional = name in DIMENSION_BASED
        entries[name] = {
            "description": INTERVENTIONS[name], "dims": dims if dimensional else None,
            "layers": (list(entry["layers"]) if entry["layers"] is not None else "all") if dimensional else None,
            "stats": stats_of(entry["measured"], tracked), "tasks": tasks_of(entry["measured"]),
            "effects": {key: listed(value) for key, value in entry["effects"].items()}}
        if name == "layernorm_zero":
            entries[name]["norms"] = norm_sites(encoder.model, entry["layers"])
        elif dimensional:
            sites = edit_sites(encoder.model)
            entries[name]["acts_at"] = {str(layer): sites[layer] for layer in entry["layers"] or range(len(sites))}
        if "controls" in entry:
            entries[name]["controls"] = {key: {part: listed(v) for part, v in summary.items()}
                                         for key, summary in entry["controls"].items()}
    head = encoder.masked_lm is not None
    return {
        **run_header(args, encoder),
        "num_sentences": baseline.num_sentences, "num_tokens": baseline.statistics.num_tokens,
        "num_truncated": baseline.num_truncated, "num_unknown": baseline.num_unknown, "num_pairs": baseline.num_pairs,
        "hidden_size": encoder.hidden_size, "num_layers": encoder.num_layers,
        "rule": {"min_share": rule.min_share, "sigma": rule.sigma, "description": rule.describe()},
        "persistent_dims": persistent_dims(outliers),
        **chance_of(outliers, baseline.statistics.num_tokens, encoder.hidden_size, rule),  # ours: chance_bound, _warning
        "dims": dims,
        "dims_from": "auto: the persistent outlier dims of the unmodified model on the same data (the outliers "
                     "analysis' rule)" if args.dims == "auto" else "given (--dims)",
        "tracked_dims": tracked,
        "controls": {"count": len(controls), "seed": args.seed, "dims": controls,
                     "drawn_from": "dims that are no outlier of any layer of the unmodified model and not in `dims`"},
        "mlm": {"head": head, "note": "" if head else encoder.head_note, "probability": 0.15, "seed": args.seed,
                "masking": "per sentence, round(0.15 x (length - 2)) non-special tokens, 80% <mask>, 10% random, "
                           "10% kept (datamodules/masking.py), the same masks for every variant",
                "masked_tokens": baseline.masked_tokens if head else 0},
        "lm": {"head": encoder.causal_lm is not None, "note": encoder.lm_note if encoder.causal_lm is None else "",
               "loss": LM_LOSS, "tokens": baseline.lm_tokens},
        "sts": {"data": args.sts, "num_pairs": len(run.sts_pairs), "score_range": list(args.score_range)}
        if run.sts_pairs is not None else None,
        "probe": {**PROBE, "epochs": args.probe_epochs, "probe_sentences": args.probe_sentences,
                  "sentences": sum(split["sentences"] for split in run.probe_splits["splits"].values()),
                  **run.probe_splits,
                  "settings": f"ours, quick (the paper: 10 epochs at lr 1e-3 on SST-2): --probe_sentences of --data "
                              f"split 80/10/10, Adam at lr {PROBE['lr']}, batches of {PROBE['batch_size']} token "
                              "vectors, bias-free linear probes of every layer, each tested with its best-validation "
                              "epoch's weights, no random-encoder baseline"} if args.probe else None,
        "variant_passes": len(run.passes),  # one pass over the sentences per variant measured
        "effects_note": EFFECTS_NOTE,
        "baseline": {"stats": stats_of(baseline, tracked), "tasks": tasks_of(baseline)},
        "interventions": entries,
    }


def series_of(entry: dict, key: str, dims: list[int]) -> list | None:
    """The per-layer values of `key` in a baseline or result entry (outlier_share: the summed share of `dims`)."""
    stats, tasks = entry["stats"], entry["tasks"]
    if key == "outlier_share":
        columns = [stats["share"][str(d)] for d in dims]
        return [sum(values) for values in zip(*columns)] if dims else None
    return stats.get(key, tasks.get(key))


def fmt(value, digits: int = 3) -> str:
    """A signed number (-0.000 printed as +0.000), "-" for None."""
    return "-" if value is None else f"{round(value, digits) + 0.0:+.{digits}f}" if isinstance(value, float) \
        else str(value)


def print_intervene(report: dict) -> None:
    dims = report["dims"]
    print(f"\ninterventions on {report['encoder']}, {report['data']}: {plural(report['num_sentences'], 'sentence')}, "
          f"{plural(report['num_tokens'], 'token', spec=',')} (special tokens {report['special_tokens']}; dims 0-indexed)")
    controls = report["controls"]
    drawn = f"{controls['count']} random sets of {len(dims)} non-outlier dims (seed {controls['seed']})" \
        if controls["count"] else "none"
    print(f"dims: {dims or 'none'} ({report['dims_from']}); controls: {drawn}")
    mlm, lm = report["mlm"], report["lm"]
    if lm["head"]:
        print(f"next-token loss (ours): {plural(lm['tokens'], 'token', spec=',')} predicted from the tokens before them, no masking")
    elif report["model_family"]["causal"]:
        print(f"next-token loss (ours): {lm['note']}")
    else:
        print(f"MLM loss: {'15% of the tokens masked, the same masks for every variant' if mlm['head'] else mlm['note']}")
    print("effect = after - before; per-layer metrics averaged over layers 1..L; p = (1 + controls at least as "
          "large) / (controls + 1)")
    headers = ["intervention", "metric", "before", "after", "effect", "controls mean ± sd", "p"]
    rows, skipped = [], []
    for name, entry in report["interventions"].items():
        if "skipped" in entry:
            skipped.append(f"{name} skipped: {entry['skipped']}")
            continue
        for key, label in LABELS.items():
            effect_key = key if key in LOSSES else f"{key}_mean"
            if effect_key not in entry["effects"]:
                continue
            effect = entry["effects"][effect_key]
            before = report["baseline"]["tasks"][key] if key in LOSSES else mean_of(
                series_of(report["baseline"], key, dims))
            summary = entry.get("controls", {}).get(effect_key)
            spread = f"{fmt(summary['mean'])} ± {summary['sd']:.3f}" if summary and summary["sd"] is not None \
                else fmt(summary["mean"]) if summary else "-"
            rows.append([name, label + (f" {','.join(map(str, dims))}" if key == "outlier_share" else ""),
                         fmt(before).lstrip("+"), fmt(None if before is None or effect is None else before + effect)
                         .lstrip("+"), fmt(effect), spread,
                         f"{summary['p_value']:.3f}" if summary and summary["p_value"] is not None else "-"])
            name = ""
    print("\n".join(table_lines(headers, rows)))
    for line in skipped:
        print(line)
    for name, entry in report["interventions"].items():
        rms = [norm["name"] for norm in entry.get("norms", ()) if "no bias" in norm["zeroed"]]
        if rms:
            print(f"{name}: {len(rms)} of its {len(entry['norms'])} norms have no bias (an RMSNorm, or a LayerNorm "
                  "without one): their gain alone is zeroed")
        placements = {norm.get("placement") for norm in entry.get("norms", ())}
        if report["model_family"]["norms"] == "pre-LN" and "pre" in placements:
            print(f"{name}: pre-LN norms normalise a sub-layer's input: the dims are removed from what it reads, not "
                  "from the residual stream (the final norm's: from layer L)")
        if "sublayer_output" in placements:
            print(f"{name}: norms placed sublayer_output normalise a sub-layer's output: the dims are removed from what "
                  "it adds to the residual stream")
    for warning in report_warnings(report):
        print(f"warning: {warning}", file=sys.stderr)
        if "acts_at" in entry and report["model_family"]["norms"] == "pre-LN":
            print(f"{name} acts at: " + "; ".join(f"layer {layer}: {where}" for layer, where in entry["acts_at"].items()))


def mean_of(values: list | None) -> float | None:
    """The mean over layers 1..L of a per-layer list (nulls left out)."""
    kept = [v for v in (values or [])[1:] if v is not None]
    return sum(kept) / len(kept) if kept else None


def intervention_figure(report: dict, short_name: str):
    """Per layer, before against after each intervention, and each dimension-based one's controls as a band (the
    unmodified model plus their mean effect ± sd)."""
    dims, baseline = report["dims"], report["baseline"]
    layers = list(range(report["num_layers"] + 1))
    panels = []
    for key in ("outlier_share", "anisotropy", "kurtosis", "max_abs", "sts", "probe"):
        before = series_of(baseline, key, dims)
        if before is None:
            continue
        panel = {"title": LABELS[key] + (f" {dims}" if key == "outlier_share" else ""), "ylabel": LABELS[key],
                 "layers": layers, "series": {"before (unmodified)": before}, "bands": {},
                 "log": key in ("kurtosis", "max_abs")}  # as magnitudes.png: 760 before, 3 after an outlier's zeroing
        for name, entry in report["interventions"].items():
            if "skipped" in entry:
                continue
            panel["series"][f"after {name}"] = series_of(entry, key, dims)
            summary = entry.get("controls", {}).get(key)
            if summary:
                sd = [0.0 if s is None else s for s in summary["sd"]]
                centre = [None if b is None or m is None else b + m for b, m in zip(before, summary["mean"])]
                panel["bands"][f"after {name}"] = (
                    [None if c is None else c - s for c, s in zip(centre, sd)],
                    [None if c is None else c + s for c, s in zip(centre, sd)],
                    f"{name} on {report['controls']['count']} random dim sets (mean ± sd)")
        panels.append(panel)
    key = "lm_loss" if report["lm"]["head"] else "mlm_loss"
    mlm = [f"{name} {entry['tasks'][key]:.3f}" for name, entry in report["interventions"].items()
           if "skipped" not in entry and entry["tasks"].get(key) is not None]
    loss = f"; {LABELS[key]} {baseline['tasks'][key]:.3f} before, " + ", ".join(mlm) if mlm else ""
    return layer_bands_figure(panels, title=f"interventions on {short_name}: before vs after per layer (dims "
                              f"{dims or 'none'}, 0-indexed){loss}")
