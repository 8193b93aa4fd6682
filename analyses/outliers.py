"""The outlier analysis (the paper's §3, with our numbers for its rule): per-layer outlier dimensions, persistent ones, and their origins.

    python analyze.py outliers --encoder bert-base-uncased --data data/austen.txt --output_dir runs/bert
    python analyze.py outliers --token_frequency     # also: token frequency vs outlier magnitude (ours; Puccetti)
    report = outliers_report(args, encoder, statistics, num_sentences, num_truncated)   # outliers.json

The statistics come from one streamed pass (analyses.reference.reference_pass: NeuronStatistics), the rule from
metrics/outliers.py, the origins from metrics/origins.py, the per-layer magnitudes (kurtosis, max |activation|,
top-1 share) from NeuronStatistics, and the opt-in token-frequency correlation from metrics/frequency.py.
"""

from __future__ import annotations

from analyses.reference import number, reference_pass
from analyses.session import finish, prepare, read_sentences, run_header, setting_of, warn_truncation
from core.errors import UserError
from core.figures import mean_vectors_figure, position_rows_figure
from core.models import position_rows
from lightning_modules.encoder import FrozenEncoder
from metrics.frequency import TokenDimensionMagnitude, frequency_correlation
from metrics.neuron_stats import NeuronStatisticsResult
from metrics.origins import summarise_origins, trace_origins
from metrics.outliers import OutlierRule, all_outlier_dims, detect_outliers, persistent_dims


def collect_statistics(encoder: FrozenEncoder, sentences: list[str], args) -> tuple[NeuronStatisticsResult, int, int]:
    """Stream this rank's sentences through the encoder into NeuronStatistics: (statistics, sentences, truncated)."""
    reference = reference_pass(setting_of(args, encoder), sentences, statistics=True, desc="outlier statistics")
    return reference.statistics, reference.num_sentences, reference.num_truncated


def outliers_report(args, encoder: FrozenEncoder, result: NeuronStatisticsResult, num_sentences: int,
                    num_truncated: int) -> dict:
    if result.num_tokens == 0:
        raise UserError(f"no tokens counted in {args.data} (all special tokens excluded?)")
    rule = OutlierRule(min_share=args.min_share, sigma=args.sigma)
    layers = detect_outliers(result, rule)
    return {
        **run_header(args, encoder),
        "num_sentences": num_sentences,
        "num_tokens": result.num_tokens,
        "num_truncated": num_truncated,
        "hidden_size": encoder.hidden_size,
        "num_layers": encoder.num_layers,
        "rule": {"min_share": rule.min_share, "sigma": rule.sigma, "description": rule.describe(),
                 "persistence": rule.describe_persistence()},
        "layers": [{**layer.to_dict(), **magnitudes} for layer, magnitudes in zip(layers, result.magnitudes())],
        "persistent_dims": persistent_dims(layers),
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
                      "most_frequent": [{"token": name, "count": int(counts[i]), "mean_magnitude": number(means[i, k])}
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


def outlier_figures(report: dict, result: NeuronStatisticsResult, encoder: FrozenEncoder) -> dict:
    """mean_vectors.png (Figures 1-2) and, for a model with an absolute position table, position_embeddings.png."""
    figures = {"mean_vectors.png": lambda: mean_vectors_png(report, result, encoder)}
    if position_rows(encoder.model)[0] is not None:
        figures["position_embeddings.png"] = lambda: position_rows_png(report, encoder)
    return figures


def run_outliers(args, rank: int, world: int) -> dict:
    sentences, encoder = prepare(args, rank, lambda: read_sentences(args, rank, world))
    result, num_sentences, num_truncated = collect_statistics(encoder, sentences, args)
    report = outliers_report(args, encoder, result, num_sentences, num_truncated)
    if getattr(args, "token_frequency", False):
        report["token_frequency"] = token_frequency_report(args, encoder, sentences, report["layers"])
    finish(args, rank, {"outliers.json": report}, outlier_figures(report, result, encoder))
    if rank == 0:
        print_outliers(report)
        warn_truncation({"outliers": report})
    return report


def print_outliers(report: dict) -> None:
    print(f"\noutlier dimensions of {report['encoder']} on {report['data']}: {report['num_sentences']} sentences, "
          f"{report['num_tokens']:,} tokens (special tokens {report['special_tokens']}; dims 0-indexed)")
    print(f"{'layer':>5}  {'argmax dim (share)':>19}  {'argmin dim (share)':>19}  outlier dims")
    for layer in report["layers"]:
        print(f"{layer['layer']:>5}  {layer['argmax_dim']:>10} ({layer['argmax_share']:6.1%})  "
              f"{layer['argmin_dim']:>10} ({layer['argmin_share']:6.1%})  "
              f"{', '.join(map(str, layer['outlier_dims'])) or '-'}")
    print(f"{report['rule']['persistence']}: {report['persistent_dims'] or 'none'}")
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
