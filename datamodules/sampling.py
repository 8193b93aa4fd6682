"""Which blocks each rank reads, in which order, and from where: cached blocks or a stream made on the fly.

    sampler = BlockSampler(num_blocks, batch_size=16, rank=0, world=2, seed=0, group=32)  # batches of block keys
    dataset = BlockDataset(blocks)                  # cached Arrow blocks; dataset[keys] -> {"blocks", "keys"}
    stream = StreamingBlocks(corpus, None, tokenizer, 128, 16, rank=0, world=2, skip_texts=2000, workers=4)  # no cache
    batches = ShuffledBatches(items, batch_size=128, seed=0)   # the probes' items: one seeded shuffle per epoch
    batches = DealtBatches(items, batch_size=64, rank=0, world=2)  # evaluation: the one-process batches, dealt out

Every rank walks one seeded permutation of the blocks per epoch; rank r of w takes its items r, r + w, ... so a
global batch holds the same blocks for any (devices × nodes × per-device batch × accumulation). A streaming rank
reads its own shards of the texts and packs its own blocks: with n loader workers a rank has n shards, shard
s = r + w j (worker j) reading texts s, s + w n, s + 2 w n, ..., each tokenised in its own worker process.
"""

from __future__ import annotations

import itertools
import signal
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from core.errors import UserError
from core.tokenizers import boundary_ids
from datamodules.blocks import pack_blocks, tokenize_texts
from datamodules.position import fresh_state, stream_start
from datamodules.text import DATA_OPTION, iter_texts

STREAM_KEY_BITS = 36  # streaming block keys: (pass, rank) in the high bits, the block counter in the low bits


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


class DealtBatches(Sampler[list[int]]):
    """Evaluation batches: the one-process batches of `items` in order (`batch_size` consecutive indices, the last
    shorter), rank r of w taking batches r, r + w, ...: every item read once, and each batch whole on one rank, the
    same batch on any device count. A statistic of each batch (the mean over test batches of IsoScore* of a batch's
    tokens, lightning_modules/finetune.py) then sums over ranks to the one-process value; BlockSampler's every w-th
    item would give each rank batches of other items."""

    def __init__(self, items: int, batch_size: int, rank: int = 0, world: int = 1) -> None:
        self.items, self.batch_size, self.rank, self.world = items, batch_size, rank, world

    def __len__(self) -> int:
        return len(range(self.rank, -(-self.items // self.batch_size), self.world))

    def __iter__(self) -> Iterator[list[int]]:
        for start in range(self.rank * self.batch_size, self.items, self.world * self.batch_size):
            yield list(range(start, min(start + self.batch_size, self.items)))


class ShuffledBatches(Sampler[list[int]]):
    """Batches of `batch_size` of `items` indices (the last one shorter) in one seeded shuffle per epoch: the order
    torch's RandomSampler(generator=Generator().manual_seed(seed)) gives epoch after epoch, cut as BatchSampler
    (drop_last=False) cuts it, but epoch e's order follows from (seed, e) alone. Lightning tells the epoch
    (set_epoch), so a probe run resumed at epoch e reads what the uninterrupted run read there (a RandomSampler made
    again on resume starts from its seed: epoch 0's order again). Without set_epoch, each pass is the next epoch."""

    def __init__(self, items: int, batch_size: int, seed: int = 0) -> None:
        self.items, self.batch_size, self.seed, self.epoch = items, batch_size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return -(-self.items // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        generator = torch.Generator().manual_seed(self.seed)
        for _ in range(2 * self.epoch):  # RandomSampler draws two permutations a pass (the second, for the rest of
            torch.randperm(self.items, generator=generator)  # num_samples // items, is cut to nothing)
        order, self.epoch = torch.randperm(self.items, generator=generator).tolist(), self.epoch + 1
        for start in range(0, self.items, self.batch_size):
            yield order[start:start + self.batch_size]


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
    """Blocks made on the fly from a corpus too big to cache: this rank's shards of the texts, packed, batched.

    A rank has `workers` shards (one per loader worker, 1 for none), shard s = rank + world × worker reading texts
    s, s + world × workers, ...: the loader's workers tokenise in parallel, and it hands their batches on in turn
    (worker 0, 1, ..., 0, ...). Texts are tokenised `chunk` at a time. Each batch carries `stream_state`, where its
    shard stands after it: {"shard": the worker's shard index 0..workers-1, "epoch", "text": the shard's index of
    the text opening the current chunk, "carry": the tokens left over from the chunks before, "done": blocks of the
    chunk already in batches, "counter": blocks of the epoch before the chunk}. `start` is the rank's stream state
    ({"shards": [each shard's state or None], "next": the shard whose batch comes next}, `merge_stream_state`);
    started from it, each shard skips the texts before its chunk without tokenising them, re-tokenises that one
    chunk and goes on with the same blocks and keys as an uninterrupted run, the loader's worker 0 playing shard
    `next`, so the batches come in the same order too.
    """

    def __init__(self, source: str, text_column: str | None, tokenizer, block_length: int, batch_size: int,
                 rank: int, world: int, skip_texts: int, start: dict | None = None, chunk: int = 1000,
                 workers: int = 1) -> None:
        self.source, self.text_column, self.tokenizer = source, text_column, tokenizer
        self.block_length, self.batch_size, self.rank, self.world = block_length, batch_size, rank, world
        self.skip_texts, self.chunk, self.workers = skip_texts, chunk, max(1, workers)
        self.start = stream_start(start, self.workers)

    def __iter__(self) -> Iterator[dict]:
        info = torch.utils.data.get_worker_info()
        loaders = info.num_workers if info is not None else 1
        if loaders != self.workers:
            raise UserError(f"a stream of {self.workers} shards per rank read by {loaders} loader workers")
        shard = ((info.id if info is not None else 0) + int(self.start["next"])) % self.workers
        yield from self._shard(shard, self.start["shards"][shard] or fresh_state())

    def _shard(self, shard: int, start: dict) -> Iterator[dict]:
        shards = self.world * self.workers
        position = self.rank + self.world * shard  # this shard's first text, among all shards of all ranks
        skip = int(start["done"])  # blocks of the first chunk already consumed (legacy checkpoints: of the epoch)
        bos, eos = boundary_ids(self.tokenizer)
        for epoch in itertools.count(int(start["epoch"])):
            first = epoch == int(start["epoch"])
            index = int(start["text"]) if first else 0
            carry: list[int] = [int(t) for t in start["carry"]] if first else []
            counter = int(start["counter"]) if first else 0
            texts = itertools.islice(iter_texts(self.source, self.text_column, DATA_OPTION),
                                     self.skip_texts + position + index * shards, None, shards)
            base = (epoch * shards + position) << STREAM_KEY_BITS
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
                        state = {"shard": shard, "epoch": epoch, "text": index, "carry": carry, "done": i + 1,
                                 "counter": counter}
                        yield {"blocks": np.array(pending), "keys": np.array(keys), "stream_state": state}
                        pending, keys = [], []
                index, carry, counter = index + len(chunk), rest, counter + len(blocks)
            if counter == 0:
                raise UserError(f"corpus {self.source} gives no full block of {self.block_length} tokens on rank "
                                f"{self.rank}" + (f", stream shard {shard}" if self.workers > 1 else ""))


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
