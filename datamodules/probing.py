"""Probe data: sentences read and split once, encoded once by the frozen encoder, served as cached features.

    python probe.py fit --config configs/probe/position.yaml --data.source data/austen.txt   # via probe.py
    dm = PositionDataModule(source="data/austen.txt", encoder="bert-base-uncased")          # from Python
    dm.prepare_data(); dm.setup("fit")
    dm.spec                                     # FeatureSpec: slots (encoder / random layers), classes, outliers
    features, labels = next(iter(dm.train_dataloader()))   # [slots, items, hidden], [items]

The encoder runs exactly once per sentence in total (datamodules/features.py); every probe of every layer and epoch
reads the cache. With `random_baseline`, a randomly initialised encoder of the same architecture (seeded) runs once
too, and its layers are appended as extra slots, so its probes train in the same run. Outlier dimensions are
detected with NeuronStatistics + detect_outliers on the training split's hidden states, unless `outlier_dims` are
given.

Splits are by sentence: `val_fraction` and `test_fraction` of `source` (seeded), or, for a `datasets` name, the held
out split `test_split` (glue/sst2's test labels are hidden, so its config tests on `validation`). A batch is
`batch_size` sentences: for positions, all their tokens; for classification, their mean-pooled vectors.
Position labels are token indices in the input (0-indexed, special tokens included unless `exclude_special`);
tokens at positions >= `max_positions` are dropped from the probe and counted. Layers 0..L, 0 = embedding output.
This data module works on one device (the cache lives in this process).
"""

from __future__ import annotations

import re
import warnings

import pytorch_lightning as pl
import torch
from torch import Tensor
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

from core.errors import UserError
from core.sources import looks_local
from datamodules.features import SPLITS, FeatureExtractor, SentenceBatches
from datamodules.text import DATA_OPTION, DEFAULT_CORPUS, iter_records, pick_text, sample_texts
from lightning_modules.encoder import FrozenEncoder, default_encoder, load_encoder, random_encoder
from lightning_modules.pooling import mean_pool
from lightning_modules.probes import FeatureSpec
from metrics.outliers import OutlierRule, all_outlier_dims, detect_outliers


