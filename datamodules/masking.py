"""Dynamic masking, done in the loader's workers: BERT's 15% rule with randomness tied to each block, not to the run.

    collator = MaskCollator(tokenizer, block_length=128, mlm_probability=0.15, seed=0)
    batch = collator({"blocks": blocks [batch, seq], "keys": keys [batch]})
    batch["input_ids"] [batch, seq], batch["positions"] [batch, k], batch["targets"] [batch, k]  (-100 = none)
    SentenceMasker(tokenizer, seed=0)(input_ids, attention_mask, keys)   # the same rule on padded sentences

Exactly round(0.15 × (block_length - 2)) non-special positions of each block are predicted (special: every id of
core.tokenizers.special_ids, the tokenizer's added tokens marked special included); of those 80% become <mask>, 10% a
random non-special token, 10% stay. The randomness of a block depends only on (seed, its key), and a
block's key is (epoch × blocks + index), so masks are the same whatever the device count, batch size, worker count
or resume point.

The causal arms (lightning_modules/arms.py) predict the next token instead, on the same blocks unmasked:

    collator = NextTokenCollator()
    batch = collator({"blocks": blocks [batch, seq], "keys": keys [batch]})
    batch["input_ids"] = blocks, batch["positions"] = 0..seq-3 [batch, seq - 2], batch["targets"] = blocks[:, 1:-1]
    NextTokenCollator(share=0.15, seed=0)   # ours: round(0.15 (seq - 2)) positions of each block, drawn per block key

The block's closing </s>, which the packing adds at its last position, is never a target: its place is fixed, so
predicting it would reward knowing the position (a no-position causal arm would be taught positions by it), and the
MLM never predicts a special token either. A text's own </s> inside the piece, where a text ends, is a target.
"""

from __future__ import annotations

import numpy as np
import torch

from core.tokenizers import special_ids, vocab_limit


class MaskCollator:
    """Blocks [batch, seq] + their keys [batch] → input_ids, positions [batch, k] and targets [batch, k] (see module doc)."""

    def __init__(self, tokenizer, block_length: int, mlm_probability: float = 0.15, seed: int = 0) -> None:
        # never masked nor drawn as a random replacement: every special token, added ones marked special included
        # (a hub tokenizer's reserved tokens; core.tokenizers.special_ids), <unk> too
        self.special = np.array(special_ids(tokenizer), dtype=np.int64)
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


class SentenceMasker:
    """MaskCollator's rule on padded sentences, each sentence its own block: round(0.15 × (length - 2)) of its
    non-special tokens (at least 1) are predicted, 80% of them become <mask>, 10% a random token, 10% stay, with the
    randomness tied to (seed, the sentence's key), so the masks are the same whatever the batching or the ranks
    (analyze.py intervene: the same masks for every variant of a model).

        masker = SentenceMasker(tokenizer, seed=0)
        batch = masker(input_ids, attention_mask, keys)   # [batch, seq] (right-padded), [batch], keys [batch]
        batch["input_ids"], batch["attention_mask"] [batch, seq]; batch["positions"], batch["targets"] [batch, k]
    """

    def __init__(self, tokenizer, mlm_probability: float = 0.15, seed: int = 0) -> None:
        self.tokenizer, self.mlm_probability, self.seed = tokenizer, mlm_probability, seed
        self.collators: dict[int, MaskCollator] = {}  # one per sentence length

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, keys) -> dict[str, torch.Tensor]:
        masked, picked = input_ids.clone(), []
        for row, (length, key) in enumerate(zip(attention_mask.sum(1).tolist(), keys)):
            if length not in self.collators:
                self.collators[length] = MaskCollator(self.tokenizer, length, self.mlm_probability, self.seed)
            out = self.collators[length]({"blocks": input_ids[row:row + 1, :length].numpy(), "keys": [int(key)]})
            masked[row, :length] = out["input_ids"][0]
            picked.append((out["positions"][0], out["targets"][0]))
        k = max((len(positions) for positions, _ in picked), default=0)
        positions = torch.zeros(len(picked), k, dtype=torch.long)
        targets = torch.full((len(picked), k), -100, dtype=torch.long)
        for row, (where, what) in enumerate(picked):
            positions[row, :len(where)], targets[row, :len(what)] = where, what
        return {"input_ids": masked, "attention_mask": attention_mask, "positions": positions, "targets": targets}


class NextTokenCollator:
    """Blocks [batch, seq] → input_ids (the blocks, unmasked), positions 0..seq-3 and targets the next tokens
    [batch, seq - 2], the block's closing </s> left out (module docstring): the causal objective in the MLM batch's
    form (lightning_modules/mlm.py's `mlm_step`). With `share` < 1 (ours), only round(share (seq - 2)) positions of
    each block are predicted, drawn (sorted) from (seed, the block's key) as MaskCollator draws its positions: as many
    predictions as the MLM's at share 0.15."""

    def __init__(self, share: float = 1.0, seed: int = 0) -> None:
        self.share, self.seed = share, seed

    def __call__(self, item: dict) -> dict[str, torch.Tensor]:
        blocks = np.asarray(item["blocks"], dtype=np.int64)  # [batch, seq]
        batch, length = blocks.shape
        predictable = length - 2  # positions 0..seq-3: the next tokens up to the piece's last, not the closing </s>
        if self.share >= 1:
            positions = np.broadcast_to(np.arange(predictable), (batch, predictable))
        else:
            k = max(1, round(self.share * predictable))
            positions = np.stack([np.sort(np.random.Generator(np.random.PCG64([self.seed, int(key)])).choice(
                predictable, size=k, replace=False)) for key in np.asarray(item["keys"], dtype=np.int64)])
        positions = np.ascontiguousarray(positions)
        out = {"input_ids": torch.from_numpy(blocks), "positions": torch.from_numpy(positions),
               "targets": torch.from_numpy(np.take_along_axis(blocks, positions + 1, axis=1))}
        if "stream_state" in item:
            out["stream_state"] = item["stream_state"]
        return out
