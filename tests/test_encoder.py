"""The frozen-encoder loader on BERT, RoBERTa, DistilBERT and ALBERT: hidden states, masks, clipping, truncation."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from core.errors import UserError
from lightning_modules.encoder import FrozenEncoder, load_encoder
from metrics.transforms import clip_spec, keep_mask, zero_dims
from tests.tiny import HIDDEN, LAYERS, MAX_POSITIONS, corpus_sentences, save_planted, save_tiny_encoder

SENTENCES = corpus_sentences(6, start=100)


@pytest.fixture(params=["bert", "roberta", "distilbert", "albert"])
def encoder_dir(request, tmp_path, bert_tok, roberta_tok):
    tokenizer = roberta_tok if request.param == "roberta" else bert_tok
    return save_tiny_encoder(tmp_path / request.param, request.param, tokenizer)


def reference_hidden_states(path, texts, max_length):
    """All hidden states straight from transformers, one sentence at a time (no padding at all)."""
    model, tokenizer = AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    accepted = set(inspect.signature(model.forward).parameters)  # DistilBERT takes no token_type_ids
    out = []
    for text in texts:
        inputs = tokenizer(text, return_tensors="pt", truncation=True, max_length=max_length)
        inputs = {key: value for key, value in inputs.items() if key in accepted}
        with torch.no_grad():
            out.append(torch.stack(model(**inputs, output_hidden_states=True).hidden_states)[:, 0])
    return out  # list of [layers, seq, hidden]


def test_hidden_states_match_transformers(encoder_dir):
    encoder = load_encoder(encoder_dir)
    assert (encoder.num_hidden_states, encoder.hidden_size) == (LAYERS + 1, HIDDEN)
    assert encoder.max_length == MAX_POSITIONS  # RoBERTa: 66 table rows minus the padding offset of 2
    expected = reference_hidden_states(encoder_dir, SENTENCES, encoder.max_length)
    inputs, truncated = encoder.tokenize(SENTENCES)
    batch = encoder(**inputs)
    assert batch.hidden_states.shape[:2] == (LAYERS + 1, len(SENTENCES))
    for row, reference in enumerate(expected):
        length = int(batch.mask[row].sum())
        assert length == reference.shape[1]
        torch.testing.assert_close(batch.hidden_states[:, row, :length], reference, atol=1e-5, rtol=1e-4)
    assert not encoder.training and not any(p.requires_grad for p in encoder.parameters())


def test_sizes_are_read_from_the_model(tmp_path, bert_tok):
    path = save_tiny_encoder(tmp_path / "wide", "bert", bert_tok, hidden_size=48, num_hidden_layers=5,
                             max_position_embeddings=40)
    encoder = load_encoder(path)
    assert (encoder.num_hidden_states, encoder.hidden_size, encoder.max_length) == (6, 48, 40)


def test_clipping_global_and_per_layer(tmp_path, bert_tok):
    """The one zeroing of dimensions (metrics.transforms: clip_spec -> keep_mask -> zero_dims) on the encoder's
    hidden states: a plain list of dims in every layer, a {layer: dims} spec in that layer only, ranges checked."""
    path = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    encoder = load_encoder(path)
    inputs, _ = encoder.tokenize(SENTENCES)
    reference = encoder(**inputs).hidden_states
    layers = encoder.num_hidden_states

    def clipped(clip):
        return zero_dims(reference, keep_mask(clip_spec(clip, layers, HIDDEN), layers, HIDDEN))

    globally, expected = clipped([3, 7]), reference.clone()
    expected[..., [3, 7]] = 0  # by hand: those dims zeroed in every layer, everything else untouched
    assert reference[..., [3, 7]].abs().sum() > 0
    torch.testing.assert_close(globally, expected, rtol=0, atol=0)
    per_layer, expected = clipped({2: [11]}), reference.clone()
    expected[2, ..., 11] = 0  # dim 11 of layer 2 only
    assert reference[:, ..., 11].abs().sum() > 0
    torch.testing.assert_close(per_layer, expected, rtol=0, atol=0)
    with pytest.raises(UserError, match="outside the model's dimensions"):
        clip_spec([HIDDEN], layers, HIDDEN)
    with pytest.raises(UserError, match="outside the model's layers"):
        clip_spec({layers: [0]}, layers, HIDDEN)


def test_exclude_special_masks_cls_and_sep(tmp_path, bert_tok):
    path = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    inputs, _ = load_encoder(path).tokenize(SENTENCES)
    batch = load_encoder(path, exclude_special=True)(**inputs)
    special = {bert_tok.cls_token_id, bert_tok.sep_token_id, bert_tok.pad_token_id}
    counted = batch.input_ids[batch.mask]
    assert not any(int(token) in special for token in counted)
    assert int(batch.mask.sum()) == int(inputs["attention_mask"].sum()) - 2 * len(SENTENCES)


def test_truncation_is_counted_and_warned(tmp_path, bert_tok):
    encoder = load_encoder(save_tiny_encoder(tmp_path / "bert", "bert", bert_tok))
    texts = [*SENTENCES[:3], " ".join(["the"] * 200), "A short one."]
    expected = sum(len(bert_tok(text)["input_ids"]) > 16 for text in texts)
    assert 0 < expected < len(texts)
    with pytest.warns(UserWarning, match=f"^{expected} sentences were longer than 16"):
        batches = list(encoder.batches(texts, batch_size=2, max_length=16, progress=False))
    assert sum(b.num_truncated for b in batches) == expected
    assert max(b.hidden_states.shape[2] for b in batches) == 16
    with pytest.raises(UserError, match="exceeds the 64 positions"):
        encoder.check_max_length(65)


def test_batches_cover_every_sentence_once(tmp_path, bert_tok):
    encoder = load_encoder(save_tiny_encoder(tmp_path / "bert", "bert", bert_tok))
    texts = corpus_sentences(37, start=500)
    with pytest.warns(UserWarning, match=r"\d+ sentences were longer than 64 tokens and were truncated"):
        batches = list(encoder.batches(texts, batch_size=8, max_length=64, progress=False, sort_buffer=2))
    expected = bert_tok(texts, truncation=True, max_length=64)["input_ids"]  # each sentence tokenised on its own
    got = {row: batch.input_ids[i][batch.mask[i]].tolist() for batch in batches for i, row in enumerate(batch.rows)}
    assert sorted(row for batch in batches for row in batch.rows) == list(range(len(texts)))  # each row once
    assert got == dict(enumerate(expected))  # and each row holds its own sentence's tokens, padding out
    assert sum(int(b.mask.sum()) for b in batches) == sum(min(len(ids), 64) for ids in bert_tok(texts)["input_ids"])


def test_model_without_hidden_states_is_rejected(tmp_path, bert_tok):
    class NoHidden(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.inner, self.config = model, model.config

        def forward(self, input_ids, attention_mask, **kwargs):
            return {"last_hidden_state": self.inner(input_ids=input_ids, attention_mask=attention_mask)[0],
                    "hidden_states": None}

    class NoOption(NoHidden):
        def forward(self, input_ids, attention_mask):
            return super().forward(input_ids, attention_mask)

    model = AutoModel.from_pretrained(save_tiny_encoder(tmp_path / "bert", "bert", bert_tok))
    encoder = FrozenEncoder(NoHidden(model), bert_tok, name="wrapped")
    inputs, _ = encoder.tokenize(SENTENCES[:2])
    with pytest.raises(UserError, match="wrapped returned no hidden states"):
        encoder(**inputs)
    with pytest.raises(UserError, match="cannot return hidden states"):
        FrozenEncoder(NoOption(model), bert_tok, name="plain")


def test_loader_errors(tmp_path):
    from transformers import BartConfig, BartModel

    with pytest.raises(UserError, match="encoder path not found"):
        load_encoder(tmp_path / "missing")
    with pytest.raises(UserError, match="cannot load encoder 'no-such-org/no-such-model'"):
        load_encoder("no-such-org/no-such-model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no config.json"):
        load_encoder(tmp_path / "empty")
    BartModel(BartConfig(encoder_layers=1, decoder_layers=1, d_model=16, encoder_attention_heads=2,
                         decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, vocab_size=50)
              ).save_pretrained(tmp_path / "bart")  # decoders load (tests/test_families.py); encoder-decoders never
    with pytest.raises(UserError, match="'bart' encoder-decoder model; only encoders and decoder-only models"):
        load_encoder(tmp_path / "bart")


def test_bfloat16_hidden_states_close_to_float32_and_counted(tmp_path, bert_tok):
    from metrics.neuron_stats import NeuronStatistics

    path = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    full = load_encoder(path, device="cpu")
    half = load_encoder(path, device="cpu", dtype=torch.bfloat16)
    inputs, _ = full.tokenize(SENTENCES)
    reference, batch = full(**inputs), half(**inputs)
    assert reference.hidden_states.dtype == torch.float32 and batch.hidden_states.dtype == torch.bfloat16
    assert torch.equal(batch.mask, reference.mask)
    exact, rounded = reference.hidden_states[:, reference.mask], batch.hidden_states[:, batch.mask].float()
    # bf16 keeps 8 significant bits (relative step 2**-8 = 0.4%): a few steps of error after LAYERS layers.
    relative = (rounded - exact).norm(dim=-1) / exact.norm(dim=-1)  # [layers, tokens]
    assert relative.max() < 0.03

    stats = NeuronStatistics(LAYERS + 1, HIDDEN)
    stats.update(batch.hidden_states, batch.mask)  # bf16 in, upcast inside
    result = stats.compute()
    direct = rounded.double()  # [layers, tokens, hidden]
    assert result.num_tokens == direct.shape[1] and result.mean.dtype == torch.float64
    torch.testing.assert_close(result.mean, direct.mean(1))
    torch.testing.assert_close(result.var, direct.var(1, unbiased=False), atol=1e-6, rtol=1e-6)
    holders = (direct == direct.amax(-1, keepdim=True)).double()  # [layers, tokens, hidden]: bf16's coarse values tie
    assert int((holders.sum(-1) > 1).sum()) > 0  # here too: each tie is split among its dims, not given to the first
    torch.testing.assert_close(result.argmax_count, (holders / holders.sum(-1, keepdim=True)).sum(1), rtol=0,
                               atol=1e-9)


def test_a_masked_lm_checkpoint_loads_quietly_and_a_missing_encoder_weight_is_named(tmp_path, roberta_tok):
    """A masked-LM checkpoint read as an encoder drops its head and lacks the pooler: expected, no warning, and the
    hidden states equal the masked-LM's own encoder. A checkpoint missing an encoder weight is named in a warning."""
    import warnings

    from safetensors.torch import load_file, save_file
    from transformers import RobertaForMaskedLM

    from tests.tiny import tiny_config

    torch.manual_seed(0)
    masked_lm = RobertaForMaskedLM(tiny_config("roberta", len(roberta_tok))).eval()
    path = tmp_path / "mlm"
    masked_lm.save_pretrained(path)
    roberta_tok.save_pretrained(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        encoder = load_encoder(path)
    assert not [w for w in caught if "weights" in str(w.message)]
    inputs, _ = encoder.tokenize(SENTENCES[:2])
    with torch.no_grad():
        expected = masked_lm.roberta(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                     output_hidden_states=True).hidden_states
    torch.testing.assert_close(encoder(**inputs).hidden_states, torch.stack(expected))

    weights = load_file(path / "model.safetensors")
    dropped = next(key for key in weights if key.endswith("layer.1.output.dense.weight"))
    save_file({key: value for key, value in weights.items() if key != dropped}, path / "model.safetensors",
              metadata={"format": "pt"})
    total = sum(1 for key in encoder.model.state_dict() if not key.startswith("pooler."))
    with pytest.raises(UserError, match=rf"^encoder {path}: 1 of its {total} weights are not in the checkpoint \(e\.g\. "
                                        r"encoder\.layer\.1\.output\.dense\.weight\): .*randomly initialised; "
                                        r"--allow_random_weights analyses such a partly random model$"):
        load_encoder(path)  # refused by default (issue 31)
    with pytest.warns(UserWarning, match=r"not in the checkpoint \(randomly initialised\): .*layer\.1\.output\.dense\.weight"):
        load_encoder(path, allow_random_weights=True)


def test_a_context_named_otherwise_is_the_limit(tmp_path, bert_tok):
    """MPT names its context `max_seq_len` (its ALiBi biases are built for that many positions): a sentence longer
    than it is truncated there, not at the tokenizer's 64, which would crash MPT's attention."""
    from transformers import MptConfig, MptModel

    torch.manual_seed(0)
    model = MptModel(MptConfig(vocab_size=len(bert_tok), d_model=16, n_layers=1, n_heads=2, max_seq_len=12))
    directory = save_planted(model, bert_tok, tmp_path / "mpt")
    encoder = load_encoder(directory)
    assert bert_tok.model_max_length > 12 and encoder.max_length == 12
    text = " ".join(["the"] * 40)
    with pytest.warns(UserWarning, match="^1 sentence was longer than 12"):
        (batch,) = list(encoder.batches([text], batch_size=1, progress=False))
    ids = torch.tensor([bert_tok(text, truncation=True, max_length=12)["input_ids"]])
    with torch.no_grad():
        expected = model(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(batch.hidden_states[:, 0], torch.stack(expected)[:, 0].float())
