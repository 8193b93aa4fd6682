"""--help of every entry point: answered without importing torch (analyze.py, study.py; train.py / probe.py before
their subcommand), every analyze.py / study.py option with a help text and its default, and train.py / probe.py
opening with the project's own usage."""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import analyze
import study

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "pytorch_lightning", "lightning_fabric", "transformers", "datasets", "wandb")

# runs an entry point as `python <program> <args>` would, then reports what it printed and imported
PROBE = """
import contextlib, io, json, runpy, sys
sys.argv = [sys.argv[1], *sys.argv[2:]]
out, code = io.StringIO(), None
with contextlib.redirect_stdout(out):
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as stop:
        code = stop.code
print(json.dumps({"code": code, "out": out.getvalue(), "modules": sorted({m.split(".")[0] for m in sys.modules})}))
"""


def run_help(*argv: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [("analyze.py", "--help"), ("analyze.py", "outliers", "--help"),
                                  ("analyze.py", "compare", "--help"), ("study.py", "--help"),
                                  ("train.py", "--help"), ("probe.py", "-h")])
def test_help_imports_no_torch(argv):
    result = run_help(*argv)
    assert result["code"] in (0, None)
    assert not set(HEAVY) & set(result["modules"]), set(HEAVY) & set(result["modules"])
    assert result["out"].startswith("usage: " if argv[0] in ("analyze.py", "study.py") else "")
    if argv[0] in ("train.py", "probe.py"):  # the program's own usage: its docstring, then the common overrides
        doc = ast.get_docstring(ast.parse((ROOT / argv[0]).read_text()))
        assert result["out"].startswith(doc.strip()) and "common overrides" in result["out"]
        overrides = ast.literal_eval(next(node.value for node in ast.parse((ROOT / argv[0]).read_text()).body
                                          if isinstance(node, ast.Assign) and node.targets[0].id == "OVERRIDES"))
        assert all(option in result["out"] for option, _ in overrides)


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found = {parser.prog: parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= subparsers(sub)
    return found


def test_every_option_has_a_help_text_and_shows_its_default():
    parsers = subparsers(analyze.build_parser()) | subparsers(study.build_parser())
    assert {"analyze.py outliers", "analyze.py compare", "analyze.py trajectory", "study.py"} <= set(parsers)
    for name, parser in parsers.items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert action.help, f"{name} {action.option_strings or action.dest}: no help text"
            shown = formatter._get_help_string(action) % {"default": action.default}
            if action.option_strings:
                assert "default" in shown.lower(), f"{name} {action.option_strings}: no default shown"
        parser.format_help()  # every help string formats


def test_shown_defaults_are_the_parsed_defaults():
    """The "(default: X)" the formatter appends is the value the option takes when not given."""
    parser = subparsers(analyze.build_parser())["analyze.py isotropy"]
    text = " ".join(parser.format_help().split())
    args = analyze.build_parser().parse_args(["isotropy"])
    for option in ("--batch_size", "--seed", "--zeta", "--minibatch", "--output_dir"):
        assert f"(default: {getattr(args, option[2:])})" in text, option


def documented_parameters(cls) -> list[str]:
    """The keyword parameters of cls.__init__, those it passes up through **kwargs included (its bases')."""
    import inspect

    names = []
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        parameters = inspect.signature(klass.__init__).parameters.values()
        names += [p.name for p in parameters if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
                  and p.name not in names]
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            return names
    return names


def lightning_cli_classes() -> dict[str, type]:
    """Every class of ours that train.py and probe.py build from options: train.py's fixed ones and every class_path of
    this project in configs/ (modules, data modules, callbacks, the logger)."""
    import importlib

    import yaml

    def class_paths(node):
        if isinstance(node, dict):
            if isinstance(node.get("class_path"), str):
                yield node["class_path"]
            for value in node.values():
                yield from class_paths(value)
        elif isinstance(node, list):
            for value in node:
                yield from class_paths(value)

    paths = {"lightning_modules.mlm.MLMModule", "datamodules.mlm.MLMDataModule", "callbacks.checkpointing."
             "PretrainCheckpoint", "lightning_modules.probes.PositionProbe", "lightning_modules.probes."
             "SentenceClassifier", "datamodules.probing.PositionDataModule", "datamodules.probing.ClassificationDataModule"}
    for config in sorted((ROOT / "configs").rglob("*.yaml")):
        paths |= {path for path in class_paths(yaml.safe_load(config.read_text())) if path.split(".")[0] in
                  ("lightning_modules", "datamodules", "callbacks")}
    classes = {}
    for path in sorted(paths):
        module, _, name = path.rpartition(".")
        classes[path] = getattr(importlib.import_module(module), name)
    return classes


def test_every_init_parameter_of_the_lightning_cli_classes_has_a_help_text():
    """What `train.py fit --help` and `probe.py fit --model.help CLASS` / `--data.help CLASS` show: jsonargparse reads
    each parameter's help from the docstrings (an Args: section); a parameter it cannot read shows only its type."""
    from jsonargparse import ArgumentParser

    classes = lightning_cli_classes()
    assert {"lightning_modules.finetune.FineTuneModule", "datamodules.finetune.FineTuneDataModule",
            "callbacks.wandb_logging.AutoWandbLogger", "callbacks.outlier_statistics.OutlierStatistics"} <= set(classes)
    missing = {}
    for path, cls in classes.items():
        parser = ArgumentParser()
        parser.add_class_arguments(cls, "x")
        helps = {action.dest[2:]: (action.help or "").strip() for action in parser._actions
                 if action.dest.startswith("x.")}
        names = documented_parameters(cls)
        assert names and set(names) <= set(helps), (path, set(names) - set(helps))
        missing[path] = [name for name in names if not helps[name]]
    assert missing == {path: [] for path in classes}


@pytest.mark.parametrize("name", [None, "study.yaml", "study-bb.yaml", "roberta-base.yaml"])
def test_study_help_lists_every_arm_of_its_study_file_with_its_settings(name, capsys):
    import yaml

    path = ROOT / "configs" / "study" / (name or "study.yaml")  # None: study.py's default study file
    arms = yaml.safe_load(path.read_text(encoding="utf-8"))["arms"]
    with pytest.raises(SystemExit) as stop:
        study.main([*(["--config", str(path)] if name else []), "--help"])
    assert stop.value.code == 0
    listed = capsys.readouterr().out.split("(train.py settings each changes):\n", 1)[1].splitlines()
    assert [line.split()[0] for line in listed] == list(arms)  # every arm, in the file's order, nothing else
    for line, (arm, settings) in zip(listed, arms.items()):
        words = line.split(None, 1)[1]
        expected = ", ".join(f"{key} {str(value).lower() if isinstance(value, bool) else value}"
                             for key, value in (settings or {}).items())
        assert words == (expected or "no change"), (arm, words)


def option_help(parser: argparse.ArgumentParser, dest: str) -> tuple[str, object]:
    action = next(action for action in parser._actions if action.dest == dest)
    return action.help, action.default


def test_max_sentences_help_says_whose_sample_its_default_is():
    from core.defaults import MAX_SENTENCES, NUM_PAIRS, PAPER_OUTLIER_SENTENCES

    parsers = subparsers(analyze.build_parser())
    text, default = option_help(parsers["analyze.py outliers"], "max_sentences")
    assert default == MAX_SENTENCES and f"default {MAX_SENTENCES}: ours;" in text  # ours, not the paper's §3 sample
    assert f"the paper's §3 sample is {PAPER_OUTLIER_SENTENCES:,} sentences of each of SST-2's and QQP's" in text
    assert "`analyze.py paper --outlier_sentences`" in text  # the subcommand that draws the paper's sample
    assert option_help(parsers["analyze.py paper"], "outlier_sentences")[1] == PAPER_OUTLIER_SENTENCES
    text, default = option_help(parsers["analyze.py paper"], "max_sentences")  # paper's is §4.1's sample, the paper's
    assert default == MAX_SENTENCES and f"default {MAX_SENTENCES}, the paper's" in text and "--outlier_sentences" in text
    assert option_help(parsers["analyze.py anisotropy"], "num_pairs")[1] == NUM_PAIRS and 2 * NUM_PAIRS == MAX_SENTENCES
    with_sample = {name: option_help(parser, "max_sentences") for name, parser in parsers.items()
                   if any(action.dest == "max_sentences" for action in parser._actions)}
    assert {"analyze.py outliers", "analyze.py anisotropy", "analyze.py isotropy", "analyze.py self-similarity",
            "analyze.py all", "analyze.py paper", "analyze.py trajectory", "analyze.py intervene"} == set(with_sample)
    for name, (text, default) in with_sample.items():  # each names its default and whose it is
        assert f"default {default}" in text and ("ours" in text or "the paper's" in text), name


def test_no_help_or_doc_calls_our_numbers_the_papers():
    """The paper's outlier rule is words ("the largest or smallest value of most vectors"; §3), not a number: the 20%
    share is ours, and neither the help nor the docs may call it the paper's. Nor does the paper name a precision for
    its hidden states, so --dtype's float32 is transformers' default, not "the paper's"."""
    from core.defaults import OUTLIER_MIN_SHARE

    share = round(100 * OUTLIER_MIN_SHARE)
    claim = re.compile(rf"paper's\s+({share}\s*%|{OUTLIER_MIN_SHARE})", re.I)
    texts = {path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8")
             for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
    for name, parser in subparsers(analyze.build_parser()).items():
        for dest in ("min_share", "dtype"):
            if any(action.dest == dest for action in parser._actions):
                text, default = option_help(parser, dest)
                texts[f"{name} --{dest}"] = text
                if dest == "min_share":  # the default is ours, and the help says so
                    assert default == OUTLIER_MIN_SHARE and "ours" in text, name
                else:
                    assert default == "float32" and "paper" not in text, name
    assert len(texts) > 10  # the docs and every subcommand with the options were read
    assert {name: claim.search(text)[0] for name, text in texts.items() if claim.search(text)} == {}


def test_paper_num_pairs_samples_its_own_sets():
    from core.defaults import NUM_PAIRS

    text, default = option_help(subparsers(analyze.build_parser())["analyze.py paper"], "num_pairs")
    assert default == NUM_PAIRS and "--sst2" in text and "--qqp" in text and "--max_sentences" in text


def test_every_option_a_help_text_names_is_an_option_of_its_subcommand():
    """A help text that names --x means this subcommand's --x, or `<other subcommand> --x` another's (`paper` has no
    --data: its --num_pairs once said 'sentences of --data')."""
    import re

    parsers = subparsers(analyze.build_parser()) | subparsers(study.build_parser())
    options = {name: {option for action in parser._actions for option in action.option_strings}
               for name, parser in parsers.items()}
    for name, parser in parsers.items():
        for action in parser._actions:
            for command, option in re.findall(r"(?:([\w-]+) )?(--[a-z0-9_]+)", action.help or ""):
                owner = f"analyze.py {command}" if f"analyze.py {command}" in parsers and command != name else name
                assert option in options[owner], f"{name} {action.option_strings}: {option} is not an option of {owner}"


def config_default(path: str, key: str):
    """The value a LightningCLI config file gives `--section.name` (under the section's init_args, or in it)."""
    import yaml

    section, name = key[2:].split(".", 1)
    config = yaml.safe_load((ROOT / path).read_text(encoding="utf-8"))[section]
    return config.get("init_args", config)[name]


def same_value(written: str, default) -> bool:
    """A default as the docs write it (`1e-4`, `false`, `glue/sst2`, `sts12 stsb`) against the parsed one."""
    import yaml

    if isinstance(default, list):
        return written.split() == [str(item) for item in default]
    if isinstance(default, bool) or default is None:
        return yaml.safe_load(written) is default
    if isinstance(default, (int, float)):
        return float(written) == float(default)
    return written == str(default)


def test_the_protocol_table_names_the_defaults_in_force():
    """docs/analyses.md's table of the paper's protocol, step by step: every `analyze.py SUB --x V` and `CONFIG --x V`
    it writes is the default that subcommand or config file has now (a value that drifts, or an option that is gone,
    fails here), and every row says whose its step is."""
    text = (ROOT / "docs" / "analyses.md").read_text(encoding="utf-8")
    table = text.split("## The paper's protocol, step by step", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| step")
            and not line.startswith("| ---")]
    assert len(rows) >= 15
    parsers = subparsers(analyze.build_parser())
    span = re.compile(r"`((?:analyze\.py [\w-]+)|(?:configs/[\w/.-]+\.yaml)) (--[\w.]+) ([^`]+)`")
    checked = []
    for row in rows:
        whose = row.rstrip(" |").rsplit(" | ", 1)[1]
        assert "the paper's" in whose or "ours" in whose or "Table 4's" in whose, row
        for where, option, written in span.findall(row):
            if where.startswith("analyze.py"):
                parser = parsers[where]
                action = next((a for a in parser._actions if option in a.option_strings), None)
                assert action is not None, (where, option)
                default = action.default
            else:
                default = config_default(where, option)
            assert same_value(written, default), (where, option, written, default)
            checked.append((where, option))
    assert len(checked) >= 25 and len(set(checked)) == len(checked)
    assert {"configs/pretrain/roberta-base.yaml", "configs/probe/position.yaml", "analyze.py paper",
            "analyze.py anisotropy", "analyze.py outliers"} <= {where for where, _ in checked}
