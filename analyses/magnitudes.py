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
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace

import torch

from core.defaults import MASSIVE_TOP_K
from core.tokenizers import readable_token, sink_ids
from lightning_modules.encoder import EncodedBatch, FrozenEncoder, NoFullAttention, TokenizedBatch
from metrics.magnitude import MagnitudeCounts, MagnitudeRule
from metrics.massive import MassiveActivations, MassiveRule
from metrics.sinks import EPSILON, AttentionSinks, token_kinds

QUERIES = "the counted tokens (padding never; special tokens unless --exclude_special)"
MARKERS = ("##", "Ġ", "▁", "Ċ")  # subword markers stripped before the punctuation test (WordPiece, BPE, spm)


def rules_of(args) -> dict:
    """The rules the options ask for, as a report's header holds them (without an encoder: trajectories)."""
    return {"massive_rule": MassiveRule(args.massive_rule, args.massive_ratio, args.massive_min).to_dict(),
            "magnitude_rule": MagnitudeRule(args.magnitude_rule, args.magnitude_threshold,
                                            args.magnitude_share).to_dict(),
            "attention_sinks": None if args.no_attention_sinks else {"epsilon": args.sink_epsilon,
                                                                     "queries": QUERIES}}


def token_kind(tokenizer, token_id: int, position: int, special: set[int]) -> dict:
    """Where a token stands and what it is: its string (`token`, the tokenizer's own: 'Ġs'; `text`, what it reads as:
    ' s'), the first token of its sequence, a special token (one of
    `special`: FrozenEncoder.special_ids, the project's one rule), punctuation (its text without subword markers is
    all punctuation)."""
    if token_id < 0:
        return {"token": None, "text": None, "token_id": None, "first": position == 0, "special": None,
                "punctuation": None}
    text = tokenizer.convert_ids_to_tokens(token_id)
    bare = text
    for marker in MARKERS:
        bare = bare.replace(marker, "")
    return {"token": text, "text": readable_token(tokenizer, text), "token_id": token_id, "first": position == 0,
            "special": token_id in special,
            "punctuation": bool(bare) and all(unicodedata.category(c).startswith("P") for c in bare)}


ATTENTION_BUDGET = 512 * 2 ** 20  # bytes of attention probabilities (every layer's) the sinks' pass holds at once


