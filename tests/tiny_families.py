"""Tiny random decoders (GPT-2, Llama, GPT-NeoX, OPT) and rotary encoders (ModernBERT, RoFormer) for unit tests.

    tokenizer = decoder_tokenizer(tmp_path)                     # byte-level BPE of the corpus, eos but no pad token
    tokenizer = llama_tokenizer(tmp_path)                       # Llama's: <s> only, left padding, model_max_length 1e30
    path = save_tiny_family(tmp_path / "gpt2", "gpt2", tokenizer, plant=lambda model: ...)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from tests.tiny import HIDDEN, LAYERS, MAX_POSITIONS, corpus_sentences, save_planted

DECODERS = ("gpt2", "llama", "gpt_neox", "opt")
ROTARY_ENCODERS = ("modernbert", "roformer")
FAMILIES = DECODERS + ROTARY_ENCODERS


def decoder_tokenizer(directory: Path, vocab_size: int = 600):
    """A GPT-2-style byte-level BPE of the bundled corpus: `</s>` is bos, eos and unk, and there is no pad token (as
    GPT-2's and Llama's own tokenizers)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2TokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(corpus_sentences(2000), vocab_size=vocab_size, min_frequency=1,
                                special_tokens=["</s>"])
    trainer.save_model(str(directory))
    return GPT2TokenizerFast(vocab=str(directory / "vocab.json"), merges=str(directory / "merges.txt"),
                             bos_token="</s>", eos_token="</s>", unk_token="</s>", model_max_length=MAX_POSITIONS)


def family_config(kind: str, vocab_size: int, **overrides):
    """A tiny config of `kind` (HIDDEN wide, LAYERS deep, 4 heads, no dropout), special ids 0 / 1 / 2."""
    import transformers as tf

    ids = dict(bos_token_id=0, eos_token_id=0 if kind in DECODERS else 2, pad_token_id=1)
    common = dict(vocab_size=vocab_size, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=MAX_POSITIONS, **ids)
    configs = {
        "gpt2": lambda: tf.GPT2Config(vocab_size=vocab_size, n_embd=HIDDEN, n_layer=LAYERS, n_head=4, n_inner=64,
                                      n_positions=MAX_POSITIONS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      **ids),
        "llama": lambda: tf.LlamaConfig(**common, num_key_value_heads=2),
        "gpt_neox": lambda: tf.GPTNeoXConfig(**common, hidden_dropout=0.0, attention_dropout=0.0),
        "opt": lambda: tf.OPTConfig(**{k: v for k, v in common.items() if k != "intermediate_size"}, ffn_dim=64,
                                    word_embed_proj_dim=HIDDEN, dropout=0.0, attention_dropout=0.0),
        "modernbert": lambda: tf.ModernBertConfig(**common, cls_token_id=0, sep_token_id=2, embedding_dropout=0.0,
                                                  attention_dropout=0.0, mlp_dropout=0.0),
        "roformer": lambda: tf.RoFormerConfig(**common, embedding_size=HIDDEN, hidden_dropout_prob=0.0,
                                              attention_probs_dropout_prob=0.0),
    }
    config = configs[kind]()
    config.update(overrides)
    return config


def save_tiny_family(directory: Path, kind: str, tokenizer, plant: Callable | None = None, seed: int = 0,
                     **overrides) -> Path:
    """A random tiny model of `kind` (transformers' AutoModel of the config) saved with its tokenizer; `plant(model)`
    edits weights before saving."""
    from transformers import AutoModel

    torch.manual_seed(seed)
    return save_planted(AutoModel.from_config(family_config(kind, len(tokenizer), **overrides)), tokenizer, directory,
                        plant)


def llama_tokenizer(directory: Path, vocab_size: int = 600):
    """A Llama-style tokenizer as real Llama checkpoints ship one: SentencePiece-like BPE (Metaspace) of the corpus,
    `<unk>` `<s>` `</s>` = 0 1 2, adds `<s>` only (no `</s>`), no pad token, padding_side left, and a
    model_max_length of 1e30 ("no limit": the model's config says how long an input may be)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaTokenizer

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    backend.train_from_iterator(corpus_sentences(2000), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], min_frequency=1))
    model = json.loads(backend.to_str())["model"]
    merges = [tuple(merge.split(" ")) if isinstance(merge, str) else tuple(merge) for merge in model["merges"]]
    tokenizer = LlamaTokenizer(vocab=model["vocab"], merges=merges, add_bos_token=True, padding_side="left",
                               model_max_length=int(1e30))
    tokenizer.save_pretrained(directory)
    return tokenizer
