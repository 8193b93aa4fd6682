"""Frozen-encoder features for probes, extracted once and cached: token positions and sentence classification.

    python probe.py fit --config configs/probe/position.yaml --data.source data/austen.txt   # via probe.py
    dm = PositionDataModule(source="data/austen.txt", encoder="bert-base-uncased")          # from Python
    dm.prepare_data(); dm.setup("fit")
    dm.spec                                     # FeatureSpec: slots (encoder / random layers), classes, outliers
    features, labels = next(iter(dm.train_dataloader()))   # [slots, items, hidden], [items]

The encoder runs exactly once per sentence in total: the hidden states of every layer are cached (in memory while
all splits' features together fit `max_memory_gb`; the splits beyond it in a memory-mapped file, with a warning) and
every probe of every layer and epoch reads the cache. With `random_baseline`, a randomly initialised encoder of the
same architecture (seeded) runs once too, and its layers are appended as extra slots, so its probes train in the
same run. Outlier dimensions are detected with NeuronStatistics + detect_outliers on the training split's cached
hidden states, unless `outlier_dims` are given.

Splits are by sentence: `val_fraction` and `test_fraction` of `source` (seeded), or, for a `datasets` name, the held
out split `test_split` (glue/sst2's test labels are hidden, so its config tests on `validation`). A batch is
`batch_size` sentences: for positions, all their tokens; for classification, their mean-pooled vectors.
Position labels are token indices in the input (0-indexed, special tokens included unless `exclude_special`);
tokens at positions >= `max_positions` are dropped from the probe and counted. Layers 0..L, 0 = embedding output.
This data module works on one device (the cache lives in this process).
"""

from __future__ import annotations

import re
import shutil
import tempfile
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch
from torch import Tensor
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, SequentialSampler
from tqdm.auto import tqdm

from datamodules.io import DEFAULT_CORPUS, UserError, _pick, iter_records, sample_texts
from lightning_modules.encoder import FrozenEncoder, default_encoder, load_encoder
from metrics.neuron_stats import NeuronStatistics
from metrics.outliers import LayerOutliers, OutlierRule, all_outlier_dims, detect_outliers

SPLITS = ("train", "val", "test")
GIB = 1024 ** 3


@dataclass
class FeatureSpec:
    """What the cached features hold; the probes size themselves from it."""

    encoder: str
    layers: list[int]  # hidden-state layers cached (0 = embedding output)
    hidden_size: int
    num_classes: int
    classes: list  # class names (positions 0..P-1 for the position probe)
    slots: list[tuple[str, int]]  # per feature slot: ("encoder" | "random", layer)
    outlier_dims: list[int]  # detected on the training split, or given
    outlier_source: str  # "detected" or "given"
    outlier_layers: list[LayerOutliers] = field(default_factory=list)
    counts: dict = field(default_factory=dict)  # per split: sentences, items, and more
    majority: dict = field(default_factory=dict)  # majority and chance baselines
    data: dict = field(default_factory=dict)  # source, max_length, special tokens, ... for the report
    seed: int = 0

    @property
    def encoder_slots(self) -> int:
        return sum(kind == "encoder" for kind, _ in self.slots)


