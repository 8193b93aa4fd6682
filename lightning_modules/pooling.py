"""Encode texts in batches that remember where each text came from, and read vectors off the hidden states:
character spans (sub-word pieces averaged), mean-pooled sentences, and one seeded random token per sentence.

    for rows, batch, offsets in indexed_batches(encoder, texts, batch_size=32, offsets=True):
        vectors, found = span_vectors(batch, offsets, spans)    # spans: per row a list of (start, end) characters
        pooled = mean_pool(batch)                              # [layers, batch, hidden], padding excluded
        tokens = random_tokens(batch, [global index of each row], seed=0)   # [layers, batch, hidden]

Rows come back sorted by length inside a buffer of batches (less padding); `rows` gives each one's position in
`texts`. Character offsets need a fast (Rust) tokenizer; sentences over `max_length` tokens are truncated and
counted in `num_truncated` of each batch, as in FrozenEncoder.batches.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor
from tqdm.auto import tqdm

from datamodules.io import UserError
from lightning_modules.encoder import EncodedBatch, FrozenEncoder, pad

Span = tuple[int, int]


def tokenize_with_offsets(encoder: FrozenEncoder, texts: Sequence[str], max_length: int | None = None
                          ) -> tuple[dict[str, Tensor], list[list[Span]], int]:
    """Like FrozenEncoder.tokenize, plus each token's (start, end) characters ((0, 0) for special tokens)."""
    tokenizer = encoder.tokenizer
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(f"{encoder.name} has no fast tokenizer, so character offsets of words cannot be located")
    max_length = encoder.check_max_length(max_length)
    options = dict(return_special_tokens_mask=True, return_offsets_mapping=True, verbose=False)
    encoded = tokenizer(list(texts), truncation=False, **options)
    long_rows = [i for i, ids in enumerate(encoded["input_ids"]) if len(ids) > max_length]
    if long_rows:
        cut = tokenizer([texts[i] for i in long_rows], truncation=True, max_length=max_length, **options)
        for key in encoded:
            for row, value in zip(long_rows, cut[key]):
                encoded[key][row] = value
    offsets = [[tuple(pair) for pair in row] for row in encoded["offset_mapping"]]
    return pad(encoded, tokenizer.pad_token_id), offsets, len(long_rows)


def indexed_batches(encoder: FrozenEncoder, texts: Sequence[str], batch_size: int = 32, max_length: int | None = None,
                    offsets: bool = False, progress: bool = True, desc: str = "encoding", sort_buffer: int = 32
                    ) -> Iterator[tuple[list[int], EncodedBatch, list[list[Span]] | None]]:
    """Yield (rows, batch, offsets or None): `rows` are the positions in `texts` of the batch's sentences."""
    encoder.check_max_length(max_length)
    order = iter(range(len(texts)))
    bar = tqdm(total=len(texts), unit="sent", desc=f"{desc} ({encoder.short_name})", disable=not progress,
               dynamic_ncols=True, leave=False)
    with bar:
        while chunk := list(itertools.islice(order, batch_size * sort_buffer)):
            chunk.sort(key=lambda i: len(texts[i]))
            for start in range(0, len(chunk), batch_size):
                rows = chunk[start:start + batch_size]
                part = [texts[i] for i in rows]
                if offsets:
                    inputs, spans, truncated = tokenize_with_offsets(encoder, part, max_length)
                else:
                    (inputs, truncated), spans = encoder.tokenize(part, max_length), None
                batch = encoder(**inputs)
                batch.num_truncated = truncated
                bar.update(len(rows))
                yield rows, batch, spans


def span_tokens(offsets: Sequence[Span], span: Span) -> list[int]:
    """Positions of the tokens whose characters overlap `span` (special tokens, with empty offsets, never do)."""
    start, end = span
    return [j for j, (a, b) in enumerate(offsets) if b > a and a < end and b > start]


def span_vectors(batch: EncodedBatch, offsets: Sequence[Sequence[Span]], spans: Sequence[Sequence[Span]]
                 ) -> tuple[Tensor, list[tuple[int, int]]]:
    """Average of the hidden states of each span's tokens: ([layers, found, hidden], [(row, span index)] found).

    spans[r] lists the character spans wanted in row r; a span with no token (cut by truncation) is left out.
    """
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


def mean_pool(batch: EncodedBatch) -> Tensor:
    """Mean of each sentence's counted tokens (padding never; special tokens unless excluded): [layers, batch, hidden]."""
    mask = batch.mask.to(batch.hidden_states.dtype)  # [batch, seq]
    sums = torch.einsum("lbsh,bs->lbh", batch.hidden_states.float(), mask.float())
    return sums / mask.sum(1).clamp_min(1).float().view(1, -1, 1)


def random_tokens(batch: EncodedBatch, items: Sequence[int], seed: int) -> tuple[Tensor, list[int]]:
    """One counted token per row, drawn by a generator seeded with (seed, items[row]) so the draw does not depend on
    batching or ranks: ([layers, rows with a token, hidden], those rows)."""
    counts = batch.mask.sum(1).tolist()
    rows, positions = [], []
    for row, (item, count) in enumerate(zip(items, counts)):
        if count:
            pick = random.Random(seed * 1_000_003 + int(item)).randrange(int(count))
            positions.append(int(batch.mask[row].nonzero()[pick]))
            rows.append(row)
    hidden = batch.hidden_states
    if not rows:
        return hidden.new_zeros(hidden.shape[0], 0, hidden.shape[-1]), []
    index_rows = torch.tensor(rows, device=hidden.device)
    index_positions = torch.tensor(positions, device=hidden.device)
    return hidden[:, index_rows, index_positions].float(), rows
