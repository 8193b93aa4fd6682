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
    return torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)


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
    assert len(ours) == 3  # the embeddings' output and 2 layers: every one compared, none left out of the zip
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert torch.allclose(theirs[-1][:, perm], shuffled, atol=1e-5) is (not pe)
    from_ckpt = load_encoder(root / "checkpoints" / "last.ckpt", device="cpu")  # .ckpt: weights + embedded tokenizer
    from_run = load_encoder(root, device="cpu")  # the run directory resolves to export/
    inputs, _ = from_run.tokenize(["Elinor saw, with concern, the low spirits of her sister."])
    torch.testing.assert_close(from_ckpt(**inputs).hidden_states, from_run(**inputs).hidden_states, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_a_padded_vocabulary_is_never_predicted_and_the_export_has_the_tokenizers_size(corpus, cache, tmp_path):
    """--model.pad_vocab_to_multiple_of 64: 600 tokenizer ids, 640 embedding and LM-head rows in training; the padding
    rows get no gradient (the LM-head bias stays zero there) and the loss is the cross-entropy over the 600 real
    logits. The export and the .ckpt load in plain transformers with 600 rows and the module's logits for every real
    token."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from lightning_modules.checkpoints import load_checkpoint_model
    from lightning_modules.mlm import MLMModule

    root = tmp_path / "padded"
    assert fit(root, corpus, cache, "--model.pad_vocab_to_multiple_of", "64", "--trainer.max_steps", "3") == 0
    module = MLMModule.load_from_checkpoint(root / "checkpoints" / "last.ckpt", map_location="cpu").eval()
    assert module.vocab_size == 600 and module.model.config.vocab_size == 640
    bias = module.model.lm_head.bias.detach()
    assert bool((bias[600:] == 0).all()) and bool((bias[:600] != 0).any())  # trained rows moved, padding rows not
    exported = AutoModelForMaskedLM.from_pretrained(root / "export").eval()
    tokenizer = AutoTokenizer.from_pretrained(root / "export")
    assert exported.config.vocab_size == len(tokenizer) == 600
    from_ckpt, _ = load_checkpoint_model(root / "checkpoints" / "last.ckpt")
    ids = torch.randint(5, 600, (3, 20))
    with torch.no_grad():
        ours = module.model(input_ids=ids).logits  # [3, 20, 640]
        for other in (exported, from_ckpt):
            torch.testing.assert_close(other(input_ids=ids).logits, ours[..., :600], rtol=0, atol=1e-5)
    batch = {"input_ids": ids, "positions": torch.tensor([[1, 4], [2, 7], [3, 9]]),
             "targets": torch.tensor([[7, 590], [9, -100], [11, 12]])}
    with torch.no_grad():
        loss = module(batch).loss
        picked = ours[torch.arange(3)[:, None], batch["positions"]][..., :600]  # the real logits only
        expected = torch.nn.functional.cross_entropy(picked.flatten(0, 1), batch["targets"].flatten())
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_analyze_outliers_reads_the_no_pe_run(runs, tmp_path):
    import analyze

    out = tmp_path / "outliers"
    code = analyze.main(["outliers", "--encoder", str(runs[False]), "--data", str(ROOT / "core" / "corpus" / "austen.txt"),
                         "--max_sentences", "40", "--output_dir", str(out), "--no_progress"])
    report = json.loads((out / "outliers.json").read_text())
    assert code == 0 and report["hidden_size"] == 32 and report["num_layers"] == 2
    assert report["origins"]["position_embeddings"] is None and "all zeros" in report["origins"]["position_embeddings_note"]


EPOCH_STEPS = 6  # 55 training blocks, global batch 8: 6 steps (48 blocks) an epoch


@pytest.mark.slow
@pytest.mark.parametrize("stop, legacy", [(4, False), (6, False), (4, True)])  # mid-epoch, at the end of epoch 0,
def test_resume_equals_straight_run(runs, corpus, cache, tmp_path, stop, legacy):  # and an older checkpoint's position
    root = tmp_path / "resumed"
    assert fit(root, corpus, cache, "--trainer.max_steps", str(stop)) == 0
    saved = checkpoint(root)
    assert saved["global_step"] == stop
    position = saved["MLMDataModule"]["position"]  # global blocks consumed, by hand: 8 a step
    assert (position["blocks"], position["epoch"], position["in_epoch"]) == \
        (8 * stop, stop // EPOCH_STEPS, 8 * (stop % EPOCH_STEPS))
    assert (position["world"], position["batch_size"]) == (1, 8)
    if legacy:  # the position as checkpoints wrote it before it was global: this rank's micro-batches
        saved["MLMDataModule"]["position"] = {"batches": stop, "per_epoch": EPOCH_STEPS}
        torch.save(saved, root / "checkpoints" / "last.ckpt")
    assert fit(root, corpus, cache, "--ckpt_path", "last") == 0
    straight, resumed = checkpoint(runs[True]), checkpoint(root)
    assert resumed["global_step"] == STEPS
    for name, value in straight["state_dict"].items():
        torch.testing.assert_close(resumed["state_dict"][name], value, rtol=0, atol=0, msg=name)
    assert train_losses(root) == train_losses(runs[True])  # same data, masks and dropout at every step


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:this run stops at step 2:UserWarning")  # a resume inside the warm-up, on purpose
@pytest.mark.parametrize("workers", [1, 2])
def test_streaming_run_resumes_exactly(corpus, cache, tmp_path, capsys, workers):
    """The resumed halves read through loader workers that prefetch 4 batches each: the checkpoint must hold the
    stream state of the last batch a step consumed, not of the last one fetched. One worker: the same stream as no
    worker at all; two: two shards of the texts, tokenised in parallel, each resumed where it stood, in turn."""
    streaming = ("--data.streaming", "true", "--data.val_texts", "4", "--trainer.val_check_interval", "3",
                 "--model.decay_steps", "4")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    same = ("--data.num_workers", "2") if workers == 2 else ()  # two shards differ from one: the same in both runs
    assert fit(straight, corpus, cache, *streaming, *same, "--trainer.max_steps", "4") == 0
    assert fit(resumed, corpus, cache, *streaming, "--trainer.max_steps", "2", "--data.num_workers", str(workers)) == 0
    if workers == 2:  # the state of both shards, the next batch from shard 0 (steps 0, 1: shards 0, 1)
        stream = checkpoint(resumed)["MLMDataModule"]["stream"][0]
        assert [shard["done"] for shard in stream["shards"]] == [8, 8] and stream["next"] == 0
    assert fit(resumed, corpus, cache, *streaming, "--trainer.max_steps", "4", "--data.num_workers", str(workers),
               "--ckpt_path", "last") == 0
    assert train_losses(resumed) == train_losses(straight) and len(train_losses(straight)) == 4
    for name, value in checkpoint(straight)["state_dict"].items():
        torch.testing.assert_close(checkpoint(resumed)["state_dict"][name], value, rtol=0, atol=0, msg=name)

    if workers == 2:
        return
    before = (resumed / "checkpoints" / "last.ckpt").read_bytes()  # streaming resumes on its own device count only
    assert fit(resumed, corpus, cache, *streaming, "--trainer.max_steps", "6", "--data.batch_size", "4",
               "--trainer.devices", "2", "--trainer.strategy", "ddp", "--ckpt_path", "last") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("train.py: error: ") and "saved at world size 1 at world size 2" in err
    assert (resumed / "checkpoints" / "last.ckpt").read_bytes() == before


@pytest.mark.slow
def test_resume_on_another_device_count_or_accumulation_equals_straight(corpus, cache, tmp_path):
    """Global batch 8 throughout. 1 process × batch 4 × accumulation 2 for 4 steps, then 2 processes × batch 4 (DDP,
    gloo) for 4 more = 8 steps of 1 × 8 straight; and 1 × 8 for 3 steps then 1 × 4 × 2. Each changes the blocks of
    a micro-batch: the position is converted, and so are Lightning's micro-batch counts (windows stay whole)."""
    no_dropout = ("--model.dropout", "0.0")
    straight, ddp, accumulated = tmp_path / "straight", tmp_path / "ddp", tmp_path / "accumulated"
    assert fit(straight, corpus, cache, *no_dropout, "--trainer.max_steps", "8") == 0
    assert fit(ddp, corpus, cache, *no_dropout, "--trainer.max_steps", "4", "--data.batch_size", "4") == 0
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *tiny_args(ddp, corpus, cache, *no_dropout, "--trainer.max_steps", "8",
                                                            "--data.batch_size", "4", "--trainer.devices", "2",
                                                            "--trainer.strategy", "ddp", "--ckpt_path", "last")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert fit(accumulated, corpus, cache, *no_dropout, "--trainer.max_steps", "3") == 0
    assert fit(accumulated, corpus, cache, *no_dropout, "--trainer.max_steps", "8", "--data.batch_size", "4",
               "--ckpt_path", "last") == 0
    reference, losses = train_losses(straight), train_losses(ddp)
    assert sorted(losses) == list(range(8))  # steps 0-3: a window's last micro-batch; 4-7: the mean over both ranks
    assert all(math.isclose(losses[s], reference[s], rel_tol=1e-5) for s in range(4, 8))
    position = checkpoint(ddp)["MLMDataModule"]["position"]
    assert (position["blocks"], position["epoch"], position["in_epoch"], position["world"]) == (64, 1, 16, 2)
    for other in (ddp, accumulated):
        saved = checkpoint(other)
        assert saved["global_step"] == 8
        for name, value in checkpoint(straight)["state_dict"].items():
            torch.testing.assert_close(saved["state_dict"][name], value, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
def test_two_process_streaming_run_resumes_exactly(corpus, cache, tmp_path):
    """Each rank's stream state (its own texts, leftover tokens) is gathered into rank 0's checkpoint and handed back
    to its rank on resume."""
    ddp = ("--data.streaming", "true", "--data.val_texts", "4", "--model.decay_steps", "4", "--data.batch_size", "4",
           "--trainer.devices", "2", "--trainer.strategy", "ddp")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

    def run(root: Path, *extra: str) -> None:
        result = subprocess.run([sys.executable, str(ROOT / "train.py"), *tiny_args(root, corpus, cache, *ddp, *extra)],
                                cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(straight, "--trainer.max_steps", "4")
    run(resumed, "--trainer.max_steps", "2")
    states = checkpoint(resumed)["MLMDataModule"]["stream"]
    assert [[(shard["text"], shard["done"]) for shard in state["shards"]] for state in states] == \
        [[(0, 8)], [(0, 8)]]  # each rank (one shard): 2 steps × 4 blocks
    run(resumed, "--trainer.max_steps", "4", "--ckpt_path", "last")
    assert train_losses(resumed) == train_losses(straight) and len(train_losses(straight)) == 4
    for name, value in checkpoint(straight)["state_dict"].items():
        torch.testing.assert_close(checkpoint(resumed)["state_dict"][name], value, rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_two_process_ddp_matches_one_process_and_accumulation(corpus, cache, tmp_path):
    """1 process × batch 8; 1 × 4 × 2 micro-batches; 2 DDP processes × 4 with the fast recipe's DDP settings (static
    graph, configs/pretrain/roberta-base-fast.yaml): the same losses and weights."""
    no_dropout = ("--model.dropout", "0.0", "--trainer.max_steps", "4", "--trainer.val_check_interval", "2",
                  "--trainer.limit_val_batches", "2")  # a validation at the last step, where a checkpoint is saved
    one, accumulated, ddp = tmp_path / "one", tmp_path / "accumulated", tmp_path / "ddp"
    assert fit(one, corpus, cache, *no_dropout) == 0
    assert fit(accumulated, corpus, cache, *no_dropout, "--data.batch_size", "4") == 0  # 2 micro-batches a step
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    fast = yaml.safe_load((ROOT / "configs" / "pretrain" / "roberta-base-fast.yaml").read_text())["trainer"]["strategy"]
    assert fast["init_args"]["static_graph"] is True
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *tiny_args(ddp, corpus, cache, *no_dropout, "--data.batch_size", "4",
                                                            "--trainer.devices", "2", "--trainer.strategy",
                                                            json.dumps(fast))],
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
        # the step-4 checkpoint holds the validation run after it was first saved (saved again on every rank), and the
        # validation loss over both ranks' shards equals one process's
        step, loss = checkpoint(other)["callbacks"]["RunSummary"]["val"]
        assert step == 4 and math.isclose(loss, checkpoint(one)["callbacks"]["RunSummary"]["val"][1], rel_tol=1e-5)


@pytest.mark.parametrize("extra, message", [
    (("--data.corpus", "/no/such/corpus.txt"), "corpus not found"),
    (("--data.corpus", "EMPTY"), "empty"),
    (("--data.global_batch_size", "12"), "not a multiple"),
    (("--data.block_length", "64"),  # RoBERTa's positions start after the pad id: 34 - (1 + 1)
     "--data.block_length 64 exceeds the model's 32 positions (--model.max_position_embeddings 34 minus "
     "(pad id 1 + 1))"),
    (("--data.tokenizer", "BERT", "--data.block_length", "64"),  # BERT's pad id 0: 34 - (0 + 1)
     "--data.block_length 64 exceeds the model's 33 positions (--model.max_position_embeddings 34 minus "
     "(pad id 0 + 1))"),
    (("--trainer.accumulate_grad_batches", "3"), "contradicts --data.global_batch_size"),
    (("--trainer.strategy", "FAST", "--trainer.devices", "2", "--data.batch_size", "2"),
     "DDP static_graph does not work with gradient accumulation (here 2 micro-batches a step; "
     "pytorch/pytorch#143580)"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(corpus, cache, tmp_path, capsys, bert_tok, extra, message):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    bert_tok.save_pretrained(tmp_path / "bert")
    fast = yaml.safe_load((ROOT / "configs" / "pretrain" / "roberta-base-fast.yaml").read_text())["trainer"]["strategy"]
    extra = tuple({"EMPTY": str(empty), "BERT": str(tmp_path / "bert"), "FAST": json.dumps(fast)}.get(e, e)
                  for e in extra)
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
    (True, ("--model.token_type_embeddings", "true"), "trained with fairseq's zero, frozen token-type row but the config "
     "asks for a learned token-type row; resume with --model.token_type_embeddings false"),
    (True, ("--data.tokenizer", "OTHER"), "tokenizer does not match"),
    (True, ("--data.global_batch_size", "16"),  # the runs' global batch is 8 (batch_size 8, one device)
     "cannot resume: checkpoint CKPT was trained with global batch 8 but the config gives 16; keep the run's global "
     "batch (--data.global_batch_size 8)"),
    (True, ("--data.streaming", "true", "--data.val_texts", "4"),
     "checkpoint CKPT is of a run with --data.streaming false; resume with the same setting (the config gives true)"),
    # the runs' schedule ends at step 10 (--model.decay_steps); without it, it would end at max_steps 12: the resume
    # keeps the saved one, so steps 11 and 12 would train at a rate of 0
    (True, ("--model.decay_steps", "null"),
     "checkpoint CKPT ends its learning-rate schedule at step 10, and a resume keeps it: steps 11..12 "
     "(--trainer.max_steps 12) would train at a rate of 0; to train longer, start the run with --model.decay_steps at "
     "its final length (or resume with --trainer.max_steps 10)"),
])
def test_resume_with_a_mismatching_config_is_refused(runs, corpus, cache, tmp_path, capsys, other_tokenizer, pe, extra,
                                                     message):
    root = tmp_path / "run"
    shutil.copytree(runs[pe], root)
    ckpt = root / "checkpoints" / "last.ckpt"
    before = ckpt.read_bytes()
    versions = sorted((root / "lightning_logs").iterdir())
    files = sorted(root.rglob("*"))
    configs = {path: path.read_bytes() for path in root.rglob("config.yaml")}
    assert configs  # the run's own: a refused resume leaves it as it was
    extra = tuple(str(other_tokenizer) if e == "OTHER" else e for e in extra)
    assert fit(root, corpus, cache, *extra, "--ckpt_path", "last", "--trainer.max_steps", str(STEPS + 2)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("train.py: error: ") and message.replace("CKPT", str(ckpt)) in err[-1]
    assert ckpt.read_bytes() == before
    assert sorted((root / "lightning_logs").iterdir()) == versions and sorted(root.rglob("*")) == files
    assert {path: path.read_bytes() for path in root.rglob("config.yaml")} == configs


@pytest.mark.slow
def test_a_checkpoint_made_before_the_zero_token_type_row_resumes_with_the_learned_row_only(corpus, cache, tmp_path,
                                                                                             capsys):
    """Such a checkpoint trained transformers' row (its optimizer state holds it) and its hyper-parameters lack the
    option: resumed as the default (a frozen row) it is refused in one line; with the opt-in it resumes and trains on."""
    root = tmp_path / "old"
    assert fit(root, corpus, cache, "--model.token_type_embeddings", "true", "--trainer.max_steps", "4") == 0
    saved = checkpoint(root)
    del saved["hyper_parameters"]["token_type_embeddings"]  # as written before the option existed
    torch.save(saved, root / "checkpoints" / "last.ckpt")
    row = "model.roberta.embeddings.token_type_embeddings.weight"
    assert saved["state_dict"][row].abs().sum() > 0
    before = sorted(root.rglob("*"))
    assert fit(root, corpus, cache, "--ckpt_path", "last", "--trainer.max_steps", "6") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"train.py: error: checkpoint {root / 'checkpoints' / 'last.ckpt'} was trained with a learned token-type row "
        "(made before the zero row became the default) but the config asks for fairseq's zero, frozen token-type row; "
        "resume with --model.token_type_embeddings true")
    assert sorted(root.rglob("*")) == before
    assert fit(root, corpus, cache, "--ckpt_path", "last", "--trainer.max_steps", "6",
               "--model.token_type_embeddings", "true") == 0
    resumed = checkpoint(root)
    assert resumed["global_step"] == 6 and not torch.equal(resumed["state_dict"][row], saved["state_dict"][row])


@pytest.mark.slow
def test_validate_gives_the_fits_last_validation_at_its_step_and_leaves_the_run_alone(corpus, cache, tmp_path, capsys,
                                                                                       monkeypatch):
    """`train.py validate --ckpt_path last` with the default W&B logger (offline): the validation fit ran after its
    last step, again, logged at the checkpoint's step to a W&B run of its own under the run directory (job type
    `validate`, its config the resolved one of the validate command); the run's files (its kept W&B run id,
    checkpoints, config) stay as they were. `test` and `predict` are one line, nothing written."""
    import importlib.metadata

    import yaml

    from core.run_config import PACKAGES
    from tests.wandb_log import read_run

    live = [json.dumps({"class_path": f"callbacks.{name}", "init_args": {"every_n_steps": 2, "image_every_n_steps": 0}})
            for name in ("outlier_statistics.OutlierStatistics", "contribution_vectors.ContributionVectors")]
    root, steps = tmp_path / "run", ("--trainer.max_steps", "4", "--trainer.val_check_interval", "4",
                                     "--trainer.callbacks", f"[{', '.join(live)}]")
    assert fit(root, corpus, cache, *steps) == 0
    (root / "wandb_run_id").write_text("kept1234\n")  # the training run's W&B run: validate starts another
    before = {path: path.read_bytes() for path in root.rglob("*") if path.is_file()}
    fitted = [row for row in metrics(root) if row.get("val/loss")]  # the fit's validation after its last step
    assert [int(row["step"]) for row in fitted] == [3]  # Lightning logs it at the steps counted before the last one
    monkeypatch.chdir(tmp_path)
    args = tiny_args(root, corpus, cache, *steps, "--trainer.logger", "callbacks.wandb_logging.AutoWandbLogger",
                     "--ckpt_path", "last")[1:]
    assert train.cli_main(["validate", *args]) == 0
    run = read_run(next((root / "wandb").glob("offline-run-*")))
    rows = [row for row in run.history if "val/loss" in row]
    assert [row["trainer/global_step"] for row in rows] == [4]  # the updates the validated weights had
    fitted = fitted[0]
    assert rows[0]["val/loss"] == pytest.approx(float(fitted["val/loss"]), rel=1e-6)
    assert rows[0]["val/perplexity"] == pytest.approx(math.exp(rows[0]["val/loss"]), rel=1e-5)
    logged = {key: value for row in run.history for key, value in row.items() if key.startswith("val_")}
    live = {key: float(value) for row in metrics(root) if row["step"] == "3"
            for key, value in row.items() if key.startswith("val_") and value}  # the fit's, at its step
    assert len(live) > 40 and "val_position_probe/accuracy" in live  # the online probe: its checkpointed weights
    assert {key: logged[key] for key in live} == pytest.approx(live, rel=1e-5)
    assert {path: path.read_bytes() for path in before} == before  # no config.yaml, run id or checkpoint rewritten
    # its W&B config: the fit's config.yaml but for what the validate command line changed (its logger, ckpt_path)
    (path,) = root.rglob("config.yaml")  # the fit's, in its logger's directory
    written = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert run.job_type == "validate" and run.config["ckpt_path"] == "last" and written["ckpt_path"] is None
    assert run.config["trainer"].pop("logger")["class_path"] == "callbacks.wandb_logging.AutoWandbLogger"
    written["trainer"].pop("logger")
    for section in ("model", "data", "trainer", "seed_everything", "checkpoint"):
        assert run.config[section] == written[section], section
    assert [c["init_args"]["every_n_steps"] for c in run.config["trainer"]["callbacks"]] == [2, 2]
    assert run.config["versions"] == {name: importlib.metadata.version(name) for name in PACKAGES}
    assert all(root / "wandb" in path.parents for path in root.rglob("*") if path.is_file() and path not in before)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run"]  # nothing in the working directory

    capsys.readouterr()
    files = sorted(root.rglob("*"))
    for subcommand, message, ckpt in (
            ("test", "train.py test: MLM pretraining has no test set", True),
            ("predict", "train.py predict is not supported", True),
            ("validate", "train.py validate needs the weights to validate: --ckpt_path last (the run in", False)):
        assert train.cli_main([subcommand, *(args if ckpt else args[:-2])]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"train.py: error: {message}")
        assert sorted(root.rglob("*")) == files


@pytest.mark.slow
def test_a_checkpoint_of_a_step_a_validation_follows_holds_that_validation_and_resumes_exactly(corpus, cache, tmp_path):
    """Lightning saves a step's checkpoints before the validation after that step (every_n_train_steps and
    val_check_interval meet, as at every config's last step): they held the validation before, so a re-run of the
    finished run summed up a stale loss and analyze.py trajectory paired each checkpoint with the previous validation.
    Each checkpoint holds the validation of its own step (the loss the logger got, logged at the step before),
    previous.ckpt is step 4's (the re-save of step 6 replaces last.ckpt without rotating it), and a run extended from
    the 4-step run's last.ckpt logs and ends as the straight 6-step run, bit for bit."""
    aligned = ("--trainer.val_check_interval", "2", "--checkpoint.save_top_k", "-1", "--trainer.log_every_n_steps", "2")
    from callbacks.checkpointing import resume_target

    straight, extended = tmp_path / "straight", tmp_path / "extended"
    assert fit(straight, corpus, cache, *aligned, "--trainer.max_steps", "6") == 0
    logged = {int(row["step"]) + 1: float(row["val/loss"]) for row in metrics(straight) if row.get("val/loss")}
    assert sorted(logged) == [2, 4, 6]  # the validations after steps 2, 4, 6
    periodic = sorted((straight / "checkpoints").glob("epoch=*-step=*.ckpt"))
    for path in [*periodic, straight / "checkpoints" / "last.ckpt"]:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        step = saved["global_step"]
        assert saved["val_loss"] == {"value": pytest.approx(logged[step], rel=1e-6), "step": step}, path.name
        assert saved["callbacks"]["RunSummary"]["val"] == [step, pytest.approx(logged[step], rel=1e-6)], path.name
    assert sorted(torch.load(p, map_location="cpu", weights_only=True)["global_step"] for p in periodic) == [2, 4, 6]
    # previous.ckpt is the checkpoint of the step before (4, with its own validation), not step 6 before its
    # validation (what the re-save's rotation left); a torn last.ckpt still resumes from it
    previous = torch.load(straight / "checkpoints" / "previous.ckpt", map_location="cpu", weights_only=True)
    assert previous["global_step"] == 4 and previous["val_loss"] == {"value": pytest.approx(logged[4], rel=1e-6),
                                                                     "step": 4}
    torn = shutil.copytree(straight / "checkpoints", tmp_path / "torn")
    (torn / "last.ckpt").write_bytes((torn / "last.ckpt").read_bytes()[:1000])
    assert resume_target(torn / "last.ckpt") == torn / "previous.ckpt"

    assert fit(extended, corpus, cache, *aligned, "--trainer.max_steps", "4") == 0
    assert fit(extended, corpus, cache, *aligned, "--trainer.max_steps", "6", "--ckpt_path", "last") == 0
    assert train_losses(extended) == train_losses(straight)
    assert {int(row["step"]): row["val/loss"] for row in metrics(extended) if row.get("val/loss")} == \
        {int(row["step"]): row["val/loss"] for row in metrics(straight) if row.get("val/loss")}
    for name, value in checkpoint(straight)["state_dict"].items():
        torch.testing.assert_close(checkpoint(extended)["state_dict"][name], value, rtol=0, atol=0, msg=name)


def test_a_validation_inside_an_accumulation_window_leaves_every_checkpoint_at_a_whole_step(corpus, cache, tmp_path):
    """2 micro-batches a step and a validation every 3 micro-batches (val_check_interval counts micro-batches): the
    one after micro-batch 3 falls inside step 2's window. The checkpoint of step 1, saved before it, must not be saved
    again there (its data position would be 1.5 global batches in), and a resume from it equals the straight run."""
    window = ("--data.batch_size", "4", "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "1",
              "--checkpoint.every_n_train_steps", "1", "--trainer.max_steps", "2")
    straight = tmp_path / "straight"
    assert fit(straight, corpus, cache, *window) == 0
    assert [int(row["step"]) for row in metrics(straight) if row.get("val/loss")] == [1]  # mid-window: after step 1
    step1 = torch.load(straight / "checkpoints" / "previous.ckpt", map_location="cpu", weights_only=True)
    assert step1["global_step"] == 1
    assert step1["MLMDataModule"]["position"]["blocks"] == 8  # one global batch of 8 blocks, not 12
    assert step1["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["ready"] == 2
    resumed = shutil.copytree(straight / "checkpoints", tmp_path / "resumed" / "checkpoints")
    shutil.copy(resumed / "previous.ckpt", resumed / "last.ckpt")
    (resumed / "previous.ckpt").unlink()
    assert fit(resumed.parent, corpus, cache, *window, "--ckpt_path", "last") == 0
    assert train_losses(resumed.parent)[1] == train_losses(straight)[1]
    for name, value in checkpoint(straight)["state_dict"].items():
        torch.testing.assert_close(checkpoint(resumed.parent)["state_dict"][name], value, rtol=0, atol=0, msg=name)


class PoisonAt(pl.Callback):
    """Test helper: makes one weight NaN just before the training step `step` (so that step's loss is NaN)."""

    def __init__(self, step: int = 5) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.model.lm_head.dense.weight[0, 0] = float("nan")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The number of training batches")  # a 6-batch run, log_every_n_steps 50 on purpose
@pytest.mark.parametrize("log_every", [1, 50])  # checked at step 5's logging step, or at the checkpoint after it
def test_nan_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(corpus, cache, tmp_path, capsys, log_every):
    root = tmp_path / "run"
    poison = '{"class_path": "tests.test_train.PoisonAt", "init_args": {"step": 5}}'
    assert fit(root, corpus, cache, "--trainer.callbacks+", poison, "--trainer.log_every_n_steps", str(log_every)) == 2
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


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_roberta_base_configs_hold_table_4_and_differ_only_in_position_embeddings(capsys):
    """Both configs parsed by train.py's CLI (unknown keys would fail), against the paper's Table 4; the no-PE one is
    the base config with the small override file after it."""
    parsed = {}
    folder = ROOT / "configs" / "pretrain"
    for name, files in (("roberta-base", ["roberta-base"]), ("roberta-base-nope", ["roberta-base", "roberta-base-nope"])):
        configs = [argument for file in files for argument in ("--config", str(folder / f"{file}.yaml"))]
        with pytest.raises(SystemExit) as stop:
            train.cli_main(["fit", *configs, "--print_config"])
        assert stop.value.code in (0, None)
        parsed[name] = yaml.safe_load(capsys.readouterr().out)
    for name, config in parsed.items():
        model, data, trainer = config["model"], config["data"], config["trainer"]
        assert (model["num_hidden_layers"], model["hidden_size"], model["intermediate_size"],
                model["num_attention_heads"]) == (12, 768, 3072, 12)
        assert model["dropout"] == 0.1 and tuple(model["betas"]) == (0.9, 0.98) and model["eps"] == 1e-6
        assert model["lr"] == 1e-4 and model["weight_decay"] == 0.01 and model["warmup_steps"] == 10_000
        assert model["decay_steps"] == trainer["max_steps"] == 200_000 and model["end_lr"] == 0.0
        assert trainer["gradient_clip_val"] == 0.5 and trainer["precision"] == "bf16-mixed"
        assert data["global_batch_size"] == 256 and data["block_length"] == 512
        assert model["max_position_embeddings"] == 512 + 2  # RoBERTa's offset rows
        assert trainer["strategy"]["class_path"].endswith("DDPStrategy")
        per_step = data["batch_size"] * trainer["devices"] * trainer["num_nodes"]
        assert data["global_batch_size"] % per_step == 0  # accumulation 256 / (32 × 4) = 2
        assert model["position_embeddings"] is (name == "roberta-base")
    pe, nope = (flatten(parsed[name]) for name in ("roberta-base", "roberta-base-nope"))
    assert pe.keys() == nope.keys()
    differ = {key for key in pe if pe[key] != nope[key]}
    assert differ == {"model.position_embeddings", "trainer.default_root_dir", "trainer.logger.init_args.name"}


FAST_CHANGES = {"model.dropout": 0.0, "model.pad_vocab_to_multiple_of": 64, "data.batch_size": 64,
                "trainer.strategy.init_args.static_graph": True}


def test_the_fast_recipe_changes_only_what_the_docs_list_and_its_twin_only_the_position_embeddings(capsys):
    """roberta-base.yaml + roberta-base-fast.yaml (+ roberta-base-fast-nope.yaml) parsed by train.py's CLI: the fast
    recipe differs from Table 4 in exactly the settings docs/pretraining.md explains (and its run directory and W&B
    name), keeps the global batch without accumulation on the base config's devices, and its no-PE twin differs from
    it only in the position embeddings (and directory and name)."""
    folder, parsed = ROOT / "configs" / "pretrain", {}
    for name, files in (("base", ["roberta-base"]), ("fast", ["roberta-base", "roberta-base-fast"]),
                        ("fast-nope", ["roberta-base", "roberta-base-fast", "roberta-base-fast-nope"])):
        configs = [argument for file in files for argument in ("--config", str(folder / f"{file}.yaml"))]
        with pytest.raises(SystemExit) as stop:
            train.cli_main(["fit", *configs, "--print_config"])
        assert stop.value.code in (0, None)
        parsed[name] = flatten(yaml.safe_load(capsys.readouterr().out))
    base, fast, nope = parsed["base"], parsed["fast"], parsed["fast-nope"]
    assert base.keys() == fast.keys() == nope.keys()
    named = {"trainer.default_root_dir", "trainer.logger.init_args.name"}
    assert {key for key in base if base[key] != fast[key]} == set(FAST_CHANGES) | named
    assert {key: fast[key] for key in FAST_CHANGES} == FAST_CHANGES
    assert fast["data.global_batch_size"] == fast["data.batch_size"] * fast["trainer.devices"] * fast["trainer.num_nodes"]
    assert {key for key in fast if fast[key] != nope[key]} == {"model.position_embeddings"} | named
    assert nope["model.position_embeddings"] is False
    docs = (ROOT / "docs" / "pretraining.md").read_text()
    section = docs[docs.index("## The fast recipe"):]
    assert all(f"`{key.rsplit('.', 1)[1]}`" in section for key in FAST_CHANGES)


@pytest.mark.parametrize("kind", ["bert", "trained"])
def test_model_takes_pad_bos_eos_ids_from_the_tokenizer(corpus, cache, tmp_path, bert_tok, kind):
    from lightning_modules.mlm import MLMModule

    extra = ()
    if kind == "bert":
        bert_tok.save_pretrained(tmp_path / "bert")
        extra = ("--data.tokenizer", str(tmp_path / "bert"))
    cli = train.PretrainCLI(MLMModule, train.MLMDataModule, seed_everything_default=0,
                            trainer_defaults=train.TRAINER_DEFAULTS, run=False,
                            args=tiny_args(tmp_path / "run", corpus, cache, *extra)[1:])
    if kind == "bert":  # no <s> or </s>: [CLS] and [SEP] open and close a block
        tokenizer, tokens = bert_tok, ["[PAD]", "[CLS]", "[SEP]"]
        expected = (tokenizer.pad_token_id, tokenizer.cls_token_id, tokenizer.sep_token_id)
    else:  # the byte-level BPE the run trains on the corpus (prepare_data), loaded as the run loads it
        cli.datamodule.prepare_data()
        tokenizer, tokens = cli.datamodule.cached_tokenizer(), ["<pad>", "<s>", "</s>"]
        expected = (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert tokenizer.convert_ids_to_tokens(list(expected)) == tokens
    config = cli.model.model.config
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == expected
    embeddings = cli.model.model.roberta.embeddings
    assert embeddings.word_embeddings.padding_idx == expected[0] == embeddings.padding_idx
    assert cli.model.max_length == 34 - (expected[0] + 1)  # RoBERTa's positions start after the pad id
    if kind == "bert":  # the BERT case really differs from RoBERTa's <pad>/<s>/</s> = 1/0/2
        assert expected != (1, 0, 2)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:--model.warmup_steps 20 does not end:UserWarning")  # the config's, cut to 5 steps
def test_tiny_config_without_pe_leaves_the_position_probe_at_the_majority_baseline(tmp_path):
    """configs/pretrain/tiny.yaml for 5 steps with and without PE, then probe.py's position probe on each export
    (special tokens excluded): no PE stays at the majority baseline on every layer, PE is far above it."""
    import probe

    config = ROOT / "configs" / "pretrain" / "tiny.yaml"
    reports = {}
    for pe in (False, True):
        root = tmp_path / f"pe-{pe}"
        assert train.cli_main(["fit", "--config", str(config), "--model.position_embeddings", str(pe).lower(),
                               "--trainer.max_steps", "5", "--trainer.logger", "false", "--trainer.callbacks", "[]",
                               "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(root),
                               "--data.cache_dir", str(tmp_path / "cache")]) == 0
        probe.cli_main(["fit", "--config", str(ROOT / "configs" / "probe" / "position.yaml"),
                        "--model.encoder", str(root), "--data.source", str(ROOT / "core" / "corpus" / "austen.txt"),
                        "--data.exclude_special", "true", "--data.max_sentences", "300",
                        "--data.random_baseline", "false", "--data.progress", "false", "--trainer.logger", "false",
                        "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(root / "probe")])
        reports[pe] = json.loads((root / "probe" / "position_probe.json").read_text())
    for report in reports.values():
        test = report["splits"]["test"]
        # every sentence has exactly one token at position 1 (the first after <s>), the most frequent position
        assert report["special_tokens"] == "excluded" and report["baselines"]["majority_class"] == 1
        assert report["baselines"]["majority"] == pytest.approx(test["sentences"] / test["tokens"])
    majority = reports[False]["baselines"]["majority"]
    nope = [layer["accuracy"] for layer in reports[False]["layers"]]
    with_pe = [layer["accuracy"] for layer in reports[True]["layers"]]
    # no PE: near the majority baseline on every layer (what is left is lexical: a capitalised word is likely at
    # position 1, a full stop last; batches of token vectors train the probe long enough to find it), far below PE
    assert len(nope) == 5 and max(nope) <= majority + 0.05, (nope, majority)  # 5 layers: embeddings + 4
    assert min(with_pe) >= majority + 0.15 and max(with_pe) >= 4 * max(nope), (with_pe, nope)


@pytest.mark.slow
def test_a_validation_after_a_sigterm_save_adds_no_periodic_checkpoint_off_its_grid(corpus, cache, tmp_path):
    """A SIGTERM after step 3 saves last.ckpt only (periodic checkpoints every 4 steps); the validation due after step
    3 (val_check_interval 3) then saves last.ckpt again with its loss, and no epoch=*-step=3.ckpt beside it: before, the
    re-save wrote a periodic checkpoint at a step off --checkpoint.every_n_train_steps (a trajectory point too many)."""
    root = tmp_path / "run"
    term = json.dumps({"class_path": "tests.test_one_run.TermAt", "init_args": {"step": 3}})
    assert fit(root, corpus, cache, "--trainer.val_check_interval", "3", "--checkpoint.every_n_train_steps", "4",
               "--checkpoint.save_top_k", "-1", "--trainer.max_steps", "6", "--trainer.callbacks+", term) == 143
    # and no previous.ckpt: the re-save replaces last.ckpt in place, and there was no checkpoint before step 3's
    assert sorted(path.name for path in (root / "checkpoints").glob("*.ckpt")) == ["last.ckpt"]
    logged = {int(row["step"]) + 1: float(row["val/loss"]) for row in metrics(root) if row.get("val/loss")}
    saved = checkpoint(root)
    assert saved["global_step"] == 3 and sorted(logged) == [3]
    assert saved["callbacks"]["RunSummary"]["val"] == [3, pytest.approx(logged[3], rel=1e-6)]


@pytest.mark.slow
def test_a_monitored_top_k_keeps_the_best_by_each_checkpoints_own_validation(corpus, cache, tmp_path):
    """--checkpoint.monitor val/loss --checkpoint.save_top_k 2: a step's checkpoint saved before its validation and
    again after it competes once, with its own validation's loss; the two kept are the two best of the validations
    at steps 2, 4, 6 (computed from the logged losses). Before, its stale entry stayed in the top k, and the re-save
    dropped a kept checkpoint for it."""
    root = tmp_path / "run"
    assert fit(root, corpus, cache, "--trainer.val_check_interval", "2", "--checkpoint.monitor", "val/loss",
               "--checkpoint.save_top_k", "2", "--trainer.max_steps", "6") == 0
    logged = {int(row["step"]) + 1: float(row["val/loss"]) for row in metrics(root) if row.get("val/loss")}
    assert sorted(logged) == [2, 4, 6]
    kept = sorted(torch.load(path, map_location="cpu", weights_only=True)["global_step"]
                  for path in (root / "checkpoints").glob("epoch=*-step=*.ckpt"))
    assert kept == sorted(sorted(logged, key=logged.get)[:2])


def test_the_blocks_order_and_masks_follow_seed_everything(corpus, cache, tmp_path):
    """--seed_everything is the run's one seed, the MLM data's too (the blocks' order, their masks) unless
    --data.seed is given. Before, the data seed was 0 whatever --seed_everything: a study's seeds of an arm differed
    only in their initialisation and dropout, every one seeing the same blocks with the same masks."""
    from lightning_modules.mlm import MLMModule

    def first_batch(*extra: str) -> tuple[int, dict]:
        cli = train.PretrainCLI(MLMModule, train.MLMDataModule, seed_everything_default=0,
                                trainer_defaults=train.TRAINER_DEFAULTS, run=False,
                                args=tiny_args(tmp_path / "run", corpus, cache, *extra)[1:])
        data = cli.datamodule
        data.trainer = cli.trainer
        data.prepare_data()
        data.setup("fit")
        return data.hparams.seed, next(iter(data.train_dataloader()))

    seeds = {extra: first_batch(*extra) for extra in [("--seed_everything", "1"), ("--seed_everything", "0"),
                                                      ("--seed_everything", "0", "--data.seed", "1")]}
    (one, by_run), (zero, default), (given, by_data) = seeds.values()
    assert (one, zero, given) == (1, 0, 1)
    for key in ("input_ids", "positions", "targets"):  # the blocks and masks of data seed 1 given outright
        assert torch.equal(by_run[key], by_data[key]) and not torch.equal(by_run[key], default[key]), key
