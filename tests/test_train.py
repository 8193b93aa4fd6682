"""train.py end to end on a 30-line corpus (CPU, tiny RoBERTa): PE and no-PE fits, export, exact resume, DDP, bad input.

    .venv/bin/pytest tests/test_train.py -q
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import yaml

import train
from tests.tiny import corpus_sentences

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")  # pytest's own argv is expected
STEPS = 10  # 55 training blocks of 32 tokens / global batch 8 = 6 steps an epoch: 10 steps cross an epoch end


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "small.txt"
    path.write_text("\n".join(corpus_sentences(30)) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def tiny_args(root: Path, corpus: Path, cache: Path, *extra: str) -> list[str]:
    # name given: jsonargparse would keep the default AutoWandbLogger's name (null) for the CSVLogger
    logger = json.dumps({"class_path": "pytorch_lightning.loggers.CSVLogger",
                         "init_args": {"save_dir": str(root), "name": "lightning_logs"}})
    return [
        "fit", "--model.hidden_size", "32", "--model.num_hidden_layers", "2", "--model.num_attention_heads", "4",
        "--model.intermediate_size", "64", "--model.max_position_embeddings", "34", "--model.dropout", "0.1",
        "--model.warmup_steps", "2", "--model.lr", "1e-3", "--model.decay_steps", str(STEPS),
        "--data.corpus", str(corpus), "--data.vocab_size", "600", "--data.block_length", "32",
        "--data.batch_size", "8", "--data.global_batch_size", "8", "--data.val_fraction", "0.1",
        "--data.cache_dir", str(cache),
        "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.max_steps", str(STEPS),
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.log_every_n_steps", "1", "--trainer.num_sanity_val_steps", "0", "--trainer.logger", logger,
        "--trainer.default_root_dir", str(root), "--checkpoint.every_n_train_steps", "2", *extra,
    ]


def fit(root: Path, corpus: Path, cache: Path, *extra: str) -> int:
    return train.cli_main(tiny_args(root, corpus, cache, *extra))


def metrics(root: Path) -> list[dict]:
    rows = []
    for path in sorted((root / "lightning_logs").glob("version_*/metrics.csv")):
        with path.open() as handle:
            rows += list(csv.DictReader(handle))
    return rows


def train_losses(root: Path) -> dict[int, float]:
    return {int(r["step"]): float(r["train/loss"]) for r in metrics(root) if r.get("train/loss")}


def checkpoint(root: Path) -> dict:
    return torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus, cache) -> dict[bool, Path]:
    """Two straight runs of STEPS steps: with (True) and without (False) positional embeddings, dropout 0.1."""
    out = {}
    for pe in (True, False):
        root = tmp_path_factory.mktemp(f"run-pe-{pe}")
        assert fit(root, corpus, cache, "--model.position_embeddings", str(pe).lower()) == 0
        out[pe] = root
    return out


@pytest.mark.slow
@pytest.mark.parametrize("pe", [True, False])
def test_fit_learns_logs_perplexity_and_exports(runs, pe):
    from transformers import AutoModelForMaskedLM

    root = runs[pe]
    losses = train_losses(root)
    assert sorted(losses) == list(range(STEPS))
    assert sum(list(losses.values())[-3:]) / 3 < sum(list(losses.values())[:3]) / 3  # it learns
    val = [r for r in metrics(root) if r.get("val/loss")]
    assert val and all(math.isclose(float(r["val/perplexity"]), math.exp(float(r["val/loss"])), rel_tol=1e-5)
                       for r in val)
    saved = checkpoint(root)
    assert saved["global_step"] == STEPS and saved["hyper_parameters"]["position_embeddings"] is pe
    model = AutoModelForMaskedLM.from_pretrained(root / "export")
    assert model.config._attn_implementation == "sdpa"
    table = model.roberta.embeddings.position_embeddings.weight
    assert bool(table.abs().sum() > 0) is pe  # no-PE: still all zero after training, in the plain transformers model


@pytest.mark.slow
@pytest.mark.parametrize("pe", [True, False])
def test_export_gives_the_module_hidden_states_and_stays_position_free(runs, pe):
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from lightning_modules.encoder import load_encoder
    from lightning_modules.mlm import MLMModule

    root = runs[pe]
    module = MLMModule.load_from_checkpoint(root / "checkpoints" / "last.ckpt", map_location="cpu").eval()
    exported = AutoModelForMaskedLM.from_pretrained(root / "export").eval()
    tokenizer = AutoTokenizer.from_pretrained(root / "export")
    assert tokenizer.convert_tokens_to_ids(["<s>", "<pad>", "</s>", "<unk>", "<mask>"]) == [0, 1, 2, 3, 4]
    ids = tokenizer(["Mrs. Dashwood was surprised only for a moment at seeing him."], return_tensors="pt")["input_ids"]
    perm = torch.cat([torch.tensor([0]), torch.randperm(ids.shape[1] - 2) + 1, torch.tensor([ids.shape[1] - 1])])
    with torch.no_grad():
        ours = module.model.roberta(input_ids=ids, output_hidden_states=True).hidden_states
        theirs = exported.roberta(input_ids=ids, output_hidden_states=True).hidden_states
        shuffled = exported.roberta(input_ids=ids[:, perm], output_hidden_states=True).hidden_states[-1]
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert torch.allclose(theirs[-1][:, perm], shuffled, atol=1e-5) is (not pe)
    from_ckpt = load_encoder(root / "checkpoints" / "last.ckpt", device="cpu")  # .ckpt: weights + embedded tokenizer
    from_run = load_encoder(root, device="cpu")  # the run directory resolves to export/
    inputs, _ = from_run.tokenize(["Elinor saw, with concern, the low spirits of her sister."])
    torch.testing.assert_close(from_ckpt(**inputs).hidden_states, from_run(**inputs).hidden_states, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_analyze_outliers_reads_the_no_pe_run(runs, tmp_path):
    import analyze

    out = tmp_path / "outliers"
    code = analyze.main(["outliers", "--encoder", str(runs[False]), "--data", str(ROOT / "data" / "austen.txt"),
                         "--max_sentences", "40", "--output_dir", str(out), "--no_progress"])
    report = json.loads((out / "outliers.json").read_text())
    assert code == 0 and report["hidden_size"] == 32 and report["num_layers"] == 2
    assert report["origins"]["position_embeddings"] is None and "all zeros" in report["origins"]["position_embeddings_note"]


@pytest.mark.slow
@pytest.mark.parametrize("stop", [4, 6])  # mid-epoch, and exactly at the end of epoch 0
def test_resume_equals_straight_run(runs, corpus, cache, tmp_path, stop):
    root = tmp_path / "resumed"
    assert fit(root, corpus, cache, "--trainer.max_steps", str(stop)) == 0
    assert checkpoint(root)["global_step"] == stop
    assert fit(root, corpus, cache, "--ckpt_path", "last") == 0
    straight, resumed = checkpoint(runs[True]), checkpoint(root)
    assert resumed["global_step"] == STEPS
    for name, value in straight["state_dict"].items():
        torch.testing.assert_close(resumed["state_dict"][name], value, rtol=0, atol=0, msg=name)
    assert train_losses(root) == train_losses(runs[True])  # same data, masks and dropout at every step


@pytest.mark.slow
def test_streaming_run_resumes_exactly(corpus, cache, tmp_path):
    streaming = ("--data.streaming", "true", "--data.val_texts", "4", "--trainer.val_check_interval", "3")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert fit(straight, corpus, cache, *streaming, "--trainer.max_steps", "4", "--model.decay_steps", "4") == 0
    assert fit(resumed, corpus, cache, *streaming, "--trainer.max_steps", "2", "--model.decay_steps", "4") == 0
    assert fit(resumed, corpus, cache, *streaming, "--trainer.max_steps", "4", "--model.decay_steps", "4",
               "--ckpt_path", "last") == 0
    assert train_losses(resumed) == train_losses(straight) and len(train_losses(straight)) == 4
    for name, value in checkpoint(straight)["state_dict"].items():
        torch.testing.assert_close(checkpoint(resumed)["state_dict"][name], value, rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_two_process_ddp_matches_one_process_and_accumulation(corpus, cache, tmp_path):
    no_dropout = ("--model.dropout", "0.0", "--trainer.max_steps", "4")
    one, accumulated, ddp = tmp_path / "one", tmp_path / "accumulated", tmp_path / "ddp"
    assert fit(one, corpus, cache, *no_dropout) == 0
    assert fit(accumulated, corpus, cache, *no_dropout, "--data.batch_size", "4") == 0  # 2 micro-batches a step
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *tiny_args(ddp, corpus, cache, *no_dropout, "--data.batch_size", "4",
                                                            "--trainer.devices", "2", "--trainer.strategy", "ddp")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    reference = train_losses(one)
    assert len(reference) == 4
    for other in (ddp, accumulated):
        losses = train_losses(other)
        if other == ddp:  # per-step losses: the mean over both ranks equals one process's mean
            assert losses.keys() == reference.keys()
            assert all(math.isclose(losses[s], reference[s], rel_tol=1e-5) for s in reference)
        weights = checkpoint(other)["state_dict"]
        for name, value in checkpoint(one)["state_dict"].items():
            torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("extra, message", [
    (("--data.corpus", "/no/such/corpus.txt"), "corpus not found"),
    (("--data.corpus", "EMPTY"), "empty"),
    (("--data.global_batch_size", "12"), "not a multiple"),
    (("--data.block_length", "64"), "exceeds the model's 32 positions"),
    (("--trainer.accumulate_grad_batches", "3"), "contradicts --data.global_batch_size"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(corpus, cache, tmp_path, capsys, extra, message):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    extra = tuple(str(empty) if e == "EMPTY" else e for e in extra)
    root = tmp_path / "run"
    assert fit(root, corpus, cache, *extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("train.py: error: ") and message in err[-1]
    assert not root.exists()


@pytest.fixture
def other_tokenizer(tmp_path, corpus):
    """A tokenizer of the same size as the runs' but trained on other text."""
    from datamodules.tokenizer import train_tokenizer

    tokenizer = train_tokenizer(iter(corpus_sentences(400, start=5000)), vocab_size=600)
    tokenizer.save_pretrained(tmp_path / "other-tokenizer")
    return tmp_path / "other-tokenizer"


