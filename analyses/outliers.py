"""The outlier analysis (the paper's §3, with our numbers for its rule): per-layer outlier dimensions, persistent ones, and their origins.

    python analyze.py outliers --encoder bert-base-uncased --data core/corpus/austen.txt --output_dir runs/bert
    python analyze.py outliers --token_frequency     # also: token frequency vs outlier magnitude (ours; Puccetti)
    python analyze.py outliers --massive_rule sun --magnitude_rule int8 --sink_epsilon 0.3   # analyses/magnitudes.py
    report = outliers_report(args, encoder, collect_statistics(encoder, sentences, args))   # outliers.json

The statistics come from one streamed pass (analyses.reference.reference_pass: NeuronStatistics), the rule from
metrics/outliers.py, the origins from metrics/origins.py, the per-layer magnitudes (kurtosis, max |activation|,
top-1 share; Bondarenko et al.'s per-sequence kurtosis and inf-norm) from NeuronStatistics, massive activations,
attention sinks and the magnitude criterion from analyses/magnitudes.py (the same pass; the sinks in one more, with
eager attention), and the opt-in token-frequency correlation from metrics/frequency.py.
"""

from __future__ import annotations

import sys

from analyses.magnitudes import Magnitudes
from analyses.reference import Reference, number, reference_pass
from analyses.session import finish, prepare, read_sentences, run_header, setting_of, warn_text_counts
from core.errors import UserError
from core.figures import layer_panels_figure, mean_vectors_figure, position_rows_figure
from core.models import position_rows
from core.tables import shown_token
from core.tokenizers import readable_token
from core.wording import plural
from lightning_modules.encoder import FrozenEncoder
from metrics.frequency import TokenDimensionMagnitude, frequency_correlation
from metrics.neuron_stats import NeuronStatisticsResult
from metrics.origins import summarise_origins, trace_origins
from metrics.outliers import (
    MORE_SENTENCES,
    OutlierRule,
    all_outlier_dims,
    chance_of,
    detect_outliers,
    persistent_dims,
)


def collect_statistics(encoder: FrozenEncoder, sentences: list[str], args, magnitudes: Magnitudes | None = None
                       ) -> Reference:
    """Stream this rank's sentences through the encoder into NeuronStatistics (and `magnitudes`): the reference pass
    (its statistics; the sentences, truncated ones, special tokens written in the text and unknown tokens counted)."""
    setting = setting_of(args, encoder)
    reference = reference_pass(setting, sentences, statistics=True, desc="outlier statistics", magnitudes=magnitudes)
    if magnitudes is not None:
        magnitudes.attention_pass(setting, sentences)
    return reference


def outliers_report(args, encoder: FrozenEncoder, reference: Reference, magnitudes: Magnitudes | None = None,
                    more: str = MORE_SENTENCES) -> dict:
    """outliers.json of a reference pass with statistics; with `magnitudes`, each layer's row also holds
    massive_activations, attention_sinks and magnitude_outliers, and the report their rules. Each layer's chance_bound
    and the report's chance_warning (ours; metrics/null.py, metrics/outliers.py); `more`: what gives the rule more
    tokens, as the warning says it."""
    result = reference.statistics
    if result.num_tokens == 0:
        raise UserError(f"no tokens counted in {args.data} (all special tokens excluded?)")
    rule = OutlierRule(min_share=args.min_share, sigma=args.sigma)
    layers = detect_outliers(result, rule)
    extra = magnitudes.layers() if magnitudes is not None else [{} for _ in layers]
    chance = chance_of(layers, result.num_tokens, encoder.hidden_size, rule, more)
    return {
        **run_header(args, encoder),
        "num_sentences": reference.num_sentences,
        "num_tokens": result.num_tokens,
        **reference.counts(),
        "hidden_size": encoder.hidden_size,
        "num_layers": encoder.num_layers,
        "rule": {"min_share": rule.min_share, "sigma": rule.sigma, "description": rule.describe(),
                 "persistence": rule.describe_persistence()},
        **(magnitudes.header() if magnitudes is not None else {}),
        "layers": [{**layer.to_dict(), "chance_bound": chance["chance_bound"], **values, **added}
                   for layer, values, added in zip(layers, result.magnitudes(), extra)],
        "persistent_dims": persistent_dims(layers),
        "chance_warning": chance["chance_warning"],
        "origins": trace_origins(encoder.model, all_outlier_dims(layers)),
    }


