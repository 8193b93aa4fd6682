"""MLM pretraining pieces, checked against direct computations: tokenizer ids, packing, masking, sampling, the loss,
no-PE permutation equivariance and the SDPA path.

    .venv/bin/pytest tests/test_mlm.py -q
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from core.errors import UserError
from core.tokenizers import SPECIAL_TOKENS, fingerprint, load_tokenizer
from datamodules.blocks import pack_blocks, tokenize_texts
from datamodules.masking import MaskCollator
from datamodules.sampling import BlockSampler, StreamingBlocks
from datamodules.tokenizer import train_tokenizer
from lightning_modules.mlm import MLMModule, PolynomialSchedule, mlm_loss
from tests.tiny import corpus_sentences

TINY = dict(vocab_size=600, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=66, dropout=0.0)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return train_tokenizer(iter(corpus_sentences(1500)), vocab_size=600)


def test_trained_tokenizer_has_roberta_special_ids_and_survives_save(bpe, tmp_path):
    assert bpe.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2, 3, 4]
    assert (bpe.bos_token_id, bpe.pad_token_id, bpe.eos_token_id, bpe.unk_token_id, bpe.mask_token_id) == (0, 1, 2, 3, 4)
    ids = bpe("Emma was rich.")["input_ids"]
    assert ids[0] == 0 and ids[-1] == 2 and bpe.decode(ids[1:-1]) == "Emma was rich."
    bpe.save_pretrained(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again("Emma was rich.")["input_ids"] == ids
    assert fingerprint(again) == fingerprint(bpe)


def test_pack_blocks_are_bos_piece_eos_and_keep_the_token_stream(bpe):
    texts = corpus_sentences(40)
    ids = tokenize_texts(texts, bpe)
    blocks, rest = pack_blocks(ids, 16, bos=0, eos=2)
    stream = [t for row in ids for t in (*row, 2)]  # each text followed by </s>, computed directly
    assert all(len(b) == 16 and b[0] == 0 and b[-1] == 2 for b in blocks)
    assert [t for b in blocks for t in b[1:-1]] + rest == stream
    assert len(rest) < 14


def test_masking_picks_k_non_special_positions_with_80_10_10(bpe):
    length = 64
    collate = MaskCollator(bpe, length, 0.15, seed=3)
    rng = np.random.default_rng(0)
    blocks = rng.integers(5, len(bpe), size=(400, length))
    blocks[:, 0], blocks[:, -1], blocks[:, 30] = 0, 2, 2  # <s> ... </s> with a separator inside
    out = collate({"blocks": blocks, "keys": np.arange(400)})
    k = round(0.15 * (length - 2))
    assert out["positions"].shape == (400, k) and (out["targets"] != -100).all()
    positions, targets, inputs = out["positions"].numpy(), out["targets"].numpy(), out["input_ids"].numpy()
    assert not np.isin(positions, [0, 30, length - 1]).any()
    assert all(len(set(row)) == k for row in positions)
    assert (np.take_along_axis(blocks, positions, 1) == targets).all()
    untouched = np.ones_like(blocks, dtype=bool)
    np.put_along_axis(untouched, positions, False, 1)
    assert (inputs[untouched] == blocks[untouched]).all()
    placed = np.take_along_axis(inputs, positions, 1)
    masked, kept = (placed == bpe.mask_token_id).mean(), (placed == targets).mean()
    assert abs(masked - 0.8) < 0.02 and abs(kept - 0.1 - 0.1 / len(bpe)) < 0.015  # a random token can equal the target
    assert not np.isin(placed[placed != bpe.mask_token_id], [0, 1, 2, 3]).any()


def test_mask_of_a_block_depends_only_on_its_key(bpe):
    collate = MaskCollator(bpe, 32, 0.15, seed=0)
    blocks = np.random.default_rng(1).integers(5, len(bpe), size=(4, 32))
    together = collate({"blocks": blocks, "keys": np.array([10, 11, 12, 13])})
    alone = collate({"blocks": blocks[2:3], "keys": np.array([12])})
    assert torch.equal(together["input_ids"][2], alone["input_ids"][0])
    assert torch.equal(together["positions"][2], alone["positions"][0])
    other = collate({"blocks": blocks[2:3], "keys": np.array([99])})
    assert not torch.equal(other["positions"][0], alone["positions"][0])


def test_sampler_global_batches_do_not_depend_on_world_size_and_resume_skips():
    single = list(BlockSampler(50, 8, rank=0, world=1, seed=5, group=8))
    ranks = [list(BlockSampler(50, 4, rank=r, world=2, seed=5, group=8)) for r in range(2)]
    assert len(single) == 6 and all(len(r) == 6 for r in ranks)
    for step, batch in enumerate(single):
        assert sorted(batch) == sorted(ranks[0][step] + ranks[1][step])
    accumulated = list(BlockSampler(50, 4, rank=0, world=1, seed=5, group=8))
    assert [sorted(accumulated[2 * i] + accumulated[2 * i + 1]) for i in range(6)] == [sorted(b) for b in single]
    resumed = BlockSampler(50, 8, seed=5, group=8)
    resumed.resume(epoch=1, batches=4)
    straight = BlockSampler(50, 8, seed=5, group=8)
    first, second = list(straight), list(straight)  # the sampler counts its own epochs, one per pass
    assert list(resumed) == second[4:] and list(resumed) == list(straight)  # then it goes on with epoch 2
    assert all(key < 50 for batch in first for key in batch) and all(50 <= key < 100 for batch in second for key in batch)
    assert sorted(k % 50 for b in first for k in b) != [k % 50 for b in first for k in b]  # shuffled


def test_position_saves_the_global_batch_and_another_one_is_refused_unless_the_checkpoint_predates_it(tmp_path):
    from datamodules.mlm import MLMDataModule

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(corpus_sentences(20)) + "\n", encoding="utf-8")

    def data(batch_size: int, global_batch_size: int | None) -> MLMDataModule:
        return MLMDataModule(corpus=str(corpus), batch_size=batch_size, global_batch_size=global_batch_size,
                             cache_dir=str(tmp_path / "cache"))

    saver = data(4, None)  # no --data.global_batch_size: batch_size × world size, 4 × 2 devices
    saver.position.current = {"blocks": 24, "epoch": 0, "in_epoch": 24}  # 3 steps of 8 blocks
    saver._rank_world = lambda: (0, 2)
    state = saver.state_dict()
    assert state["position"]["global_batch"] == 4 * 2
    data(2, 8).check_position(state, world=2)  # the same global batch: 2 × 2 devices × 2 accumulated
    data(8, None).check_position(state, world=1)  # 8 × 1 device
    for other, world, given in ((data(4, 16), 2, 16), (data(4, None), 1, 4)):
        with pytest.raises(UserError) as error:
            other.check_position(state, world, "checkpoint x.ckpt")
        assert str(error.value) == (f"cannot resume: checkpoint x.ckpt was trained with global batch 8 but the config "
                                    f"gives {given}; keep the run's global batch (--data.global_batch_size 8)")
    older = {"position": {key: value for key, value in state["position"].items() if key != "global_batch"}}
    data(4, 16).check_position(older, world=2)  # a checkpoint from before the global batch was saved: accepted


def test_streaming_packs_this_ranks_texts_across_chunks_and_resumes_from_a_batch_state(bpe, tmp_path):
    texts = corpus_sentences(120)
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(texts) + "\n", encoding="utf-8")

    def stream(start=None):
        return StreamingBlocks(str(path), None, bpe, block_length=16, batch_size=2, rank=1, world=2, skip_texts=10,
                               start=start, chunk=7)

    batches = list(itertools.islice(iter(stream()), 5))
    expected, _ = pack_blocks(tokenize_texts(texts[11::2], bpe), 16, bos=0, eos=2)  # rank 1 of 2, after 10 held out
    got = [row.tolist() for batch in batches for row in batch["blocks"]]
    assert got == expected[:10]
    keys = [int(k) for batch in batches for k in batch["keys"]]
    assert len(set(keys)) == len(keys)
    resumed = list(itertools.islice(iter(stream(start=batches[2]["stream_state"])), 2))  # after 3 batches
    assert [row.tolist() for batch in resumed for row in batch["blocks"]] == got[6:10]
    assert [int(k) for batch in resumed for k in batch["keys"]] == keys[6:10]
    legacy = {"epoch": 0, "text": 0, "carry": [], "done": 6, "counter": 0}  # an old checkpoint: 3 batches to skip
    assert [int(k) for batch in itertools.islice(iter(stream(start=legacy)), 2) for k in batch["keys"]] == keys[6:10]


def test_streaming_resume_tokenises_one_chunk_not_the_consumed_texts(bpe, tmp_path, monkeypatch):
    import datamodules.sampling as sampling

    texts = corpus_sentences(400)
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(texts) + "\n", encoding="utf-8")
    tokenised = []
    original = sampling.tokenize_texts
    monkeypatch.setattr(sampling, "tokenize_texts", lambda chunk, tokenizer: tokenised.extend(chunk) or
                        original(chunk, tokenizer))

    def stream(start=None):
        return StreamingBlocks(str(path), None, bpe, block_length=32, batch_size=2, rank=0, world=2, skip_texts=4,
                               start=start, chunk=5)

    straight = list(itertools.islice(iter(stream()), 80))
    state = straight[69]["stream_state"]  # where rank 0 stood after its 70th batch
    consumed = state["text"]  # this rank's texts before the chunk the state points into, never tokenised again
    tokenised.clear()
    first = next(iter(stream(start=state)))
    assert consumed >= 60 and 0 < len(tokenised) <= 2 * 5  # the state's chunk (and the next if it ran out)
    assert set(tokenised).isdisjoint(texts[4:4 + 2 * consumed:2])  # none of this rank's texts before that chunk
    resumed = [first, *itertools.islice(iter(stream(start=state)), 1, 10)]
    for a, b in zip(resumed, straight[70:], strict=True):
        assert np.array_equal(a["blocks"], b["blocks"]) and np.array_equal(a["keys"], b["keys"])
    collate = MaskCollator(bpe, 32, seed=0)
    for a, b in zip(resumed, straight[70:], strict=True):
        masked_a, masked_b = collate(a), collate(b)
        assert masked_a["stream_state"] == masked_b["stream_state"]  # passed through for the datamodule
        assert all(torch.equal(masked_a[k], masked_b[k]) for k in ("input_ids", "positions", "targets"))


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")  # 3 workers on 2 cores, on purpose
def test_streaming_with_several_workers_shards_the_texts_and_resumes_in_the_same_order(bpe, tmp_path):
    """Rank 1 of 2 with 3 loader workers: worker j packs texts 1 + 2 j, + 6, + 12, ... (each text in one shard); the
    loader hands the workers' batches on in turn. Resumed from the state after 7 consumed batches (merged batch by
    batch, as the datamodule does), with fresh workers, it yields the same batches in the same order; a checkpoint
    read by another worker count is refused in one line."""
    from datamodules.position import DataPosition

    texts = corpus_sentences(240)
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(texts) + "\n", encoding="utf-8")

    def loader(start=None):
        dataset = StreamingBlocks(str(path), None, bpe, block_length=16, batch_size=2, rank=1, world=2, skip_texts=10,
                                  start=start, chunk=7, workers=3)
        return torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=3)

    straight = list(itertools.islice(iter(loader()), 12))
    for worker in range(3):
        expected, _ = pack_blocks(tokenize_texts(texts[10 + 1 + 2 * worker::6], bpe), 16, bos=0, eos=2)
        got = [row.tolist() for batch in straight[worker::3] for row in batch["blocks"]]
        assert got == expected[:len(got)] and [b["stream_state"]["shard"] for b in straight[worker::3]] == [worker] * 4
    keys = [int(k) for batch in straight for k in batch["keys"]]
    assert len(set(keys)) == len(keys)
    position = DataPosition(2, None, streaming=True, workers=3)
    position.current = {"blocks": 0, "epoch": 0, "in_epoch": 0}
    for batch in straight[:7]:
        position.advance(batch["stream_state"])
    assert position.stream["next"] == 1  # batch 8 comes from shard 1
    resumed = list(itertools.islice(iter(loader(start=position.stream)), 5))
    for a, b in zip(resumed, straight[7:], strict=True):
        assert np.array_equal(a["blocks"], b["blocks"]) and np.array_equal(a["keys"], b["keys"])
    saved = position.state(world=1)
    with pytest.raises(UserError) as error:
        DataPosition(2, None, streaming=True, workers=2).check(saved, world=1)
    assert str(error.value) == ("cannot resume a streaming run read by 3 loader workers per rank with "
                                "--data.num_workers giving 2 (each worker reads its own shard of the texts): resume "
                                "with --data.num_workers 3")


def test_polynomial_schedule_by_hand():
    schedule = PolynomialSchedule(warmup_steps=10, decay_steps=110, end_ratio=0.0, power=1.0)
    assert schedule(0) == pytest.approx(1 / 11) and schedule(9) == pytest.approx(10 / 11)
    assert schedule(10) == 1.0 and schedule(60) == pytest.approx(0.5) and schedule(110) == 0.0
    assert schedule(500) == 0.0


def test_a_resume_keeps_the_saved_schedule_so_a_run_past_its_end_at_rate_0_is_refused(monkeypatch):
    """LambdaLR saves PolynomialSchedule's fields: a resumed scheduler follows the checkpoint's end whatever the new
    settings say (the rate at step 7 is the saved schedule's, by hand). check_resumed_schedule: silent when the
    settings give the saved schedule, one line when steps past a rate-0 end would follow, else one warning."""
    import warnings
    from types import SimpleNamespace

    from pytorch_lightning.utilities import rank_zero_only

    from lightning_modules.training import check_resumed_schedule, check_warmup

    def scheduler(decay_steps, end_ratio=0.0):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, PolynomialSchedule(2, decay_steps, end_ratio))

    saved = scheduler(10)
    for _ in range(5):
        saved.optimizer.step()
        saved.step()
    state = saved.state_dict()
    resumed = scheduler(20)  # the settings now say 20: the state restores 10
    resumed.load_state_dict(state)
    for _ in range(2):
        resumed.optimizer.step()
        resumed.step()
    assert resumed.get_last_lr()[0] == pytest.approx(1 - (7 - 2) / (10 - 2))  # not 1 - 5 / 18
    settings = dict(lr=1.0, end_lr=0.0, warmup_steps=2, power=1.0)  # the saved scheduler's
    check_resumed_schedule([state], SimpleNamespace(decay_steps=None, **settings), 10, "C")  # the same: silent
    check_resumed_schedule([state], SimpleNamespace(decay_steps=10, **settings), 12, "C")  # asked for: steps at end_lr
    with pytest.raises(UserError, match=r"^checkpoint C ends its learning-rate schedule at step 10, and a resume keeps "
                                        r"it: steps 11\.\.20 \(--trainer.max_steps 20\) would train at a rate of 0"):
        check_resumed_schedule([state], SimpleNamespace(decay_steps=None, **settings), 20, "C")
    with pytest.warns(UserWarning, match=r"schedule \(to 0 x --model.lr at step 10\) is resumed as it was, not the one "
                                         r"the settings give \(0 x at step 30\)"):
        check_resumed_schedule([state], SimpleNamespace(decay_steps=30, **settings), 8, "C")  # stops before the end
    floor = scheduler(10, end_ratio=0.1).state_dict()  # a rate above 0 after the end: training there is real
    with pytest.warns(UserWarning, match=r"\(to 0.1 x --model.lr at step 10\) is resumed as it was"):
        check_resumed_schedule([floor], SimpleNamespace(decay_steps=None, **{**settings, "end_lr": 0.1}), 20, "C")
    check_resumed_schedule(None, SimpleNamespace(decay_steps=None, **settings), 20, "C")  # no schedule saved
    # warm-up, power and the peak rate are restored too (the fields and base_lrs above): a change is not followed
    for name, value in [("warmup_steps", 5), ("power", 2.0), ("lr", 3e-4)]:
        changed = SimpleNamespace(decay_steps=None, **{**settings, name: value, "end_lr": 0.0})
        with pytest.warns(UserWarning, match=rf"\(to 0 x --model.lr at step 10, --model.{name} {state_value(state, name):g}\) "
                                             rf"is resumed as it was, not the one the settings give \(0 x at step 10, "
                                             rf"--model.{name} {value:g}\)"):
            check_resumed_schedule([state], changed, 10, "C")
    # said by the first process only: every DDP process resumes the same checkpoint (the refusal stays on every rank)
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    with warnings.catch_warnings(record=True) as given:
        warnings.simplefilter("always")
        check_resumed_schedule([state], SimpleNamespace(decay_steps=30, **settings), 8, "C")
        check_warmup(warmup_steps=50, decay_steps=None, max_steps=20)
    assert given == []
    with pytest.raises(UserError, match=r"^checkpoint C ends its learning-rate schedule at step 10"):
        check_resumed_schedule([state], SimpleNamespace(decay_steps=None, **settings), 20, "C")
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    with pytest.warns(UserWarning, match=r"--model.warmup_steps 50 does not end before the learning-rate schedule"):
        check_warmup(warmup_steps=50, decay_steps=None, max_steps=20)


def state_value(state: dict, name: str) -> float:
    """A field of a saved LambdaLR's state: the schedule's, or its first base rate for `lr`."""
    return state["base_lrs"][0] if name == "lr" else state["lr_lambdas"][0][name]


def random_batch(vocab=600, batch=3, seq=20, k=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (batch, seq), generator=generator)
    ids[:, 0], ids[:, -1] = 0, 2
    positions = torch.stack([torch.randperm(seq - 2, generator=generator)[:k].sort().values + 1 for _ in range(batch)])
    targets = ids.gather(1, positions)
    targets[0, -1] = -100
    return {"input_ids": ids, "positions": positions, "targets": targets}


def test_masked_only_loss_equals_transformers_full_logits_loss():
    torch.manual_seed(0)
    module = MLMModule(**TINY).eval()
    batch = random_batch()
    labels = torch.full_like(batch["input_ids"], -100)
    keep = batch["targets"] != -100
    labels.scatter_(1, batch["positions"], torch.where(keep, batch["targets"], -100))
    with torch.no_grad():
        ours, count = mlm_loss(module.model, batch)
        reference = module.model(input_ids=batch["input_ids"], labels=labels).loss
    assert count == keep.sum()
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("position_embeddings", [False, True])
def test_permuting_tokens_permutes_hidden_states_only_without_pe(position_embeddings):
    torch.manual_seed(0)
    module = MLMModule(position_embeddings=position_embeddings, **TINY).eval()
    ids = torch.randint(5, 600, (2, 24))
    perm = torch.randperm(24)
    with torch.no_grad():
        hidden = module.model.roberta(input_ids=ids, output_hidden_states=True).hidden_states
        permuted = module.model.roberta(input_ids=ids[:, perm], output_hidden_states=True).hidden_states
    equal = [torch.allclose(h[:, perm], p, atol=1e-5) for h, p in zip(hidden, permuted, strict=True)]
    assert len(equal) == TINY["num_hidden_layers"] + 1  # the embeddings' output and each layer's
    if position_embeddings:
        assert not any(equal)
    else:
        assert all(equal)


@pytest.mark.parametrize("position_embeddings", [False, True])
def test_both_variants_run_sdpa_and_no_pe_table_is_zero_frozen_and_not_optimised(position_embeddings, monkeypatch):
    from transformers.integrations import sdpa_attention

    torch.manual_seed(0)
    module = MLMModule(position_embeddings=position_embeddings, **TINY, warmup_steps=0, decay_steps=10)
    assert module.model.config._attn_implementation == "sdpa"
    calls = []
    original = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(sdpa_attention.torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or original(*a, **k))
    loss, _ = mlm_loss(module.model, random_batch())
    assert len(calls) == TINY["num_hidden_layers"]  # every layer's attention went through SDPA

    table = module.model.roberta.embeddings.position_embeddings.weight
    names = {id(p): n for n, p in module.model.named_parameters()}
    trained = {id(p) for p in module.model.parameters() if p.requires_grad}
    optimizer = module.configure_optimizers()["optimizer"]  # fairseq's way (the default): every parameter decays
    decayed, undecayed = ({id(p) for p in group["params"]} for group in optimizer.param_groups)
    assert decayed == trained and not undecayed and (id(table) in decayed) is position_embeddings
    assert optimizer.param_groups[0]["weight_decay"] == TINY.get("weight_decay", 0.01)
    module.hparams.decay_bias_and_norm = False  # the option: biases and LayerNorm weights exempt
    decayed, undecayed = ({id(p) for p in group["params"]}
                          for group in module.configure_optimizers()["optimizer"].param_groups)
    assert decayed | undecayed == trained and (id(table) in decayed | undecayed) is position_embeddings
    exempt = ("bias", "LayerNorm.weight", "layer_norm.weight")  # RoBERTa's LayerNorms and the LM head's layer_norm
    assert undecayed == {i for i in trained if names[i].endswith(exempt)}
    optimizer = module.configure_optimizers()["optimizer"]

    loss.backward()
    before = table.detach().clone()
    optimizer.step()
    assert table.requires_grad is position_embeddings
    if position_embeddings:
        assert before.abs().sum() > 0 and not torch.equal(before, table)
    else:
        assert table.grad is None and table.abs().sum() == 0


def test_block_cache_key_follows_corpus_tokenizer_and_block_length_and_is_reused(bpe, tmp_path, monkeypatch):
    import os

    import datamodules.blocks as blocks
    import datamodules.mlm as mlm
    from datamodules.mlm import MLMDataModule

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(corpus_sentences(200)) + "\n", encoding="utf-8")
    bpe.save_pretrained(tmp_path / "tokenizer")
    other = train_tokenizer(iter(corpus_sentences(300, start=4000)), vocab_size=600)
    other.save_pretrained(tmp_path / "other")
    builds, trainings = [], []
    build, train = mlm.build_blocks, blocks.train_tokenizer
    monkeypatch.setattr(mlm, "build_blocks", lambda output, *a, **k: builds.append(output) or build(output, *a, **k))
    monkeypatch.setattr(blocks, "train_tokenizer", lambda *a, **k: trainings.append(1) or train(*a, **k))

    def prepared(tokenizer="tokenizer", block_length=32) -> Path:
        data = MLMDataModule(corpus=str(corpus), tokenizer=str(tmp_path / tokenizer) if tokenizer != "train" else
                             "train", vocab_size=300, block_length=block_length, cache_dir=str(tmp_path / "cache"))
        data.prepare_data()
        path = data.blocks_dir(data.cached_tokenizer())
        assert (path / "blocks.json").exists()
        return path

    first = prepared()
    assert prepared() == first and builds == [first]  # the second prepare_data reuses the cache
    assert prepared(block_length=16) != first
    assert prepared(tokenizer="other") != first
    trained = prepared(tokenizer="train")
    assert prepared(tokenizer="train") == trained and len(trainings) == 1  # the trained tokenizer is cached too
    assert len(builds) == 4 and len(set(builds)) == 4
    stat = corpus.stat()
    text = corpus.read_text(encoding="utf-8")
    assert "Elinor" in text
    corpus.write_text(text.replace("Elinor", "Marian", 1), encoding="utf-8")  # an edit of the same size ...
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # ... that moves its mtime
    edited = prepared()
    assert corpus.stat().st_size == stat.st_size and edited not in builds[:4] and builds[-1] == edited
    corpus.write_text(text + "One more sentence.\n", encoding="utf-8")
    assert prepared() not in (first, edited) and len(builds) == 6


def test_a_cache_build_removes_the_staging_directory_a_killed_build_left_and_not_a_live_ones(tmp_path, monkeypatch,
                                                                                             capsys):
    """The tokenizer and block caches stage in .staging-<host>-<pid>-* (core.output.new_stage, staged_output's own):
    a build killed mid-way leaves one, which the next build into the same cache directory removes (its pid, of a
    process that has exited, no longer running), one warning line each; a live build's (this process's pid) stays.
    Each build's own staging directory has the name that makes it removable (read back by core.output's pattern)."""
    import subprocess

    import datamodules.blocks as blocks
    from core.output import STAGE_NAME, host_tag

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(corpus_sentences(200)) + "\n", encoding="utf-8")
    cache = blocks.BlockCache(str(corpus), None, None, str(tmp_path / "cache"))
    exited = subprocess.Popen(["true"])
    exited.wait(timeout=30)
    planted = {}
    for kind in ("tokenizers", "blocks"):
        for whose, pid in (("dead", exited.pid), ("live", os.getpid())):
            directory = cache.root / kind / f".staging-{host_tag()}-{pid}-k2j4_x9q"
            directory.mkdir(parents=True)
            (directory / "part.bin").write_bytes(b"x" * 2048)
            planted[kind, whose] = directory
    stages = []
    publish = blocks.publish_directory
    monkeypatch.setattr(blocks, "publish_directory", lambda staged, target: stages.append(staged) or publish(staged,
                                                                                                              target))
    tokenizer = cache.tokenizer(vocab_size=300, tokenizer_texts=1000)
    assert not planted["tokenizers", "dead"].exists() and planted["blocks", "dead"].exists()  # only its own directory
    output = cache.blocks_dir(tokenizer, 32, {"val": 0.1})
    info = blocks.build_blocks(output, str(corpus), None, None, tokenizer, 32, 0.1, 8, None)
    assert (output / "blocks.json").is_file() and sum(info.values()) > 2
    assert not planted["blocks", "dead"].exists()
    assert all((planted[kind, "live"] / "part.bin").stat().st_size == 2048 for kind in ("tokenizers", "blocks"))
    own = [stage if stage.name.startswith(".staging-") else stage.parent for stage in stages]
    assert len(own) == 2 and all(STAGE_NAME.fullmatch(stage.name)["pid"] == str(os.getpid()) for stage in own)
    assert all(not stage.exists() for stage in own)
    warned = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: removed")]
    assert warned == [f"warning: removed {planted[kind, 'dead']} (2.0 KiB), the staging directory of a run that ended "
                      f"without finishing (pid {exited.pid} on {host_tag()}, no longer running)"
                      for kind in ("tokenizers", "blocks")]


@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")
def test_gradient_clip_val_clips_the_update_by_global_norm(monkeypatch, tmp_path):
    """One Lightning step with --trainer.gradient_clip_val equals loss.backward + clip_grad_norm_ + AdamW by hand."""
    import pytorch_lightning as pl

    import lightning_modules.mlm as mlm_module

    monkeypatch.setattr(mlm_module, "export", lambda *args: None)  # no tokenizer here: skip the export at fit end
    torch.manual_seed(0)
    module = MLMModule(**TINY, lr=1e-2, warmup_steps=0, decay_steps=10)
    initial = {name: value.clone() for name, value in module.state_dict().items()}
    batch = random_batch()
    clip = 1e-4  # far below the gradient norm, and small enough that Adam's eps makes the update depend on it

    def by_hand(max_norm: float) -> tuple[dict, float, float]:
        twin = MLMModule(**TINY, lr=1e-2, warmup_steps=0, decay_steps=10)
        twin.load_state_dict(initial)
        optimizer = twin.configure_optimizers()["optimizer"]  # lr × schedule(0) = lr
        loss, _ = mlm_loss(twin.model, batch)
        loss.backward()
        parameters = [p for p in twin.model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        optimizer.step()
        return twin.state_dict(), float(norm), float(loss.detach())

    clipped, norm, loss = by_hand(clip)
    unclipped, _, _ = by_hand(float("inf"))
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, gradient_clip_val=clip, logger=False, log_every_n_steps=1,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([batch], batch_size=None))
    assert norm > 100 * clip
    assert float(trainer.callback_metrics["train/grad_norm"]) == pytest.approx(norm, rel=1e-5)  # logged before clipping
    assert float(trainer.callback_metrics["train/loss"]) == pytest.approx(loss, rel=1e-6)  # logged at the interval
    weights = module.state_dict()
    for name, value in clipped.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-7, msg=name)
    moved = max(float((weights[name] - unclipped[name]).abs().max()) for name in unclipped)
    assert moved > 1e-3  # the unclipped update is clearly another one (lr 1e-2)


# ---- the token-type row: fairseq's (zero, frozen) by default, transformers' learned row as an option ----

@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")
@pytest.mark.parametrize("token_type_embeddings", [False, True])
def test_token_type_row_stays_zero_through_training_steps_unless_asked_for(token_type_embeddings, monkeypatch,
                                                                           tmp_path):
    import pytorch_lightning as pl

    import lightning_modules.mlm as mlm_module

    monkeypatch.setattr(mlm_module, "export", lambda *args: None)  # no tokenizer here: skip the export at fit end
    torch.manual_seed(0)
    module = MLMModule(**TINY, lr=1e-2, warmup_steps=0, decay_steps=10, token_type_embeddings=token_type_embeddings)
    row = module.model.roberta.embeddings.token_type_embeddings.weight
    before = row.detach().clone()
    assert (before.abs().sum() == 0) is not token_type_embeddings  # transformers' init draws a non-zero row
    trainer = pl.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([random_batch(seed=s) for s in range(3)],
                                                                      batch_size=None))
    optimizer = trainer.optimizers[0]
    in_optimizer = any(p is row for group in optimizer.param_groups for p in group["params"])
    assert row.requires_grad is in_optimizer is (row in optimizer.state) is token_type_embeddings
    if token_type_embeddings:
        assert not torch.equal(before, row.detach())  # learned: three Adam steps moved it
    else:
        assert row.grad is None and row.abs().sum() == 0


def test_export_with_the_zero_row_gives_plain_transformers_the_same_hidden_states(bpe, tmp_path):
    from transformers import RobertaForMaskedLM, RobertaModel

    from lightning_modules.mlm import export

    torch.manual_seed(0)
    module = MLMModule(**TINY).eval()
    with torch.no_grad():  # a trained-looking model: every other weight moved off its initialisation
        for parameter in module.model.parameters():
            if parameter.requires_grad:
                parameter.add_(0.02 * torch.randn_like(parameter))
    export(module, bpe, tmp_path / "export")
    ids = random_batch()["input_ids"]
    with torch.no_grad():
        ours = module.model.roberta(input_ids=ids, output_hidden_states=True).hidden_states
        for cls in (RobertaModel, RobertaForMaskedLM):
            plain = cls.from_pretrained(tmp_path / "export").eval()
            body = plain if cls is RobertaModel else plain.roberta
            assert body.embeddings.token_type_embeddings.weight.abs().sum() == 0
            theirs = body(input_ids=ids, output_hidden_states=True).hidden_states
            assert len(ours) == TINY["num_hidden_layers"] + 1  # every layer compared, none left out of the zip
            for layer, (a, b) in enumerate(zip(ours, theirs, strict=True)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{cls.__name__} layer {layer}")
        # the row counts: the same weights with a non-zero row give other hidden states (a random one: a constant
        # row would be taken out again by the embedding LayerNorm)
        body.embeddings.token_type_embeddings.weight.copy_(torch.randn(1, TINY["hidden_size"]))
        assert not torch.allclose(body(input_ids=ids).last_hidden_state, ours[-1], atol=1e-3)


def test_resuming_a_checkpoint_of_another_token_type_row_is_one_line():
    from lightning_modules.mlm import check_architecture

    current = {"position_embeddings": True, "token_type_embeddings": False}
    check_architecture({"token_type_embeddings": False}, current, "the checkpoint")
    check_architecture({}, {**current, "token_type_embeddings": True}, "x")  # before the option: a learned row
    with pytest.raises(UserError, match=r"^the checkpoint was trained with a learned token-type row \(made before the "
                                        r"zero row became the default\) but the config asks for fairseq's zero, frozen "
                                        r"token-type row; resume with --model.token_type_embeddings true$"):
        check_architecture({}, current, "the checkpoint")
    with pytest.raises(UserError, match=r"trained with fairseq's zero, frozen token-type row but the config asks for "
                                        r"a learned token-type row; resume with --model.token_type_embeddings false$"):
        check_architecture({"token_type_embeddings": False}, {**current, "token_type_embeddings": True}, "x")


def test_the_fingerprint_ignores_the_truncation_and_padding_a_call_rewrites(minilm_path, bpe):
    """A sentence-transformers tokenizer.json saves truncation (max_length 128) and fixed padding; transformers clears
    them on the first call, so the block cache's key (and the resume check) must not depend on them: the fingerprint
    before and after a call are equal, and equal to the one of the backend with both cleared by hand."""
    import hashlib

    tokenizer = load_tokenizer(minilm_path)
    backend = tokenizer.backend_tokenizer
    assert backend.truncation is not None and backend.padding is not None  # as saved
    before = fingerprint(tokenizer)
    tokenize_texts(corpus_sentences(3), tokenizer)
    assert backend.truncation is None and backend.padding is None  # the call rewrote them
    assert fingerprint(tokenizer) == before
    assert before == hashlib.sha256(backend.to_str().encode("utf-8")).hexdigest()[:16]
    # a tokenizer saved without them keeps the digest of its whole definition (existing caches and checkpoints match)
    assert fingerprint(bpe) == hashlib.sha256(bpe.backend_tokenizer.to_str().encode("utf-8")).hexdigest()[:16]


def test_a_re_export_of_another_shard_layout_leaves_no_stale_shard_that_transformers_would_read(bpe, tmp_path,
                                                                                                monkeypatch):
    """An export in one model.safetensors, then a bigger one sharded (model-0000i-of-0000n.safetensors + the index)
    into the same directory: transformers prefers model.safetensors to the index, so the first export's file, left
    beside the second, was what it loaded. Each export removes the weight files its predecessor wrote and it does not
    (core.output's owner record): the loaded weights are the second model's (compared tensor by tensor), the files
    are exactly the ones save_pretrained wrote; and back to one file, the shards and index are gone."""
    from functools import partialmethod

    from transformers import PreTrainedModel, RobertaForMaskedLM

    from lightning_modules.mlm import export

    directory = tmp_path / "export"
    modules = []
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        modules.append(MLMModule(**TINY).eval())
    export(modules[0], bpe, directory)
    assert (directory / "model.safetensors").is_file()
    with monkeypatch.context() as patch:  # the second, "bigger" model: sharded as a big one would be
        patch.setattr(PreTrainedModel, "save_pretrained",
                      partialmethod(PreTrainedModel.save_pretrained, max_shard_size="100KB"))
        export(modules[1], bpe, directory)
    for index, module in ((1, modules[1]), (2, modules[2])):
        if index == 2:
            export(module, bpe, directory)  # one file again
        loaded = RobertaForMaskedLM.from_pretrained(directory).state_dict()
        compared = [key for key in module.model.state_dict() if key in loaded]
        assert len(compared) > 10
        for key in compared:
            torch.testing.assert_close(loaded[key], module.model.state_dict()[key], rtol=0, atol=0,
                                       msg=f"export {index} {key}")
        files = sorted(path.name for path in directory.glob("model*.safetensors*"))
        if index == 1:
            assert "model.safetensors.index.json" in files and len(files) >= 3 and "model.safetensors" not in files
        else:
            assert files == ["model.safetensors"]


@pytest.mark.parametrize("legacy", ["single", "sharded"])
def test_a_re_export_over_an_export_made_before_the_record_removes_its_weights_and_none_of_the_users_files(
        bpe, tmp_path, monkeypatch, legacy):
    """An export made before the .written_by record existed (one whose record is gone), in one layout, plus an older
    transformers' pytorch_model.bin; then an export in the other layout. Its weight files that transformers would load
    go: the single files, the old index and the shards it names (before, a legacy model.safetensors stayed beside the
    new index and was what transformers loaded). The user's files stay: a note, weights no index names
    (pytorch_model-mine.bin, mine.safetensors), a non-weight file and paths out of the directory that the old index
    names. Expected: the files of the same export into an empty directory, plus the user's; the weights loaded are
    the new model's, tensor by tensor."""
    import json
    from functools import partialmethod

    from transformers import PreTrainedModel, RobertaForMaskedLM

    from core.output import OWNERS
    from lightning_modules.mlm import export

    sharded = partialmethod(PreTrainedModel.save_pretrained, max_shard_size="100KB")
    modules = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        modules.append(MLMModule(**TINY).eval())
    directory, clean = tmp_path / "export", tmp_path / "clean"
    with monkeypatch.context() as patch:
        if legacy == "sharded":
            patch.setattr(PreTrainedModel, "save_pretrained", sharded)
        export(modules[0], bpe, directory)
    (directory / OWNERS).unlink()  # as an export made before the record existed
    torch.save(modules[0].model.state_dict(), directory / "pytorch_model.bin")
    outside = tmp_path / "outside.safetensors"
    user = {"notes.txt": b"mine", "pytorch_model-mine.bin": b"mine", "mine.safetensors": b"mine"}
    for name, content in [*user.items(), ("../outside.safetensors", b"mine")]:
        (directory / name).write_bytes(content)
    index = directory / "model.safetensors.index.json"
    if legacy == "sharded":
        shards = set(json.loads(index.read_text())["weight_map"].values())
        assert len(shards) >= 2 and all((directory / shard).is_file() for shard in shards)
        record = json.loads(index.read_text())
        record["weight_map"].update({"a": "notes.txt", "b": "../outside.safetensors", "c": str(outside)})
        index.write_text(json.dumps(record))
    with monkeypatch.context() as patch:
        if legacy == "single":
            patch.setattr(PreTrainedModel, "save_pretrained", sharded)
        export(modules[1], bpe, directory)
        export(modules[1], bpe, clean)
    expected = sorted([*(path.name for path in clean.iterdir()), *user])
    assert sorted(path.name for path in directory.iterdir()) == expected
    assert ("model.safetensors" in expected) == (legacy == "sharded") and "pytorch_model.bin" not in expected
    assert all((directory / name).read_bytes() == content for name, content in user.items())
    assert outside.read_bytes() == b"mine"
    loaded = RobertaForMaskedLM.from_pretrained(directory).state_dict()
    weights = modules[1].model.state_dict()
    assert len([key for key in weights if key in loaded]) > 10
    for key in (key for key in weights if key in loaded):
        torch.testing.assert_close(loaded[key], weights[key], rtol=0, atol=0, msg=key)
