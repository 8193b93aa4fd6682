"""MLM pretraining data: corpus → tokenizer → packed full blocks (cached on disk) → dynamic 15% masking per batch.

    python train.py fit --config configs/pretrain/tiny.yaml                                  # core/corpus/austen.txt
    python train.py fit --config configs/pretrain/roberta-base.yaml --data.corpus wikitext:wikitext-103-raw-v1:train
    python train.py fit --config ... --data.corpus wikipedia:20220301.en --data.streaming true

`prepare_data` (local rank 0) trains or loads the tokenizer and writes the blocks (datamodules/blocks.py); `setup`
loads them on every rank. A held-out split of blocks gives val/loss and val/perplexity. Batches are
`{"input_ids": [batch, seq], "positions": [batch, k], "targets": [batch, k]}` (datamodules/masking.py), drawn so that
a global batch holds the same blocks for any device count and accumulation (datamodules/sampling.py). The data
position after the last batch a training step consumed is saved in the checkpoint and restored on `--ckpt_path last`
(datamodules/position.py), also on another device count with the same global batch (streaming: its own only).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from core.errors import UserError
from core.sources import looks_local
from core.tokenizers import boundary_ids, fingerprint, load_tokenizer, tokenizer_files, vocab_limit
from core.wording import plural
from datamodules.blocks import BlockCache, build_blocks, check_training_texts
from datamodules.masking import MaskCollator, NextTokenCollator
from datamodules.position import DataPosition
from datamodules.sampling import BlockDataset, BlockSampler, ResumableLoader, StreamingBlocks, ignore_sigterm
from datamodules.text import DATA_OPTION, DEFAULT_CORPUS, iter_texts
from datamodules.tokenizer import check_vocab_size
from lightning_modules.training import run_seed


class MLMDataModule(pl.LightningDataModule):
    """Packed, dynamically masked MLM blocks from local text or a `datasets` corpus (see the module docstring).

    Args:
        corpus: a text/csv/tsv/jsonl file, a `datasets` directory, or a `datasets` NAME[:CONFIG][:SPLIT].
        text_column: the column holding the text (default: detected).
        max_texts: use only the first texts of the corpus.
        tokenizer: "train" (a byte-level BPE on the corpus) or a tokenizer's hub id (org/name@REVISION pins one) or
            directory.
        vocab_size: the trained tokenizer's vocabulary size (and the model's), ignored for an existing tokenizer.
        tokenizer_texts: train the tokenizer on the first this-many texts.
        block_length: tokens per sequence, <s> and </s> included.
        batch_size: sequences per device and step (micro-batch).
        global_batch_size: sequences per optimizer step across all devices and nodes; gradient accumulation is
            derived from it (global / (batch_size × devices × nodes)). None: no accumulation.
        mlm_probability: the share of tokens masked in each batch (dynamic masking; RoBERTa's 15%).
        val_fraction: the held-out split, a fraction of the blocks.
        max_val_blocks: at most this many held-out blocks.
        val_batch_size: sequences per device in validation (default: batch_size).
        streaming: make training blocks on the fly (no cache of the whole corpus); the first `val_texts` texts are
            held out and cached for validation. Each loader worker tokenises its own shard of the texts.
        val_texts: streaming: the texts held out for validation.
        cache_dir: where tokenizers and blocks are cached (default $POSART_CACHE or ~/.cache/positional-artefacts).
        num_workers: loader worker processes per device (masking runs there; streaming: tokenising too, one shard
            of the stream each, so a streaming run resumes with the same number).
        num_proc: processes for tokenising in prepare_data (default: one; the tokenizer itself is multi-threaded).
        seed: the blocks' order and their masks (default: the run's one seed, --seed_everything; a checkpoint holds
            it, and a resume must have the same).
        objective: mlm (15% masked) or causal (the blocks unmasked, every next token predicted but the block's
            closing </s>); train.py sets it from --model.objective.
        next_token_share: the causal arms' share of a block's next tokens predicted in training (1: every one, the
            causal LM's loss; 0.15: as many as the MLM predicts, drawn per block; ours); validation predicts every one.
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
        seed: int | None = None,
        objective: str = "mlm",
        next_token_share: float = 1.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if seed is None:  # the run's one seed: every seed of a study's arm its own blocks' order and masks
            self.hparams["seed"] = self._hparams_initial["seed"] = run_seed()
        self._existing_tokenizer = load_tokenizer(tokenizer, mask=objective == "mlm") if tokenizer != "train" else None
        if self._existing_tokenizer is not None:  # ignored, so set to the model's (linked): loggers merge both hparams
            self.hparams["vocab_size"] = self._hparams_initial["vocab_size"] = vocab_limit(self._existing_tokenizer)
        self._validate_arguments()
        self.cache = BlockCache(corpus, text_column, max_texts, cache_dir)
        self.tokenizer = None
        self.train_blocks = self.val_blocks = None
        self.position = DataPosition(batch_size, global_batch_size, streaming, num_workers if streaming else 1)

    def _validate_arguments(self) -> None:
        h = self.hparams
        for name in ("block_length", "batch_size"):
            least = 4 if name == "block_length" else 1
            if getattr(h, name) < least:
                raise UserError(f"--data.{name} too small: {getattr(h, name)} (at least {least})")
        if h.global_batch_size is not None and h.global_batch_size < h.batch_size:
            raise UserError(f"--data.global_batch_size {h.global_batch_size} is below --data.batch_size {h.batch_size}")
        if h.objective not in ("mlm", "causal"):
            raise UserError(f"--model.objective must be one of mlm, causal, got {h.objective!r}")  # train.py links it
        if not 0 < h.next_token_share <= 1:
            raise UserError(f"--data.next_token_share must lie in (0, 1], got {h.next_token_share}")
        if not 0 < h.mlm_probability < 1:
            raise UserError(f"--data.mlm_probability must lie in (0, 1), got {h.mlm_probability}")
        if not 0 < h.val_fraction < 1:
            raise UserError(f"--data.val_fraction must lie in (0, 1), got {h.val_fraction}")
        if h.tokenizer == "train":  # before any data work (study.py checks its arms with it before any trains)
            check_vocab_size(h.vocab_size)
        if looks_local(h.corpus):
            path = Path(h.corpus).expanduser()
            if not path.exists():
                raise UserError(f"corpus not found: {h.corpus}")
            if path.is_file() and next(iter_texts(path, h.text_column, DATA_OPTION), None) is None:  # empty, binary,
                raise UserError(f"no text in {h.corpus}: every row's text is empty")  # not UTF-8: one line each

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

    # -- the cache --

    def blocks_dir(self, tokenizer):
        h = self.hparams
        split = {"streaming_val_texts": h.val_texts} if h.streaming else {"val": h.val_fraction, "max": h.max_val_blocks}
        return self.cache.blocks_dir(tokenizer, h.block_length, split)

    def cached_tokenizer(self):
        """The tokenizer if it exists already (an existing one, or a trained one in the cache), else None."""
        if self._existing_tokenizer is not None:
            return self._existing_tokenizer
        return self.cache.cached_tokenizer(self.hparams.vocab_size, self.hparams.tokenizer_texts)

    # -- Lightning hooks --

    def prepare_data(self) -> None:
        """Train or load the tokenizer and pack the blocks (cached), then check both against the trainer's model and
        global batch: Lightning calls this before its loggers and callbacks write anything."""
        h = self.hparams
        if h.streaming:  # before any data work, cached or not (the corpus may have changed since)
            check_training_texts(h.corpus, h.text_column, h.val_texts)
        tokenizer = self._existing_tokenizer or self.cache.tokenizer(h.vocab_size, h.tokenizer_texts)
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
        if self.trainer is not None:
            self.check_blocks(info, self.trainer.world_size)

    def setup(self, stage: str | None = None) -> None:
        import datasets

        h = self.hparams
        self.tokenizer = self.cached_tokenizer()
        if self.tokenizer is None:
            raise UserError(f"tokenizer cache missing: {self.cache.tokenizer_dir(h.vocab_size, h.tokenizer_texts)} "
                            "(prepare_data did not run on this node?)")
        self._tokenizer_files = tokenizer_files(self.tokenizer)
        if self.trainer is not None:
            self.check_trainer(self.trainer)
        path = self.blocks_dir(self.tokenizer)
        if not (path / "blocks.json").exists():
            raise UserError(f"block cache missing: {path} (prepare_data did not run on this node?)")
        loaded = datasets.load_from_disk(str(path))
        self.train_blocks = None if h.streaming else BlockDataset(loaded["train"])
        self.val_blocks = BlockDataset(loaded["validation"])
        if h.objective == "causal":
            self.collator, self.val_collator = NextTokenCollator(h.next_token_share, h.seed), NextTokenCollator()
        else:
            self.collator = MaskCollator(self.tokenizer, h.block_length, h.mlm_probability, h.seed)
            self.val_collator = MaskCollator(self.tokenizer, h.block_length, h.mlm_probability, h.seed + 1)

    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def train_dataloader(self) -> DataLoader:
        h = self.hparams
        rank, world = self._rank_world()
        resume = self.position.begin(world)
        if h.streaming:
            dataset = StreamingBlocks(h.corpus, h.text_column, self.tokenizer, h.block_length, h.batch_size, rank,
                                      world, skip_texts=h.val_texts, start=self.position.stream,
                                      workers=self.position.workers)
            return self._loader(dataset, None, self.collator)
        self.check_blocks({"train": len(self.train_blocks)}, world)
        sampler = BlockSampler(len(self.train_blocks), h.batch_size, rank, world, h.seed, shuffle=True,
                               group=self.position.global_batch(world))
        sampler.resume(*self.position.begin_epochs(resume, len(sampler) * self.position.step))
        return self._loader(self.train_blocks, sampler, self.collator)

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        """Record the data position after each training batch the step consumes (not at fetch time: loaders
        prefetch), and strip a streaming batch's `stream_state` before it reaches the model."""
        state = batch.pop("stream_state", None) if isinstance(batch, dict) else None
        if self.trainer is not None and self.trainer.training:
            self.position.advance(state)
        return batch

    def val_dataloader(self) -> DataLoader:
        h = self.hparams
        rank, world = self._rank_world()
        sampler = BlockSampler(len(self.val_blocks), h.val_batch_size or h.batch_size, rank, world, shuffle=False)
        return self._loader(self.val_blocks, sampler, self.val_collator)

    def shrinkage_batches(self, epoch: int, max_tokens: int, rank: int, world: int):
        """This rank's share of up to `max_tokens` training tokens, unmasked, in batches of {"input_ids"}: I-STAR's
        C0 pass (lightning_modules/training.py). Cached blocks: the first blocks of a seeded permutation per epoch,
        rank r taking every world-th, so their union does not depend on the device count; streaming: the first
        blocks of this rank's stream."""
        h = self.hparams
        count = max(1, max_tokens // h.block_length)
        size = h.val_batch_size or h.batch_size
        if h.streaming:
            stream = StreamingBlocks(h.corpus, h.text_column, self.tokenizer, h.block_length, size, rank, world,
                                     skip_texts=h.val_texts)
            for taken, batch in enumerate(stream):
                if taken * size * world >= count:
                    return
                yield {"input_ids": torch.as_tensor(batch["blocks"])}
            return
        generator = torch.Generator().manual_seed(h.seed * 1_000_003 + 7_777 + epoch)
        chosen = torch.randperm(len(self.train_blocks), generator=generator)[:count][rank::world].tolist()
        for start in range(0, len(chosen), size):
            yield {"input_ids": torch.as_tensor(self.train_blocks[chosen[start:start + size]]["blocks"])}

    def _loader(self, dataset, sampler, collator) -> DataLoader:
        workers = self.hparams.num_workers
        return ResumableLoader(dataset, sampler=sampler, batch_size=None, collate_fn=collator, num_workers=workers,
                               pin_memory=torch.cuda.is_available(), persistent_workers=workers > 0,
                               prefetch_factor=4 if workers else None, worker_init_fn=ignore_sigterm if workers else None)

    # -- checks against the trainer and the model --

    def check_cache(self, vocab_rows: int, world_size: int) -> None:
        """Before the fit, on every rank: a tokenizer and blocks cached already, against the model's embedding rows
        and the global batch (what is not cached yet, prepare_data checks once it has made it)."""
        tokenizer = self.cached_tokenizer()
        if tokenizer is None:
            return
        self.check_vocab(tokenizer, vocab_rows)
        info = self.blocks_dir(tokenizer) / "blocks.json"
        if info.exists():
            self.check_blocks(json.loads(info.read_text()), world_size)

    def accumulation(self, world_size: int) -> int:
        """Gradient-accumulation steps that keep the global batch: global / (batch_size × world size)."""
        return self.position.accumulation(world_size)

    def check_trainer(self, trainer, apply: bool = True, tokenizer=None) -> None:
        """Accumulation from the global batch (set on the trainer when `apply`), and the block length and vocabulary
        (of `tokenizer`, default the loaded one) against the attached model's."""
        tokenizer = tokenizer if tokenizer is not None else self.tokenizer
        self.position.check_trainer(trainer, apply)
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

    def check_blocks(self, info: dict, world_size: int) -> None:
        """One line when the training blocks make no full global batch (the sampler drops partial ones), or when the
        validation blocks leave a rank without one (Lightning stops a DDP run whose rank has no validation batch).
        `info`: the block counts, {"train", "validation"} (either may be missing: a streamed corpus has no "train")."""
        num_blocks = info.get("train")
        if num_blocks is not None and num_blocks < self.position.global_batch(world_size):
            raise UserError(f"{num_blocks} training blocks make no full global batch of "
                            f"{self.position.global_batch(world_size)}")
        val = info.get("validation")
        validates = getattr(self.trainer, "limit_val_batches", 1) != 0 if self.trainer is not None else True
        if val is not None and val < world_size and validates:
            raise UserError(f"{plural(val, 'validation block')} cannot give each of the {world_size} "
                            "processes one: raise --data.val_fraction (or --data.max_val_blocks), or train on fewer "
                            "devices")

    # -- checkpointed state: the tokenizer's identity and the data position --

    def state_dict(self) -> dict:
        """The tokenizer's identity (and its files, as text) and the data position (datamodules/position.py)."""
        return {"tokenizer_fingerprint": fingerprint(self.tokenizer) if self.tokenizer is not None else None,
                "tokenizer_files": getattr(self, "_tokenizer_files", None), "block_length": self.hparams.block_length,
                **self.position.state(self._rank_world()[1])}

    def load_state_dict(self, state: dict) -> None:
        expected = state.get("tokenizer_fingerprint")
        current = fingerprint(self.tokenizer) if self.tokenizer is not None else None
        if expected is not None and current is not None and expected != current:
            raise UserError("the tokenizer does not match the checkpoint's (its vocabulary or merges differ); "
                            "resume with the tokenizer the run was started with")
        if state.get("block_length", self.hparams.block_length) != self.hparams.block_length:
            raise UserError(f"--data.block_length {self.hparams.block_length} differs from the checkpoint's "
                            f"{state['block_length']}")
        self.position.restore(state, *self._rank_world())

    def check_position(self, state: dict, world: int, source: str = "the checkpoint") -> None:
        self.position.check(state, world, source)

    def adapt_checkpoint(self, checkpoint: dict) -> None:
        """Lightning's saved micro-batch counts in this run's micro-batches (the MLM module calls this from
        on_load_checkpoint, before Lightning restores its loops)."""
        self.position.adapt(checkpoint.get(type(self).__qualname__) or {}, checkpoint, self._rank_world()[1])


def check_block_length(block_length: int, module) -> None:
    """One line when a block is longer than the MLM module's position table allows (its `max_length`: RoBERTa's
    positions start after the pad id, so max_position_embeddings - (pad id + 1)); no module, no check."""
    limit = getattr(module, "max_length", None)
    if limit is not None and block_length > limit:
        pad, table = module.model.config.pad_token_id, module.model.config.max_position_embeddings
        why = f"minus (pad id {pad} + 1)" if table > limit else "(rotary: positions from 0)"
        raise UserError(f"--data.block_length {block_length} exceeds the model's {limit} positions "
                        f"(--model.max_position_embeddings {table} {why})")
