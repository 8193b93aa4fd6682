"""Vectors read off a batch's hidden states: character spans (sub-word pieces averaged), mean-pooled sentences, and
one seeded random token per sentence.

    for batch in encoder.batches(texts, batch_size=32, offsets=True):
        vectors, found = span_vectors(batch, spans)            # spans: per row a list of (start, end) characters
        truncated, in_special = lost_spans(batch, spans, found)  # why the others have no token
        pooled = mean_pool(batch.hidden_states, batch.mask)    # [layers, batch, hidden], padding excluded
        tokens, kept = random_tokens(batch, batch.rows, seed=0)   # [layers, rows with a token, hidden]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_modules.encoder import EncodedBatch, Span
from metrics.geometry import random_tokens as sample_tokens


def span_tokens(offsets: Sequence[Span], span: Span) -> list[int]:
    """Positions of the tokens whose characters overlap `span` (special tokens, with empty offsets, never do)."""
    start, end = span
    return [j for j, (a, b) in enumerate(offsets) if b > a and a < end and b > start]


def span_vectors(batch: EncodedBatch, spans: Sequence[Sequence[Span]]) -> tuple[Tensor, list[tuple[int, int]]]:
    """Average of the hidden states of each span's tokens: ([layers, found, hidden], [(row, span index)] found).

    spans[r] lists the character spans wanted in row r (the batch was encoded with `offsets=True`); a span with no
    token (cut by truncation) is left out.
    """
    offsets = batch.offsets
    hidden = batch.hidden_states  # [layers, batch, seq, hidden]
    seq = hidden.shape[2]
    flat, owner, found = [], [], []
    for row, (row_offsets, row_spans) in enumerate(zip(offsets, spans)):
        for index, span in enumerate(row_spans):
            tokens = span_tokens(row_offsets, span)
            if tokens:
                flat += [row * seq + j for j in tokens]
                owner += [len(found)] * len(tokens)
                found.append((row, index))
    layers, size = hidden.shape[0], hidden.shape[-1]
    if not found:
        return hidden.new_zeros(layers, 0, size), []
    tokens = hidden.flatten(1, 2).index_select(1, torch.tensor(flat, device=hidden.device)).float()
    owner_t = torch.tensor(owner, device=hidden.device)
    sums = tokens.new_zeros(layers, len(found), size).index_add_(1, owner_t, tokens)
    counts = torch.bincount(owner_t, minlength=len(found)).to(sums)
    return sums / counts.view(1, -1, 1), found


def lost_spans(batch: EncodedBatch, spans: Sequence[Sequence[Span]], found: Sequence[tuple[int, int]]
               ) -> tuple[int, int]:
    """Why the spans `span_vectors` did not find have no token: (cut off by truncation: they start where the row's
    tokens stop reading it; inside a special token written in the text, as "mask" in "[MASK]": that token is no
    word's)."""
    kept = set(found)
    missing = [(row, span) for row, row_spans in enumerate(spans) for index, span in enumerate(row_spans)
               if (row, index) not in kept]
    truncated = sum(span[0] >= batch.covered[row] for row, span in missing)
    return truncated, len(missing) - truncated


def mean_pool(hidden_states: Tensor, mask: Tensor) -> Tensor:
    """Mean of each sentence's counted tokens in float32: hidden_states [layers, batch, seq, hidden], mask [batch, seq]
    (the tokens that count: never padding) → [layers, batch, hidden]."""
    weights = mask.float()
    sums = torch.einsum("lbsh,bs->lbh", hidden_states.float(), weights)
    return sums / weights.sum(1).clamp_min(1).view(1, -1, 1)


def random_tokens(batch: EncodedBatch, items: Sequence[int], seed: int) -> tuple[Tensor, list[int]]:
    """One counted token per row, drawn by a generator seeded with (seed, items[row]) so the draw does not depend on
    batching or ranks: ([layers, rows with a token, hidden], those rows). metrics.geometry.random_tokens, the sampler
    the live anisotropy uses too."""
    return sample_tokens(batch.hidden_states, batch.mask, items, seed)
