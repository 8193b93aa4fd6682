"""The Gaussian twin of an encoder (ours): the same tokenizer, special tokens, maximum length and layer count, but every
hidden state seeded standard Gaussian noise. Analysed like any encoder, it gives each statistic's Gaussian null on the
very tokens a checkpoint is analysed on (analyses/null.py).

    twin = gaussian_encoder(encoder, seed=0)      # a FrozenEncoder: twin.batches(...) as encoder.batches(...)

Each forward draws [layers, batch, seq, hidden] from a CPU generator seeded once (metrics/null.py's
gaussian_states), so a pass over the same sentences in the same batches is the same sample. Under torchrun each rank
draws its own shard from `seed + rank`: the sample then depends on the world size (still a seeded Gaussian sample).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch
from torch import nn

from lightning_modules.encoder import FrozenEncoder
from metrics.null import gaussian_states


class GaussianStates(nn.Module):
    """Stands in for a transformers encoder: `hidden_states` are seeded N(0, 1) noise of the encoder's shape."""

    def __init__(self, config, seed: int) -> None:
        super().__init__()
        self.config = config
        self.anchor = nn.Parameter(torch.zeros(()), requires_grad=False)  # the device the twin lives on
        self.generator = torch.Generator().manual_seed(seed)

    def forward(self, input_ids, attention_mask=None, output_hidden_states: bool = True, return_dict: bool = True,
                **kwargs):
        shape = (self.config.num_hidden_layers + 1, *input_ids.shape, self.config.hidden_size)
        states = gaussian_states(shape, self.generator).to(self.anchor.device)
        return SimpleNamespace(hidden_states=tuple(states))


def gaussian_encoder(encoder: FrozenEncoder, seed: int, rank: int = 0) -> FrozenEncoder:
    """`encoder`'s Gaussian twin (same tokenizer, mask rules, maximum length, hidden size and layers)."""
    model = GaussianStates(copy.deepcopy(encoder.model.config), seed + rank)
    twin = FrozenEncoder(model, encoder.tokenizer, name=f"gaussian null (seed {seed})",
                         exclude_special=encoder.exclude_special)
    twin.max_length = encoder.max_length
    return twin.to(encoder.device)