def attention_rows(layers: int, heads: int, seq: int, budget: int | None = None) -> int:
    """Rows of a padded batch whose attention probabilities [layers, rows, heads, seq, seq] in float32 fit in `budget`
    (None: ATTENTION_BUDGET; at least 1): a batch of 32 sentences of 512 tokens through bert-base holds 4.8 GB of
    them, 32 of 40 tokens 30 MB."""
    return max(1, (ATTENTION_BUDGET if budget is None else budget) // (layers * heads * seq * seq * 4))


def row_chunks(batches: Iterable[TokenizedBatch], rows_of: Callable[[int], int]) -> Iterator[TokenizedBatch]:
    """Each tokenised batch, or its consecutive slices of `rows_of(seq)` rows when it has more: the same padded rows
    (no re-padding: each row's tokens and positions unchanged), their truncations counted on the first slice."""
    for item in batches:
        rows = rows_of(item.inputs["input_ids"].shape[1])
        if rows >= len(item.rows):
            yield item
            continue
        for start in range(0, len(item.rows), rows):
            part = slice(start, start + rows)
            yield replace(item, inputs={key: value[part] for key, value in item.inputs.items()}, rows=item.rows[part],
                          num_truncated=item.num_truncated if start == 0 else 0,
                          offsets=item.offsets[part] if item.offsets is not None else None,
                          covered=item.covered[part] if item.covered is not None else None)


class Magnitudes:
    """The three metrics of one reference pass, and their per-layer report entries."""

    def __init__(self, encoder: FrozenEncoder, massive: MassiveRule = MassiveRule(),
                 magnitude: MagnitudeRule = MagnitudeRule(), sinks: bool = True, epsilon: float = EPSILON,
                 top_k: int = MASSIVE_TOP_K) -> None:
        self.encoder, self.massive_rule, self.magnitude_rule, self.top_k = encoder, massive, magnitude, top_k
        layers, hidden, device = encoder.num_hidden_states, encoder.hidden_size, encoder.device
        self.massive = MassiveActivations(layers, hidden).to(device)
        self.counts = MagnitudeCounts(layers, hidden, magnitude).to(device)
        self.special_ids = sink_ids(encoder.tokenizer)  # as --exclude_special reads them: not [UNK] (a word), no pad
        self.sinks, self.sinks_note = None, ""
        if sinks:
            heads = getattr(encoder.model.config, "num_attention_heads", None) or encoder.model.config.n_heads
            self.sinks = AttentionSinks(encoder.num_layers, int(heads), epsilon, len(self.special_ids)).to(device)

    @classmethod
    def of(cls, args, encoder: FrozenEncoder, attention: bool = True) -> Magnitudes:
        """The metrics the options of `analyses.options.add_magnitude_arguments` ask for (the sinks only with
        `attention`: an encoder that has attention weights to read)."""
        return cls(encoder, MassiveRule(args.massive_rule, args.massive_ratio, args.massive_min),
                   MagnitudeRule(args.magnitude_rule, args.magnitude_threshold, args.magnitude_share),
                   attention and not args.no_attention_sinks, args.sink_epsilon, args.massive_top_k)

    def kinds(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[batch, seq] long: each token's index in special_ids (padding is not one), -1 for the others."""
        return token_kinds(input_ids, self.special_ids)

    def update(self, batch: EncodedBatch) -> None:
        self.massive.update(batch.hidden_states, batch.mask, batch.input_ids)
        self.counts.update(batch.hidden_states, batch.mask)

    def attention_pass(self, setting, sentences: list[str]) -> None:
        """The attention sinks of this rank's shard of `sentences` (analyses.reference.Setting), a pass with eager
        attention; nothing without the sinks. A batch whose attention probabilities of every layer would pass
        ATTENTION_BUDGET (transformers returns them all at once) is encoded a few of its padded rows at a time
        (`attention_rows`): the same rows, so the same sinks, in bounded memory."""
        if self.sinks is None:
            return
        layers, heads = self.encoder.num_layers, self.sinks.num_heads
        try:
            with self.encoder.attention_weights(), warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # truncations are counted in the reports instead
                chunks = row_chunks(setting.tokenized(sentences), lambda seq: attention_rows(layers, heads, seq))
                for batch in self.encoder.encode(chunks, len(setting.shard(len(sentences))), setting.progress,
                                                 "attention sinks", setting.max_length):
                    self.sinks.update(batch.attention_mass, batch.mask, self.kinds(batch.input_ids),
                                      batch.first_key_seen)
        except NoFullAttention as error:  # every rank runs the same model: all of them drop the sinks
            self.sinks, self.sinks_note = None, f"attention sinks not measured: {error}"
            warnings.warn(self.sinks_note, stacklevel=2)

    def header(self) -> dict:
        """The rules, once per report."""
        return {**({"attention_sinks_note": self.sinks_note} if self.sinks_note else {}),
                "massive_rule": self.massive_rule.to_dict(), "magnitude_rule": self.magnitude_rule.to_dict(),
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
        tokenizer, special = self.encoder.tokenizer, set(self.encoder.special_ids.tolist())
        peaks = result.peak_abs[layer].cpu()
        passing = [d for d in range(peaks.shape[0]) if peaks[d] >= 0 and self.massive_rule.passes(float(peaks[d]),
                                                                                                  median)]
        top = []
        for dim in result.top(self.top_k)[layer].tolist():
            value, position = float(result.peak_value[layer, dim]), int(result.peak_position[layer, dim])
            top.append({"dim": dim, "value": round(value, 6), "ratio": round(abs(value) / median, 3) if median > 0
                        else None, "position": position,
                        **token_kind(tokenizer, int(result.peak_token[layer, dim]), position, special),
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
