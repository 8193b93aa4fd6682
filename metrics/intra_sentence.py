"""Ethayarajh's (2019, "How Contextual are Contextualized Word Representations?", eq. 2) intra-sentence
similarity, per layer: how close a sentence's word vectors are to their own mean, the measure read beside self-similarity
(metrics/geometry.py's SelfSimilarity) and the anisotropy baseline both are adjusted by.

    intra = IntraSentenceSimilarity(num_layers=13)
    intra.update(hidden_states, mask)    # [layers, batch, seq, hidden], mask [batch, seq]: the tokens that count
    tokens, rows = sentence_tokens(hidden_states, mask)       # or their counted tokens [layers, n, hidden], row of each,
    intra.update(variant.apply(tokens), sentences=rows)       # a variant applied to those only (not to the padding)
    intra.compute().mean                 # [layers]: the mean over sentences of (1/n) sum_i cos(w_i, mean(w_1..w_n))

A sentence's words are its tokens that the mask counts (FrozenEncoder's mask: never padding; special tokens unless
--exclude_special), each its own vector, sub-word pieces included: the token vectors every geometry metric here reads
(the anisotropy it is adjusted by draws its random tokens by the same mask), as Ethayarajh's code takes every token of
the sentence (bert-base-cased's word pieces, [CLS] and [SEP] dropped: --exclude_special). A sentence never spans two
batches, so each update sees whole sentences: the state is the sum of the per-sentence values and their number, exact
under DDP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from metrics.base import Metric
from metrics.geometry import cosine


def sentence_tokens(hidden_states: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """The counted tokens of a batch and the row of each: hidden_states [layers, batch, seq, hidden], mask [batch, seq]
    -> ([layers, n, hidden], rows [n]), row-major (a sentence's tokens in order)."""
    rows, positions = mask.to(hidden_states.device).bool().nonzero(as_tuple=True)
    return hidden_states[:, rows, positions], rows


def intra_sentence_values(vectors: Tensor, sentences: Tensor) -> tuple[Tensor, Tensor]:
    """Each sentence's intra-sentence similarity from its word vectors: vectors [layers, n, hidden], sentences [n] (the
    sentence of each vector, 0..k-1) -> ([layers, k] float64, which of the k have a vector [k] bool; the others 0).
    A sentence's mean is its vector; a zero vector (a word, or a mean, fully clipped) has cosine 0, as MeanCosine
    counts it. One layer at a time in float32 (no float copy of all layers)."""
    sentences = sentences.to(vectors.device).long()
    size = int(sentences.max()) + 1 if sentences.numel() else 0
    counts = torch.bincount(sentences, minlength=size)  # [k]
    per_layer = []
    for layer in vectors:  # [n, hidden]
        layer = layer.float()
        sums = layer.new_zeros(size, layer.shape[-1]).index_add_(0, sentences, layer)
        mean = sums / counts.clamp_min(1).unsqueeze(1).to(sums)
        cosines = cosine(layer, mean[sentences]).double()  # [n]
        per_layer.append(cosines.new_zeros(size).index_add_(0, sentences, cosines) / counts.clamp_min(1))
    values = torch.stack(per_layer) if per_layer else torch.zeros(0, size, dtype=torch.float64)
    return values, counts > 0


@dataclass
class IntraSentenceResult:
    mean: Tensor  # [layers] the mean over sentences (nan without one)
    num_sentences: Tensor  # [] the sentences counted (with a word)


class IntraSentenceSimilarity(Metric):
    """Intra-sentence similarity (Ethayarajh 2019, eq. 2) per layer: for a sentence s with word vectors w_1..w_n,
    IntraSim(s) = (1/n) sum_i cos(w_i, s_bar), s_bar = (1/n) sum_i w_i, averaged over sentences. States: per layer the
    sum of the sentences' values, and the number of sentences (one with no counted token is not one)."""

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    def __init__(self, num_layers: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_layers = num_layers
        self.add_state("sum", torch.zeros(num_layers, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, hidden_states: Tensor, mask: Tensor | None = None, sentences: Tensor | None = None) -> None:
        """Whole sentences: hidden_states [layers, batch, seq, hidden] with mask [batch, seq] (True: a token that
        counts), or token vectors [layers, n, hidden] with `sentences` [n] (the sentence of each, 0..k-1; every token
        of a sentence in this update: `sentence_tokens` of a batch, a variant applied to them)."""
        if hidden_states.dim() == 4 and mask is not None and sentences is None:
            if tuple(mask.shape) != tuple(hidden_states.shape[1:3]):
                raise ValueError(f"mask {tuple(mask.shape)} is not [batch, seq] of {tuple(hidden_states.shape)}")
            hidden_states, sentences = sentence_tokens(hidden_states, mask)
        elif hidden_states.dim() != 3 or sentences is None or mask is not None:
            raise ValueError(f"expected [layers, batch, seq, hidden] with a mask or [layers, n, hidden] with sentences, "
                             f"got {tuple(hidden_states.shape)}")
        if hidden_states.shape[0] != self.num_layers or sentences.numel() != hidden_states.shape[1]:
            raise ValueError(f"vectors {tuple(hidden_states.shape)} are not [{self.num_layers}, {sentences.numel()} "
                             "(sentence ids), hidden]")
        values, counted = intra_sentence_values(hidden_states, sentences)
        self.sum += values.sum(1).to(self.sum)  # sentences without a vector are 0
        self.count += counted.sum().to(self.count)

    def compute(self) -> IntraSentenceResult:
        mean = torch.where(self.count > 0, self.sum / self.count.clamp_min(1), torch.full_like(self.sum, float("nan")))
        return IntraSentenceResult(mean=mean, num_sentences=self.count.clone())
