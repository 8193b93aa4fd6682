"""Where outlier dimensions come from (the paper's §3): positional-embedding rows and LayerNorm parameters.

    origins = trace_origins(encoder.model, dims=[223, 63])

For each dimension d:
- position_embeddings: the rows (positions, 0-indexed from the first position a token can take) whose largest or
  smallest value lies on d, their shares of all rows, and d's rank by |column mean| of the table. The whole entry
  is None, with a reason, when the model has no absolute position table, an all-zero one (this project's no-PE
  models), or one narrower than the hidden size (ALBERT's factorised embeddings).
- layer_norms: for every LayerNorm over the hidden size, d's gain and bias and their ranks by magnitude among
  all dimensions (1 = largest), with the hidden-state layer the LayerNorm writes (0 = embeddings).
"""

from __future__ import annotations

import re

from torch import Tensor, nn

from lightning_modules.encoder import model_max_length, position_offset


def rank_by_magnitude(values: Tensor) -> Tensor:
    """rank[d] = 1 + the number of entries with a strictly larger |value| (1 = largest). values: [hidden]."""
    magnitude = values.abs()
    return (magnitude.unsqueeze(0) > magnitude.unsqueeze(1)).sum(1) + 1


def position_table(model: nn.Module) -> tuple[Tensor | None, str]:
    """The rows of the absolute position table a token can actually use, or None and why not."""
    base = getattr(model, "base_model", model)
    embeddings = getattr(base, "embeddings", None)
    table = getattr(embeddings, "position_embeddings", None)
    if not isinstance(table, nn.Embedding):
        return None, "no absolute position-embedding table"
    weight = table.weight.detach().float().cpu()
    if not weight.any():
        return None, "the position-embedding table is all zeros (trained without positional embeddings)"
    if weight.shape[1] != model.config.hidden_size:
        return None, f"position embeddings have width {weight.shape[1]}, not the hidden size"
    offset = position_offset(model)
    return weight[offset: offset + model_max_length(model)], ""


def layer_norms(model: nn.Module) -> list[tuple[str, int, nn.LayerNorm]]:
    """(name, hidden-state layer it writes, module) for each LayerNorm over the hidden size, in model order."""
    hidden = model.config.hidden_size
    found = []
    for name, module in model.named_modules():
        if isinstance(module, nn.LayerNorm) and tuple(module.normalized_shape) == (hidden,):
            match = re.search(r"layers?\.(\d+)\.", name + ".")
            found.append((name, int(match.group(1)) + 1 if match else 0, module))
    return found


def trace_origins(model: nn.Module, dims: list[int]) -> dict:
    """Origins report for `dims`: {"position_embeddings": ..., "layer_norms": ...} (see module docstring)."""
    table, reason = position_table(model)
    report: dict = {"position_embeddings": None, "position_embeddings_note": reason, "layer_norms": {}}
    if table is not None:
        row_max, row_min = table.argmax(1), table.argmin(1)  # [positions]
        column_rank = rank_by_magnitude(table.mean(0))
        report["position_embeddings"] = {
            "num_positions": int(table.shape[0]),
            "dims": {
                str(d): {
                    "positions_as_max": (row_max == d).nonzero().flatten().tolist(),
                    "positions_as_min": (row_min == d).nonzero().flatten().tolist(),
                    "share_as_max": round(float((row_max == d).float().mean()), 6),
                    "share_as_min": round(float((row_min == d).float().mean()), 6),
                    "column_mean": round(float(table[:, d].mean()), 6),
                    "column_mean_rank": int(column_rank[d]),
                }
                for d in dims
            },
        }
    norms = layer_norms(model)
    ranks = [
        (name, layer, rank_by_magnitude(module.weight.detach().float().cpu()),
         rank_by_magnitude(module.bias.detach().float().cpu()) if module.bias is not None else None, module)
        for name, layer, module in norms
    ]
    for d in dims:
        entries = []
        for name, layer, weight_rank, bias_rank, module in ranks:
            entry = {"module": name, "layer": layer, "weight": round(float(module.weight[d]), 6),
                     "weight_rank": int(weight_rank[d])}
            if bias_rank is not None:
                entry.update(bias=round(float(module.bias[d]), 6), bias_rank=int(bias_rank[d]))
            entries.append(entry)
        report["layer_norms"][str(d)] = entries
    report["hidden_size"] = model.config.hidden_size
    return report


def summarise_origins(report: dict, top: int = 3) -> dict[int, str]:
    """One line per dimension for the terminal: position-row shares and the best LayerNorm ranks."""
    lines = {}
    for key, entries in report["layer_norms"].items():
        d = int(key)
        parts = []
        table = report["position_embeddings"]
        if table is not None:
            info = table["dims"][key]
            parts.append(f"PE rows as max {info['share_as_max']:.0%}, as min {info['share_as_min']:.0%}, "
                         f"|col mean| rank {info['column_mean_rank']}")
        best_weight = min(entries, key=lambda e: e["weight_rank"], default=None)
        best_bias = min((e for e in entries if "bias_rank" in e), key=lambda e: e["bias_rank"], default=None)
        if best_weight is not None:
            parts.append(f"LN gain rank {best_weight['weight_rank']} (layer {best_weight['layer']})")
        if best_bias is not None:
            parts.append(f"LN bias rank {best_bias['bias_rank']} (layer {best_bias['layer']})")
        top_weight = sum(e["weight_rank"] <= top for e in entries)
        top_bias = sum(e.get("bias_rank", top + 1) <= top for e in entries)
        parts.append(f"top-{top} in {top_weight}/{len(entries)} gains, {top_bias}/{len(entries)} biases")
        lines[d] = "; ".join(parts)
    return lines
