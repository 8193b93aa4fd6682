"""Terminal tables, figures and the summary (markdown + JSON) of analyze.py's evaluation reports.

    print_report("anisotropy", report)                  # per-layer table on the terminal
    figures = figures_of("isotropy", report, "MiniLM")  # isotropy.png, spectrum.png, sequence_spectrum.png
    summary = summarise(reports, notes)                 # the paper's Tables 1-2 and Figure 6 as JSON
    summary_markdown(summary); summary_figure(summary, "MiniLM")

A report's per-layer rows hold one entry per variant ("raw", "clipped", "whitened", "standardized", "softdecay").
"""

from __future__ import annotations

import sys

from core.figures import layer_panels_figure, spectrum_figure
from core.tables import table_lines
from core.wording import plural

VARIANT_LABELS = ("raw", "clipped", "whitened", "standardized", "softdecay")


def figures_of(name: str, report: dict, model: str) -> dict:
    """{file name: figure maker} of one report (isotropy has three: the scores, the corpus-wide spectra and the
    per-sequence spectra)."""
    figures = {f"{name}.png": lambda: figure_of(name, report, model)}
    if name == "isotropy":
        figures["spectrum.png"] = lambda: figure_of("spectrum", report, model)
        figures["sequence_spectrum.png"] = lambda: figure_of("sequence_spectrum", report, model)
    return figures


def series(rows: list[dict], *path: str) -> dict[str, list]:
    """{variant: [value per layer]} from report rows, following `path` inside each variant's entry."""
    keys = [k for k in VARIANT_LABELS if k in rows[0]] if rows else []
    out = {}
    for key in keys:
        values = []
        for row in rows:
            value = row[key]
            for step in path:
                value = None if value is None else value.get(step)
            values.append(value)
        out[key] = values
    return out


def panel(report: dict, title: str, ylabel: str, *path: str, baselines: dict | None = None, empty: str = "") -> dict:
    """One panel of a per-layer figure; `empty` says why, when no layer has a value."""
    rows = report["layers"]
    return {"title": title, "ylabel": ylabel, "layers": [row["layer"] for row in rows],
            "series": series(rows, *path), "baselines": baselines, "empty": empty}


def panels_of(name: str, report: dict) -> list[dict]:
    if name == "anisotropy":
        return [panel(report, "anisotropy: mean cosine of random token pairs", "cosine")]
    if name == "isotropy":
        return [panel(report, "IsoScore (all tokens)", "IsoScore", "isoscore"),
                panel(report, f"IsoScore* (mini-batches of {report['minibatch_tokens']}, zeta {report['zeta']})",
                      "IsoScore*", "isoscore_star",
                      empty=f"{plural(report['num_minibatches'], 'mini-batch', 'mini-batches')} of "
                            f"{plural(report['minibatch_tokens'], 'token')} (one token per sentence: "
                            f"{plural(report['num_sentences'], 'sentence')} here, at least "
                            f"{report['minibatch_tokens']} needed)"),
                panel(report, "token uniformity per sentence: mean sigma_1^2 / sum sigma^2 (tokenUni)", "share",
                      "sequence_energy_top1")]
    if name == "self_similarity":
        return [panel(report, "self-similarity", "mean cosine", "self_similarity"),
                panel(report, "self-similarity - anisotropy", "adjusted", "adjusted"),
                panel(report, "intra-sentence similarity (Ethayarajh): cosine of a sentence's tokens with their mean",
                      "mean cosine", "intra_sentence"),
                panel(report, "intra-sentence similarity - anisotropy", "adjusted", "intra_sentence_adjusted")]
    if name == "wic":
        return [panel(report, "WiC: best accuracy per layer", "accuracy", "accuracy",
                      baselines={"all true": report["baseline"]})]
    static = (report.get("static_baseline") or {}).get("spearman")
    return [panel(report, f"STS ({report['data']}): Spearman x 100", "Spearman x 100",
                  baselines={"static vectors": static} if static is not None else None)]


def figure_of(name: str, report: dict, model: str):
    if name == "spectrum":
        return spectrum_figure(report["corpus_spectra"], title=f"singular values of the corpus-wide token matrix per "
                               f"layer: {model}")
    if name == "sequence_spectrum":
        return spectrum_figure(report["sequence_spectra"], title=f"singular values of each sentence's token matrix, "
                               f"normalised and averaged per rank (tokenUni): {model}")
    return layer_panels_figure(panels_of(name, report), title=f"{name.replace('_', ' ')}: {model} "
                               f"(clipped dims {report.get('clipped_dims') or 'none'})")


