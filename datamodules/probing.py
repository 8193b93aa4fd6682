"""Probe data: sentences read and split once, encoded once by the frozen encoder, served as cached features.

    python probe.py fit --config configs/probe/position.yaml --data.source core/corpus/austen.txt   # via probe.py
    dm = PositionDataModule(source="core/corpus/austen.txt", encoder="bert-base-uncased")          # from Python
    dm.prepare_data(); dm.setup("fit")
    dm.spec                                     # FeatureSpec: slots (encoder / random layers), classes, outliers
    features, labels, control = next(iter(dm.train_dataloader()))   # [slots, items, hidden], [items], [items]

The encoder (and with `random_baseline` its seeded random-init twin, as extra slots) runs once per sentence in total
(datamodules/features.py); every probe of every layer and epoch reads the cache. `outlier_dims` are by default the
persistent outliers (detect_outliers on the training split; in at least half the non-input layers: ours). The control
task's labels: metrics/control.py. Splits: datamodules/splits.py. Position labels are token indices in the input
(0-indexed, special tokens included unless `exclude_special`). One device only (the cache lives in this process).
"""

from __future__ import annotations

import warnings

import pytorch_lightning as pl
import torch
from torch import Tensor
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from core.defaults import FEATURE_MEMORY_GB
from core.errors import UserError
from core.wording import plural
from datamodules.features import FeatureExtractor, ItemBatches
from datamodules.sampling import ShuffledBatches
from datamodules.splits import SPLITS, Splits, normalise_label, read_splits, sort_labels, warn_blank_rows
from datamodules.text import DATA_OPTION, DEFAULT_CORPUS, TextColumn, iter_records
from lightning_modules.encoder import FrozenEncoder, default_encoder, load_encoder, random_encoder
from lightning_modules.linear_probes import FeatureSpec
from lightning_modules.pooling import mean_pool
from metrics.control import CONSTRUCTION, control_labels, text_key
from metrics.outliers import OutlierRule, chance_of, detect_outliers, persistent_dims
from metrics.transforms import SOFTDECAY_ALPHA, SoftDecay, check_softdecay_alpha

BLOCK_BYTES = 64 * 2 ** 20  # a training block's float32 features at most (unless one batch is more)
MORE = "more sentences (--data.max_sentences, or a larger --data.source)"  # the chance warning's remedy (ours)