@pytest.mark.slow
@pytest.mark.parametrize("pe, extra, message", [
    (True, ("--model.position_embeddings", "false"), "trained with positional embeddings but the config asks"),
    (False, ("--model.position_embeddings", "true"), "trained without positional embeddings (no-PE) but"),
    (True, ("--data.vocab_size", "500"), "vocab_size=600 but the config gives 500"),
    (True, ("--data.tokenizer", "OTHER"), "tokenizer does not match"),
])
def test_resume_with_a_mismatching_config_is_refused(runs, corpus, cache, tmp_path, capsys, other_tokenizer, pe, extra,
                                                     message):
    root = tmp_path / "run"
    shutil.copytree(runs[pe], root)
    before = (root / "checkpoints" / "last.ckpt").read_bytes()
    versions = sorted((root / "lightning_logs").iterdir())
    extra = tuple(str(other_tokenizer) if e == "OTHER" else e for e in extra)
    assert fit(root, corpus, cache, *extra, "--ckpt_path", "last", "--trainer.max_steps", str(STEPS + 2)) == 2
    assert message in capsys.readouterr().err
    assert (root / "checkpoints" / "last.ckpt").read_bytes() == before
    assert sorted((root / "lightning_logs").iterdir()) == versions


class PoisonAt(pl.Callback):
    """Test helper: makes one weight NaN just before the training step `step` (so that step's loss is NaN)."""

    def __init__(self, step: int = 5) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.model.lm_head.dense.weight[0, 0] = float("nan")


