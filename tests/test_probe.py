"""Probes on planted signals: position recovered from one dimension, contributions single it out, a separable
sentence task learned and removed by clipping its dimension, joint = separate training, no-PE at chance, and the
feature cache (memory-mapped streaming, dropped positions, split and label errors)."""

from __future__ import annotations

import csv
from collections import Counter
from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, BertConfig

from core.errors import UserError
from datamodules import probing
from datamodules.features import GIB, SPLITS
from datamodules.probing import ClassificationDataModule, PositionDataModule
from lightning_modules.encoder import FrozenEncoder, load_encoder
from lightning_modules.probes import PositionProbe, SentenceClassifier
from lightning_modules.stacked import StackedLinearCrossEntropy, StackedProbe, slot_seed
from metrics.null import chance_outlier_bound
from tests.tiny import HIDDEN as TINY_HIDDEN
from tests.tiny import LAYERS, corpus_sentences, save_tiny_encoder

HIDDEN = 16
PLANTED = [3, 7, 9]  # the planted dimension of hidden states 0, 1, 2


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matrices: one thread is faster


class Planted(nn.Module):
    """A tiny 'encoder' whose hidden state l is one fixed vector for every token (nothing to read there) except
    dimension PLANTED[l], which holds the token's position ("position") or +1/-1 by token-id parity ("parity"); or
    ("type") a fixed random vector per token id in every layer, and nothing else (no position)."""

    def __init__(self, vocab_size: int, signal: str) -> None:
        super().__init__()
        self.config = BertConfig(vocab_size=vocab_size, hidden_size=HIDDEN, num_hidden_layers=len(PLANTED) - 1,
                                 num_attention_heads=1, max_position_embeddings=64)
        self.constant = nn.Parameter(torch.rand(HIDDEN, generator=torch.Generator().manual_seed(0)) + 0.5)
        self.signal = signal
        self.table = nn.Parameter(torch.randn(vocab_size, HIDDEN, generator=torch.Generator().manual_seed(1)))

    def forward(self, input_ids, attention_mask, output_hidden_states=True, return_dict=True):
        if self.signal == "type":
            return SimpleNamespace(hidden_states=tuple(self.table[input_ids] for _ in PLANTED))
        if self.signal == "position":
            value = torch.arange(input_ids.shape[1], dtype=torch.float).expand(input_ids.shape)
        else:
            value = 1.0 - 2.0 * (input_ids % 2).float()
        states = []
        for dim in PLANTED:
            hidden = self.constant.expand(*input_ids.shape, HIDDEN).clone()
            hidden[..., dim] = value
            states.append(hidden)
        return SimpleNamespace(hidden_states=tuple(states))


def fit(model, datamodule, epochs: int, val_every: int | None = None) -> pl.Trainer:
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         check_val_every_n_epoch=val_every or max(epochs, 1))
    trainer.fit(model, datamodule=datamodule)
    trainer.test(model, datamodule=datamodule, verbose=False)
    return trainer


class RowRecorder:
    """A forward pre-hook recording every row a model runs on, as its unpadded token ids."""

    def __init__(self, model: nn.Module) -> None:
        self.rows: list[tuple[int, ...]] = []
        model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs) -> None:
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"].bool()
        self.rows += [tuple(row[keep].tolist()) for row, keep in zip(ids, mask)]


def hidden_states(model, tokenizer, texts: list[str], max_length: int) -> torch.Tensor:
    """[layers, tokens, hidden]: the hidden states of each sentence run alone (no padding), tokens concatenated."""
    out = []
    with torch.no_grad():
        for text in texts:
            inputs = tokenizer(text, truncation=True, max_length=max_length, return_tensors="pt")
            out.append(torch.stack(model.eval()(**inputs, output_hidden_states=True).hidden_states)[:, 0])
    return torch.cat(out, dim=1)


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("chunk_rows", [None, 5])  # the whole batch at once; chunks of 5 items (the last of 2)
@pytest.mark.parametrize("classes, bias", [(300, False), (3, True)])
@pytest.mark.parametrize("factor", [1.0, 2.0])  # the loss itself backpropagated (no scaling pass), or a multiple
def test_fused_cross_entropy_equals_autograd(classes, bias, chunk_rows, factor, monkeypatch):
    if chunk_rows is not None:  # chunk_elements counts padded logits: 4 slots x width columns x rows
        width = -(-classes // 64) * 64 if classes >= 64 else classes
        monkeypatch.setattr(StackedLinearCrossEntropy, "chunk_elements", 4 * width * chunk_rows)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 37, 24, generator=generator)
    target = torch.randint(0, classes, (37,), generator=generator)
    weight = torch.randn(4, 24, classes, generator=generator).requires_grad_()
    b = torch.randn(4, classes, generator=generator).requires_grad_() if bias else None
    fused = StackedLinearCrossEntropy.apply(x, weight, b, target)
    grads = torch.autograd.grad(factor * fused, [weight] + ([b] if bias else []))
    logits = torch.bmm(x, weight) + (b.unsqueeze(1) if bias else 0)  # per slot mean cross-entropy, summed
    plain = sum(F.cross_entropy(logits[s], target) for s in range(4))
    expected = torch.autograd.grad(factor * plain, [weight] + ([b] if bias else []))
    torch.testing.assert_close(fused, plain)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("chunk_elements", [None, 2 ** 20])  # one piece (as on GPUs); CPU chunks
@pytest.mark.parametrize("bias", [False, True])
def test_fused_cross_entropy_of_an_empty_batch_is_zero_with_zero_gradients(chunk_elements, bias, monkeypatch):
    """A batch of zero items: the sum of each slot's mean over no items is 0 (the mean of nothing taken as 0), and
    neither the loss nor the weights' gradient depends on anything."""
    monkeypatch.setattr(StackedLinearCrossEntropy, "chunk_elements", chunk_elements)
    generator = torch.Generator().manual_seed(0)
    x, target = torch.randn(3, 0, 8, generator=generator), torch.zeros(0, dtype=torch.long)
    weight = torch.randn(3, 8, 5, generator=generator).requires_grad_()
    b = torch.randn(3, 5, generator=generator).requires_grad_() if bias else None
    loss = StackedLinearCrossEntropy.apply(x, weight, b, target)
    loss.backward()
    assert loss.item() == 0 and torch.equal(weight.grad, torch.zeros_like(weight))
    assert b is None or torch.equal(b.grad, torch.zeros_like(b))


