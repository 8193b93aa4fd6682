"""paper.json / paper.md / figure6.png of `analyze.py paper`: the reports laid out like the paper's tables.

    summary = paper_summary(reports, args, clip="1:63+223,...", notes=[])   # JSON: §3, Figure 6, Tables 1-3
    paper_markdown(summary)                                              # the same, as markdown with the figures
    figure6(reports, "bert")                                             # anisotropy, self-similarity per layer

Layer 0 is the embedding output; the best layers of Tables 1-3 are searched over 1..L (Table 3: by validation).
"""

from __future__ import annotations

from core.figures import layer_panels_figure
from core.wording import plural
from metrics.ranks import ranked

VARIANTS = ("raw", "clipped")
NAMES = {"sst2": "SST-2", "qqp": "QQP"}


def fmt(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def probe_row(row: dict) -> dict:
    """A layer of position_probe.json as paper.json holds it: accuracies, the top 5 contributing dims and the outlier
    dims' ranks, each with its ties (metrics.contributions.rank_dims)."""
    return {"layer": row["layer"], "accuracy": row["accuracy"], "control_accuracy": row.get("control_accuracy"),
            "selectivity": row.get("selectivity"), "top_dims": row["top_contribution_dims"][:5],
            "top_ties": row["top_contribution_ties"][:5],
            "outlier_ranks": {d: entry["rank"] for d, entry in row["outlier_dims"].items()},
            "outlier_ties": {d: entry["ties"] for d, entry in row["outlier_dims"].items()}}


def top_dims_cell(row: dict) -> str:
    """The top contributing dims of a probe row, each tied one with its ties ('12 (tied with 3)')."""
    ties = row["top_ties"]
    return ", ".join(f"{d} (tied with {t})" if t else str(d) for d, t in zip(row["top_dims"], ties))


def outlier_ranks_cell(row: dict) -> str:
    """Each outlier dim's contribution rank with its ties ('557: rank 1, tied with 2 other dims; 12: rank 3'), or '-'."""
    ties = row["outlier_ties"]
    return "; ".join(f"{d}: {ranked(rank, ties[d])}" for d, rank in row["outlier_ranks"].items()) or "-"


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
            "clipped": best["accuracy_clipped"], "control": best.get("control_accuracy"),
            "selectivity": best.get("selectivity"), "last_layer": last["layer"], "last_raw": last["accuracy"],
            "last_clipped": last["accuracy_clipped"], "majority": report["majority_baseline"],
            "test_sentences": report["splits"]["test"]["sentences"], "splits_from": report["splits_from"]}


def _figure6(reports: dict, name: str) -> dict:
    """Figure 6 of one data set: anisotropy and the adjusted self-similarity (self-similarity minus the anisotropy
    of the same layer and variant), the unadjusted value beside them, and how the words were drawn."""
    selfsim = reports[f"self_similarity_{name}"]
    return {"anisotropy": _per_layer(reports[f"anisotropy_{name}"]),
            "self_similarity_adjusted": _per_layer(selfsim, "adjusted"),
            "self_similarity": _per_layer(selfsim, "self_similarity"), "adjusted_by": selfsim["adjusted_by"],
            "words": {key: selfsim[key] for key in ("num_words", "num_candidates", "contexts_per_word",
                                                    "pool_sentences", "num_sentences", "word_case")}}


def paper_summary(reports: dict, args, clip: str, notes: list[str]) -> dict:
    outliers = reports["outliers"]
    probe = reports.get("position_probe")
    summary = {
        "encoder": str(args.encoder), "encoder_commit": outliers["encoder_commit"],  # the hub commit it was read at
        "seed": args.seed, "clip": clip,
        "clip_rule": next((r.get("clip_rule") for n, r in reports.items() if n.startswith("anisotropy_")), None),
        "clipped_dims": next((r["clipped_dims"] for n, r in reports.items() if n.startswith("anisotropy_")), []),
        "indexing": "0-indexed dimensions; layer 0 = embedding output",
        "data": {"sst2": args.sst2, "qqp": args.qqp, "wic": args.wic, "sts": list(args.sts or []),
                 "imdb": args.imdb, "sst5": args.sst5},
        "section3_outliers": {"layers": [{key: layer[key] for key in ("layer", "argmax_dim", "argmax_share",
                                                                        "argmin_dim", "argmin_share", "outlier_dims")}
                                         for layer in outliers["layers"]],
                              "persistent_dims": outliers["persistent_dims"], "rule": outliers["rule"]["description"],
                              "persistence": outliers["rule"]["persistence"],  # Figures 3-4 only with a table to draw
                              "position_figure": outliers["origins"]["position_embeddings"] is not None,
                              "position_embeddings_note": outliers["origins"]["position_embeddings_note"]},
        "section3_position_probe": None if probe is None else {
            "layers": [probe_row(row) for row in probe["layers"]],
            "random_encoder": [row["accuracy"] for row in probe["baselines"].get("random_encoder", {}).get("layers", [])],
            "majority": probe["baselines"]["majority"], "outlier_dims": probe["outlier_dims"]},
        "section3_sentences": outliers["sentences_from"], "section3_sentences_asked": outliers["sentences_asked"],
        "figure6": {name: _figure6(reports, name) for name in ("sst2", "qqp") if f"anisotropy_{name}" in reports},
        "table1_wic": None, "table2_sts": [], "table3_classifiers": {}, "notes": notes,
    }
    wic = reports.get("wic")
    if wic is not None:
        summary["table1_wic"] = {"raw": wic["best"], "clipped": wic.get("best_clipped"), "baseline": wic["baseline"],
                                 "data": wic["data"], "split": wic["split"],
                                 "num_pairs": wic["num_pairs"] + wic["skipped"]["count"],
                                 "num_scored": wic["num_scored"], "skipped": wic["skipped"]["count"]}
    for name, report in reports.items():
        if name.startswith("sts_"):
            summary["table2_sts"].append({"dataset": name.removeprefix("sts_"), "num_pairs": report["num_pairs"],
                                          "raw": report["best"], "clipped": report.get("best_clipped")})
        if name.startswith("classifier_"):
            summary["table3_classifiers"][name.removeprefix("classifier_")] = _classifier(report)
    return summary


