"""paper.json / paper.md / figure6.png of `analyze.py paper`: the reports laid out like the paper's tables.

    summary = paper_summary(reports, args, clip="1:63+223,...", notes=[])   # JSON: §3, Figure 6, Tables 1-3
    paper_markdown(summary)                                              # the same, as markdown with the figures
    figure6(reports, "bert")                                             # anisotropy, self-similarity per layer

Layer 0 is the embedding output; the best layers of Tables 1-3 are searched over 1..L (Table 3: by validation).
"""

from __future__ import annotations

from core.figures import layer_panels_figure

VARIANTS = ("raw", "clipped")


def fmt(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _per_layer(report: dict, *path: str) -> dict[str, list]:
    out = {}
    for key in VARIANTS:
        values = []
        for row in report["layers"]:
            value = row.get(key)
            for step in path:
                value = None if value is None else value.get(step)
            values.append(value)
        if any(v is not None for v in values):
            out[key] = values
    return out


def _classifier(report: dict) -> dict:
    """The layer of best validation accuracy (of 1..L), its test accuracy raw and clipped, and the last layer's."""
    rows = [row for row in report["layers"] if row["layer"] >= 1] or report["layers"]
    best = max(rows, key=lambda row: (row.get("val_accuracy") or -1.0, -row["layer"]))
    last = report["layers"][-1]
    return {"data": report["source"], "best_layer": best["layer"], "raw": best["accuracy"],
            "clipped": best["accuracy_clipped"], "last_layer": last["layer"], "last_raw": last["accuracy"],
            "last_clipped": last["accuracy_clipped"], "majority": report["majority_baseline"],
            "test_sentences": report["splits"]["test"]["sentences"], "splits_from": report["splits_from"]}


def paper_summary(reports: dict, args, clip: str, notes: list[str]) -> dict:
    outliers = reports["outliers"]
    probe = reports["position_probe"]
    summary = {
        "encoder": str(args.encoder), "seed": args.seed, "clip": clip,
        "clip_rule": (reports.get("anisotropy_sst2") or {}).get("clip_rule"),
        "clipped_dims": (reports.get("anisotropy_sst2") or {}).get("clipped_dims", []),
        "indexing": "0-indexed dimensions; layer 0 = embedding output",
        "data": {"sst2": args.sst2, "qqp": args.qqp, "wic": args.wic, "sts": list(args.sts or []),
                 "imdb": args.imdb, "sst5": args.sst5},
        "section3_outliers": {"layers": [{key: layer[key] for key in ("layer", "argmax_dim", "argmax_share",
                                                                        "argmin_dim", "argmin_share", "outlier_dims")}
                                         for layer in outliers["layers"]],
                              "persistent_dims": outliers["persistent_dims"], "rule": outliers["rule"]["description"]},
        "section3_position_probe": {
            "layers": [{"layer": row["layer"], "accuracy": row["accuracy"], "top_dims": row["top_contribution_dims"][:5],
                        "outlier_ranks": {d: entry["rank"] for d, entry in row["outlier_dims"].items()}}
                       for row in probe["layers"]],
            "random_encoder": [row["accuracy"] for row in probe["baselines"].get("random_encoder", {}).get("layers", [])],
            "majority": probe["baselines"]["majority"], "outlier_dims": probe["outlier_dims"]},
        "figure6": {name: {"anisotropy": _per_layer(reports[f"anisotropy_{name}"]),
                           "self_similarity": _per_layer(reports[f"self_similarity_{name}"], "self_similarity")}
                    for name in ("sst2", "qqp") if f"anisotropy_{name}" in reports},
        "table1_wic": None, "table2_sts": [], "table3_classifiers": {}, "notes": notes,
    }
    wic = reports.get("wic")
    if wic is not None:
        summary["table1_wic"] = {"raw": wic["best"], "clipped": wic.get("best_clipped"), "baseline": wic["baseline"],
                                 "num_pairs": wic["num_scored"]}
    for name, report in reports.items():
        if name.startswith("sts_"):
            summary["table2_sts"].append({"dataset": name.removeprefix("sts_"), "num_pairs": report["num_pairs"],
                                          "raw": report["best"], "clipped": report.get("best_clipped")})
        if name.startswith("classifier_"):
            summary["table3_classifiers"][name.removeprefix("classifier_")] = _classifier(report)
    return summary


def paper_markdown(summary: dict) -> str:
    lines = [f"# Positional artefacts: {summary['encoder']}", "",
             f"Dimensions are 0-indexed; layer 0 is the embedding output. Clipping: `{summary['clip']}` "
             f"(dims {summary['clipped_dims'] or 'none'}; rule: {summary['clip_rule']}). "
             "Data: " + "; ".join(f"{k}: {v}" for k, v in summary["data"].items()) + ".", ""]
    section = summary["section3_outliers"]
    lines += ["## §3 Outlier neurons", "", "![Figure 1: average vector per layer](outliers/mean_vectors.png)",
              "![Figures 3-4: position-embedding rows](outliers/position_embeddings.png)", "",
              f"Rule: {section['rule']}. Persistent (at least half of layers 1..L): "
              f"{section['persistent_dims'] or 'none'}.", "",
              "| layer | argmax dim (share) | argmin dim (share) | outlier dims |", "| --- | --- | --- | --- |"]
    lines += [f"| {row['layer']} | {row['argmax_dim']} ({row['argmax_share']:.1%}) | {row['argmin_dim']} "
              f"({row['argmin_share']:.1%}) | {', '.join(map(str, row['outlier_dims'])) or '-'} |"
              for row in section["layers"]]
    probe = summary["section3_position_probe"]
    random = probe["random_encoder"] or [None] * len(probe["layers"])
    lines += ["", "## §3 Position probe (Figure 5)", "", "![accuracy per layer](position_probe/accuracy_by_layer.png)",
              "![Figure 5b/5c: outlier neurons vs the mean contribution](position_probe/outlier_contributions.png)", "",
              f"Majority baseline {fmt(probe['majority'])}; outlier dims {probe['outlier_dims'] or 'none'} "
              "(their contribution rank per layer, 1 = largest).", "",
              "| layer | accuracy | random-init encoder | top contributing dims | outlier ranks |",
              "| --- | --- | --- | --- | --- |"]
    lines += [f"| {row['layer']} | {fmt(row['accuracy'])} | {fmt(r)} | {', '.join(map(str, row['top_dims']))} | "
              f"{', '.join(f'{d}: {rank}' for d, rank in row['outlier_ranks'].items()) or '-'} |"
              for row, r in zip(probe["layers"], random)]
    lines += ["", "## §4.1 Anisotropy and self-similarity (Figure 6)", "", "![Figure 6](figure6.png)", ""]
    figure = summary["figure6"]
    columns = [(name, measure, key) for name, data in figure.items() for measure in ("anisotropy", "self_similarity")
               for key in data[measure]]
    if columns:
        lines += ["| layer | " + " | ".join(f"{name} {measure.replace('_', '-')} {key}" for name, measure, key in columns)
                  + " |", "| --- |" + " --- |" * len(columns)]
        for layer in range(len(next(iter(figure.values()))["anisotropy"]["raw"])):
            lines.append(f"| {layer} | " + " | ".join(fmt(figure[name][measure][key][layer])
                                                      for name, measure, key in columns) + " |")
    lines += ["", "## Table 1: WiC (best accuracy over layers 1..L and thresholds)", ""]
    wic = summary["table1_wic"]
    if wic is None:
        lines.append("(skipped)")
    else:
        lines += ["| | accuracy | layer | threshold |", "| --- | --- | --- | --- |"]
        lines += [f"| {key} | {fmt(wic[key]['accuracy'])} | {wic[key]['layer']} | {wic[key]['threshold']} |"
                  for key in VARIANTS if wic.get(key)]
        lines.append(f"| all-true baseline | {fmt(wic['baseline'])} | | |")
    lines += ["", "## Table 2: STS (Spearman x 100 of mean-pooled embeddings, best layer of 1..L)", ""]
    if not summary["table2_sts"]:
        lines.append("(skipped)")
    else:
        lines += ["| dataset | pairs | raw | clipped |", "| --- | --- | --- | --- |"]
        lines += [f"| {row['dataset']} | {row['num_pairs']} | " + " | ".join(
            f"{fmt(row[key]['spearman'], 2)} (layer {row[key]['layer']})" if row.get(key) else "-" for key in VARIANTS)
            + " |" for row in summary["table2_sts"]]
    lines += ["", "## Table 3: frozen-encoder classifiers (test accuracy, bias-free linear maps, §4.4)", "",
              "| task | best layer (validation) | raw | clipped | last layer | raw | clipped | majority |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {name} | {row['best_layer']} | {fmt(row['raw'])} | {fmt(row['clipped'])} | {row['last_layer']} | "
              f"{fmt(row['last_raw'])} | {fmt(row['last_clipped'])} | {fmt(row['majority'])} |"
              for name, row in summary["table3_classifiers"].items()] or ["| (skipped) | | | | | | | |"]
    lines += [""] + [f"Note: {note}" for note in summary["notes"]]
    return "\n".join(lines).rstrip() + "\n"


def figure6(reports: dict, model: str):
    """Anisotropy and self-similarity per layer, raw and clipped, on SST-2 (and QQP): the paper's Figure 6."""
    panels = []
    for name in ("sst2", "qqp"):
        for measure, path in (("anisotropy", ()), ("self_similarity", ("self_similarity",))):
            report = reports.get(f"{measure}_{name}")
            if report is not None:
                panels.append({"title": f"{measure.replace('_', '-')} ({name})", "ylabel": "mean cosine",
                               "layers": [row["layer"] for row in report["layers"]],
                               "series": _per_layer(report, *path)})
    return layer_panels_figure(panels, title=f"{model}: before and after clipping (Figure 6)", columns=2)