class ProbeDataModule(pl.LightningDataModule):
    """Reads, splits and encodes the data once; serves cached features. Subclasses say what an item and a label are
    (the hooks of datamodules.features.ProbeTask, and read_split / set_classes)."""

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
        self.encoder = encoder  # a name (hub id, directory, export) or, from Python, a FrozenEncoder
        self.spec: FeatureSpec | None = None
        self.stores: dict = {}  # per split: a FeatureStore
        self.texts: dict[str, list[str]] = {}  # per split, in the stores' sentence order
        self.extractor: FeatureExtractor | None = None

    def close(self) -> None:
        """Remove the memory-mapped cache files, if any (also done at interpreter exit); in-memory features stay."""
        self.stores = {split: store for split, store in self.stores.items() if store.path is None}
        if self.extractor is not None:
            self.extractor.close()

    # ---- what an item is: subclass hooks (datamodules.features.ProbeTask) -----------------------------------------
    def read_split(self, source: str, split: str | None) -> tuple[list[str], list]:
        """(texts, raw labels) of a source."""
        raise NotImplementedError

    def set_classes(self, labels: dict[str, list]) -> tuple[list, dict[str, Tensor]]:
        """(class names, label tensor per split); sentence-level labels for classification, none for positions."""
        raise NotImplementedError

    def items_of(self, mask: Tensor) -> Tensor:
        return mask

    def item_counts(self, keep: Tensor) -> Tensor:
        return keep.sum(1)

    def split_counts(self, mask: Tensor, keep: Tensor) -> dict:
        return {}

    def describe(self) -> dict:
        return {}

    def check_counts(self, counts: dict) -> None:
        """Warn about what the counts reveal (dropped positions, ...)."""

    # ---- Lightning hooks ------------------------------------------------------------------------------------------
    def prepare_data(self) -> None:
        # Single device (checked): the cache lives in this process, so extraction here also fails fast on bad input
        # before any logger or checkpoint directory is created.
        self._prepare()

    def setup(self, stage: str | None = None) -> None:
        self._prepare()

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.hparams.seed)
        return self._loader("train", RandomSampler(range(self.stores["train"].sentences), generator=generator))

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", SequentialSampler(range(self.stores["val"].sentences)))

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", SequentialSampler(range(self.stores["test"].sentences)))

    def _loader(self, split: str, sampler) -> DataLoader:
        on_cuda = self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"
        return DataLoader(SentenceBatches(self.stores[split]), batch_size=None,
                          sampler=BatchSampler(sampler, self.hparams.batch_size, drop_last=False),
                          num_workers=self.hparams.num_workers, pin_memory=on_cuda)

    # ---- the one pass ---------------------------------------------------------------------------------------------
    def _prepare(self) -> None:
        if self.spec is not None:
            return
        if self.trainer is not None and self.trainer.world_size > 1:
            raise UserError("probe.py trains on one device (the feature cache lives in one process): "
                            "use --trainer.devices 1")
        h = self.hparams
        self._check_arguments()
        texts, raw_labels = self.read_splits()
        classes, labels = self.set_classes(raw_labels)
        encoders = self._encoders()
        primary = encoders[0]
        layers = self._layers(primary)
        root = h.cache_dir or (self.trainer.default_root_dir if self.trainer is not None else None)
        self.extractor = FeatureExtractor(layers, h.encode_batch_size, h.max_length, h.exclude_special,
                                          h.max_memory_gb, root, h.progress)
        extracted = self.extractor.extract(encoders, texts, labels, self)
        self.stores, self.texts = extracted.stores, extracted.texts
        self.check_counts(extracted.counts)
        outlier_layers = detect_outliers(extracted.statistics.compute(), OutlierRule(h.min_share, h.sigma))
        if h.outlier_dims is not None:
            bad = [d for d in h.outlier_dims if not 0 <= d < primary.hidden_size]
            if bad:
                raise UserError(f"outlier dims {bad} out of range 0..{primary.hidden_size - 1}")
            outlier_dims, outlier_source = sorted(set(h.outlier_dims)), "given"
        else:
            outlier_dims, outlier_source = all_outlier_dims(outlier_layers), "detected"
        for layer in outlier_layers:  # report the hidden-state layer, not the index into the cached subset
            layer.layer = layers[layer.layer]
        self.spec = FeatureSpec(
            encoder=primary.name, layers=layers, hidden_size=primary.hidden_size, num_classes=len(classes),
            classes=classes, slots=[(kind, layer) for kind in ("encoder", "random")[:len(encoders)] for layer in layers],
            outlier_dims=outlier_dims, outlier_source=outlier_source, outlier_layers=outlier_layers,
            counts=extracted.counts, majority=self._majority(len(classes)), seed=h.seed,
            data={"source": str(h.source), "test_split": h.test_split if self._held_out() else None,
                  "max_length": h.max_length or primary.max_length, "num_truncated": extracted.num_truncated,
                  "special_tokens": "excluded" if h.exclude_special else "included", **self.describe()},
        )
        del encoders
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _check_arguments(self) -> None:
        h = self.hparams
        for name in ("batch_size", "encode_batch_size"):
            if h[name] < 1:
                raise UserError(f"--data.{name} must be at least 1, got {h[name]}")
        if h.max_sentences < 0:
            raise UserError(f"--data.max_sentences must be 0 (all) or positive, got {h.max_sentences}")
        if not (0 <= h.val_fraction < 1 and 0 <= h.test_fraction < 1 and h.val_fraction + h.test_fraction < 1):
            raise UserError(f"--data.val_fraction {h.val_fraction} and --data.test_fraction {h.test_fraction} "
                            "must be in [0, 1) and sum below 1")
        if h.max_memory_gb <= 0:
            raise UserError(f"--data.max_memory_gb must be positive, got {h.max_memory_gb}")

    def read_splits(self) -> tuple[dict[str, list[str]], dict[str, list]]:
        """Texts and raw labels per split: a held-out `test_split` of a datasets name, else seeded fractions."""
        h = self.hparams
        if h.source is None:
            raise UserError("no data source: pass --data.source (a file, a datasets directory or a datasets name)")
        source = str(h.source)
        held_out = h.test_split is not None and self._held_out()
        if h.test_split is not None and not held_out:
            warnings.warn(f"--data.test_split {h.test_split!r} applies to datasets names only; the test set is "
                          f"carved out of {source} by --data.test_fraction", stacklevel=2)
        texts, labels = self._sample(*self.read_split(source, None))
        n = len(texts)
        permutation = torch.randperm(n, generator=torch.Generator().manual_seed(h.seed)).tolist()
        n_test = 0 if held_out else round(n * h.test_fraction)
        n_val = round(n * h.val_fraction)
        parts = {"test": permutation[:n_test], "val": permutation[n_test:n_test + n_val],
                 "train": permutation[n_test + n_val:]}
        split_texts = {name: [texts[i] for i in sorted(rows)] for name, rows in parts.items()}
        split_labels = {name: [labels[i] for i in sorted(rows)] for name, rows in parts.items()}
        if held_out:
            name, config, _ = (source.split(":") + [None, None])[:3]
            test_source = f"{name}:{config or ''}:{h.test_split}"
            split_texts["test"], split_labels["test"] = self._sample(*self.read_split(test_source, h.test_split))
        for split in SPLITS:
            if not split_texts[split]:
                raise UserError(f"the {split} split is empty: {n} sentences in {source} with "
                                f"val_fraction={h.val_fraction}, test_fraction={h.test_fraction}"
                                + (f", test split {h.test_split!r}" if held_out else ""))
        return split_texts, split_labels

    def _held_out(self) -> bool:
        """Whether the source is a datasets name without a split, whose `test_split` is read as the test set."""
        source = str(self.hparams.source)
        return not looks_local(source) and len(source.split(":")) < 3

    def _sample(self, texts: list[str], labels: list) -> tuple[list[str], list]:
        limit = self.hparams.max_sentences
        if not limit or len(texts) <= limit:
            return texts, labels
        keep = sample_texts(iter(range(len(texts))), limit, self.hparams.seed)
        return [texts[i] for i in keep], [labels[i] for i in keep]

    def _encoders(self) -> list[FrozenEncoder]:
        h = self.hparams
        device = self.trainer.strategy.root_device if self.trainer is not None else None
        if isinstance(self.encoder, FrozenEncoder):
            primary = self.encoder
        else:
            primary = load_encoder(self.encoder or default_encoder(), device=device, exclude_special=h.exclude_special)
        primary.check_max_length(h.max_length)
        return [primary, random_encoder(primary, h.seed)] if h.random_baseline else [primary]

    def _layers(self, encoder: FrozenEncoder) -> list[int]:
        layers = self.hparams.layers
        if layers is None:
            return list(range(encoder.num_hidden_states))
        bad = [layer for layer in layers if not 0 <= layer < encoder.num_hidden_states]
        if bad or not layers:
            raise UserError(f"--data.layers {layers}: layers run 0..{encoder.num_hidden_states - 1} "
                            "(0 = embedding output)")
        return sorted(set(layers))

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
        if self.hparams.source is None:
            self.hparams.source = str(DEFAULT_CORPUS)  # the bundled corpus by default
        if max_positions < 2:
            raise UserError(f"--data.max_positions must be at least 2, got {max_positions}")
        self.max_positions = max_positions

    def read_split(self, source: str, split: str | None) -> tuple[list[str], list]:
        texts = []
        for record in iter_records(source):
            text = pick_text(record, self.hparams.text_column, source, DATA_OPTION)
            if isinstance(text, str) and text.strip():
                texts.append(text.strip())
        if not texts:
            raise UserError(f"no sentences in {source}")
        return texts, [None] * len(texts)

    def set_classes(self, labels: dict[str, list]) -> tuple[list, dict[str, Tensor]]:
        return list(range(self.max_positions)), {}

    def describe(self) -> dict:
        return {"max_positions": self.max_positions}

    def items_of(self, mask: Tensor) -> Tensor:
        return mask & (torch.arange(mask.shape[1]) < self.max_positions)

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
            text, label = pick_text(record, self.hparams.text_column, source, DATA_OPTION), normalise_label(record[self.label_column])
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

    def item_counts(self, keep: Tensor) -> Tensor:
        return torch.ones(len(keep), dtype=torch.long)

    def pool(self, hidden: Tensor, keep: Tensor, rows: Tensor, sentence_labels: Tensor | None
             ) -> tuple[Tensor, Tensor, Tensor]:
        rows = rows.to(hidden.device)
        return mean_pool(hidden[:, rows], keep[rows]), sentence_labels, torch.ones(len(rows), dtype=torch.long)


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