class ProbeDataModule(pl.LightningDataModule):
    """Reads, splits and encodes the data once; serves cached features. Subclasses say what an item and a label are
    (the hooks of datamodules.features.ProbeTask, and read_split / set_classes).

    Args:
        source: a txt/csv/tsv/jsonl file, a datasets directory or NAME[:CONFIG][:SPLIT] (positions: bundled corpus).
        encoder: a hub id, a local directory or this project's export (None: the packaged MiniLM; --model.encoder's).
        text_column: a table's text column (None: detected).
        max_length: tokens per sentence, longer ones truncated (None: the encoder's maximum).
        max_sentences: a seeded sample of this many sentences per split (0: all).
        batch_size: items per optimizer step, drawn across sentences (128: the paper's batch size; that it counts
            token vectors, not sentences, is our reading).
        steps_per_block: training batches served at once, stepped one by one (fewer round trips; a block <= 64 MiB).
        encode_batch_size: sentences per encoder forward in the one extraction pass.
        val_fraction: the share of train carved out as validation (seeded, by sentence) when the source has none.
        test_fraction: the same for a missing or unlabelled test split (a single file: 80/10/10 by default).
        val_split: the source's validation split by name (None: validation, val or dev).
        test_split: the source's test split by name (None: test).
        eval_batch_size: items per validation and test batch.
        layers: the hidden-state layers probed (0 = embedding output; None: all).
        random_baseline: also probe a randomly initialised, seeded encoder of the same architecture (the baseline).
        control_task: also learn the control task and report selectivity (Hewitt & Liang 2019; ours, on by default).
        outlier_dims: the outlier dims (0-indexed) reported and clipped (None: detected on the training split).
        min_share: the outlier rule's argmax or argmin share (the paper's criterion; the number is ours).
        sigma: also a dim whose mean is this many robust SDs off the layer's (ours, opt-in; None: off).
        exclude_special: leave special tokens ([CLS], <s>: their position shows) out of the items (ours; off).
        allow_random_weights: load an encoder whose checkpoint lacks some weights (randomly initialised then;
            default False: refused); probe.py links --model.allow_random_weights to it.
        max_memory_gb: the features' memory budget: float16 when float32 would pass it, then memory-mapped files.
        cache_dir: where memory-mapped features go (None: --trainer.default_root_dir, else the temp directory).
        num_workers: loader worker processes (0: the main process).
        seed: splits, samples, the random encoder, control labels and shuffling (probe.py: --seed_everything).
        progress: a progress bar over the extraction pass.
    """

    item_name: str | None = None  # what an item is, when it is not a sentence
    max_memory_option = "--data.max_memory_gb"  # how the entry point names max_memory_gb (analyze.py: --max_memory_gb)
    type_name = "sentence texts"  # what an item's type is, for the control task

    def __init__(
        self,
        source: str | None = None,
        encoder: str | None = None,
        text_column: str | None = None,
        max_length: int | None = None,
        max_sentences: int = 0,
        batch_size: int = 128,
        steps_per_block: int = 16,
        encode_batch_size: int = 32,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        val_split: str | None = None,
        test_split: str | None = None,
        eval_batch_size: int = 4096,
        layers: list[int] | None = None,
        random_baseline: bool = True,
        control_task: bool = True,
        outlier_dims: list[int] | None = None,
        min_share: float = OutlierRule.min_share,
        sigma: float = OutlierRule.sigma,
        exclude_special: bool = False,
        allow_random_weights: bool = False,
        max_memory_gb: float = FEATURE_MEMORY_GB,
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

    def labelled(self, labels: list) -> bool:
        """Whether a split's raw labels are real (GLUE's test splits hide them: -1); positions need none."""
        return True

    def variants(self) -> list:
        """Per-sentence variants (metrics.transforms.SoftDecay) whose items are cached as extra slots."""
        return []

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
        """Blocks of `steps_per_block` batches of `batch_size` items (token vectors drawn across sentences, or pooled
        sentences), in the order of one seeded shuffle per epoch: the probe takes one optimizer step per batch of the
        block, in order (the same steps as one batch per loader batch, fewer trainer round trips)."""
        batches = ShuffledBatches(self.stores["train"].items, self.hparams.batch_size * self.steps_per_block(),
                                  self.hparams.seed)  # epoch e's order from (seed, e): a resumed run reads the same
        return self._loader("train", batches, None, step=self.hparams.batch_size)

    def steps_per_block(self) -> int:
        """`steps_per_block`, fewer when a block's float32 features would pass BLOCK_BYTES (at least one batch)."""
        store, h = self.stores["train"], self.hparams
        item_bytes = 4 * store.array.shape[0 if store.path is None else 1] * store.array.shape[2]  # slots x hidden
        return max(1, min(h.steps_per_block, BLOCK_BYTES // (item_bytes * h.batch_size)))

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", SequentialSampler(range(self.stores["val"].items)), self.hparams.eval_batch_size)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", SequentialSampler(range(self.stores["test"].items)), self.hparams.eval_batch_size)

    def _loader(self, split: str, sampler, batch_size: int | None, step: int | None = None) -> DataLoader:
        on_cuda = self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"
        return DataLoader(ItemBatches(self.stores[split], step), batch_size=None,  # (batch_size None: batches given)
                          sampler=sampler if batch_size is None else BatchSampler(sampler, batch_size, drop_last=False),
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
        splits = self.read_splits()
        classes, labels = self.set_classes(splits.labels)
        encoders = self._encoders()
        primary = encoders[0]
        layers = self._layers(primary)
        root = h.cache_dir or (self.trainer.default_root_dir if self.trainer is not None else None)
        self.extractor = FeatureExtractor(layers, h.encode_batch_size, h.max_length, h.exclude_special,
                                          h.max_memory_gb, root, h.progress, self.max_memory_option)
        extracted = self.extractor.extract(encoders, splits.texts, labels, self, self.variants())
        self.stores, self.texts = extracted.stores, extracted.texts
        self.check_counts(extracted.counts)
        control = self._control_task(len(classes))
        rule, statistics = OutlierRule(h.min_share, h.sigma), extracted.statistics.compute()  # of the training split
        outlier_layers = detect_outliers(statistics, rule)
        for layer in outlier_layers:  # the hidden-state layer, not the index into the cached subset
            layer.layer = layers[layer.layer]
        chance = chance_of(outlier_layers, statistics.num_tokens, primary.hidden_size, rule, MORE)  # ours
        if h.outlier_dims is not None:
            bad = [d for d in h.outlier_dims if not 0 <= d < primary.hidden_size]
            if bad:
                raise UserError(f"outlier dims {bad} out of range 0..{primary.hidden_size - 1}")
            outlier_dims, outlier_source = sorted(set(h.outlier_dims)), "given"
        else:  # the persistent outliers (metrics/outliers.py: the paper's criterion, our numbers), non-input layers
            outlier_dims, outlier_source = persistent_dims(outlier_layers), "detected"
        self.spec = FeatureSpec(
            encoder=primary.name, layers=layers, hidden_size=primary.hidden_size, num_classes=len(classes),
            num_hidden_states=primary.num_hidden_states, encoder_commit=primary.commit,
            classes=classes, slots=[(kind, layer) for kind in [*("encoder", "random")[:len(encoders)],
                                                               *(variant.key for variant in self.variants())]
                                    for layer in layers],
            outlier_dims=outlier_dims, outlier_source=outlier_source, outlier_layers=outlier_layers,
            outlier_chance_bound=chance["chance_bound"], outlier_chance_warning=chance["chance_warning"], control=control,
            counts=extracted.counts, majority=self._majority(len(classes)), seed=h.seed, batch_size=h.batch_size,
            data={"source": str(h.source), "splits_from": splits.described,
                  "max_length": h.max_length or primary.max_length, "num_truncated": extracted.num_truncated,
                  "num_special_in_text": extracted.num_special_in_text, "num_unknown": extracted.num_unknown,
                  "special_tokens": "excluded" if h.exclude_special else "included", "features": extracted.storage,
                  **self.describe()},
        )
        del encoders
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _check_arguments(self) -> None:
        h = self.hparams
        for name in ("batch_size", "steps_per_block", "encode_batch_size", "eval_batch_size"):
            if h[name] < 1:
                raise UserError(f"--data.{name} must be at least 1, got {h[name]}")
        if h.max_sentences < 0:
            raise UserError(f"--data.max_sentences must be 0 (all) or positive, got {h.max_sentences}")
        if not (0 <= h.val_fraction < 1 and 0 <= h.test_fraction < 1 and h.val_fraction + h.test_fraction < 1):
            raise UserError(f"--data.val_fraction {h.val_fraction} and --data.test_fraction {h.test_fraction} "
                            "must be in [0, 1) and sum below 1")
        if h.max_memory_gb <= 0:
            raise UserError(f"{self.max_memory_option} must be positive, got {h.max_memory_gb}")

    def read_splits(self) -> Splits:
        """Texts and raw labels per split: the source's own splits when it has them, else seeded fractions
        (datamodules/splits.py)."""
        h = self.hparams
        if h.source is None:
            raise UserError("no data source: pass --data.source (a file, a datasets directory or a datasets name)")
        return read_splits(str(h.source), self.read_split, self.labelled, h.val_fraction, h.test_fraction, h.seed,
                           h.max_sentences, h.val_split, h.test_split)

    def _encoders(self) -> list[FrozenEncoder]:
        h = self.hparams
        device = self.trainer.strategy.root_device if self.trainer is not None else None
        if isinstance(self.encoder, FrozenEncoder):
            primary = self.encoder
        else:
            primary = load_encoder(self.encoder or default_encoder(), device=device, exclude_special=h.exclude_special,
                                   allow_random_weights=h.allow_random_weights,
                                   allow_option="--model.allow_random_weights true")
        primary.check_max_length(h.max_length, "--data.max_length")
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

    def _control_task(self, num_classes: int) -> dict:
        """With `control_task`: every split's control labels, a function of each item's type drawn from the training
        labels' distribution (metrics/control.py); the spec's description of it ({} without)."""
        if not self.hparams.control_task:
            return {}
        distribution = torch.bincount(self.stores["train"].labels, minlength=num_classes)
        for store in self.stores.values():
            store.control = control_labels(store.types[:store.items], distribution, self.hparams.seed)
        return {"construction": CONSTRUCTION, "types": self.type_name, "seed": self.hparams.seed,
                "num_types_train": int(self.stores["train"].types[:self.stores["train"].items].unique().numel())}

    def _majority(self, num_classes: int) -> dict:
        """Chance (uniform over the classes seen in training) and majority (the most frequent training label)."""
        train, test = self.stores["train"].labels, self.stores["test"].labels
        counts = torch.bincount(train, minlength=num_classes)
        majority = int(counts.argmax())
        return {"chance": 1.0 / int((counts > 0).sum()), "majority": float((test == majority).double().mean()),
                "majority_class": majority}


class PositionDataModule(ProbeDataModule):
    """Token features labelled with their position (0-indexed token index); positions >= max_positions dropped.

    Args:
        max_positions: the positions probed, 0..max_positions-1 (default 300); later tokens are left out and counted.
    """

    item_name = "tokens"
    type_name = "token ids"
    max_positions_option: str | None = "--data.max_positions"  # None where no option sets it (analyze.py's probes)

    def __init__(self, max_positions: int = 300, **kwargs) -> None:
        super().__init__(**kwargs)
        if self.hparams.source is None:
            self.hparams.source = str(DEFAULT_CORPUS)  # the bundled corpus by default
        if max_positions < 2:
            raise UserError(f"--data.max_positions must be at least 2, got {max_positions}")
        self.max_positions = max_positions

    def read_split(self, source: str, split: str | None) -> tuple[list[str], list]:
        texts, column = [], TextColumn(self.hparams.text_column, source, DATA_OPTION)
        for record in iter_records(source, split=split):
            if text := column(record):
                texts.append(text)
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

    def item_types(self, input_ids: Tensor, keep: Tensor, rows: Tensor, texts: list[str]) -> Tensor:
        return input_ids[keep]  # the token id of each token, in pool's order

    def check_counts(self, counts: dict) -> None:
        dropped = sum(split["dropped_positions"] for split in counts.values())
        if dropped:
            name = self.max_positions_option or "the position probe's max_positions"
            warnings.warn(f"the probe leaves out {plural(dropped, 'token')} at positions >= {name} "
                          f"{self.max_positions} (counted in the report as dropped_positions)", stacklevel=2)


class ClassificationDataModule(ProbeDataModule):
    """Mean-pooled sentence vectors (padding excluded) with their labels; classes inferred or fixed by `classes`.

    Args:
        label_column: the labels' column (default label).
        classes: fix the classes and their order (None: the training split's labels, sorted).
        normalize: none (default) or softdecay (ours, opt-in): also every layer's sentences pooled from tokenUni's
            SoftDecay of their token matrices, on which the classifiers train too.
        softdecay_alpha: SoftDecay's alpha, in (-1, 0) (default -0.2).
    """

    label_hint = "pass --data.label_column"  # how the entry point names another label column (analyze.py paper: none)

    def __init__(self, label_column: str = "label", classes: list[str | int] | None = None, normalize: str = "none",
                 softdecay_alpha: float = SOFTDECAY_ALPHA, **kwargs) -> None:
        super().__init__(**kwargs)
        if normalize not in ("none", "softdecay"):
            raise UserError(f"--data.normalize must be none or softdecay (the classifiers' per-sentence transform; "
                            f"clipping is --model.clip), got {normalize!r}")
        self.normalize = normalize
        self.softdecay = SoftDecay(check_softdecay_alpha(softdecay_alpha, "--data.softdecay_alpha")) \
            if normalize == "softdecay" else None
        self.label_column = label_column
        self.classes = [normalise_label(c) for c in classes] if classes is not None else None
        if self.classes is not None and len(set(self.classes)) != len(self.classes):
            raise UserError(f"--data.classes {classes} has duplicates")
        if self.classes is not None and len(self.classes) < 2:
            raise UserError(f"--data.classes needs at least two classes, got {classes}")

    def read_split(self, source: str, split: str | None) -> tuple[list[str], list]:
        texts, labels, blank = [], [], 0
        column = TextColumn(self.hparams.text_column, source, DATA_OPTION, (self.label_column,))
        for row, record in enumerate(iter_records(source, split=split), 1):
            if self.label_column not in record:
                raise UserError(f"no label column {self.label_column!r} in {source} (columns: {sorted(record)}); "
                                f"{self.label_hint}")
            text = column(record)
            label = normalise_label(record[self.label_column])
            if label is None:
                raise UserError(f"{source}: row {row} has no label (column {self.label_column!r})")
            if not text:  # None, or nothing visible (TextColumn gives texts stripped)
                blank += 1
                continue
            texts.append(text)
            labels.append(label)
        warn_blank_rows(blank, source)
        if not texts:
            raise UserError(f"no labelled texts in {source}")
        return texts, labels

    def labelled(self, labels: list) -> bool:
        return any(label != -1 for label in labels)  # GLUE's hidden test labels are all -1

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

    def item_types(self, input_ids: Tensor, keep: Tensor, rows: Tensor, texts: list[str]) -> Tensor:
        return torch.tensor([text_key(texts[row]) for row in rows.tolist()], dtype=torch.long)  # a sentence's text

    def variants(self) -> list:
        return [self.softdecay] if self.softdecay is not None else []

    def describe(self) -> dict:
        return {"normalize": self.normalize, **({"softdecay_alpha": self.softdecay.alpha} if self.softdecay else {})}

    def pool(self, hidden: Tensor, keep: Tensor, rows: Tensor, sentence_labels: Tensor | None
             ) -> tuple[Tensor, Tensor, Tensor]:
        rows = rows.to(hidden.device)
        return mean_pool(hidden[:, rows], keep[rows]), sentence_labels, torch.ones(len(rows), dtype=torch.long)

