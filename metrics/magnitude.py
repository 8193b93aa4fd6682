"""A magnitude criterion for outlier dimensions, beside the paper's share rule (ours; LLM.int8's fixed threshold as an
option): a dimension is a magnitude outlier of a layer when |activation| exceeds a threshold in at least a share of
the layer's tokens.

    counts = MagnitudeCounts(num_layers=7, hidden_size=384, rule=MagnitudeRule())   # the rule's threshold, fixed
    counts.update(hidden_states, mask)            # [layers, batch, seq, hidden] or [layers, tokens, hidden]
    above, num_tokens = counts.compute()          # [layers, hidden] tokens above the threshold, token count
    MagnitudeRule().outliers(above, num_tokens)   # per layer [(dim, share), ...], largest share first

Rules:
- "rms" (the default, ours): |x_d| > `threshold` (4) x the token vector's RMS, sqrt(mean_i x_i^2), in at least
  `min_share` (0.2) of the tokens. Scale-free: the same for any hidden size or LayerNorm scale. For Gaussian token
  vectors, |x_d| > 4 RMS has probability 6e-5 per token, so no dimension comes near 0.2 (the test plants one in
  128-dim Gaussian noise and checks that only it passes); a dimension merely shifted by -2.5 standard deviations,
  which holds 29-47% of the minima and passes the paper's share rule in a 128-dim model, exceeds 4 RMS in about 7% of
  the tokens and does not pass. The packaged MiniLM's outlier dimension 223 exceeds 4 RMS in 41-69% of the tokens of
  layers 2-5 (docs/analyses.md). A single component can exceed c x RMS only when the hidden size exceeds c^2 (16).
- "int8": LLM.int8's fixed |x_d| >= `threshold` (6.0) in at least `min_share` (0.06) of the tokens (Dettmers et al.
  2022: magnitude 6 in at least 6% of the sequence's tokens; their third condition, in at least 25% of the layers, is
  left to the reader of the per-layer report). Not scale-free: made for LLMs' activations.

States are sum-reduced counts, so the result is exact under DDP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from core.defaults import MAGNITUDE_DEFAULTS, MAGNITUDE_RULES
from metrics.base import Metric

RULES, DEFAULTS = MAGNITUDE_RULES, MAGNITUDE_DEFAULTS  # core/defaults.py: the parsers show them without torch


@dataclass(frozen=True)
class MagnitudeRule:
    rule: str = "rms"
    threshold: float | None = None  # None: the rule's default (4 x RMS; 6.0 for int8)
    min_share: float | None = None  # None: the rule's default (0.2; 0.06 for int8)

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"magnitude rule must be one of {RULES}, got {self.rule!r}")
        for name in ("threshold", "min_share"):
            value = getattr(self, name)
            object.__setattr__(self, name, DEFAULTS[self.rule][name] if value is None else float(value))

    def limit(self, tokens: Tensor) -> Tensor:
        """tokens [..., hidden] -> the threshold each token's components are compared with [..., 1]."""
        if self.rule == "int8":
            return tokens.new_full((*tokens.shape[:-1], 1), self.threshold)
        return tokens.pow(2).mean(-1, keepdim=True).sqrt_().mul_(self.threshold)

    def exceeds(self, tokens: Tensor) -> Tensor:
        """tokens [..., hidden] -> bool [..., hidden]: the components past the threshold, as `describe` says: |x_d| >=
        threshold for int8 (LLM.int8's "magnitude of at least 6": a bf16 or fp16 activation can be 6.0 exactly),
        |x_d| > threshold x RMS for rms."""
        magnitude, limit = tokens.abs(), self.limit(tokens)
        return magnitude >= limit if self.rule == "int8" else magnitude > limit

    def outliers(self, above: Tensor, num_tokens: int) -> list[list[tuple[int, float]]]:
        """Per layer, the (dimension, share of tokens above the threshold) that reach min_share, largest first."""
        shares = above.double() / max(num_tokens, 1)
        found = []
        for row in shares.cpu():
            dims = (row >= self.min_share).nonzero().flatten().tolist()
            found.append(sorted(((d, round(float(row[d]), 6)) for d in dims), key=lambda pair: (-pair[1], pair[0])))
        return found

    def describe(self) -> str:
        if self.rule == "int8":
            return (f"|x_d| >= {self.threshold:g} in at least {self.min_share:.0%} of the tokens (LLM.int8's fixed "
                    "threshold, Dettmers et al. 2022)")
        return (f"|x_d| > {self.threshold:g} x the token vector's RMS in at least {self.min_share:.0%} of the tokens "
                "(ours)")

    def to_dict(self) -> dict:
        return {"rule": self.rule, "threshold": self.threshold, "min_share": self.min_share,
                "description": self.describe()}


class MagnitudeCounts(Metric):
    """Per layer and dimension, the number of counted tokens whose |component| exceeds the rule's threshold."""

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    def __init__(self, num_layers: int, hidden_size: int, rule: MagnitudeRule = MagnitudeRule(), **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_layers, self.hidden_size, self.rule = num_layers, hidden_size, rule
        self.add_state("above", torch.zeros(num_layers, hidden_size, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")

    def update(self, hidden_states: Tensor, mask: Tensor | None = None) -> None:
        """hidden_states [layers, batch, seq, hidden] with mask [batch, seq] bool, or [layers, tokens, hidden]."""
        if hidden_states.shape[0] != self.num_layers or hidden_states.shape[-1] != self.hidden_size \
                or hidden_states.dim() not in (3, 4):
            raise ValueError(f"hidden states {tuple(hidden_states.shape)} do not match {self.num_layers} layers x "
                             f"{self.hidden_size} dims")
        for layer in range(self.num_layers):  # one layer's temporaries at a time
            values = hidden_states[layer]
            tokens = (values[mask.bool()] if mask is not None else values.flatten(0, 1)) if values.dim() == 3 \
                else values
            tokens = tokens.float()
            self.above[layer] += self.rule.exceeds(tokens).sum(0)
        self.count += tokens.shape[0]

    def compute(self) -> tuple[Tensor, int]:
        return self.above.clone(), int(self.count)