@pytest.mark.parametrize("chunk_rows", [None, 5])
def test_a_padded_probe_trains_as_the_unpadded_one_and_its_padding_stays_zero(chunk_rows, monkeypatch):
    """StackedProbe(pad=True) stores [slots, hidden, 320] for 300 classes: the same loss, logits and Adam steps as
    the unpadded probe (whose loss is checked against autograd above), and the 20 padding columns stay exactly 0."""
    if chunk_rows is not None:
        monkeypatch.setattr(StackedLinearCrossEntropy, "chunk_elements", 3 * 320 * chunk_rows)
    slots = [("encoder", 0), ("encoder", 1), ("random", 0)]
    plain, padded = StackedProbe(slots, 24, 300, seed=1), StackedProbe(slots, 24, 300, seed=1, pad=True)
    assert plain.weight.shape == (3, 24, 300) and padded.weight.shape == (3, 24, 320)
    assert torch.equal(padded.weights, plain.weight) and not padded.weight[:, :, 300:].any()
    optimizers = [torch.optim.Adam(plain.parameters(), lr=0.01), torch.optim.Adam(padded.parameters(), lr=0.01)]
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        x, target = torch.randn(3, 17, 24, generator=generator), torch.randint(0, 300, (17,), generator=generator)
        losses = []
        for probe, optimizer in zip((plain, padded), optimizers):
            optimizer.zero_grad()
            loss = probe.loss(x, target)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0])
        assert not padded.weight.grad[:, :, 300:].any() and not padded.weight[:, :, 300:].any()
    torch.testing.assert_close(padded.weights, plain.weight)
    assert (plain.weight - StackedProbe(slots, 24, 300, seed=1).weight).abs().max() > 0.03  # it trained
    torch.testing.assert_close(padded(x), plain(x))


def test_probe_recovers_planted_position_and_contributions_single_out_its_dimension(tmp_path, bert_tok):
    data = write_lines(tmp_path / "s.txt", corpus_sentences(60))
    encoder = FrozenEncoder(Planted(len(bert_tok), "position"), bert_tok, name="planted")
    dm = PositionDataModule(source=str(data), encoder=encoder, max_length=8, max_positions=8, batch_size=8,
                            random_baseline=False, progress=False)
    model = PositionProbe(lr=0.1)
    fit(model, dm, 50)

    assert model.accuracy_of("encoder") == [1.0, 1.0, 1.0]  # every test token's position, exactly
    features, positions = dm.stores["test"].features(), dm.stores["test"].labels  # [layers, tokens, hidden]
    weight = model.weight.detach()[:3]  # the encoder's layers (the control task's probes follow)
    direct = (weight[:, :, positions].transpose(1, 2) * features).abs()  # c(i) = |w_gold,i v_i| by hand
    torch.testing.assert_close(model.results["contributions"], direct.mean(1), rtol=1e-5, atol=1e-6)
    for p in range(8):
        torch.testing.assert_close(model.results["contributions_by_position"][:, p],
                                   direct[:, positions == p].mean(1), rtol=1e-5, atol=1e-6)
    for layer, dim in enumerate(PLANTED):
        top2 = model.results["contributions"][layer].topk(2)
        assert top2.indices[0] == dim and top2.values[0] > 3 * top2.values[1]

    report = model.write_outputs(tmp_path / "out")
    by_hand = hand_outlier_dims(dm.stores["train"].features())  # detected on the training split
    assert {int(layer): dims for layer, dims in report["outlier_layers"].items()} == dict(enumerate(by_hand))
    train = dm.stores["train"].features()  # [layers, tokens, hidden]: the token vectors the rule counted
    assert report["outlier_chance_bound"] == chance_outlier_bound(train.shape[1], train.shape[2], 0.2)
    for layer, dim in enumerate(PLANTED):  # detected: each layer's planted dim holds most tokens' maximum there
        assert dim in report["outlier_layers"][str(layer)]
    # persistent: an outlier in at least half of layers 1..2 (here: in either), most frequent first, then by dim
    counts = Counter(dim for dims in by_hand[1:] for dim in dims)
    assert report["outlier_dims"] == sorted(counts, key=lambda d: (-counts[d], d))
    assert PLANTED[1] in report["outlier_dims"] and PLANTED[0] not in report["outlier_dims"]  # layer 0 never counts
    for layer, (entry, dim) in enumerate(zip(report["layers"], PLANTED, strict=True)):
        assert entry["top_contribution_dims"][0] == dim
        assert sorted(map(int, entry["outlier_dims"])) == sorted(report["outlier_dims"])  # the persistent ones
        assert (str(dim) in entry["outlier_dims"]) == (layer >= 1)  # layers 1, 2's planted dims are persistent
        if layer >= 1:
            contribution = float(model.results["contributions"][layer, dim])
            assert entry["outlier_dims"][str(dim)]["rank"] == 1
            assert entry["outlier_dims"][str(dim)]["contribution"] == pytest.approx(contribution, rel=1e-6)
            assert entry["outlier_dims"][str(dim)]["contribution"] > 3 * entry["mean_contribution"]
            assert entry["outlier_dims"][str(dim)]["ties"] == 0 and entry["top_contribution_ranks"][0] == 1

    # planted ties in the contributions the report ranks: layer 2's planted dim tied with dim 0 at the top
    planted = model.results["contributions"].clone()
    planted[2, 0] = planted[2, PLANTED[2]]
    model.results["contributions"] = planted
    entry = model.report()["layers"][2]
    lower = int((planted[2] < planted[2, PLANTED[2]]).sum())  # every other dim is smaller (by hand: none larger)
    assert lower == planted.shape[1] - 2
    assert entry["top_contribution_dims"][:2] == sorted([0, PLANTED[2]])  # the tie: lower index first
    assert entry["top_contribution_ranks"][:3] == [1, 1, 3] and entry["top_contribution_ties"][:2] == [1, 1]
    assert entry["outlier_dims"][str(PLANTED[2])]["rank"] == 1 and entry["outlier_dims"][str(PLANTED[2])]["ties"] == 1


