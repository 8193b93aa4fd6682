"""Train / validation / test splits for the probes: the source's own splits when it has them, else seeded fractions.

    splits = read_splits(source, read, labelled, val_fraction=0.1, test_fraction=0.1, seed=0)
    splits.texts["train"], splits.labels["val"], splits.described["test"]

A source with splits (a `datasets` name such as glue/sst2, or a datasets directory) gives its own: "train", the
validation split ("validation", "val" or "dev") and "test", or the ones `val_split` / `test_split` name. What is
missing is carved, by sentence and seeded, out of train (the copies of a repeated sentence in one split: no test
sentence is also a training one): a missing validation split is `val_fraction` of train; a
test split that is missing or unlabelled (GLUE hides its test labels: `labelled` says no) is replaced by the
validation split, and validation is then carved out of train. A single table (a file, or NAME:CONFIG:SPLIT) is split
`1 - val_fraction - test_fraction` / `val_fraction` / `test_fraction`. `described` says where each split came from,
for the report. `max_sentences` caps each split read (a seeded sample; 0: all). Labels as read are normalised
once for every data module (`normalise_label`: 1, "1", 1.0, "1.0", True and a csv's "True" are the class 1) and
ordered (`sort_labels`).
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from core.errors import UserError
from core.wording import plural
from datamodules.text import sample_texts, split_names

SPLITS = ("train", "val", "test")
VAL_NAMES = ("validation", "val", "dev")

Reader = Callable[[str, "str | None"], "tuple[list[str], list]"]  # (source, split) -> (texts, raw labels)


@dataclass
class Splits:
    texts: dict[str, list[str]] = field(default_factory=dict)
    labels: dict[str, list] = field(default_factory=dict)
    described: dict[str, str] = field(default_factory=dict)
    repeats: int = 0  # carved sentences that repeat another (each kept in the split of its first row)


def read_splits(source: str, read: Reader, labelled: Callable[[list], bool], val_fraction: float = 0.1,
                test_fraction: float = 0.1, seed: int = 0, max_sentences: int = 0, val_split: str | None = None,
                test_split: str | None = None) -> Splits:
    """The three splits of `source` (see the module docstring); an empty split is one line naming it."""
    names = split_names(source)
    splits = Splits()

    def take(split_name: str | None) -> tuple[list[str], list]:
        texts, labels = read(source, split_name)
        return _sample(texts, labels, max_sentences, seed)

    if names is None:
        if val_split is not None or test_split is not None:
            raise UserError(f"--data.val_split / --data.test_split need a source with splits; {source} is a single "
                            "table (a file, or a datasets name with its split): its splits are carved by fraction")
        texts, labels = take(None)
        _carve(splits, texts, labels, {"test": test_fraction, "val": val_fraction}, seed, f"{source}")
    else:
        for option, wanted in (("val_split", val_split), ("test_split", test_split)):
            if wanted is not None and wanted not in names:
                raise UserError(f"dataset {source} has no split {wanted!r} (--data.{option}; splits: {names})")
        if "train" not in names:
            raise UserError(f"dataset {source} has no train split (splits: {names})")
        val_name = val_split or next((name for name in VAL_NAMES if name in names), None)
        test_name = test_split or ("test" if "test" in names else None)
        carve: dict[str, float] = {}
        why = ""
        if test_name is not None:
            splits.texts["test"], splits.labels["test"] = take(test_name)
            splits.described["test"] = f"{source} split {test_name!r}"
            if not labelled(splits.labels["test"]):
                why, test_name = f" (its {test_name!r} split is unlabelled)", None
        if test_name is None:
            if val_name is not None:  # the validation split becomes the test set; validation is carved from train
                splits.texts["test"], splits.labels["test"] = take(val_name)
                splits.described["test"] = f"{source} split {val_name!r}{why}"
                val_name = None
            else:
                carve["test"] = test_fraction
        if val_name is not None:
            splits.texts["val"], splits.labels["val"] = take(val_name)
            splits.described["val"] = f"{source} split {val_name!r}"
        else:
            carve["val"] = val_fraction
        texts, labels = take("train")
        _carve(splits, texts, labels, carve, seed, f"{source} split 'train'")
    for split in SPLITS:
        if not splits.texts.get(split):
            copies = f" ({splits.repeats} of its sentences repeat another, which stay in one split)" \
                if splits.repeats else ""
            raise UserError(f"the {split} split is empty ({splits.described.get(split, split)}): a bigger source or "
                            f"other --data.val_fraction / --data.test_fraction{copies}")
    return splits


def _carve(splits: Splits, texts: list, labels: list, fractions: dict[str, float], seed: int, origin: str) -> None:
    """Carve `fractions` of the sentences (seeded) into the named splits; the rest is train. The copies of a sentence
    (the same text, or pair) go together, where the seeded order puts its first row in the file, so no test or
    validation item is a training item again, and a sentence lands in a split as often as any other, however many
    copies it has (ordered by the first of its copies in the seeded order, a sentence of 50 copies in 1,000 rows led
    that order and went to test for every seed); without repeats, the seeded order alone decides, as before."""
    permutation = torch.randperm(len(texts), generator=torch.Generator().manual_seed(seed)).tolist()
    place = {row: index for index, row in enumerate(permutation)}  # each row's place in the seeded order
    copies: dict = {}  # text -> its rows, in file order: the first one stands for the text
    for row, text in enumerate(texts):
        copies.setdefault(text, []).append(row)
    groups, start, taken = sorted(copies.values(), key=lambda rows: place[rows[0]]), 0, 0.0
    splits.repeats = len(texts) - len(groups)
    for name in ("test", "val"):
        if name not in fractions:
            continue
        count, chosen = round(len(texts) * fractions[name]), []
        while len(chosen) < count and start < len(groups):
            chosen += groups[start]
            start += 1
        rows = sorted(chosen)
        splits.texts[name], splits.labels[name] = [texts[i] for i in rows], [labels[i] for i in rows]
        splits.described[name] = f"{fractions[name]:.0%} of {origin} (seeded, by sentence)"
        taken += fractions[name]
    rows = sorted(row for group in groups[start:] for row in group)
    splits.texts["train"], splits.labels["train"] = [texts[i] for i in rows], [labels[i] for i in rows]
    splits.described["train"] = f"{1 - taken:.0%} of {origin} (seeded, by sentence)" if taken else origin


def _sample(texts: list[str], labels: list, limit: int, seed: int) -> tuple[list[str], list]:
    if not limit or len(texts) <= limit:
        return texts, labels
    keep = sample_texts(iter(range(len(texts))), limit, seed)
    return [texts[i] for i in keep], [labels[i] for i in keep]


def warn_blank_rows(blank: int, source) -> None:
    """The one warning of a labelled source's rows without text, skipped (none when `blank` is 0)."""
    if blank:
        warnings.warn(f"{plural(blank, 'row')} of {source} had no text: skipped", stacklevel=3)


def normalise_label(value):
    """A label as an int when it is one (1, "1", 1.0, "1.0", True, "True"), else a stripped string; None when missing
    (None, an empty cell, a float column's NaN).
    "1.0" is how a csv writes the float 1.0 (pandas' float columns) that JSON, parquet and datasets give as 1.0: the
    class 1 in every format, and the same class as a "1" of the same column. Likewise a boolean: JSON's true, a
    parquet or datasets bool and a csv's True / true / TRUE (pandas, Spark, R write them so) are the class 1, false the
    class 0, in every format (before, a csv's "True" and "False" were two text classes that JSON made 1 and 0)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isnan(value):  # a parquet or datasets float column's missing label
            return None
        return int(value) if value.is_integer() else str(value)
    text = str(value).strip()
    if not text:
        return None
    if text.lower() in ("true", "false"):
        return int(text.lower() == "true")
    whole = re.fullmatch(r"([+-]?\d+)(?:\.0*)?", text)
    return int(whole.group(1)) if whole else text


def sort_labels(labels) -> list:
    """The classes in order: integers numerically, anything else as text."""
    if all(isinstance(label, int) for label in labels):
        return sorted(labels)
    return sorted(labels, key=str)
