"""Control tasks (Hewitt & Liang 2019): labels that are a function of the item's type and random otherwise, carried by
the probe data, learned by stacked control probes on the same features; selectivity = accuracy - control accuracy."""

from __future__ import annotations

import csv
import random

import pytest
import torch
import torch.nn.functional as F

from datamodules.probing import ClassificationDataModule, PositionDataModule
from lightning_modules.encoder import FrozenEncoder
from lightning_modules.probes import PositionProbe, SentenceClassifier
from lightning_modules.stacked import StackedLinearCrossEntropy
from metrics.control import control_labels, text_key
from tests.test_probe import PLANTED, Planted, fit, write_lines
from tests.tiny import corpus_sentences

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("chunk_rows", [None, 5])  # the whole batch at once; chunks of 5 items
@pytest.mark.parametrize("classes, bias", [(300, False), (3, True)])
def test_fused_cross_entropy_of_parts_with_a_target_per_slot_equals_autograd(classes, bias, chunk_rows, monkeypatch):
    """The control probes' loss: features given as parts (4 task slots, then 2 control slots reading the first two
    slots' features again, never copied) and one target row per slot equal autograd on the stacked copy."""
    if chunk_rows is not None:
        width = -(-classes // 64) * 64 if classes >= 64 else classes
        monkeypatch.setattr(StackedLinearCrossEntropy, "chunk_elements", 6 * width * chunk_rows)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 37, 24, generator=generator)
    task, control = (torch.randint(0, classes, (37,), generator=generator) for _ in range(2))
    targets = torch.stack([task] * 4 + [control] * 2)
    weight = torch.randn(6, 24, classes, generator=generator).requires_grad_()
    b = torch.randn(6, classes, generator=generator).requires_grad_() if bias else None
    fused = StackedLinearCrossEntropy.apply((x, x[:2]), weight, b, targets)
    grads = torch.autograd.grad(fused, [weight] + ([b] if bias else []))
    stacked = torch.cat([x, x[:2]])
    logits = torch.bmm(stacked, weight) + (b.unsqueeze(1) if bias else 0)
    plain = sum(F.cross_entropy(logits[s], targets[s]) for s in range(6))
    expected = torch.autograd.grad(plain, [weight] + ([b] if bias else []))
    torch.testing.assert_close(fused, plain)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)


def test_control_labels_are_a_function_of_the_type_and_random_otherwise():
    """Planted: task labels that are a fixed function of the type (type % 7). The control labels are one per type
    (the same in any order, call or subset), follow the given label distribution over types, carry nothing of the
    task's labels (agreement as for independent labels), and change with the seed."""
    generator = torch.Generator().manual_seed(0)
    distribution = torch.tensor([50.0, 30.0, 15.0, 5.0, 0.0, 0.0, 0.0])  # empirical counts of 7 classes
    types = torch.randint(0, 20_000, (60_000,), generator=generator)
    labels = control_labels(types, distribution, seed=3)
    first = {}
    for t, label in zip(types.tolist(), labels.tolist()):
        assert first.setdefault(t, label) == label  # every occurrence of a type: one label
    order = torch.randperm(len(types), generator=generator)[:5000]  # another order, a subset, another call
    assert torch.equal(control_labels(types[order], distribution, seed=3), labels[order])
    distinct = torch.tensor(sorted(first))
    per_type = torch.tensor([first[t] for t in distinct.tolist()])
    shares = torch.bincount(per_type, minlength=7).double() / len(per_type)
    torch.testing.assert_close(shares, distribution.double() / distribution.sum(), atol=0.012, rtol=0)
    task = distinct % 7  # the planted task: a function of the type too
    expected = float((torch.bincount(task, minlength=7).double() / len(task) * shares).sum())  # if independent
    assert float((per_type == task).double().mean()) == pytest.approx(expected, abs=0.012)
    other = control_labels(distinct, distribution, seed=4)
    same = float((other == per_type).double().mean())  # independent draws agree with probability sum p^2
    assert same == pytest.approx(float((shares ** 2).sum()), abs=0.012)


def test_position_items_carry_their_token_id_as_type_and_one_control_label_per_type_across_splits(tmp_path, bert_tok):
    """Each item's type is its token id (in the store's order, against the tokenizer run here); a token type has one
    control label in every split; the labels are positions drawn from the training positions' distribution."""
    texts = corpus_sentences(60, start=300)
    encoder = FrozenEncoder(Planted(len(bert_tok), "position"), bert_tok, name="planted")
    dm = PositionDataModule(source=str(write_lines(tmp_path / "s.txt", texts)), encoder=encoder, max_length=10,
                            max_positions=10, random_baseline=False, progress=False, seed=2)
    dm.prepare_data()
    label_of = {}
    for split, store in dm.stores.items():
        ids = [bert_tok(text, truncation=True, max_length=10)["input_ids"] for text in dm.texts[split]]
        assert store.types[:store.items].tolist() == [i for row in ids for i in row]
        assert len(store.control) == store.items
        for t, label in zip(store.types[:store.items].tolist(), store.control.tolist()):
            assert label_of.setdefault(t, label) == label
    assert set(label_of.values()) <= set(dm.stores["train"].labels.tolist())  # positions seen in training
    assert len(set(label_of.values())) > 3 and dm.spec.control["types"] == "token ids"
    assert dm.spec.control["num_types_train"] == dm.stores["train"].types.unique().numel()