def hand_outlier_dims(features: torch.Tensor, min_share: float = 0.2) -> list[list[int]]:
    """Per layer of features [layers, tokens, hidden], by hand: the dims holding the largest or the smallest value of
    at least `min_share` of the tokens, largest |mean| first."""
    out = []
    for layer in features.double():
        count, size = layer.shape
        max_share = torch.bincount(layer.argmax(1), minlength=size) / count
        min_share_ = torch.bincount(layer.argmin(1), minlength=size) / count
        dims = torch.nonzero((max_share >= min_share) | (min_share_ >= min_share)).flatten().tolist()
        out.append(sorted(dims, key=lambda d: -abs(float(layer[:, d].mean()))))
    return out


def test_classifier_learns_separable_task_and_clipping_its_dimension_leaves_the_majority(tmp_path, bert_tok):
    texts = corpus_sentences(400)
    ids = bert_tok(texts, truncation=True, max_length=24)["input_ids"]
    parity = [sum(1 - 2 * (i % 2) for i in row) / len(row) for row in ids]  # the planted dim, mean-pooled
    rows = [(t, "even" if v > 0 else "odd") for t, v in zip(texts, parity) if abs(v) > 0.1]  # a margin
    data = tmp_path / "labelled.csv"
    with data.open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([("text", "label"), *rows])
    encoder = FrozenEncoder(Planted(len(bert_tok), "parity"), bert_tok, name="planted")
    dm = ClassificationDataModule(source=str(data), encoder=encoder, max_length=24, batch_size=16,
                                  outlier_dims=[PLANTED[-1]], random_baseline=False, progress=False)
    model = SentenceClassifier(lr=0.05)
    fit(model, dm, 40)

    assert dm.spec.classes == ["even", "odd"]
    test_labels = dm.stores["test"].labels
    train_majority = torch.bincount(dm.stores["train"].labels).argmax()
    majority = float((test_labels == train_majority).double().mean())
    assert model.report()["majority_baseline"] == pytest.approx(majority)
    assert model.report()["outlier_chance_bound"] is None  # the clipped dims are given: no detection enters
    accuracy, clipped = model.accuracy_of("encoder"), model.accuracy_of("clipped")
    assert accuracy == [1.0, 1.0, 1.0]
    # Clipping dim 9 removes the signal from layer 2 only (its planted dim): its features are then one constant
    # vector, so the clipped classifier gives every test sentence the same answer, scoring that class's share.
    assert clipped[:2] == [1.0, 1.0]
    shares = torch.bincount(test_labels, minlength=2).double() / len(test_labels)
    assert any(clipped[2] == pytest.approx(float(share)) for share in shares) and clipped[2] <= max(shares)
    pooled = dm.stores["test"].features()[2, :, PLANTED[2]]  # mean over tokens, padding excluded, by hand:
    assert torch.equal((pooled < 0).long(), test_labels)  # "odd" (class 1) is a negative mean