@pytest.mark.slow
def test_nan_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(corpus, cache, tmp_path, capsys):
    root = tmp_path / "run"
    poison = '{"class_path": "tests.test_train.PoisonAt", "init_args": {"step": 5}}'
    assert fit(root, corpus, cache, "--trainer.callbacks+", poison) == 2
    err = capsys.readouterr().err
    assert "non-finite training loss (nan)" in err and "at step 5" in err
    saved = checkpoint(root)
    assert saved["global_step"] == 4  # saved every 2 steps: the last one before the NaN
    assert all(torch.isfinite(value).all() for value in saved["state_dict"].values())
    assert not (root / "export").exists()


@pytest.mark.slow
def test_fast_dev_run_of_the_tiny_config(tmp_path):
    config = ROOT / "configs" / "pretrain" / "tiny.yaml"
    root = tmp_path / "tiny"
    code = train.cli_main(["fit", "--config", str(config), "--trainer.fast_dev_run", "true",
                           "--trainer.default_root_dir", str(root), "--data.cache_dir", str(tmp_path / "cache"),
                           "--trainer.enable_progress_bar", "false"])
    assert code == 0
    expected = yaml.safe_load(config.read_text())["model"]
    exported = yaml.safe_load((root / "export" / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "max_position_embeddings"):
        assert exported[key] == expected[key]
    assert exported["vocab_size"] == yaml.safe_load(config.read_text())["data"]["vocab_size"]
