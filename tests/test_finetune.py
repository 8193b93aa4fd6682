"""train.py's fine-tuning end to end on a tiny BERT (a local stand-in for a hub id) and a small labelled file: the
export against plain transformers, finetune.json against a direct computation, exact resume and 2-process DDP with
I-STAR on, GLUE's configs (a local datasets directory standing in for glue/rte), and bad input.

    .venv/bin/pytest tests/test_finetune.py -q
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

import train
from core.errors import UserError
from datamodules.finetune import FineTuneDataModule
from datamodules.sampling import DealtBatches
from lightning_modules.encoder import load_encoder
from metrics.geometry import Covariance
from metrics.isotropy import isoscore_star
from tests.test_refusals import files_under, stderr_lines
from tests.tiny import bert_tokenizer, corpus_sentences, save_tiny_encoder

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
CONFIG = ROOT / "configs" / "finetune" / "classify.yaml"
EPOCH = 8  # 80 labelled lines: 64 train (80/10/10) / batch 8


def labelled(path: Path, count: int = 80, start: int = 300) -> Path:
    """Lines of the bundled corpus labelled by whether they hold a comma."""
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text", "label"])
        for line in corpus_sentences(count, start=start):
            writer.writerow([line, "comma" if "," in line else "plain"])
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("finetune-inputs")
    tokenizer = bert_tokenizer(folder / "tokenizer")
    return {"encoder": save_tiny_encoder(folder / "bert", "bert", tokenizer, hidden_dropout_prob=0.1),
            "data": labelled(folder / "data.csv")}


def ft_args(root: Path, inputs: dict, *extra: str) -> list[str]:
    logger = json.dumps({"class_path": "pytorch_lightning.loggers.CSVLogger",
                         "init_args": {"save_dir": str(root), "name": "lightning_logs"}})
    return ["fit", "--config", str(CONFIG), "--model.encoder", str(inputs["encoder"]), "--data.source",
            str(inputs["data"]), "--data.max_length", "32", "--data.batch_size", "8", "--data.eval_batch_size", "5",
            "--model.warmup_steps", "2", "--model.decay_steps", "12", "--model.lr", "1e-3",
            "--model.reg_shrinkage_tokens", "300",
            "--trainer.max_steps", "12", "--trainer.val_check_interval", "6", "--trainer.log_every_n_steps", "1",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--trainer.logger", logger, "--trainer.default_root_dir", str(root), "--checkpoint.every_n_train_steps",
            "2", *extra]


ISTAR = ("--model.regularizer", "istar", "--model.reg_weight", "0.5")


def logged(root: Path) -> dict[int, dict]:
    rows = {}
    for path in sorted((root / "lightning_logs").glob("version_*/metrics.csv")):
        with path.open() as handle:
            for row in csv.DictReader(handle):
                if row.get("train/loss"):
                    rows[int(row["step"])] = {key: float(value) for key, value in row.items()
                                              if key.startswith("train/") and value}
    return rows


def checkpoint(root: Path) -> dict:
    return torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)


def direct_test_statistics(export: Path, inputs: dict, size: int = 5) -> tuple[float, list[float]]:
    """(test accuracy, per-layer IsoScore*) of an export on the test split, computed here: the one-process test
    batches (`size` consecutive examples), every test token's covariance C0 (metrics.geometry.Covariance) and the mean
    over batches of metrics.isotropy.isoscore_star of each batch's tokens shrunk with zeta 0.2 towards C0."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    exported = AutoModelForSequenceClassification.from_pretrained(export).eval()
    data = FineTuneDataModule(source=str(inputs["data"]), max_length=32, eval_batch_size=size)
    data.attach(AutoTokenizer.from_pretrained(export))
    test = data.sets["test"]
    batches = [test[list(range(i, min(i + size, len(test))))] for i in range(0, len(test), size)]
    correct, states = 0, []
    with torch.no_grad():
        for batch in batches:
            out = exported(**{k: v for k, v in batch.items() if k != "labels"}, output_hidden_states=True)
            correct += int((out.logits.argmax(-1) == batch["labels"]).sum())
            states.append((torch.stack(out.hidden_states), batch["attention_mask"].bool()))
    layers, hidden = states[0][0].shape[0], states[0][0].shape[-1]
    covariance = Covariance(layers, hidden)
    for hidden_states, mask in states:
        covariance.update(hidden_states, mask)
    c0 = covariance.compute().cov
    stars = []
    for layer in range(layers):
        star = [isoscore_star(h[layer][m], 0.2, c0[layer]).item() for h, m in states if int(m.sum()) >= 2]
        stars.append(sum(star) / len(star))
    return correct / len(test), stars


@pytest.fixture(scope="module")
def straight(tmp_path_factory, inputs) -> Path:
    """12 steps with I-STAR (λ 0.5; C0 at steps 0 and 8, the second epoch's start)."""
    root = tmp_path_factory.mktemp("straight")
    assert train.cli_main(ft_args(root, inputs, *ISTAR)) == 0
    return root


