"""MLM pretraining data: corpus → tokenizer → packed full blocks (cached on disk) → dynamic 15% masking per batch.

    python train.py fit --config configs/pretrain/tiny.yaml                                  # data/austen.txt
    python train.py fit --config configs/pretrain/roberta-base.yaml --data.corpus wikitext:wikitext-103-raw-v1:train
    python train.py fit --config ... --data.corpus wikipedia:20220301.en --data.streaming true

Blocks: each text is tokenised without special tokens and followed by </s>; the stream is cut into pieces of
`block_length - 2` tokens and each block is `<s> piece </s>` (every block full, no padding, position 0 is <s>).
`prepare_data` (local rank 0) trains or loads the tokenizer and writes the blocks with `datasets` under
`cache_dir/blocks/<corpus>-<block_length>-<key>`, the key hashing corpus + tokenizer + block length + split; `setup`
loads them on every rank. A held-out split of blocks gives val/loss and val/perplexity.

Masking (BERT's rule, done in the loader's workers): exactly round(0.15 × (block_length - 2)) non-special positions
of each block are predicted; of those 80% become <mask>, 10% a random non-special token, 10% stay. The randomness of
a block depends only on (seed, epoch, block index), so masks are the same whatever the device count, batch size,
worker count or resume point: a batch is `{"input_ids": [batch, seq], "positions": [batch, k], "targets": [batch, k]}`
with targets -100 where a block had fewer than k maskable tokens.

Every rank walks one seeded permutation of the blocks per epoch; rank r of w takes its items r, r + w, ... so a
global batch holds the same blocks for any (devices × nodes × per-device batch × accumulation). The data position
after the last batch a training step consumed is saved in the checkpoint in global blocks (with the world size and
batch size) and restored on `--ckpt_path last`, also on another device count with the same global batch. Streaming
saves every rank's stream state instead (texts skipped unread by the tokenizer on resume, one chunk re-tokenised)
and resumes on its own device count only.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from datamodules.io import DEFAULT_CORPUS, UserError, iter_texts
from datamodules.tokenizer import fingerprint, load_tokenizer, tokenizer_files, train_tokenizer, vocab_limit

CACHE_VERSION = 1
STREAM_KEY_BITS = 36  # streaming block keys: (pass, rank) in the high bits, the block counter in the low bits


# ---- tokenise and pack (named module-level functions, so `datasets` can hash them) ----

def corpus_records(source: str, text_column: str | None, max_texts: int | None, skip_texts: int = 0):
    """Yield {"text": ...} for texts skip_texts .. skip_texts + max_texts of the corpus."""
    stop = None if max_texts is None else skip_texts + max_texts
    for text in itertools.islice(iter_texts(source, text_column), skip_texts, stop):
        yield {"text": text}


def tokenize_texts(texts: list[str], tokenizer) -> list[list[int]]:
    """Token ids of each text without special tokens."""
    return tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]


def pack_blocks(ids: list[list[int]], block_length: int, bos: int, eos: int,
                carry: list[int] | None = None) -> tuple[list[list[int]], list[int]]:
    """Concatenate texts (each followed by eos), cut into <s> piece </s> blocks: (full blocks, leftover tokens)."""
    stream = list(carry or [])
    for row in ids:
        stream.extend(row)
        stream.append(eos)
    piece = block_length - 2
    full = len(stream) // piece
    blocks = [[bos, *stream[i * piece:(i + 1) * piece], eos] for i in range(full)]
    return blocks, stream[full * piece:]


def boundary_ids(tokenizer) -> tuple[int, int]:
    """The ids opening and closing a block: <s> and </s>, or [CLS] and [SEP] for a tokenizer without bos/eos."""
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.cls_token_id
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    return bos, eos


def tokenize_and_pack(batch: dict, tokenizer, block_length: int) -> dict:
    """datasets.map function: a batch of texts → the full blocks it makes (the remainder of the batch is dropped)."""
    blocks, _ = pack_blocks(tokenize_texts(batch["text"], tokenizer), block_length, *boundary_ids(tokenizer))
    return {"input_ids": blocks}


def build_blocks(output: Path, source: str, text_column: str | None, max_texts: int | None, tokenizer,
                 block_length: int, val_fraction: float, max_val_blocks: int, num_proc: int | None,
                 skip_texts: int = 0, only_val: bool = False) -> dict:
    """Write a DatasetDict {"train", "validation"} of packed blocks to `output` (via a staging dir); its info."""
    import datasets

    output.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".staging-", dir=output.parent))
    try:
        dtype = "uint16" if vocab_limit(tokenizer) <= 65536 else "int32"
        features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value(dtype), length=block_length)})
        texts = datasets.Dataset.from_generator(
            corpus_records, cache_dir=str(stage / "hf"), num_proc=None,
            gen_kwargs={"source": source, "text_column": text_column, "max_texts": max_texts, "skip_texts": skip_texts})
        blocks = texts.map(tokenize_and_pack, batched=True, batch_size=2000, remove_columns=texts.column_names,
                           fn_kwargs={"tokenizer": tokenizer, "block_length": block_length}, features=features,
                           num_proc=num_proc, desc=f"tokenising and packing into {block_length}-token blocks")
        if len(blocks) < 2 and not only_val:
            raise UserError(f"corpus {source} gives {len(blocks)} full blocks of {block_length} tokens; "
                            "need at least 2 (a bigger corpus or a shorter --data.block_length)")
        if len(blocks) == 0:
            raise UserError(f"corpus {source} gives no full block of {block_length} tokens")
        if only_val:
            split = {"validation": blocks}
        else:
            num_val = min(max(1, round(val_fraction * len(blocks))), max_val_blocks, len(blocks) - 1)
            order = np.random.default_rng(0).permutation(len(blocks))
            split = {"train": blocks.select(np.sort(order[num_val:])), "validation": blocks.select(np.sort(order[:num_val]))}
        datasets.DatasetDict(split).save_to_disk(str(stage / "data"))
        info = {name: len(part) for name, part in split.items()}
        (stage / "data" / "blocks.json").write_text(json.dumps(info) + "\n")
        publish(stage / "data", output)
        return info
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def publish(staged: Path, target: Path) -> None:
    """Move a finished cache entry into place atomically; if another node's local rank 0 won the race, keep theirs."""
    try:
        os.replace(staged, target)
    except OSError:
        if not target.exists():
            raise


