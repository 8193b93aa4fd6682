"""Control tasks for probes (Hewitt & Liang, "Designing and Interpreting Probes with Control Tasks", EMNLP 2019):
the same label space and item count as the task, with each item's label a seeded random function of its type.

    types = item_types(...)                                   # [items] int64: a token id, or text_key(sentence)
    control = control_labels(types, distribution, seed=0)     # [items]: one label per type, drawn from distribution
    selectivity(task_accuracy, control_accuracy)              # [layers]: task accuracy - control accuracy

The construction (ours in its details, theirs in kind): every type t (a token id for the position probe, as their
control for a token-level task; the text of a sentence for the sentence classifiers, whose items are sentences) gets
one label, drawn from the task's empirical label distribution on the training split (`distribution`, counts per
class) by inverse transform sampling of u(t) = blake2b(seed, t) / 2^64, a uniform number that depends on the seed and
the type alone. So a control label is a function of the type (every occurrence of a token type, in any split, has the
same one; a probe can only learn it by memorising types) and random otherwise; the label space and the number of
items are the task's. Selectivity, high when the probe reads the task from the representation rather than memorising
types, is the task accuracy minus the control accuracy of the same probe on the same features.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

CONSTRUCTION = ("Hewitt & Liang (2019) control task: each item type (a token id for positions, a sentence's text for "
                "classes) gets one label drawn from the task's empirical training-label distribution, by inverse "
                "transform sampling of blake2b(seed, type) / 2^64 (ours in detail): a function of the type, random "
                "otherwise; the same label space and items as the task")


def text_key(text: str) -> int:
    """A sentence's type as an int64: the first 8 bytes of blake2b of its UTF-8 text (equal texts, equal keys)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little", signed=True)


def uniform_of(types: Tensor, seed: int) -> Tensor:
    """[n] int64 types -> [n] float64 in [0, 1): blake2b(seed, type) / 2^64, per distinct type (computed once each)."""
    distinct, inverse = torch.unique(types.cpu(), return_inverse=True)
    values = [int.from_bytes(hashlib.blake2b(f"{seed}:{int(t)}".encode(), digest_size=8).digest(), "little") / 2 ** 64
              for t in distinct.tolist()]
    return torch.tensor(values, dtype=torch.float64)[inverse]


def control_labels(types: Tensor, distribution: Tensor, seed: int) -> Tensor:
    """types [n] (int64) -> labels [n] (long) in 0..len(distribution)-1: each type's label drawn from `distribution`
    (counts or probabilities per class, at least one positive) by inverse transform sampling of uniform_of."""
    weights = distribution.double().clamp_min(0)
    if not bool(weights.sum() > 0):
        raise ValueError("the label distribution of a control task needs a positive count")
    cdf = weights.cumsum(0) / weights.sum()
    labels = torch.searchsorted(cdf, uniform_of(types, seed), right=True)
    return labels.clamp_max(len(weights) - 1).to(torch.long)  # u below 1 = cdf[-1]; the clamp guards rounding


def selectivity(task_accuracy, control_accuracy) -> list:
    """Per layer: task accuracy - control accuracy (None where either is missing)."""
    return [None if a is None or c is None else a - c for a, c in zip(task_accuracy, control_accuracy)]
