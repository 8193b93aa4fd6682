"""Quirks of real checkpoints that default-built tiny models lack, each against a direct computation: a config.json
that records bfloat16 / float16 (real Llama, Qwen, Pythia, OPT checkpoints do; transformers 5 then loads the weights in
that dtype unless told otherwise), a Llama tokenizer that pads on the left, adds `<s>` only, has no pad token and a
model_max_length of 1e30, grouped-query attention with an explicit head_dim, sharded safetensors, a tokenizer that
truncates on the left, DistilBERT's sinusoidal position table. OPT-350m (post-LN, project_out): tests/test_families.py.

    .venv/bin/pytest tests/test_checkpoint_quirks.py -q
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModel, LlamaForCausalLM

from lightning_modules.encoder import load_encoder
from lightning_modules.finetune import load_classifier
from lightning_modules.pooling import mean_pool
from tests.tiny import MAX_POSITIONS, save_tiny_encoder
from tests.tiny_families import family_config, llama_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_fine_tuning_a_half_precision_checkpoint_starts_from_its_weights_in_float32(bert_tok, tmp_path):
    """A checkpoint saved in float16 (config.json's dtype float16) is fine-tuned with float32 weights (the trainer's
    precision decides what the forward computes in), equal to the saved ones; it was trained in float16 throughout."""
    path = save_tiny_encoder(tmp_path / "half", "bert", bert_tok, plant=lambda model: model.half())
    saved = load_file(path / "model.safetensors")
    assert {tensor.dtype for tensor in saved.values()} == {torch.float16}
    model, _ = load_classifier(str(path), ["no", "yes"])
    assert {parameter.dtype for parameter in model.parameters()} == {torch.float32}
    weights = model.base_model.state_dict()
    for name, tensor in saved.items():
        if name in weights:
            assert torch.equal(weights[name], tensor.float()), name


def test_a_left_padding_bos_only_llama_with_grouped_queries_and_a_bf16_config_is_read_in_float32_right_padded(
        tmp_path):
    """Llama as released: GQA (1 key-value head of 4 query heads), head_dim 16 != hidden / heads, config.json in
    bfloat16, sharded safetensors, untied head; a tokenizer that pads on the left, adds <s> only, has no pad token and
    says model_max_length 1e30. The encoder computes in float32 (the report's dtype), reads at most the config's
    positions, pads on the right whatever the tokenizer says (so <s> is every sentence's position 0 and padding comes
    after its real tokens), and each sentence's states and mean-pooled vector are those of it alone in float32."""
    tokenizer = llama_tokenizer(tmp_path / "tokenizer")
    torch.manual_seed(0)
    config = family_config("llama", len(tokenizer), num_key_value_heads=1, head_dim=16, bos_token_id=1,
                           eos_token_id=2, pad_token_id=None, tie_word_embeddings=False)
    path = tmp_path / "llama"
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path, max_shard_size="20KB")
    tokenizer.save_pretrained(path)
    assert len(list(path.glob("model-*.safetensors"))) > 1 and '"dtype": "bfloat16"' in (path / "config.json").read_text()

    encoder = load_encoder(str(path), device="cpu")
    assert {parameter.dtype for parameter in encoder.model.parameters()} == {torch.float32}
    assert encoder.max_length == MAX_POSITIONS and encoder.tokenizer.padding_side == "left"
    texts = ["She smiled.", "It is a truth universally acknowledged, that a single man must be in want of a wife."]
    inputs, _ = encoder.tokenize(texts)
    batch = encoder(**inputs)
    assert batch.input_ids[:, 0].tolist() == [tokenizer.bos_token_id] * 2
    pooled = mean_pool(batch.hidden_states, batch.mask)  # [layers, 2, hidden]
    direct = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    for row, text in enumerate(texts):
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        length = ids.shape[1]
        assert batch.attention_mask[row].tolist() == [1] * length + [0] * (batch.input_ids.shape[1] - length)
        with torch.no_grad():
            alone = torch.stack(direct(input_ids=ids, output_hidden_states=True).hidden_states)[:, 0]
        torch.testing.assert_close(batch.hidden_states[:, row, :length], alone, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pooled[:, row], alone.mean(1), rtol=1e-5, atol=1e-5)


def test_a_tokenizer_that_truncates_on_the_left_still_reads_each_sentence_from_its_start(bert_tok, tmp_path):
    """A tokenizer saved with truncation_side left (chat models' often are) would keep a long sentence's end: the
    encoder, and fine-tuning, cut the end instead, as a right-truncating tokenizer does, and the report's `covered`
    characters are those read; the tokenizer's own side is left as it was."""
    import csv

    from transformers import AutoTokenizer

    from datamodules.finetune import FineTuneDataModule
    from tests.tiny import corpus_sentences

    path = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    AutoTokenizer.from_pretrained(path, truncation_side="left").save_pretrained(path)
    encoder = load_encoder(str(path), device="cpu")
    tokenizer = encoder.tokenizer
    assert tokenizer.truncation_side == "left"
    texts = corpus_sentences(12, start=40)
    inputs, truncated = encoder.tokenize(texts, max_length=8, offsets=True)
    kept = bert_tok(texts, truncation=True, max_length=8, return_offsets_mapping=True)  # right-truncating: the start
    assert truncated == sum(len(ids) > 8 for ids in bert_tok(texts)["input_ids"]) > 0
    for row, (ids, offsets) in enumerate(zip(kept["input_ids"], kept["offset_mapping"], strict=True)):
        assert inputs["input_ids"][row, :len(ids)].tolist() == ids
        assert inputs["covered"][row] == (max(end for _, end in offsets) if len(ids) == 8 else len(texts[row]))
    assert tokenizer.truncation_side == "left"

    data = tmp_path / "labelled.csv"
    with open(data, "w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([["text", "label"], *([text, row % 2] for row, text in enumerate(texts * 3))])
    module = FineTuneDataModule(source=str(data), max_length=8)
    with pytest.warns(UserWarning, match="were truncated"):
        module.attach(tokenizer)
    for split in ("train", "val", "test"):
        expected = bert_tok([text for text, _ in module.splits.texts[split]], truncation=True, max_length=8)
        assert module.sets[split].encoded["input_ids"] == expected["input_ids"]
    assert tokenizer.truncation_side == "left"


@pytest.mark.parametrize("sinusoidal", [True, False])
def test_a_distilbert_with_sinusoidal_positions_is_named_a_table_of_fixed_sinusoids(bert_tok, sinusoidal):
    """DistilBERT's sinusoidal_pos_embds: its position table holds Vaswani et al.'s sinusoids (checked against the
    formula), frozen; the report's family says so instead of `learned table`."""
    from transformers import DistilBertModel

    from core.models import model_family
    from tests.tiny import HIDDEN, tiny_config

    model = DistilBertModel(tiny_config("distilbert", len(bert_tok), sinusoidal_pos_embds=sinusoidal))
    table = model.embeddings.position_embeddings.weight.detach()
    angles = torch.arange(MAX_POSITIONS)[:, None] / 10000 ** (torch.arange(0, HIDDEN, 2) / HIDDEN)  # [positions, d/2]
    formula = torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)  # sin at even dims, cos at odd ones
    assert torch.allclose(table, formula, atol=1e-5) is sinusoidal
    assert model_family(model).positions == ("fixed sinusoids (a frozen table)" if sinusoidal else "learned table")