# ---- masking ----

class MaskCollator:
    """Blocks [batch, seq] + their keys [batch] → input_ids, positions [batch, k] and targets [batch, k] (see module doc)."""

    def __init__(self, tokenizer, block_length: int, mlm_probability: float = 0.15, seed: int = 0) -> None:
        specials = sorted({int(i) for i in tokenizer.all_special_ids})
        self.special = np.array(specials, dtype=np.int64)
        self.mask_id = int(tokenizer.mask_token_id)
        self.random_ids = np.setdiff1d(np.arange(vocab_limit(tokenizer)), self.special)
        self.k = max(1, round(mlm_probability * (block_length - 2)))
        self.seed = seed

    def __call__(self, item: dict) -> dict[str, torch.Tensor]:
        blocks = np.asarray(item["blocks"], dtype=np.int64)  # [batch, seq]
        keys = np.asarray(item["keys"], dtype=np.int64)
        batch, length = blocks.shape
        k = min(self.k, length)
        input_ids = blocks.copy()
        positions = np.zeros((batch, k), dtype=np.int64)
        targets = np.full((batch, k), -100, dtype=np.int64)
        maskable = ~np.isin(blocks, self.special)
        for row in range(batch):
            rng = np.random.Generator(np.random.PCG64([self.seed, int(keys[row])]))
            scores = rng.random(length)
            scores[~maskable[row]] = np.inf
            chosen = np.sort(np.argpartition(scores, k - 1)[:k])
            chosen = chosen[maskable[row, chosen]]
            count = len(chosen)
            positions[row, :count] = chosen
            targets[row, :count] = blocks[row, chosen]
            action = rng.random(k)[:count]
            replace = rng.choice(self.random_ids, size=k)[:count]
            input_ids[row, chosen] = np.where(action < 0.8, self.mask_id, np.where(action < 0.9, replace, blocks[row, chosen]))
        out = {"input_ids": torch.from_numpy(input_ids), "positions": torch.from_numpy(positions),
               "targets": torch.from_numpy(targets)}
        if "stream_state" in item:  # where a streaming rank stands after this batch; the datamodule strips it
            out["stream_state"] = item["stream_state"]
        return out


# ---- sampling and datasets ----

