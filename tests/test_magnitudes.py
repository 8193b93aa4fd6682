"""Bondarenko et al.'s per-sequence kurtosis and inf-norm, massive activations (Sun et al.), the magnitude criterion
(ours) and attention sinks (Gu et al.), each against a computation made another way: scipy and their own formula on
flattened sequences, planted values, Gaussian noise, attention weights read off a tiny model by hand; and DDP with 2
processes equal to 1."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import scipy.stats
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from metrics.magnitude import MagnitudeCounts, MagnitudeRule
from metrics.massive import MassiveActivations, MassiveRule, histogram_quantile
from metrics.neuron_stats import BONDARENKO_EPS, NeuronStatistics
from metrics.outliers import OutlierRule, detect_outliers
from metrics.sinks import AttentionSinks, attention_key_mass, key_attention
from tests.tiny import free_port

LAYERS, HIDDEN = 3, 24


def ragged_batches(seed: int, n: int = 4):
    """[layers, batch, seq, hidden] with ragged masks (a row without any token too), one dimension planted large."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for index in range(n):
        batch, seq = 5, int(torch.randint(3, 9, (1,), generator=generator))
        hidden = torch.randn(LAYERS, batch, seq, HIDDEN, generator=generator)
        hidden[:, :, :, 7] += 6.0 * torch.rand(LAYERS, batch, seq, generator=generator)
        mask = torch.rand(batch, seq, generator=generator) > 0.3
        mask[:, 0] = True
        if index == 1:
            mask[2] = False  # a sequence without a counted token: not a sequence of the average
        ids = torch.randint(5, 100, (batch, seq), generator=generator)
        batches.append((hidden, mask, ids))
    return batches


