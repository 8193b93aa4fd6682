"""metrics/attention.py on padded batches of tiny BERT and DistilBERT encoders: queries and keys projected from the
hidden states equal the projections' own outputs, and QueryKeyGeometry equals a direct computation from them and
from transformers' eager attention probabilities (padding excluded everywhere).

    .venv/bin/pytest tests/test_attention.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.models import attention_projections
from metrics.attention import QueryKeyGeometry, project_heads
from tests.tiny import tiny_config


@pytest.mark.parametrize("kind", ["bert", "distilbert"])
def test_query_key_geometry_equals_the_eager_attention_of_a_padded_batch(kind):
    from transformers import AutoModel

    torch.manual_seed(0)
    model = AutoModel.from_config(tiny_config(kind, 200), attn_implementation="eager").eval()
    lengths = [12, 7, 3]
    mask = torch.arange(12)[None, :] < torch.tensor(lengths)[:, None]
    ids = torch.randint(5, 200, (3, 12)) * mask
    outputs, handles = {}, []
    projections = attention_projections(model)
    for layer, (query, key, heads) in enumerate(projections):
        for name, module in (("query", query), ("key", key)):
            def keep(module, args, output, where=(layer, name), heads=heads):
                outputs[where] = output.detach().double().unflatten(-1, (heads, -1))
            handles.append(module.register_forward_hook(keep))
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask.long(), output_hidden_states=True, output_attentions=True)
    for handle in handles:
        handle.remove()
    first, second = torch.tensor([0, 2, 5, 9]), torch.tensor([1, 8, 2, 11])
    rows = torch.tensor([0, 4, 10])
    geometry = QueryKeyGeometry(len(projections), projections[0][2], projections[0][0].out_features // projections[0][2])
    for layer, (query, key, heads) in enumerate(projections):
        hidden = out.hidden_states[layer]  # the layer's input
        q = project_heads(hidden, query.weight, query.bias, heads)
        k = project_heads(hidden, key.weight, key.bias, heads)
        torch.testing.assert_close(q.double()[mask], outputs[layer, "query"][mask], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k.double()[mask], outputs[layer, "key"][mask], rtol=1e-5, atol=1e-5)
        geometry.update(layer, q, k, mask, (first, second), rows)
    result = geometry.compute()
    assert result["num_tokens"] == sum(lengths)
    assert result["num_pairs"] == int((mask[:, first] & mask[:, second]).sum()) == 4 + 2 + 1
    assert result["num_queries"] == int(mask[:, rows].sum()) == 3 + 2 + 1
    for layer in range(len(projections)):
        q, k = outputs[layer, "query"], outputs[layer, "key"]  # [batch, seq, heads, d]
        tokens_q, tokens_k = q[mask], k[mask]  # [tokens, heads, d]
        mean_q, mean_k = tokens_q.mean(0), tokens_k.mean(0)
        expected = {"qk_mean_cosine": F.cosine_similarity(mean_q, mean_k, dim=-1).mean(),
                    "query_mean_norm_ratio": (mean_q.norm(dim=-1) / tokens_q.norm(dim=-1).mean(0)).mean(),
                    "key_mean_norm_ratio": (mean_k.norm(dim=-1) / tokens_k.norm(dim=-1).mean(0)).mean()}
        for name, vectors in (("query_anisotropy", q), ("key_anisotropy", k)):
            cosines = [F.cosine_similarity(vectors[b, p], vectors[b, r], dim=-1)  # [heads]
                       for b in range(3) for p, r in zip(first.tolist(), second.tolist()) if mask[b, p] and mask[b, r]]
            expected[name] = torch.stack(cosines).mean()
        probabilities = out.attentions[layer].double()  # [batch, heads, seq, seq]
        entropies = []
        for b in range(3):
            for r in rows.tolist():
                if mask[b, r]:
                    p = probabilities[b, :, r, :lengths[b]]
                    entropies.append(-(p * p.clamp_min(1e-300).log()).sum(-1) / torch.log(torch.tensor(lengths[b])))
        expected["entropy"] = torch.stack(entropies).mean()
        for name, value in expected.items():
            assert result[name][layer].item() == pytest.approx(value.item(), rel=1e-5, abs=1e-6), (layer, name)
    assert ((0 < result["entropy"]) & (result["entropy"] <= 1)).all()


def test_attention_entropy_leaves_out_a_sequence_without_tokens():
    """A sequence with no counted token (an empty text with --exclude_special) has queries without keys: their
    softmax is nan, which made the layer's entropy nan for good. The entropy is that of the other sequences alone,
    computed by hand from their softmax."""
    from metrics.attention import attention_entropy

    generator = torch.Generator().manual_seed(3)
    queries, keys = torch.randn(2, 2, 4, 1, 8, generator=generator)
    mask = torch.ones(2, 4, dtype=torch.bool)
    mask[1] = False
    total, counted = attention_entropy(queries, keys, mask, torch.arange(4))
    probs = (queries[0, :, 0] @ keys[0, :, 0].T / 8 ** 0.5).softmax(-1)
    by_hand = -(probs * probs.log()).sum(-1) / torch.tensor(4.0).log()
    assert int(counted) == 4 and float(total) == pytest.approx(float(by_hand.sum()), rel=1e-5)