class BlockSampler(Sampler[list[int]]):
    """This rank's batches of block keys (epoch × n + index) from one seeded permutation per epoch (see module doc).

    Training drops the blocks past the last whole `group` (the global batch) so every rank and every accumulation
    window is full. The sampler counts its own epochs (one per pass), so the data order does not depend on how
    Lightning numbers epochs after a restart; `resume(epoch, batches)` starts the next pass there.
    """

    def __init__(self, num_blocks: int, batch_size: int, rank: int = 0, world: int = 1, seed: int = 0,
                 shuffle: bool = True, group: int | None = None) -> None:
        self.num_blocks, self.batch_size, self.rank, self.world = num_blocks, batch_size, rank, world
        self.seed, self.shuffle = seed, shuffle
        self.group = group if shuffle else None
        self.epoch, self.skip = 0, 0

    def resume(self, epoch: int, batches: int) -> None:
        self.epoch, self.skip = epoch, batches

    def _mine(self, epoch: int) -> np.ndarray:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(self.num_blocks, generator=generator).numpy()
        else:
            order = np.arange(self.num_blocks)
        if self.group:
            order = order[: self.num_blocks // self.group * self.group]
        return order[self.rank::self.world]

    def __len__(self) -> int:
        if self.group:
            return self.num_blocks // self.group * self.group // (self.world * self.batch_size)
        mine = len(range(self.rank, self.num_blocks, self.world))
        return -(-mine // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        epoch, skip = self.epoch, self.skip
        if self.shuffle:
            self.epoch, self.skip = epoch + 1, 0
        mine = self._mine(epoch)
        for start in range(skip * self.batch_size, len(self) * self.batch_size, self.batch_size):
            yield (epoch * self.num_blocks + mine[start:start + self.batch_size]).tolist()


class BlockDataset(torch.utils.data.Dataset):
    """Packed blocks on disk (Arrow, memory-mapped); indexed by a list of keys, returns one batch."""

    def __init__(self, blocks) -> None:
        self.blocks = blocks.with_format("numpy")

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, keys: list[int]) -> dict:
        keys = np.asarray(keys, dtype=np.int64)
        rows = self.blocks[np.sort(keys % len(self.blocks)).tolist()]["input_ids"]
        order = np.argsort(np.argsort(keys % len(self.blocks), kind="stable"), kind="stable")
        return {"blocks": np.asarray(rows)[order], "keys": keys}


class StreamingBlocks(IterableDataset):
    """Blocks made on the fly from a corpus too big to cache: this rank's texts (r, r + w, ...), packed, batched.

    Texts are tokenised `chunk` at a time. Each batch carries `stream_state`, where this rank's stream stands after
    it: {"epoch", "text": this rank's index of the text opening the current chunk, "carry": the tokens left over from
    the chunks before, "done": blocks of the chunk already in batches, "counter": blocks of the epoch before the
    chunk}. Started from such a state (`start`), the stream skips the texts before the chunk without tokenising
    them, re-tokenises that one chunk and goes on with the same blocks and keys as an uninterrupted run.
    """

    def __init__(self, source: str, text_column: str | None, tokenizer, block_length: int, batch_size: int,
                 rank: int, world: int, skip_texts: int, start: dict | None = None, chunk: int = 1000) -> None:
        self.source, self.text_column, self.tokenizer = source, text_column, tokenizer
        self.block_length, self.batch_size, self.rank, self.world = block_length, batch_size, rank, world
        self.skip_texts, self.chunk = skip_texts, chunk
        self.start = start or {"epoch": 0, "text": 0, "carry": [], "done": 0, "counter": 0}

    def __iter__(self) -> Iterator[dict]:
        info = torch.utils.data.get_worker_info()
        if info is not None and info.num_workers > 1:
            raise UserError("--data.streaming takes --data.num_workers 0 or 1")
        start = self.start
        skip = int(start["done"])  # blocks of the first chunk already consumed (legacy checkpoints: of the epoch)
        bos, eos = boundary_ids(self.tokenizer)
        for epoch in itertools.count(int(start["epoch"])):
            first = epoch == int(start["epoch"])
            index = int(start["text"]) if first else 0
            carry: list[int] = [int(t) for t in start["carry"]] if first else []
            counter = int(start["counter"]) if first else 0
            texts = itertools.islice(iter_texts(self.source, self.text_column),
                                     self.skip_texts + self.rank + index * self.world, None, self.world)
            base = (epoch * self.world + self.rank) << STREAM_KEY_BITS
            pending: list[list[int]] = []
            keys: list[int] = []
            while chunk := list(itertools.islice(texts, self.chunk)):
                blocks, rest = pack_blocks(tokenize_texts(chunk, self.tokenizer), self.block_length, bos, eos, carry)
                for i, block in enumerate(blocks):
                    if skip:
                        skip -= 1
                        continue
                    pending.append(block)
                    keys.append(base + counter + i)
                    if len(pending) == self.batch_size:
                        state = {"epoch": epoch, "text": index, "carry": carry, "done": i + 1, "counter": counter}
                        yield {"blocks": np.array(pending), "keys": np.array(keys), "stream_state": state}
                        pending, keys = [], []
                index, carry, counter = index + len(chunk), rest, counter + len(blocks)
            if counter == 0:
                raise UserError(f"corpus {self.source} gives no full block of {self.block_length} tokens on rank "
                                f"{self.rank}")


def ignore_sigterm(worker_id: int) -> None:
    """Loader workers leave SIGTERM to the training process, which saves a checkpoint and then shuts them down (a
    worker killed by it, or running the trainer's handler in a forked copy, would break the step in flight)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class ResumableLoader(DataLoader):
    """A DataLoader that tells Lightning it resumes mid-epoch: the position itself is saved and restored by
    MLMDataModule.state_dict / load_state_dict (micro-batches consumed), which positions the sampler."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


# ---- the datamodule ----

def default_cache_dir() -> Path:
    return Path(os.environ.get("POSART_CACHE", Path.home() / ".cache" / "positional-artefacts"))


def corpus_fingerprint(source: str, text_column: str | None, max_texts: int | None) -> dict:
    """What identifies a corpus: a local file or directory by path, size and mtime; a hub name by itself."""
    path = Path(source).expanduser()
    if path.exists():
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        stat = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
        ident: object = stat
    else:
        ident = source
    return {"corpus": ident, "text_column": text_column, "max_texts": max_texts}


def digest(payload: object) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def corpus_stem(source: str) -> str:
    name = Path(source).stem if Path(source).expanduser().exists() else source
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:40]