class FeatureStore:
    """Features of one split: [items, slots, hidden] float32, in memory or in a memory-mapped file.

    Items of one sentence are contiguous: sentence s owns items offsets[s]:offsets[s + 1].
    """

    def __init__(self, items: int, slots: int, hidden: int, sentences: int, path: Path | None = None) -> None:
        self.path = path
        if path is None:  # slot-major in memory: a batch gather is one index_select, already contiguous
            self.array = torch.empty(slots, items, hidden)
        else:  # item-major on disk: a batch reads whole rows
            self.array = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(items, slots, hidden))
        self.labels = torch.empty(items, dtype=torch.long)
        self.offsets = torch.zeros(sentences + 1, dtype=torch.long)
        self.items = 0
        self.sentences = 0

    def append(self, features: Tensor, labels: Tensor, per_sentence: Tensor) -> None:
        """features [slots, n, hidden], labels [n], per_sentence [sentences in this batch] (items of each)."""
        n, start = features.shape[1], self.items
        if self.path is None:
            self.array[:, start:start + n] = features.float().cpu()
        else:
            self.array[start:start + n] = features.float().cpu().transpose(0, 1).numpy()
        self.labels[start:start + n] = labels.cpu()
        count = len(per_sentence)
        self.offsets[self.sentences + 1:self.sentences + 1 + count] = start + per_sentence.cpu().cumsum(0)
        self.items += n
        self.sentences += count

    def rows(self, sentences: Tensor) -> Tensor:
        """The item indices of the given sentences, in order."""
        starts, ends = self.offsets[sentences], self.offsets[sentences + 1]
        lengths = ends - starts
        base = torch.repeat_interleave(starts - (lengths.cumsum(0) - lengths), lengths)
        return base + torch.arange(int(lengths.sum()))

    def gather(self, rows: Tensor) -> Tensor:
        """[slots, len(rows), hidden]."""
        if self.path is None:
            return self.array.index_select(1, rows)
        return torch.from_numpy(np.ascontiguousarray(self.array[rows.numpy()])).transpose(0, 1).contiguous()

    def features(self) -> Tensor:
        """All features [slots, items, hidden] (a copy when memory-mapped)."""
        return self.gather(torch.arange(self.items))


class SentenceBatches(Dataset):
    """Indexed by a list of sentence ids (from a BatchSampler): (features [slots, items, hidden], labels [items])."""

    def __init__(self, store: FeatureStore) -> None:
        self.store = store

    def __len__(self) -> int:
        return self.store.sentences

    def __getitem__(self, sentences: list[int]) -> tuple[Tensor, Tensor]:
        rows = self.store.rows(torch.as_tensor(sorted(sentences), dtype=torch.long))
        return self.store.gather(rows), self.store.labels[rows]