def sample_line(used: dict[str, int], asked: int) -> str:
    """Where §3's sentences came from: "N sentences of SST-2 and M of QQP (of A asked of each; QQP has only M: used
    whole)"."""
    found = " and ".join(f"{plural(count, 'sentence')} of {NAMES[name]}" for name, count in used.items())
    short = [f"{NAMES[name]} has only {count}" for name, count in used.items() if count < asked]
    return f"{found} ({asked} asked of each{'; ' + ', '.join(short) + ': used whole' if short else ''})"


def paper_markdown(summary: dict) -> str:
    found = sample_line(summary["section3_sentences"], summary["section3_sentences_asked"])
    commit = f" (commit `{summary['encoder_commit']}`)" if summary.get("encoder_commit") else ""  # none: a path
    lines = [f"# Positional artefacts: {summary['encoder']}{commit}", "",
             f"Dimensions are 0-indexed; layer 0 is the embedding output. Outliers (§3) detected on {found} "
             f"(training sets). Clipping (§4): `{summary['clip']}` (dims {summary['clipped_dims'] or 'none'}; rule: "
             f"{summary['clip_rule']}). Data: " + "; ".join(f"{k}: {v}" for k, v in summary["data"].items()) + ".", ""]
    section = summary["section3_outliers"]
    rows = ("![Figures 3-4: position-embedding rows](outliers/position_embeddings.png)"
            if section.get("position_figure", True) else
            f"(no Figures 3-4: {section.get('position_embeddings_note') or 'no position-embedding table'})")
    lines += ["## §3 Outlier neurons", "", "![Figure 1: average vector per layer](outliers/mean_vectors.png)", rows, "",
              f"Rule: {section['rule']}. Dims {section['persistence']}: {section['persistent_dims'] or 'none'}.", "",
              "| layer | argmax dim (share) | argmin dim (share) | outlier dims |", "| --- | --- | --- | --- |"]
    lines += [f"| {row['layer']} | {row['argmax_dim']} ({row['argmax_share']:.1%}) | {row['argmin_dim']} "
              f"({row['argmin_share']:.1%}) | {', '.join(map(str, row['outlier_dims'])) or '-'} |"
              for row in section["layers"]]
    probe = summary["section3_position_probe"]
    lines += ["", "## §3 Position probe (Figure 5)", ""]
    if probe is None:
        lines.append("(skipped: --sst2 none)")
    else:
        random = probe["random_encoder"] or [None] * len(probe["layers"])
        lines += ["![accuracy per layer](position_probe/accuracy_by_layer.png)",
                  "![Figure 5b/5c: outlier neurons vs the mean contribution](position_probe/outlier_contributions.png)",
                  "", f"Majority baseline {fmt(probe['majority'])}; outlier dims {probe['outlier_dims'] or 'none'} "
                  "(their contribution rank per layer, 1 = largest, with the dims of exactly the same contribution; a "
                  "top dim with ties is the lowest-indexed of them). Control task (Hewitt & Liang 2019; ours, the paper "
                  "has none): the same probe on a random position per token type; selectivity = accuracy - control "
                  "accuracy.", "",
                  "| layer | accuracy | random-init encoder | control task | selectivity | top contributing dims | "
                  "outlier ranks |", "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {row['layer']} | {fmt(row['accuracy'])} | {fmt(r)} | {fmt(row.get('control_accuracy'))} | "
                  f"{fmt(row.get('selectivity'))} | {top_dims_cell(row)} | {outlier_ranks_cell(row)} |"
                  for row, r in zip(probe["layers"], random)]
    lines += ["", "## §4.1 Anisotropy and self-similarity (Figure 6)", "", "![Figure 6](figure6.png)", ""]
    figure = summary["figure6"]
    for name, data in figure.items():
        words = data["words"]
        lines.append(f"{NAMES[name]}: {plural(words['num_words'], 'word')} of the {words['num_candidates']} that occur "
                     f"in at least {words['contexts_per_word']} of its {plural(words['pool_sentences'], 'sentence')}, "
                     f"{plural(words['contexts_per_word'], 'context')} each "
                     f"({plural(words['num_sentences'], 'sentence')} encoded; words {words['word_case']}).")
    labels = {"anisotropy": "anisotropy", "self_similarity_adjusted": "adjusted self-sim"}
    columns = [(name, measure, key) for name, data in figure.items() for measure in labels for key in data[measure]]
    if columns:
        lines += ["", "Adjusted self-similarity: self-similarity minus the anisotropy of the same layer (the paper "
                  "subtracts the anisotropy, after Ethayarajh 2019); each variant by its own (raw with raw, clipped "
                  "with clipped) is ours, as the paper names no variant; the unadjusted values are in paper.json "
                  "(`figure6.<set>.self_similarity`).", ""]
        lines += ["| layer | " + " | ".join(f"{name} {labels[measure]} {key}" for name, measure, key in columns)
                  + " |", "| --- |" + " --- |" * len(columns)]
        for layer in range(len(next(iter(figure.values()))["anisotropy"]["raw"])):
            lines.append(f"| {layer} | " + " | ".join(fmt(figure[name][measure][key][layer])
                                                      for name, measure, key in columns) + " |")
    lines += ["", "## Table 1: WiC (best accuracy over layers 1..L and thresholds)", ""]
    wic = summary["table1_wic"]
    if wic is None:
        lines.append("(skipped)")
    else:
        split = f"its {wic['split']!r} split" if wic["split"] else "the whole file"
        lines += [f"{wic['data']}, {split}: {plural(wic['num_pairs'], 'pair')}, {wic['num_scored']} scored "
                  f"({wic['skipped']} skipped: target not at its offsets).", "", "| | accuracy | layer | threshold |",
                  "| --- | --- | --- | --- |"]
        lines += [f"| {key} | {fmt(wic[key]['accuracy'])} | {wic[key]['layer']} | {wic[key]['threshold']} |"
                  for key in VARIANTS if wic.get(key)]
        lines.append(f"| all-true baseline | {fmt(wic['baseline'])} | | |")
    lines += ["", "## Table 2: STS (Spearman x 100 of mean-pooled embeddings, best layer of 1..L)", ""]
    if not summary["table2_sts"]:
        lines.append("(skipped)")
    else:
        lines += ["| dataset | pairs | raw | clipped |", "| --- | --- | --- | --- |"]
        lines += [f"| {row['dataset']} | {row['num_pairs']} | " + " | ".join(
            f"{fmt(row[key]['spearman'], 2)} (layer {row[key]['layer']})"
            if (row.get(key) or {}).get("layer") is not None else "-" for key in VARIANTS)
            + " |" for row in summary["table2_sts"]]
    lines += ["", "## Table 3: frozen-encoder classifiers (test accuracy, bias-free linear maps, §4.4)", "",
              "Control task (Hewitt & Liang 2019; ours, the paper has none): the same classifier on a random class per "
              "sentence; selectivity = raw accuracy - control accuracy, at the best layer.", "",
              "| task | best layer (validation) | raw | clipped | control task | selectivity | last layer | raw | clipped "
              "| majority |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {name} | {row['best_layer']} | {fmt(row['raw'])} | {fmt(row['clipped'])} | {fmt(row.get('control'))} "
              f"| {fmt(row.get('selectivity'))} | {row['last_layer']} | {fmt(row['last_raw'])} | "
              f"{fmt(row['last_clipped'])} | {fmt(row['majority'])} |"
              for name, row in summary["table3_classifiers"].items()] or ["| (skipped) | | | | | | | | | |"]
    lines += [""] + [f"Note: {note}" for note in summary["notes"]]
    return "\n".join(lines).rstrip() + "\n"


def figure6(reports: dict, model: str):
    """Anisotropy (left) and the adjusted self-similarity (right: self-similarity minus the anisotropy of the same
    layer and variant) per layer, raw and clipped, on SST-2 (and QQP): the paper's Figure 6."""
    panels = []
    for name in ("sst2", "qqp"):
        for measure, path, title in (("anisotropy", (), "anisotropy"),
                                     ("self_similarity", ("adjusted",), "self-similarity - anisotropy")):
            report = reports.get(f"{measure}_{name}")
            if report is not None:
                panels.append({"title": f"{title} ({name})", "ylabel": "mean cosine",
                               "layers": [row["layer"] for row in report["layers"]],
                               "series": _per_layer(report, *path)})
    return layer_panels_figure(panels, title=f"{model}: before and after clipping (Figure 6)", columns=2)
