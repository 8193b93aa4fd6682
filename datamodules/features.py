"""Frozen-encoder features for the probes, extracted in one pass and cached: every layer of every sentence, once.

    extractor = FeatureExtractor(layers=[0, ..., L], batch_size=32, max_memory_gb=4.0)
    result = extractor.extract([encoder, random_twin], texts, labels, task)   # per split; task: what an item is
    extractor.extract([encoder], texts, labels, task, [SoftDecay(-0.2)])      # + slots pooled from SoftDecay's states
    result.stores["train"].gather(items)                # [slots, items, hidden] float32
    result.statistics                                   # NeuronStatistics of the training split's hidden states
    result.storage                                      # how the features are held (dtype, memory or file per split)

The encoders run exactly once per sentence in total, over all splits sorted by length (little padding); each batch's
rows are routed to their split's FeatureStore. Within `max_memory_gb`: float32 when all splits' features fit it,
else float16 (half the bytes; hidden states keep ~3 significant digits); a split stays in memory while the running
total fits, and the splits beyond it go to a memory-mapped file (with one warning), removed by `close()` or at exit;
its directory, `<cache_root>/.features-<host>-<pid>-*` (core.output.new_stage), is removed by the next extraction into
the same cache root when the run that made it was killed (its pid no longer running; a live run's stays).
An SST-2-size position probe (0.7M tokens × 13 layers × 768) is ~14 GiB in float16, twice that with the random
twin's slots (the default): it streams from disk.
Slots: the first encoder's layers, then the next encoder's (the random-init twin's), then the first encoder's again
for each per-sentence variant (metrics.transforms: SoftDecay transforms each sentence's token matrix, so the items
are taken from its states, not transformed afterwards), in `layers` order.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from core.defaults import FEATURE_MEMORY_GB
from core.errors import UserError
from core.output import FEATURES, new_stage
from core.tokenizers import unknown_count, unknown_line
from core.wording import plural
from datamodules.splits import SPLITS
from lightning_modules.encoder import FrozenEncoder, in_text_specials
from metrics.neuron_stats import NeuronStatistics
from metrics.transforms import Variant

GIB = 1024 ** 3


class FeatureStore:
    """Features of one split: [items, slots, hidden] in float32 or float16, in memory or in a memory-mapped file;
    `gather` always returns float32.

    Items of one sentence are contiguous: sentence s owns items offsets[s]:offsets[s + 1].
    """

    def __init__(self, items: int, slots: int, hidden: int, sentences: int, path: Path | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        self.path, self.dtype = path, dtype
        if path is None:  # slot-major in memory: a batch gather is one index_select, already contiguous
            self.array = torch.empty(slots, items, hidden, dtype=dtype)
        else:  # item-major on disk: a batch reads whole rows
            numpy_dtype = np.float16 if dtype == torch.float16 else np.float32
            self.array = np.lib.format.open_memmap(path, mode="w+", dtype=numpy_dtype, shape=(items, slots, hidden))
        self.labels = torch.empty(items, dtype=torch.long)
        self.types = torch.empty(items, dtype=torch.long)  # each item's type (token id, sentence key): control tasks
        self.control: Tensor | None = None  # each item's control-task label (metrics/control.py), when set
        self.offsets = torch.zeros(sentences + 1, dtype=torch.long)
        self.items = 0
        self.sentences = 0

    def append(self, features: Tensor, labels: Tensor, per_sentence: Tensor, types: Tensor) -> None:
        """features [slots, n, hidden], labels [n], per_sentence [sentences in this batch] (items of each), types [n]."""
        n, start = features.shape[1], self.items
        if self.path is None:
            self.array[:, start:start + n] = features.to(self.dtype).cpu()
        else:
            self.array[start:start + n] = features.to(self.dtype).cpu().transpose(0, 1).numpy()
        self.labels[start:start + n] = labels.cpu()
        self.types[start:start + n] = types.cpu()
        count = len(per_sentence)
        self.offsets[self.sentences + 1:self.sentences + 1 + count] = start + per_sentence.cpu().cumsum(0)
        self.items += n
        self.sentences += count

    def gather(self, rows: Tensor) -> Tensor:
        """[slots, len(rows), hidden] float32 of items `rows` (sorted rows read a memory-mapped file in order)."""
        if self.path is None:
            return self.array.index_select(1, rows).float()
        return torch.from_numpy(np.ascontiguousarray(self.array[rows.numpy()])).float().transpose(0, 1).contiguous()

    def features(self) -> Tensor:
        """All features [slots, items, hidden] (a copy when memory-mapped)."""
        return self.gather(torch.arange(self.items))


class ItemBatches(Dataset):
    """Indexed by a list of item ids (from a BatchSampler): (features [slots, items, hidden], labels [items]), and the
    items' control-task labels [items] third when the store has them (metrics/control.py). An item
    is a token vector for the position probe (a batch draws tokens across sentences), a pooled sentence for the
    classifiers. With `step` (the training loader's blocks), the ids are several consecutive optimizer batches of
    `step` items each: each batch's rows are sorted on their own and stay in their place, so the block's items
    [i * step, (i + 1) * step) are batch i's items, whatever the others hold."""

    def __init__(self, store: FeatureStore, step: int | None = None) -> None:
        self.store, self.step = store, step

    def __len__(self) -> int:
        return self.store.items

    def __getitem__(self, items: list[int]) -> tuple[Tensor, ...]:
        ids = torch.as_tensor(items, dtype=torch.long)
        if self.step is None or len(ids) <= self.step:
            rows = ids.sort().values
        else:  # one sort, keyed first by the batch each id belongs to
            batch = torch.arange(len(ids)) // self.step
            rows = (batch * self.store.items + ids).sort().values - batch * self.store.items
        batch = (self.store.gather(rows), self.store.labels[rows])
        return batch if self.store.control is None else (*batch, self.store.control[rows])


class ProbeTask(Protocol):
    """What an item and its label are (the position probe: tokens and positions; classifiers: pooled sentences)."""

    item_name: str | None

    def items_of(self, mask: Tensor) -> Tensor:
        """mask [batch, seq] (the tokens that count) → [batch, seq] bool: the tokens that make the items."""

    def item_counts(self, keep: Tensor) -> Tensor:
        """keep [rows, seq] → [rows]: items per sentence."""

    def pool(self, hidden: Tensor, keep: Tensor, rows: Tensor, sentence_labels: Tensor | None
             ) -> tuple[Tensor, Tensor, Tensor]:
        """hidden [layers, batch, seq, hidden], keep [batch, seq] (False outside `rows`), rows [sentences] of the
        batch, their labels → (features [layers, n, hidden], labels [n], items per sentence [sentences])."""

    def split_counts(self, mask: Tensor, keep: Tensor) -> dict:
        """Extra counts of some rows: mask [rows, seq] (counted tokens), keep [rows, seq] (the items' tokens)."""

    def item_types(self, input_ids: Tensor, keep: Tensor, rows: Tensor, texts: list[str]) -> Tensor:
        """[n]: the type of each item `pool` makes (input_ids [batch, seq], keep and rows as there, texts the
        batch's): what its control-task label is a function of (metrics/control.py)."""


@dataclass
class Extracted:
    stores: dict[str, FeatureStore]
    texts: dict[str, list[str]]  # per split, in the stores' sentence order
    labels: dict[str, Tensor]  # per split (classification), in the same order
    counts: dict[str, dict]  # per split: sentences, items (under the task's item name), and the task's counts
    num_truncated: int
    statistics: NeuronStatistics  # of the first encoder's hidden states on the training split
    storage: dict  # {"dtype", "gib", "splits": {split: "memory" | "memory-mapped file"}}: how the features are held
    num_special_in_text: int = 0  # special tokens written in the sentences (excluded with exclude_special)
    num_unknown: int = 0  # the tokenizer's unknown tokens ([UNK]) in the sentences


class FeatureExtractor:
    """One pass of every encoder over all sentences of all splits into FeatureStores (see the module docstring)."""

    def __init__(self, layers: list[int], batch_size: int = 32, max_length: int | None = None,
                 exclude_special: bool = False, max_memory_gb: float = FEATURE_MEMORY_GB,
                 cache_root: str | Path | None = None, progress: bool = True,
                 memory_option: str = "--data.max_memory_gb") -> None:
        self.layers, self.batch_size, self.max_length = layers, batch_size, max_length
        self.memory_option = memory_option  # how the entry point names max_memory_gb (in its refusal and warning)
        self.exclude_special, self.max_memory_gb, self.cache_root = exclude_special, max_memory_gb, cache_root
        self.progress = progress
        self._cleanups: list[weakref.finalize] = []  # memory-mapped files live as long as this extractor

    def close(self) -> None:
        """Remove the memory-mapped files, if any (also done at interpreter exit)."""
        for cleanup in self._cleanups:
            cleanup()
        self._cleanups = []

    def mask(self, batch: dict, special: Tensor | None = None) -> Tensor:
        """[batch, seq] bool: tokens that count (not padding; not special tokens when excluded: those the tokenizer
        added and, with `special` ([n] ids, FrozenEncoder.special_ids), those written in the text)."""
        mask = batch["attention_mask"].bool()
        if self.exclude_special and "special_tokens_mask" in batch:
            mask &= ~batch["special_tokens_mask"].bool()
            if special is not None:
                mask &= ~in_text_specials(batch["input_ids"], batch["attention_mask"], None, special)
        return mask

    @torch.no_grad()
    def extract(self, encoders: Sequence[FrozenEncoder], texts: dict[str, list[str]], labels: dict[str, Tensor],
                task: ProbeTask, variants: Sequence[Variant] = ()) -> Extracted:
        """Features of `texts` (per split) from every encoder, and from the first encoder's states as each
        per-sentence variant transforms them (`variants`); `labels` (per split, classification) are reordered with
        the sentences (sorted by length)."""
        primary, num_slots = encoders[0], (len(encoders) + len(variants)) * len(self.layers)
        entries = sorted(((split, i) for split in SPLITS for i in range(len(texts[split]))),
                         key=lambda entry: len(texts[entry[0]][entry[1]]))
        ordered = [texts[split][i] for split, i in entries]
        batches = [primary.tokenize(ordered[start:start + self.batch_size], self.max_length)
                   for start in range(0, len(ordered), self.batch_size)]
        routes = []  # per batch: {split: row indices in the batch}
        for start in range(0, len(entries), self.batch_size):
            chunk = [split for split, _ in entries[start:start + self.batch_size]]
            routes.append({split: torch.tensor([r for r, s in enumerate(chunk) if s == split], dtype=torch.long)
                           for split in SPLITS if split in chunk})
        special = primary.special_ids
        keeps = [task.items_of(self.mask(inputs, special)) for inputs, _ in batches]
        in_text = sum(int(in_text_specials(inputs["input_ids"], inputs["attention_mask"],
                                           inputs.get("special_tokens_mask"), special).sum()) for inputs, _ in batches)
        unknown = sum(unknown_count(inputs["input_ids"], inputs["attention_mask"], primary.unknown_id)
                      for inputs, _ in batches)
        counts = {split: {"sentences": len(texts[split])} for split in SPLITS}
        for (inputs, _), keep, route in zip(batches, keeps, routes):
            for split, rows in route.items():
                extra = {"items": int(task.item_counts(keep[rows]).sum()),
                         **task.split_counts(self.mask(inputs, special)[rows], keep[rows])}
                for key, value in extra.items():
                    counts[split][key] = counts[split].get(key, 0) + value
        numbers = {split: counts[split]["items"] * num_slots * primary.hidden_size for split in SPLITS}
        paths, dtype = self.store_paths(numbers)  # all splits' features against one budget
        stores, ordered_texts, ordered_labels = {}, {}, {}
        for split in SPLITS:
            order = [i for s, i in entries if s == split]
            ordered_texts[split] = [texts[split][i] for i in order]
            if split in labels:
                ordered_labels[split] = labels[split][order]
            stores[split] = FeatureStore(counts[split]["items"], num_slots, primary.hidden_size, len(order),
                                         paths[split], dtype)
        statistics = NeuronStatistics(len(self.layers), primary.hidden_size).to(primary.device)
        done = dict.fromkeys(SPLITS, 0)  # sentences written per split
        bar = tqdm(total=len(entries), unit="sent", desc=f"encoding ({primary.short_name})",
                   disable=not self.progress, dynamic_ncols=True, leave=False)
        with bar:
            for number, ((inputs, _), keep, route) in enumerate(zip(batches, keeps, routes)):
                batch_texts = ordered[number * self.batch_size:(number + 1) * self.batch_size]
                hidden = [self.select(encoder(**inputs).hidden_states) for encoder in encoders]
                hidden += [variant.states(hidden[0], self.mask(inputs, special)) for variant in variants]  # per sentence
                for split, rows in route.items():
                    split_keep = torch.zeros_like(keep)  # the items of this split's rows only: no row copies
                    split_keep[rows] = keep[rows]
                    split_keep = split_keep.to(primary.device)
                    sentence_labels = ordered_labels[split][done[split]:done[split] + len(rows)] \
                        if split in ordered_labels else None
                    parts = []
                    for states in hidden:
                        features, item_labels, per_sentence = task.pool(states, split_keep, rows, sentence_labels)
                        parts.append(features.float().cpu())
                    self.check_range(parts, dtype, sum(numbers.values()))
                    if split == "train":
                        statistics.update(hidden[0], split_keep)
                    types = task.item_types(inputs["input_ids"].to(split_keep.device), split_keep, rows, batch_texts)
                    stores[split].append(parts[0] if len(parts) == 1 else torch.cat(parts), item_labels, per_sentence,
                                         types)
                    done[split] += len(rows)
                bar.update(len(inputs["input_ids"]))
        for split in SPLITS:
            items = counts[split].pop("items")
            if task.item_name:
                counts[split] = {"sentences": counts[split]["sentences"], task.item_name: items, **counts[split]}
        truncated = sum(truncated for _, truncated in batches)
        if truncated:  # said as analyze.py says them (the report's num_truncated and num_unknown count them too)
            warnings.warn(f"{plural(truncated, 'sentence was', 'sentences were')} longer than "
                          f"{self.max_length or primary.max_length} tokens and were truncated (counted in the report as "
                          "num_truncated)", stacklevel=2)
        if unknown:
            warnings.warn(unknown_line(unknown, sum(int(inputs["attention_mask"].sum()) for inputs, _ in batches)),
                          stacklevel=2)
        storage = {"dtype": str(dtype).removeprefix("torch."),
                   "gib": round(sum(numbers.values()) * dtype.itemsize / GIB, 4),
                   "splits": {split: "memory" if paths[split] is None else "memory-mapped file" for split in SPLITS}}
        return Extracted(stores, ordered_texts, ordered_labels, counts, truncated, statistics, storage, in_text, unknown)

    def check_range(self, parts: list[Tensor], dtype: torch.dtype, values: int) -> None:
        """Features held in float16 must fit its range: a hidden state past 65504 (a massive activation of a large
        model) would be cached as inf, and every probe reading it would train to nan, silently. One line instead, with
        the budget that keeps them in float32 (`values`: the features of all splits)."""
        if dtype != torch.float16:
            return
        peak = max((float(part.abs().amax()) for part in parts if part.numel()), default=0.0)
        if peak > torch.finfo(torch.float16).max:
            need = values * 4 / GIB
            raise UserError(f"hidden states reach |x| = {peak:.4g}, past float16's largest value (65504): the features "
                            f"({need:.2f} GiB in float32) are over {self.memory_option} {self.max_memory_gb}, so they "
                            f"would be held in float16, as inf; give {self.memory_option} {math.ceil(need * 100) / 100} "
                            "or more to hold them in float32")

    def select(self, hidden_states: Tensor) -> Tensor:
        """[all layers, batch, seq, hidden] → [chosen layers, ...] (no copy when all are chosen)."""
        if self.layers == list(range(hidden_states.shape[0])):
            return hidden_states
        return hidden_states[self.layers]

    def store_paths(self, numbers: dict[str, int]) -> tuple[dict[str, Path | None], torch.dtype]:
        """(where each split's features live: None (memory) or a memory-mapped file; their dtype), for `numbers`
        feature values per split. `max_memory_gb` bounds all splits together: float32 when all of them fit, else
        float16; in SPLITS order (train, val, test: the most read first), a split stays in memory while the running
        total of the in-memory splits fits the budget; the others stream from disk, with one warning."""
        dtype = torch.float32 if sum(numbers.values()) * 4 <= self.max_memory_gb * GIB else torch.float16
        nbytes = {split: number * dtype.itemsize for split, number in numbers.items()}
        budget, total, paths = self.max_memory_gb * GIB, 0, {}
        for split in SPLITS:
            if total + nbytes[split] <= budget:
                total += nbytes[split]
                paths[split] = None
        streamed = [split for split in SPLITS if split not in paths]
        if not streamed:
            return paths, dtype
        # .features-<host>-<pid>-*: one a killed run left here (its pid gone) is removed first, a live run's never
        directory = new_stage(self.cache_root or tempfile.gettempdir(), FEATURES)
        self._cleanups.append(weakref.finalize(self, shutil.rmtree, directory, True))  # at close() or exit
        sizes = ", ".join(f"{split} {nbytes[split] / GIB:.2f}" for split in SPLITS)
        warnings.warn(f"features need {sum(nbytes.values()) / GIB:.2f} GiB in float16 ({sizes}), over "
                      f"{self.memory_option} {self.max_memory_gb}: streaming {', '.join(streamed)} from a "
                      f"memory-mapped file in {directory} (slower)", stacklevel=3)
        return {**paths, **{split: directory / f"{split}.npy" for split in streamed}}, dtype
