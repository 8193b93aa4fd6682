"""Fine-tuning data: labelled sentences or sentence pairs, read and split once, tokenised with the encoder's tokenizer.

    python train.py fit --config configs/finetune/classify.yaml --data.source reviews.csv --data.label_column stars
    python train.py fit --config configs/finetune/rte.yaml          # glue/rte: --data.text_pair_column sentence2

Sources are read as everywhere else (datamodules/text.py: a txt/csv/tsv/jsonl file, a datasets directory or name) and
split as the probes' are (datamodules/splits.py: the source's own train / validation / test splits, an unlabelled
test split replaced by validation and validation carved out of train, a single file 80/10/10). The classes are the
training split's labels (or --data.classes); a label of another split that training never shows, or a single class,
is one line. Batches: {"input_ids", "attention_mask" (, "token_type_ids"), "labels"}, padded per batch. Training
batches are drawn as the MLM blocks are (datamodules/sampling.py: one seeded permutation per epoch, rank r taking
every world-th example, the tail that makes no whole global batch dropped), so a global batch holds the same examples
on any number of devices, and the data position is saved in checkpoints and restored exactly
(datamodules/position.py). Test batches are the one-process batches of --data.eval_batch_size consecutive examples,
each read whole by one rank (rank r of w taking batches r, r + w, ...: DealtBatches), so a statistic of each batch is
the same on any number of devices. Validation (Lightning's loop, whose sums over examples no batching changes) gives
rank r every w-th example, so every rank validates: Lightning skips a rank without a batch, and the others' synced
val/loss then waits on it (fewer validation examples than ranks are refused).
"""

from __future__ import annotations

import warnings

import pytorch_lightning as pl
import torch
from torch import Tensor

from core.errors import UserError
from core.tokenizers import truncating_right
from datamodules.position import DataPosition
from datamodules.sampling import BlockSampler, DealtBatches, ResumableLoader
from datamodules.splits import SPLITS, Splits, normalise_label, read_splits, sort_labels, warn_blank_rows
from datamodules.text import DATA_OPTION, TextColumn, iter_records


class Examples(torch.utils.data.Dataset):
    """Tokenised examples; indexed by a list of keys (epoch × n + index, as BlockSampler gives), returns a padded
    batch."""

    def __init__(self, encoded: dict[str, list[list[int]]], labels: Tensor, pad_id: int) -> None:
        self.encoded, self.labels, self.pad_id = encoded, labels, pad_id

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, keys: list[int]) -> dict[str, Tensor]:
        rows = [key % len(self.labels) for key in keys]
        width = max(len(self.encoded["input_ids"][row]) for row in rows)
        batch = {}
        for name, fill in (("input_ids", self.pad_id), ("attention_mask", 0), ("token_type_ids", 0)):
            if name not in self.encoded:
                continue
            tensor = torch.full((len(rows), width), fill, dtype=torch.long)
            for i, row in enumerate(rows):
                values = self.encoded[name][row]
                tensor[i, :len(values)] = torch.as_tensor(values, dtype=torch.long)
            batch[name] = tensor
        batch["labels"] = self.labels[rows]
        return batch


def count_truncated(tokenizer, texts: list[tuple[str, str | None]], ids: list[list[int]], max_length: int) -> int:
    """How many of `texts` (sentence, pair or None) were cut to `max_length`: only an example `max_length` long can
    have been, and those few are tokenised again whole."""
    full = [row for row, example in enumerate(ids) if len(example) >= max_length]
    if not full:
        return 0
    firsts = [texts[row][0] for row in full]
    seconds = [texts[row][1] for row in full] if texts[full[0]][1] is not None else None
    whole = tokenizer(firsts, seconds, truncation=False, verbose=False)["input_ids"]
    return sum(len(example) > max_length for example in whole)


