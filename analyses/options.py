"""The options of analyze.py's subcommands that live beside their runners, torch-free: `analyze.py --help` builds its
parser from these without importing the runners (which import torch).

    add_magnitude_arguments(outliers); check_magnitude_arguments(args)   # massive activations, sinks, magnitudes
    add_intervene_arguments(intervene)                                   # analyze.py intervene

The values they show live in core/defaults.py, which the metrics and runners read too.
"""

from __future__ import annotations

import argparse

from core.defaults import (
    INTERVENE_PROBE,
    INTERVENTIONS,
    MAGNITUDE_DEFAULTS,
    MAGNITUDE_RULES,
    MASSIVE_DEFAULTS,
    MASSIVE_RULES,
    MASSIVE_TOP_K,
    NUM_PAIRS,
    SINK_EPSILON,
    STS_PRESETS,
)
from core.errors import UserError

INTERVENE_HELP = ("interventions inside the forward pass (position table, token types, LayerNorm weights, "
                  "activations) with random-dimension controls and p-values: outlier statistics, anisotropy, MLM loss, "
                  "STS, position probe")


def add_magnitude_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the massive activations, attention sinks and magnitude criterion (outliers, trajectory)."""
    parser.add_argument("--massive_rule", choices=MASSIVE_RULES, default="ratio",
                        help="massive activations: ratio (default, ours: |x| >= --massive_ratio x the layer's median "
                             "|x|) or sun (Sun et al. 2024, for LLMs: |x| > --massive_min and >= --massive_ratio x the "
                             "median)")
    parser.add_argument("--massive_ratio", type=float, default=None,
                        help=f"times the layer's median |x| (default {MASSIVE_DEFAULTS['ratio']['ratio']:g} for "
                             f"ratio, {MASSIVE_DEFAULTS['sun']['ratio']:g} for sun)")
    parser.add_argument("--massive_min", type=float, default=None,
                        help=f"an absolute floor on |x| (default {MASSIVE_DEFAULTS['sun']['min_abs']:g} for sun, none "
                             "for ratio)")
    parser.add_argument("--massive_top_k", type=int, default=MASSIVE_TOP_K,
                        help=f"dimensions of largest peak |x| reported per layer (default {MASSIVE_TOP_K})")
    parser.add_argument("--sink_epsilon", type=float, default=SINK_EPSILON,
                        help=f"attention sinks (Gu et al. 2025): a head is a sink when the first token gets more than "
                             f"this of the attention, averaged over queries (default {SINK_EPSILON:g}, theirs)")
    parser.add_argument("--no_attention_sinks", action="store_true",
                        help="skip the attention sinks and their pass (default: computed, in one more pass over the "
                             "sentences with eager attention)")
    parser.add_argument("--magnitude_rule", choices=MAGNITUDE_RULES, default="rms",
                        help="magnitude outliers: rms (default, ours: |x_d| > --magnitude_threshold x the token's "
                             "RMS) or int8 (LLM.int8, Dettmers et al. 2022: |x_d| >= --magnitude_threshold), in at "
                             "least --magnitude_share of the tokens")
    parser.add_argument("--magnitude_threshold", type=float, default=None,
                        help=f"default {MAGNITUDE_DEFAULTS['rms']['threshold']:g} (x RMS) for rms, "
                             f"{MAGNITUDE_DEFAULTS['int8']['threshold']:g} for int8")
    parser.add_argument("--magnitude_share", type=float, default=None,
                        help=f"default {MAGNITUDE_DEFAULTS['rms']['min_share']:g} for rms, "
                             f"{MAGNITUDE_DEFAULTS['int8']['min_share']:g} for int8")


def check_magnitude_arguments(args) -> None:
    """One line for a value out of range (before anything is written)."""
    if not hasattr(args, "massive_rule"):
        return
    for name in ("massive_ratio", "magnitude_threshold"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise UserError(f"--{name} must be positive, got {value}")
    if args.massive_min is not None and args.massive_min < 0:
        raise UserError(f"--massive_min must not be negative, got {args.massive_min}")
    if args.massive_top_k < 1:
        raise UserError(f"--massive_top_k must be at least 1, got {args.massive_top_k}")
    if not 0 <= args.sink_epsilon < 1:
        raise UserError(f"--sink_epsilon must lie in [0, 1), got {args.sink_epsilon}")
    if args.magnitude_share is not None and not 0 < args.magnitude_share <= 1:
        raise UserError(f"--magnitude_share must lie in (0, 1], got {args.magnitude_share}")


def add_intervene_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--interventions", nargs="+", choices=list(INTERVENTIONS), default=["layernorm_zero"],
                        metavar="NAME", help="one or several of " + ", ".join(INTERVENTIONS) + " (default "
                        "layernorm_zero; docs/interventions.md says what each does)")
    parser.add_argument("--dims", default="auto", help="the dims of layernorm_zero / activation_zero / "
                        "activation_mean and the ones tracked: auto (default: the persistent outlier dims of the "
                        "unmodified model on the same data, by --min_share / --sigma) or a list, 223 or 77,588 "
                        "(0-indexed)")
    parser.add_argument("--layers", default="all", help="hidden-state layers (0 = embedding output; in a decoder "
                        "or pre-LN stack the first block's input, L the final norm's output) where activation_zero / "
                        "activation_mean act and whose norms layernorm_zero edits (pre-LN: the norms inside block l): "
                        "all (default) or a list and ranges, 1-3,6")
    parser.add_argument("--controls", type=int, default=10, help="random sets of as many non-outlier dims on which "
                        "each dimension-based intervention is repeated, seeded by --seed (default 10; 0: none)")
    parser.add_argument("--sts", default=None, help="STS pairs (a file, or a preset: " + ", ".join(STS_PRESETS) +
                        "): Spearman of mean-pooled cosines per layer for every variant (default: none)")
    parser.add_argument("--score_range", default="0,5", help="declared range of the --sts gold scores LO,HI "
                        "(default 0,5; SICK-R is 1,5)")
    parser.add_argument("--probe", action="store_true", help="also the all-layer position probe's test accuracy for "
                        f"every variant, quick settings (ours): {INTERVENE_PROBE['epochs']} epochs at lr "
                        f"{INTERVENE_PROBE['lr']} by default, "
                        "--probe_sentences of --data split 80/10/10 (one process only)")
    parser.add_argument("--probe_sentences", type=int, default=INTERVENE_PROBE["sentences"],
                        help=f"sentences of --data for the probe (default {INTERVENE_PROBE['sentences']})")
    parser.add_argument("--probe_epochs", type=int, default=INTERVENE_PROBE["epochs"],
                        help=f"probe epochs (default {INTERVENE_PROBE['epochs']}; the paper trains 10)")
    parser.add_argument("--num_pairs", type=int, default=NUM_PAIRS,
                        help="anisotropy: token pairs, one random token from each of 2 x this many random sentences "
                             f"(default {NUM_PAIRS}, the paper's)")
