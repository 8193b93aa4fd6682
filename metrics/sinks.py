"""Attention sinks (Gu et al., "When Attention Sink Emerges in Language Models: An Empirical View", ICLR 2025; code
sail-sg/Attention-Sink): heads that put much of every query's attention on the first token.

    mass = key_attention(probs, query_mask)          # probs [batch, heads, seq, seq] -> [batch, heads, seq]
    seen = first_key_seen(probs, query_mask)         # [batch]: the share of the counted queries that see the first key
    masses, seens = key_masses(attentions, query_mask)   # both, for every layer's probs at once
    mass = attention_key_mass(queries, keys, key_mask, query_mask)   # the same from queries and keys (live)
    sinks = AttentionSinks(num_layers=6, num_heads=12, epsilon=0.3, num_kinds=2)
    kinds = token_kinds(input_ids, special_ids)      # [batch, seq]: each token's index in special_ids, -1 if none
    sinks.update(masses, query_mask, kinds, seen)    # masses [layers, batch, heads, seq]; kinds [batch, seq] long;
                                                     # seen [layers, batch] (None: every query sees the first key)
    sinks.compute()   # {"sink_share" [layers], "first_token_mass" [layers], "first_token_mass_by_head" [layers, heads],
                      #  "special_mass" [layers, kinds], "num_sequences"}

Gu et al.'s metric (eval_sink_open_source.py, `compute_attention_sink`): the importance of key j is the mean, over the
queries that can see it, of the attention they give it (their `ratios`: T - j queries of a causal model see key j);
a head of a sequence is a sink when the first token's importance exceeds epsilon (0.3); their metric is the share of
(sequence, layer, head) that are sinks. Per layer, as here: the share of (sequence, head) whose first token (position
0) receives more than epsilon of the attention, averaged over the sequence's query positions that can see it. Every
query sees the first token, in a causal model (query i sees keys 0..i, and right padding keeps the first token at
position 0) as in an encoder, so there the mean over every counted query (padding never counts; special tokens unless
the caller's mask leaves them out) is their importance of key 0 exactly (tests/test_families.py, against each family's
eager attention); in a sliding-window layer (ModernBERT's local layers, a window of 128: queries more than 64 tokens
on cannot see the first token, and give it exactly 0) the mean is over the counted queries that see it
(`first_key_seen`: a query whose every head gives the first key a weight of 0 does not), not diluted by those that
cannot. The
mass on special tokens is the attention every counted query gives, in all, to the keys of each kind (a special token:
[CLS] / <s>, [SEP] / </s>, ...), averaged over queries, heads and sequences: in a causal model the queries before a
special token cannot see it and give it nothing, so it reads as the share of all attention that goes to special tokens
(not Gu et al.'s importance of those keys). Every state is a float64 sum, so a DDP run's values equal a single
process's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from core.defaults import SINK_EPSILON
from metrics.base import Metric

EPSILON = SINK_EPSILON  # Gu et al.'s epsilon (core/defaults.py)


def key_attention(probs: Tensor, query_mask: Tensor) -> Tensor:
    """probs [batch, heads, queries, keys] (rows summing to 1), query_mask [batch, queries] bool -> [batch, heads,
    keys] float32: the attention each key receives, averaged over the counted queries (0 for a sequence without one)."""
    weight = query_mask.to(torch.float32)
    total = torch.einsum("bhqk,bq->bhk", probs.float(), weight)
    return total / weight.sum(1).clamp_min(1)[:, None, None]


def first_key_seen(probs: Tensor, query_mask: Tensor) -> Tensor:
    """probs [batch, heads, queries, keys], query_mask [batch, queries] bool -> [batch] float32: the share of the
    counted queries that can see the first key (some head gives it a weight above 0; a masked key gets exactly 0 from
    every head): 1 under full or causal attention, less in a sliding-window layer; 0 without a counted query."""
    counted = query_mask.bool()
    seen = (probs[..., 0] > 0).any(1) & counted
    return seen.sum(1).float() / counted.sum(1).clamp_min(1).float()


def key_masses(attentions: Sequence[Tensor], query_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Each layer's probs [batch, heads, queries, keys] -> (key_attention [layers, batch, heads, keys], first_key_seen
    [layers, batch]): what AttentionSinks.update reads."""
    return (torch.stack([key_attention(probs, query_mask) for probs in attentions]),
            torch.stack([first_key_seen(probs, query_mask) for probs in attentions]))