def their_kurtosis(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers_language/utils.py of outlier-free-transformers, verbatim: x (B, d)."""
    mu = x.mean(dim=1, keepdims=True)
    s = x.std(dim=1)
    mu4 = ((x - mu) ** 4.0).mean(dim=1)
    return mu4 / (s ** 4.0 + eps)


def direct_sequences(batches):
    """Per layer, over the sequences with a token: the mean of scipy's kurtosis of the flattened tokens x hidden
    values turned into theirs (m4 / (s^4 + eps), s with n - 1), the same from their own function, and the mean
    max |x|."""
    scipy_based, theirs, inf = [], [], []
    for hidden, mask, _ in batches:
        for row in range(mask.shape[0]):
            if not mask[row].any():
                continue
            values = hidden[:, row, mask[row]].flatten(1).double()  # [layers, tokens * hidden]
            n = values.shape[1]
            pearson = scipy.stats.kurtosis(values.numpy(), axis=1, fisher=False, bias=True)  # m4 / m2^2
            m2 = values.var(1, unbiased=False).numpy()
            scipy_based.append(pearson * m2 ** 2 / ((m2 * n / (n - 1)) ** 2 + BONDARENKO_EPS))
            theirs.append(their_kurtosis(values).numpy())
            inf.append(values.abs().amax(1).numpy())
    return np.mean(scipy_based, 0), np.mean(theirs, 0), np.mean(inf, 0), len(inf)


def test_bondarenko_kurtosis_and_inf_norm_equal_scipy_and_their_code_on_flattened_sequences():
    batches = ragged_batches(0)
    metric = NeuronStatistics(LAYERS, HIDDEN)
    for hidden, mask, _ in batches:
        metric.update(hidden, mask)
    result = metric.compute()
    by_scipy, by_theirs, inf, count = direct_sequences(batches)
    assert result.num_sequences == count == sum(int(m.any(1).sum()) for _, m, _ in batches)
    np.testing.assert_allclose(result.kurtosis_sequence.numpy(), by_scipy, rtol=1e-5)
    np.testing.assert_allclose(result.kurtosis_sequence.numpy(), by_theirs, rtol=1e-5)
    np.testing.assert_allclose(result.inf_norm_sequence.numpy(), inf, rtol=1e-6)
    rows = result.magnitudes()
    assert rows[1]["kurtosis_sequence"] == pytest.approx(by_scipy[1], rel=1e-5)
    # [layers, tokens, hidden] input has no sequences: the keys are None, the per-token ones still there, each token
    # vector's Pearson kurtosis around its own mean (scipy, fisher=False, bias=True), averaged over the tokens
    flat = NeuronStatistics(LAYERS, HIDDEN)
    tokens = batches[0][0].flatten(1, 2)
    flat.update(tokens)
    per_token = scipy.stats.kurtosis(tokens.double().numpy(), axis=2, fisher=False, bias=True)  # [layers, tokens]
    for layer, row in enumerate(flat.compute().magnitudes()):
        assert row["kurtosis_sequence"] is None and row["inf_norm_sequence"] is None
        assert row["kurtosis_mean"] == pytest.approx(per_token[layer].mean(), rel=1e-5, abs=1e-6)
        assert row["kurtosis_max"] == pytest.approx(per_token[layer].max(), rel=1e-5, abs=1e-6)


def test_massive_activation_planted_is_found_with_its_dimension_position_token_and_ratio():
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(LAYERS, 6, 10, HIDDEN, generator=generator)
    mask = torch.ones(6, 10, dtype=torch.bool)
    mask[4, 7:] = False
    ids = torch.randint(5, 90, (6, 10), generator=generator)
    hidden[1, 3, 4, 5] = -500.0  # layer 1, sequence 3, position 4, dimension 5
    hidden[2, 4, 8, 6] = 1e4  # padding: never counted
    metric = MassiveActivations(LAYERS, HIDDEN)
    metric.update(hidden[:, :3], mask[:3], ids[:3])
    metric.update(hidden[:, 3:], mask[3:], ids[3:])
    result = metric.compute()
    top = int(result.top(1)[1, 0])
    assert top == 5 and result.peak_value[1, 5] == -500.0
    assert int(result.peak_position[1, 5]) == 4 and int(result.peak_token[1, 5]) == int(ids[3, 4])
    assert float(result.peak_abs[2].max()) < 10  # the padded 1e4 was not counted
    exact = hidden[:, mask].abs().flatten(1).median(1).values.double()
    np.testing.assert_allclose(result.median.numpy(), exact.numpy(), rtol=0.019)  # the histogram's resolution
    assert result.num_values == int(mask.sum()) * HIDDEN
    ratio = 500 / float(result.median[1])
    assert MassiveRule().passes(-500.0, float(result.median[1])) and ratio > 20
    assert not MassiveRule().passes(float(result.peak_abs[0].max()), float(result.median[0]))  # Gaussian: ~ 5 / 0.67
    assert not MassiveRule("sun").passes(-500.0, float(result.median[1]))  # 500 / 0.67 < 1000
    assert MassiveRule("sun", ratio=500).passes(-500.0, float(result.median[1]))
    assert not MassiveRule("sun", ratio=500, min_abs=600).passes(-500.0, float(result.median[1]))


def test_histogram_median_within_its_resolution_at_any_scale():
    generator = torch.Generator().manual_seed(2)
    for scale in (1e-4, 1.0, 3e3):
        values = (torch.randn(1, 4, 50, 16, generator=generator) * scale)
        metric = MassiveActivations(1, 16)
        metric.update(values)
        exact = float(values.abs().flatten().median())
        assert float(metric.compute().median[0]) == pytest.approx(exact, rel=0.019)
    empty = torch.zeros(2, 770, dtype=torch.long)
    assert torch.isnan(histogram_quantile(empty, 0.5)).all()


def gaussian_tokens(seed: int, tokens: int = 17000, hidden: int = 128) -> torch.Tensor:
    return torch.randn(1, tokens, hidden, generator=torch.Generator().manual_seed(seed))


def test_magnitude_criterion_finds_a_planted_outlier_and_nothing_in_gaussian_noise():
    rule = MagnitudeRule()
    noise = gaussian_tokens(3)
    counts = MagnitudeCounts(1, 128, rule)
    counts.update(noise)
    assert rule.outliers(*counts.compute()) == [[]]  # 128-dim Gaussian token vectors: no dimension passes
    planted = noise.clone()
    planted[0, :10200, 41] += -8.0  # a real outlier, far out in 60% of the tokens (MiniLM's 223: 41-69%)
    counts = MagnitudeCounts(1, 128, rule)
    counts.update(planted[:, :9000])
    counts.update(planted[:, 9000:])
    found = rule.outliers(*counts.compute())
    rms = planted.pow(2).mean(-1, keepdim=True).sqrt()
    share = float((planted[0, :, 41].abs() > 4 * rms[0, :, 0]).double().mean())
    assert [d for d, _ in found[0]] == [41] and found[0][0][1] == pytest.approx(share, abs=1e-6) and share > 0.55
    # a mild offset (-2.5 sd) passes the paper's share rule in a 128-dim model but not the magnitude criterion
    mild = noise.clone()
    mild[0, :, 9] -= 2.5
    stats = NeuronStatistics(1, 128)
    stats.update(mild)
    assert 9 in detect_outliers(stats.compute(), OutlierRule())[0].outlier_dims
    counts = MagnitudeCounts(1, 128, rule)
    counts.update(mild)
    above, total = counts.compute()
    assert rule.outliers(above, total) == [[]] and 0.02 < float(above[0, 9]) / total < 0.1


def test_int8_rule_is_a_fixed_threshold_of_six():
    rule = MagnitudeRule("int8")
    assert (rule.threshold, rule.min_share) == (6.0, 0.06)
    tokens = gaussian_tokens(4, tokens=2000, hidden=32)
    tokens[0, :160, 3] = 6.5  # 8% of the tokens at 6.5
    tokens[0, :100, 4] = 6.5  # 5%: below the share
    tokens[0, :, 5] *= 50  # huge spread: |x| >= 6 in about 90% of the tokens whatever the RMS
    counts = MagnitudeCounts(1, 32, rule)
    counts.update(tokens)
    found = dict(rule.outliers(*counts.compute())[0])
    expected = (tokens[0].abs() >= 6).double().mean(0)
    assert sorted(found) == [3, 5] and found[5] == pytest.approx(float(expected[5]), abs=1e-6)
    assert found[3] == pytest.approx(float(expected[3]), abs=1e-6) and found[3] >= 0.08  # the planted 8%, and noise


def test_int8_rule_counts_exactly_six_and_rms_rule_stays_strict():
    """LLM.int8's "magnitude of at least 6" (the rule's own description: >=): a bf16 / fp16 activation can be 6.0
    exactly; the rms rule keeps its strict >, checked against the formula computed by hand."""
    tokens = torch.zeros(1, 50, 4)
    tokens[0, :, 0] = 6.0  # exactly the threshold, in every token
    tokens[0, :, 1] = -6.0
    tokens[0, :, 2] = 5.999  # just below
    rule = MagnitudeRule("int8")
    counts = MagnitudeCounts(1, 4, rule)
    counts.update(tokens.bfloat16())
    above, total = counts.compute()
    assert above[0].tolist() == [50, 50, 50 if torch.tensor(5.999).bfloat16() == 6 else 0, 0] and total == 50
    assert [d for d, _ in rule.outliers(above, total)[0]][:2] == [0, 1]
    flat = torch.ones(1, 10, 16)  # RMS 1: |x| = 4 is exactly 4 RMS, not above it
    flat[0, :, 3] = 4.0
    rms = MagnitudeRule()
    by_hand = (flat.abs() > 4 * flat.pow(2).mean(-1, keepdim=True).sqrt()).sum(1)
    counts = MagnitudeCounts(1, 16, rms)
    counts.update(flat)
    assert torch.equal(counts.compute()[0], by_hand)


def test_massive_peak_ties_go_to_the_smaller_position_whatever_the_batching():
    """Two tokens share a dimension's largest |x| (bf16 massive activations at the first token and a delimiter tie
    often): the docstring's rule (the smaller position, then the smaller token id) picks the same one in one batch,
    one sentence per batch in either order, and (test_ddp_two_processes_equal_one) across ranks."""
    hidden = torch.randn(1, 3, 6, 4, generator=torch.Generator().manual_seed(5))
    hidden[0, 0, 3, 1] = 50.0  # sentence 0, position 3, token 7
    hidden[0, 1, 2, 1] = -50.0  # sentence 1, position 2, token 9: the same |x| at a smaller position
    hidden[0, 2, 2, 1] = 50.0  # sentence 2, position 2 too, token 8: the smaller token id wins
    hidden[0, 2, 5, 2] = -80.0  # no tie elsewhere
    hidden[0, 0, 5, 2] = 70.0
    ids = torch.tensor([[1, 2, 3, 7, 4, 4], [11, 5, 9, 8, 4, 4], [12, 5, 8, 8, 4, 4]])
    orders = {"one batch": [[0, 1, 2]], "one at a time": [[0], [1], [2]], "reversed": [[2], [1], [0]],
              "pairs": [[0, 2], [1]]}
    for name, batches in orders.items():
        metric = MassiveActivations(1, 4)
        for rows in batches:
            metric.update(hidden[:, rows], None, ids[rows])
        result = metric.compute()
        assert (int(result.peak_position[0, 1]), int(result.peak_token[0, 1])) == (2, 8), name
        assert float(result.peak_value[0, 1]) == 50.0, name
        assert (int(result.peak_position[0, 2]), float(result.peak_value[0, 2])) == (5, -80.0), name


def test_key_mass_from_queries_and_keys_equals_the_softmax_weights():
    generator = torch.Generator().manual_seed(5)
    queries, keys = torch.randn(2, 2, 7, 4, 8, generator=generator).unbind(0)  # [batch, seq, heads, head_dim]
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3], dtype=torch.bool)
    scores = torch.einsum("bqhd,bkhd->bhqk", queries, keys) / 8 ** 0.5
    probs = scores.masked_fill(~mask[:, None, None, :], float("-inf")).softmax(-1)
    expected = key_attention(probs, mask)
    torch.testing.assert_close(attention_key_mass(queries, keys, mask, mask, chunk=3), expected)
    by_hand = torch.stack([probs[b, :, mask[b]].mean(1) for b in range(2)])  # mean over real queries
    torch.testing.assert_close(expected, by_hand)


def sink_inputs(seed: int, layers: int = 2, batch: int = 6, heads: int = 3, seq: int = 9):
    generator = torch.Generator().manual_seed(seed)
    probs = torch.rand(layers, batch, heads, seq, seq, generator=generator) ** 4
    probs[..., 0] += torch.rand(layers, batch, heads, 1, generator=generator) * 3  # some heads lean on token 0
    mask = torch.rand(batch, seq, generator=generator) > 0.25
    mask[:, 0] = True
    probs = probs.masked_fill(~mask[None, :, None, None, :], 0)
    probs = probs / probs.sum(-1, keepdim=True)
    kinds = torch.full((batch, seq), -1)
    kinds[:, 0] = 0
    kinds[torch.arange(batch), mask.sum(1) - 1] = 1  # a [SEP] at each sequence's last token
    return probs, mask, kinds


def test_sink_share_and_special_mass_by_hand_loops():
    probs, mask, kinds = sink_inputs(6)
    masses = torch.stack([key_attention(p, mask) for p in probs])
    sinks = AttentionSinks(2, 3, epsilon=0.3, num_kinds=2)
    sinks.update(masses, mask, kinds)
    result = sinks.compute()
    for layer in range(2):
        first, sink, special = [], [], np.zeros(2)
        for b in range(6):
            queries = mask[b].nonzero().flatten().tolist()
            for h in range(3):
                rows = [probs[layer, b, h, i] for i in queries]
                first.append(sum(float(r[0]) for r in rows) / len(rows))
                sink.append(first[-1] > 0.3)
                for kind in (0, 1):
                    special[kind] += sum(float(r[k]) for r in rows for k in range(9) if kinds[b, k] == kind) / len(rows)
        assert float(result["sink_share"][layer]) == pytest.approx(np.mean(sink), abs=1e-9)
        assert 0 < np.mean(sink) < 1
        assert float(result["first_token_mass"][layer]) == pytest.approx(np.mean(first), abs=1e-6)
        np.testing.assert_allclose(result["special_mass"][layer].numpy(), special / 18, atol=1e-6)


def _ddp_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(run_metrics(rank, world), out) if rank == 0 else run_metrics(rank, world)
    finally:
        dist.destroy_process_group()


def run_metrics(rank: int, world: int) -> dict:
    """The new metrics over this rank's share of the batches (uneven), computed (synced under DDP)."""
    massive, counts, stats = MassiveActivations(LAYERS, HIDDEN), MagnitudeCounts(LAYERS, HIDDEN), \
        NeuronStatistics(LAYERS, HIDDEN)
    for hidden, mask, ids in ragged_batches(7, n=5)[rank::world]:
        massive.update(hidden, mask, ids)
        counts.update(hidden, mask)
        stats.update(hidden, mask)
    sinks = AttentionSinks(2, 3, epsilon=0.2, num_kinds=2)
    for seed in (8, 9, 10)[rank::world]:
        probs, mask, kinds = sink_inputs(seed)
        sinks.update(torch.stack([key_attention(p, mask) for p in probs]), mask, kinds)
    peaks, above, result = massive.compute(), counts.compute(), stats.compute()
    return {"median": peaks.median, "peak_abs": peaks.peak_abs, "peak_position": peaks.peak_position,
            "peak_token": peaks.peak_token, "above": above[0], "count": above[1],
            "kurtosis_sequence": result.kurtosis_sequence, "inf_norm_sequence": result.inf_norm_sequence,
            **{f"sinks_{key}": value for key, value in sinks.compute().items()}}


