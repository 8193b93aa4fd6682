"""Where outlier dimensions come from (the paper's §3): positional-embedding rows and LayerNorm parameters.

    origins = trace_origins(encoder.model, dims=outlier_dims)    # the detected dims, e.g. [d1, d2]

For each dimension d:
- position_embeddings: the rows (positions, 0-indexed from the first position a token can take) whose largest or
  smallest value lies on d, their shares of all rows, and d's rank by |column mean| of the table. A row whose largest
  (smallest) value k dims hold exactly is listed under each of them and counts 1/k in each one's share, as a token
  does in the outlier rule (metrics.neuron_stats.count_extremes), so no dim gains from its index. The whole entry
  is None, with a reason, when the model has no absolute position table or an all-zero one (this project's no-PE
  models). A factorised table [positions, E] narrower than the hidden size H (ALBERT's, ELECTRA's) has its rows
  traced into the hidden space through the E-to-H projection (`embedding_hidden_mapping_in`, `embeddings_project`:
  rows @ W.T, no bias; core.models.position_rows), and the note says so.
- layer_norms: for every LayerNorm over the hidden size, d's gain and bias and their ranks by magnitude among
  all dimensions (1 + the dims of strictly larger |value|: 1 = largest) and ties (the other dims of exactly the same
  |value|: a random-init LayerNorm's gains are all 1, so every dim has rank 1 and hidden - 1 ties), with the hidden-state layer the LayerNorm writes (0 = embeddings); a LayerNorm
  shared by several layers (ALBERT's shared groups) has layer None and lists them in shared_by_layers. An RMSNorm
  (Llama, Qwen) is traced like a LayerNorm's gain and has no bias. Gains and biases are what the norm applies
  (core.norms.norm_affine, read off its forward pass): Gemma's RMSNorm gain is 1 + its weight, and OLMo's
  parameter-free LayerNorm has gain 1 everywhere. In a pre-LN model (GPT-2, Llama, GPT-NeoX, OPT,
  ModernBERT) a norm inside layer l normalises the input of its attention or MLP and writes no hidden state: its entry
  has layer l and placement "pre"; the final norm writes layer L ("final"); `layer_norms_note` says so.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from core.families import decoder_stack, norm_placement, pre_norm
from core.models import layer_norms, position_rows
from core.norms import norm_affine
from metrics.neuron_stats import count_extremes
from metrics.ranks import ranked, ranks_and_ties, strictly_top


def trace_origins(model: nn.Module, dims: list[int]) -> dict:
    """Origins report for `dims`: {"position_embeddings": ..., "layer_norms": ...} (see module docstring)."""
    table, note = position_rows(model)
    report: dict = {"position_embeddings": None, "position_embeddings_note": note, "layer_norms": {}}
    if table is not None:
        counts = torch.zeros(2, 1, table.shape[1], dtype=torch.float64)  # [max | min, 1 table, hidden]: ties split
        extremes = [count_extremes(counts[i], table[None], largest=i == 0)[0] for i in (0, 1)]  # [positions] each
        holds_max, holds_min = (table == value[:, None] for value in extremes)  # [positions, hidden]
        column_rank, column_ties = ranks_and_ties(table.mean(0))
        report["position_embeddings"] = {
            "num_positions": int(table.shape[0]),
            "dims": {
                str(d): {
                    "positions_as_max": holds_max[:, d].nonzero().flatten().tolist(),
                    "positions_as_min": holds_min[:, d].nonzero().flatten().tolist(),
                    "share_as_max": round(float(counts[0, 0, d]) / table.shape[0], 6),
                    "share_as_min": round(float(counts[1, 0, d]) / table.shape[0], 6),
                    "column_mean": round(float(table[:, d].mean()), 6),
                    "column_mean_rank": int(column_rank[d]),
                    "column_mean_ties": int(column_ties[d]),
                }
                for d in dims
            },
        }
    norms = [(name, layers, module, norm_affine(module, model.config.hidden_size),
              (norm_placement(model, module) or (None, None))[1])  # once per norm, not per dim
             for name, layers, module in layer_norms(model)]
    report["layer_norms_note"] = norms_note(model, [(module, affine, placement)
                                                    for _, _, module, affine, placement in norms])
    ranks = [(ranks_and_ties(affine.gain), ranks_and_ties(affine.bias) if affine.bias is not None else None)
             for _, _, _, affine, _ in norms]
    for d in dims:
        entries = []
        for (name, layers, _, affine, placement), (weight_rank, bias_rank) in zip(norms, ranks, strict=True):
            entry = {"module": name, "layer": layers[0] if len(layers) == 1 else None,
                     "weight": round(float(affine.gain[d]), 6), "weight_rank": int(weight_rank[0][d]),
                     "weight_ties": int(weight_rank[1][d])}
            if len(layers) > 1:
                entry["shared_by_layers"] = layers
            if placement is not None:
                entry["placement"] = placement
            if bias_rank is not None:
                entry.update(bias=round(float(affine.bias[d]), 6), bias_rank=int(bias_rank[0][d]),
                             bias_ties=int(bias_rank[1][d]))
            entries.append(entry)
        report["layer_norms"][str(d)] = entries
    report["hidden_size"] = model.config.hidden_size
    return report


def norms_note(model: nn.Module, norms: list) -> str:
    """What the norm entries mean for this model's family (empty for BERT's post-LN layout with LayerNorms): `norms`
    holds (module, core.norms.NormAffine, placement) triples."""
    parts = []
    if any(not affine.centres for _, affine, _ in norms):
        parts.append("RMSNorm: traced like a LayerNorm's gain; it has no bias")
    if any(getattr(module, "weight", None) is None for module, _, _ in norms):
        parts.append("a norm without parameters (OLMo's LayerNorm) has gain 1 on every dim: it cannot single one out")
    if any(isinstance(getattr(module, "weight", None), Tensor) and not _applies_its_weight(module, affine)
           for module, affine, _ in norms):
        parts.append("the gain is the one the norm applies, not its stored weight (Gemma's RMSNorm: 1 + weight)")
    if pre_norm(model):
        parts.append("pre-LN: a norm inside layer l (placement pre) normalises the input of its attention or MLP and "
                     "writes no hidden state")
    if any(placement == "sublayer_output" for _, _, placement in norms):
        parts.append("a norm placed sublayer_output (Gemma 2/3's, OLMo-2's post_*_layernorm) normalises its sub-layer's "
                     "output before the residual stream adds it")
    stack = decoder_stack(model)
    if stack is not None and stack.final_norm is not None:
        parts.append("the final norm (placement final) writes layer L, transformers' last hidden state")
    return "; ".join(parts)


def _applies_its_weight(module: nn.Module, affine) -> bool:
    """The gain read off the norm's forward pass is its stored weight, to float32 rounding of its output (about 1e-7
    of the output's scale, |weight| + |bias|, whatever the weight: a weight near 0 is read as itself plus that, not as
    another gain)."""
    weight = module.weight.detach().float().cpu()
    scale = 1.0 + float(weight.abs().max()) + (float(affine.bias.abs().max()) if affine.bias is not None else 0.0)
    return torch.allclose(affine.gain, weight, rtol=1e-5, atol=1e-5 * scale)


def summarise_origins(report: dict, top: int = 3) -> dict[int, str]:
    """One line per dimension for the terminal: position-row shares and the best LayerNorm ranks, each with its ties
    ("rank 1, tied with 383 other dims"); "top-3" counts the norms where the dim is among the top 3 whichever way ties break, and
    those where it is tied across the top 3's edge are counted apart."""
    lines = {}
    for key, entries in report["layer_norms"].items():
        d = int(key)
        parts = []
        table = report["position_embeddings"]
        if table is not None:
            info = table["dims"][key]
            parts.append(f"PE rows as max {info['share_as_max']:.0%}, as min {info['share_as_min']:.0%}, "
                         f"|col mean| {ranked(info['column_mean_rank'], info.get('column_mean_ties', 0))}")
        gains = [(e["weight_rank"], e.get("weight_ties", 0), e) for e in entries]
        biases = [(e["bias_rank"], e.get("bias_ties", 0), e) for e in entries if "bias_rank" in e]
        for what, ranks in (("gain", gains), ("bias", biases)):
            if ranks:
                rank, ties, entry = min(ranks, key=lambda item: item[:2])
                parts.append(f"LN {what} {ranked(rank, ties)} ({where(entry)})")
        strict = [sum(strictly_top(rank, ties, top) for rank, ties, _ in ranks) for ranks in (gains, biases)]
        edge = [sum(rank <= top < rank + ties for rank, ties, _ in ranks) for ranks in (gains, biases)]
        parts.append(f"top-{top} in {strict[0]}/{len(entries)} gains, {strict[1]}/{len(entries)} biases" +
                     (f" (tied across the top-{top} edge in {edge[0]} gains, {edge[1]} biases)" if any(edge) else ""))
        lines[d] = "; ".join(parts)
    return lines


def where(entry: dict) -> str:
    """"layer 3", or "shared by layers 1-12" for a LayerNorm that several layers run."""
    shared = entry.get("shared_by_layers")
    if shared:
        return f"shared by layers {shared[0]}-{shared[-1]}"
    placement = {"pre": " input norm", "final": " final norm"}.get(entry.get("placement"), "")
    return f"layer {entry['layer']}{placement}"