def token_frequency_report(args, encoder: FrozenEncoder, sentences: list[str], layers: list[dict],
                           most_frequent: int = 5) -> dict:
    """--token_frequency (ours; Puccetti et al. 2022): a second streamed pass over the same sentences following every
    outlier dimension at each layer where it is one; per (layer, dim), Spearman's rho over the token types seen between
    a type's count in the data and the mean |value| of the dimension over its tokens (metrics/frequency.py)."""
    pairs = [(row["layer"], dim) for row in layers for dim in row["outlier_dims"]]
    entry = {"correlation": "Spearman's rho over the token types seen (ours, after Puccetti et al. 2022): a type's "
                            "token count in the analysed data against the mean |value| of the outlier dimension over "
                            "its tokens, at each layer where the dimension is an outlier",
             "num_types": 0, "dims": []}
    if not pairs:
        return entry
    vocab = max(int(encoder.model.config.vocab_size), len(encoder.tokenizer))
    metric = TokenDimensionMagnitude(vocab, pairs).to(encoder.device)
    for batch in setting_of(args, encoder).batches(sentences, desc="token frequency"):
        metric.update(batch.hidden_states, batch.input_ids, batch.mask)
    counts, means = metric.compute()
    counts, means = counts.cpu(), means.cpu()
    rho = frequency_correlation(counts, means)
    top = counts.argsort(descending=True, stable=True)[:most_frequent]
    top = top[counts[top] > 0].tolist()
    names = encoder.tokenizer.convert_ids_to_tokens(top)
    entry["num_types"] = int((counts > 0).sum())
    entry["dims"] = [{"layer": layer, "dim": dim, "spearman": number(rho[k]),
                      "mean_magnitude": number((means[:, k] * counts).sum() / counts.sum()),
                      "most_frequent": [{"token": name, "text": readable_token(encoder.tokenizer, name),
                                         "count": int(counts[i]), "mean_magnitude": number(means[i, k])}
                                        for name, i in zip(names, top)]}
                     for k, (layer, dim) in enumerate(pairs)]
    return entry


def mean_vectors_png(report: dict, result: NeuronStatisticsResult, encoder: FrozenEncoder):
    outliers = {layer["layer"]: layer["outlier_dims"] for layer in report["layers"]}
    return mean_vectors_figure(result.mean, outliers, title=f"average vector per layer: {encoder.short_name}")


def position_rows_png(report: dict, encoder: FrozenEncoder):
    """The paper's Figures 3-4: the positional-embedding rows, the outlier dims marked; None without a table."""
    rows, note = position_rows(encoder.model)
    if rows is None:
        return None
    dims = report["persistent_dims"] or sorted({d for layer in report["layers"] for d in layer["outlier_dims"]})
    return position_rows_figure(rows, dims, title=f"position-embedding rows: {encoder.short_name} (outlier dims "
                                f"{dims or 'none'}){'; ' + note if note else ''}")


def magnitudes_png(report: dict, encoder: FrozenEncoder):
    """magnitudes.png: per layer, the largest peaks and the median |activation| (Sun et al.'s Figure), the kurtosis
    per token (ours) and per sequence (Bondarenko et al.), and the attention sinks (Gu et al.) when computed."""
    rows = report["layers"]
    layers = [row["layer"] for row in rows]
    shown = min(3, len(rows[0]["massive_activations"]["top"]))
    peaks = {f"top {i + 1} peak |x|": [abs(row["massive_activations"]["top"][i]["value"]) for row in rows]
             for i in range(shown)}
    panels = [{"title": f"largest |activation| per dimension and the median ({report['massive_rule']['rule']} rule)",
               "ylabel": "|activation| (log)", "layers": layers, "log": True,
               "series": {**peaks, "median |x|": [row["massive_activations"]["median_abs"] for row in rows],
                          f"massive from (x {report['massive_rule']['ratio']:g} median)": [
                              report["massive_rule"]["ratio"] * row["massive_activations"]["median_abs"]
                              for row in rows]}},
              {"title": "kurtosis (Pearson, log)", "ylabel": "kurtosis", "layers": layers, "log": True,
               "series": {"per token, mean (ours)": [row["kurtosis_mean"] for row in rows],
                          "per sequence (Bondarenko et al.)": [row["kurtosis_sequence"] for row in rows]}}]
    if report.get("attention_sinks"):
        sinks = [row["attention_sinks"] for row in rows]
        panels.append({"title": f"attention sinks (epsilon {report['attention_sinks']['epsilon']:g}; layer 0 has "
                                "no attention)", "ylabel": "share / attention", "layers": layers,
                       "series": {"share of heads that are sinks": [s and s["sink_share"] for s in sinks],
                                  "attention on the first token": [s and s["first_token_mass"] for s in sinks],
                                  "attention on special tokens": [s and s["special_token_mass"] for s in sinks]}})
    return layer_panels_figure(panels, title=f"massive activations, kurtosis and attention sinks: "
                                             f"{encoder.short_name}", columns=len(panels))