@pytest.mark.slow
def test_the_export_gives_the_modules_logits_and_finetune_json_what_a_direct_computation_gives(straight, inputs):
    """export/ loads in plain transformers with the trained module's logits; analyze.py's and probe.py's loader take
    it and the run directory; finetune.json's test accuracy and per-layer IsoScore* equal those recomputed from the
    export on the test split; each logged train/reg_loss is λ (1 - train/isoscore_star)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from lightning_modules.finetune import FineTuneModule

    exported = AutoModelForSequenceClassification.from_pretrained(straight / "export").eval()
    tokenizer = AutoTokenizer.from_pretrained(straight / "export")
    module = FineTuneModule.load_from_checkpoint(straight / "checkpoints" / "last.ckpt", map_location="cpu").eval()
    texts = corpus_sentences(6, start=5000)
    batch = tokenizer(texts, padding=True, truncation=True, max_length=32, return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(exported(**batch).logits, module.model(**batch).logits, rtol=0, atol=1e-6)
        hidden = exported.bert(**batch, output_hidden_states=True).hidden_states
    for source in (straight, straight / "export"):  # analyze.py --encoder, probe.py --model.encoder
        encoder = load_encoder(source, device="cpu")
        got = encoder(batch["input_ids"], batch["attention_mask"], token_type_ids=batch["token_type_ids"])
        torch.testing.assert_close(got.hidden_states, torch.stack(hidden), rtol=0, atol=1e-6)

    report = json.loads((straight / "finetune.json").read_text())
    assert {"encoder", "regularizer", "reg_weight", "zeta", "reg_layers", "accuracy", "val_accuracy", "steps",
            "layers"} <= set(report)
    assert (report["regularizer"], report["reg_weight"], report["zeta"], report["reg_layers"], report["steps"]) == \
        ("istar", 0.5, 0.2, [1, 2, 3], 12)
    accuracy, stars = direct_test_statistics(straight / "export", inputs)
    assert report["accuracy"] == pytest.approx(accuracy, abs=1e-6)
    assert len(report["layers"]) == len(stars) == 4
    for layer in range(4):
        assert report["layers"][layer]["isoscore_star"] == pytest.approx(stars[layer], abs=1e-6)

    rows = logged(straight)
    assert sorted(rows) == list(range(12))
    for row in rows.values():
        assert row["train/reg_loss"] == pytest.approx(0.5 * (1 - row["train/isoscore_star"]), rel=1e-5)
    final = {}  # the end-of-fit row: the report's numbers under the per-layer key pattern of every logger key
    for path in sorted((straight / "lightning_logs").glob("version_*/metrics.csv")):
        with path.open() as handle:
            final.update(next((row for row in csv.DictReader(handle) if row.get("test/accuracy")), {}))
    assert float(final["test/accuracy"]) == pytest.approx(report["accuracy"], abs=1e-6)
    for layer in range(4):
        assert float(final[f"test_by_layer/layer_{layer}/isoscore_star"]) == \
            pytest.approx(report["layers"][layer]["isoscore_star"], abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("stop", [5, EPOCH])  # inside the first epoch, and at its end (C0 of the next one is due)
def test_resume_with_istar_is_exact(straight, inputs, tmp_path, stop):
    """N steps, then --ckpt_path last to 12: every step's loss, the regulariser's values, C0 and the weights of the
    straight run, bit for bit (data position, dropout and C0 restored or recomputed where the straight run did)."""
    root = tmp_path / "resumed"
    assert train.cli_main(ft_args(root, inputs, *ISTAR, "--trainer.max_steps", str(stop))) == 0
    assert checkpoint(root)["regularizer"]["epoch"] == 0
    assert train.cli_main(ft_args(root, inputs, *ISTAR, "--ckpt_path", "last")) == 0
    assert logged(root) == logged(straight)
    resumed, reference = checkpoint(root), checkpoint(straight)
    assert resumed["regularizer"]["epoch"] == reference["regularizer"]["epoch"] == 1
    torch.testing.assert_close(resumed["regularizer"]["shrinkage"], reference["regularizer"]["shrinkage"], rtol=0,
                               atol=0)
    for name, value in reference["state_dict"].items():
        torch.testing.assert_close(resumed["state_dict"][name], value, rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_two_process_ddp_gives_the_regularised_loss_of_one_process(inputs, tmp_path):
    """I-STAR under DDP: 2 processes (gloo) × 4 examples a step against 1 × 8, dropout off: the same loss, I-STAR term
    and IsoScore* every step (the moments of every rank's tokens together), the same C0 and weights; finetune.json's
    test accuracy and per-layer IsoScore* the one-process run's, each the direct computation on its export's test
    features (the test batches are the one-process batches, each whole on one rank)."""
    common = (*ISTAR, "--model.dropout", "0.0", "--trainer.max_steps", "5")
    one, two = tmp_path / "one", tmp_path / "two"
    assert train.cli_main(ft_args(one, inputs, *common)) == 0
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(ROOT / "train.py"),
                             *ft_args(two, inputs, *common, "--data.batch_size", "4", "--trainer.devices", "2",
                                      "--trainer.strategy", "ddp")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    a, b = logged(one), logged(two)
    assert sorted(a) == sorted(b) == list(range(5))
    for step in a:
        for key in ("train/loss", "train/reg_loss", "train/isoscore_star"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5), (step, key)
    for name, value in checkpoint(one)["state_dict"].items():
        torch.testing.assert_close(checkpoint(two)["state_dict"][name], value, rtol=1e-4, atol=1e-5, msg=name)
    # C0: each rank's share padded to its own batches' widths (float32 rounding in the padded attention)
    torch.testing.assert_close(checkpoint(two)["regularizer"]["shrinkage"], checkpoint(one)["regularizer"]["shrinkage"],
                               rtol=1e-4, atol=1e-7)
    reports = [json.loads((root / "finetune.json").read_text()) for root in (one, two)]
    assert reports[1]["accuracy"] == pytest.approx(reports[0]["accuracy"], abs=1e-6)
    # the per-layer IsoScore* of the test tokens: each run's equals the direct computation on its own export's test
    # features (the one-process test batches, C0 of every test token), and the two runs' agree
    for root, report in zip((one, two), reports):
        accuracy, stars = direct_test_statistics(root / "export", inputs)
        assert report["accuracy"] == pytest.approx(accuracy, abs=1e-6), root.name
        assert [row["isoscore_star"] for row in report["layers"]] == pytest.approx(stars, abs=1e-6), root.name
    assert [row["isoscore_star"] for row in reports[1]["layers"]] == \
        pytest.approx([row["isoscore_star"] for row in reports[0]["layers"]], abs=1e-5)


def test_validation_examples_dealt_to_the_ranks_give_each_rank_one(inputs):
    """Lightning skips the validation of a rank whose loader has no batch, and the other ranks' synced val/loss then
    waits on it (gloo: a crash at the next step): the 8 validation examples in one batch of 8 go to 2 ranks 4 and 4,
    every example once (their labels are the split's), and fewer validation examples than processes are refused."""
    data = FineTuneDataModule(source=str(inputs["data"]), max_length=32, batch_size=1, eval_batch_size=8)
    from transformers import AutoTokenizer

    data.attach(AutoTokenizer.from_pretrained(inputs["encoder"]))
    labels = data.labels["val"].tolist()
    assert len(labels) == 8
    read = []
    for rank in range(2):
        data.trainer = SimpleNamespace(global_rank=rank, world_size=2)
        batches = list(data.val_dataloader())
        assert [len(batch["labels"]) for batch in batches] == [4]
        read += batches[0]["labels"].tolist()
        assert sum(len(batch["labels"]) for batch in data.test_dataloader()) == [8, 0][rank]  # one whole test batch
    assert sorted(read) == sorted(labels)
    data.trainer = None
    data.check_examples(8)
    with pytest.raises(UserError, match=r"^8 validation examples for 9 processes: each process validates at least "
                                        r"one$"):
        data.check_examples(9)


@pytest.mark.slow
def test_two_processes_with_one_validation_and_one_test_batch_give_the_one_process_statistics(inputs, tmp_path):
    """2 processes, --data.eval_batch_size 8: one validation batch (8 examples) and one test batch between them. The
    run validates on both ranks (a rank left without a validation batch crashed the run at the next step), and
    finetune.json's test accuracy and IsoScore* are the direct computation on its export (rank 1 reads no test
    batch)."""
    root = tmp_path / "two"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(ROOT / "train.py"),
                             *ft_args(root, inputs, "--trainer.max_steps", "4", "--trainer.val_check_interval", "2",
                                      "--data.batch_size", "4", "--data.eval_batch_size", "8", "--trainer.devices",
                                      "2", "--trainer.strategy", "ddp")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((root / "finetune.json").read_text())
    accuracy, stars = direct_test_statistics(root / "export", inputs, size=8)
    assert report["accuracy"] == pytest.approx(accuracy, abs=1e-6)
    assert [row["isoscore_star"] for row in report["layers"]] == pytest.approx(stars, abs=1e-6)


@pytest.mark.parametrize("items, size", [(8, 5), (23, 4), (3, 5), (0, 5)])
def test_evaluation_batches_are_the_one_process_batches_dealt_whole_to_the_ranks(items, size):
    """DealtBatches: on one process, consecutive batches of `size` (the last shorter); on w processes, rank r reads
    batches r, r + w, ... of those, whole, and __len__ counts them."""
    one = [list(range(start, min(start + size, items))) for start in range(0, items, size)]
    assert list(DealtBatches(items, size)) == one
    for world in (2, 3):
        samplers = [DealtBatches(items, size, rank, world) for rank in range(world)]
        assert [list(sampler) for sampler in samplers] == [one[rank::world] for rank in range(world)]
        assert [len(sampler) for sampler in samplers] == [len(one[rank::world]) for rank in range(world)]


def glue_standin(folder: Path) -> Path:
    """A datasets directory shaped like glue/rte: train, validation and a test split whose labels GLUE hides (-1)."""
    import datasets

    lines = corpus_sentences(90, start=700)
    def split(rows, hidden=False):
        return datasets.Dataset.from_dict({"sentence1": [lines[i] for i in rows], "sentence2": [lines[i + 1] for i in rows],
                                           "label": [-1 if hidden else i % 2 for i in rows], "idx": list(rows)})
    datasets.DatasetDict({"train": split(range(0, 60)), "validation": split(range(60, 80)),
                          "test": split(range(80, 89), hidden=True)}).save_to_disk(str(folder))
    return folder


@pytest.mark.slow
def test_a_glue_config_reads_sentence_pairs_and_its_own_splits(inputs, tmp_path):
    """configs/finetune/rte.yaml with a local stand-in for glue/rte: pairs are encoded as pairs, the hidden test
    labels make validation the test set, and the run writes its report. Every task config parses with its columns."""
    from transformers import AutoTokenizer

    source = glue_standin(tmp_path / "rte")
    root = tmp_path / "run"
    assert train.cli_main(["fit", "--config", str(ROOT / "configs" / "finetune" / "rte.yaml"), "--model.encoder",
                           str(inputs["encoder"]), "--data.source", str(source), "--data.max_length", "32",
                           "--data.batch_size", "8", "--trainer.max_steps", "2", "--model.warmup_steps", "0",
                           "--trainer.val_check_interval", "2", "--trainer.logger", "false",
                           "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(root)]) == 0
    report = json.loads((root / "finetune.json").read_text())
    assert report["classes"] == [0, 1] and report["steps"] == 2
    data = FineTuneDataModule(source=str(source), text_column="sentence1", text_pair_column="sentence2",
                              max_length=32)
    tokenizer = AutoTokenizer.from_pretrained(root / "export")
    data.attach(tokenizer)
    longer = sum(len(tokenizer(text, pair)["input_ids"]) > 32 for text, pair in data.splits.texts["test"])
    assert report["splits"]["test"] == {"from": f"{source} split 'validation' (its 'test' split is unlabelled)",
                                        "examples": 20, "truncated": longer}
    assert report["splits"]["train"]["examples"] == 54 and report["splits"]["val"]["examples"] == 6
    first = data.splits.texts["test"][0]
    expected = tokenizer(first[0], first[1], truncation=True, max_length=32)["input_ids"]
    row = data.sets["test"][[0]]
    assert row["input_ids"][0, :len(expected)].tolist() == expected and 1 in row["token_type_ids"][0].tolist()
    columns = {"sst2": ("sentence", None), "cola": ("sentence", None), "mrpc": ("sentence1", "sentence2"),
               "qqp": ("question1", "question2"), "qnli": ("question", "sentence"), "rte": ("sentence1", "sentence2"),
               "sst5": ("text", None)}
    for name, (text, pair) in columns.items():
        config = yaml.safe_load((ROOT / "configs" / "finetune" / f"{name}.yaml").read_text())
        data_args, trainer = config["data"]["init_args"], config["trainer"]
        assert (data_args["text_column"], data_args["text_pair_column"]) == (text, pair), name
        assert config["model"]["init_args"]["warmup_steps"] == round(trainer["max_steps"] / 10), name
        assert trainer["max_steps"] == 3 * trainer["val_check_interval"], name  # 3 epochs, validated once each


def bad_inputs(tmp: Path, inputs: dict) -> dict[str, tuple[tuple, str]]:
    """name: (extra arguments, the line after `train.py: error: `)."""
    single = tmp / "single.csv"
    single.write_text("text,label\n" + "".join(f"line {i},yes\n" for i in range(20)))
    unlabelled = tmp / "unlabelled.csv"
    unlabelled.write_text("text,label\nfirst line,a\nsecond line,\n")
    unseen = tmp / "unseen"
    unseen.mkdir()
    for split, labels in (("train", "ab"), ("validation", "ab"), ("test", "abz")):
        with open(unseen / f"{split}.csv", "w", newline="", encoding="utf-8") as handle:
            handle.write("text,label\n" + "".join(f"sentence {i},{labels[i % len(labels)]}\n" for i in range(12)))
    from tests.test_refusals import foreign_checkpoint

    pretraining = foreign_checkpoint(tmp / "pretraining.ckpt")
    istar = ("--model.regularizer", "istar", "--model.reg_weight", "1")
    return {
        "an unknown regularizer": (("--model.regularizer", "isotropy"),
                                   "--model.regularizer must be one of none, istar, cosreg, got 'isotropy'"),
        "reg_layers outside the model": ((*istar, "--model.reg_layers", "2,7"),
                                         "--model.reg_layers 2,7: layer(s) [7] are outside the model's layers 0..3 "
                                         "(0 = embedding output)"),
        "reg_layers not understood": ((*istar, "--model.reg_layers", "top"),
                                      "--model.reg_layers must be all, last or layers such as 4 or 1,3,5, got 'top'"),
        "zeta outside [0, 1]": ((*istar, "--model.zeta", "1.5"), "--model.zeta must lie in [0, 1], got 1.5"),
        "a C0 token budget below 2": ((*istar, "--model.reg_shrinkage_tokens", "1"),
                                      "--model.reg_shrinkage_tokens must be at least 2, got 1"),
        "no data source": (("--data.source", "null"), "no data source: pass --data.source (a file with text and label "
                                                      "columns, a datasets directory or a datasets name)"),
        "a label column with one class": (("--data.source", str(single)),
                                          "the label column 'label' has a single class ['yes'] in the training split: "
                                          "nothing to classify"),
        "a label missing from the training split": (("--data.source", str(unseen)),
                                                    "label(s) ['z'] of the test split are not among the training "
                                                    "split's labels ['a', 'b']"),
        "a label column the data lack": (("--data.label_column", "stars"),
                                         f"no label column 'stars' in {inputs['data']} (columns: ['label', 'text']); "
                                         "pass --data.label_column"),
        "a row without a label": (("--data.source", str(unlabelled)), f"{unlabelled}: row 2 has no label (column "
                                                                     "'label')"),
        "a text pair column the data lack": (("--data.text_pair_column", "hypothesis"),
                                             f"text pair column 'hypothesis' not in {inputs['data']} (columns: "
                                             "['label', 'text'])"),
        "classes that are not two distinct ones": (("--data.classes", "[comma]"),
                                                   "--data.classes needs at least two distinct classes, got "
                                                   "['comma']"),
        "split fractions that leave no training split": (("--data.val_fraction", "0.6", "--data.test_fraction", "0.5"),
                                                         "--data.val_fraction 0.6 and --data.test_fraction 0.5 must be "
                                                         "in [0, 1) and sum below 1"),
        "a global batch that is not a multiple of the batch": (("--data.global_batch_size", "12"),
                                                               "--data.global_batch_size 12 must be a multiple of "
                                                               "--data.batch_size 8"),
        "too few training examples for a global batch": (("--data.global_batch_size", "128"),
                                                         "64 training examples make no full global batch of 128"),
        "an encoder that is not there": (("--model.encoder", str(tmp / "no-such-encoder")),
                                         f"encoder path not found: {tmp / 'no-such-encoder'}"),
        "max_length beyond the encoder": (("--data.max_length", "100"),
                                          "--data.max_length 100 exceeds the encoder's 64 positions"),
        "max_length that holds no token": (("--data.max_length", "1"), "--data.max_length too small: 1 (at least 2)"),
        "a checkpoint of pretraining": (("--ckpt_path", str(pretraining)),
                                        f"{pretraining} is not a checkpoint of this project's fine-tuning (no "
                                        "FineTuneModule hyper-parameters and state_dict)"),
    }


@pytest.mark.parametrize("case", ["an unknown regularizer", "reg_layers outside the model", "reg_layers not understood",
                                  "zeta outside [0, 1]", "a C0 token budget below 2", "no data source", "a label column with one class",
                                  "a label missing from the training split", "a label column the data lack",
                                  "a row without a label", "a text pair column the data lack",
                                  "classes that are not two distinct ones",
                                  "split fractions that leave no training split",
                                  "a global batch that is not a multiple of the batch",
                                  "too few training examples for a global batch", "an encoder that is not there",
                                  "max_length beyond the encoder", "max_length that holds no token",
                                  "a checkpoint of pretraining"])
def test_fine_tuning_bad_input_is_one_line_exit_2_and_writes_nothing(inputs, tmp_path, capfd, case):
    extra, message = bad_inputs(tmp_path, inputs)[case]
    root = tmp_path / "run"
    before = files_under(tmp_path)
    assert train.cli_main(ft_args(root, inputs, *extra)) == 2
    assert stderr_lines(capfd) == ["train.py: error: " + message]
    assert files_under(tmp_path) == before


@pytest.mark.slow
def test_resuming_a_fine_tuning_run_on_data_with_other_classes_is_refused(straight, inputs, tmp_path, capfd):
    root = tmp_path / "run"
    shutil.copytree(straight, root)
    other = tmp_path / "other.csv"
    other.write_text(inputs["data"].read_text(encoding="utf-8").replace(",comma\n", ",clause\n"), encoding="utf-8")
    files = files_under(root)
    assert train.cli_main(ft_args(root, {**inputs, "data": other}, "--ckpt_path", "last",
                                  "--trainer.max_steps", "14")) == 2
    ckpt = root / "checkpoints" / "last.ckpt"
    assert stderr_lines(capfd) == [f"train.py: error: checkpoint {ckpt} was fine-tuned on the classes ['comma', "
                                   "'plain'] but the data give ['clause', 'plain']; resume with the same data"]
    assert files_under(root) == files


@pytest.mark.slow
def test_a_regulariser_with_weight_zero_warns_and_trains_as_without(inputs, tmp_path, straight):
    """λ = 0: one warning line, then the run of regularizer none (the same losses), with its statistic logged."""
    short = ("--trainer.max_steps", "3")
    assert train.cli_main(ft_args(tmp_path / "none", inputs, *short)) == 0
    with pytest.warns(UserWarning) as said:
        assert train.cli_main(ft_args(tmp_path / "zero", inputs, *short, "--model.regularizer", "istar")) == 0
    assert [str(w.message) for w in said if str(w.message).startswith("--model.regularizer")] == [
        "--model.regularizer istar with --model.reg_weight 0 does not change the loss: its isoscore_star is computed "
        "and logged only (λ > 0 pushes towards isotropy, λ < 0 away)"]
    none, zero = logged(tmp_path / "none"), logged(tmp_path / "zero")
    assert {step: row["train/loss"] for step, row in zero.items()} == \
        {step: row["train/loss"] for step, row in none.items()}
    assert sorted(zero) == [0, 1, 2] and all(row["train/reg_loss"] == 0 for row in zero.values())
    # the statistic is the one λ 0.5 computes: at step 0 (the same weights, batch and dropout, before any update) the
    # straight run's IsoScore*, which its reg_loss = 0.5 (1 - IsoScore*) ties to the loss it trained with
    reference = logged(straight)[0]
    assert zero[0]["train/isoscore_star"] == pytest.approx(reference["train/isoscore_star"], rel=1e-6)
    assert 0 < zero[0]["train/isoscore_star"] < 1
@pytest.mark.parametrize("extra, message", [
    (("--model.regularizer", "cosreg", "--model.reg_layers", "5"),
     "--model.reg_layers 5: layer(s) [5] are outside the model's layers 0..2 (0 = embedding output)"),
    (("--model.regularizer", "istar", "--model.zeta", "-0.1"), "--model.zeta must lie in [0, 1], got -0.1"),
])
def test_pretraining_refuses_bad_regulariser_options_in_one_line(corpus, cache, tmp_path, capfd, extra, message):
    from tests.test_train import tiny_args

    root = tmp_path / "run"
    assert train.cli_main(tiny_args(root, corpus, cache, *extra, "--model.reg_weight", "1")) == 2
    assert stderr_lines(capfd) == ["train.py: error: " + message] and not root.exists()


# ---- SoftDecay inside the model (lightning_modules/softdecay.py) ---------------------------------------------------

SOFTDECAY = ("--model.softdecay", "true", "--model.dropout", "0.0", "--trainer.max_steps", "6",
             "--model.decay_steps", "6", "--trainer.val_check_interval", "6")


@pytest.mark.slow
def test_softdecay_fine_tuning_learns_alpha_logs_it_and_the_logits_are_the_heads_of_the_transformed_last_layer(
        inputs, tmp_path):
    """--model.softdecay true as tokenUni place it (before the last LayerNorm, their unconstrained alpha learned from
    -0.2) and our variant with a fixed alpha (-0.3) on the last layer's output: train/softdecay_alpha is logged every
    step (the learned one moves, the fixed one stays), finetune.json holds the last alpha, and the trained module's
    logits are the head (pooler + classifier) of the last layer computed by hand from the export (which holds no
    SoftDecay) at that alpha: LayerNorm(SoftDecay(FFN(x) + x) + x) in the last layer, or SoftDecay of its output."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from lightning_modules.finetune import FineTuneModule
    from tests.test_softdecay import direct_soft_decay

    learned, fixed = tmp_path / "learned", tmp_path / "fixed"
    assert train.cli_main(ft_args(learned, inputs, *SOFTDECAY)) == 0
    assert train.cli_main(ft_args(fixed, inputs, *SOFTDECAY, "--model.softdecay_alpha", "-0.3",
                                  "--model.softdecay_alpha_mode", "fixed",
                                  "--model.softdecay_placement", "after_layernorm")) == 0
    for root, initial, mode in ((learned, -0.2, "learned"), (fixed, -0.3, "fixed")):
        alphas = [logged(root)[step]["train/softdecay_alpha"] for step in range(6)]
        report = json.loads((root / "finetune.json").read_text())
        assert (report["softdecay"], report["softdecay_alpha_initial"], report["softdecay_alpha_mode"],
                report["softdecay_placement"]) == (True, initial, mode,
                                                   "before_layernorm" if mode == "learned" else "after_layernorm")
        assert alphas[0] == pytest.approx(initial, abs=1e-6)
        if mode == "learned":  # moved step by step (Adam, lr 1e-3), and the report holds the alpha after the last update
            assert all(a != b for a, b in zip(alphas, alphas[1:])) and abs(report["softdecay_alpha"] - initial) > 1e-4
        else:
            assert len(set(alphas)) == 1 and report["softdecay_alpha"] == initial  # (logged in float32)
        module = FineTuneModule.load_from_checkpoint(root / "checkpoints" / "last.ckpt", map_location="cpu").eval()
        assert module.softdecay.value() == pytest.approx(report["softdecay_alpha"], abs=1e-7)
        exported = AutoModelForSequenceClassification.from_pretrained(root / "export").eval()
        tokenizer = AutoTokenizer.from_pretrained(root / "export")
        batch = tokenizer(corpus_sentences(5, start=5000), padding=True, truncation=True, max_length=32,
                          return_tensors="pt")
        last, seen = exported.bert.encoder.layer[-1].output, {}
        handle = last.register_forward_hook(
            lambda m, args, out, seen=seen: seen.update(x=args[1], z=m.dense(args[0]) + args[1]))
        with torch.no_grad():
            states = exported.bert(**batch, output_hidden_states=True).hidden_states
            handle.remove()
            source = seen["z"] if mode == "learned" else states[-1]
            transformed = source.double().clone()
            for row, n in enumerate(batch["attention_mask"].sum(1).tolist()):
                transformed[row, :n] = torch.from_numpy(direct_soft_decay(source[row, :n].double().numpy(),
                                                                          report["softdecay_alpha"]))
            if mode == "learned":
                transformed = last.LayerNorm(transformed.float() + seen["x"]).double()
            expected = exported.classifier(exported.bert.pooler(transformed.float()))
            torch.testing.assert_close(module(dict(batch)).logits, expected, rtol=1e-4, atol=1e-4)
            # the last hidden state the regularisers and live statistics read is the transformed one; the others
            ours = module(dict(batch), hidden_states=True).hidden_states  # are the layers' own
            mask = batch["attention_mask"].bool()
            torch.testing.assert_close(ours[-1][mask], transformed.float()[mask], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(ours[-2], states[-2], rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", ["alpha below -1", "alpha of 0", "alpha of 1 without softdecay",
                                  "an unknown alpha mode", "an unknown placement", "an encoder without a layer stack"])
def test_softdecay_bad_input_is_one_line_exit_2_and_writes_nothing(inputs, tmp_path, capfd, case):
    alpha = "--model.softdecay_alpha must lie in (-1, 0) (SoftDecay needs alpha < 0, and alpha <= -1 takes the log " \
            "of a non-positive number for small singular values), got "
    if case == "an encoder without a layer stack":  # ALBERT: shared layer groups, no encoder.layer list
        albert = save_tiny_encoder(tmp_path / "albert", "albert", bert_tokenizer(tmp_path / "tok"))
        capfd.readouterr()  # the save's progress bar
        extra = ("--model.softdecay", "true", "--model.encoder", str(albert))
        message = (f"--model.softdecay cannot wrap {str(albert)!r} (AlbertForSequenceClassification): it has no layer "
                   "stack whose output is the last layer's token matrix (an `encoder.layer` or `transformer.layer` "
                   "list beside `embeddings`, as BERT, RoBERTa, DistilBERT, ELECTRA)")
    else:
        extra, message = {
            "alpha below -1": (("--model.softdecay", "true", "--model.softdecay_alpha", "-1.5"), alpha + "-1.5"),
            "alpha of 0": (("--model.softdecay", "true", "--model.softdecay_alpha", "0"), alpha + "0.0"),
            "alpha of 1 without softdecay": (("--model.softdecay_alpha", "1"), alpha + "1.0"),
            "an unknown alpha mode": (("--model.softdecay", "true", "--model.softdecay_alpha_mode", "sigmoid"),
                                      "--model.softdecay_alpha_mode must be one of learned, bounded, fixed, got "
                                      "'sigmoid'"),
            "an unknown placement": (("--model.softdecay_placement", "inside"),
                                     "--model.softdecay_placement must be one of before_layernorm, after_layernorm, "
                                     "got 'inside'"),
        }[case]
    root = tmp_path / "run"
    before = files_under(tmp_path)
    assert train.cli_main(ft_args(root, inputs, *extra)) == 2
    assert stderr_lines(capfd) == ["train.py: error: " + message]
    assert files_under(tmp_path) == before


@pytest.mark.parametrize("pairs", [False, True])
def test_truncated_examples_are_counted_per_split_and_said(inputs, tmp_path, pairs):
    """Examples over --data.max_length are cut: finetune.json's splits count them, and one warning says so; the
    count is the examples whose whole tokenisation (pair and special tokens included) is longer, computed directly."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(inputs["encoder"])
    data = tmp_path / "long.csv"
    with open(data, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text", "other", "label"])
        for i, line in enumerate(corpus_sentences(60, start=100)):
            writer.writerow([line * (1 + i % 3), line[:20], i % 2])
    module = FineTuneDataModule(source=str(data), max_length=24, text_pair_column="other" if pairs else None)
    with pytest.warns(UserWarning, match="were truncated") as caught:
        module.attach(tokenizer)
    direct = {}
    for split in ("train", "val", "test"):
        texts = module.splits.texts[split]
        direct[split] = sum(len(tokenizer(text, pair)["input_ids"]) > 24 for text, pair in texts)
        assert module.described()[split]["truncated"] == direct[split]
        assert max(len(ids) for ids in module.sets[split].encoded["input_ids"]) == 24
    assert 0 < direct["train"] < len(module.splits.texts["train"])
    said = ", ".join(f"{direct[s]} of {len(module.splits.texts[s])} {s}" for s in ("train", "val", "test"))
    assert [str(w.message) for w in caught if "truncated" in str(w.message)] == [
        f"examples longer than --data.max_length 24 tokens were truncated: {said} (counted in finetune.json's splits)"]
    # under DDP every rank tokenises the whole splits: the same counts, said once (rank 0), not once per rank
    other = FineTuneDataModule(source=str(data), max_length=24, text_pair_column="other" if pairs else None)
    other.trainer = SimpleNamespace(global_rank=1, world_size=2)
    with warnings.catch_warnings(record=True) as rank_1:
        warnings.simplefilter("always")
        other.attach(tokenizer)
    assert other.truncated == direct and not [w for w in rank_1 if "truncated" in str(w.message)]


def test_a_pair_missing_from_a_row_skips_the_row_as_a_missing_text_does(inputs, tmp_path):
    """A JSON null (or an empty cell, or one holding only invisible characters) in --data.text_pair_column is a row
    without its second sentence: skipped and counted in one warning, as a row without text is, never encoded as a
    single sentence (or a TypeError in setup); a second sentence is cleaned as the first is (a leading BOM dropped)."""
    from transformers import AutoTokenizer

    lines = corpus_sentences(40, start=500)
    data = tmp_path / "pairs.jsonl"
    missing = {3: None, 17: "", 29: None, 33: "\u200b \u2060"}
    bom = {5: "\ufeff" + lines[4]}
    data.write_text("".join(json.dumps({"premise": line, "hypothesis": missing.get(i, bom.get(i, lines[i - 1])),
                                        "label": i % 2})
                            + "\n" for i, line in enumerate(lines)), encoding="utf-8")
    module = FineTuneDataModule(source=str(data), text_column="premise", text_pair_column="hypothesis",
                                val_fraction=0.2, test_fraction=0.2)
    with pytest.warns(UserWarning, match=f"^{len(missing)} rows of {data} had no text: skipped$"):
        module.attach(AutoTokenizer.from_pretrained(inputs["encoder"]))
    kept = [(text, pair) for split in ("train", "val", "test") for text, pair in module.splits.texts[split]]
    assert sorted(kept) == sorted((line, lines[i - 1]) for i, line in enumerate(lines) if i not in missing)


def test_fine_tuning_from_a_pretraining_checkpoint_keeps_its_dropout_as_from_its_export(roberta_tok, tmp_path):
    """--model.encoder run/checkpoints/last.ckpt and --model.encoder run (its export) are one model: both fine-tune
    with the pretraining's dropout (here 0.25, its hyper-parameter), the head's included; the .ckpt was read with
    dropout 0, so fine-tuning from it trained without any."""
    from torch import nn

    from core.tokenizers import tokenizer_files
    from lightning_modules.finetune import load_classifier
    from lightning_modules.mlm import MLMModule, export

    torch.manual_seed(0)
    module = MLMModule(vocab_size=len(roberta_tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, max_position_embeddings=66, dropout=0.25)
    export(module, roberta_tok, tmp_path / "export")
    ckpt = tmp_path / "last.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams), "global_step": 1,
                "MLMDataModule": {"tokenizer_files": tokenizer_files(roberta_tok)}}, ckpt)
    rates = {}
    for source in (ckpt, tmp_path / "export"):
        classifier, _ = load_classifier(str(source), ["a", "b"])
        config = classifier.config
        assert (config.hidden_dropout_prob, config.attention_probs_dropout_prob) == (0.25, 0.25), source
        rates[source] = [m.p for m in classifier.modules() if isinstance(m, nn.Dropout)]
        states = {key: value for key, value in classifier.state_dict().items() if not key.startswith("classifier")}
        for key, value in module.model.roberta.state_dict().items():  # the same encoder weights either way
            torch.testing.assert_close(states[f"roberta.{key}"], value, rtol=0, atol=0, msg=key)
    assert rates[ckpt] == rates[tmp_path / "export"] and set(rates[ckpt]) == {0.25}


def test_the_new_head_depends_on_the_seed_alone_whether_from_a_checkpoint_or_its_export(roberta_tok, tmp_path):
    """--model.encoder run/checkpoints/last.ckpt (built from_config) and --model.encoder run (its export, from_pretrained)
    consume the global generator differently: with one seed both give the head drawn from that seed by a generator of
    its own (compared with one drawn here by hand: normal(0, initializer_range) in module order, biases 0), whatever
    the global generator's state; another seed gives another head."""
    from core.tokenizers import tokenizer_files
    from lightning_modules.finetune import load_classifier
    from lightning_modules.mlm import MLMModule, export

    torch.manual_seed(0)
    module = MLMModule(vocab_size=len(roberta_tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, max_position_embeddings=66)
    export(module, roberta_tok, tmp_path / "export")
    ckpt = tmp_path / "last.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams), "global_step": 1,
                "MLMDataModule": {"tokenizer_files": tokenizer_files(roberta_tok)}}, ckpt)

    def head(source, seed: int) -> dict:
        torch.manual_seed(1234)  # the same global state before each load: the paths consume it differently
        model, _ = load_classifier(str(source), ["a", "b", "c"], seed)
        return {key: value for key, value in model.state_dict().items() if key.startswith("classifier.")}

    heads = {(source, seed): head(source, seed) for source in (ckpt, tmp_path / "export") for seed in (3, 4)}
    std = module.model.config.initializer_range
    for seed in (3, 4):
        generator = torch.Generator().manual_seed(seed)
        by_hand = {}
        for name, shape in (("dense", (32, 32)), ("out_proj", (3, 32))):
            by_hand[f"classifier.{name}.weight"] = torch.empty(shape).normal_(0.0, std, generator=generator)
            by_hand[f"classifier.{name}.bias"] = torch.zeros(shape[0])
        for source in (ckpt, tmp_path / "export"):
            assert heads[source, seed].keys() == by_hand.keys()
            for key, value in by_hand.items():
                torch.testing.assert_close(heads[source, seed][key], value, rtol=0, atol=0, msg=f"{source} {key}")
    assert not torch.equal(heads[ckpt, 3]["classifier.out_proj.weight"], heads[ckpt, 4]["classifier.out_proj.weight"])
    from lightning_fabric.utilities.seed import seed_everything

    from lightning_modules.finetune import FineTuneModule

    previous = os.environ.get("PL_GLOBAL_SEED")
    try:  # the module takes the run's seed (train.py's --seed_everything, set before it is built)
        seed_everything(4, verbose=False)
        built = FineTuneModule(encoder=str(tmp_path / "export"), classes=["a", "b", "c"]).model.state_dict()
    finally:
        if previous is None:
            del os.environ["PL_GLOBAL_SEED"]
        else:
            os.environ["PL_GLOBAL_SEED"] = previous
    for key, value in heads[ckpt, 4].items():
        torch.testing.assert_close(built[key], value, rtol=0, atol=0, msg=key)
    # a fine-tuned source keeps its head when the classes fit it (as transformers keeps it); another size is redrawn
    model, tokenizer = load_classifier(str(tmp_path / "export"), ["a", "b", "c"], 3)
    with torch.no_grad():
        model.classifier.out_proj.weight.add_(1.0)  # a trained head: no draw of any seed gives it
    model.save_pretrained(tmp_path / "finetuned")
    tokenizer.save_pretrained(tmp_path / "finetuned")
    trained = {key: value for key, value in model.state_dict().items() if key.startswith("classifier.")}
    kept = head(tmp_path / "finetuned", 4)
    for key, value in trained.items():
        torch.testing.assert_close(kept[key], value, rtol=0, atol=0, msg=key)
    resized, _ = load_classifier(str(tmp_path / "finetuned"), ["a", "b"], 4)
    generator = torch.Generator().manual_seed(4)  # only out_proj is of another size: it alone is drawn
    torch.testing.assert_close(resized.classifier.out_proj.weight, torch.empty(2, 32).normal_(0.0, std, generator=generator),
                               rtol=0, atol=0)
    torch.testing.assert_close(resized.classifier.dense.weight, trained["classifier.dense.weight"], rtol=0, atol=0)
