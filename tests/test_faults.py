"""Faults a long pretraining run and the analyses must survive: kills, pre-emption, torn or foreign checkpoints,
a full disk, a failing DDP rank (CPU, tiny configs; see docs/errors.md).

    .venv/bin/pytest tests/test_faults.py -q
"""

from __future__ import annotations

import errno
import importlib.util
import io
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from difflib import SequenceMatcher
from pathlib import Path

import pytest
import torch

import train
from callbacks.checkpointing import last_checkpoint
from core.errors import UserError
from core.output import atomic_file, check_writable, staged_output
from core.signals import Interrupted
from tests.test_train import STEPS, checkpoint, fit, tiny_args, train_losses
from tests.tiny import save_tiny_encoder

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")  # pytest's own argv is expected


# ---- writing: nothing half-written, no directories left behind ----

def test_a_failed_run_leaves_no_directory_it_created(tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "kept.txt").write_text("someone else's")
    deep = tmp_path / "runs" / "probe" / "bert" / "out"
    check_writable(deep)  # the early check creates the directories and removes them again
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["kept.txt"]
    with pytest.raises(RuntimeError), staged_output(deep) as stage:
        (stage / "report.json").write_text("{}")
        raise RuntimeError("bad input found half-way")
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["kept.txt"]  # runs/ existed: it stays
    with staged_output(deep) as stage:
        (stage / "report.json").write_text("{}")
    assert [p.name for p in deep.iterdir()] == ["report.json"]


def test_full_disk_while_staging_a_report_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    out = tmp_path / "runs" / "report"
    real_write = Path.write_bytes

    def full_disk(self, data):  # writes part of the file, then the disk is full
        real_write(self, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))

    with pytest.raises(UserError) as raised, staged_output(out) as stage:
        (stage / "a.json").write_text("{}")
        monkeypatch.setattr(Path, "write_bytes", full_disk)
        (stage / "b.bin").write_bytes(b"x" * 1000)
    assert str(raised.value) == f"cannot write report to {out}: No space left on device {on_disk(out)}"
    assert not (tmp_path / "runs").exists()


def on_disk(path: Path) -> str:
    """'on the disk mounted at <mount> (<size>)' as df sees the filesystem of `path` (its nearest existing parent):
    how a full-disk message names the disk."""
    while not path.exists():
        path = path.parent
    target, size = subprocess.run(["df", "-B1", "--output=target,size", str(path)], capture_output=True, text=True,
                                  check=True).stdout.splitlines()[-1].rsplit(None, 1)
    size, unit = float(size), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"on the disk mounted at {target.strip()} ({size:.0f} B)" if unit == "B" else \
        f"on the disk mounted at {target.strip()} ({size:.1f} {unit})"