class MLMDataModule(pl.LightningDataModule):
    """Packed, dynamically masked MLM blocks from local text or a `datasets` corpus (see the module docstring).

    Args:
        corpus: a text/csv/tsv/jsonl file, a `datasets` directory, or a `datasets` NAME[:CONFIG][:SPLIT].
        text_column: the column holding the text (default: detected).
        max_texts: use only the first texts of the corpus.
        tokenizer: "train" (a byte-level BPE on the corpus) or a tokenizer's hub id or directory.
        vocab_size: the trained tokenizer's vocabulary size (and the model's), ignored for an existing tokenizer.
        tokenizer_texts: train the tokenizer on the first this-many texts.
        block_length: tokens per sequence, <s> and </s> included.
        batch_size: sequences per device and step (micro-batch).
        global_batch_size: sequences per optimizer step across all devices and nodes; gradient accumulation is
            derived from it (global / (batch_size × devices × nodes)). None: no accumulation.
        val_fraction, max_val_blocks: the held-out split (a fraction of the blocks, at most this many).
        streaming: make training blocks on the fly (no cache of the whole corpus); the first `val_texts` texts are
            held out and cached for validation.
        cache_dir: where tokenizers and blocks are cached (default $POSART_CACHE or ~/.cache/positional-artefacts).
        num_workers: loader worker processes per device (masking runs there).
        num_proc: processes for tokenising in prepare_data (default: one; the tokenizer itself is multi-threaded).
        seed: shuffling and masking seed.
    """

    def __init__(
        self,
        corpus: str = str(DEFAULT_CORPUS),
        text_column: str | None = None,
        max_texts: int | None = None,
        tokenizer: str = "train",
        vocab_size: int = 8192,
        tokenizer_texts: int = 1_000_000,
        block_length: int = 128,
        batch_size: int = 32,
        global_batch_size: int | None = None,
        mlm_probability: float = 0.15,
        val_fraction: float = 0.01,
        max_val_blocks: int = 1000,
        val_batch_size: int | None = None,
        streaming: bool = False,
        val_texts: int = 2000,
        cache_dir: str | None = None,
        num_workers: int = 0,
        num_proc: int | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self._validate_arguments()
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        self.corpus_id = corpus_fingerprint(corpus, text_column, max_texts)
        self.tokenizer = None
        self._existing_tokenizer = None
        if tokenizer != "train":
            self._existing_tokenizer = load_tokenizer(tokenizer)
        self.train_blocks = self.val_blocks = None
        self._resume: dict | None = None  # the position a checkpoint holds, converted to this run (load_state_dict)
        self._position: dict | None = None  # {"blocks", "epoch", "in_epoch"} after the last training batch consumed
        self._stream: dict | None = None  # streaming: this rank's stream state after that batch
        self._step = self._epoch_blocks = 0  # blocks per training micro-batch over all ranks; per epoch

    def _validate_arguments(self) -> None:
        h = self.hparams
        for name in ("block_length", "batch_size"):
            if getattr(h, name) < (4 if name == "block_length" else 1):
                raise UserError(f"--data.{name} too small: {getattr(h, name)}")
        if h.global_batch_size is not None and h.global_batch_size < h.batch_size:
            raise UserError(f"--data.global_batch_size {h.global_batch_size} is below --data.batch_size {h.batch_size}")
        if not 0 < h.mlm_probability < 1:
            raise UserError(f"--data.mlm_probability must lie in (0, 1), got {h.mlm_probability}")
        if not 0 < h.val_fraction < 1:
            raise UserError(f"--data.val_fraction must lie in (0, 1), got {h.val_fraction}")
        if h.streaming and h.num_workers > 1:
            raise UserError("--data.streaming takes --data.num_workers 0 or 1 (one reader per device)")
        path = Path(h.corpus).expanduser()
        if path.exists() or h.corpus.startswith((".", "/", "~")) or path.suffix:
            if not path.exists():
                raise UserError(f"corpus not found: {h.corpus}")
            if path.is_file():
                next(iter_texts(path, h.text_column), None)  # empty, binary or not UTF-8: one clear line

    # -- sizes the model needs before any data work --

    @property
    def model_vocab_size(self) -> int:
        """Rows the model's embedding needs: the trained tokenizer's target size, or the existing one's ids."""
        if self._existing_tokenizer is not None:
            return vocab_limit(self._existing_tokenizer)
        return self.hparams.vocab_size

    @property
    def model_special_ids(self) -> dict[str, int]:
        """The model config's pad/bos/eos ids: RoBERTa's 1/0/2 for the trained BPE, else the existing tokenizer's
        (bos and eos fall back to [CLS] and [SEP], which a BERT tokenizer puts around a block)."""
        tokenizer = self._existing_tokenizer
        if tokenizer is None:
            return {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}
        bos, eos = boundary_ids(tokenizer)
        return {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": bos, "eos_token_id": eos}

    # -- cache locations --

    def tokenizer_dir(self) -> Path:
        h = self.hparams
        key = digest({"corpus": self.corpus_id, "vocab": h.vocab_size, "texts": h.tokenizer_texts, "v": CACHE_VERSION})
        return self.cache_dir / "tokenizers" / f"{corpus_stem(h.corpus)}-{h.vocab_size}-{key}"

    def blocks_dir(self, tokenizer) -> Path:
        h = self.hparams
        split = {"streaming_val_texts": h.val_texts} if h.streaming else {"val": h.val_fraction, "max": h.max_val_blocks}
        key = digest({"corpus": self.corpus_id, "tokenizer": fingerprint(tokenizer), "block": h.block_length,
                      "split": split, "v": CACHE_VERSION})
        return self.cache_dir / "blocks" / f"{corpus_stem(h.corpus)}-{h.block_length}-{key}"

    # -- Lightning hooks --

    def prepare_data(self) -> None:
        """Train or load the tokenizer and pack the blocks (cached), then check both against the trainer's model and
        global batch: Lightning calls this before its loggers and callbacks write anything."""
        h = self.hparams
        tokenizer = self._prepare_tokenizer()
        if self.trainer is not None:
            self.check_trainer(self.trainer, apply=False, tokenizer=tokenizer)
        target = self.blocks_dir(tokenizer)
        if (target / "blocks.json").exists():
            info = json.loads((target / "blocks.json").read_text())
        elif h.streaming:
            info = build_blocks(target, h.corpus, h.text_column, h.val_texts, tokenizer, h.block_length,
                                h.val_fraction, h.max_val_blocks, h.num_proc, only_val=True)
        else:
            info = build_blocks(target, h.corpus, h.text_column, h.max_texts, tokenizer, h.block_length,
                                h.val_fraction, h.max_val_blocks, h.num_proc)
        if "train" in info and self.trainer is not None:
            self.check_blocks(info["train"], self.trainer.world_size)

    def _prepare_tokenizer(self):
        if self._existing_tokenizer is not None:
            return self._existing_tokenizer
        h = self.hparams
        target = self.tokenizer_dir()
        if (target / "tokenizer.json").exists():
            return load_tokenizer(target)
        texts = iter_texts(h.corpus, h.text_column)
        tokenizer = train_tokenizer(texts, h.vocab_size, max_texts=min(h.tokenizer_texts, h.max_texts or h.tokenizer_texts))
        target.parent.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
        try:
            tokenizer.save_pretrained(stage)
            publish(stage, target)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        return tokenizer

    def check_cache(self, vocab_rows: int, world_size: int) -> None:
        """Before the fit, on every rank: a tokenizer and blocks cached already, against the model's embedding rows
        and the global batch (what is not cached yet, prepare_data checks once it has made it)."""
        tokenizer = self.cached_tokenizer()
        if tokenizer is None:
            return
        self.check_vocab(tokenizer, vocab_rows)
        info = self.blocks_dir(tokenizer) / "blocks.json"
        if info.exists() and not self.hparams.streaming:
            self.check_blocks(json.loads(info.read_text())["train"], world_size)

    def cached_tokenizer(self):
        """The tokenizer if it exists already (an existing one, or a trained one in the cache), else None."""
        if self._existing_tokenizer is not None:
            return self._existing_tokenizer
        target = self.tokenizer_dir()
        return load_tokenizer(target) if (target / "tokenizer.json").exists() else None

    def load_tokenizer(self):
        """The tokenizer prepare_data made or found (every rank)."""
        if self._existing_tokenizer is not None:
            return self._existing_tokenizer
        target = self.tokenizer_dir()
        if not (target / "tokenizer.json").exists():
            raise UserError(f"tokenizer cache missing: {target} (prepare_data did not run on this node?)")
        return load_tokenizer(target)

    def setup(self, stage: str | None = None) -> None:
        import datasets

        h = self.hparams
        self.tokenizer = self.load_tokenizer()
        self._tokenizer_files = tokenizer_files(self.tokenizer)
        if self.trainer is not None:
            self.check_trainer(self.trainer)
        path = self.blocks_dir(self.tokenizer)
        if not (path / "blocks.json").exists():
            raise UserError(f"block cache missing: {path} (prepare_data did not run on this node?)")
        loaded = datasets.load_from_disk(str(path))
        self.train_blocks = None if h.streaming else BlockDataset(loaded["train"])
        self.val_blocks = BlockDataset(loaded["validation"])
        self.collator = MaskCollator(self.tokenizer, h.block_length, h.mlm_probability, h.seed)
        self.val_collator = MaskCollator(self.tokenizer, h.block_length, h.mlm_probability, h.seed + 1)

    def accumulation(self, world_size: int) -> int:
        """Gradient-accumulation steps that keep the global batch: global / (batch_size × world size)."""
        h = self.hparams
        if h.global_batch_size is None:
            return 1
        per_step = h.batch_size * world_size
        if h.global_batch_size % per_step:
            raise UserError(f"global batch {h.global_batch_size} is not a multiple of batch_size {h.batch_size} × "
                            f"{world_size} devices; choose --data.batch_size so that it divides")
        return h.global_batch_size // per_step

    def check_trainer(self, trainer, apply: bool = True, tokenizer=None) -> None:
        """Accumulation from the global batch (set on the trainer when `apply`), and the block length and vocabulary
        (of `tokenizer`, default the loaded one) against the attached model's."""
        tokenizer = tokenizer if tokenizer is not None else self.tokenizer
        accumulate = self.accumulation(trainer.world_size)
        if trainer.accumulate_grad_batches not in (1, accumulate):
            raise UserError(f"--trainer.accumulate_grad_batches {trainer.accumulate_grad_batches} contradicts "
                            f"--data.global_batch_size (which needs {accumulate}); set only the global batch")
        if apply:
            trainer.accumulate_grad_batches = accumulate
        module = trainer.lightning_module if trainer.strategy._lightning_module is not None else None
        check_block_length(self.hparams.block_length, module)
        vocab = getattr(module, "vocab_size", None)
        if vocab is not None and tokenizer is not None:
            self.check_vocab(tokenizer, vocab)

    @staticmethod
    def check_vocab(tokenizer, vocab_rows: int) -> None:
        if vocab_limit(tokenizer) > vocab_rows:
            raise UserError(f"the tokenizer has ids up to {vocab_limit(tokenizer) - 1} but the model only "
                            f"{vocab_rows} embedding rows")

    def global_batch(self, world_size: int) -> int:
        """Blocks per optimizer step over all ranks: --data.global_batch_size, else batch_size × world size."""
        return self.hparams.global_batch_size or self.hparams.batch_size * world_size

    def check_blocks(self, num_blocks: int, world_size: int) -> None:
        """One line when the training blocks make no full global batch (the sampler drops partial ones)."""
        if num_blocks < self.global_batch(world_size):
            raise UserError(f"{num_blocks} training blocks make no full global batch of {self.global_batch(world_size)}")

    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def train_dataloader(self) -> DataLoader:
        h = self.hparams
        rank, world = self._rank_world()
        # a checkpoint's position, else where this run stands (a loader made again goes on from there)
        resume, self._resume = self._resume or {**(self._position or {}), "stream": self._stream}, None
        self._step = h.batch_size * world
        self._position = {"blocks": int(resume.get("blocks", 0)), "epoch": 0, "in_epoch": 0}
        if h.streaming:
            self._stream = resume.get("stream")
            dataset = StreamingBlocks(h.corpus, h.text_column, self.tokenizer, h.block_length, h.batch_size, rank,
                                      world, skip_texts=h.val_texts, start=self._stream)
            return self._loader(dataset, None, self.collator)
        self.check_blocks(len(self.train_blocks), world)
        sampler = BlockSampler(len(self.train_blocks), h.batch_size, rank, world, h.seed, shuffle=True,
                               group=self.global_batch(world))
        self._epoch_blocks = len(sampler) * self._step
        epoch, in_epoch = int(resume.get("epoch", 0)), int(resume.get("in_epoch", 0))
        if in_epoch >= self._epoch_blocks:  # another global batch than the checkpoint's: this epoch is used up
            epoch, in_epoch = epoch + 1, 0
        sampler.resume(epoch, in_epoch // self._step)
        self._position.update(epoch=epoch, in_epoch=in_epoch)
        return self._loader(self.train_blocks, sampler, self.collator)

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        """Record the data position after each training batch the step consumes (not at fetch time: loaders
        prefetch), and strip a streaming batch's `stream_state` before it reaches the model."""
        state = batch.pop("stream_state", None) if isinstance(batch, dict) else None
        trainer = self.trainer
        if trainer is not None and trainer.training and self._position is not None:
            self._stream = state if state is not None else self._stream
            position = self._position
            position["blocks"] += self._step
            position["in_epoch"] += self._step
            if self._epoch_blocks and position["in_epoch"] >= self._epoch_blocks:
                position["epoch"], position["in_epoch"] = position["epoch"] + 1, 0
        return batch

    def val_dataloader(self) -> DataLoader:
        h = self.hparams
        rank, world = self._rank_world()
        sampler = BlockSampler(len(self.val_blocks), h.val_batch_size or h.batch_size, rank, world, shuffle=False)
        return self._loader(self.val_blocks, sampler, self.val_collator)

    def _loader(self, dataset, sampler, collator) -> DataLoader:
        workers = self.hparams.num_workers
        return ResumableLoader(dataset, sampler=sampler, batch_size=None, collate_fn=collator, num_workers=workers,
                          pin_memory=torch.cuda.is_available(), persistent_workers=workers > 0,
                          prefetch_factor=4 if workers else None, worker_init_fn=ignore_sigterm if workers else None)

    # -- checkpointed state: data position and the tokenizer's identity --

    def state_dict(self) -> dict:
        """The tokenizer's identity, and the data position after the last training batch consumed: global blocks
        (micro-batches × batch_size × world size), the epoch and blocks into it, the world size, batch size and global
        batch; for streaming, every rank's stream state (gathered from all ranks: Lightning calls this on every
        rank)."""
        h = self.hparams
        state = {"tokenizer_fingerprint": fingerprint(self.tokenizer) if self.tokenizer is not None else None,
                 "tokenizer_files": getattr(self, "_tokenizer_files", None), "block_length": h.block_length}
        if self._position is not None:
            _, world = self._rank_world()
            state["position"] = {**self._position, "world": world, "batch_size": h.batch_size,
                                 "global_batch": self.global_batch(world), "streaming": h.streaming}
            if h.streaming:
                state["stream"] = gather_objects(self._stream, world)
        return state

    def load_state_dict(self, state: dict) -> None:
        expected = state.get("tokenizer_fingerprint")
        current = fingerprint(self.tokenizer) if self.tokenizer is not None else None
        if expected is not None and current is not None and expected != current:
            raise UserError("the tokenizer does not match the checkpoint's (its vocabulary or merges differ); "
                            "resume with the tokenizer the run was started with")
        if state.get("block_length", self.hparams.block_length) != self.hparams.block_length:
            raise UserError(f"--data.block_length {self.hparams.block_length} differs from the checkpoint's "
                            f"{state['block_length']}")
        rank, world = self._rank_world()
        self.check_position(state, world)
        position = state.get("position")
        if not position:
            return
        h = self.hparams
        if "world" in position:
            self._resume = {key: position[key] for key in ("blocks", "epoch", "in_epoch")}
            if h.streaming:
                self._resume["stream"] = state["stream"][rank]
            return
        # a checkpoint from before the position was global: micro-batches of this rank, same devices assumed
        batches, per_epoch = int(position["batches"]), int(position["per_epoch"]) or 1
        self._resume = {"blocks": batches * h.batch_size * world, "epoch": batches // per_epoch,
                        "in_epoch": batches % per_epoch * h.batch_size * world}
        if h.streaming:
            self._resume["stream"] = {"epoch": 0, "text": 0, "carry": [], "done": batches * h.batch_size, "counter": 0}

    def check_position(self, state: dict, world: int, source: str = "the checkpoint") -> None:
        """One clear line (naming `source`) when a checkpoint's data position cannot continue on `world` devices with
        this config.

        The cached path converts exactly whenever the global batch is unchanged (a step sees the same blocks on any
        device count), and another global batch is refused (checkpoints from before it was saved are not checked);
        a streaming run interleaves the texts by rank, so it resumes only on its own device count.
        """
        position = (state or {}).get("position") or {}
        if "world" not in position:
            return
        h = self.hparams
        if position["streaming"] != h.streaming:
            raise UserError(f"{source} is of a run with --data.streaming {str(position['streaming']).lower()}; "
                            f"resume with the same setting (the config gives {str(h.streaming).lower()})")
        if h.streaming and position["world"] != world:
            raise UserError(f"cannot resume a streaming run saved at world size {position['world']} at world size "
                            f"{world} (devices × nodes; each rank reads its own share of the texts): resume with "
                            f"world size {position['world']}")
        saved, current = position.get("global_batch"), self.global_batch(world)
        if saved is not None and saved != current:
            raise UserError(f"cannot resume: {source} was trained with global batch {saved} but the config gives "
                            f"{current}; keep the run's global batch (--data.global_batch_size {saved})")
        step = h.batch_size * world
        if position["blocks"] % step or position["in_epoch"] % step:
            raise UserError(f"cannot resume: {source} stopped after {position['blocks']} blocks, not a multiple "
                            f"of --data.batch_size {h.batch_size} × {world} devices; keep the run's global batch")

    def adapt_checkpoint(self, checkpoint: dict) -> None:
        """Express Lightning's saved micro-batch counts in this run's micro-batches when batch_size × world size
        changed (the MLM module calls this from on_load_checkpoint, before Lightning restores its loops), so that
        accumulation windows, epoch ends and dropout seeds continue from the same blocks."""
        state = checkpoint.get(type(self).__qualname__) or {}
        position = state.get("position") or {}
        if "world" not in position:
            return
        self.check_position(state, self._rank_world()[1])
        old, new = position["batch_size"] * position["world"], self.hparams.batch_size * self._rank_world()[1]
        progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
        if old == new or not progress:
            return
        for counts in (progress["total"], progress["current"]):
            shift = counts["processed"] * old // new - counts["processed"]  # keeps Lightning's restart pattern
            for key in ("ready", "started", "processed", "completed"):
                counts[key] += shift


def check_block_length(block_length: int, module) -> None:
    """One line when a block is longer than the MLM module's position table allows (its `max_length`: RoBERTa's
    positions start after the pad id, so max_position_embeddings - (pad id + 1)); no module, no check."""
    limit = getattr(module, "max_length", None)
    if limit is not None and block_length > limit:
        pad = module.model.config.pad_token_id
        raise UserError(f"--data.block_length {block_length} exceeds the model's {limit} positions "
                        f"(--model.max_position_embeddings {limit + pad + 1} minus (pad id {pad} + 1))")


def gather_objects(value, world: int) -> list:
    """[value of rank 0, value of rank 1, ...] (a collective: every rank calls it)."""
    import torch.distributed as dist

    if world > 1 and dist.is_available() and dist.is_initialized():
        values = [None] * world
        dist.all_gather_object(values, value)
        return values
    return [value]
