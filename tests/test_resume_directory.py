"""Issue 31: a resume never writes into a directory that holds another run. `train.py fit --trainer.default_root_dir B
--ckpt_path A/checkpoints/last.ckpt` with B holding a run is refused, whichever way the checkpoint is named (a path
into A, a relative one, a symbolic link, `last` or `hpc` finding a link to A's), and B's and A's files stay byte for
byte as they were; a checkpoint of A resumes in A itself or in an empty directory (docs/errors.md).

    .venv/bin/pytest tests/test_resume_directory.py -q
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import train
from tests.test_refusals import stderr_lines
from tests.test_train import checkpoint, tiny_args

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter", "ignore:The dirpath has changed")


def snapshot(*roots: Path) -> dict[str, bytes]:
    """Every file under `roots` (links as where they point), by path: to compare byte for byte."""
    found = {}
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.is_symlink():
                found[str(path)] = f"-> {os.readlink(path)}".encode()
            elif path.is_file():
                found[str(path)] = path.read_bytes()
    return found


@pytest.fixture(scope="module")
def run_a(tmp_path_factory, corpus, cache) -> Path:
    """A finished tiny run (2 steps): checkpoints/last.ckpt and export/."""
    root = tmp_path_factory.mktemp("a") / "run-a"
    assert train.cli_main(tiny_args(root, corpus, cache, "--trainer.max_steps", "2", "--model.warmup_steps", "1")) == 0
    return root


def finished_run(root: Path) -> Path:
    """Another run's directory as train.py leaves it (contents not read: holding them is what counts)."""
    (root / "checkpoints").mkdir(parents=True)
    (root / "checkpoints" / "last.ckpt").write_bytes(b"run B's weights")
    (root / "checkpoints" / "previous.ckpt").write_bytes(b"run B's weights before")
    (root / "export").mkdir()
    (root / "export" / "config.json").write_text('{"model_type": "roberta"}')
    (root / "export" / "model.safetensors").write_bytes(b"run B's export")
    (root / "config.yaml").write_text("run B's config\n")
    return root


@pytest.mark.parametrize("form", ["path into A", "relative path", "symbolic link", "last finding a link to A's",
                                  "hpc finding a link to A's"])
def test_a_resume_from_another_run_into_a_directory_with_a_run_is_refused(form, run_a, corpus, cache, tmp_path,
                                                                          monkeypatch, capfd):
    a_last = run_a / "checkpoints" / "last.ckpt"
    b = finished_run(tmp_path / "run-b")
    held = "last.ckpt, previous.ckpt, export/"
    if form == "path into A":
        given = str(a_last)
    elif form == "relative path":
        monkeypatch.chdir(tmp_path)
        given = os.path.relpath(a_last, tmp_path)
    elif form == "symbolic link":
        (tmp_path / "latest.ckpt").symlink_to(a_last)
        given = str(tmp_path / "latest.ckpt")
    elif form == "last finding a link to A's":
        (b / "checkpoints" / "last.ckpt").unlink()
        (b / "checkpoints" / "last.ckpt").symlink_to(a_last)
        given = "last"
    else:
        (b / "hpc_ckpt_3.ckpt").symlink_to(a_last)
        given = "hpc"
        held = "last.ckpt, previous.ckpt, hpc_ckpt_3.ckpt, export/"
    before = snapshot(b, run_a)
    assert train.cli_main(tiny_args(b, corpus, cache, "--ckpt_path", given)) == 2
    assert stderr_lines(capfd) == [
        f"train.py: error: {b} holds another run ({held}) and --ckpt_path {given} is a checkpoint of {run_a}: a "
        "resume writes into --trainer.default_root_dir and would overwrite that run; resume in the checkpoint's own "
        f"directory (--trainer.default_root_dir {run_a}) or in an empty one"]
    assert snapshot(b, run_a) == before  # both runs byte for byte, no lock or config.yaml left


def test_hpc_without_an_hpc_checkpoint_and_best_are_one_line(corpus, cache, tmp_path, capfd):
    root = tmp_path / "run"
    for given, line in (("hpc", f"--ckpt_path hpc: no HPC checkpoint (hpc_ckpt_<n>.ckpt, which Lightning saves on "
                                f"SLURM's USR1 signal) in {root}; resume with --ckpt_path last or a checkpoint file"),
                        ("best", "--ckpt_path best cannot resume a run: give last, hpc or a checkpoint file")):
        assert train.cli_main(tiny_args(root, corpus, cache, "--ckpt_path", given)) == 2
        assert stderr_lines(capfd) == [f"train.py: error: {line}"]
        assert not root.exists()


@pytest.mark.slow
def test_a_checkpoint_of_another_run_resumes_in_an_empty_directory_and_leaves_that_run_alone(run_a, corpus, cache,
                                                                                            tmp_path):
    before = snapshot(run_a)
    fork = tmp_path / "fork"
    assert train.cli_main(tiny_args(fork, corpus, cache, "--trainer.max_steps", "3", "--ckpt_path",
                                    str(run_a / "checkpoints" / "last.ckpt"))) == 0
    assert checkpoint(fork)["global_step"] == 3 and checkpoint(run_a)["global_step"] == 2
    assert snapshot(run_a) == before