class ProbeDataModule(pl.LightningDataModule):
    """Reads, splits and encodes the data once; serves cached features. Subclasses say what an item and a label are."""

    item_name: str | None = None  # what an item is, when it is not a sentence

    def __init__(
        self,
        source: str | None = None,
        encoder: str | None = None,
        text_column: str | None = None,
        max_length: int | None = None,
        max_sentences: int = 0,
        batch_size: int = 128,
        encode_batch_size: int = 32,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        test_split: str | None = None,
        layers: list[int] | None = None,
        random_baseline: bool = True,
        outlier_dims: list[int] | None = None,
        min_share: float = OutlierRule.min_share,
        sigma: float = OutlierRule.sigma,
        exclude_special: bool = False,
        max_memory_gb: float = 4.0,
        cache_dir: str | None = None,
        num_workers: int = 0,
        seed: int = 0,
        progress: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["encoder"] if isinstance(encoder, FrozenEncoder) else None)
        self.source, self.encoder, self.text_column = source, encoder, text_column
        self.max_length, self.max_sentences, self.batch_size = max_length, max_sentences, batch_size
        self.encode_batch_size, self.val_fraction, self.test_fraction = encode_batch_size, val_fraction, test_fraction
        self.test_split, self.layers, self.random_baseline = test_split, layers, random_baseline
        self.outlier_dims, self.rule = outlier_dims, OutlierRule(min_share=min_share, sigma=sigma)
        self.exclude_special, self.max_memory_gb, self.cache_dir = exclude_special, max_memory_gb, cache_dir
        self.num_workers, self.seed, self.progress = num_workers, seed, progress
        self.spec: FeatureSpec | None = None
        self.stores: dict[str, FeatureStore] = {}
        self.texts: dict[str, list[str]] = {}  # per split, in the stores' sentence order
        self._cleanups: list[weakref.finalize] = []

    def close(self) -> None:
        """Remove the memory-mapped cache files, if any (also done at interpreter exit); in-memory features stay."""
        self.stores = {split: store for split, store in self.stores.items() if store.path is None}
        for cleanup in self._cleanups:
            cleanup()
        self._cleanups = []

    # ---- subclass hooks -------------------------------------------------------------------------------------------
    def read_split(self, source: str, split: str | None) -> tuple[list[str], list]:
        """(texts, raw labels) of a source."""
        raise NotImplementedError

    def set_classes(self, labels: dict[str, list]) -> tuple[list, dict[str, Tensor]]:
        """(class names, label tensor per split); sentence-level labels for classification, none for positions."""
        raise NotImplementedError

    def items_of(self, batch, mask: Tensor) -> Tensor:
        """[batch, seq] bool: the tokens that become items (for pooling or as tokens)."""
        return mask

    def pool(self, hidden: Tensor, keep: Tensor, rows: Tensor, sentence_labels: Tensor | None
             ) -> tuple[Tensor, Tensor, Tensor]:
        """hidden [layers, batch, seq, hidden], keep [batch, seq] (False outside `rows`), rows [sentences] of the
        batch, their labels → (features [layers, n, hidden], labels [n], items per sentence [sentences])."""
        raise NotImplementedError

    # ---- Lightning hooks ------------------------------------------------------------------------------------------
    def prepare_data(self) -> None:
        # Single device (checked): the cache lives in this process, so extraction here also fails fast on bad input
        # before any logger or checkpoint directory is created.
        self._prepare()

    def setup(self, stage: str | None = None) -> None:
        self._prepare()

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return self._loader("train", RandomSampler(range(self.stores["train"].sentences), generator=generator))

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", SequentialSampler(range(self.stores["val"].sentences)))

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", SequentialSampler(range(self.stores["test"].sentences)))

    def _loader(self, split: str, sampler) -> DataLoader:
        on_cuda = self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"
        return DataLoader(SentenceBatches(self.stores[split]), batch_size=None,
                          sampler=BatchSampler(sampler, self.batch_size, drop_last=False),
                          num_workers=self.num_workers, pin_memory=on_cuda)

    # ---- the one pass ---------------------------------------------------------------------------------------------
    def _prepare(self) -> None:
        if self.spec is not None:
            return
        if self.trainer is not None and self.trainer.world_size > 1:
            raise UserError("probe.py trains on one device (the feature cache lives in one process): "
                            "use --trainer.devices 1")
        self._check_arguments()
        texts, raw_labels = self.read_splits()
        classes, labels = self.set_classes(raw_labels)
        encoders = self._encoders()
        primary = encoders[0]
        layers = self._layers(primary)
        slots = [(kind, layer) for kind in ("encoder", "random")[:len(encoders)] for layer in layers]
        stats = NeuronStatistics(len(layers), primary.hidden_size).to(primary.device)
        counts, num_truncated = self._encode(encoders, texts, labels, layers, stats, len(slots))
        self.check_counts(counts)
        outlier_layers = detect_outliers(stats.compute(), self.rule)
        if self.outlier_dims is not None:
            bad = [d for d in self.outlier_dims if not 0 <= d < primary.hidden_size]
            if bad:
                raise UserError(f"outlier dims {bad} out of range 0..{primary.hidden_size - 1}")
            outlier_dims, outlier_source = sorted(set(self.outlier_dims)), "given"
        else:
            outlier_dims, outlier_source = all_outlier_dims(outlier_layers), "detected"
        for layer in outlier_layers:  # report the hidden-state layer, not the index into the cached subset
            layer.layer = layers[layer.layer]
        self.spec = FeatureSpec(
            encoder=primary.name, layers=layers, hidden_size=primary.hidden_size, num_classes=len(classes),
            classes=classes, slots=slots, outlier_dims=outlier_dims, outlier_source=outlier_source,
            outlier_layers=outlier_layers, counts=counts, majority=self._majority(len(classes)), seed=self.seed,
            data={"source": str(self.source), "test_split": self.test_split if _is_hub_name(str(self.source)) else None,
                  "max_length": self.max_length or primary.max_length, "num_truncated": num_truncated,
                  "special_tokens": "excluded" if self.exclude_special else "included", **self.describe()},
        )
        del encoders
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _check_arguments(self) -> None:
        for name in ("batch_size", "encode_batch_size"):
            if getattr(self, name) < 1:
                raise UserError(f"--data.{name} must be at least 1, got {getattr(self, name)}")
        if self.max_sentences < 0:
            raise UserError(f"--data.max_sentences must be 0 (all) or positive, got {self.max_sentences}")
        if not (0 <= self.val_fraction < 1 and 0 <= self.test_fraction < 1 and self.val_fraction + self.test_fraction < 1):
            raise UserError(f"--data.val_fraction {self.val_fraction} and --data.test_fraction {self.test_fraction} "
                            "must be in [0, 1) and sum below 1")
        if self.max_memory_gb <= 0:
            raise UserError(f"--data.max_memory_gb must be positive, got {self.max_memory_gb}")

    def read_splits(self) -> tuple[dict[str, list[str]], dict[str, list]]:
        """Texts and raw labels per split: a held-out `test_split` of a datasets name, else seeded fractions."""
        if self.source is None:
            raise UserError("no data source: pass --data.source (a file, a datasets directory or a datasets name)")
        source = str(self.source)
        held_out = self.test_split is not None and _is_hub_name(source)
        if self.test_split is not None and not held_out:
            warnings.warn(f"--data.test_split {self.test_split!r} applies to datasets names only; the test set is "
                          f"carved out of {source} by --data.test_fraction", stacklevel=2)
        texts, labels = self.read_split(source, None)
        texts, labels = self._sample(texts, labels)
        n = len(texts)
        permutation = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed)).tolist()
        n_test = 0 if held_out else round(n * self.test_fraction)
        n_val = round(n * self.val_fraction)
        parts = {"test": permutation[:n_test], "val": permutation[n_test:n_test + n_val],
                 "train": permutation[n_test + n_val:]}
        split_texts = {name: [texts[i] for i in sorted(rows)] for name, rows in parts.items()}
        split_labels = {name: [labels[i] for i in sorted(rows)] for name, rows in parts.items()}
        if held_out:
            name, config, _ = (source.split(":") + [None, None])[:3]
            test_source = f"{name}:{config or ''}:{self.test_split}"
            split_texts["test"], split_labels["test"] = self._sample(*self.read_split(test_source, self.test_split))
        for split in SPLITS:
            if not split_texts[split]:
                raise UserError(f"the {split} split is empty: {n} sentences in {source} with "
                                f"val_fraction={self.val_fraction}, test_fraction={self.test_fraction}"
                                + (f", test split {self.test_split!r}" if held_out else ""))
        return split_texts, split_labels

    def _sample(self, texts: list[str], labels: list) -> tuple[list[str], list]:
        if not self.max_sentences or len(texts) <= self.max_sentences:
            return texts, labels
        keep = sample_texts(iter(range(len(texts))), self.max_sentences, self.seed)
        return [texts[i] for i in keep], [labels[i] for i in keep]

    def _encoders(self) -> list[FrozenEncoder]:
        device = self.trainer.strategy.root_device if self.trainer is not None else None
        if isinstance(self.encoder, FrozenEncoder):
            primary = self.encoder
        else:
            primary = load_encoder(self.encoder or default_encoder(), device=device,
                                   exclude_special=self.exclude_special)
        primary.check_max_length(self.max_length)
        encoders = [primary]
        if self.random_baseline:
            encoders.append(random_encoder(primary, self.seed))
        return encoders

    def _layers(self, encoder: FrozenEncoder) -> list[int]:
        if self.layers is None:
            return list(range(encoder.num_hidden_states))
        bad = [layer for layer in self.layers if not 0 <= layer < encoder.num_hidden_states]
        if bad or not self.layers:
            raise UserError(f"--data.layers {self.layers}: layers run 0..{encoder.num_hidden_states - 1} "
                            "(0 = embedding output)")
        return sorted(set(self.layers))

    def _tokenize(self, encoder: FrozenEncoder, texts: list[str]) -> list[dict]:
        """Padded inputs per batch of `encode_batch_size` sentences; the truncated count is kept in each."""
        batches = []
        for start in range(0, len(texts), self.encode_batch_size):
            inputs, truncated = encoder.tokenize(texts[start:start + self.encode_batch_size], self.max_length)
            batches.append({**inputs, "num_truncated": truncated})
        return batches

    def _store_paths(self, nbytes: dict[str, int]) -> dict[str, Path | None]:
        """Where each split's features live: None (memory) or a memory-mapped file. `max_memory_gb` bounds all
        splits together: in SPLITS order (train, val, test: the most read first), a split stays in memory while the
        running total of the in-memory splits fits the budget; the others stream from disk, with one warning."""
        budget, total, paths = self.max_memory_gb * GIB, 0, {}
        for split in SPLITS:
            if total + nbytes[split] <= budget:
                total += nbytes[split]
                paths[split] = None
        streamed = [split for split in SPLITS if split not in paths]
        if not streamed:
            return paths
        root = Path(self.cache_dir or (self.trainer.default_root_dir if self.trainer is not None else tempfile.gettempdir()))
        root.mkdir(parents=True, exist_ok=True)
        directory = Path(tempfile.mkdtemp(prefix=".features-", dir=root))
        self._cleanups.append(weakref.finalize(self, shutil.rmtree, directory, True))  # at close() or exit
        sizes = ", ".join(f"{split} {nbytes[split] / GIB:.2f}" for split in SPLITS)
        warnings.warn(f"features need {sum(nbytes.values()) / GIB:.2f} GiB ({sizes}), over --data.max_memory_gb "
                      f"{self.max_memory_gb}: streaming {', '.join(streamed)} from a memory-mapped file in "
                      f"{directory} (slower)", stacklevel=2)
        return {**paths, **{split: directory / f"{split}.npy" for split in streamed}}

    @torch.no_grad()
    def _encode(self, encoders: Sequence[FrozenEncoder], texts: dict[str, list[str]], labels: dict[str, Tensor],
                layers: list[int], stats: NeuronStatistics, num_slots: int) -> tuple[dict, int]:
        """One pass of every encoder over all sentences of all splits, sorted by length (little padding), each
        batch's rows routed to their split's FeatureStore; NeuronStatistics sees the training rows.
        Returns (counts per split, number of truncated sentences)."""
        primary = encoders[0]
        entries = sorted(((split, i) for split in SPLITS for i in range(len(texts[split]))),
                         key=lambda entry: len(texts[entry[0]][entry[1]]))
        batches = self._tokenize(primary, [texts[split][i] for split, i in entries])
        routes = []  # per batch: {split: row indices in the batch}
        for start in range(0, len(entries), self.encode_batch_size):
            chunk = [split for split, _ in entries[start:start + self.encode_batch_size]]
            routes.append({split: torch.tensor([r for r, s in enumerate(chunk) if s == split], dtype=torch.long)
                           for split in SPLITS if split in chunk})
        keeps = [self.items_of(batch, self._mask(batch)) for batch in batches]
        counts = {split: {"sentences": len(texts[split])} for split in SPLITS}
        for batch, keep, route in zip(batches, keeps, routes):
            for split, rows in route.items():
                extra = {"items": int(self._item_counts(keep[rows]).sum()),
                         **self.split_counts(self._mask(batch)[rows], keep[rows])}
                for key, value in extra.items():
                    counts[split][key] = counts[split].get(key, 0) + value
        paths = self._store_paths({split: counts[split]["items"] * num_slots * primary.hidden_size * 4
                                   for split in SPLITS})  # float32 features of all splits against one budget
        for split in SPLITS:
            order = [i for s, i in entries if s == split]
            self.texts[split] = [texts[split][i] for i in order]  # the store's sentence order
            if split in labels:
                labels[split] = labels[split][order]
            self.stores[split] = FeatureStore(counts[split]["items"], num_slots, primary.hidden_size, len(order),
                                              paths[split])
        done = dict.fromkeys(SPLITS, 0)  # sentences written per split
        bar = tqdm(total=len(entries), unit="sent", desc=f"encoding ({primary.short_name})",
                   disable=not self.progress, dynamic_ncols=True, leave=False)
        with bar:
            for batch, keep, route in zip(batches, keeps, routes):
                inputs = {key: value for key, value in batch.items() if isinstance(value, Tensor)}
                hidden = [self._select(encoder(**inputs).hidden_states, layers) for encoder in encoders]
                for split, rows in route.items():
                    split_keep = torch.zeros_like(keep)  # the items of this split's rows only: no row copies
                    split_keep[rows] = keep[rows]
                    split_keep = split_keep.to(primary.device)
                    split_labels = labels[split][done[split]:done[split] + len(rows)] if split in labels else None
                    parts = []
                    for states in hidden:
                        features, item_labels, per_sentence = self.pool(states, split_keep, rows, split_labels)
                        parts.append(features.float().cpu())
                    if split == "train":
                        stats.update(hidden[0], split_keep)
                    self.stores[split].append(parts[0] if len(parts) == 1 else torch.cat(parts), item_labels,
                                              per_sentence)
                    done[split] += len(rows)
                bar.update(len(batch["input_ids"]))
        item_name = self.item_name
        for split in SPLITS:
            items = counts[split].pop("items")
            if item_name:
                counts[split] = {"sentences": counts[split]["sentences"], item_name: items, **counts[split]}
        return counts, sum(batch["num_truncated"] for batch in batches)

    @staticmethod
    def _select(hidden_states: Tensor, layers: list[int]) -> Tensor:
        """[all layers, batch, seq, hidden] → [chosen layers, ...] (no copy when all are chosen)."""
        if layers == list(range(hidden_states.shape[0])):
            return hidden_states
        return hidden_states[layers]

    def _mask(self, batch: dict) -> Tensor:
        """[batch, seq] bool: tokens that count (not padding; not special tokens when excluded)."""
        mask = batch["attention_mask"].bool()
        if self.exclude_special and "special_tokens_mask" in batch:
            mask &= ~batch["special_tokens_mask"].bool()
        return mask

    def _item_counts(self, keep: Tensor) -> Tensor:
        return keep.sum(1)

    def split_counts(self, mask: Tensor, keep: Tensor) -> dict:
        """Extra counts of some rows: mask [rows, seq] (counted tokens), keep [rows, seq] (the items' tokens)."""
        return {}

    def describe(self) -> dict:
        return {}

    def check_counts(self, counts: dict) -> None:
        """Warn about what the counts reveal (dropped positions, ...)."""

    def _majority(self, num_classes: int) -> dict:
        """Chance (uniform over the classes seen in training) and majority (the most frequent training label)."""
        train, test = self.stores["train"].labels, self.stores["test"].labels
        counts = torch.bincount(train, minlength=num_classes)
        majority = int(counts.argmax())
        return {"chance": 1.0 / int((counts > 0).sum()), "majority": float((test == majority).double().mean()),
                "majority_class": majority}


