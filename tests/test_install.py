"""The package as a user installs it (docs/install.md): a wheel holds the bundled corpus and its defaults find it from
any working directory; the shipped configs resolve from elsewhere; the console scripts exit as the programs do."""

from __future__ import annotations

import configparser
import importlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from tests.tiny import corpus_sentences, save_tiny_encoder

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "core" / "corpus" / "austen.txt"
SCRIPTS = {"posart-train": "train", "posart-probe": "probe", "posart-analyze": "analyze", "posart-study": "study"}


def console_scripts() -> dict[str, str]:
    """setup.cfg's console scripts: name -> "module:function"."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = config["options.entry_points"]["console_scripts"].strip().splitlines()
    return dict((part.strip() for part in line.split("=", 1)) for line in lines)


def build_wheel(tmp_path: Path) -> Path:
    """The wheel `pip wheel` builds from a copy of the clone (the clone itself gains no build/ folder), offline."""
    source = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "runs", ".venv", ".git", "wandb")
    source.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md", "train.py", "probe.py", "analyze.py", "study.py"):
        shutil.copy2(ROOT / name, source / name)
    for package in ("core", "metrics", "lightning_modules", "datamodules", "callbacks", "analyses"):
        shutil.copytree(ROOT / package, source / package, ignore=ignore)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("positional_artefacts-*.whl")
    return wheel


@pytest.mark.slow
def test_a_wheel_holds_the_corpus_and_installed_from_it_the_defaults_find_it_from_another_directory(tmp_path):
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        assert archive.read("core/corpus/austen.txt") == CORPUS.read_bytes()  # the bundled corpus, byte for byte
        assert archive.read("core/corpus/LICENSE.md") == (CORPUS.parent / "LICENSE.md").read_bytes()
        (entry_points,) = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
        shipped = configparser.ConfigParser()
        shipped.read_string(archive.read(entry_points).decode())
        assert dict(shipped["console_scripts"]) == console_scripts()
        archive.extractall(tmp_path / "site")  # a pure wheel installs as its contents (what pip install does)
    assert not any(name.startswith("configs/") for name in names)  # the clone's (docs/install.md)

    elsewhere = tmp_path / "project"
    elsewhere.mkdir()
    env = {**{key: value for key, value in os.environ.items() if key != "PYTHONPATH"},
           "PYTHONPATH": str(tmp_path / "site")}
    done = subprocess.run([sys.executable, "-c", "import core.defaults as d; print(d.__file__); print(d.DEFAULT_CORPUS)"],
                          cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    module, corpus = done.stdout.split()
    assert Path(module).parent == tmp_path / "site" / "core"  # the installed copy, not the clone
    assert Path(corpus) == tmp_path / "site" / "core" / "corpus" / "austen.txt"
    assert Path(corpus).read_bytes() == CORPUS.read_bytes()

    # study.py installed: no configs/ here or beside it -> one line naming --config, nothing written
    done = subprocess.run([sys.executable, "-m", "study", "--output_dir", "out"], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert done.stderr.startswith("study.py: error: no --config given") and "pass --config" in done.stderr
    assert not (elsewhere / "out").exists()


def test_every_console_script_runs_its_program_and_returns_its_exit_status(tmp_path, bert_tok, monkeypatch):
    """posart-X runs what `python X.py` runs, and the function it names returns the exit status: a console script is
    sys.exit(function()) on sys.argv (posart-probe's returned its ProbeCLI: printed, exit status 1 after a good run)."""
    assert {name: target.split(":")[0] for name, target in console_scripts().items()} == SCRIPTS
    module, function = console_scripts()["posart-probe"].split(":")
    data = tmp_path / "s.txt"
    data.write_text("\n".join(corpus_sentences(40)) + "\n", encoding="utf-8")
    monkeypatch.setattr(sys, "argv", [
        "posart-probe", "fit", "--config", str(ROOT / "configs" / "probe" / "position.yaml"), "--model.encoder",
        str(save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)), "--data.source", str(data), "--data.batch_size",
        "3", "--trainer.fast_dev_run", "true", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        "--data.progress", "false", "--trainer.default_root_dir", str(tmp_path / "out")])
    code = getattr(importlib.import_module(module), function)()
    assert code == 0
    report = json.loads((tmp_path / "out" / "position_probe.json").read_text())
    assert report["source"] == str(data)  # the run the status is of: every sentence of the file, split 80/10/10
    assert [report["splits"][split]["sentences"] for split in ("train", "val", "test")] == [32, 4, 4]


def test_study_reads_its_default_file_beside_the_program_from_another_directory(tmp_path, monkeypatch, capsys):
    """`python /path/to/clone/study.py` run elsewhere reads the clone's configs/study/study.yaml (its arms are named
    in the refusal of an unknown one); a configs/study/study.yaml in the working directory comes first."""
    import study

    monkeypatch.chdir(tmp_path)
    assert study.study_file(None) == ROOT / "configs" / "study" / "study.yaml"
    assert study.main(["--output_dir", "out", "--arms", "nosuch"]) == 2
    arms = ", ".join(yaml.safe_load((ROOT / "configs" / "study" / "study.yaml").read_text())["arms"])
    assert capsys.readouterr().err == f"study.py: error: unknown arm 'nosuch' (the study's arms: {arms})\n"
    assert not (tmp_path / "out").exists()
    (tmp_path / "configs" / "study").mkdir(parents=True)
    (tmp_path / "configs" / "study" / "study.yaml").write_text("arms: {}\n")
    assert study.study_file(None) == Path("configs/study/study.yaml")  # the working directory's, first


def test_the_shipped_configs_on_the_bundled_corpus_resolve_it_from_another_directory(tmp_path, monkeypatch):
    """train.py's tiny config and the study's recipe, resolved by train.py itself with the working directory
    elsewhere: the corpus is the packaged file (a config's relative path is the working directory's: docs/install.md),
    and so is the study's comparison data."""
    import study
    from analyses.study import read_study, resolve, trajectory_arguments
    from core.defaults import DEFAULT_CORPUS

    monkeypatch.chdir(tmp_path)
    for configs in (["pretrain/tiny.yaml"], ["study/base.yaml"]):
        args = [argument for config in configs for argument in ("--config", str(ROOT / "configs" / config))]
        corpus = resolve("check", args)["data"]["corpus"]
        assert Path(corpus).is_file() and Path(corpus).read_bytes() == CORPUS.read_bytes(), (configs, corpus)
    for name in ("study.yaml", "roberta-base.yaml"):
        options = read_study(ROOT / "configs" / "study" / name)["trajectory"]
        args = trajectory_arguments(options, tmp_path / "runs", study.parse_trajectory)
        assert Path(args.data) == DEFAULT_CORPUS and Path(args.data).is_file(), name
    text = yaml.safe_load((ROOT / "configs" / "pretrain" / "tiny.yaml").read_text())
    assert "corpus" not in text["data"]  # the default, not a path read from the working directory