def test_ddp_two_processes_equal_one(tmp_path):
    out = str(tmp_path / "synced.pt")
    mp.start_processes(_ddp_worker, args=(2, free_port(), out), nprocs=2, start_method="spawn", join=True)
    synced, single = torch.load(out), run_metrics(0, 1)
    assert synced.keys() == single.keys()
    for key, value in single.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(synced[key], value, rtol=1e-9, atol=1e-12, msg=key)
        else:
            assert synced[key] == value, key


def test_attention_weights_run_eager_and_restore_the_implementation(tmp_path, bert_tok):
    from transformers import AutoModel

    from lightning_modules.attention import CLIPPED, install_attention
    from lightning_modules.encoder import FrozenEncoder, load_encoder
    from tests.tiny import corpus_sentences, save_tiny_encoder, tiny_config

    encoder = load_encoder(save_tiny_encoder(tmp_path / "bert", "bert", bert_tok), device="cpu")
    texts = [text for text in corpus_sentences(30, start=100) if text][:6]
    plain = next(encoder.batches(texts, batch_size=6, progress=False))
    assert encoder.model.config._attn_implementation == "sdpa" and plain.attention_mass is None
    with encoder.attention_weights():
        assert encoder.model.config._attn_implementation == "eager"
        eager = next(encoder.batches(texts, batch_size=6, progress=False))
        direct = encoder.model(input_ids=eager.input_ids, attention_mask=eager.attention_mask, output_attentions=True)
    torch.testing.assert_close(eager.hidden_states, plain.hidden_states, atol=1e-5, rtol=1e-5)  # float rounding
    torch.testing.assert_close(eager.attention_mass, torch.stack([key_attention(a, eager.mask)
                                                                  for a in direct.attentions]))
    assert eager.attention_mass.shape == (3, 6, 4, eager.mask.shape[1])
    assert encoder.model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="inside"):
        with encoder.attention_weights():
            raise RuntimeError("inside")
    assert encoder.model.config._attn_implementation == "sdpa"  # restored on an error too
    # an implementation that returns its weights is kept: clipped softmax (its weights, clipped, are the ones read)
    model = install_attention(AutoModel.from_config(tiny_config("bert", len(bert_tok))), "clipped_softmax",
                              gamma=-0.025, zeta=1.0)
    clipped = FrozenEncoder(model, bert_tok)
    with clipped.attention_weights():
        assert model.config._attn_implementation == CLIPPED
        read = next(clipped.batches(texts, batch_size=6, progress=False))
    assert model.config._attn_implementation == CLIPPED
    # by hand: layer 1 reads the embeddings whatever the attention, so its weights are clip(1.025 p - 0.025, 0, 1) of
    # the plain softmax p of the same weights (an eager twin), each key's averaged over the counted queries
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("eager")
    with torch.no_grad():
        p = twin(input_ids=read.input_ids, attention_mask=read.attention_mask, output_attentions=True).attentions[0]
    weights = ((1.0 + 0.025) * p.double() - 0.025).clamp(0, 1)
    queries = read.mask.double()
    by_hand = torch.einsum("bhqk,bq->bhk", weights, queries) / queries.sum(1)[:, None, None]
    torch.testing.assert_close(read.attention_mass[0].double(), by_hand, atol=1e-6, rtol=1e-5)
    plain_mass = torch.einsum("bhqk,bq->bhk", p.double(), queries) / queries.sum(1)[:, None, None]
    assert not torch.allclose(read.attention_mass[0].double(), plain_mass, atol=1e-4)  # the clipped weights are read


