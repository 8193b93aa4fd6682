"""RoFormer's self-attention through PyTorch's scaled_dot_product_attention (ours): transformers' RoFormer has only its
eager attention (two matrix products, softmax and dropout on [batch, heads, T, T]), which doubles the rotary arms'
step on a GPU (docs/benchmarks.md, benchmarks/gpu_arms.py).

    install_sdpa(model)     # every RoFormerSelfAttention of `model` now attends through SDPA (same weights, same math)

The queries and keys are rotated as RoFormer's `apply_rotary_position_embeddings` rotates them (the values too with
`rotary_value`), in three kernels a tensor and in the queries' dtype (bf16 under autocast, as Llama's and ModernBERT's
rotary embeddings are applied): transformers' version builds the interleaved sines and cosines in every layer and,
under autocast, promotes the rotated [batch, heads, T, d] tensors to float32, some 20 kernels a layer that took a
sixth of the rotary MLM's eager GPU step, 9 ms of 58 on an H200 (docs/benchmarks.md). Then they attend through SDPA
with the mask RoFormerModel made, and dropout on the attention probabilities in training, as eager does. Eagerly a
bidirectional batch without padding has no mask (the flash kernel); traced by torch.compile, transformers' mask helpers
cannot look at the mask's values and materialise it (an all-True mask: the memory-efficient kernel instead). Asked for
the attention weights (`output_attentions`: the attention sinks, the analyses) or given a cache or cross-attention
inputs, a layer runs transformers' eager forward. The model's state dict, config and export are unchanged: plain
transformers loads the export with its eager attention and gives the same hidden states (tested).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.models.roformer.modeling_roformer import RoFormerSelfAttention


class SdpaRoFormerSelfAttention(RoFormerSelfAttention):
    """RoFormerSelfAttention whose plain self-attention runs through scaled_dot_product_attention."""

    @staticmethod
    def apply_rotary_position_embeddings(sinusoidal_pos: Tensor, query_layer: Tensor, key_layer: Tensor,
                                         value_layer: Tensor | None = None) -> tuple[Tensor, ...]:
        """RoFormer's rotation (its signature and result): the pair (x_2i, x_2i+1) at position p turned by the angle
        p 10000^(-2i/d), `sinusoidal_pos` [..., T, d] holding the sines then the cosines; as x cos + swap(x) sin with
        swap(x) = (x_1, x_0, x_3, x_2, ...) and the sines signed (-s_0, s_0, -s_1, s_1, ...)."""
        sin, cos = sinusoidal_pos.to(query_layer.dtype).chunk(2, dim=-1)
        cos, sin = cos.repeat_interleave(2, dim=-1), torch.stack((-sin, sin), dim=-1).flatten(-2)

        def turned(x: Tensor) -> Tensor:
            return torch.addcmul(x * cos, x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2), sin)

        return tuple(turned(x) for x in (query_layer, key_layer, value_layer) if x is not None)

    def forward(self, hidden_states, attention_mask=None, sinusoidal_pos=None, encoder_hidden_states=None, cache=None,
                output_attentions=False, **kwargs):
        if output_attentions or encoder_hidden_states is not None or cache is not None:
            return super().forward(hidden_states, attention_mask=attention_mask, sinusoidal_pos=sinusoidal_pos,
                                   encoder_hidden_states=encoder_hidden_states, cache=cache,
                                   output_attentions=output_attentions, **kwargs)
        shape = (*hidden_states.shape[:-1], -1, self.attention_head_size)
        query, key, value = (projection(hidden_states).view(shape).transpose(1, 2)
                             for projection in (self.query, self.key, self.value))
        if sinusoidal_pos is not None:
            query, key, *rest = self.apply_rotary_position_embeddings(sinusoidal_pos, query, key,
                                                                       value if self.rotary_value else None)
            value = rest[0] if rest else value
        mask = attention_mask.to(query.dtype) if attention_mask is not None and attention_mask.is_floating_point() \
            else attention_mask
        context = F.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                                 dropout_p=self.dropout.p if self.training else 0.0)
        return context.transpose(1, 2).reshape(*hidden_states.shape[:-1], self.all_head_size), None


def install_sdpa(model: nn.Module) -> int:
    """Route every RoFormerSelfAttention of `model` through SDPA (in place: the modules keep their weights); returns
    how many."""
    count = 0
    for module in model.modules():
        if type(module) is RoFormerSelfAttention:
            module.__class__ = SdpaRoFormerSelfAttention
            count += 1
    return count
