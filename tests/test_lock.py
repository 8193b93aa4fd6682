"""One live run per run directory (core/lock.py): a second train.py or probe.py into it is refused with one line naming
the other process; a lock left by a killed run is taken over with a note; DDP ranks never refuse their own run.

    .venv/bin/pytest tests/test_lock.py -q
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import probe
import train
from core.errors import UserError
from core.lock import LOCK_NAME, RunLock
from tests.test_faults import pause, spawn, wait_for
from tests.test_train import checkpoint, tiny_args
from tests.tiny import free_port

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
HOST = socket.gethostname()


@pytest.fixture
def holder(tmp_path):
    """Another process holding the lock of tmp_path/"run" (as a live train.py would), killed at the end."""
    root = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from core.lock import RunLock; RunLock(sys.argv[1], 'train.py')"
         ".acquire(); print('held', flush=True); time.sleep(300)", str(root)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    yield root, process
    process.kill()
    process.wait()


def in_use(root: Path, pid: int) -> str:
    return f"{root} is in use by another run: train.py (pid {pid} on {HOST}, since "


def test_a_live_runs_lock_refuses_another_and_a_killed_runs_lock_is_taken_over(holder, capsys):
    root, process = holder
    with pytest.raises(UserError) as refused:
        RunLock(root, "probe.py").acquire()
    assert str(refused.value).startswith(in_use(root, process.pid))
    assert str(refused.value).endswith("; wait for it to end, or choose another --trainer.default_root_dir")
    process.send_signal(signal.SIGKILL)  # no chance to remove its lock file: the kernel drops its flock
    process.wait()
    assert json.loads((root / LOCK_NAME).read_text())["pid"] == process.pid
    lock = RunLock(root, "probe.py")
    lock.acquire()
    note = capsys.readouterr().err.strip()
    assert note.startswith(f"note: {root} was locked by train.py (pid {process.pid} on {HOST}, since ")
    assert note.endswith("which is no longer running: taking the lock over")
    assert json.loads((root / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert sorted(root.iterdir()) == []  # the lock file goes; the directory stays (it was there before)


def test_a_released_lock_leaves_nothing_and_the_directory_only_if_it_was_there(tmp_path):
    deep = tmp_path / "runs" / "a" / "b"
    lock = RunLock(deep, "train.py")
    lock.acquire()
    owner = json.loads((deep / LOCK_NAME).read_text())
    assert (owner["program"], owner["pid"], owner["host"]) == ("train.py", os.getpid(), HOST)
    with pytest.raises(UserError, match="is in use by another run: train.py"):  # one process, two runs: refused too
        RunLock(deep, "train.py").acquire()
    lock.release()
    assert list(tmp_path.iterdir()) == []  # every directory acquire created, gone with the lock
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match=f"cannot write to output directory {tmp_path / 'file'}: File exists"):
        RunLock(tmp_path / "file", "train.py").acquire()


def test_without_flock_a_dead_pid_or_this_slurm_jobs_lock_is_stale_and_another_hosts_is_not(tmp_path, monkeypatch,
                                                                                          capsys):
    from core import lock as locking

    monkeypatch.setattr(locking, "flock", lambda fd: None)  # a filesystem without flock
    root = tmp_path / "run"
    root.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    cases = [({"program": "train.py", "pid": dead.pid, "host": HOST}, None, True),
             ({"program": "train.py", "pid": os.getppid(), "host": HOST}, None, False),  # alive
             ({"program": "train.py", "pid": 1, "host": "elsewhere"}, None, False),
             ({"program": "train.py", "pid": 1, "host": "elsewhere", "slurm_job": "77"}, "77", True)]  # requeued
    for owner, job, stale in cases:
        (root / LOCK_NAME).write_text(json.dumps(owner))
        monkeypatch.delenv("SLURM_JOB_ID", raising=False)
        if job:
            monkeypatch.setenv("SLURM_JOB_ID", job)
        lock = RunLock(root, "train.py")
        if stale:
            lock.acquire()
            assert "which is no longer running: taking the lock over" in capsys.readouterr().err
            lock.release()
        else:
            with pytest.raises(UserError, match=f"in use by another run: train.py \\(pid {owner['pid']} on "):
                lock.acquire()


def test_train_and_probe_refuse_a_directory_another_run_holds(holder, corpus, cache, bert_tok, sentences_file,
                                                              capsys):
    from tests.test_untrusted import probe_args
    from tests.tiny import save_tiny_encoder

    root, process = holder
    encoder = save_tiny_encoder(root.parent / "bert", "bert", bert_tok)
    capsys.readouterr()
    assert train.cli_main(tiny_args(root, corpus, cache)) == 2
    with pytest.raises(SystemExit) as exited:
        probe.cli_main(probe_args(encoder, sentences_file, root))
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert [line.split(": error: ")[0] for line in lines] == ["train.py", "probe.py"]
    assert all(line.split(": error: ")[1].startswith(in_use(root, process.pid)) for line in lines)
    assert sorted(p.name for p in root.iterdir()) == [LOCK_NAME]  # the holder's lock, nothing else


@pytest.mark.slow
def test_two_runs_into_one_directory_cannot_both_proceed(corpus, cache, tmp_path, capsys):
    root = tmp_path / "run"
    spec, ready, go = pause(tmp_path, at=3, where="batch_start")
    first = spawn("train", tiny_args(root, corpus, cache, "--trainer.callbacks+", spec))  # PE, paused mid-run
    wait_for(ready, first)
    for extra in (("--model.position_embeddings", "false"), ("--ckpt_path", "last")):  # a no-PE run; a resume
        assert train.cli_main(tiny_args(root, corpus, cache, *extra)) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
            f"train.py: error: {in_use(root, first.pid)}")
    go.touch()
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    assert json.loads((root / "export" / "config.json").read_text())["max_position_embeddings"] == 34
    assert checkpoint(root)["hyper_parameters"]["position_embeddings"] is True  # the first run's, whole
    assert not (root / LOCK_NAME).exists()
    # afterwards a fresh no-PE run would overwrite the finished run: refused; a resume must match its config
    assert train.cli_main(tiny_args(root, corpus, cache, "--model.position_embeddings", "false")) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"train.py: error: {root} holds an earlier run (last.ckpt, previous.ckpt, export/): resume it with "
        "--ckpt_path last, or start this one in another --trainer.default_root_dir (or remove that run first)")


@pytest.mark.slow
def test_torchrun_ranks_share_their_runs_lock(corpus, cache, tmp_path):
    root = tmp_path / "ddp"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         "train.py", *tiny_args(root, corpus, cache, "--data.batch_size", "4", "--trainer.devices", "2",
                                "--trainer.strategy", "ddp", "--trainer.max_steps", "2", "--model.decay_steps", "2",
                                "--model.warmup_steps", "1")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "in use by another run" not in result.stderr and time.monotonic() - started < 300
    assert checkpoint(root)["global_step"] == 2 and (root / "export" / "config.json").exists()
    assert not (root / LOCK_NAME).exists()
