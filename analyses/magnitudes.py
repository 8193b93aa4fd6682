"""Per-layer magnitudes beyond the paper, for `analyze.py outliers` and `trajectory`: massive activations (Sun et al.
2024), attention sinks (Gu et al. 2025) and the magnitude criterion for outlier dimensions (ours; LLM.int8's fixed
threshold as an option), taken in the outlier statistics' own reference pass, and the sinks in a pass of their own
with eager attention.

    python analyze.py outliers --massive_rule sun --sink_epsilon 0.5 --magnitude_rule int8
    python analyze.py outliers --no_attention_sinks          # no attention pass (attention_sinks: null)
    magnitudes = Magnitudes.of(args, encoder)                 # the metrics, on the encoder's device
    reference_pass(setting, sentences, statistics=True, magnitudes=magnitudes)   # updated batch by batch
    magnitudes.attention_pass(setting, sentences)             # the sinks: one more pass, eager attention
    magnitudes.layers()       # per layer {"massive_activations", "attention_sinks", "magnitude_outliers"}

The metrics are metrics/massive.py, metrics/sinks.py and metrics/magnitude.py (sum / max / merged fixed-size states:
exact under DDP). Attention weights come from the model's own attention (output_attentions), which SDPA does not
return: the sinks' pass runs the model with transformers' eager attention (FrozenEncoder.attention_weights) and the
model is restored afterwards, so every other statistic still comes from the SDPA pass, unchanged (eager's hidden states
differ from SDPA's by float rounding, 2e-4 on MiniLM's activations of up to 10). The pass costs about one more
forward over the sentences, only when the sinks are asked for (the default in `outliers` and `trajectory`).
"""

from __future__ import annotations

import unicodedata

import torch

from core.errors import UserError
from lightning_modules.encoder import EncodedBatch, FrozenEncoder
from metrics.magnitude import DEFAULTS as MAGNITUDE_DEFAULTS
from metrics.magnitude import RULES as MAGNITUDE_RULES
from metrics.magnitude import MagnitudeCounts, MagnitudeRule
from metrics.massive import DEFAULTS as MASSIVE_DEFAULTS
from metrics.massive import RULES as MASSIVE_RULES
from metrics.massive import MassiveActivations, MassiveRule
from metrics.sinks import EPSILON, AttentionSinks

TOP_K = 5
QUERIES = "the counted tokens (padding never; special tokens unless --exclude_special)"
MARKERS = ("##", "Ġ", "▁", "Ċ")  # subword markers stripped before the punctuation test (WordPiece, BPE, spm)


def add_magnitude_arguments(parser) -> None:
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
    parser.add_argument("--massive_top_k", type=int, default=TOP_K,
                        help=f"dimensions of largest peak |x| reported per layer (default {TOP_K})")
    parser.add_argument("--sink_epsilon", type=float, default=EPSILON,
                        help=f"attention sinks (Gu et al. 2025): a head is a sink when the first token gets more than "
                             f"this of the attention, averaged over queries (default {EPSILON:g}, theirs)")
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


def rules_of(args) -> dict:
    """The rules the options ask for, as a report's header holds them (without an encoder: trajectories)."""
    return {"massive_rule": MassiveRule(args.massive_rule, args.massive_ratio, args.massive_min).to_dict(),
            "magnitude_rule": MagnitudeRule(args.magnitude_rule, args.magnitude_threshold,
                                            args.magnitude_share).to_dict(),
            "attention_sinks": None if args.no_attention_sinks else {"epsilon": args.sink_epsilon,
                                                                     "queries": QUERIES}}


def token_kind(tokenizer, token_id: int, position: int) -> dict:
    """Where a token stands and what it is: its string, the first token of its sequence, a special token,
    punctuation (its text without subword markers is all punctuation)."""
    if token_id < 0:
        return {"token": None, "token_id": None, "first": position == 0, "special": None, "punctuation": None}
    text = tokenizer.convert_ids_to_tokens(token_id)
    bare = text
    for marker in MARKERS:
        bare = bare.replace(marker, "")
    return {"token": text, "token_id": token_id, "first": position == 0,
            "special": token_id in set(tokenizer.all_special_ids),
            "punctuation": bool(bare) and all(unicodedata.category(c).startswith("P") for c in bare)}