def test_joint_training_equals_separately_trained_single_layer_probes(tmp_path, bert_tok):
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    data = write_lines(tmp_path / "s.txt", corpus_sentences(40, start=100))
    common = dict(source=str(data), encoder=str(encoder), max_length=16, max_positions=16, batch_size=8,
                  random_baseline=True, progress=False, seed=3)
    joint = PositionProbe(lr=0.01, seed=3)
    fit(joint, PositionDataModule(**common), 2)
    kinds = ("encoder", "random", "control")
    assert joint.probe_slots == [(kind, layer) for kind in kinds for layer in range(LAYERS + 1)]
    for layer in (0, 2):
        alone = PositionProbe(lr=0.01, seed=3)
        fit(alone, PositionDataModule(layers=[layer], **common), 2)
        assert alone.probe_slots == [(kind, layer) for kind in kinds]
        for kind in kinds:
            trained = joint.weight.detach()[joint.probe_slots.index((kind, layer))]
            bound = TINY_HIDDEN ** -0.5  # nn.Linear's initial range, from the slot's own seeded generator
            init = torch.empty(TINY_HIDDEN, 16).uniform_(
                -bound, bound, generator=torch.Generator().manual_seed(slot_seed(3, kind, layer)))
            assert (trained - init).abs().max() > 1e-3  # it trained
            torch.testing.assert_close(alone.weight.detach()[alone.probe_slots.index((kind, layer))], trained,
                                       rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(alone.results["accuracy"],
                                   joint.results["accuracy"][[joint.probe_slots.index((k, layer)) for k in kinds]])


def test_no_position_embeddings_leave_position_near_chance(tmp_path, roberta_tok):
    data = write_lines(tmp_path / "s.txt", corpus_sentences(200))

    def zero_positions(model):  # as this project's no-PE exports are: an all-zero position table
        model.embeddings.position_embeddings.weight.zero_()

    accuracy = {}
    for name, plant in (("pe", None), ("nope", zero_positions)):
        encoder = save_tiny_encoder(tmp_path / name, "roberta", roberta_tok, plant=plant)
        # special tokens excluded: <s> and </s> would give their positions away by their identity alone
        dm = PositionDataModule(source=str(data), encoder=str(encoder), max_length=16, max_positions=16,
                                batch_size=16, exclude_special=True, progress=False)
        model = PositionProbe(lr=0.01)
        fit(model, dm, 10)
        accuracy[name] = model.accuracy_of("encoder") + model.accuracy_of("random")
        labels, test = dm.stores["train"].labels, dm.stores["test"].labels  # the majority baseline, by hand:
        majority = float((test == torch.bincount(labels).argmax()).double().mean())  # the top training label's share
        assert dm.spec.majority["majority"] == pytest.approx(majority)
    assert min(accuracy["pe"]) > 0.9  # the trained and the random-init PE model alike
    # word identity alone says little about position; the no-PE model's random twin has a zero table too
    assert max(accuracy["nope"]) < majority + 0.1


def test_each_sentence_goes_through_the_encoder_and_its_random_twin_exactly_once(tmp_path, bert_tok, monkeypatch):
    encoder = load_encoder(save_tiny_encoder(tmp_path / "bert", "bert", bert_tok), device="cpu")
    recorders = {"encoder": RowRecorder(encoder.model)}
    make_twin = probing.random_encoder

    def recorded_twin(primary, seed):
        twin = make_twin(primary, seed)
        recorders["random"] = RowRecorder(twin.model)
        return twin

    monkeypatch.setattr(probing, "random_encoder", recorded_twin)
    texts = corpus_sentences(50, start=1500)
    dm = PositionDataModule(source=str(write_lines(tmp_path / "s.txt", texts)), encoder=encoder, max_length=16,
                            max_positions=16, batch_size=4, encode_batch_size=8, progress=False)
    model = PositionProbe(lr=0.01)
    trainer = fit(model, dm, 4, val_every=1)  # 4 epochs, validated after each, then tested, every layer

    assert trainer.current_epoch == 4 and len(model.probe_slots) == 3 * (LAYERS + 1)  # encoder, random, control
    assert sum(len(store.offsets) - 1 for store in dm.stores.values()) == len(texts)
    expected = Counter(map(tuple, bert_tok(texts, truncation=True, max_length=16)["input_ids"]))
    for kind in ("encoder", "random"):  # every sentence once, none twice, nothing re-run per layer or epoch
        assert len(recorders[kind].rows) == len(texts), kind
        assert Counter(recorders[kind].rows) == expected, kind


def test_random_baseline_is_a_fresh_seeded_model_of_the_same_architecture(tmp_path, bert_tok, roberta_tok):
    path = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok, seed=0)
    data = write_lines(tmp_path / "s.txt", corpus_sentences(30, start=1800))
    dm = PositionDataModule(source=str(data), encoder=str(path), max_length=16, max_positions=16, seed=5,
                            progress=False)
    dm.prepare_data()
    cached, texts = dm.stores["test"].features(), dm.texts["test"]  # [2 (L + 1), tokens, hidden]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)  # the run's seed
        fresh = AutoModel.from_config(AutoConfig.from_pretrained(path))
    trained = AutoModel.from_pretrained(path)
    torch.testing.assert_close(cached[LAYERS + 1:], hidden_states(fresh, bert_tok, texts, 16), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cached[:LAYERS + 1], hidden_states(trained, bert_tok, texts, 16), rtol=1e-4, atol=1e-5)
    differences = (cached[LAYERS + 1:] - cached[:LAYERS + 1]).abs().amax(dim=(1, 2))  # per layer
    assert differences.min() > 0.1  # the twin is not the trained encoder, at any layer

    def zero_positions(model):  # this project's no-PE exports: an all-zero position table
        model.embeddings.position_embeddings.weight.zero_()

    for name, plant in (("pe", None), ("nope", zero_positions)):
        source = load_encoder(save_tiny_encoder(tmp_path / name, "roberta", roberta_tok, plant=plant), device="cpu")
        twin = probing.random_encoder(source, seed=7)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(7)
            expected = AutoModel.from_config(source.model.config).state_dict()
        table = "embeddings.position_embeddings.weight"
        assert expected[table].abs().sum() > 0
        if plant is not None:
            expected[table] = torch.zeros_like(expected[table])  # a zero table stays zero in the twin
        state = twin.model.state_dict()
        assert state.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(state[key], value), (name, key)


def test_features_over_the_memory_budget_go_float16_then_stream_from_disk_with_the_same_results(tmp_path, bert_tok):
    """Within the budget: float32 in memory; over it, float16 (the report says so), in memory while the splits fit
    together, the rest from a memory-mapped file, with results equal to float16 in memory."""
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    data = write_lines(tmp_path / "s.txt", corpus_sentences(30, start=500))
    common = dict(source=str(data), encoder=str(encoder), max_length=16, batch_size=4, progress=False)
    full = PositionDataModule(**common)
    fit(PositionProbe(), full, 1)
    assert all(full.stores[split].path is None and full.stores[split].dtype == torch.float32 for split in SPLITS)
    assert full.spec.data["features"]["dtype"] == "float32"
    numbers = {split: full.stores[split].features().numel() for split in SPLITS}
    half = {split: number * 2 for split, number in numbers.items()}  # float16 bytes
    # float32 does not fit but float16 does: all in memory, in float16
    in_half = PositionDataModule(max_memory_gb=sum(half.values()) / GIB, **common)
    model_half = PositionProbe()
    fit(model_half, in_half, 2)
    assert in_half.spec.data["features"] == {"dtype": "float16", "gib": round(sum(half.values()) / GIB, 4),
                                             "splits": dict.fromkeys(SPLITS, "memory")}
    for split in SPLITS:
        assert torch.equal(in_half.stores[split].features(), full.stores[split].features().half().float())
    # nothing fits; then each split fits alone but not all together: the budget bounds the sum, so some split streams
    for name, budget in (("none", 1e-9), ("each alone", max(half.values()) / GIB)):
        assert name == "none" or sum(half.values()) > budget * GIB >= max(half.values())
        with pytest.warns(UserWarning, match="from a memory-mapped file"):
            disk = PositionDataModule(max_memory_gb=budget, cache_dir=str(tmp_path / name), **common)
            model_disk = PositionProbe()
            fit(model_disk, disk, 2)
        in_memory = [split for split in SPLITS if disk.stores[split].path is None]
        assert len(in_memory) < len(SPLITS) and sum(half[split] for split in in_memory) <= budget * GIB
        assert name == "none" or in_memory  # the budget is used, not given up on
        assert disk.spec.data["features"]["splits"] == {split: "memory" if split in in_memory else
                                                        "memory-mapped file" for split in SPLITS}
        for split in SPLITS:
            assert torch.equal(disk.stores[split].features(), in_half.stores[split].features())
            assert torch.equal(disk.stores[split].labels, in_half.stores[split].labels)
        torch.testing.assert_close(model_disk.weight, model_half.weight, rtol=0, atol=0)
        assert torch.equal(model_disk.results["accuracy"], model_half.results["accuracy"])
        torch.testing.assert_close(model_disk.results["contributions"], model_half.results["contributions"])
        cache = next(disk.stores[split].path for split in SPLITS if split not in in_memory).parent
        assert cache.exists()
        disk.close()
        assert not cache.exists()  # the memory-mapped cache goes with close() (probe.py calls it) or at exit