def test_atomic_file_keeps_the_old_content_when_the_writer_dies(tmp_path):
    target = tmp_path / "ckpt" / "last.ckpt"
    with atomic_file(target) as handle:
        handle.write(b"old checkpoint")
    with pytest.raises(OSError), atomic_file(target) as handle:
        handle.write(b"new chec")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert target.read_bytes() == b"old checkpoint"
    assert [p.name for p in target.parent.iterdir()] == ["last.ckpt"]  # the temporary file is gone too
    assert oct(target.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def test_atomic_file_keeps_the_file_it_replaces_as_the_previous_one(tmp_path):
    target, previous = tmp_path / "last.ckpt", tmp_path / "previous.ckpt"
    with atomic_file(target, keep_previous=previous) as handle:
        handle.write(b"step 2")
    assert not previous.exists()
    with atomic_file(target, keep_previous=previous) as handle:
        handle.write(b"step 4")
    assert (target.read_bytes(), previous.read_bytes()) == (b"step 4", b"step 2")
    with pytest.raises(OSError), atomic_file(target, keep_previous=previous) as handle:
        handle.write(b"step")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert (target.read_bytes(), previous.read_bytes()) == (b"step 4", b"step 2")  # a failed write renames nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "previous.ckpt"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---- training: kill -9, a kill inside a checkpoint write, SIGTERM, bad checkpoints, a failing DDP rank ----

ACCUMULATE = ("--data.batch_size", "4")  # 2 micro-batches per optimizer step (global batch 8)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus, cache) -> dict[str, Path]:
    """Uninterrupted runs of STEPS steps: one micro-batch per step ("plain") and two ("accumulated")."""
    runs = {}
    for name, extra in (("plain", ()), ("accumulated", ACCUMULATE)):
        runs[name] = tmp_path_factory.mktemp(f"straight-{name}")
        assert fit(runs[name], corpus, cache, *extra) == 0
    return runs


def spawn(program: str, args: list[str], *fault: str) -> subprocess.Popen:
    """`python -m tests.faults PROGRAM [fault] ARGS` with this process's thread count (the same arithmetic)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(torch.get_num_threads())}
    return subprocess.Popen([sys.executable, "-m", "tests.faults", program, *fault, *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def pause(tmp_path: Path, at: int, where: str) -> tuple[str, Path, Path]:
    ready, go = tmp_path / "ready", tmp_path / "go"
    spec = {"class_path": "tests.faults.Pause", "init_args": {"ready": str(ready), "go": str(go), "at": at,
                                                               "where": where}}
    return json.dumps(spec), ready, go


def wait_for(path: Path, process: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None:
            pytest.fail(f"the run ended before {path.name} (status {process.returncode}): "
                        f"{process.communicate()[1][-3000:]}")
        assert time.monotonic() < deadline, f"no {path.name} after {timeout} s"
        time.sleep(0.05)


def assert_same_weights(root: Path, reference: Path) -> None:
    resumed, straight = checkpoint(root), checkpoint(reference)
    assert resumed["global_step"] == straight["global_step"] == STEPS
    for name, value in straight["state_dict"].items():
        torch.testing.assert_close(resumed["state_dict"][name], value, rtol=0, atol=0, msg=name)
    assert train_losses(root) == train_losses(reference)  # every step's loss, the interrupted ones included


@pytest.mark.slow
def test_kill_9_mid_step_then_resume_equals_an_uninterrupted_run(straight, corpus, cache, tmp_path):
    root = tmp_path / "run"
    spec, ready, _ = pause(tmp_path, at=5, where="optimizer_step")  # after backward, before step 5's update
    process = spawn("train", tiny_args(root, corpus, cache, "--trainer.callbacks+", spec))
    wait_for(ready, process)
    assert checkpoint(root)["global_step"] == 4  # the periodic checkpoint (every 2 steps) exists
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL
    assert not (root / "export").exists()
    assert fit(root, corpus, cache, "--ckpt_path", "last") == 0
    assert_same_weights(root, straight["plain"])


@pytest.mark.slow
def test_a_kill_inside_a_checkpoint_write_keeps_the_previous_one(straight, corpus, cache, tmp_path):
    root = tmp_path / "run"
    process = spawn("train", tiny_args(root, corpus, cache), "--die-in-save", "2")  # dies writing step 4's
    _, err = process.communicate(timeout=300)
    assert process.returncode == -signal.SIGKILL, err[-3000:]
    folder = root / "checkpoints"
    assert checkpoint(root)["global_step"] == 2  # the previous checkpoint, whole
    torn = list(folder.glob(".last.ckpt.*.tmp"))
    assert len(torn) == 1 and torn[0].stat().st_size > 0
    with pytest.raises(RuntimeError, match="zip archive"):  # really torn (and no resume ever looks at it)
        torch.load(torn[0], map_location="cpu", weights_only=True)
    assert last_checkpoint(folder) == folder / "last.ckpt"
    assert fit(root, corpus, cache, "--ckpt_path", "last") == 0
    assert_same_weights(root, straight["plain"])
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "previous.ckpt"]  # the torn leftover is gone


@pytest.mark.slow
def test_sigterm_saves_at_the_next_step_boundary_and_the_rerun_resumes_exactly(straight, corpus, cache, tmp_path):
    root = tmp_path / "run"
    # Micro-batch 4 opens optimizer step 3's window (2 micro-batches a step): the signal lands mid-window.
    spec, ready, go = pause(tmp_path, at=4, where="batch_start")
    process = spawn("train", tiny_args(root, corpus, cache, *ACCUMULATE, "--trainer.callbacks+", spec))
    wait_for(ready, process)
    process.send_signal(signal.SIGTERM)
    go.touch()
    _, err = process.communicate(timeout=120)
    lines = err.strip().splitlines()
    assert process.returncode == train.PREEMPTED_EXIT, err[-3000:]
    path = root / "checkpoints" / "last.ckpt"
    assert lines[-1] == (f"train.py: stopped by SIGTERM after step 3: saved {path}; rerun with --ckpt_path last "
                         "to resume (exit status 143)")
    assert checkpoint(root)["global_step"] == 3  # not 2 (the last periodic one): the window was finished first
    assert not (root / "export").exists()
    assert fit(root, corpus, cache, *ACCUMULATE, "--ckpt_path", "last") == 0
    assert_same_weights(root, straight["accumulated"])


@pytest.mark.slow
def test_ctrl_c_stops_at_once_names_the_checkpoint_and_the_rerun_resumes_exactly(straight, corpus, cache, tmp_path):
    """Lightning turned a Ctrl-C into its own line and exit status 1; now one line naming last.ckpt and its step (every
    2 steps: step 4's), the process ended by SIGINT (status 130), the lock and no export left, and the resume equals
    the uninterrupted run."""
    root = tmp_path / "run"
    spec, ready, _ = pause(tmp_path, at=5, where="batch_start")  # before step 5's micro-batch
    process = spawn("train", tiny_args(root, corpus, cache, "--trainer.callbacks+", spec))
    wait_for(ready, process)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == -signal.SIGINT, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert err.strip().splitlines()[-1] == (f"train.py: stopped by SIGINT after step 5; rerun with --ckpt_path last to "
                                            f"resume from {root}/checkpoints/last.ckpt (step 4) (exit status 130)")
    assert checkpoint(root)["global_step"] == 4
    assert not (root / "export").exists() and not (root / ".run.lock").exists()
    assert fit(root, corpus, cache, "--ckpt_path", "last") == 0
    assert_same_weights(root, straight["plain"])


@pytest.mark.slow
def test_a_stop_between_the_step_0_checkpoints_resumes_and_logs_every_step_at_its_own_step(straight, corpus, cache,
                                                                                          tmp_path, monkeypatch):
    """--checkpoint.save_initial (every study arm) saves step 0 twice: last.ckpt now first, then epoch=0-step=0.ckpt.
    The other way round, a run stopped between the two (here by a Ctrl-C inside the second) left a checkpoint but no
    last.ckpt, and `--ckpt_path last` (a study's rerun) was refused as a fresh start into an earlier run's directory.
    And a run resumed from step 0 logged every step one step late (Lightning's restart adds 1 to its logging step)."""
    root = tmp_path / "run"
    initial = ("--checkpoint.save_initial", "true")
    real, calls = torch.save, []

    def save(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:
            raise Interrupted(signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    assert fit(root, corpus, cache, *initial) == 130
    monkeypatch.setattr(torch, "save", real)
    assert checkpoint(root)["global_step"] == 0
    assert fit(root, corpus, cache, *initial, "--ckpt_path", "last") == 0
    assert_same_weights(root, straight["plain"])
    first = torch.load(root / "checkpoints" / "epoch=0-step=0.ckpt", map_location="cpu", weights_only=True)
    assert first["global_step"] == 0 and sorted(first["state_dict"]) == sorted(checkpoint(root)["state_dict"])


def bad_checkpoints(folder: Path, good: Path) -> dict[str, tuple[Path, tuple[str, ...], str]]:
    """name: (checkpoint file, extra arguments, the error line after 'train.py: error: ')."""
    data = good.read_bytes()
    files = {"truncated": data[: len(data) // 2], "corrupt": os.urandom(4096), "empty": b""}
    for name, content in files.items():
        (folder / f"{name}.ckpt").write_bytes(content)
    torch.save({"state_dict": {}, "epoch": 3}, folder / "foreign.ckpt")
    missing = folder / "missing.ckpt"
    return {
        "truncated": (folder / "truncated.ckpt", (), "cannot read checkpoint {}: truncated or corrupt "
                      "(PytorchStreamReader failed reading zip archive: failed finding central directory)"),
        "corrupt": (folder / "corrupt.ckpt", (), "cannot read checkpoint {}: truncated or corrupt "
                    "(not a torch.save zip archive)"),
        "empty": (folder / "empty.ckpt", (), "cannot read checkpoint {}: the file is empty"),
        "foreign": (folder / "foreign.ckpt", (), "{} is not a checkpoint of this project's MLM pretraining (no "
                    "MLMModule hyper-parameters and state_dict)"),
        "other size": (good, ("--model.hidden_size", "48"), "checkpoint {} has hidden_size=32 but the config gives "
                       "48 (hidden_size mismatch)"),
        "other depth": (good, ("--model.num_hidden_layers", "3"), "checkpoint {} has num_hidden_layers=2 but the "
                        "config gives 3 (num_hidden_layers mismatch)"),
        "other attention": (good, ("--model.attention", "gated"), "checkpoint {} was trained with attention softmax "
                            "but the config asks for gated gate_init=0.25; resume with the matching --model.attention"),
        "other arm": (good, ("--model.objective", "causal"), "checkpoint {} was trained as the mlm-learned arm but "
                      "the config asks for causal-learned; resume with the matching --model.objective and "
                      "--model.positions"),
        "other seed": (good, ("--seed_everything", "1"), "checkpoint {} was trained with data seed 0 (its blocks' "
                       "order and masks) but this run's is 1: resume with the run's own --seed_everything (a run "
                       "started before the data followed it: --data.seed 0)"),
        "missing": (missing, (), "checkpoint not found: {}"),
    }


@pytest.mark.parametrize("case", ["truncated", "corrupt", "empty", "foreign", "other size", "other depth",
                                  "other attention", "other arm", "other seed", "missing"])
def test_a_bad_checkpoint_is_one_line_naming_it_exit_2_and_nothing_written(straight, corpus, cache, tmp_path,
                                                                          capsys, case):
    good = tmp_path / "good.ckpt"
    good.write_bytes((straight["plain"] / "checkpoints" / "last.ckpt").read_bytes())
    path, extra, message = bad_checkpoints(tmp_path, good)[case]
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    root = tmp_path / "run"
    assert fit(root, corpus, cache, *extra, "--ckpt_path", str(path)) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "train.py: error: " + message.format(path)
    assert not root.exists()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


def test_ckpt_path_last_reads_the_torn_last_checkpoint_of_a_run_and_names_it(straight, corpus, cache, tmp_path,
                                                                             capsys):
    root = tmp_path / "run"
    (root / "checkpoints").mkdir(parents=True)
    data = (straight["plain"] / "checkpoints" / "last.ckpt").read_bytes()
    (root / "checkpoints" / "last.ckpt").write_bytes(data[: len(data) // 3])  # e.g. copied by hand, half-way
    assert fit(root, corpus, cache, "--ckpt_path", "last") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"train.py: error: cannot read checkpoint {root / 'checkpoints' / 'last.ckpt'}: truncated")
    assert sorted(p.name for p in root.rglob("*")) == ["checkpoints", "last.ckpt"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The dirpath has changed")  # Lightning's: the checkpoints were copied from another run
@pytest.mark.parametrize("damage", ["torn", "missing"])
def test_a_torn_or_missing_last_checkpoint_resumes_from_the_previous_one_saying_so(straight, corpus, cache, tmp_path,
                                                                                  capsys, damage):
    root = tmp_path / "run"
    folder = root / "checkpoints"
    shutil.copytree(straight["plain"] / "checkpoints", folder)
    last, previous = folder / "last.ckpt", folder / "previous.ckpt"
    assert torch.load(previous, map_location="cpu", weights_only=True)["global_step"] == STEPS - 2
    if damage == "torn":  # e.g. a disk error after the save, or a copy by hand cut short
        last.write_bytes(last.read_bytes()[: last.stat().st_size // 3])
        reason = (f"cannot read checkpoint {last}: truncated or corrupt (PytorchStreamReader failed reading zip "
                  "archive: failed finding central directory)")
    else:  # a kill between the save's two renames (last.ckpt -> previous.ckpt, the new file -> last.ckpt)
        last.unlink()
        reason = f"{last} is missing"
    assert fit(root, corpus, cache, "--ckpt_path", "last") == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert notes == [f"note: {reason}; resuming from the checkpoint before it, {previous} (step {STEPS - 2})"]
    resumed, reference = checkpoint(root), checkpoint(straight["plain"])
    assert resumed["global_step"] == STEPS
    for name, value in reference["state_dict"].items():  # the two steps again, bit for bit
        torch.testing.assert_close(resumed["state_dict"][name], value, rtol=0, atol=0, msg=name)
    losses = train_losses(straight["plain"])
    assert train_losses(root) == {step: losses[step] for step in (STEPS - 2, STEPS - 1)}


@pytest.mark.parametrize("rank", [0, 1])
def test_the_note_of_a_torn_last_checkpoint_is_said_by_the_first_process_only(straight, tmp_path, capsys, monkeypatch,
                                                                               rank):
    """Every DDP process resumes from the same previous.ckpt; only the first says so (the path it returns is the
    same on every rank)."""
    from pytorch_lightning.utilities import rank_zero_only

    from callbacks.checkpointing import resume_target

    folder = tmp_path / "checkpoints"
    shutil.copytree(straight["plain"] / "checkpoints", folder)
    (folder / "last.ckpt").unlink()
    monkeypatch.setattr(rank_zero_only, "rank", rank)
    assert resume_target(folder / "last.ckpt") == folder / "previous.ckpt"
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert notes == ([f"note: {folder / 'last.ckpt'} is missing; resuming from the checkpoint before it, "
                      f"{folder / 'previous.ckpt'} (step {STEPS - 2})"] if rank == 0 else [])


@pytest.mark.slow
def test_a_full_disk_while_saving_a_checkpoint_is_one_line_and_keeps_the_one_before(corpus, cache, tmp_path, capsys,
                                                                                    monkeypatch):
    real_save, calls = torch.save, []

    def full_disk_from_the_second_save(obj, handle, *args, **kwargs):
        calls.append(handle)
        if len(calls) < 2:
            return real_save(obj, handle, *args, **kwargs)
        handle.write(b"half a checkpoint")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", full_disk_from_the_second_save)
    root = tmp_path / "run"
    assert fit(root, corpus, cache, "--trainer.max_steps", "6", "--model.decay_steps", "6") == 2
    monkeypatch.undo()
    last = root / "checkpoints" / "last.ckpt"
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"train.py: error: cannot save checkpoint {last}: No space left on device {on_disk(last)}; the one saved "
        "before is kept "
        "(resume with --ckpt_path last once there is room)")
    assert checkpoint(root)["global_step"] == 2  # whole, weights-only
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]  # no torn temporary file, nothing renamed
    assert not (root / "export").exists() and not (root / ".run.lock").exists()


# ---- a full disk while an analysis writes its report ----

def full_disk_figure():
    """save_figure that writes half of the PNG and then finds the disk full (the JSON report was staged before)."""

    def save(fig, path, *args, **kwargs):
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        Path(path).write_bytes(buffer.getvalue()[: buffer.tell() // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    return save


def test_disk_full_while_analyze_writes_its_report(tmp_path, bert_tok, sentences_file, capfd, monkeypatch):
    import analyze
    from analyses import session

    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    out = tmp_path / "runs" / "outliers"
    monkeypatch.setattr(session, "save_figure", full_disk_figure())
    code = analyze.main(["outliers", "--encoder", str(encoder), "--data", str(sentences_file), "--output_dir",
                         str(out), "--no_progress"])
    errors = [line for line in capfd.readouterr().err.splitlines() if "error:" in line]
    assert code == 2
    assert errors == [f"analyze.py outliers: error: cannot write report to {out}: No space left on device "
                      f"{on_disk(out)}"]
    assert not (tmp_path / "runs").exists()  # no partial report, and no directory the run created


def test_disk_full_while_probe_writes_its_report(tmp_path, bert_tok, sentences_file, capfd, monkeypatch):
    import probe
    from lightning_modules import probes

    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    out = tmp_path / "runs" / "probe"
    monkeypatch.setattr(probes, "save_figure", full_disk_figure())
    with pytest.raises(SystemExit) as exited:
        probe.cli_main(["fit", "--config", str(ROOT / "configs" / "probe" / "position.yaml"), "--model.encoder",
                        str(encoder), "--data.source", str(sentences_file), "--data.progress", "false",
                        "--data.batch_size", "8", "--trainer.fast_dev_run", "true", "--trainer.logger", "false",
                        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
                        "--trainer.default_root_dir", str(out)])
    errors = [line for line in capfd.readouterr().err.splitlines() if "error:" in line]
    assert exited.value.code == 2
    assert errors == [f"probe.py: error: cannot write report to {out}: No space left on device {on_disk(out)}"]
    assert not (tmp_path / "runs").exists()


# ---- one DDP rank failing: every rank stops, the failing rank's message is shown, nothing hangs ----

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def alive_with(marker: str, grace: float = 10) -> list[int]:
    """Processes still running `grace` seconds on whose command line holds `marker` (a path unique to one test)."""
    deadline = time.monotonic() + grace
    while True:
        pids = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                continue
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.1)


def finish(process: subprocess.Popen, timeout: float) -> str:
    try:
        _, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"still running after {timeout} s: a rank hangs")
    return err


@pytest.mark.slow
def test_an_error_on_one_ddp_rank_of_train_stops_every_rank(corpus, cache, tmp_path):
    root = tmp_path / "ddp-run"
    failure = json.dumps({"class_path": "tests.faults.FailOnRank", "init_args": {"rank": 1, "step": 2}})
    process = spawn("train", tiny_args(root, corpus, cache, "--model.dropout", "0.0", "--data.batch_size", "4",
                                       "--trainer.devices", "2", "--trainer.strategy", "ddp",
                                       "--trainer.callbacks+", failure))
    err = finish(process, timeout=240)
    assert process.returncode not in (0, None)
    assert "RuntimeError: planted failure on rank 1 at step 2" in err
    assert alive_with(str(root)) == []  # rank 1 (Lightning's child process) is gone too
    assert checkpoint(root)["global_step"] == 2 and not (root / "export").exists()


@pytest.mark.slow
def test_an_error_on_one_rank_of_analyze_under_torchrun_stops_every_rank(tmp_path, bert_tok, sentences_file):
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    out = tmp_path / "ddp-report"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         "-m", "tests.faults", "analyze", "--fail-rank", "1", "outliers", "--encoder", str(encoder), "--data",
         str(sentences_file), "--output_dir", str(out), "--no_progress"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err = finish(process, timeout=240)
    assert process.returncode not in (0, None)
    assert "RuntimeError: planted failure on rank 1 while encoding" in err
    assert alive_with(str(out)) == []
    assert not out.exists()


@pytest.mark.slow
def test_sigterm_to_one_ddp_rank_stops_both_at_the_same_step(corpus, cache, tmp_path):
    """The ranks agree on a SIGTERM every --checkpoint.sigterm_every_n_steps (4 here) optimizer steps, not every
    step: signalled before step 3, both stop at the step boundary after 4 steps."""
    root = tmp_path / "ddp-run"
    spec, ready, go = pause(tmp_path, at=2, where="batch_start")  # both ranks wait before step 3's micro-batch
    process = spawn("train", tiny_args(root, corpus, cache, "--data.batch_size", "4", "--trainer.devices", "2",
                                       "--trainer.strategy", "ddp", "--trainer.callbacks+", spec,
                                       "--checkpoint.sigterm_every_n_steps", "4"))
    wait_for(ready, process)
    process.send_signal(signal.SIGTERM)  # only rank 0 (Lightning's launcher process) is signalled
    go.touch()
    err = finish(process, timeout=120)
    assert process.returncode == train.PREEMPTED_EXIT, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("train.py: stopped by SIGTERM after step 4: saved ")
    assert checkpoint(root)["global_step"] == 4  # rank 1 stopped at the same step boundary (else rank 0 would hang)
    assert alive_with(str(root)) == []


# ---- the SLURM script requeues a pre-empted run (srun and scontrol stand in for a cluster) ----

@pytest.mark.parametrize("status, requeued", [(143, True), (0, False), (2, False)])
def test_slurm_script_requeues_only_a_run_stopped_by_sigterm(tmp_path, status, requeued):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/usr/bin/env bash\necho "$@" > {tmp_path}/srun.args\ntouch {tmp_path}/started\n'
                                  f'sleep 1\nexit {status}\n')
    (bin_dir / "scontrol").write_text(f'#!/usr/bin/env bash\necho "$@" > {tmp_path}/scontrol.args\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2",
           "SLURM_NTASKS_PER_NODE": "4", "SLURM_SUBMIT_DIR": str(ROOT)}
    process = subprocess.Popen(["bash", str(ROOT / "scripts" / "slurm_pretrain.sh"), "configs/pretrain/roberta-base.yaml",
                                "--data.batch_size", "16"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    wait_for(tmp_path / "started", process, timeout=30)
    process.send_signal(signal.SIGTERM)  # pre-emption signals the batch shell too: it must keep waiting
    out, err = process.communicate(timeout=30)
    assert process.returncode == status, err
    args = (tmp_path / "srun.args").read_text().split()
    assert args[:4] == ["--kill-on-bad-exit=1", "python", "train.py", "fit"]
    assert " ".join(args[4:]) == ("--config configs/pretrain/roberta-base.yaml --trainer.num_nodes 2 --trainer.devices 4 "
                                  "--ckpt_path last --data.batch_size 16")
    assert (tmp_path / "scontrol.args").exists() is requeued
    if requeued:
        assert (tmp_path / "scontrol.args").read_text().split() == ["requeue", "4242"]


# ---- bad input refused where it is first known, in the entry point's own words ----

def outlier_at_20(model) -> None:
    """A large constant on dim 20 of every hidden state (embedding and block LayerNorm biases): a persistent outlier
    outside --dims 0-15."""
    model.embeddings.LayerNorm.bias[20] = 8.0
    for block in model.encoder.layer:
        block.output.LayerNorm.bias[20] = 8.0


def test_intervene_refuses_too_few_control_dims_before_any_pass_and_after_it_only_for_the_outliers(
        tmp_path, bert_tok, capfd, monkeypatch):
    """Given --dims that leave fewer other dims than each control set needs (as many as --dims) are refused before
    the unmodified model's pass (they ran it first, then refused); --dims that leave enough until the baseline's
    outliers are left out too can only be refused after that pass, which finds them. Nothing is written either way."""
    import analyze
    from analyses import intervene

    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok, plant=outlier_at_20)
    hidden = json.loads((encoder / "config.json").read_text())["hidden_size"]
    capfd.readouterr()  # transformers' bar of the model saved
    data = tmp_path / "sentences.txt"
    data.write_text("\n".join(f"the {word} sat on the mat by the door today" for word in ("cat", "dog", "bird", "fox",
                                                                                          "hen", "cow")) + "\n")
    passes = []
    real_measure = intervene.measure
    monkeypatch.setattr(intervene, "measure", lambda run, intervention, desc: passes.append(desc) or
                        real_measure(run, intervention, desc))
    out = tmp_path / "runs" / "intervene"
    argv = ["intervene", "--no_progress", "--encoder", str(encoder), "--data", str(data), "--batch_size", "4",
            "--num_pairs", "5", "--controls", "1", "--device", "cpu", "--interventions", "activation_zero",
            "--output_dir", str(out)]
    assert analyze.main([*argv, "--dims", "0-20"]) == 2  # 21 dims: 11 others, fewer than 21
    errors = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(errors) == 1, errors
    assert re.fullmatch(rf"analyze\.py intervene: error: 21 control dims wanted, but only {hidden - 21} of the {hidden} "
                        rf"dims of .+ are not in --dims \(and its outliers are left out too\): give at most "
                        rf"{hidden // 2} dims in --dims, or --controls 0", errors[0]), errors
    assert passes == [] and not (tmp_path / "runs").exists()
    assert analyze.main([*argv, "--dims", f"0-{hidden // 2 - 1}"]) == 2  # half the dims: enough until dim 20 is out
    errors = [line for line in capfd.readouterr().err.splitlines() if "error:" in line]
    found = re.fullmatch(rf"analyze\.py intervene: error: {hidden // 2} control dims wanted, but only (\d+) dims are "
                         "not outliers or chosen", errors[0]) if len(errors) == 1 else None
    assert found and int(found.group(1)) < hidden // 2, errors  # the outlier dim 20 at least is left out
    assert passes == ["unmodified model"] and not (tmp_path / "runs").exists()


def test_paper_names_its_own_feature_budget_option_and_the_value_it_gives_holds_float32(tmp_path, bert_tok,
                                                                                      monkeypatch, capsys):
    """`analyze.py paper`'s probes refuse hidden states past float16's range naming --max_memory_gb, an option
    `paper --help` lists (they named probe.py's --data.max_memory_gb, which paper does not take); the budget the line
    gives holds the features in float32, and the probe trains on them."""
    import analyze
    from analyses import paper
    from lightning_modules.encoder import FrozenEncoder
    from tests.test_probe import Massive

    data = tmp_path / "sst2.txt"
    data.write_text("\n".join(f"the {word} sat on the mat today" for word in ("cat", "dog", "bird", "fox", "hen",
                                                                             "cow", "owl", "pig", "ram", "yak")) + "\n")
    args = analyze.build_parser().parse_args([
        "paper", "--sst2", str(data), "--qqp", "none", "--wic", "none", "--imdb", "none", "--sst5", "none", "--sts",
        "none", "--epochs", "1", "--no_progress", "--max_length", "16", "--max_memory_gb", "1e-9", "--output_dir",
        str(tmp_path / "out")])
    analyze.validate(args)
    monkeypatch.setattr(paper, "CLASSIFIERS", {})  # the position probe alone
    encoder = FrozenEncoder(Massive(len(bert_tok), "position"), bert_tok, name="massive")
    stage = tmp_path / "stage"
    stage.mkdir()
    with pytest.raises(UserError) as refused, pytest.warns(UserWarning, match=r"over --max_memory_gb 1e-09: streaming"):
        paper.probes(args, encoder, "none", stage)
    message = str(refused.value)
    assert "past float16's largest value (65504)" in message
    named = set(re.findall(r"--[\w.]+", message))
    listed = subprocess.run([sys.executable, "analyze.py", "paper", "--help"], cwd=ROOT, capture_output=True,
                            text=True, check=True, env={**os.environ, "COLUMNS": "200"}).stdout
    assert named == {"--max_memory_gb"} and re.search(r"^\s+--max_memory_gb MAX_MEMORY_GB\s", listed, re.M), named
    args.max_memory_gb = float(re.search(r"give --max_memory_gb ([\d.]+) or more", message).group(1))
    report = paper.probes(args, encoder, "none", stage)["position_probe"]
    assert report["features"]["dtype"] == "float32"
    assert all(math.isfinite(row["accuracy"]) for row in report["layers"])
    capsys.readouterr()
    for command in ("paper", "intervene"):  # a budget that holds nothing: refused before anything is read
        out = tmp_path / f"out-{command}"
        assert analyze.main([command, "--max_memory_gb", "0", "--output_dir", str(out)]) == 2
        assert capsys.readouterr().err.splitlines() == [f"analyze.py {command}: error: --max_memory_gb must be "
                                                        "positive, got 0.0"]
        assert not out.exists()


PROBE_CONFIG = str(ROOT / "configs" / "probe" / "position.yaml")
# program: (an abbreviation of one of its options, with a missing input that ends a run at once should it be taken;
# its one-line refusal; the full option; the value it parses to)
ABBREVIATED = {
    "train.py": (["fit", "--trainer.max_step", "3", "--data.corpus", "missing.txt"],
                 "train.py: error: unknown option 'trainer.max_step' (did you mean 'trainer.max_steps'?)",
                 ["fit", "--trainer.max_steps", "3"], "3"),
    "probe.py": (["fit", "--config", PROBE_CONFIG, "--trainer.max_epoch", "3", "--data.source", "missing.txt"],
                 "probe.py: error: unknown option 'trainer.max_epoch' (did you mean 'trainer.max_epochs'?)",
                 ["fit", "--config", PROBE_CONFIG, "--trainer.max_epochs", "3"], "3"),
    "analyze.py outliers": (["outliers", "--data", "missing.txt", "--enc", "bert-base-uncased"],
                            "analyze.py: error: unknown option --enc (did you mean --encoder?)",
                            ["outliers", "--encoder", "bert-base-uncased"], "bert-base-uncased"),
    "analyze.py intervene": (["intervene", "--data", "missing.txt", "--interv", "position_mean"],
                             "analyze.py: error: unknown option --interv (did you mean --interventions?)",
                             ["intervene", "--interventions", "position_mean"], "['position_mean']"),
    "analyze.py paper": (["paper", "--sst2", "missing.txt", "--max_memory", "8"],
                         "analyze.py: error: unknown option --max_memory (did you mean --max_memory_gb?)",
                         ["paper", "--max_memory_gb", "8"], "8.0"),
    "study.py": (["--conf", "s.yaml"], "study.py: error: unknown option --conf (did you mean --config?)",
                 ["--config", "s.yaml"], "s.yaml"),
    "scripts/bigram_backcopy.py": (["--output", "bb.txt", "--seq", "3"],
                                   "bigram_backcopy.py: error: unknown option --seq (did you mean --sequences?)",
                                   ["--output", "bb.txt", "--sequences", "3"], "3"),
    "scripts/live_sampling.py": (["--enc", "missing-encoder"],
                                 "live_sampling.py: error: unknown option --enc (did you mean --encoder?)",
                                 ["--encoder", "bert-base-uncased"], "bert-base-uncased"),
}


def parsed_value(program: str, argv: list[str], cwd: Path) -> str:
    """The value of the full option (the one before the last word of `argv`) as `program` parses it (bigram_backcopy:
    as it uses it, the number of sequences written)."""
    key = argv[-2].removeprefix("--")
    if program in ("train.py", "probe.py"):  # the config jsonargparse parsed
        printed = subprocess.run([sys.executable, str(ROOT / program), *argv, "--print_config"], cwd=cwd,
                                 capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert printed.returncode == 0, printed.stderr
        return re.search(rf"^\s+{key.rsplit('.', 1)[-1]}: (\S+)$", printed.stdout, re.M).group(1)
    if program.startswith("analyze.py"):
        import analyze

        return str(getattr(analyze.build_parser().parse_args(argv), key))
    if program == "study.py":
        import study

        return study.build_parser().parse_args(argv).config
    script = script_module(ROOT / program)
    if program == "scripts/bigram_backcopy.py":
        assert script.main([argv[0], str(cwd / argv[1]), *argv[2:]]) == 0
        return str(len((cwd / argv[1]).read_text().splitlines()))
    return script.build_parser().parse_args(argv).encoder


def script_module(path: Path):
    """A script of scripts/ imported from its file (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("program", [pytest.param(program, marks=[pytest.mark.slow] if program in ("train.py", "probe.py")
                                                  else []) for program in sorted(ABBREVIATED)])  # Lightning: 2 runs
def test_an_abbreviated_option_is_refused_by_every_entry_point_and_the_full_one_is_taken(program, tmp_path, capsys):
    """argparse (allow_abbrev) and jsonargparse 4 (with a deprecation warning) read `--enc` as --encoder, silently:
    an abbreviation is an unknown option, one line and exit status 2, nothing written; the full option still works."""
    abbreviated, line, full, value = ABBREVIATED[program]
    script = ROOT / program.split()[0]
    refused = subprocess.run([sys.executable, str(script), *abbreviated], cwd=tmp_path, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert refused.returncode == 2
    assert refused.stderr.splitlines() == [line]  # the line alone: no usage before it
    assert list(tmp_path.iterdir()) == []
    assert parsed_value(program, full, tmp_path) == value


def longest_shared(text: str, source: str) -> int:
    """Length of the longest piece of `text` that occurs in `source`."""
    match = SequenceMatcher(None, text, source, autojunk=False).find_longest_match(0, len(text), 0, len(source))
    return match.size


# The rows of docs/errors.md's tables and the tests that run each of them: bad inputs by (entry point, bad input),
# faults by their name, each as written in the table's first cells.
ERROR_ROW_TESTS = {
    ('analyze.py', '`--sink_epsilon` outside [0, 1) (outliers, trajectory)'): [
        'test_analyze_outliers.py::test_bad_inputs_give_one_line_and_write_nothing',
    ],
    ('analyze.py', '`--massive_ratio` or `--magnitude_threshold` not positive, `--massive_min` negative, `--massive_top_k` below 1, `--magnitude_share` outside (0, 1]'): [
        'test_analyze_outliers.py::test_bad_inputs_give_one_line_and_write_nothing',
    ],
    ('analyze.py', 'intervene: an unknown intervention'): [
        'test_intervene.py::test_bad_requests_are_one_line_and_write_nothing',
    ],
    ('analyze.py', 'intervene: a position intervention on a model without an absolute position table (rotary, relative, none)'): [
        'test_intervene_families.py::test_what_a_family_cannot_take_is_one_line_and_writes_nothing',
        'test_more_families.py::test_position_interventions_name_what_a_family_has_instead_of_a_table',
    ],
    ('analyze.py', "intervene: a position intervention on a model whose table is all zeros (this project's no-PE models)"): [
        'test_intervene.py::test_bad_requests_are_one_line_and_write_nothing',
    ],
    ('analyze.py', 'intervene: `token_type_zero` on a model without token-type embeddings (DistilBERT)'): [
        'test_intervene.py::test_bad_requests_are_one_line_and_write_nothing',
        'test_intervene_families.py::test_what_a_family_cannot_take_is_one_line_and_writes_nothing',
    ],
    ('analyze.py', 'intervene: `layernorm_zero` on a model without a LayerNorm or RMSNorm over the hidden size'): [
        'test_intervene.py::test_bad_requests_are_one_line_and_write_nothing',
    ],
    ('analyze.py', 'intervene: `layernorm_zero` with `--layers` that no LayerNorm or RMSNorm writes (layer 0 of GPT-2, Llama, OPT: no norm before the first block)'): [
        'test_intervene_families.py::test_what_a_family_cannot_take_is_one_line_and_writes_nothing',
    ],
    ('analyze.py', "hidden states past the `--dtype`'s range (float16: 65504) at a real token (any analysis)"): [
        'test_intervene.py::test_hidden_states_past_float16s_range_are_one_line_and_write_nothing',
    ],
    ('analyze.py', 'intervene: a dimension outside the model'): [
        'test_intervene.py::test_bad_requests_are_one_line_and_write_nothing',
    ],
    ('analyze.py', 'intervene: a layer outside the model'): [
        'test_intervene.py::test_bad_requests_are_one_line_and_write_nothing',
    ],
    ('analyze.py', 'intervene: `--dims` or `--layers` not understood'): [
        'test_intervene.py::test_bad_requests_are_one_line_and_write_nothing',
    ],
    ('analyze.py', 'intervene: a negative `--controls`'): [
        'test_intervene.py::test_bad_requests_are_one_line_and_write_nothing',
    ],
    ('analyze.py', 'intervene: `--probe` with too few epochs or sentences'): [
        'test_intervene.py::test_bad_requests_are_one_line_and_write_nothing',
    ],
    ('analyze.py', 'intervene: `--probe` under torchrun'): [
        'test_intervene.py::test_bad_requests_are_one_line_and_write_nothing',
    ],
    ('analyze.py', 'intervene: `--dims` that leave fewer other dims than a control set needs (as many as `--dims`)'): [
        'test_faults.py::test_intervene_refuses_too_few_control_dims_before_any_pass_and_after_it_only_for_the_outliers',
        'test_intervene.py::test_bad_requests_are_one_line_and_write_nothing',
    ],
    ('analyze.py', "intervene: fewer dims outside the outliers and `--dims` than the controls need, known only once the "
                   "unmodified model's pass has found the outliers (`--dims auto`, or outliers outside the given "
                   "`--dims`; nothing written)"): [
        'test_faults.py::test_intervene_refuses_too_few_control_dims_before_any_pass_and_after_it_only_for_the_outliers',
    ],
    ('analyze.py', 'paper, intervene: `--max_memory_gb` not positive'): [
        'test_faults.py::test_paper_names_its_own_feature_budget_option_and_the_value_it_gives_holds_float32',
    ],
    ('analyze.py', "paper (and intervene `--probe`): hidden states past float16's range (\\|x\\| > 65504) while the "
                   "probes' features, over `--max_memory_gb` in float32, would be held in float16"): [
        'test_faults.py::test_paper_names_its_own_feature_budget_option_and_the_value_it_gives_holds_float32',
    ],
    ('train.py', 'an abbreviated option (`--trainer.max_step` for `--trainer.max_steps`; jsonargparse 4 took it, with a '
                 'deprecation warning)'): [
        'test_faults.py::test_an_abbreviated_option_is_refused_by_every_entry_point_and_the_full_one_is_taken',
    ],
    ('probe.py', 'an abbreviated option (`--trainer.max_epoch` for `--trainer.max_epochs`; jsonargparse 4 took it, with '
                 'a deprecation warning)'): [
        'test_faults.py::test_an_abbreviated_option_is_refused_by_every_entry_point_and_the_full_one_is_taken',
    ],
    ('analyze.py', 'an abbreviated option (`--enc` for `--encoder`; argparse took it, silently)'): [
        'test_faults.py::test_an_abbreviated_option_is_refused_by_every_entry_point_and_the_full_one_is_taken',
    ],
    ('study.py', 'an abbreviated option (`--conf` for `--config`)'): [
        'test_faults.py::test_an_abbreviated_option_is_refused_by_every_entry_point_and_the_full_one_is_taken',
    ],
    ('scripts/bigram_backcopy.py, scripts/live_sampling.py', 'an abbreviated option (`--seq` for `--sequences`)'): [
        'test_faults.py::test_an_abbreviated_option_is_refused_by_every_entry_point_and_the_full_one_is_taken',
    ],
    # issues 20-22: attention variants, SoftDecay fine-tuning, several-run trajectories, the probe's blocks
    ('analyze.py', 'trajectory: one of several runs without checkpoints'): [
        'test_trajectory.py::test_several_runs_refuse_bad_input_in_one_line_and_write_nothing',
    ],
    ('analyze.py', 'trajectory: two runs with one label (`--run a=X --run a=Y`, or two directories of one name unlabelled)'): [
        'test_trajectory.py::test_several_runs_refuse_bad_input_in_one_line_and_write_nothing',
    ],
    ('analyze.py', 'under torchrun, a hub id whose branch moved while the processes loaded it (each reads the commit '
                   'its own first read resolved to)'): [
        'test_hub_revisions.py::test_processes_that_read_a_hub_id_at_different_commits_are_refused_on_every_rank',
    ],
    ('analyze.py, probe.py, train.py', 'a gated export whose model.safetensors lacks the gates'): [
        'test_attention_variants.py::test_a_gated_export_without_its_gate_weights_is_one_line',
    ],
    ('probe.py', '`probe.py test`, `validate` or `predict`'): [
        'test_probe_cli.py::test_a_subcommand_other_than_fit_is_refused_rather_than_scoring_untrained_probes',
    ],
    ('probe.py', "hidden states past float16's range (\\|x\\| > 65504, a large model's massive activation) while the "
                 'features, over `--data.max_memory_gb` in float32, would be held in float16'): [
        'test_probe.py::test_features_past_float16s_range_are_refused_not_cached_as_inf',
    ],
    ('probe.py', 'a batch size or steps per block under 1'): [
        'test_probe_cli.py::test_bad_inputs_give_one_line_exit_2_and_write_nothing',
    ],
    ('train.py', 'OutlierStatistics `anisotropy_sequences` below 2'): [
        'test_callbacks.py::test_bad_callback_settings_are_one_line_exit_2_and_write_nothing',
    ],
    ('train.py', 'a clipped-softmax gamma above 0'): [
        'test_refusals.py::test_train_failures_are_one_line_exit_2_and_write_nothing',
        'test_attention_variants.py::test_settings_fill_their_defaults_and_refuse_what_is_not_theirs',
    ],
    ('train.py', 'a clipped-softmax zeta below 1'): [
        'test_refusals.py::test_train_failures_are_one_line_exit_2_and_write_nothing',
        'test_attention_variants.py::test_settings_fill_their_defaults_and_refuse_what_is_not_theirs',
    ],
    ('train.py', 'a gate probability outside (0, 1)'): [
        'test_attention_variants.py::test_settings_fill_their_defaults_and_refuse_what_is_not_theirs',
    ],
    ('train.py', "a variant's parameter with another variant"): [
        'test_refusals.py::test_train_failures_are_one_line_exit_2_and_write_nothing',
        'test_attention_variants.py::test_settings_fill_their_defaults_and_refuse_what_is_not_theirs',
    ],
    ('train.py', 'an unknown attention variant'): [
        'test_refusals.py::test_train_failures_are_one_line_exit_2_and_write_nothing',
        'test_attention_variants.py::test_settings_fill_their_defaults_and_refuse_what_is_not_theirs',
    ],
    ('train.py', "fine-tuning: `--model.softdecay true` on an encoder it cannot wrap (no `encoder.layer` / `transformer.layer` list: ALBERT's shared layer groups)"): [
        'test_finetune.py::test_softdecay_bad_input_is_one_line_exit_2_and_writes_nothing',
    ],
    ('train.py', 'fine-tuning: `--model.softdecay_alpha` outside (-1, 0) (with or without `--model.softdecay true`)'): [
        'test_finetune.py::test_softdecay_bad_input_is_one_line_exit_2_and_writes_nothing',
    ],
    ('train.py', 'fine-tuning: `--model.softdecay_alpha_mode` or `--model.softdecay_placement` not one of its choices (with or without `--model.softdecay true`)'): [
        'test_finetune.py::test_softdecay_bad_input_is_one_line_exit_2_and_writes_nothing',
    ],
    ('train.py', 'resume with another seed (`--seed_everything`, `--data.seed`)'): [
        'test_faults.py::test_a_bad_checkpoint_is_one_line_naming_it_exit_2_and_nothing_written',
    ],
    ('train.py', 'resume with another arm (`--model.objective`, `--model.positions`)'): [
        'test_faults.py::test_a_bad_checkpoint_is_one_line_naming_it_exit_2_and_nothing_written',
    ],
    ('train.py', 'an unknown objective or positions, or positions contradicting `--model.position_embeddings false`'): [
        'test_arms.py::test_bad_arm_options_are_one_line_exit_2_and_write_nothing',
    ],
    ('train.py', 'a next-token share outside (0, 1]'): [
        'test_arms.py::test_bad_arm_options_are_one_line_exit_2_and_write_nothing',
    ],
    ('train.py', 'an attention variant with rotary positions'): [
        'test_arms.py::test_bad_arm_options_are_one_line_exit_2_and_write_nothing',
    ],
    ('analyze.py', "an encoder whose hidden states have different widths through a projection after its last layer "
                   "that this project does not know (OPT-350m's `project_out` is read: docs/families.md)"): [
        'test_families.py::test_opt_350m_post_ln_with_project_out_reads_layer_l_before_the_projection_and_its_lm_loss_after_it',
    ],
    ('train.py', 'resume with another attention variant or its parameters'): [
        'test_attention_variants.py::test_resuming_with_another_variant_is_one_line',
        'test_faults.py::test_a_bad_checkpoint_is_one_line_naming_it_exit_2_and_nothing_written',
    ],
    ("train.py", "missing corpus"): ["test_train.py::test_bad_input_is_one_line_exit_2_and_writes_nothing"],
    ("train.py", "empty corpus"): [
        "test_train.py::test_bad_input_is_one_line_exit_2_and_writes_nothing",
        "test_train_inputs.py::test_bad_model_and_data_settings_are_one_line_exit_2_and_write_nothing",
    ],
    ("train.py", "global batch not a multiple of the micro-batches"): [
        "test_train.py::test_bad_input_is_one_line_exit_2_and_writes_nothing",
    ],
    ("train.py", "block longer than the position table"): [
        "test_train.py::test_bad_input_is_one_line_exit_2_and_writes_nothing",
    ],
    ("train.py", "accumulation that contradicts the global batch"): [
        "test_train.py::test_bad_input_is_one_line_exit_2_and_writes_nothing",
    ],
    ("train.py", "resume with the other PE setting"): [
        "test_train.py::test_resume_with_a_mismatching_config_is_refused",
    ],
    ("train.py", "resume with another vocabulary size"): [
        "test_train.py::test_resume_with_a_mismatching_config_is_refused",
    ],
    ("train.py", "resume with another tokenizer"): ["test_train.py::test_resume_with_a_mismatching_config_is_refused"],
    ("train.py", "resume with another global batch (`--data.global_batch_size`, or batch_size × world size without it; checkpoints from before it was saved are not checked)"): [
        "test_train.py::test_resume_with_a_mismatching_config_is_refused",
        "test_mlm.py::test_position_saves_the_global_batch_and_another_one_is_refused_unless_the_checkpoint_predates_it",
    ],
    ("train.py", "resume with the other `--data.streaming` setting"): [
        "test_train.py::test_resume_with_a_mismatching_config_is_refused",
    ],
    ("train.py", "resume a streaming run at another world size"): ["test_train.py::test_streaming_run_resumes_exactly"],
    ("train.py", "resume with another size or depth"): [
        "test_faults.py::test_a_bad_checkpoint_is_one_line_naming_it_exit_2_and_nothing_written",
    ],
    ("train.py", "truncated checkpoint"): [
        "test_faults.py::test_a_bad_checkpoint_is_one_line_naming_it_exit_2_and_nothing_written",
        "test_faults.py::test_ckpt_path_last_reads_the_torn_last_checkpoint_of_a_run_and_names_it",
    ],
    ("train.py", "corrupt checkpoint"): [
        "test_faults.py::test_a_bad_checkpoint_is_one_line_naming_it_exit_2_and_nothing_written",
    ],
    ("train.py", "empty checkpoint file"): [
        "test_faults.py::test_a_bad_checkpoint_is_one_line_naming_it_exit_2_and_nothing_written",
    ],
    ("train.py", "a checkpoint of something else"): [
        "test_faults.py::test_a_bad_checkpoint_is_one_line_naming_it_exit_2_and_nothing_written",
    ],
    ("train.py", "missing checkpoint"): [
        "test_faults.py::test_a_bad_checkpoint_is_one_line_naming_it_exit_2_and_nothing_written",
    ],
    ("train.py", "NaN or infinite loss or gradient"): [
        "test_train.py::test_nan_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint",
        "test_hot_path.py::test_a_non_finite_step_is_skipped_on_the_device_and_named_at_the_next_logging_step",
    ],
    ("train.py", "hidden size not a multiple of the heads"): [
        "test_train_inputs.py::test_bad_model_and_data_settings_are_one_line_exit_2_and_write_nothing",
    ],
    ("train.py", "a block or micro-batch too small"): [
        "test_train_inputs.py::test_bad_model_and_data_settings_are_one_line_exit_2_and_write_nothing",
    ],
    ("train.py", "global batch below the micro-batch"): [
        "test_train_inputs.py::test_bad_model_and_data_settings_are_one_line_exit_2_and_write_nothing",
    ],
    ("train.py", "masking probability outside (0, 1)"): [
        "test_train_inputs.py::test_bad_model_and_data_settings_are_one_line_exit_2_and_write_nothing",
    ],
    ("train.py", "validation share outside (0, 1)"): [
        "test_train_inputs.py::test_bad_model_and_data_settings_are_one_line_exit_2_and_write_nothing",
    ],
    ("train.py", "resume a streaming run with another number of loader workers"): [
        "test_mlm.py::test_streaming_with_several_workers_shards_the_texts_and_resumes_in_the_same_order",
    ],
    ("train.py", "DDP `static_graph` with gradient accumulation"): [
        "test_train.py::test_bad_input_is_one_line_exit_2_and_writes_nothing",
    ],
    ("train.py", "a vocabulary padding multiple below 1"): [
        "test_train_inputs.py::test_bad_model_and_data_settings_are_one_line_exit_2_and_write_nothing",
    ],
    ("train.py", "a SIGTERM agreement interval below 1"): [
        "test_train_inputs.py::test_bad_model_and_data_settings_are_one_line_exit_2_and_write_nothing",
    ],
    ("train.py", "a vocabulary too small for a byte-level BPE"): [
        "test_train_inputs.py::test_bad_model_and_data_settings_are_one_line_exit_2_and_write_nothing",
    ],
    ("train.py", "missing tokenizer path (starting with `.`, `/` or `~`, or under a directory that exists)"): [
        "test_train_inputs.py::test_a_missing_tokenizer_path_is_named_not_taken_for_a_hub_id",
    ],
    ("train.py", "a tokenizer that cannot be loaded (a directory without one, an unknown hub id)"): [
        "test_train_inputs.py::test_a_tokenizer_that_cannot_be_used_is_one_line_exit_2_and_writes_nothing",
    ],
    ("train.py", "a tokenizer without a mask (or pad) token"): [
        "test_train_inputs.py::test_a_tokenizer_that_cannot_be_used_is_one_line_exit_2_and_writes_nothing",
    ],
    ("train.py", "a tokenizer directory holding only vocab.json + merges.txt or vocab.txt (the `tokenizers` library's `save_model`)"): [
        "test_train_inputs.py::test_tokenizer_files_that_do_not_say_what_tokenizer_they_are_are_one_line_exit_2",
    ],
    ("train.py", "a tokenizer path that is a file but not a `tokenizers` .json"): [
        "test_train_inputs.py::test_tokenizer_files_that_do_not_say_what_tokenizer_they_are_are_one_line_exit_2",
    ],
    ("train.py", "resume past the end of the checkpoint's learning-rate schedule (a resume keeps the saved schedule; its end rate 0)"): [
        "test_train.py::test_resume_with_a_mismatching_config_is_refused",
        "test_mlm.py::test_a_resume_keeps_the_saved_schedule_so_a_run_past_its_end_at_rate_0_is_refused",
    ],
    ("train.py", "no end for the learning-rate schedule"): [
        "test_train_inputs.py::test_no_end_for_the_learning_rate_schedule_is_one_line_exit_2",
    ],
    ("train.py", "a corpus too small for one global batch"): [
        "test_train_inputs.py::test_a_corpus_too_small_for_one_global_batch_is_one_line_exit_2",
    ],
    ("train.py", "fewer validation blocks than DDP processes (a small corpus, `--data.max_val_blocks`)"): [
        "test_train_inputs.py::test_too_few_validation_blocks_for_the_ddp_processes_are_one_line_exit_2_and_write_nothing",
    ],
    ("train.py", "a cached tokenizer with more ids than `--data.vocab_size` (a cache edited by hand)"): [
        "test_train_inputs.py::test_a_cached_tokenizer_with_more_ids_than_the_model_is_one_line_exit_2",
    ],
    ("train.py", "live-statistics `layers` outside the model or repeated"): [
        "test_callbacks.py::test_bad_callback_settings_are_one_line_exit_2_and_write_nothing",
    ],
    ("train.py", "live-statistics `every_n_steps` below 1"): [
        "test_callbacks.py::test_bad_callback_settings_are_one_line_exit_2_and_write_nothing",
    ],
    ("train.py", "images off the capture cadence"): [
        "test_callbacks.py::test_bad_callback_settings_are_one_line_exit_2_and_write_nothing",
    ],
    ("train.py", "an online probe of under 2 positions"): [
        "test_callbacks.py::test_bad_callback_settings_are_one_line_exit_2_and_write_nothing",
    ],
    ("train.py", "AttentionGeometry `layers` outside the transformer layers 1..L or repeated"): [
        "test_callbacks.py::test_bad_callback_settings_are_one_line_exit_2_and_write_nothing",
    ],
    ("train.py", "AttentionGeometry sample sizes below 1"): [
        "test_callbacks.py::test_bad_callback_settings_are_one_line_exit_2_and_write_nothing",
    ],
    ("train.py", "a checkpoint that needs code to unpickle (a crafted `.ckpt`, given as `--ckpt_path FILE` or found by `--ckpt_path last`)"): [
        "test_untrusted.py::test_every_entry_point_refuses_the_crafted_checkpoint_and_runs_nothing",
        "test_untrusted.py::test_a_refusal_names_what_the_checkpoint_would_have_built",
    ],
    ("train.py", "`--weights_only false`"): [
        "test_untrusted.py::test_weights_only_false_is_refused_on_the_command_line",
    ],
    ("train.py", "a checkpoint of another project whose hyper-parameters lack an architecture key"): [
        "test_refusals.py::test_train_failures_are_one_line_exit_2_and_write_nothing",
    ],
    ("train.py", "a checkpoint whose weights do not fit the model"): [
        "test_refusals.py::test_a_checkpoint_whose_weights_do_not_fit_names_them",
    ],
    ("train.py", "a run directory that a live run holds"): [
        "test_lock.py::test_train_and_probe_refuse_a_directory_another_run_holds",
        "test_lock.py::test_two_runs_into_one_directory_cannot_both_proceed",
    ],
    ("train.py", "a fresh start (no `--ckpt_path`) in the directory of an earlier run"): [
        "test_refusals.py::test_train_failures_are_one_line_exit_2_and_write_nothing",
        "test_lock.py::test_two_runs_into_one_directory_cannot_both_proceed",
    ],
    ("train.py", "a learning rate or another optimiser argument out of range"): [
        "test_refusals.py::test_train_failures_are_one_line_exit_2_and_write_nothing",
    ],
    ("train.py", "a `default_root_dir` that is a file or cannot be written"): [
        "test_refusals.py::test_train_failures_are_one_line_exit_2_and_write_nothing",
        "test_refusals.py::test_a_directory_that_cannot_be_written_is_one_line",
    ],
    ("train.py", "an unknown key in a config file or on the command line"): [
        "test_refusals.py::test_train_failures_are_one_line_exit_2_and_write_nothing",
    ],
    ("train.py", "an option that picks a list item by its index (`--trainer.callbacks[0].init_args.every_n_steps 5`, "
                 "`--trainer.callbacks.0.every_n_steps 5`; jsonargparse takes no index)"): [
        "test_refusals.py::test_train_failures_are_one_line_exit_2_and_write_nothing",
        "test_refusals.py::test_did_you_mean_never_names_the_option_given",
        "test_train_inputs.py::test_a_dotted_callback_option_changes_the_last_callback_and_a_later_config_any_one",
    ],
    ("train.py", "a config file that is not UTF-8"): [
        "test_refusals.py::test_train_failures_are_one_line_exit_2_and_write_nothing",
        "test_fuzz.py::test_train_checkpoints_and_configs",
    ],
    ("train.py", "a corpus directory that is no `datasets` directory"): [
        "test_refusals.py::test_train_failures_are_one_line_exit_2_and_write_nothing",
    ],
    ("train.py", "a streaming corpus (`--data.streaming true`) with no text after the `--data.val_texts` it holds out "
                 "for validation (a small file)"): [
        "test_refusals.py::test_train_failures_are_one_line_exit_2_and_write_nothing",
    ],
    ("train.py", "a corpus table without a text column"): [
        "test_refusals.py::test_train_failures_are_one_line_exit_2_and_write_nothing",
    ],
    ("train.py", "a corpus whose texts are all empty"): [
        "test_refusals.py::test_train_failures_are_one_line_exit_2_and_write_nothing",
        "test_fuzz.py::test_train_and_probe_data",
    ],
    ("train.py", "a tokenizer directory without tokenizer files"): [
        "test_refusals.py::test_train_failures_are_one_line_exit_2_and_write_nothing",
    ],
    ("train.py", "an unknown regularizer"): [
        "test_finetune.py::test_fine_tuning_bad_input_is_one_line_exit_2_and_writes_nothing",
        "test_regularizers.py::test_bad_regulariser_options_are_one_line",
    ],
    ("train.py", "`--model.reg_layers` outside the model"): [
        "test_finetune.py::test_fine_tuning_bad_input_is_one_line_exit_2_and_writes_nothing",
        "test_finetune.py::test_pretraining_refuses_bad_regulariser_options_in_one_line",
        "test_regularizers.py::test_bad_regulariser_options_are_one_line",
    ],
    ("train.py", "`--model.reg_layers` not understood"): [
        "test_finetune.py::test_fine_tuning_bad_input_is_one_line_exit_2_and_writes_nothing",
        "test_regularizers.py::test_bad_regulariser_options_are_one_line",
    ],
    ("train.py", "`--model.zeta` outside [0, 1]"): [
        "test_finetune.py::test_fine_tuning_bad_input_is_one_line_exit_2_and_writes_nothing",
        "test_finetune.py::test_pretraining_refuses_bad_regulariser_options_in_one_line",
        "test_regularizers.py::test_bad_regulariser_options_are_one_line",
    ],
    ("train.py", "I-STAR's C0 token budget below 2"): [
        "test_finetune.py::test_fine_tuning_bad_input_is_one_line_exit_2_and_writes_nothing",
        "test_regularizers.py::test_bad_regulariser_options_are_one_line",
    ],
    ("train.py", "fine-tuning: no data source"): [
        "test_finetune.py::test_fine_tuning_bad_input_is_one_line_exit_2_and_writes_nothing",
    ],
    ("train.py", "fine-tuning: a label column with one class"): [
        "test_finetune.py::test_fine_tuning_bad_input_is_one_line_exit_2_and_writes_nothing",
    ],
    ("train.py", "fine-tuning: a label missing from the training split"): [
        "test_finetune.py::test_fine_tuning_bad_input_is_one_line_exit_2_and_writes_nothing",
    ],
    ("train.py", "fine-tuning: no label column"): [
        "test_finetune.py::test_fine_tuning_bad_input_is_one_line_exit_2_and_writes_nothing",
    ],
    ("train.py", "fine-tuning: a row without a label"): [
        "test_finetune.py::test_fine_tuning_bad_input_is_one_line_exit_2_and_writes_nothing",
    ],
    ("train.py", "fine-tuning: a text pair column the data lack"): [
        "test_finetune.py::test_fine_tuning_bad_input_is_one_line_exit_2_and_writes_nothing",
    ],
    ("train.py", "fine-tuning: `--data.classes` not two distinct classes"): [
        "test_finetune.py::test_fine_tuning_bad_input_is_one_line_exit_2_and_writes_nothing",
    ],
    ("train.py", "fine-tuning: split fractions that leave no training split"): [
        "test_finetune.py::test_fine_tuning_bad_input_is_one_line_exit_2_and_writes_nothing",
    ],
    ("train.py", "fine-tuning: a global batch not a multiple of the batch"): [
        "test_finetune.py::test_fine_tuning_bad_input_is_one_line_exit_2_and_writes_nothing",
    ],
    ("train.py", "fine-tuning: a training split smaller than the global batch"): [
        "test_finetune.py::test_fine_tuning_bad_input_is_one_line_exit_2_and_writes_nothing",
    ],
    ("train.py", "fine-tuning under DDP: fewer validation examples than processes"): [
        "test_finetune.py::test_validation_examples_dealt_to_the_ranks_give_each_rank_one",
    ],
    ("train.py", "fine-tuning: missing encoder"): [
        "test_finetune.py::test_fine_tuning_bad_input_is_one_line_exit_2_and_writes_nothing",
    ],
    ("train.py", "fine-tuning: `--data.max_length` above the encoder's positions"): [
        "test_finetune.py::test_fine_tuning_bad_input_is_one_line_exit_2_and_writes_nothing",
    ],
    ("train.py", "fine-tuning: a checkpoint of pretraining"): [
        "test_finetune.py::test_fine_tuning_bad_input_is_one_line_exit_2_and_writes_nothing",
    ],
    ("train.py", "fine-tuning: resume on data with other classes"): [
        "test_finetune.py::test_resuming_a_fine_tuning_run_on_data_with_other_classes_is_refused",
    ],
    ("a Trainer with the live callbacks", "a model whose hidden states cannot be captured"): [
        "test_callbacks.py::test_a_model_whose_hidden_states_cannot_be_captured_is_a_clear_error",
    ],
    ("a Trainer with AttentionGeometry",
     "a model whose attention cannot be read (its queries and keys are no projection of the hidden states)"): [
        "test_callbacks.py::test_a_model_whose_attention_cannot_be_read_is_refused_at_setup_with_one_line",
        "test_more_families.py::test_attention_geometry_of_relative_position_biases_is_one_line_that_says_why",
    ],
    ('train.py', '`--trainer.max_steps` or `--trainer.max_epochs` below -1'): [
        'test_lightning_refusals.py::test_train_refuses_the_trainers_options_in_one_line_and_writes_nothing',
    ],
    ('train.py', 'a run that trains nothing (`--trainer.max_steps 0`, `--trainer.max_epochs 0`, `--trainer.limit_train_batches 0`)'): [
        'test_lightning_refusals.py::test_train_refuses_the_trainers_options_in_one_line_and_writes_nothing',
        'test_lightning_refusals.py::test_the_checks_pass_what_lightning_accepts',
    ],
    ('train.py', '`--trainer.val_check_interval` 0 (or a fraction outside (0, 1])'): [
        'test_lightning_refusals.py::test_train_refuses_the_trainers_options_in_one_line_and_writes_nothing',
        'test_lightning_refusals.py::test_the_checks_pass_what_lightning_accepts',
    ],
    ('train.py', 'a GPU (or Apple MPS) the machine lacks, or more GPUs than it has'): [
        'test_lightning_refusals.py::test_train_refuses_the_trainers_options_in_one_line_and_writes_nothing',
    ],
    ('train.py', "a stateful callback twice (the config's OutlierStatistics added again with `--trainer.callbacks+`)"): [
        'test_lightning_refusals.py::test_train_refuses_the_trainers_options_in_one_line_and_writes_nothing',
    ],
    ('train.py', 'under `torchrun`, `--trainer.devices` × `--trainer.num_nodes` not the processes it started (a config\'s `devices: 1` under `--nproc_per_node 2`; probe.py and study.py\'s arms too)'): [
        'test_lightning_refusals.py::test_torchrun_processes_that_the_trainer_does_not_count_are_one_line_and_write_nothing',
    ],
    ('train.py', 'another trainer setting Lightning refuses (`--trainer.devices 0`, ...)'): [
        'test_lightning_refusals.py::test_train_refuses_the_trainers_options_in_one_line_and_writes_nothing',
    ],
    ('train.py', "a value its option's type refuses"): [
        'test_lightning_refusals.py::test_train_refuses_the_trainers_options_in_one_line_and_writes_nothing',
    ],
    ('train.py', "a resume from another run's checkpoint into a directory that holds a run (a path into it, a relative path, a symbolic link; `last` or `hpc` finding a link to it)"): [
        'test_resume_directory.py::test_a_resume_from_another_run_into_a_directory_with_a_run_is_refused',
        'test_resume_directory.py::test_a_checkpoint_of_another_run_resumes_in_an_empty_directory_and_leaves_that_run_alone',
    ],
    ('train.py', '`--ckpt_path hpc` without an HPC checkpoint, `--ckpt_path best` or `registry`'): [
        'test_resume_directory.py::test_hpc_without_an_hpc_checkpoint_and_best_are_one_line',
    ],
    ('train.py', '`train.py validate` without `--ckpt_path`; `train.py test` or `predict`'): [
        'test_train.py::test_validate_gives_the_fits_last_validation_at_its_step_and_leaves_the_run_alone',
    ],
    ('train.py', 'disk full before training (config.yaml, the logs, the lock)'): [
        'test_full_disk.py::test_a_full_disk_at_the_start_keeps_the_earlier_config_and_leaves_no_lock',
    ],
    ("probe.py", "missing data"): ["test_probe_cli.py::test_bad_inputs_give_one_line_exit_2_and_write_nothing"],
    ("probe.py", "missing encoder"): ["test_probe_cli.py::test_bad_inputs_give_one_line_exit_2_and_write_nothing"],
    ("probe.py", "`--data.max_length` above the model's positions"): [
        "test_probe_cli.py::test_bad_inputs_give_one_line_exit_2_and_write_nothing",
    ],
    ("probe.py", "an empty split"): [
        "test_probe_cli.py::test_bad_inputs_give_one_line_exit_2_and_write_nothing",
        "test_probe.py::test_the_copies_of_a_repeated_sentence_stay_in_one_split",
    ],
    ("probe.py", "a dataset without the split asked for"): [
        "test_paper.py::test_splits_come_from_a_local_dataset_with_its_own_splits",
    ],
    ("probe.py", "a missing label"): ["test_probe_cli.py::test_bad_inputs_give_one_line_exit_2_and_write_nothing"],
    ("probe.py", "a label outside `--data.classes`"): [
        "test_probe_cli.py::test_bad_inputs_give_one_line_exit_2_and_write_nothing",
    ],
    ("probe.py", "no label column"): ["test_probe_cli.py::test_bad_inputs_give_one_line_exit_2_and_write_nothing"],
    ("probe.py", "disk full while writing the report"): [
        "test_faults.py::test_disk_full_while_probe_writes_its_report",
    ],
    ("probe.py", "a learning rate that is not positive"): [
        "test_refusals.py::test_probe_failures_are_one_line_exit_2_and_write_nothing",
    ],
    ("probe.py", "`--data.softdecay_alpha` outside (-1, 0)"): [
        "test_softdecay.py::test_bad_softdecay_settings_of_the_classifiers_are_one_line_exit_2",
    ],
    ("probe.py", "`--data.normalize` other than none or softdecay"): [
        "test_softdecay.py::test_bad_softdecay_settings_of_the_classifiers_are_one_line_exit_2",
    ],
    ("probe.py", "a checkpoint that needs code to unpickle (`--model.encoder FILE.ckpt`, a run directory without export/, `--ckpt_path`)"): [
        "test_untrusted.py::test_every_entry_point_refuses_the_crafted_checkpoint_and_runs_nothing",
    ],
    ("probe.py", "a run directory that a live run holds"): [
        "test_lock.py::test_train_and_probe_refuse_a_directory_another_run_holds",
    ],
    ("probe.py", "a `default_root_dir` that is a file or cannot be written"): [
        "test_refusals.py::test_probe_failures_are_one_line_exit_2_and_write_nothing",
    ],
    ("probe.py", "a truncated `model.safetensors`"): [
        "test_refusals.py::test_probe_failures_are_one_line_exit_2_and_write_nothing",
        "test_fuzz.py::test_analyze_and_probe_encoders",
    ],
    ("probe.py", "an unknown key in a config file or on the command line"): [
        "test_refusals.py::test_probe_failures_are_one_line_exit_2_and_write_nothing",
        "test_fuzz.py::test_probe_configs",
    ],
    ("probe.py", "a data table without a text column"): [
        "test_refusals.py::test_probe_failures_are_one_line_exit_2_and_write_nothing",
        "test_io.py::test_a_detected_text_column_holds_for_every_row_and_a_null_is_a_blank_row",
    ],
    ("probe.py", "a data directory that is no `datasets` directory"): [
        "test_refusals.py::test_probe_failures_are_one_line_exit_2_and_write_nothing",
    ],
    ('probe.py', '`--trainer.max_epochs` or `--trainer.max_steps` below -1'): [
        'test_lightning_refusals.py::test_probe_refuses_runs_that_train_nothing_and_names_bad_keys',
    ],
    ('probe.py', 'a run that trains nothing (`--trainer.max_epochs 0`, `--trainer.max_steps 0`, `--trainer.limit_train_batches 0`)'): [
        'test_lightning_refusals.py::test_probe_refuses_runs_that_train_nothing_and_names_bad_keys',
    ],
    ('probe.py', "a value its option's type refuses, inside `--model.*` or `--data.*`"): [
        'test_lightning_refusals.py::test_probe_refuses_runs_that_train_nothing_and_names_bad_keys',
    ],
    ('probe.py', 'an encoder whose weights do not match its config.json'): [
        'test_refusals.py::test_probe_failures_are_one_line_exit_2_and_write_nothing',
        'test_refusals.py::test_a_partly_random_model_is_analysed_only_when_asked_for',
    ],
    ("every entry point", "a hub id or datasets name with no network and no `HF_HUB_OFFLINE`"): [
        "test_offline.py::test_unreachable_hub_fails_in_seconds_with_the_way_out_and_no_hub_call",
    ],
    ("every entry point", "a revision on a local path (`runs/x@v1`) or an empty one (`org/name@`, `@v1`), in "
                          "`--encoder`, `--encoders`, `--model.encoder`, `--data.tokenizer`"): [
        "test_hub_revisions.py::test_a_revision_on_a_local_path_or_an_empty_one_is_one_line_exit_2_and_nothing_written",
    ],
    ("every entry point", "`org/name` meant as a hub id while a folder `./org` exists (the path rule reads it as a "
                          "path)"): [
        "test_hub_cache.py::test_a_snapshot_directory_loads_under_its_name_and_a_local_folder_named_as_an_id_wins",
    ],
    ("analyze.py compare", "no report given"): ["test_compare.py::test_bad_usage_is_one_line"],
    ("analyze.py compare", "a missing report, or a JSON file that is no outliers report"): [
        "test_compare.py::test_bad_usage_is_one_line",
    ],
    ("analyze.py", "unknown hub id (not found)"): [
        "test_analyze_outliers.py::test_bad_inputs_give_one_line_and_write_nothing",
    ],
    ("every entry point", "a hub id or datasets name not in the local cache while told to stay offline "
                          "(`HF_HUB_OFFLINE`, `TRANSFORMERS_OFFLINE`; for datasets also `HF_DATASETS_OFFLINE`)"): [
        "test_offline.py::test_an_uncached_hub_name_offline_names_the_variable_that_says_offline",
        "test_offline.py::test_offline_flags_read_as_the_libraries_read_them",
        "test_hub_revisions.py::test_a_revision_the_cache_lacks_offline_is_one_line_naming_the_flag",
    ],
    ("analyze.py", "missing encoder path"): [
        "test_analyze_outliers.py::test_bad_inputs_give_one_line_and_write_nothing",
        "test_analyze_outliers.py::test_console_script_reports_the_error_and_exit_status",
    ],
    ("analyze.py", "an encoder-decoder model (T5, BART)"): [
        "test_analyze_outliers.py::test_bad_inputs_give_one_line_and_write_nothing",
    ],
    ("analyze.py", "a multimodal model (Gemma 3 from 4B, Llama 4, Mistral 3, Qwen2.5-VL: the language model's config "
                   "is its `text_config`)"): [
        "test_more_families.py::test_a_multimodal_model_is_one_line_that_says_so",
    ],
    ("analyze.py, probe.py, train.py", "a model without attention heads (RWKV, Mamba)"): [
        "test_more_families.py::test_a_model_without_attention_is_one_line",
    ],
    ("analyze.py, probe.py", "an ALBERT with `inner_group_num` > 1 (no released checkpoint: transformers' "
                             "`hidden_states` then holds a state per sub-layer)"): [
        "test_more_families.py::test_albert_with_inner_layers_is_refused_by_the_hooks_and_the_analyses",
    ],
    ("analyze.py", "`paper --sts none` with other set names"): [
        "test_paper.py::test_paper_refuses_bad_input_before_writing",
    ],
    ("analyze.py, probe.py, train.py",
     "a BERT-family checkpoint trained with transformers 4's relative positions (`position_embedding_type` "
     "`relative_key` / `relative_key_query` in its config: transformers 5 ignores the key, drops the distance "
     "embeddings and adds the untrained absolute table; a checkpoint whose safetensors hold no `distance_embedding` "
     "and whose absolute table is trained, saved by transformers 5 with the key stale, is read with a warning "
     "instead)"): [
        "test_more_families.py::test_a_bert_with_transformers_4_relative_key_positions_is_one_line",
        "test_more_families.py::test_a_bert_saved_by_transformers_5_with_a_stale_relative_key_is_read_with_its_trained_"
        "table",
    ],
    ("analyze.py, probe.py, train.py",
     "a model that needs its own Python code (an `auto_map` to a class transformers lacks)"): [
        "test_untrusted.py::test_a_model_with_its_own_code_is_refused_even_when_a_person_would_say_yes",
    ],
    ("train.py", "pretraining a RoBERTa arm (learned or no positions) with a tokenizer whose pad id is past the "
                 "position table (a GPT-2 tokenizer's added `<pad>`)"): [
        "test_train_inputs.py::test_a_gpt2_style_tokenizer_trains_the_causal_rotary_arm_and_its_pad_is_added",
    ],
    ("analyze.py", "missing data path"): ["test_analyze_outliers.py::test_bad_inputs_give_one_line_and_write_nothing"],
    ("analyze.py", "empty data file"): [
        "test_analyze_outliers.py::test_bad_inputs_give_one_line_and_write_nothing",
        "test_analyze_eval_inputs.py::test_bad_inputs_give_one_line_and_write_nothing",
    ],
    ("analyze.py", "binary data file"): ["test_analyze_outliers.py::test_bad_inputs_give_one_line_and_write_nothing"],
    ("analyze.py", 'UTF-16 data file (Windows PowerShell\'s `>`, Notepad\'s "Unicode")'): ["test_io.py::test_bad_files"],
    ("analyze.py", "a csv row with more fields than its header (an unquoted comma)"): [
        "test_io.py::test_a_csv_row_with_more_fields_than_its_header_is_refused",
    ],
    ("analyze.py, probe.py, train.py", "data not UTF-8 (Latin-1, Windows-1252)"): [
        "test_analyze_outliers.py::test_bad_inputs_give_one_line_and_write_nothing",
        "test_io.py::test_a_byte_that_is_not_utf8_is_named_where_it_lies_in_the_file",  # the reader all three share
    ],
    ("analyze.py", "no text column"): ["test_analyze_outliers.py::test_bad_inputs_give_one_line_and_write_nothing"],
    ("analyze.py", "`--max_length` above the model's positions"): [
        "test_analyze_outliers.py::test_bad_inputs_give_one_line_and_write_nothing",
    ],
    ("analyze.py", "unwritable output directory"): [
        "test_analyze_outliers.py::test_bad_inputs_give_one_line_and_write_nothing",
    ],
    ("analyze.py", "a non-positive size"): [
        "test_analyze_outliers.py::test_bad_inputs_give_one_line_and_write_nothing",
    ],
    ("analyze.py", "disk full while writing the report"): [
        "test_faults.py::test_disk_full_while_analyze_writes_its_report",
    ],
    ("analyze.py", "WiC: no target word at its offsets"): [
        "test_analyze_eval_inputs.py::test_bad_inputs_give_one_line_and_write_nothing",
    ],
    ("analyze.py", "WiC: missing columns"): [
        "test_analyze_eval_inputs.py::test_bad_inputs_give_one_line_and_write_nothing",
    ],
    ("analyze.py", "WiC: an unlabelled item"): [
        "test_analyze_eval_inputs.py::test_bad_inputs_give_one_line_and_write_nothing",
    ],
    ("analyze.py", "WiC/STS: data and gold of different lengths"): [
        "test_analyze_eval_inputs.py::test_bad_inputs_give_one_line_and_write_nothing",
    ],
    ("analyze.py", "STS: a score outside `--score_range`"): [
        "test_analyze_eval_inputs.py::test_bad_inputs_give_one_line_and_write_nothing",
    ],
    ("analyze.py", "STS: a score that is not a number"): [
        "test_analyze_eval_inputs.py::test_bad_inputs_give_one_line_and_write_nothing",
    ],
    ("analyze.py", "STS: an empty sentence (or one with nothing visible in it: zero-width spaces, a byte-order mark "
                   "alone; NULs and a leading byte-order mark are dropped first)"): [
        "test_analyze_eval_inputs.py::test_bad_inputs_give_one_line_and_write_nothing",
        "test_analyze_eval_inputs.py::test_sts_sentences_are_cleaned_and_one_with_nothing_visible_is_refused",
    ],
    ("analyze.py", "STS: no score column"): [
        "test_analyze_eval_inputs.py::test_bad_inputs_give_one_line_and_write_nothing",
    ],
    ("analyze.py", "STS: `--score_range` upside down"): [
        "test_analyze_eval_inputs.py::test_bad_inputs_give_one_line_and_write_nothing",
    ],
    ("analyze.py", "static vectors: the file missing, or `--static_lowercase` without it (before the encoder loads)"): [
        "test_paper.py::test_paper_refuses_bad_input_before_writing",
    ],
    ("analyze.py", "static vectors: ragged lines"): [
        "test_analyze_eval_inputs.py::test_bad_inputs_give_one_line_and_write_nothing",
    ],
    ("analyze.py", "static vectors: none of the words"): [
        "test_analyze_eval_inputs.py::test_bad_inputs_give_one_line_and_write_nothing",
    ],
    ("analyze.py", "self-similarity: too few words"): [
        "test_analyze_eval_inputs.py::test_bad_inputs_give_one_line_and_write_nothing",
        "test_analyze_eval_inputs.py::test_too_few_words_are_refused_before_the_encoders_weights_are_read",
        "test_analyze_eval_inputs.py::test_a_repeated_sentence_is_one_context_of_its_words",
        "test_analyze_eval_inputs.py::test_self_similarity_refuses_words_that_truncation_cuts_from_every_context",
    ],
    ("analyze.py", "self-similarity: a source that changes between its streamed passes (`--max_sentences 0` / "
                   "`--pool_sentences 0`)"): [
        "test_analyze_eval_inputs.py::test_word_pool_streams_the_whole_source_and_counts_the_qualifying_words",
    ],
    ("analyze.py", "paper: a missing local `--sst2` or `--qqp` (any of its data)"): [
        "test_paper.py::test_paper_refuses_bad_input_before_writing",
    ],
    ("analyze.py", "paper: `--sst2 none --qqp none`"): [
        "test_paper.py::test_paper_refuses_bad_input_before_writing",
    ],
    ("analyze.py", "paper: `--outlier_sentences 0`"): [
        "test_paper.py::test_paper_refuses_bad_input_before_writing",
    ],
    ("analyze.py", "anisotropy: under 2 sentences"): [
        "test_analyze_eval_inputs.py::test_bad_inputs_give_one_line_and_write_nothing",
    ],
    ("analyze.py", "`--clip` not understood"): [
        "test_analyze_eval_inputs.py::test_bad_inputs_give_one_line_and_write_nothing",
    ],
    ("analyze.py", "`--clip` outside the model"): [
        "test_analyze_eval_inputs.py::test_bad_inputs_give_one_line_and_write_nothing",
    ],
    ("analyze.py", "an empty `--clip` item"): [
        "test_analyze_eval_inputs.py::test_bad_inputs_give_one_line_and_write_nothing",
        "test_clip.py::test_bad_clip_text_is_one_line",
    ],
    ("analyze.py", "`--minibatch` below 2 (isotropy, all, trajectory)"): [
        "test_analyze_eval_inputs.py::test_bad_inputs_give_one_line_and_write_nothing",
    ],
    ("analyze.py", "`--zeta` outside [0, 1]"): [
        "test_analyze_eval_inputs.py::test_bad_inputs_give_one_line_and_write_nothing",
    ],
    ("analyze.py", "`--softdecay_alpha` outside (-1, 0)"): [
        "test_softdecay.py::test_softdecay_alpha_outside_minus_one_to_zero_is_one_line_exit_2_and_writes_nothing",
    ],
    ("analyze.py", "trajectory: a run directory without checkpoints"): [
        "test_trajectory.py::test_no_checkpoints_or_other_architectures_are_one_line_exit_2_and_write_nothing",
    ],
    ("analyze.py", "trajectory: a run directory that does not exist"): [
        "test_trajectory.py::test_no_checkpoints_or_other_architectures_are_one_line_exit_2_and_write_nothing",
    ],
    ("analyze.py", "trajectory: `--encoders` mixing encoders without a step (an export directory, a name without `step_N`) with checkpoints"): [
        "test_trajectory.py::test_no_checkpoints_or_other_architectures_are_one_line_exit_2_and_write_nothing",
    ],
    ("analyze.py", "trajectory: two `--encoders` at one step (`checkpoints/*.ckpt`: last.ckpt beside its periodic twin)"): [
        "test_trajectory.py::test_no_checkpoints_or_other_architectures_are_one_line_exit_2_and_write_nothing",
    ],
    ("analyze.py", "trajectory: checkpoints of different architectures"): [
        "test_trajectory.py::test_no_checkpoints_or_other_architectures_are_one_line_exit_2_and_write_nothing",
    ],
    ("analyze.py", "a checkpoint that needs code to unpickle (`--encoder FILE.ckpt`, or a run directory without export/)"): [
        "test_untrusted.py::test_every_entry_point_refuses_the_crafted_checkpoint_and_runs_nothing",
    ],
    ("analyze.py", "a checkpoint of another project whose hyper-parameters lack an architecture key"): [
        "test_refusals.py::test_analyze_failures_are_one_line_exit_2_and_write_nothing",
    ],
    ("analyze.py", "a checkpoint whose hyper-parameters describe no model"): [
        "test_refusals.py::test_analyze_failures_are_one_line_exit_2_and_write_nothing",
    ],
    ("analyze.py", "a checkpoint whose embedded tokenizer files are not plain names and texts"): [
        "test_untrusted.py::test_an_embedded_tokenizer_cannot_write_outside_its_temporary_directory",
    ],
    ("analyze.py", "a truncated `model.safetensors`"): [
        "test_refusals.py::test_analyze_failures_are_one_line_exit_2_and_write_nothing",
        "test_fuzz.py::test_analyze_and_probe_encoders",
    ],
    ("analyze.py", "a truncated tokenizer or config JSON of the encoder"): [
        "test_refusals.py::test_analyze_failures_are_one_line_exit_2_and_write_nothing",
        "test_fuzz.py::test_analyze_and_probe_encoders",
    ],
    ("analyze.py", "an encoder directory without tokenizer files"): [
        "test_refusals.py::test_analyze_failures_are_one_line_exit_2_and_write_nothing",
    ],
    ("analyze.py", "a data directory that is no `datasets` directory"): [
        "test_refusals.py::test_analyze_failures_are_one_line_exit_2_and_write_nothing",
    ],
    ("analyze.py", "a csv/tsv field over 16 MiB (or another row the csv reader cannot read)"): [
        "test_refusals.py::test_analyze_failures_are_one_line_exit_2_and_write_nothing",
        "test_fuzz.py::test_analyze_data",
    ],
    ("analyze.py", "`--max_length` that only the special tokens fill, with `--exclude_special`"): [
        "test_refusals.py::test_analyze_failures_are_one_line_exit_2_and_write_nothing",
    ],
    ("analyze.py", "WiC: a single scorable pair"): [
        "test_refusals.py::test_analyze_failures_are_one_line_exit_2_and_write_nothing",
    ],
    ("analyze.py", "WiC: targets lost to truncation, under 2 pairs left"): [
        "test_refusals.py::test_analyze_failures_are_one_line_exit_2_and_write_nothing",
    ],
    ("analyze.py", "an unknown option"): [
        "test_refusals.py::test_an_unknown_analyze_option_is_one_line_with_the_closest",
    ],
    ('analyze.py', 'a `--device` the machine lacks, or no device'): [
        'test_lightning_refusals.py::test_analyze_refuses_a_device_the_machine_lacks',
    ],
    ('analyze.py', "an encoder whose weights do not match its config.json (DistilBERT's weights under a BERT config)"): [
        'test_refusals.py::test_analyze_failures_are_one_line_exit_2_and_write_nothing',
        'test_refusals.py::test_a_partly_random_model_is_analysed_only_when_asked_for',
        'test_encoder.py::test_a_masked_lm_checkpoint_loads_quietly_and_a_missing_encoder_weight_is_named',
    ],
    ("study.py", "an arm whose bad input only its data shows (a corpus too small for its global batch)"): [
        "test_study.py::test_an_arm_refused_with_its_data_leaves_nothing_and_a_rerun_with_it_changed_proceeds"],
    ("study.py", "an arm of several processes (`trainer.devices: 2`) started without torchrun"): [
        "test_study.py::test_a_two_arm_study_under_torchrun_trains_both_arms_and_compares_as_one_process"],
    ("study.py", "an arm not in the study file"): ["test_study.py::test_bad_input_is_one_line_exit_2_and_writes_nothing"],
    ("study.py", "an arm's setting train.py does not know (or a bad value)"): ["test_study.py::test_bad_input_is_one_line_exit_2_and_writes_nothing"],
    ("study.py", "an arm setting what the study sets"): ["test_study.py::test_bad_input_is_one_line_exit_2_and_writes_nothing"],
    ("study.py", "a trajectory option analyze.py does not know"): ["test_study.py::test_bad_input_is_one_line_exit_2_and_writes_nothing"],
    ("study.py", "`--max_steps 0`"): ["test_study.py::test_bad_input_is_one_line_exit_2_and_writes_nothing"],
    ("study.py", "`--seeds` given twice or negative"): ["test_study.py::test_bad_input_is_one_line_exit_2_and_writes_nothing"],
    ("study.py", "a bad `verdict` in the study file"): ["test_study.py::test_bad_input_is_one_line_exit_2_and_writes_nothing"],
    ("study.py", "an output directory whose run was trained otherwise"): [
        "test_study.py::test_a_rerun_skips_finished_runs_and_refuses_changed_settings",
    ],
    ("study.py", "an output directory of the one-seed study layout"): [
        "test_study.py::test_a_rerun_skips_finished_runs_and_refuses_changed_settings",
    ],
    ("study.py", "an arm directory that is not a study arm"): ["test_study.py::test_bad_input_is_one_line_exit_2_and_writes_nothing"],
    ("study.py", "a missing study file"): ["test_study.py::test_bad_input_is_one_line_exit_2_and_writes_nothing"],
}
FAULT_ROW_TESTS = {
    "Ctrl-C (SIGINT) to `train.py`": [
        "test_faults.py::test_ctrl_c_stops_at_once_names_the_checkpoint_and_the_rerun_resumes_exactly",
    ],
    "Ctrl-C or SIGTERM to `analyze.py`, `probe.py` or `study.py`": [
        "test_interrupt.py::test_analyze_stopped_by_ctrl_c_is_one_line_and_leaves_the_earlier_report_as_it_was",
        "test_interrupt.py::test_probe_stopped_by_sigterm_says_so_with_status_143_and_the_rerun_writes_the_report_a_fresh_run_does",
        "test_interrupt.py::test_study_stopped_by_ctrl_c_mid_arm_says_so_and_the_rerun_ends_the_arm_as_an_uninterrupted_run",
        "test_interrupt.py::test_a_reports_files_all_move_in_before_a_signal_stops_the_run",
        "test_interrupt.py::test_a_checkpoint_kept_as_previous_has_its_successor_in_place_before_a_signal_stops_the_run",
    ],
    "the W&B run of a stopped run": [
        "test_one_run.py::test_a_stopped_resumed_and_rerun_training_run_is_one_wandb_run_with_every_step_once",
        "test_callbacks.py::test_two_process_ddp_logs_what_one_process_logs",
    ],
    "`kill -9` mid-step": ["test_faults.py::test_kill_9_mid_step_then_resume_equals_an_uninterrupted_run"],
    "a kill inside a checkpoint write": [
        "test_faults.py::test_a_kill_inside_a_checkpoint_write_keeps_the_previous_one",
    ],
    "SIGTERM (SLURM pre-emption or time limit, `scancel`, `kill`)": [
        "test_faults.py::test_sigterm_saves_at_the_next_step_boundary_and_the_rerun_resumes_exactly",
        "test_faults.py::test_sigterm_to_one_ddp_rank_stops_both_at_the_same_step",
    ],
    "SLURM": ["test_faults.py::test_slurm_script_requeues_only_a_run_stopped_by_sigterm"],
    "an error on one DDP rank (train.py)": ["test_faults.py::test_an_error_on_one_ddp_rank_of_train_stops_every_rank"],
    "a reader that stops early (`analyze.py compare a b \\| head`, `study.py ... \\| head`)": [
        "test_compare.py::test_a_reader_that_stops_early_ends_the_table_quietly",
    ],
    "an error on one rank (analyze.py under torchrun)": [
        "test_faults.py::test_an_error_on_one_rank_of_analyze_under_torchrun_stops_every_rank",
        "test_analyze_outliers.py::test_an_error_on_one_rank_stops_every_rank",
    ],
    "disk full while writing a report or an export": [
        "test_full_disk.py::test_a_report_or_an_export_on_a_full_disk_is_one_line_and_keeps_the_earlier_one",
        "test_faults.py::test_disk_full_while_analyze_writes_its_report",
        "test_faults.py::test_disk_full_while_probe_writes_its_report",
        "test_faults.py::test_full_disk_while_staging_a_report_is_one_line_and_leaves_nothing",
    ],
    "disk full under W&B's files": [
        "test_full_disk.py::test_w_and_b_media_on_a_full_disk_is_one_warning_naming_the_file_and_the_disk",
    ],
    "disk full while saving a checkpoint (train.py)": [
        "test_full_disk.py::test_the_real_torch_save_on_a_full_disk_is_one_line_and_keeps_the_checkpoint_before",
        "test_full_disk.py::test_train_on_a_disk_that_fills_up_stops_with_one_line_and_its_last_checkpoint",
        "test_faults.py::test_a_full_disk_while_saving_a_checkpoint_is_one_line_and_keeps_the_one_before",
        "test_faults.py::test_atomic_file_keeps_the_file_it_replaces_as_the_previous_one",
    ],
    "a torn or missing `last.ckpt` beside `previous.ckpt`": [
        "test_faults.py::test_a_torn_or_missing_last_checkpoint_resumes_from_the_previous_one_saying_so",
    ],
    "a run killed while it held its directory's lock": [
        "test_lock.py::test_a_live_runs_lock_refuses_another_and_a_killed_runs_lock_is_taken_over",
    ],
    "a run killed while it staged its reports (`analyze.py paper`'s probes build their feature caches there: "
    "gigabytes), or while `train.py` built its tokenizer or block cache (`<cache_dir>/tokenizers/`, "
    "`<cache_dir>/blocks/`)": [
        "test_io.py::test_a_later_run_removes_the_staging_directory_of_a_killed_run_and_no_live_one",
        "test_mlm.py::test_a_cache_build_removes_the_staging_directory_a_killed_build_left_and_not_a_live_ones",
    ],
    "a probe run (probe.py, `analyze.py paper`'s probes) killed while its features streamed from a memory-mapped file "
    "(over `--data.max_memory_gb`, `analyze.py paper`'s `--max_memory_gb`: gigabytes)": [
        "test_probe.py::test_a_killed_runs_memory_mapped_features_directory_is_removed_by_the_next_run_and_no_live_ones",
    ],
}


def error_tables() -> dict[str, list[list[str]]]:
    """docs/errors.md's tables by their first header cell ("entry point": bad inputs, "fault": faults), each row as
    its cells."""
    tables: dict[str, list[list[str]]] = {}
    rows = None
    for line in (ROOT / "docs" / "errors.md").read_text(encoding="utf-8").splitlines():
        if not line.startswith("| "):
            rows = None
            continue
        cells = [cell.strip() for cell in line.strip().removeprefix("| ").removesuffix(" |").split(" | ")]
        if rows is None:  # a table's header line
            assert cells[0] not in tables, f"two tables headed {cells[0]!r} in docs/errors.md"
            rows = tables[cells[0]] = []
        elif not line.startswith("| ---"):
            rows.append(cells)
    return tables


def test_every_row_of_the_docs_error_tables_is_tied_to_tests_that_exist():
    tables = error_tables()
    inputs, faults = tables["entry point"], tables["fault"]
    assert all(len(row) == 3 for row in inputs), [row for row in inputs if len(row) != 3]
    assert all(len(row) == 2 for row in faults), [row for row in faults if len(row) != 2]
    assert len(inputs) + len(faults) > 60
    # every row has its tests here, and every entry here is a row of the docs (no stale or missing ties)
    for rows, mapping in ((inputs, ERROR_ROW_TESTS), (faults, FAULT_ROW_TESTS)):
        keys = [(row[0], row[1]) if mapping is ERROR_ROW_TESTS else row[0] for row in rows]
        assert len(set(keys)) == len(keys), f"rows that repeat a key: {sorted({k for k in keys if keys.count(k) > 1})}"
        assert not set(keys) - set(mapping), f"rows of docs/errors.md with no tests here: {sorted(set(keys) - set(mapping))}"
        assert not set(mapping) - set(keys), f"tests tied to no row of docs/errors.md: {sorted(set(mapping) - set(keys))}"
    rows = [(row, ERROR_ROW_TESTS[row[0], row[1]], True) for row in inputs]
    rows += [(row, FAULT_ROW_TESTS[row[0]], False) for row in faults]
    for row, ids, is_input in rows:
        assert ids, f"no test named for: {row}"
        tests = [re.fullmatch(r"(test_\w+\.py)::(test_\w+)", test_id) for test_id in ids]
        assert all(tests), (row, ids)
        tests = [test.groups() for test in tests]
        sources = {file: (ROOT / "tests" / file).read_text(encoding="utf-8") for file, _ in tests}
        for file, name in tests:
            assert re.search(rf"^def {name}\(", sources[file], re.M), (file, name)
        if not is_input:
            continue
        entry, _, printed = row
        if entry in ("train.py", "probe.py", "analyze.py"):  # the line printed starts with the entry point's name
            assert printed.startswith(f"`{entry}"), row
        # the line quoted: its words (outside <placeholders> and "...") are what a named test checks, 10+ characters
        # of them at least (tests match a telling piece of the message, not always all of it)
        line = re.match(r"(`+)(.+?)\1", printed).group(2)
        message = re.sub(r"^(?:\S+(?: [\w-]+)?: error: |UserError: )", "", line)
        pieces = [piece for piece in re.split(r"<[^>]*>|\.\.\.", message) if piece.strip()]
        shared = max(longest_shared(piece, "\n".join(sources.values())) for piece in pieces)
        assert shared >= min(10, max(len(piece.strip()) for piece in pieces)), (row, shared)


def test_every_test_docs_guarantees_names_exists():
    text = (ROOT / "docs" / "guarantees.md").read_text(encoding="utf-8")
    named = set(re.findall(r"(test_\w+\.py)::(test_\w+)", text))
    assert len(named) > 20
    for file, name in sorted(named):
        assert re.search(rf"^def {name}\(", (ROOT / "tests" / file).read_text(encoding="utf-8"), re.M), (file, name)
