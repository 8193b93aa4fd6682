"""Issue 31: a full disk, on a real small filesystem (a 1 MiB tmpfs mounted by the test; skipped only where mounting is
not permitted, the faked-error tests of test_faults.py stand in then). The real torch.save turns ENOSPC into
`RuntimeError: [enforce fail at inline_container.cc] unexpected pos`, save_pretrained into a SafetensorError, W&B's
client into an OSError of its media file: each is one line naming the path and the disk, and the files written
before stay whole (docs/errors.md, docs/guarantees.md).

    .venv/bin/pytest tests/test_full_disk.py -q
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

import analyze
import train
from callbacks.checkpointing import AtomicCheckpointIO
from core.errors import UserError
from core.output import staged_output
from tests.test_refusals import stderr_lines
from tests.test_train import checkpoint, tiny_args
from tests.tiny import save_tiny_encoder, tiny_config

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
SIZE = "1.0 MiB"  # the disk's size as the messages give it


@pytest.fixture
def disk(tmp_path) -> Path:
    """A 1 MiB tmpfs of its own (we run as root in a sandbox); unmounted after the test."""
    where = tmp_path / "disk"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or mounted.returncode}): the faked "
                    "full-disk tests of test_faults.py stand in")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def fill(disk: Path, leave: int = 0) -> None:
    """Fill the disk, then give `leave` bytes back (whole 4 KiB pages)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as error:
        assert error.errno == errno.ENOSPC
    finally:
        os.close(fd)
    if leave:
        os.truncate(filler, max(0, filler.stat().st_size - leave))


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def full(path: Path, disk: Path) -> str:
    return f"No space left on device on the disk mounted at {disk} ({SIZE})"


def test_the_real_torch_save_on_a_full_disk_is_one_line_and_keeps_the_checkpoint_before(disk):
    folder = disk / "checkpoints"
    writer, last = AtomicCheckpointIO(), disk / "checkpoints" / "last.ckpt"
    writer.save_checkpoint({"state_dict": {"w": torch.arange(100.0)}, "global_step": 2}, last)
    before = last.read_bytes()
    fill(disk, leave=64 * 1024)
    big = {"state_dict": {"w": torch.randn(128, 1024)}, "global_step": 4}  # 512 KiB: more than is left
    with pytest.raises(RuntimeError, match=r"enforce fail at inline_container.cc.*unexpected pos"):
        with (disk / "plain.ckpt").open("wb") as handle:  # what torch.save itself raises (the error of the issue)
            torch.save(big, handle)
    (disk / "plain.ckpt").unlink()
    with pytest.raises(UserError) as raised:
        writer.save_checkpoint(big, last)
    assert str(raised.value) == (f"cannot save checkpoint {last}: {full(last, disk)}; the one saved before is kept "
                                 "(resume with --ckpt_path last once there is room)")
    assert last.read_bytes() == before  # whole: the earlier checkpoint, not a torn one
    assert torch.load(last, weights_only=True)["global_step"] == 2
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"]  # no temporary file, no previous.ckpt


@pytest.mark.slow
def test_train_on_a_disk_that_fills_up_stops_with_one_line_and_its_last_checkpoint(disk, corpus, cache, capfd):
    """Step 2's checkpoint fits on the 1 MiB disk; step 4's does not beside it (previous.ckpt is kept)."""
    root = disk / "run"
    assert train.cli_main(tiny_args(root, corpus, cache, "--trainer.max_steps", "6")) == 2
    last = root / "checkpoints" / "last.ckpt"
    assert stderr_lines(capfd)[-1] == (f"train.py: error: cannot save checkpoint {last}: {full(last, disk)}; the one "
                                       "saved before is kept (resume with --ckpt_path last once there is room)")
    assert checkpoint(root)["global_step"] == 2
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]
    assert not (root / "export").exists() and not (root / ".run.lock").exists()


def test_a_full_disk_at_the_start_keeps_the_earlier_config_and_leaves_no_lock(disk, corpus, cache, capfd):
    """config.yaml is written whole or not at all; a lock that cannot be written is one line too."""
    root = disk / "run"
    root.mkdir()
    (root / "config.yaml").write_text("# an earlier attempt's config\n")
    fill(disk, leave=4096)  # room for the lock file, none for the config
    assert train.cli_main(tiny_args(root, corpus, cache)) == 2
    assert stderr_lines(capfd)[-1] == f"train.py: error: cannot write {root}: {full(root, disk)}"
    assert snapshot(root) == {"config.yaml": b"# an earlier attempt's config\n"}
    (disk / "filler").unlink()
    fill(disk)  # not even the lock file
    assert train.cli_main(tiny_args(root, corpus, cache)) == 2
    assert stderr_lines(capfd)[-1] == f"train.py: error: cannot write to output directory {root}: {full(root, disk)}"
    assert snapshot(root) == {"config.yaml": b"# an earlier attempt's config\n"}


def test_a_report_or_an_export_on_a_full_disk_is_one_line_and_keeps_the_earlier_one(disk, bert_tok, sentences_file,
                                                                                     tmp_path, capfd):
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    out = disk / "report"
    argv = ["outliers", "--encoder", str(encoder), "--data", str(sentences_file), "--output_dir", str(out),
            "--no_progress", "--max_length", "16"]
    assert analyze.main(argv) == 0
    earlier = snapshot(out)
    fill(disk, leave=8192)  # room for the staging directory and a page of JSON, not the figures
    assert analyze.main(argv) == 2
    assert stderr_lines(capfd)[-1] == f"analyze.py outliers: error: cannot write report to {out}: {full(out, disk)}"
    assert snapshot(out) == earlier and not list(out.glob(".staging-*"))

    from transformers import AutoModel

    export = disk / "export"
    (disk / "filler").unlink()
    model = AutoModel.from_config(tiny_config("bert", len(bert_tok)))
    with staged_output(export, "the export") as stage:
        model.save_pretrained(stage)
    earlier = snapshot(export)
    fill(disk)
    with pytest.raises(UserError) as raised, staged_output(export, "the export") as stage:
        model.save_pretrained(stage)  # safetensors' own "No space left on device (os error 28)"
    assert str(raised.value) == f"cannot write the export to {export}: {full(export, disk)}"
    assert snapshot(export) == earlier


def test_w_and_b_media_on_a_full_disk_is_one_warning_naming_the_file_and_the_disk(disk):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from callbacks.wandb_logging import AutoWandbLogger, LoggingWarning, log_figure

    logger = AutoWandbLogger(save_dir=str(disk / "run"))
    from pytorch_lightning.loggers.logger import DummyExperiment

    assert not isinstance(logger.experiment, DummyExperiment)  # the offline run starts while there is room

    class Trainer:
        loggers, global_step, is_global_zero = [logger], 3, True

    figure = plt.figure()
    plt.imshow(torch.rand(64, 64).numpy())
    fill(disk)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log_figure(Trainer(), "mean_vectors", figure, 3)
    said = [str(w.message) for w in caught if issubclass(w.category, LoggingWarning)]
    assert len(said) == 1, said
    media = json.dumps(said[0])
    assert said[0].startswith(f"W&B failed mid-run (cannot write {disk / 'run' / 'wandb'}"), media
    assert said[0].endswith(f".png: {full(disk, disk)}); training continues without W&B logging"), media
    logger.finalize("success")