def test_a_killed_runs_memory_mapped_features_directory_is_removed_by_the_next_run_and_no_live_ones(tmp_path,
                                                                                                       capsys):
    """The memory-mapped features live in <cache_root>/.features-<host>-<pid>-* (core.output.new_stage): one a killed
    run left (its pid, of a process that has exited, no longer running) is removed by the next run that streams
    features into that cache root, with one warning line naming it and its size; a live run's (this process's, and
    another live process's) stays. This run's own directory carries its pid and goes with close(), as before."""
    import os
    import subprocess
    import sys

    from core.output import STAGE_NAME, host_tag
    from datamodules.features import FeatureExtractor

    exited = subprocess.Popen(["true"])
    exited.wait(timeout=30)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        planted = {}
        for whose, pid in (("dead", exited.pid), ("this", os.getpid()), ("other live", alive.pid)):
            directory = tmp_path / f".features-{host_tag()}-{pid}-k2j4_x9q"
            directory.mkdir()
            (directory / "train.npy").write_bytes(b"x" * 3072)
            planted[whose] = directory
        extractor = FeatureExtractor(layers=[0], max_memory_gb=1e-9, cache_root=tmp_path)
        with pytest.warns(UserWarning, match="from a memory-mapped file"):
            paths, dtype = extractor.store_paths({"train": 10, "val": 2, "test": 2})
        assert not planted["dead"].exists()
        assert all((planted[whose] / "train.npy").stat().st_size == 3072 for whose in ("this", "other live"))
        own = paths["train"].parent
        assert own.parent == tmp_path and own.is_dir() and set(paths.values()) == {own / f"{s}.npy" for s in SPLITS}
        assert STAGE_NAME.fullmatch(own.name)["prefix"] == ".features-"
        assert STAGE_NAME.fullmatch(own.name)["pid"] == str(os.getpid())
        assert capsys.readouterr().err.splitlines() == [
            f"warning: removed {planted['dead']} (3.0 KiB), the memory-mapped features directory of a run that ended "
            f"without finishing (pid {exited.pid} on {host_tag()}, no longer running)"]
        extractor.close()
        assert sorted(path.name for path in tmp_path.iterdir()) == sorted(planted[w].name for w in ("this", "other live"))
    finally:
        alive.kill()
        alive.wait(timeout=30)


def test_positions_beyond_max_positions_are_dropped_and_counted(tmp_path, bert_tok):
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    texts = corpus_sentences(30, start=900)
    data = write_lines(tmp_path / "s.txt", texts)
    dm = PositionDataModule(source=str(data), encoder=str(encoder), max_length=20, max_positions=6,
                            random_baseline=False, progress=False)
    with pytest.warns(UserWarning, match="positions >= --data.max_positions 6"):
        dm.prepare_data()
    lengths = [min(len(ids), 20) for ids in bert_tok(texts)["input_ids"]]
    counts = dm.spec.counts
    assert sum(counts[s]["dropped_positions"] for s in counts) == sum(max(0, n - 6) for n in lengths)
    assert sum(counts[s]["tokens"] for s in counts) == sum(min(n, 6) for n in lengths)
    assert all(int(dm.stores[s].labels.max()) == 5 for s in counts)


def test_outliers_are_detected_by_neuron_statistics_on_the_cached_training_features(tmp_path, bert_tok):
    def plant(model):
        model.embeddings.LayerNorm.bias[11] = 6.0

    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok, plant=plant)
    data = write_lines(tmp_path / "s.txt", corpus_sentences(30, start=1200))
    dm = PositionDataModule(source=str(data), encoder=str(encoder), max_length=16, random_baseline=False,
                            progress=False)
    dm.prepare_data()
    features = dm.stores["train"].features().double()  # [layers, tokens, hidden]
    count = features.shape[1]
    max_share = torch.stack([torch.bincount(f.argmax(1), minlength=TINY_HIDDEN) for f in features]) / count
    min_share = torch.stack([torch.bincount(f.argmin(1), minlength=TINY_HIDDEN) for f in features]) / count
    expected = hand_outlier_dims(features)  # the 20% rule, by hand
    assert 11 in dm.spec.outlier_dims and 11 in {d for dims in expected for d in dims}
    # The cache may hold the features in float16 (the memory budget decides), which can move a near-tie's argmax: the
    # two detections agree on every dimension whose share is not within a few tokens of the 20% threshold.
    share = torch.maximum(max_share, min_share)  # [layers, hidden]
    near = (share - 0.2).abs() < 0.01
    assert len(dm.spec.outlier_layers) == LAYERS + 1
    assert dm.spec.outlier_chance_bound == chance_outlier_bound(count, TINY_HIDDEN, 0.2)  # of the training tokens
    for layer, (spec_layer, dims) in enumerate(zip(dm.spec.outlier_layers, expected, strict=True)):
        assert spec_layer.layer == layer
        differ = set(spec_layer.outlier_dims) ^ set(dims)
        assert all(near[layer, d] for d in differ), (layer, differ)
        assert spec_layer.argmax_share == pytest.approx(float(max_share[layer].max()), abs=0.01)
        assert spec_layer.argmin_share == pytest.approx(float(min_share[layer].max()), abs=0.01)


