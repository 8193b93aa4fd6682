"""Issue 31: what Lightning refused with a 30-line traceback (or not at all) is one line, exit status 2, with nothing
written: the trainer's own limits and intervals, a GPU the machine lacks, a stateful callback twice, runs that would
train nothing, a bad value inside --model.* naming its key, and analyze.py's --device (docs/errors.md).

    .venv/bin/pytest tests/test_lightning_refusals.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import analyze
import train
from core.errors import UserError
from core.trainer_checks import check_trainer_settings, check_val_check_interval
from tests.test_refusals import files_under, stderr_lines
from tests.test_train import tiny_args
from tests.test_untrusted import probe_args, run_entry_point
from tests.tiny import save_tiny_encoder

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")


@pytest.fixture(scope="module")
def encoder(tmp_path_factory, bert_tok) -> Path:
    return save_tiny_encoder(tmp_path_factory.mktemp("encoder") / "bert", "bert", bert_tok)
WANDB = json.dumps({"class_path": "callbacks.wandb_logging.AutoWandbLogger"})  # train.py's own logger (offline here)
STATS = "callbacks.outlier_statistics.OutlierStatistics"


def gpu_request() -> tuple[tuple[str, ...], str]:
    """--trainer.accelerator gpu with one GPU more than this machine has, and the line that refuses it (no GPU: that
    there is none; GPUs: how many)."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        reason = (f"this PyTorch ({torch.__version__}) is built without CUDA" if torch.version.cuda is None
                  else "CUDA sees no GPU (CUDA_VISIBLE_DEVICES, the driver?)")
        return (("--trainer.accelerator", "gpu"), f"--trainer.accelerator gpu: this machine has no CUDA GPU ({reason}); "
                "use --trainer.accelerator cpu (or auto)")
    return (("--trainer.accelerator", "gpu", "--trainer.devices", str(count + 1)),
            f"--trainer.devices {count + 1} asks for {count + 1} GPUs but this machine has {count} GPU"
            f"{'s' if count != 1 else ''}; use --trainer.devices {count} or fewer")


TRAIN = {
    "max_steps below -1": (("--trainer.max_steps", "-5"), "--trainer.max_steps must be -1 (no limit) or at least 1, "
                           "got -5"),
    "max_steps 0": (("--trainer.max_steps", "0"), "--trainer.max_steps 0 trains nothing: give at least 1 step (or -1 "
                    "for no limit)"),
    "max_epochs 0": (("--trainer.max_epochs", "0"), "--trainer.max_epochs 0 trains nothing: give at least 1 epoch "
                     "(or -1 for no limit)"),
    "val_check_interval 0 (W&B logger)": (("--trainer.val_check_interval", "0", "--trainer.logger", WANDB),
                                          "--trainer.val_check_interval must be a number of training batches (an "
                                          "integer of at least 1) or a fraction of an epoch in (0, 1], got 0"),
    "a GPU the machine lacks": gpu_request(),
    "a stateful callback twice": (("--trainer.callbacks+", STATS, "--trainer.callbacks+", STATS),
                                  "--trainer.callbacks holds OutlierStatistics twice: a checkpoint keeps one state "
                                  "per kind of stateful callback; keep one OutlierStatistics (the config may have "
                                  "one already, and --trainer.callbacks+ adds another) and set its options instead"),
    "what only Lightning checks": (("--trainer.devices", "0"), "the trainer refused its settings: Trainer(devices='0') "
                                   "value is not a valid input using cpu accelerator."),
    "a value its type refuses": (("--model.lr", "nan"), "--model.lr: expected a float, got nan"),
}


@pytest.mark.parametrize("case", list(TRAIN))
def test_train_refuses_the_trainers_options_in_one_line_and_writes_nothing(case, corpus, cache, tmp_path, capfd):
    extra, message = TRAIN[case]
    before = files_under(tmp_path)
    assert train.cli_main(tiny_args(tmp_path / "run", corpus, cache, *extra)) == 2
    assert stderr_lines(capfd) == [f"train.py: error: {message}"]
    assert files_under(tmp_path) == before  # no run directory, config.yaml, checkpoints/ or wandb/


PROBE = {
    "max_epochs below -1": (("--trainer.max_epochs", "-2"), "--trainer.max_epochs must be -1 (no limit) or at least "
                            "1, got -2"),
    "max_epochs 0": (("--trainer.max_epochs", "0"), "--trainer.max_epochs 0 trains nothing: give at least 1 epoch (or "
                     "-1 for no limit)"),
    "max_steps 0": (("--trainer.max_steps", "0"), "--trainer.max_steps 0 trains nothing: give at least 1 step (or -1 "
                    "for no limit)"),
    "limit_train_batches 0": (("--trainer.limit_train_batches", "0"), "--trainer.limit_train_batches 0 trains "
                              "nothing: give a fraction of the batches in (0, 1] or a number of batches of at least "
                              "1"),
    "a learning rate its type refuses": (("--model.lr", "nan"), "--model.lr: expected a float, got nan"),
    "a batch size its type refuses": (("--data.batch_size", "1.5"), "--data.batch_size: expected an int, got 1.5"),
}


