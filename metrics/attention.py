"""The geometry of self-attention's queries and keys (Godey, de la Clergerie & Sagot, "Anisotropy Is Inherent to
Self-Attention in Transformers", EACL 2024): during training, queries and keys drift towards a common direction and
the attention sharpens.

    queries = project_heads(hidden, query.weight, query.bias, heads)    # [batch, seq, heads, head_dim]
    geometry = QueryKeyGeometry(num_layers=12, num_heads=12, head_dim=64)
    geometry.update(0, queries, keys, mask, pairs=(first, second), rows=positions)   # one layer at a time
    geometry.compute()   # {"qk_mean_cosine", "query_mean_norm_ratio", ..., "entropy": [layers], "num_tokens", ...}

Every statistic is taken per head (the vectors one head's attention compares) and averaged over the heads:
- qk_mean_cosine: the cosine between the mean query and the mean key;
- query_mean_norm_ratio, key_mean_norm_ratio: the norm of the mean vector over the mean norm (1 when every vector
  points the same way, near 0 for vectors spread around the origin): the common drift;
- query_anisotropy, key_anisotropy: the mean cosine of pairs of positions of one sequence (`pairs`);
- entropy: the entropy of the attention distribution softmax(q k^T / sqrt(head_dim)) of the queries at `rows` of every
  sequence over its keys (the tokens of `mask`), divided by log(number of keys): 1 for uniform attention, 0 for one
  key; sequences of a single token are left out. For a causal model (`causal`) a query's keys are the tokens at and
  before it, and a query with fewer than 2 is left out; for a rotary model the entropy takes the queries and keys as
  its attention rotates them (`attended`), the other statistics the projections of the hidden states.
States are float64 sums, so a DDP run's values equal a single process's on the same global batch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from metrics.base import Metric
from metrics.geometry import cosine

NAMES = ("qk_mean_cosine", "query_mean_norm_ratio", "key_mean_norm_ratio", "query_anisotropy", "key_anisotropy",
         "entropy")


def project_heads(hidden: Tensor, weight: Tensor, bias: Tensor | None, heads: int) -> Tensor:
    """hidden [batch, seq, hidden] through a query or key projection (weight [heads * head_dim, hidden]) ->
    [batch, seq, heads, head_dim], in float32."""
    out = F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())
    return out.unflatten(-1, (heads, out.shape[-1] // heads))


def attention_entropy(queries: Tensor, keys: Tensor, mask: Tensor, rows: Tensor, causal: bool = False
                      ) -> tuple[Tensor, Tensor]:
    """The normalised attention entropy of the queries at positions `rows` [m] of each sequence: queries, keys
    [batch, seq, heads, head_dim], mask [batch, seq] bool (the keys and queries that exist) -> (sum over the counted
    queries [heads] float64, their number: a 0-dim tensor, no wait for the device). A query counts when its position
    holds a token and it has at least 2 keys (`causal`: the tokens at and before its position)."""
    picked = queries[:, rows]  # [batch, m, heads, d]
    scores = torch.einsum("bmhd,bshd->bhms", picked, keys) / math.sqrt(queries.shape[-1])
    visible = mask[:, None, :].expand(-1, len(rows), -1)  # [batch, m, seq]
    if causal:
        visible = visible & (torch.arange(mask.shape[1], device=mask.device)[None, :] <= rows[:, None])[None]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    entropy = torch.special.entr(scores.softmax(-1)).sum(-1)  # [batch, heads, m]
    length = visible.sum(-1)  # [batch, m]
    counted = mask[:, rows] & (length >= 2)  # [batch, m]
    normalised = entropy / length.clamp_min(2).log().to(entropy)[:, None, :]
    # a query without a key (a sequence without a token; causal, before the first) has softmax nan: left out, as
    # nan x 0 would still make the layer's sum nan
    normalised = torch.where(counted[:, None, :], normalised, torch.zeros_like(normalised))
    total = normalised.sum((0, 2), dtype=torch.float64)
    return total, counted.sum()


class QueryKeyGeometry(Metric):
    """Per layer and head: sums of queries and keys, of their norms, of pair cosines and of attention entropies (see
    the module docstring); compute() averages over the heads."""

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    def __init__(self, num_layers: int, num_heads: int, head_dim: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_layers, self.num_heads, self.head_dim = num_layers, num_heads, head_dim
        for name in ("query_sum", "key_sum"):
            self.add_state(name, torch.zeros(num_layers, num_heads, head_dim, dtype=torch.float64),
                           dist_reduce_fx="sum")
        for name in ("query_norm_sum", "key_norm_sum", "query_pair_sum", "key_pair_sum", "entropy_sum"):
            self.add_state(name, torch.zeros(num_layers, num_heads, dtype=torch.float64), dist_reduce_fx="sum")
        for name in ("tokens", "pairs", "queries"):
            self.add_state(name, torch.zeros(num_layers, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, layer: int, queries: Tensor, keys: Tensor, mask: Tensor | None, pairs: tuple[Tensor, Tensor],
               rows: Tensor, causal: bool = False, attended: tuple[Tensor, Tensor] | None = None) -> None:
        """Layer `layer` (0..num_layers-1) of a batch: queries, keys [batch, seq, heads, head_dim]; mask [batch, seq]
        (None: every position is a token); pairs (first [n], second [n]) positions of each sequence compared for
        anisotropy; rows [m] positions of each sequence whose attention entropy is taken; `causal`: a query attends
        to the tokens at and before it; `attended`: the (queries, keys) the attention compares, when it rotates them
        (rotary positions; default the projections themselves)."""
        expected = (self.num_heads, self.head_dim)
        if queries.dim() != 4 or tuple(queries.shape[2:]) != expected or keys.shape != queries.shape:
            raise ValueError(f"queries {tuple(queries.shape)} and keys {tuple(keys.shape)} are not both "
                             f"[batch, seq, {self.num_heads}, {self.head_dim}]")
        batch, seq = queries.shape[:2]
        mask = torch.ones(batch, seq, dtype=torch.bool, device=queries.device) if mask is None else \
            mask.to(queries.device).bool()
        weights = mask[:, :, None, None].to(queries.dtype)
        first, second = (p.to(queries.device) for p in pairs)
        valid = (mask[:, first] & mask[:, second])[:, :, None].to(queries.dtype)  # [batch, n, 1]
        for kind, vectors in (("query", queries), ("key", keys)):
            getattr(self, f"{kind}_sum")[layer] += (vectors * weights).sum((0, 1), dtype=torch.float64)
            getattr(self, f"{kind}_norm_sum")[layer] += (vectors.norm(dim=-1) * weights[..., 0]).sum(
                (0, 1), dtype=torch.float64)
            getattr(self, f"{kind}_pair_sum")[layer] += (cosine(vectors[:, first], vectors[:, second]) * valid).sum(
                (0, 1), dtype=torch.float64)
        self.tokens[layer] += mask.sum()
        self.pairs[layer] += valid.sum()
        total, counted = attention_entropy(*(attended or (queries, keys)), mask, rows.to(queries.device), causal)
        self.entropy_sum[layer] += total
        self.queries[layer] += counted

    def compute(self) -> dict:
        """{name: [layers] float64 for name in NAMES, "num_tokens", "num_pairs", "num_queries": ints (of the first
        layer: every layer sees the same tokens)}."""
        def ratio(sums: Tensor, counts: Tensor) -> Tensor:
            return (sums / counts.clamp_min(1).unsqueeze(1)).mean(1)

        return {
            "qk_mean_cosine": cosine(self.query_sum, self.key_sum).double().mean(1),
            "query_mean_norm_ratio": (self.query_sum.norm(dim=-1) / self.query_norm_sum.clamp_min(1e-300)).mean(1),
            "key_mean_norm_ratio": (self.key_sum.norm(dim=-1) / self.key_norm_sum.clamp_min(1e-300)).mean(1),
            "query_anisotropy": ratio(self.query_pair_sum, self.pairs),
            "key_anisotropy": ratio(self.key_pair_sum, self.pairs),
            "entropy": ratio(self.entropy_sum, self.queries),
            "num_tokens": int(self.tokens[0].item()),
            "num_pairs": int(self.pairs[0].item()),
            "num_queries": int(self.queries[0].item()),
        }