def test_split_and_label_errors(tmp_path, bert_tok):
    encoder = str(save_tiny_encoder(tmp_path / "bert", "bert", bert_tok))
    few = write_lines(tmp_path / "few.txt", corpus_sentences(3))
    with pytest.raises(UserError, match="the val split is empty"):
        PositionDataModule(source=str(few), encoder=encoder, progress=False).prepare_data()

    labelled = tmp_path / "l.csv"
    labelled.write_text("text,label\n" + "".join(f"{t.replace(',', ' ')},{'ab'[i % 2]}\n"
                                                 for i, t in enumerate(corpus_sentences(20))))
    fixed = ClassificationDataModule(source=str(labelled), encoder=encoder, classes=["a", "c"], progress=False)
    with pytest.raises(UserError, match=r"unknown label\(s\) \['b'\] in the \w+ split: not among the classes fixed"):
        fixed.prepare_data()
    inferred = ClassificationDataModule(source=str(labelled), encoder=encoder)
    with pytest.raises(UserError, match=r"unknown label\(s\) \['c'\] in the test split: not among the training"):
        inferred.set_classes({"train": ["a", "b", "a"], "val": ["b"], "test": ["a", "c"]})
    missing = tmp_path / "m.csv"
    missing.write_text("text,label\nfine words,1\nno label here,\n")
    with pytest.raises(UserError, match=r"row 2 has no label"):
        ClassificationDataModule(source=str(missing), encoder=encoder).prepare_data()
    with pytest.raises(UserError, match="no label column 'stars'"):
        ClassificationDataModule(source=str(labelled), encoder=encoder, label_column="stars").prepare_data()
    ints = ClassificationDataModule(source=str(labelled), encoder=encoder)
    classes, tensors = ints.set_classes({"train": [10, 2, 2], "val": [10], "test": [2]})
    assert classes == [2, 10] and tensors["train"].tolist() == [1, 0, 0]  # ints sort as numbers



def test_the_copies_of_a_repeated_sentence_stay_in_one_split(tmp_path):
    """Splits carved from one file put each copy of a repeated line (boilerplate, a doubled file) into its first
    copy's split: before, copies landed in train and test alike, and the probes were tested on sentences they had
    trained on (a corpus of one repeated line scored 1.0). Without repeats the split is the seeded permutation's, by
    hand; a corpus of one line repeated leaves a split empty, and the refusal says why."""
    from datamodules.splits import read_splits

    source = write_lines(tmp_path / "any.txt", ["unused: the reader below gives the texts"])

    def reader(texts):
        return lambda source, split: (list(texts), [None] * len(texts))

    unique = [f"sentence {i}" for i in range(40)]
    plain = read_splits(str(source), reader(unique), bool)
    order = torch.randperm(40, generator=torch.Generator().manual_seed(0)).tolist()
    assert plain.texts["test"] == [unique[i] for i in sorted(order[:4])]
    assert plain.texts["val"] == [unique[i] for i in sorted(order[4:8])]
    assert plain.texts["train"] == [unique[i] for i in sorted(order[8:])]
    repeated = unique + ["a boilerplate line"] * 10 + unique[:5]
    splits = read_splits(str(source), reader(repeated), bool)
    held_out = set(splits.texts["test"]) | set(splits.texts["val"])
    assert not held_out & set(splits.texts["train"])
    assert sorted(sum(splits.texts.values(), [])) == sorted(repeated)  # every row in exactly one split
    assert (plain.repeats, splits.repeats) == (0, 9 + 5)
    with pytest.raises(UserError, match=r"the \w+ split is empty .*\(199 of its sentences repeat another"):
        read_splits(str(source), reader(["one line"] * 200), bool)


def test_a_repeated_sentence_is_held_out_as_often_as_any_other(tmp_path):
    """A sentence's copies go to one split, drawn as often as a sentence of one copy: here 50 copies of one line among
    950 other lines, test and validation 10% each. Ordered by the first of its copies in the seeded order, the
    repeated line led that order for every seed and went to test each time (half the test split one sentence). Over
    200 seeds it lands in test about a tenth of the time, as the sentences of one copy do on average."""
    from datamodules.splits import read_splits

    source = write_lines(tmp_path / "any.txt", ["unused: the reader below gives the texts"])
    texts = [f"sentence {i}" for i in range(950)] + ["a boilerplate line"] * 50
    in_test, singles = 0, 0.0
    for seed in range(200):
        splits = read_splits(str(source), lambda source, split: (list(texts), [None] * len(texts)), bool, seed=seed)
        test = set(splits.texts["test"])
        assert not test & set(splits.texts["train"]) and not test & set(splits.texts["val"])
        in_test += "a boilerplate line" in test
        singles += len(test - {"a boilerplate line"}) / 950  # the share of the sentences of one copy held in test
    assert singles / 200 == pytest.approx(0.1, abs=0.02)
    assert in_test / 200 == pytest.approx(singles / 200, abs=0.07)