@pytest.mark.parametrize("case", list(PROBE))
def test_probe_refuses_runs_that_train_nothing_and_names_bad_keys(case, encoder, sentences_file, tmp_path, capfd):
    extra, message = PROBE[case]
    out = tmp_path / "out"
    before = files_under(tmp_path)
    assert run_entry_point("probe.py", probe_args(encoder, sentences_file, out, *extra)) == 2
    assert stderr_lines(capfd) == [f"probe.py: error: {message}"]
    assert files_under(tmp_path) == before  # no report, no figures, no "wrote the report"


def test_analyze_refuses_a_device_the_machine_lacks(encoder, sentences_file, tmp_path, capfd):
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = f"cuda:{count + 7}"  # never there
    if count == 0:
        reason = (f"this PyTorch ({torch.__version__}) is built without CUDA" if torch.version.cuda is None
                  else "CUDA sees no GPU (CUDA_VISIBLE_DEVICES, the driver?)")
        expected = f"--device {device}: this machine has no CUDA GPU ({reason}); use --device cpu"
    else:
        expected = (f"--device {device}: this machine has {count} GPU{'s' if count != 1 else ''} "
                    f"(cuda:0{f'..cuda:{count - 1}' if count > 1 else ''})")
    out = tmp_path / "out"
    for argv, line in ((["outliers", "--device", device], expected),
                       (["anisotropy", "--device", "gpu:0"], "--device 'gpu:0' is not a device (cpu, cuda, cuda:1, "
                                                             "mps)")):
        assert analyze.main([*argv, "--encoder", str(encoder), "--data", str(sentences_file), "--output_dir",
                             str(out), "--no_progress"]) == 2
        assert stderr_lines(capfd) == [f"analyze.py {argv[0]}: error: {line}"]
    assert not out.exists()


def test_the_checks_pass_what_lightning_accepts():
    """The limits and intervals a run may give, by Lightning's rules: nothing refused (a fast_dev_run sets its own)."""
    for settings in ({"max_steps": -1, "max_epochs": None}, {"max_steps": 1, "max_epochs": -1},
                     {"max_epochs": 0, "fast_dev_run": 2}, {"limit_train_batches": 0.5, "val_check_interval": 1.0},
                     {"val_check_interval": 0.25}, {"val_check_interval": 3}, {"val_check_interval": 200.0},
                     {"val_check_interval": "00:00:10:00"}, {"accelerator": "cpu", "devices": 4},
                     {"accelerator": "auto"}):
        check_trainer_settings(settings)
    for value in (0, 0.0, -3, 1.5, float("nan")):
        with pytest.raises(UserError, match="val_check_interval"):
            check_val_check_interval(value)


def test_torchrun_processes_that_the_trainer_does_not_count_are_one_line_and_write_nothing(corpus, cache, tmp_path,
                                                                                          capfd, monkeypatch):
    """Under `torchrun --nproc_per_node 2` (its environment, set here), a config's `devices: 1` made each process a run
    of its own in one directory: one refused as "in use by another run", the other trained alone until torchrun
    killed it, leaving a run without its export. Refused before anything is written; devices that count the
    processes (2 on 1 node, 1 on each of 2 nodes) pass, and outside torchrun nothing is asked."""
    from core.trainer_checks import check_launcher

    root = tmp_path / "run"
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    for name, value in (("RANK", "0"), ("GROUP_RANK", "0"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "2"),
                        ("WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    assert train.cli_main(tiny_args(root, corpus, cache)) == 2  # tiny_args: --trainer.devices 1
    assert stderr_lines(capfd)[-1:] == ["train.py: error: torchrun started 2 processes but --trainer.devices 1 x "
                                        "--trainer.num_nodes 1 make 1: set --trainer.devices 2 --trainer.num_nodes 1 "
                                        "(scripts/torchrun_pretrain.sh sets both)"]
    assert files_under(root) == []
    check_launcher(2, 1)
    check_launcher("0,1", None)
    check_launcher("auto", 1)  # Lightning counts these itself
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one process on each of 2 nodes
    check_launcher(1, 2)
    with pytest.raises(UserError, match="set --trainer.devices 1 --trainer.num_nodes 2"):
        check_launcher(1, 1)
    monkeypatch.delenv("GROUP_RANK")  # not torchrun: Lightning's own launcher (or none) counts its processes
    check_launcher(1, 1)