def test_attention_pass_encodes_long_batches_a_few_rows_at_a_time(tmp_path, bert_tok, monkeypatch):
    """The sinks' pass holds every layer's attention probabilities of what it encodes at once (output_attentions): a
    batch over ATTENTION_BUDGET goes through the model in slices of its padded rows, and the sinks equal those of
    whole batches (the same rows: float rounding only)."""
    from analyses import magnitudes as module
    from analyses.reference import Setting
    from lightning_modules.encoder import load_encoder
    from tests.tiny import corpus_sentences, save_tiny_encoder

    encoder = load_encoder(save_tiny_encoder(tmp_path / "bert", "bert", bert_tok), device="cpu")
    texts = [text for text in corpus_sentences(40, start=200) if text][:11]
    calls, forward = [], encoder.model.forward

    def recording(*args, **kwargs):
        calls.append(tuple(kwargs["input_ids"].shape))
        return forward(*args, **kwargs)

    monkeypatch.setattr(encoder.model, "forward", recording)

    def sinks() -> dict:
        metrics = module.Magnitudes(encoder)
        metrics.attention_pass(Setting(encoder, batch_size=4, progress=False), texts)
        return metrics.sinks.compute()

    whole = sinks()
    assert [rows for rows, _ in calls] == [4, 4, 3]  # the budget holds these batches whole
    layers, heads = encoder.num_layers, whole["first_token_mass_by_head"].shape[1]
    seq = max(width for _, width in calls)
    calls.clear()
    budget = 2 * layers * heads * seq * seq * 4  # two rows of the widest batch
    monkeypatch.setattr(module, "ATTENTION_BUDGET", budget)
    sliced = sinks()
    assert sum(rows for rows, _ in calls) == len(texts) and len(calls) > 3
    assert all(layers * rows * heads * width * width * 4 <= budget or rows == 1 for rows, width in calls)
    assert sliced["num_sequences"] == whole["num_sequences"] == len(texts)
    for key in ("sink_share", "first_token_mass", "first_token_mass_by_head", "special_mass"):
        torch.testing.assert_close(sliced[key], whole[key], rtol=1e-5, atol=1e-6, msg=key)