def outlier_figures(report: dict, result: NeuronStatisticsResult, encoder: FrozenEncoder) -> dict:
    """mean_vectors.png (Figures 1-2), magnitudes.png when the report holds them and, for a model with an absolute
    position table, position_embeddings.png."""
    figures = {"mean_vectors.png": lambda: mean_vectors_png(report, result, encoder)}
    if "massive_rule" in report:
        figures["magnitudes.png"] = lambda: magnitudes_png(report, encoder)
    if position_rows(encoder.model)[0] is not None:
        figures["position_embeddings.png"] = lambda: position_rows_png(report, encoder)
    return figures


def run_outliers(args, rank: int, world: int) -> dict:
    sentences, encoder = prepare(args, rank, lambda: read_sentences(args, rank, world))
    magnitudes = Magnitudes.of(args, encoder)
    reference = collect_statistics(encoder, sentences, args, magnitudes)
    report, result = outliers_report(args, encoder, reference, magnitudes), reference.statistics
    if getattr(args, "token_frequency", False):
        report["token_frequency"] = token_frequency_report(args, encoder, sentences, report["layers"])
    finish(args, rank, {"outliers.json": report}, outlier_figures(report, result, encoder))
    if rank == 0:
        print_outliers(report)
        warn_text_counts({"outliers": report})
        warn_chance(report)
    return report


def warn_chance(report: dict) -> None:
    """The report's chance_warning (ours), when it has one, as one line on stderr."""
    if report.get("chance_warning"):
        print(f"warning: {report['chance_warning']}", file=sys.stderr)


def print_outliers(report: dict) -> None:
    print(f"\noutlier dimensions of {report['encoder']} on {report['data']}: {plural(report['num_sentences'], 'sentence')}, "
          f"{plural(report['num_tokens'], 'token', spec=',')} (special tokens {report['special_tokens']}; dims 0-indexed)")
    print(f"{'layer':>5}  {'argmax dim (share)':>19}  {'argmin dim (share)':>19}  outlier dims")
    for layer in report["layers"]:
        print(f"{layer['layer']:>5}  {layer['argmax_dim']:>10} ({layer['argmax_share']:6.1%})  "
              f"{layer['argmin_dim']:>10} ({layer['argmin_share']:6.1%})  "
              f"{', '.join(map(str, layer['outlier_dims'])) or '-'}")
    print(f"{report['rule']['persistence']}: {report['persistent_dims'] or 'none'}")
    if "massive_rule" in report:
        print_magnitudes(report)
    frequency = report.get("token_frequency")
    if frequency is not None:
        print(f"token frequency vs |value| of each outlier dim (Spearman over {frequency['num_types']} token types): " +
              (", ".join(f"layer {row['layer']} dim {row['dim']}: {row['spearman']}" for row in frequency["dims"])
               or "no outlier dims"))
    origins = report["origins"]
    if origins["position_embeddings"] is None:
        print(f"positional embeddings: none to trace ({origins['position_embeddings_note']})")
    elif origins["position_embeddings_note"]:
        print(f"positional embeddings: {origins['position_embeddings_note']}")
    for dim, line in summarise_origins(origins).items():
        if dim in report["persistent_dims"]:
            print(f"  origin of {dim}: {line}")


def print_magnitudes(report: dict) -> None:
    """Per layer: kurtosis per token (ours) and per sequence (Bondarenko et al.), the largest peak (Sun et al.), the
    magnitude outliers (ours) and the share of sink heads (Gu et al.)."""
    print(f"massive: {report['massive_rule']['description']}; magnitude outliers: "
          f"{report['magnitude_rule']['description']}")
    print(f"{'layer':>5}  {'kurtosis tok/seq':>16}  {'peak |x|: dim @ token (pos), x median':<40} {'massive':<9} "
          f"{'magnitude dims':<16} sinks")
    for row in report["layers"]:
        massive, sinks = row["massive_activations"], row["attention_sinks"]
        peak = massive["top"][0] if massive["top"] else None
        where = f"{abs(peak['value']):.3g}: {peak['dim']} @ {shown_token(peak)} ({peak['position']}), {peak['ratio']}x" \
            if peak else "-"
        dims = ", ".join(str(entry["dim"]) for entry in row["magnitude_outliers"]["dims"]) or "-"
        share = "-" if sinks is None else f"{sinks['sink_share']:.0%} of heads"
        kurtosis = f"{row['kurtosis_mean']:.2f}/{row['kurtosis_sequence']:.2f}"
        massive_dims = ", ".join(map(str, massive["massive_dims"][:3])) or "-"
        print(f"{row['layer']:>5}  {kurtosis:>16}  {where:<40} {massive_dims:<9} {dims:<16} {share}")
