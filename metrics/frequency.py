"""Token frequency against the magnitude of outlier dimensions (Puccetti et al. 2022, "Outlier dimensions that
disrupt transformers are driven by frequency"), streamed.

    python analyze.py outliers --token_frequency            # the report's token_frequency entry
    magnitude = TokenDimensionMagnitude(vocab_size, [(layer, dim), ...])   # the (layer, dim) pairs to follow
    magnitude.update(hidden_states, input_ids, mask)      # [layers, batch, seq, hidden], [batch, seq], [batch, seq]
    counts, means = magnitude.compute()                   # [vocab] tokens per type, [vocab, pairs] mean |value|
    rho = frequency_correlation(counts, means)            # [pairs]: Spearman over the token types seen

Per token type (input id), the number of its counted tokens and the sum of |value| of each followed dimension at its
layer, as scatter_add sums into [vocab] and [vocab, pairs] tensor states (bounded by the vocabulary, whatever the
number of tokens; summed across ranks under DDP). The correlation (ours) is Spearman's rho (average ranks for ties)
between a type's frequency in the analysed data (its token count) and the mean |value| of the dimension over its
tokens, over the types seen at least once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from metrics.base import Metric
from metrics.similarity import spearman


class TokenDimensionMagnitude(Metric):
    """Token count and mean |value| of chosen (layer, dim) pairs per token type, over unmasked tokens."""

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    def __init__(self, vocab_size: int, pairs: list[tuple[int, int]], **kwargs) -> None:
        super().__init__(**kwargs)
        self.vocab_size, self.pairs = vocab_size, [(int(layer), int(dim)) for layer, dim in pairs]
        self.register_buffer("layer_index", torch.tensor([layer for layer, _ in self.pairs], dtype=torch.long),
                             persistent=False)
        self.register_buffer("dim_index", torch.tensor([dim for _, dim in self.pairs], dtype=torch.long),
                             persistent=False)
        self.add_state("count", torch.zeros(vocab_size, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("magnitude", torch.zeros(vocab_size, len(self.pairs), dtype=torch.float64),
                       dist_reduce_fx="sum")

    def update(self, hidden_states: Tensor, input_ids: Tensor, mask: Tensor) -> None:
        """hidden_states [layers, batch, seq, hidden]; input_ids [batch, seq]; mask [batch, seq] bool (tokens counted)."""
        mask = mask.bool()
        ids = input_ids[mask].long()  # [tokens]
        if ids.numel() == 0:
            return
        if int(ids.max()) >= self.vocab_size or int(ids.min()) < 0:
            raise ValueError(f"token ids must lie in 0..{self.vocab_size - 1}, got {int(ids.min())}..{int(ids.max())}")
        layers, dims = self.layer_index.to(hidden_states.device), self.dim_index.to(hidden_states.device)
        values = hidden_states[layers, :, :, dims]  # [pairs, batch, seq]
        values = values[:, mask].abs().double().T  # [tokens, pairs]
        self.count.index_add_(0, ids, torch.ones_like(ids, dtype=torch.float64))
        self.magnitude.index_add_(0, ids, values)

    def compute(self) -> tuple[Tensor, Tensor]:
        """(count [vocab], mean |value| [vocab, pairs]: 0 for types never seen)."""
        return self.count.clone(), self.magnitude / self.count.clamp_min(1).unsqueeze(1)


def frequency_correlation(count: Tensor, mean_magnitude: Tensor) -> Tensor:
    """Spearman's rho between the token count and each column of the mean magnitude, over the types seen
    (count > 0). count [vocab], mean_magnitude [vocab, pairs] -> [pairs] (nan where either side is constant)."""
    seen = count > 0
    if int(seen.sum()) < 2:
        return torch.full((mean_magnitude.shape[1],), float("nan"), dtype=torch.float64)
    return spearman(mean_magnitude[seen], count[seen]).reshape(-1)