def test_sentence_items_carry_their_text_as_type(tmp_path, bert_tok):
    """Classification: an item's type is its sentence's text; duplicates share one control label, drawn among the
    training classes."""
    texts = corpus_sentences(40, start=500)
    rows = [(text, i % 3) for i, text in enumerate(texts)] + [(texts[0], 0), (texts[1], 1), (texts[0], 0)]
    data = tmp_path / "c.csv"
    with data.open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([("text", "label"), *rows])
    encoder = FrozenEncoder(Planted(len(bert_tok), "parity"), bert_tok, name="planted")
    dm = ClassificationDataModule(source=str(data), encoder=encoder, max_length=16, random_baseline=False,
                                  progress=False)
    dm.prepare_data()
    label_of = {}
    for split, store in dm.stores.items():
        assert store.types[:store.items].tolist() == [text_key(text) for text in dm.texts[split]]
        assert len(store.control) == store.items == len(dm.texts[split])
        for text, label in zip(dm.texts[split], store.control.tolist()):
            assert label_of.setdefault(text, label) == label
            assert 0 <= label < 3
    assert dm.spec.control["types"] == "sentence texts"


def control_accuracy_by_hand(model, store, layers: list[int], kind: str = "control") -> list[float]:
    """Each control probe's test accuracy from its weights: its layer's encoder features against the control labels
    (`kind` "encoder": the task probe's, against the task labels)."""
    features, slots = store.features(), model.probe_slots
    targets = store.control if kind == "control" else store.labels
    accuracies = []
    for layer in layers:
        weight = model.weight.detach()[slots.index((kind, layer))]
        bias = 0 if model.bias is None else model.bias.detach()[slots.index((kind, layer))]
        logits = features[slots.index(("encoder", layer))] @ weight + bias
        accuracies.append(float((logits.argmax(-1) == targets).double().mean()))
    return accuracies


@pytest.mark.parametrize("signal", ["position", "type"])
def test_selectivity_is_the_task_accuracy_minus_the_control_accuracy_on_planted_encoders(signal, tmp_path, bert_tok):
    """Planted: an encoder holding each token's position (nothing of its type) gives a selective probe (task 1.0,
    control low); one holding only a random vector per token type gives the control task (memorised types) and not
    the positions. Per layer, the report's control accuracy equals the control probe's by hand, and selectivity is
    accuracy - control accuracy, in position_probe.json and its baselines."""
    words = ["the", "and", "of", "to", "in", "was", "her", "she"]
    rng = random.Random(0)
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 8))) for _ in range(120)]
    encoder = FrozenEncoder(Planted(len(bert_tok), signal), bert_tok, name="planted")
    dm = PositionDataModule(source=str(write_lines(tmp_path / "s.txt", texts)), encoder=encoder, max_length=10,
                            max_positions=10, batch_size=16, random_baseline=False, progress=False)
    model = PositionProbe(lr=0.1)
    fit(model, dm, 30)
    report = model.write_outputs(tmp_path / "out")
    layers = list(range(len(PLANTED)))
    control = control_accuracy_by_hand(model, dm.stores["test"], layers)
    rows = report["layers"]
    assert [row["control_accuracy"] for row in rows] == pytest.approx(control, abs=1e-9)
    task = control_accuracy_by_hand(model, dm.stores["test"], layers, kind="encoder")
    assert [row["accuracy"] for row in rows] == pytest.approx(task, abs=1e-9)
    for row, entry in zip(rows, report["baselines"]["control_task"]["layers"], strict=True):
        assert row["selectivity"] == pytest.approx(row["accuracy"] - row["control_accuracy"], abs=1e-12)
        assert (entry["accuracy"], entry["selectivity"]) == (row["control_accuracy"], row["selectivity"])
    if signal == "position":  # positions are read; the control labels no better than their commonest one
        commonest = float(torch.bincount(dm.stores["test"].control).max()) / dm.stores["test"].items
        assert all(row["control_accuracy"] <= commonest + 0.05 and row["selectivity"] > 0.2 for row in rows)
    else:  # the types are memorised, the positions are not there
        assert all(row["control_accuracy"] > 0.95 and row["selectivity"] < -0.3 for row in rows)
    assert (tmp_path / "out" / "accuracy_by_layer.png").read_bytes()[:4] == b"\x89PNG"


def test_classifier_reports_its_control_task_and_selectivity(tmp_path, bert_tok):
    texts = corpus_sentences(120, start=2000)
    ids = bert_tok(texts, truncation=True, max_length=16)["input_ids"]
    rows = [(t, "even" if sum(1 - 2 * (i % 2) for i in row) > 0 else "odd") for t, row in zip(texts, ids)]
    data = tmp_path / "labelled.csv"
    with data.open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([("text", "label"), *rows])
    encoder = FrozenEncoder(Planted(len(bert_tok), "parity"), bert_tok, name="planted")
    dm = ClassificationDataModule(source=str(data), encoder=encoder, max_length=16, batch_size=16,
                                  random_baseline=False, progress=False)
    model = SentenceClassifier(lr=0.05, clip="none")
    fit(model, dm, 10)
    report = model.report()
    control = control_accuracy_by_hand(model, dm.stores["test"], list(range(len(PLANTED))))
    assert [row["control_accuracy"] for row in report["layers"]] == pytest.approx(control, abs=1e-9)
    task = control_accuracy_by_hand(model, dm.stores["test"], list(range(len(PLANTED))), kind="encoder")
    assert [row["accuracy"] for row in report["layers"]] == pytest.approx(task, abs=1e-9)
    for row in report["layers"]:
        assert row["selectivity"] == pytest.approx(row["accuracy"] - row["control_accuracy"], abs=1e-12)
    assert report["baselines"]["control_task"]["types"] == "sentence texts"