class Magnitudes:
    """The three metrics of one reference pass, and their per-layer report entries."""

    def __init__(self, encoder: FrozenEncoder, massive: MassiveRule = MassiveRule(),
                 magnitude: MagnitudeRule = MagnitudeRule(), sinks: bool = True, epsilon: float = EPSILON,
                 top_k: int = TOP_K) -> None:
        self.encoder, self.massive_rule, self.magnitude_rule, self.top_k = encoder, massive, magnitude, top_k
        layers, hidden, device = encoder.num_hidden_states, encoder.hidden_size, encoder.device
        self.massive = MassiveActivations(layers, hidden).to(device)
        self.counts = MagnitudeCounts(layers, hidden, magnitude).to(device)
        tokenizer = encoder.tokenizer
        pad = tokenizer.pad_token_id
        self.special_ids = sorted({i for i in tokenizer.all_special_ids if i != pad and i is not None})
        self.sinks = None
        if sinks:
            heads = getattr(encoder.model.config, "num_attention_heads", None) or encoder.model.config.n_heads
            self.sinks = AttentionSinks(encoder.num_layers, int(heads), epsilon, len(self.special_ids)).to(device)

    @classmethod
    def of(cls, args, encoder: FrozenEncoder) -> Magnitudes:
        """The metrics the options of `add_magnitude_arguments` ask for."""
        return cls(encoder, MassiveRule(args.massive_rule, args.massive_ratio, args.massive_min),
                   MagnitudeRule(args.magnitude_rule, args.magnitude_threshold, args.magnitude_share),
                   not args.no_attention_sinks, args.sink_epsilon, args.massive_top_k)

    def kinds(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[batch, seq] long: each token's index in special_ids (padding is not one), -1 for the others."""
        kinds = torch.full_like(input_ids, -1)
        for index, token in enumerate(self.special_ids):
            kinds[input_ids == token] = index
        return kinds

    def update(self, batch: EncodedBatch) -> None:
        self.massive.update(batch.hidden_states, batch.mask, batch.input_ids)
        self.counts.update(batch.hidden_states, batch.mask)

    def attention_pass(self, setting, sentences: list[str]) -> None:
        """The attention sinks of this rank's shard of `sentences` (analyses.reference.Setting), a pass with eager
        attention; nothing without the sinks."""
        if self.sinks is None:
            return
        with self.encoder.attention_weights():
            for batch in setting.batches(sentences, desc="attention sinks"):
                self.sinks.update(batch.attention_mass, batch.mask, self.kinds(batch.input_ids))

    def header(self) -> dict:
        """The rules, once per report."""
        return {"massive_rule": self.massive_rule.to_dict(), "magnitude_rule": self.magnitude_rule.to_dict(),
                "attention_sinks": None if self.sinks is None else {
                    "epsilon": self.sinks.epsilon, "queries": QUERIES,
                    "special_tokens": self.encoder.tokenizer.convert_ids_to_tokens(self.special_ids)}}

    def layers(self) -> list[dict]:
        """Per layer 0..L: {"massive_activations", "attention_sinks" (None for layer 0, and when not computed),
        "magnitude_outliers"} (every metric syncs here: call on every rank)."""
        massive = self.massive.compute()
        above, num_tokens = self.counts.compute()
        sinks = self.sinks.compute() if self.sinks is not None else None
        outliers = self.magnitude_rule.outliers(above, num_tokens)
        return [{"massive_activations": self.massive_entry(massive, layer),
                 "attention_sinks": self.sink_entry(sinks, layer - 1) if sinks is not None and layer else None,
                 "magnitude_outliers": {"dims": [{"dim": d, "share": share} for d, share in outliers[layer]],
                                        "rule": self.magnitude_rule.describe()}}
                for layer in range(self.encoder.num_hidden_states)]

    def massive_entry(self, result, layer: int) -> dict:
        median = float(result.median[layer])
        tokenizer = self.encoder.tokenizer
        peaks = result.peak_abs[layer].cpu()
        passing = [d for d in range(peaks.shape[0]) if peaks[d] >= 0 and self.massive_rule.passes(float(peaks[d]),
                                                                                                  median)]
        top = []
        for dim in result.top(self.top_k)[layer].tolist():
            value, position = float(result.peak_value[layer, dim]), int(result.peak_position[layer, dim])
            top.append({"dim": dim, "value": round(value, 6), "ratio": round(abs(value) / median, 3) if median > 0
                        else None, "position": position,
                        **token_kind(tokenizer, int(result.peak_token[layer, dim]), position),
                        "massive": dim in passing})
        return {"median_abs": round(median, 6), "ratio": top[0]["ratio"] if top else None, "top": top,
                "massive_dims": sorted(passing, key=lambda d: -float(peaks[d]))}

    def sink_entry(self, sinks: dict, index: int) -> dict:
        names = self.encoder.tokenizer.convert_ids_to_tokens(self.special_ids)
        special = sinks["special_mass"][index].cpu().tolist()
        return {"sink_share": round(float(sinks["sink_share"][index]), 6), "epsilon": sinks["epsilon"],
                "first_token_mass": round(float(sinks["first_token_mass"][index]), 6),
                "first_token_mass_by_head": [round(v, 6) for v in sinks["first_token_mass_by_head"][index].tolist()],
                "special_token_mass": round(sum(special), 6),
                "special_token_mass_by_token": {name: round(v, 6) for name, v in zip(names, special)}}