def test_a_whole_number_written_with_a_decimal_point_is_the_class_of_that_number_in_every_file_format(tmp_path):
    """A csv exported by pandas from a float column writes 1.0; JSON, parquet and datasets give the float 1.0, which
    is the class 1: read from the csv it was the class '1.0', another class than a '1' of the same column (a third
    class of a two-class task) and not among --data.classes [1, 2]. The classes by hand: 1 and 2."""
    import json

    labels = ["1", "2.0", "2", "1.00", " +2.0 ", "1"]  # as written in the csv
    table, lines = tmp_path / "l.csv", tmp_path / "l.jsonl"
    with table.open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([("text", "label"), *((f"sentence {i}", x) for i, x in enumerate(labels))])
    lines.write_text("".join(json.dumps({"text": f"sentence {i}", "label": float(x)}) + "\n"
                             for i, x in enumerate(labels)), encoding="utf-8")
    by_hand = [1, 2, 2, 1, 2, 1]
    for path in (table, lines):
        data = ClassificationDataModule(source=str(path), encoder="unused", classes=[1, 2])
        texts, read = data.read_split(str(path), None)
        assert read == by_hand, path
        classes, tensors = data.set_classes({"train": read, "val": read[:2], "test": read[2:]})
        assert classes == [1, 2] and tensors["train"].tolist() == [x - 1 for x in by_hand], path
    inferred = ClassificationDataModule(source=str(table), encoder="unused")
    assert inferred.set_classes({split: by_hand for split in SPLITS})[0] == [1, 2]
    assert ClassificationDataModule(source=str(table), encoder="unused").read_split(str(table), None)[1] == by_hand
    fractions = tmp_path / "f.csv"  # a label that is no whole number stays the text it is written as
    fractions.write_text("text,label\na,0.5\nb,1.5\nc,2.0e0\n", encoding="utf-8")
    assert inferred.read_split(str(fractions), None)[1] == ["0.5", "1.5", "2.0e0"]


def test_a_boolean_label_is_the_class_1_or_0_whether_the_file_is_csv_jsonl_or_parquet(tmp_path):
    """One table of boolean labels written three ways: pandas' csv writes True / False (other tools true, TRUE), JSON
    true / false, parquet a bool column. Every format gives the same classes, 1 for true and 0 for false (by hand from
    the booleans); before, the csv's were the text classes 'False' and 'True' and the others 0 and 1."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as parquet

    truth = [True, False, False, True, True, False]
    written = ["True", "False", "false", "true", " TRUE ", "FALSE"]  # as csv writers spell them
    table, lines, columns = tmp_path / "b.csv", tmp_path / "b.jsonl", tmp_path / "b.parquet"
    with table.open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([("text", "label"), *((f"sentence {i}", x) for i, x in enumerate(written))])
    lines.write_text("".join(json.dumps({"text": f"sentence {i}", "label": x}) + "\n" for i, x in enumerate(truth)),
                     encoding="utf-8")
    parquet.write_table(pa.table({"text": [f"sentence {i}" for i in range(len(truth))],
                                  "label": pa.array(truth, pa.bool_())}), columns)
    by_hand = [int(x) for x in truth]
    for path in (table, lines, columns):
        data = ClassificationDataModule(source=str(path), encoder="unused")
        read = data.read_split(str(path), None)[1]
        assert read == by_hand, path
        classes, tensors = data.set_classes({"train": read, "val": read, "test": read})
        assert classes == [0, 1] and tensors["train"].tolist() == by_hand, path
    fixed = ClassificationDataModule(source=str(table), encoder="unused", classes=["False", "True"])  # as a user types
    assert fixed.set_classes({split: by_hand for split in SPLITS})[0] == [0, 1]


def test_a_missing_label_of_a_float_column_is_no_label_not_the_class_nan(tmp_path):
    """A parquet (or datasets) float label column holds a missing label as NaN: that row has no label, refused as a
    csv's empty cell is (row 2 by hand); before, NaN was the text class 'nan', a third class of a two-class task."""
    import pyarrow as pa
    import pyarrow.parquet as parquet

    columns = tmp_path / "f.parquet"
    parquet.write_table(pa.table({"text": ["fine words", "no label here", "more words"],
                                  "label": pa.array([1.0, float("nan"), 0.0], pa.float64())}), columns)
    with pytest.raises(UserError, match=r"row 2 has no label"):
        ClassificationDataModule(source=str(columns), encoder="unused").read_split(str(columns), None)


def test_position_batches_hold_batch_size_token_vectors_drawn_across_sentences(tmp_path, bert_tok):
    """The paper's batches: `batch_size` token vectors from several sentences, reshuffled every epoch, every training
    token once per epoch; the loader serves them `steps_per_block` at a time, each batch's rows in its own place."""
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    data = write_lines(tmp_path / "s.txt", corpus_sentences(40, start=700))
    dm = PositionDataModule(source=str(data), encoder=str(encoder), max_length=16, batch_size=16, steps_per_block=3,
                            random_baseline=False, progress=False)
    dm.prepare_data()
    store = dm.stores["train"]
    sentence_of = torch.repeat_interleave(torch.arange(store.sentences), store.offsets.diff())  # item -> sentence
    epochs = []
    loader = dm.train_dataloader()  # made once per fit, iterated once per epoch
    for _ in range(2):
        epoch = loader.sampler.epoch  # ShuffledBatches: each pass the next epoch's seeded permutation
        blocks = [list(ids) for ids in loader.sampler]
        loader.sampler.set_epoch(epoch)  # the loader then draws the same permutation
        features = list(loader)
        assert [len(ids) for ids in blocks[:-1]] == [48] * (len(blocks) - 1) and len(blocks) > 2
        order = [i for ids in blocks for i in ids]  # the epoch's permutation, cut into batches of 16
        batches = [order[start:start + 16] for start in range(0, len(order), 16)]
        assert sorted(order) == list(range(store.items))  # each token once
        assert all(len(set(sentence_of[ids].tolist())) > 1 for ids in batches[:-1])  # across sentences
        for block, (x, y, c) in zip(blocks, features):  # batch i of a block: items [16 i, 16 i + 16), sorted
            rows = torch.cat([torch.tensor(sorted(block[start:start + 16])) for start in range(0, len(block), 16)])
            assert torch.equal(x, store.gather(rows)) and torch.equal(y, store.labels[rows])
            assert torch.equal(c, store.control[rows])  # each item's control-task label rides along
        epochs.append(batches)
    assert epochs[0] != epochs[1]  # shuffled again each epoch