class FineTuneDataModule(pl.LightningDataModule):
    """Labelled sentences (or pairs) for FineTuneModule (see the module docstring).

    Args:
        source: a file with text and label columns, a datasets directory or a datasets NAME[:CONFIG] (required).
        text_column: the text column (None: detected).
        text_pair_column: the second sentence of a pair (None: single sentences).
        label_column: the labels (strings or integers; default label).
        classes: fix the classes and their order (None: the training split's labels, sorted).
        max_length: tokens per example (longer ones are truncated: the pair's longest sentence first).
        batch_size: examples per device and micro-batch.
        global_batch_size: examples per optimizer step over every device; gradient accumulation is derived from it
            (None: batch_size × devices, no accumulation).
        eval_batch_size: examples per validation and test batch.
        val_fraction: the share of train carved out as validation when the source has no validation split (seeded,
            by sentence; datamodules/splits.py).
        test_fraction: the same for a missing or unlabelled test split (a single file: split 80/10/10 by default).
        val_split: the source's validation split by name (None: validation, val or dev).
        test_split: the source's test split by name (None: test).
        max_sentences: a seeded sample of this many examples per split (0: all).
        num_workers: loader worker processes (0: the main process).
        seed: the seed of the splits, the shuffling and C0's sample (its own: --seed_everything does not set it).
    """

    def __init__(
        self,
        source: str | None = None,
        text_column: str | None = None,
        text_pair_column: str | None = None,
        label_column: str = "label",
        classes: list[str | int] | None = None,
        max_length: int = 128,
        batch_size: int = 32,
        global_batch_size: int | None = None,
        eval_batch_size: int = 64,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        val_split: str | None = None,
        test_split: str | None = None,
        max_sentences: int = 0,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        h = self.hparams
        if source is None:
            raise UserError("no data source: pass --data.source (a file with text and label columns, a datasets "
                            "directory or a datasets name)")
        for name in ("max_length", "batch_size", "eval_batch_size"):
            least = 2 if name == "max_length" else 1
            if h[name] < least:
                raise UserError(f"--data.{name} too small: {h[name]} (at least {least})")
        if global_batch_size is not None and (global_batch_size < batch_size or global_batch_size % batch_size):
            raise UserError(f"--data.global_batch_size {global_batch_size} must be a multiple of --data.batch_size "
                            f"{batch_size}")
        if not (0 <= val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
            raise UserError(f"--data.val_fraction {val_fraction} and --data.test_fraction {test_fraction} must be in "
                            "[0, 1) and sum below 1")
        self.fixed = [normalise_label(c) for c in classes] if classes is not None else None
        if self.fixed is not None and (len(set(self.fixed)) != len(self.fixed) or len(self.fixed) < 2):
            raise UserError(f"--data.classes needs at least two distinct classes, got {classes}")
        self._splits: Splits | None = None
        self._classes: list | None = None
        self.labels: dict[str, Tensor] = {}
        self.sets: dict[str, Examples] = {}
        self.tokenizer = None
        self.truncated: dict[str, int] = {}  # per split, the examples cut to max_length (set by attach)
        self.position = DataPosition(batch_size, global_batch_size, streaming=False)

    # -- reading, once (the model's head needs the classes: train.py links them, so bad data is found first) --

    def read(self, source: str, split: str | None) -> tuple[list[tuple[str, str | None]], list]:
        h = self.hparams
        texts, labels, blank = [], [], 0
        column = TextColumn(h.text_column, source, DATA_OPTION, (h.label_column, h.text_pair_column))
        pair_column = TextColumn(h.text_pair_column, source, "--data.text_pair_column")
        for row, record in enumerate(iter_records(source, split=split), 1):
            if h.label_column not in record:
                raise UserError(f"no label column {h.label_column!r} in {source} (columns: {sorted(record)}); pass "
                                "--data.label_column")
            if h.text_pair_column is not None and h.text_pair_column not in record:
                raise UserError(f"text pair column {h.text_pair_column!r} not in {source} (columns: "
                                f"{sorted(record)})")
            text = column(record)
            label = normalise_label(record[h.label_column])
            pair = pair_column(record) if h.text_pair_column is not None else None  # cleaned as the first is
            if label is None:
                raise UserError(f"{source}: row {row} has no label (column {h.label_column!r})")
            if not text or (h.text_pair_column is not None and not pair):
                blank += 1
                continue
            texts.append((text, pair))
            labels.append(label)
        warn_blank_rows(blank, source)
        if not texts:
            raise UserError(f"no labelled texts in {source}")
        return texts, labels

    @property
    def splits(self) -> Splits:
        if self._splits is None:
            h = self.hparams
            self._splits = read_splits(str(h.source), self.read, lambda labels: any(x != -1 for x in labels),
                                       h.val_fraction, h.test_fraction, h.seed, h.max_sentences, h.val_split,
                                       h.test_split)
        return self._splits

    @property
    def label_names(self) -> list:
        """The classes in label order: --data.classes, else the training split's labels, sorted; every split's
        labels among them."""
        if self._classes is None:
            labels = self.splits.labels
            if self.fixed is not None:
                classes, origin = self.fixed, "the classes of --data.classes"
            else:
                classes, origin = sort_labels(set(labels["train"])), "the training split's labels"
                if len(classes) < 2:
                    raise UserError(f"the label column {self.hparams.label_column!r} has a single class {classes} in "
                                    "the training split: nothing to classify")
            for split in SPLITS:
                unknown = sorted({str(label) for label in labels[split] if label not in classes})
                if unknown:
                    raise UserError(f"label(s) {unknown[:5]} of the {split} split are not among {origin} {classes}")
            self._classes = classes
            # the model's hyper-parameter too (linked): loggers merge both sets, which must agree
            self.hparams["classes"] = self._hparams_initial["classes"] = list(classes)
        return self._classes

    def majority(self) -> dict:
        """The most frequent training class and its share of the test split (the baseline beside the accuracy)."""
        counts = torch.bincount(self.labels["train"], minlength=len(self.label_names))
        top = int(counts.argmax())
        return {"class": self.label_names[top], "test_accuracy": float((self.labels["test"] == top).double().mean())}

    def described(self) -> dict:
        return {split: {"from": self.splits.described[split], "examples": len(self.splits.texts[split]),
                        **({"truncated": self.truncated[split]} if split in self.truncated else {})}
                for split in SPLITS}

    # -- Lightning hooks --

    def setup(self, stage: str | None = None) -> None:
        """Tokenise every split with the model's tokenizer (each rank; kept in memory)."""
        if self.sets:
            return
        module = self.trainer.lightning_module if self.trainer is not None else None
        tokenizer = self.tokenizer or getattr(module, "tokenizer", None)
        if tokenizer is None:
            raise UserError("no tokenizer: fine-tuning data are tokenised by the model's (train with FineTuneModule)")
        self.attach(tokenizer, getattr(module, "max_length", None))
        if self.trainer is not None:
            self.check_trainer(self.trainer)

    def check_max_length(self, model_max_length: int | None) -> None:
        if model_max_length is not None and self.hparams.max_length > model_max_length:
            raise UserError(f"--data.max_length {self.hparams.max_length} exceeds the encoder's {model_max_length} "
                            "positions")

    def attach(self, tokenizer, model_max_length: int | None = None) -> None:
        """Tokenise the splits with `tokenizer` (from Python without a trainer too)."""
        h = self.hparams
        self.check_max_length(model_max_length)
        self.tokenizer = tokenizer
        index = {label: i for i, label in enumerate(self.label_names)}
        self.truncated = {}
        for split in SPLITS:
            texts = self.splits.texts[split]
            pairs = [pair for _, pair in texts] if h.text_pair_column is not None else None
            with truncating_right(tokenizer):  # an example's start is kept, whatever the tokenizer's own side
                encoded = tokenizer([text for text, _ in texts], pairs, truncation=True, max_length=h.max_length)
            self.truncated[split] = count_truncated(tokenizer, texts, encoded["input_ids"], h.max_length)
            self.labels[split] = torch.tensor([index[label] for label in self.splits.labels[split]], dtype=torch.long)
            self.sets[split] = Examples(dict(encoded), self.labels[split], tokenizer.pad_token_id or 0)
        if any(self.truncated.values()) and self._rank_world()[0] == 0:  # every rank tokenises the whole splits
            counts = ", ".join(f"{self.truncated[split]} of {len(self.sets[split])} {split}" for split in SPLITS)
            warnings.warn(f"examples longer than --data.max_length {h.max_length} tokens were truncated: {counts} "
                          "(counted in finetune.json's splits)", stacklevel=2)

    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def check_examples(self, world_size: int) -> None:
        """One line when the training split makes no full global batch (the sampler drops partial ones), or when the
        validation split leaves a rank without an example (Lightning skips its validation; the others wait on it)."""
        examples = len(self.splits.texts["train"])
        if examples < self.position.global_batch(world_size):
            raise UserError(f"{examples} training examples make no full global batch of "
                            f"{self.position.global_batch(world_size)}")
        validation = len(self.splits.texts["val"])
        if 0 < validation < world_size:
            raise UserError(f"{validation} validation examples for {world_size} processes: each process validates at "
                            "least one")

    def train_dataloader(self) -> ResumableLoader:
        h = self.hparams
        rank, world = self._rank_world()
        resume = self.position.begin(world)
        examples = len(self.sets["train"])
        sampler = BlockSampler(examples, h.batch_size, rank, world, h.seed, shuffle=True,
                               group=self.position.global_batch(world))
        sampler.resume(*self.position.begin_epochs(resume, len(sampler) * self.position.step))
        return self._loader(self.sets["train"], sampler)

    def val_dataloader(self) -> ResumableLoader:
        """Every w-th example: each rank has a batch (whole batches dealt out would leave some ranks none)."""
        rank, world = self._rank_world()
        sampler = BlockSampler(len(self.sets["val"]), self.hparams.eval_batch_size, rank, world, shuffle=False)
        return self._loader(self.sets["val"], sampler)

    def test_dataloader(self) -> ResumableLoader:
        """The one-process batches, dealt whole to the ranks (read by FineTuneModule.evaluate, not Lightning)."""
        rank, world = self._rank_world()
        sampler = DealtBatches(len(self.sets["test"]), self.hparams.eval_batch_size, rank, world)
        return self._loader(self.sets["test"], sampler)

    def _loader(self, dataset, sampler) -> ResumableLoader:
        workers = self.hparams.num_workers
        return ResumableLoader(dataset, sampler=sampler, batch_size=None, num_workers=workers,
                               pin_memory=torch.cuda.is_available(), persistent_workers=workers > 0)

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        """Record the data position after each training batch the step consumes (not at fetch time)."""
        if self.trainer is not None and self.trainer.training:
            self.position.advance(None)
        return batch

    def shrinkage_batches(self, epoch: int, max_tokens: int, rank: int, world: int):
        """This rank's share of the first training examples of a seeded permutation per epoch holding up to
        `max_tokens` tokens (padding excluded; at least one example), rank r taking every world-th, so their union
        does not depend on the device count: I-STAR's C0 pass (lightning_modules/training.py)."""
        examples = self.sets["train"]
        generator = torch.Generator().manual_seed(self.hparams.seed * 1_000_003 + 7_777 + epoch)
        order = torch.randperm(len(examples), generator=generator).tolist()
        lengths = torch.tensor([len(examples.encoded["input_ids"][row]) for row in order])
        count = max(1, int((lengths.cumsum(0) <= max_tokens).sum()))
        chosen = order[:count][rank::world]
        size = self.hparams.eval_batch_size
        for start in range(0, len(chosen), size):
            yield examples[chosen[start:start + size]]

    # -- the global batch, and checkpointed state --

    def accumulation(self, world_size: int) -> int:
        return self.position.accumulation(world_size)

    def check_trainer(self, trainer, apply: bool = True) -> None:
        self.position.check_trainer(trainer, apply)

    def cached_tokenizer(self):
        return None  # the encoder's own: nothing to compare on resume

    def state_dict(self) -> dict:
        return {"classes": list(self.label_names), **self.position.state(self._rank_world()[1])}

    def load_state_dict(self, state: dict) -> None:
        self.position.restore(state, *self._rank_world())

    def check_position(self, state: dict, world: int, source: str = "the checkpoint") -> None:
        self.position.check(state, world, source)

    def adapt_checkpoint(self, checkpoint: dict) -> None:
        self.position.adapt(checkpoint.get(type(self).__qualname__) or {}, checkpoint, self._rank_world()[1])