class PositionDataModule(ProbeDataModule):
    """Token features labelled with their position (0-indexed token index); positions >= max_positions dropped."""

    item_name = "tokens"

    def __init__(self, max_positions: int = 300, **kwargs) -> None:
        super().__init__(**kwargs)
        self.source = self.source or str(DEFAULT_CORPUS)  # the bundled corpus by default
        if max_positions < 2:
            raise UserError(f"--data.max_positions must be at least 2, got {max_positions}")
        self.max_positions = max_positions

    def read_split(self, source: str, split: str | None) -> tuple[list[str], list]:
        texts = []
        for record in iter_records(source):
            text = _pick(record, self.text_column, source)
            if isinstance(text, str) and text.strip():
                texts.append(text.strip())
        if not texts:
            raise UserError(f"no sentences in {source}")
        return texts, [None] * len(texts)

    def set_classes(self, labels: dict[str, list]) -> tuple[list, dict[str, Tensor]]:
        return list(range(self.max_positions)), {}

    def describe(self) -> dict:
        return {"max_positions": self.max_positions}

    def items_of(self, batch, mask: Tensor) -> Tensor:
        positions = torch.arange(mask.shape[1])
        return mask & (positions < self.max_positions)

    def pool(self, hidden: Tensor, keep: Tensor, rows: Tensor, sentence_labels: Tensor | None
             ) -> tuple[Tensor, Tensor, Tensor]:
        positions = torch.arange(keep.shape[1], device=keep.device).expand_as(keep)
        return hidden[:, keep], positions[keep], keep.sum(1)[rows.to(keep.device)]

    def split_counts(self, mask: Tensor, keep: Tensor) -> dict:
        return {"dropped_positions": int((mask & ~keep).sum())}

    def check_counts(self, counts: dict) -> None:
        dropped = sum(split["dropped_positions"] for split in counts.values())
        if dropped:
            warnings.warn(f"{dropped} tokens at positions >= --data.max_positions {self.max_positions} are left out "
                          "of the probe (counted in the report as dropped_positions)", stacklevel=2)