@pytest.mark.parametrize("steps_per_block", [1, 3])
def test_blocks_of_steps_give_the_weights_of_a_plain_adam_loop_over_the_same_batches(tmp_path, bert_tok,
                                                                                     steps_per_block):
    """Several Adam steps per trainer step (every layer, the random baseline and the control task stacked, validation
    each epoch) leave the weights a plain PyTorch loop leaves: one autograd cross-entropy and Adam step per batch of
    8 token vectors, each slot on its own (a control probe: its layer's encoder features against the control
    labels), in the epoch's shuffled order."""
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    data = write_lines(tmp_path / "s.txt", corpus_sentences(40, start=900))
    dm = PositionDataModule(source=str(data), encoder=str(encoder), max_length=16, max_positions=16, batch_size=8,
                            steps_per_block=steps_per_block, random_baseline=True, progress=False, seed=5)
    model = PositionProbe(lr=0.02, seed=5)
    seen = []

    class Record(pl.Callback):
        def on_train_epoch_end(self, trainer, module):
            seen.append(module.weight.detach().clone())

    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[Record()])
    trainer.fit(model, datamodule=dm)
    store, slots = dm.stores["train"], model.probe_slots
    loader = dm.train_dataloader()  # a fresh loader draws the fit's permutations again (one seeded generator)
    epochs = [[i for ids in loader.sampler for i in ids] for _ in range(2)]
    assert trainer.global_step == 2 * -(-store.items // 8)  # one optimizer step per batch of 8
    bound = TINY_HIDDEN ** -0.5  # each slot's initial weights, from its own seeded generator
    weights = [torch.empty(TINY_HIDDEN, 16).uniform_(-bound, bound,
                                                     generator=torch.Generator().manual_seed(slot_seed(5, *slot)))
               for slot in slots]
    initial = torch.stack(weights)
    weights = [nn.Parameter(w.clone()) for w in weights]
    optimizers = [torch.optim.Adam([w], lr=0.02) for w in weights]
    for epoch, order in enumerate(epochs):
        for start in range(0, len(order), 8):
            rows = torch.tensor(order[start:start + 8])
            features, positions = store.gather(rows), store.labels[rows]  # [slots, 8, hidden], [8]
            for (kind, layer), weight, optimizer in zip(slots, weights, optimizers):
                x = features[slots.index(("encoder", layer)) if kind == "control" else slots.index((kind, layer))]
                optimizer.zero_grad()
                F.cross_entropy(x @ weight, store.control[rows] if kind == "control" else positions).backward()
                optimizer.step()
        torch.testing.assert_close(seen[epoch], torch.stack([w.detach() for w in weights]), rtol=1e-4, atol=1e-5)
    assert (seen[0] - initial).abs().max() > 0.1 and (seen[1] - seen[0]).abs().max() > 0.01  # it trained


def test_each_layer_is_tested_with_its_weights_of_the_best_validation_epoch(tmp_path, bert_tok):
    """Validation after every epoch; per layer the epoch of best validation accuracy (the earliest on ties) is the one
    whose weights are tested, checked against weights recorded at every validation."""
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    data = write_lines(tmp_path / "s.txt", corpus_sentences(40, start=800))
    dm = PositionDataModule(source=str(data), encoder=str(encoder), max_length=16, batch_size=8,
                            random_baseline=False, progress=False)
    model = PositionProbe(lr=0.05)
    seen = []

    class Record(pl.Callback):
        def on_validation_epoch_end(self, trainer, module):
            seen.append(module.weight.detach().clone())

    trainer = pl.Trainer(max_epochs=4, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[Record()])
    trainer.fit(model, datamodule=dm)
    trainer.test(model, datamodule=dm, verbose=False)
    val, test = dm.stores["val"], dm.stores["test"]

    def accuracy(weight, store):  # the encoder's layers on the task, then the control task's probes on theirs
        features = store.features().repeat(2, 1, 1)
        targets = torch.stack([store.labels] * (LAYERS + 1) + [store.control] * (LAYERS + 1))
        return (torch.bmm(features, weight).argmax(-1) == targets).double().mean(1)

    by_epoch = torch.stack([accuracy(w, val) for w in seen])  # [epochs, layers]
    best = by_epoch.argmax(0)  # the first maximum: the earliest best epoch
    assert model.results["best_epoch"].tolist() == best.tolist()
    torch.testing.assert_close(model.results["val_accuracy"], by_epoch.max(0).values)
    tested = torch.stack([seen[int(epoch)][layer] for layer, epoch in enumerate(best)])
    torch.testing.assert_close(model.results["accuracy"].double(), accuracy(tested, test))
    report = model.report()
    assert [row["best_epoch"] for row in report["layers"]] == best[:LAYERS + 1].tolist()  # the encoder's layers


class Massive(Planted):
    """Planted with every hidden state's dim 0 at 1e5, past float16's largest value (a large model's massive
    activation)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        for hidden in out.hidden_states:
            hidden[..., 0] = 1e5
        return out


def test_features_past_float16s_range_are_refused_not_cached_as_inf(tmp_path, bert_tok):
    """A hidden state past 65504 (a large model's massive activation) held in float16 would be inf in the cache, and
    every probe reading it nan (accuracy at chance, nan contributions), silently: one line naming the budget that
    keeps float32; within float32's budget the same features train as usual."""
    data = write_lines(tmp_path / "s.txt", corpus_sentences(30, start=500))
    encoder = FrozenEncoder(Massive(len(bert_tok), "position"), bert_tok, name="massive")
    common = dict(source=str(data), encoder=encoder, max_length=8, max_positions=8, batch_size=8,
                  random_baseline=False, control_task=False, progress=False)
    full = PositionDataModule(**common)
    full.prepare_data()
    assert full.spec.data["features"]["dtype"] == "float32"
    assert all(bool(full.stores[split].features().isfinite().all()) for split in SPLITS)
    values = sum(full.stores[split].features().numel() for split in SPLITS)  # float32: 4 bytes each
    with pytest.raises(UserError, match=r"past float16's largest value \(65504\).*--data.max_memory_gb") as error:
        PositionDataModule(max_memory_gb=values * 2 / GIB, **common).prepare_data()  # float16 fits, float32 not
    assert f"|x| = {1e5:.4g}" in str(error.value)