def fmt(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_report(name: str, report: dict) -> None:
    rows = report["layers"]
    columns = {"anisotropy": [("", ())],
               "isotropy": [("IsoScore", ("isoscore",)), ("IsoScore*", ("isoscore_star",)),
                            ("top-1 energy", ("corpus_energy_top1",)),
                            ("seq top-1", ("sequence_energy_top1",))],
               "self_similarity": [("self-sim", ("self_similarity",)), ("adjusted", ("adjusted",)),
                                   ("intra-sent", ("intra_sentence",)), ("intra adj", ("intra_sentence_adjusted",))],
               "wic": [("accuracy", ("accuracy",))],
               "sts": [("Spearman", ())]}["sts" if name.startswith("sts") else name]
    headers, cells = ["layer"], [[str(row["layer"])] for row in rows]
    for label, path in columns:
        for key, values in series(rows, *path).items():
            headers.append(f"{label} {key}".strip())
            digits = 2 if name.startswith("sts") else 3
            for cell, value in zip(cells, values):
                cell.append(fmt(value, digits))
    print(f"\n{name.replace('_', ' ')} of {report['encoder']} on {report['data']} (clipped dims: "
          f"{report.get('clipped_dims') or 'none'}; {report['clip']} clipping; normalize {report['normalize']})")
    print("\n".join(table_lines(headers, cells, align=">")))
    for key in ("best", *(f"best_{key}" for key in VARIANT_LABELS[1:])):
        if key in report:
            print(f"{key}: {report[key]}")
    if name == "wic":
        split = f"its {report['split']!r} split" if report.get("split") else "the whole file"
        print(f"{report['data']}, {split}: {plural(report['num_pairs'] + report['skipped']['count'], 'pair')}, "
              f"{report['num_scored']} scored; all-true baseline: {report['baseline']}; skipped "
              f"{plural(report['skipped']['count'], 'item')} whose target is not at its offsets")
    if report.get("static_baseline"):
        print(f"static vectors: Spearman x 100 = {report['static_baseline']['spearman']}")
    for warning in report_warnings(report):
        print(f"warning: {warning}", file=sys.stderr)


def report_warnings(report: dict) -> list[str]:
    """What a report could not compute, or computed with less than asked, each in one line: its `*_warning` keys
    (normalize_warning, isoscore_star_warning, adjusted_warning, ...)."""
    return [value for key, value in report.items() if key.endswith("_warning") and value]


def summarise(reports: dict, notes: list[str]) -> dict:
    """summary.json: the paper's Tables 1-2 (WiC, STS) and Figure 6 (per layer, before / after clipping)."""
    outliers, anisotropy = reports["outliers"], reports["anisotropy"]
    keys = anisotropy["variants"]
    summary = {key: anisotropy[key] for key in ("encoder", "encoder_commit", "data", "clip", "clipped_dims", "normalize",
                                                  "variants")}
    if "softdecay_alpha" in anisotropy:
        summary["softdecay_alpha"] = anisotropy["softdecay_alpha"]
    summary["normalize_fit"] = {name: report.get("normalize_fit") for name, report in reports.items()
                                if name != "outliers"}  # tokens, or sentences (STS)
    summary["persistent_dims"] = outliers["persistent_dims"]
    summary["outlier_dims_per_layer"] = {layer["layer"]: layer["outlier_dims"] for layer in outliers["layers"]}
    wic = reports.get("wic")
    summary["table1_wic"] = None if wic is None else {
        **{key: wic["best" if key == "raw" else f"best_{key}"] for key in keys}, "baseline": wic["baseline"],
        "num_pairs": wic["num_scored"], "skipped": wic["skipped"]["count"], "data": wic["data"], "split": wic["split"]}
    summary["table2_sts"] = [
        {"dataset": report["data"], "num_pairs": report["num_pairs"],
         **{key: report["best" if key == "raw" else f"best_{key}"] for key in keys},
         "static_baseline": (report.get("static_baseline") or {}).get("spearman")}
        for name, report in reports.items() if name.startswith("sts_")]
    figure = []
    for layer in range(len(anisotropy["layers"])):
        row = {"layer": layer, "anisotropy": {k: anisotropy["layers"][layer][k] for k in keys}}
        selfsim = reports["self_similarity"]["layers"][layer]
        row["self_similarity"] = {k: selfsim[k]["self_similarity"] for k in keys}
        row["self_similarity_adjusted"] = {k: selfsim[k]["adjusted"] for k in keys}
        row["isoscore"] = {k: reports["isotropy"]["layers"][layer][k]["isoscore"] for k in keys}
        if wic is not None:
            row["wic_accuracy"] = {k: wic["layers"][layer][k]["accuracy"] for k in keys}
        for name, report in reports.items():
            if name.startswith("sts_"):
                row[f"{name}_spearman"] = {k: report["layers"][layer][k] for k in keys}
        figure.append(row)
    summary["figure6_layers"] = figure
    summary["notes"] = notes + [f"{name}: {warning}" for name, report in reports.items()
                                for warning in report_warnings(report)]
    return summary


def summary_markdown(summary: dict) -> str:
    keys = summary["variants"]
    lines = [f"# Clipping and evaluations: {summary['encoder']}", "",
             f"Sentences: {summary['data']}. Clipping: {summary['clip']}, dims {summary['clipped_dims'] or 'none'} "
             f"(0-indexed; persistent outlier dims {summary['persistent_dims'] or 'none'}). "
             f"Normalisation: {normalisation_line(summary)}. Layer 0 is the embedding output.", ""]
    lines += ["## Table 1: WiC (best accuracy over layers and thresholds 0.1-0.9)", ""]
    wic = summary["table1_wic"]
    if wic is None:
        lines += ["(skipped: no --wic file)", ""]
    else:
        lines += ["| variant | accuracy | layer | threshold |", "| --- | --- | --- | --- |"]
        lines += [f"| {key} | {fmt(wic[key]['accuracy'])} | {wic[key]['layer']} | {wic[key]['threshold']} |"
                  for key in keys]
        lines += [f"| all-true baseline | {fmt(wic['baseline'])} | | |", "",
                  f"{wic['data']}, " + (f"its {wic['split']!r} split" if wic["split"] else "the whole file")
                  + f": {plural(wic['num_pairs'], 'pair')} scored; {wic['skipped']} skipped (target not at its offsets).", ""]
    lines += ["## Table 2: STS (Spearman x 100 of mean-pooled embeddings, best layer)", ""]
    if not summary["table2_sts"]:
        lines += ["(skipped: no --sts data)", ""]
    else:
        lines += ["| dataset | pairs | " + " | ".join(keys) + " | static vectors |",
                  "| --- | --- | " + " | ".join("---" for _ in keys) + " | --- |"]
        for row in summary["table2_sts"]:
            cells = [f"{fmt(row[k]['spearman'], 2)} (layer {row[k]['layer']})" if row[k]["layer"] is not None else "-"
                     for k in keys]
            lines.append(f"| {row['dataset']} | {row['num_pairs']} | " + " | ".join(cells) +
                         f" | {fmt(row['static_baseline'], 2)} |")
        lines.append("")
    lines += ["## Figure 6: per layer, before / after clipping", "", "![per-layer curves](summary.png)", ""]
    measures = [m for m in summary["figure6_layers"][0] if m != "layer"]
    lines.append("| layer | " + " | ".join(f"{m} {k}" for m in measures for k in keys) + " |")
    lines.append("| --- | " + " | ".join("---" for _ in measures for _ in keys) + " |")
    for row in summary["figure6_layers"]:
        lines.append(f"| {row['layer']} | " + " | ".join(fmt(row[m][k], 2 if m.startswith("sts") else 3)
                                                          for m in measures for k in keys) + " |")
    lines += [""] + [f"Note: {note}" for note in summary["notes"]]
    return "\n".join(lines).rstrip() + "\n"


def normalisation_line(summary: dict) -> str:
    """"none", or the normalisation and what each report estimated it from."""
    fits = {fit: [name for name, f in summary.get("normalize_fit", {}).items() if f == fit]
            for fit in ("tokens", "sentences")}
    if summary["normalize"] == "none":
        return "none"
    if summary["normalize"] == "softdecay":
        return (f"softdecay (tokenUni's SoftDecay, alpha {summary.get('softdecay_alpha')}, of each sentence's token "
                "matrix at every layer, post hoc: ours; nothing fit)")
    where = "; ".join(f"{', '.join(names)} fit on {'token vectors' if fit == 'tokens' else 'mean-pooled sentences'}"
                      for fit, names in fits.items() if names)
    return f"{summary['normalize']} ({where})"


def summary_figure(summary: dict, model: str):
    rows = summary["figure6_layers"]
    layers = [row["layer"] for row in rows]
    titles = {"anisotropy": "anisotropy (random token pairs)", "self_similarity": "self-similarity",
              "self_similarity_adjusted": "self-similarity - anisotropy", "isoscore": "IsoScore",
              "wic_accuracy": "WiC accuracy"}
    for measure in rows[0]:  # STS sets: sts_<set>_spearman
        if measure.startswith("sts_") and measure.endswith("_spearman"):
            titles[measure] = f"STS ({measure[4:-9]}): Spearman x 100"
    ylabels = {"anisotropy": "mean cosine", "self_similarity": "mean cosine", "self_similarity_adjusted": "mean cosine",
               "isoscore": "IsoScore", "wic_accuracy": "accuracy"}  # STS: Spearman x 100
    panels = [{"title": titles.get(measure, measure.replace("_", " ")),
               "ylabel": ylabels.get(measure, "Spearman x 100" if measure.startswith("sts_") else ""), "layers": layers,
               "series": {key: [row[measure][key] for row in rows] for key in summary["variants"]}}
              for measure in rows[0] if measure != "layer"]
    return layer_panels_figure(panels, title=f"{model}: per layer, clipped dims "
                               f"{summary['clipped_dims'] or 'none'}", columns=3)