class ClassificationDataModule(ProbeDataModule):
    """Mean-pooled sentence vectors (padding excluded) with their labels; classes inferred or fixed by `classes`."""

    def __init__(self, label_column: str = "label", classes: list[str | int] | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.label_column = label_column
        self.classes = [normalise_label(c) for c in classes] if classes is not None else None
        if self.classes is not None and len(set(self.classes)) != len(self.classes):
            raise UserError(f"--data.classes {classes} has duplicates")
        if self.classes is not None and len(self.classes) < 2:
            raise UserError(f"--data.classes needs at least two classes, got {classes}")

    def read_split(self, source: str, split: str | None) -> tuple[list[str], list]:
        texts, labels, blank = [], [], 0
        for row, record in enumerate(iter_records(source), 1):
            if self.label_column not in record:
                raise UserError(f"no label column {self.label_column!r} in {source} (columns: {sorted(record)}); "
                                "pass --data.label_column")
            text, label = _pick(record, self.text_column, source), normalise_label(record[self.label_column])
            if label is None:
                raise UserError(f"{source}: row {row} has no label (column {self.label_column!r})")
            if not isinstance(text, str) or not text.strip():
                blank += 1
                continue
            texts.append(text.strip())
            labels.append(label)
        if blank:
            warnings.warn(f"{blank} rows of {source} have no text and were skipped", stacklevel=2)
        if not texts:
            raise UserError(f"no labelled texts in {source}")
        return texts, labels

    def set_classes(self, labels: dict[str, list]) -> tuple[list, dict[str, Tensor]]:
        if self.classes is not None:
            classes, origin = self.classes, "the classes fixed by --data.classes"
        else:
            classes, origin = sort_labels(set(labels["train"])), "the training split's labels"
            if len(classes) < 2:
                raise UserError(f"the training split has a single label {classes}: nothing to classify")
        index = {label: i for i, label in enumerate(classes)}
        tensors = {}
        for split in SPLITS:
            unknown = sorted({str(label) for label in labels[split] if label not in index})
            if unknown:
                raise UserError(f"unknown label(s) {unknown[:5]} in the {split} split: not among {origin} "
                                f"{classes}")
            tensors[split] = torch.tensor([index[label] for label in labels[split]], dtype=torch.long)
        return classes, tensors

    def _item_counts(self, keep: Tensor) -> Tensor:
        return torch.ones(len(keep), dtype=torch.long)

    def pool(self, hidden: Tensor, keep: Tensor, rows: Tensor, sentence_labels: Tensor | None
             ) -> tuple[Tensor, Tensor, Tensor]:
        rows = rows.to(hidden.device)
        weights = keep[rows].to(hidden.dtype)  # [sentences, seq]
        pooled = torch.einsum("lbsh,bs->lbh", hidden[:, rows], weights) / weights.sum(1).clamp_min(1)[None, :, None]
        return pooled, sentence_labels, torch.ones(len(rows), dtype=torch.long)


def normalise_label(value):
    """A label as an int when it is one (1, "1", 1.0, True), else a stripped string; None when missing."""
    if value is None:
        return None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else str(value)
    text = str(value).strip()
    if not text:
        return None
    return int(text) if re.fullmatch(r"[+-]?\d+", text) else text


def sort_labels(labels) -> list:
    if all(isinstance(label, int) for label in labels):
        return sorted(labels)
    return sorted(labels, key=str)


def random_encoder(encoder: FrozenEncoder, seed: int) -> FrozenEncoder:
    """A randomly initialised encoder of the same architecture (transformers' init, seeded), same tokenizer.

    A model whose position table is all zeros (this project's no-PE models) gets a zero table in its twin too.
    """
    from transformers import AutoModel

    parameter = next(encoder.model.parameters())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModel.from_config(encoder.model.config)
    table = _position_table(encoder.model)
    if table is not None and not table.weight.any():
        with torch.no_grad():
            _position_table(model).weight.zero_()
    return FrozenEncoder(model, encoder.tokenizer, name=f"random init of {encoder.name}",
                         exclude_special=encoder.exclude_special).to(device=parameter.device, dtype=parameter.dtype)


def _position_table(model) -> torch.nn.Embedding | None:
    embeddings = getattr(getattr(model, "base_model", model), "embeddings", None)
    table = getattr(embeddings, "position_embeddings", None)
    return table if isinstance(table, torch.nn.Embedding) else None


def _is_hub_name(source: str) -> bool:
    path = Path(source)
    return not path.exists() and len(source.split(":")) < 3