def attention_key_mass(queries: Tensor, keys: Tensor, key_mask: Tensor, query_mask: Tensor, chunk: int = 256,
                       causal: bool = False) -> Tensor:
    """key_attention of softmax(q k^T / sqrt(head_dim)) over the keys of key_mask (and, `causal`, at or before the
    query's position), from queries and keys [batch, seq, heads, head_dim] (float32), in chunks of `chunk` queries
    (memory [batch, heads, chunk, seq])."""
    total = queries.new_zeros(queries.shape[0], queries.shape[2], keys.shape[1])
    scale = 1 / math.sqrt(queries.shape[-1])
    weight = query_mask.to(total.dtype)
    for start in range(0, queries.shape[1], chunk):
        scores = torch.einsum("bqhd,bkhd->bhqk", queries[:, start:start + chunk].float() * scale, keys.float())
        hidden = ~key_mask.bool()[:, None, None, :]
        if causal:
            where = torch.arange(start, start + scores.shape[2], device=scores.device)
            hidden = hidden | (torch.arange(keys.shape[1], device=scores.device)[None, :] > where[:, None])
        probs = scores.masked_fill_(hidden, float("-inf")).softmax(-1).nan_to_num_(0.0)
        total += torch.einsum("bhqk,bq->bhk", probs, weight[:, start:start + chunk])
    return total / weight.sum(1).clamp_min(1)[:, None, None]


def token_kinds(input_ids: Tensor, special_ids: Sequence[int] | Tensor) -> Tensor:
    """[batch, seq] long: each token's index in `special_ids` (sorted, distinct; a tensor of them, on the ids' device,
    saves a copy to the device per call), -1 for any other token; one pass whatever the number of special ids (a hub
    tokenizer's hundreds of reserved tokens)."""
    if len(special_ids) == 0:
        return torch.full_like(input_ids, -1)
    ids = special_ids.to(input_ids) if isinstance(special_ids, Tensor) else \
        torch.tensor(special_ids, dtype=input_ids.dtype, device=input_ids.device)
    index = torch.searchsorted(ids, input_ids).clamp_max(len(special_ids) - 1)
    return torch.where(ids[index] == input_ids, index, torch.full_like(input_ids, -1))


class AttentionSinks(Metric):
    """Per layer: the share of (sequence, head) whose first token gets more than epsilon of the attention (averaged
    over queries), the mean attention on the first token (per head too), and on each kind of special token."""

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    def __init__(self, num_layers: int, num_heads: int, epsilon: float = EPSILON, num_kinds: int = 0,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_layers, self.num_heads, self.epsilon, self.num_kinds = num_layers, num_heads, epsilon, num_kinds
        self.add_state("num_sequences", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("sink_heads", torch.zeros(num_layers, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("first_mass", torch.zeros(num_layers, num_heads, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("special_mass", torch.zeros(num_layers, max(num_kinds, 1), dtype=torch.float64),
                       dist_reduce_fx="sum")

    def update(self, masses: Tensor, query_mask: Tensor, kinds: Tensor | None = None, seen: Tensor | None = None
               ) -> None:
        """masses [layers, batch, heads, seq]: key_attention of each layer; query_mask [batch, seq] bool (sequences
        without a counted query are skipped); kinds [batch, seq] long: each key's special-token kind in 0..num_kinds-1,
        -1 for the others (padding included); seen [layers, batch]: first_key_seen of each layer (None: every counted
        query sees the first key), the first token's mass is divided by it (the mean over the queries that see it)."""
        if masses.shape[0] != self.num_layers or masses.shape[2] != self.num_heads:
            raise ValueError(f"attention masses {tuple(masses.shape)} are not [{self.num_layers} layers, batch, "
                             f"{self.num_heads} heads, seq]")
        kept = query_mask.bool().any(1)
        masses = masses[:, kept].double()  # [layers, sequences, heads, seq]
        first = masses[..., 0]
        if seen is not None:
            share = seen.to(masses.device)[:, kept].double()[..., None]  # [layers, sequences, 1]
            first = torch.where(share > 0, first / share.clamp_min(1e-12), 0.0)
        self.num_sequences += kept.sum()
        self.sink_heads += (first > self.epsilon).sum((1, 2))
        self.first_mass += first.sum(1)
        if kinds is not None and self.num_kinds:
            kinds = kinds[kept].to(masses.device)
            one_hot = torch.nn.functional.one_hot(kinds.clamp_min(0), self.num_kinds).double()
            one_hot *= (kinds >= 0)[..., None]  # [sequences, seq, kinds]
            self.special_mass += torch.einsum("lbhs,bsk->lk", masses, one_hot)

    def compute(self) -> dict:
        sequences = self.num_sequences.clamp_min(1)
        pairs = sequences * self.num_heads
        return {"num_sequences": int(self.num_sequences.item()), "epsilon": self.epsilon,
                "sink_share": self.sink_heads / pairs,
                "first_token_mass": self.first_mass.sum(1) / pairs,
                "first_token_mass_by_head": self.first_mass / sequences,
                "special_mass": self.special_mass[:, :self.num_kinds] / pairs}
