"""Every command, link and option the docs give is true today: README.md and docs/*.md checked against the programs as
they are, parsed without running their work (no encoder loads, nothing trained, nothing written).

What counts as a command
- every line of a ```bash block: backslash-continued lines joined, `# comments` cut (the options a comment names are
  checked as names, below), a line split at `;`, `&&`, `|` and `&` into its commands, `VAR=value` before a command
  dropped, a heredoc's body skipped, a `for` loop's body lines checked with its shell variables set by SHELL_VARIABLES;
- an inline span in prose that is a whole command: `python X.py ARGS`, `torchrun ... X.py ARGS`, `make TARGET`,
  `posart-X ARGS`, `python benchmarks/X.py ARGS`, `python scripts/X.py ARGS`. A span whose arguments are only `...`
  (`python train.py ...`) names a program; a span without its launcher (`analyze.py paper --outlier_sentences`,
  `train.py validate --config <run>/config.yaml ...`) is a fragment: its options are checked as names only;
- a command of another program (pip, wandb, python -c, ...) is no command of ours: its first word must be in NOT_OURS,
  so that a new kind of command in a doc does not go unchecked unnoticed;
- also the indented command lines of the module docstrings of train.py, probe.py, analyze.py and study.py (their --help
  prints them), of benchmarks/*.py and of scripts/*.py.

How a command is checked
- analyze.py and study.py: their own argparse parsers (analyze.build_parser, study.build_parser); study.py's --arms must
  be arms of its --config study file;
- train.py and probe.py: their real entry points (train._cli_main picks fine-tuning's or pretraining's CLI as it does),
  whose LightningCLI stops once the arguments are parsed and --ckpt_path is checked, before any seed or class:
  jsonargparse checks every key, every value's type and every --config file (which must exist);
- torchrun: torch's own parser, then the program it starts; scripts/torchrun_pretrain.sh and scripts/slurm_pretrain.sh:
  the train.py command each ends in (its config and extra arguments), the script's own line checked to be that;
- benchmarks/*.py and scripts/*.py: the argparse parser their main() builds (caught at its parse, before any work);
- make: each target a rule of the Makefile, each VAR=value one of its variables;
- every argument that names a path inside the repository (configs/..., core/corpus/austen.txt, scripts/...) names a
  file that exists.
Placeholders (<encoder>, ARM, `...`) and users' files (hub ids, glove.840B.300d.txt, wic/dev.jsonl, runs/...) pass:
options and value types are checked, not that a user's file exists. A yaml block a doc names (`# callbacks.yaml: ...`)
is written to a temporary directory and stands for that file in the doc's commands; USER_CONFIGS stand for a run's
saved config.yaml.

Links: every relative markdown link and image in README.md and docs/*.md (outside code) names an existing file, and a
#anchor into a .md file (or the page itself) is the GitHub slug of one of its headings.

Options in prose: every `--option` in a backtick span is checked as a name. In a span that opens with a program (a
fragment such as `analyze.py paper --outlier_sentences`, an error message such as `probe.py: error: --data.x ...`): an
option of the program it names last before the option (`analyze.py SUB` for a subcommand, `SUB --x` too). In any other
span: an option of one of the programs its doc names anywhere. A dotted option (--model.x, --data.x, --trainer.x,
--checkpoint.x) is a key of train.py or probe.py (the span's own of the two, when it opens with one; study.py's arms
are train.py settings), and a key under a class_path counts when train.py or probe.py parses it. The options a block
command's comment names are options of that command's program. A command's options are written in full (the entry
points and scripts/ refuse an abbreviation; benchmarks/' parsers would take one). Options of other programs the docs
quote, and forms the docs show refused, are FOREIGN, each with its reason.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import re
import runpy
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CLONE = "/path/to/clone/"  # docs/install.md's stand-in for the clone's directory
REPO_DIRS = ("analyses", "benchmarks", "callbacks", "configs", "core", "data", "datamodules", "docs",
             "lightning_modules", "metrics", "scripts", "tests")  # an argument starting with one of them is our file

NOT_OURS = {  # first words of the commands in the docs that are not the project's programs
    "pip": "installs (docs/install.md)",
    "python -m": "`python -m venv`, `python -m train ...` (the module form of the programs, a table cell)",
    "python -c": "hub downloads and an import, for compute nodes (docs/install.md, docs/benchmarks.md)",
    "python -": "a heredoc's inline Python (docs/finetuning.md writes its example data)",
    ".": "activating a virtual environment",
    "export": "an environment variable",
    "wandb": "W&B's own CLI (wandb sync)",
    "for": "a shell loop: its body's commands are checked",
    "do": "a shell loop's body opening (`do IFS=: read ...`)",
    "done": "a shell loop's end",
}
SHELL_VARIABLES = {"name": "plus1", "reg": "istar", "weight": "1"}  # docs/finetuning.md's loop, its first item
USER_CONFIGS = {  # a run's saved config.yaml (written by train.py): the config that run was started with stands for it
    "runs/pretrain/tiny/config.yaml": "configs/pretrain/tiny.yaml",
}
FOREIGN = {  # --options in the docs that are no option of ours, on purpose
    "--attn_softmax": "Bondarenko et al.'s own code's option, quoted beside ours (docs/pretraining.md)",
    "--attn_gate_type": "Bondarenko et al.'s own code's option, quoted beside ours (docs/pretraining.md)",
    "--attn_gate_init": "Bondarenko et al.'s own code's option, quoted beside ours (docs/pretraining.md)",
    "--encodr": "the misspelt option of an error message's example (docs/errors.md)",
    "--no_such_option": "the unknown option of an error message's example (docs/errors.md)",
    "--trainer.callbacks[0].every_n_steps": "a form jsonargparse refuses, shown as refused (docs/live-statistics.md)",
    "--trainer.callbacks.0.every_n_steps": "a form jsonargparse refuses, shown as refused (docs/live-statistics.md)",
    "--trainer.callbacks[0].init_args.every_n_steps": "the refused form of an error message (docs/errors.md)",
    "--reset_type": "Sun et al.'s massive-activations code's option, quoted beside ours (docs/interventions.md)",
    "--enc": "an abbreviation, shown as refused (docs/errors.md)",
    "--conf": "an abbreviation, shown as refused (docs/errors.md)",
    "--seq": "an abbreviation, shown as refused (docs/errors.md)",
    "--trainer.max_step": "an abbreviation, shown as refused (docs/errors.md)",
    "--trainer.max_epoch": "an abbreviation, shown as refused (docs/errors.md)",
}
PROGRAM = re.compile(r"(?<![\w/.-])(?:python3? )?((?:[\w./-]*/)?(?:analyze|train|probe|study)\.py|posart-(?:analyze|"
                     r"train|probe|study)|(?:benchmarks/|scripts/)?(?:bench_\w+|gpu_\w+|run_all|bigram_backcopy|"
                     r"live_sampling)(?:\.py)?|(?:scripts/)?\w+_pretrain\.sh|torchrun(?= --))(?:[ ]+([a-z][\w-]*))?")
OPTION = re.compile(r"(?<![\w-])--[A-Za-z](?:[\w.\[\]]*[\w\]])?\+?")


# ----------------------------------------------------------------------------------------------- reading the docs


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@functools.cache
def split_doc(path: Path) -> tuple[list[tuple[str, int, list[str]]], list[str]]:
    """The fenced blocks (language, number of their first line, lines) and the prose (code lines blanked)."""
    blocks, prose, block = [], [], None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if block is None and line.lstrip().startswith("```"):
            block = (line.strip()[3:].strip(), number + 1, [])
            prose.append("")
        elif block is not None and line.strip() == "```":
            blocks.append(block)
            block = None
            prose.append("")
        elif block is not None:
            block[2].append(line)
            prose.append("")
        else:
            prose.append(line)
    assert block is None, f"{relative(path)}: a fenced block is not closed"
    return blocks, prose


def paragraphs(path: Path) -> list[tuple[int, str]]:
    """(first line, text) of each paragraph of prose: lines up to a blank line; a table row or a list item starts one."""
    found, lines, first = [], [], 0
    for number, line in enumerate(split_doc(path)[1] + [""], 1):
        starts = line.lstrip().startswith(("|", "- ", "* ", "#"))
        if (not line.strip() or starts) and lines:
            found.append((first, " ".join(lines)))
            lines = []
        if line.strip():
            first = number if not lines else first
            lines.append(line.strip())
    return found


def split_comment(line: str) -> tuple[str, str]:
    """A shell line's code and its comment (a # that starts a word outside quotes)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i], line[i + 1:]
    return line, ""


def shell_words(code: str) -> list[list[str]]:
    """The simple commands of a shell line, each as its words (split at ; & && | ||)."""
    lexer = shlex.shlex(code, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    commands, words = [], []
    for word in lexer:
        if word in (";", "&", "&&", "|", "||"):
            commands.append(words)
            words = []
        else:
            words.append(word)
    return [words for words in [*commands, words] if words]


@dataclass(frozen=True)
class Command:
    where: str  # file:line
    words: tuple[str, ...]
    comment: str = ""
    inline: bool = False

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.words)}"


def shell_commands(name: str, first: int, lines: list[str], launched_only: bool = False) -> list[Command]:
    """The commands of shell lines (`first`: the number of the first); `launched_only`: only the lines that open with a
    launcher (a docstring's indented commands among its prose)."""
    found, i, heredoc = [], 0, None
    while i < len(lines):
        number, text = first + i, lines[i]
        i += 1
        if heredoc is not None:
            heredoc = None if text.strip() == heredoc else heredoc
            continue
        if launched_only and not LAUNCHERS.match(text.strip()):
            continue
        while text.rstrip().endswith("\\") and i < len(lines):
            text = text.rstrip()[:-1] + " " + lines[i]
            i += 1
        code, comment = split_comment(text)
        opened = re.search(r"(?<!<)<<(?!<)-?\s*['\"]?(\w+)", code)
        heredoc = opened.group(1) if opened else None
        found += [Command(f"{name}:{number}", tuple(words), comment) for words in shell_words(code)]
    return found


def block_commands(path: Path) -> list[Command]:
    return [command for language, first, lines in split_doc(path)[0] if language in ("bash", "sh", "shell")
            for command in shell_commands(relative(path), first, lines)]


def docstring_commands() -> list[Command]:
    """The commands the module docstrings of the entry points (what their --help prints), benchmarks and scripts give."""
    import ast

    found = []
    for path in [*(ROOT / name for name in ("analyze.py", "probe.py", "study.py", "train.py")),
                 *sorted((ROOT / "benchmarks").glob("*.py")), *sorted((ROOT / "scripts").glob("*.py"))]:
        module = ast.parse(path.read_text(encoding="utf-8"))
        doc = ast.get_docstring(module, clean=False) or ""
        found += shell_commands(relative(path), module.body[0].lineno, doc.splitlines(), launched_only=True)
    return found


LAUNCHERS = re.compile(r"^(?:\w+=\S+ )*(?:python3? |torchrun |make |posart-\w+ |sbatch |scripts/\w+\.sh )")


def inline_commands(path: Path) -> list[Command]:
    """The commands written as backtick spans in prose (resolve tells a whole command from a mention)."""
    return [Command(f"{relative(path)}:{number}", tuple(words), inline=True)
            for number, text in paragraphs(path) for span in re.findall(r"`([^`]+)`", text) if LAUNCHERS.match(span)
            for words in shell_words(span)]


@functools.cache
def doc_commands() -> tuple[Command, ...]:
    return tuple(command for path in DOCS for command in [*block_commands(path), *inline_commands(path)])


@functools.cache
def named_files(tmp: Path) -> dict[str, str]:
    """The files a doc writes out in a yaml block (`# NAME.yaml: what it is` on its first line), saved under tmp."""
    files = {}
    for path in DOCS:
        for language, _, lines in split_doc(path)[0]:
            named = re.match(r"#\s*([\w.-]+\.ya?ml):", lines[0]) if language == "yaml" and lines else None
            if named:
                yaml.safe_load("\n".join(lines))  # a doc's YAML is YAML
                (tmp / named.group(1)).write_text("\n".join(lines) + "\n", encoding="utf-8")
                files[named.group(1)] = str(tmp / named.group(1))
    return files


# -------------------------------------------------------------------------------------- what a command resolves to


def resolve(words: tuple[str, ...]) -> tuple[str, str, list[str]]:
    """(kind, program, argv): kind "ours" (program: a file of the repository), "make", "mention" (a program named with
    `...` only) or "other" (program: the first word, to be in NOT_OURS)."""
    words = list(words)
    while words and re.fullmatch(r"[A-Za-z_]\w*=\S*", words[0]):  # VAR=value for this command
        words.pop(0)
    head, rest = words[0], words[1:]
    if head in ("python", "python3"):
        if not rest or rest[0].startswith("-"):
            return "other", f"python {rest[0] if rest else ''}".strip(), []
        head, rest = rest[0].replace(CLONE, ""), rest[1:]
    elif head.startswith("posart-"):
        head = head[len("posart-"):] + ".py"
    elif head == "make":
        return "make", "make", rest
    elif head == "torchrun":
        return "ours", "torchrun", rest
    elif head == "sbatch":
        script = next((i for i, word in enumerate(rest) if word.endswith(".sh")), None)  # after sbatch's options
        if script is None:
            return "other", head, []
        head, rest = rest[script], rest[script + 1:]
    if head in ("scripts/torchrun_pretrain.sh", "scripts/slurm_pretrain.sh"):
        return "ours", head, rest
    if head.endswith(".py"):
        return ("mention" if rest and all(word == "..." for word in rest) else "ours"), head, rest
    return "other", head, []


LAUNCHED = {  # the train.py arguments each launcher script gives before the user's (its last line is checked to say so)
    "scripts/torchrun_pretrain.sh": ('train.py fit --config "$CONFIG" \\\n  --trainer.devices "$GPUS" --trainer.num_nodes'
                                     ' "$NNODES" --ckpt_path last "$@"'),
    "scripts/slurm_pretrain.sh": ('train.py fit --config "$CONFIG" \\\n  --trainer.num_nodes "${SLURM_NNODES:-1}" '
                                  '--trainer.devices "$GPUS_PER_NODE" --ckpt_path last "$@"'),
}


def launched(script: str, argv: list[str]) -> list[str]:
    """The train.py arguments of `script CONFIG [GPUS] ARGS...` (torchrun_pretrain.sh takes the GPU count second)."""
    assert LAUNCHED[script] in (ROOT / script).read_text(encoding="utf-8"), f"{script} no longer runs {LAUNCHED[script]}"
    config, rest = argv[0], argv[1:]
    gpus = "4"
    if script.endswith("torchrun_pretrain.sh") and rest and rest[0].isdigit():
        gpus, rest = rest[0], rest[1:]
    return ["fit", "--config", config, "--trainer.num_nodes", "1", "--trainer.devices", gpus, "--ckpt_path", "last",
            *rest]


# ------------------------------------------------------------------------------------------------ the parsers


class Parsed(Exception):
    """Raised where a LightningCLI has parsed and checked its arguments, before it seeds or builds anything."""


PARSERS: dict[type, tuple] = {}


@functools.cache
def parse_only(cli_class: type) -> type:
    """cli_class stopped after parsing (and its --ckpt_path check); its parser built once and kept."""

    class ParseOnly(cli_class):
        def setup_parser(self, add_subcommands, main_kwargs, subparser_kwargs) -> None:
            if cli_class not in PARSERS:
                super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
                PARSERS[cli_class] = (self.parser, getattr(self, "_subcommand_method_arguments", {}))
            self.parser, self._subcommand_method_arguments = PARSERS[cli_class]

        def _set_seed(self) -> None:
            raise Parsed(self.config)

    assert callable(getattr(cli_class, "_set_seed", None)), "LightningCLI no longer seeds in _set_seed: stop elsewhere"
    ParseOnly.__name__ = cli_class.__name__
    return ParseOnly


def outcome(call) -> str | None:
    """None when `call` parses (a Parsed, or exit 0 after --help / --print_config), else what it printed on stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = call()
            code = code if isinstance(code, int) else 0  # an argparse Namespace; train._cli_main's exit status
        except Parsed:
            return None
        except SystemExit as stop:
            code = stop.code
    return None if code in (0, None) else (err.getvalue().strip() or f"exit status {code}")


def run_lightning(program: str, argv: list[str]) -> str | None:
    import probe
    import train

    with mock.patch.object(train, "PretrainCLI", parse_only(train.PretrainCLI)), \
            mock.patch.object(train, "FineTuneCLI", parse_only(train.FineTuneCLI)), \
            mock.patch.object(probe, "ProbeCLI", parse_only(probe.ProbeCLI)):
        if program == "train.py":
            return outcome(lambda: train._cli_main(argv))
        return outcome(lambda: probe.cli_main(argv))


@functools.cache
def analyze_parser() -> argparse.ArgumentParser:
    import analyze

    return analyze.build_parser()


@functools.cache
def script_parser(path: str) -> argparse.ArgumentParser:
    """The argparse parser a benchmark's or script's main() builds, caught when it parses (before any work)."""
    assert parses(path), f"{path}: main() parses no arguments first"

    class Caught(Exception):
        pass

    def catch(self, args=None, namespace=None):
        raise Caught(self)

    sys.path.insert(0, str((ROOT / path).parent))
    try:
        main = runpy.run_path(str(ROOT / path), run_name="doc_commands")["main"]
        with mock.patch.object(argparse.ArgumentParser, "parse_known_args", catch):
            main()
    except Caught as caught:
        return caught.args[0]
    finally:
        sys.path.remove(str((ROOT / path).parent))
    raise AssertionError(f"{path}: main() returned without parsing its arguments")


def parse_argparse(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    return outcome(lambda: parser.parse_args(argv))


def makefile() -> tuple[set[str], set[str]]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([\w.-]+):", text, re.M)) - {".PHONY"}, set(re.findall(r"^(\w+) \??=", text, re.M))


def check_command(command: Command, files: dict[str, str]) -> str | None:
    """What is wrong with a command (None: nothing)."""
    return check_words(command.words, tuple(sorted(files.items())))


@functools.cache
def check_words(words: tuple[str, ...], files: tuple[tuple[str, str], ...]) -> str | None:
    """check_command's answer, once for a command the README and a doc both give."""
    kind, program, argv = resolve(words)
    files = dict(files)
    if kind == "other":
        return None if program in NOT_OURS else f"{program}: not a program of ours, nor in NOT_OURS"
    if kind == "make":
        targets, variables = makefile()
        wrong = [word for word in argv if not (word in targets or word.split("=", 1)[0] in variables)]
        return f"not a Makefile target or variable: {wrong}" if wrong or not argv else None
    if program == "torchrun":
        from torch.distributed.run import get_args_parser

        wrong = parse_argparse(get_args_parser(), argv)  # torch's own: its options, then the program and its arguments
        if wrong:
            return wrong
        parsed = get_args_parser().parse_args(argv)
        return check_words(("python", parsed.training_script, *parsed.training_script_args), tuple(sorted(files.items())))
    if not (ROOT / program).is_file():
        return f"no program {program}"
    if kind == "mention":
        return None
    argv = [re.sub(r"\$\{?(\w+)\}?", lambda m: SHELL_VARIABLES[m.group(1)], word) for word in argv if word != "..."]
    argv = [files.get(word, USER_CONFIGS.get(word, word)).replace(CLONE, "") for word in argv]
    for word in argv:  # files of the repository that a command names exist
        path = word.split("=", 1)[-1]
        if path.split("/", 1)[0] in REPO_DIRS and "/" in path and not (ROOT / path).exists():
            return f"{path} does not exist"
    if program in LAUNCHED:
        wrong = run_lightning("train.py", launched(program, argv))
    elif program in ("train.py", "probe.py"):
        wrong = run_lightning(program, argv)
    elif program == "analyze.py":
        wrong = parse_argparse(analyze_parser(), argv)
    elif program == "study.py":
        wrong = check_study(argv)
    elif program.startswith(("benchmarks/", "scripts/")):
        wrong = parse_argparse(script_parser(program), argv)
    else:
        wrong = f"{program}: no parser known for it"
    if wrong:
        return wrong
    options = program_options(f"analyze.py {argv[0]}" if program == "analyze.py" else program)
    abbreviated = [word for word in argv if word.startswith("--") and word.split("=", 1)[0] not in options
                   and any(option.startswith(word.split("=", 1)[0]) for option in options)]  # refused, or taken
    return f"{abbreviated}: an option's abbreviation, not its name" if abbreviated else None


def check_study(argv: list[str]) -> str | None:
    import study

    config = next((value for flag, value in zip(argv, argv[1:]) if flag == "--config"), None)
    if config is not None and not (ROOT / config).is_file():
        return f"no study file {config}"
    wrong = parse_argparse(study.build_parser(config), argv)
    if wrong:
        return wrong
    if {"-h", "--help"} & set(argv):
        return None
    args = study.build_parser(config).parse_args(argv)
    arms = yaml.safe_load(study.study_file(config).read_text(encoding="utf-8"))["arms"]
    unknown = [arm for arm in args.arms or [] if arm not in arms]
    return f"--arms {unknown}: not arms of {config} ({list(arms)})" if unknown else None


# ------------------------------------------------------------------------------------------- the options of each


def action_options(parser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings if option.startswith("--")}


@functools.cache
def analyze_subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in analyze_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@functools.cache
def lightning_options(program: str) -> frozenset[str]:
    """The options of train.py's `fit` (pretraining's and fine-tuning's parsers) or probe.py's, as their parsers list
    them, and the keys of the model and data classes its configs name under class_path (--model.X and
    --model.init_args.X, as jsonargparse reads the class's signature); any other key: lightning_takes."""
    import importlib

    from jsonargparse import ArgumentParser

    import probe
    import train

    for config in LIGHTNING_CONFIGS[program]:  # the parsers built
        assert run_lightning(program, ["fit", "--config", config]) is None, config
    classes = {"train.py": (train.PretrainCLI, train.FineTuneCLI), "probe.py": (probe.ProbeCLI,)}[program]
    options = set().union(*(action_options(PARSERS[cli][0]._subcommands_action._name_parser_map["fit"])
                            for cli in classes))
    folders = {"train.py": ("pretrain", "finetune"), "probe.py": ("probe",)}[program]
    for config in sorted(path for folder in folders for path in (ROOT / "configs" / folder).glob("*.yaml")):
        for key, node in (yaml.safe_load(config.read_text(encoding="utf-8")) or {}).items():
            if key in ("model", "data") and isinstance(node, dict) and "class_path" in node:
                module, _, name = node["class_path"].rpartition(".")
                parser = ArgumentParser()
                parser.add_class_arguments(getattr(importlib.import_module(module), name), "x")
                names = [action.dest[2:] for action in parser._actions if action.dest.startswith("x.")]
                options |= {f"--{key}.{name}" for name in names} | {f"--{key}.init_args.{name}" for name in names}
    return frozenset(options)


@functools.cache
def program_options(program: str) -> frozenset[str]:
    """The options of a program as the docs name it: `analyze.py SUB`, analyze.py (all subcommands), study.py, train.py,
    probe.py, torchrun, a benchmark or script (by its file name)."""
    import study

    name, _, sub = program.partition(" ")
    name = program_name(name)
    if name == "analyze.py":
        subs = analyze_subparsers()
        chosen = [subs[sub]] if sub in subs else list(subs.values())
        return frozenset(set().union(*map(action_options, chosen)) | action_options(analyze_parser()))
    if name == "study.py":
        return frozenset(action_options(study.build_parser()))
    if name in ("train.py", "probe.py"):
        return lightning_options(name)
    if name.endswith("_pretrain.sh"):  # the launchers: train.py's options, and slurm_pretrain.sh's own #SBATCH ones
        sbatch = re.findall(r"^#SBATCH (--[\w-]+)", (ROOT / "scripts" / name).read_text(encoding="utf-8"), re.M)
        return frozenset(lightning_options("train.py") | set(sbatch))
    if name == "torchrun":
        from torch.distributed.run import get_args_parser

        return frozenset(action_options(get_args_parser()))
    paths = [f"{folder}/{name}" for folder in ("benchmarks", "scripts") if (ROOT / folder / name).is_file()]
    return frozenset(action_options(script_parser(paths[0]))) if paths and parses(paths[0]) else frozenset()


def program_name(name: str) -> str:
    """A program as the docs write it, as a file name: posart-analyze -> analyze.py, bench_x -> bench_x.py."""
    name = re.sub(r"^posart-(\w+)$", r"\1.py", name).rsplit("/", 1)[-1]
    return name if name.endswith((".py", ".sh")) or name == "torchrun" else f"{name}.py"


def parses(path: str) -> bool:
    """Whether a benchmark or script takes options (its main() parses them before any work)."""
    return bool(re.search(r"parse_(?:known_)?args\(|step_timing_options\(", (ROOT / path).read_text(encoding="utf-8")))


def all_programs() -> tuple[str, ...]:
    return ("analyze.py", "study.py", "train.py", "probe.py", "torchrun",
            *(path.name for folder in ("benchmarks", "scripts") for path in sorted((ROOT / folder).glob("*.py"))))


LIGHTNING_GROUPS = ("--model", "--data", "--trainer", "--checkpoint", "--optimizer", "--lr_scheduler")


def option_owners(option: str, programs: tuple[str, ...]) -> tuple[str, ...]:
    """The programs whose options `option` is checked against: the span's own program, or those of its doc (loose)."""
    if option.split(".", 1)[0] in LIGHTNING_GROUPS and "." in option:  # a LightningCLI key
        if len(programs) == 1 and programs[0] in ("train.py", "probe.py", "study.py"):
            return ("train.py",) if programs[0] == "study.py" else programs  # study.py's arms: train.py settings
        return "train.py", "probe.py"
    return programs


def mentions(text: str) -> list[tuple[int, str]]:
    """(position, program) of each program a text names: `analyze.py SUB` for a subcommand of analyze.py, also a span
    opening with `SUB --x`."""
    subs = set(analyze_subparsers())
    found = []
    for match in PROGRAM.finditer(text):
        name = program_name(match.group(1))
        sub = match.group(2) if name == "analyze.py" and match.group(2) in subs else None
        found.append((match.start(), f"{name} {sub}" if sub else name))
    for match in re.finditer(r"(?:^|`)([a-z][\w-]*) --", text):
        if match.group(1) in subs:
            found.append((match.start(), f"analyze.py {match.group(1)}"))
    return sorted(found)


@functools.cache
def doc_programs(path: Path) -> tuple[str, ...]:
    """Every program a doc names, in its prose or its code (analyze.py with all its subcommands)."""
    return tuple(sorted({program.split()[0] if program.startswith("analyze.py") else program
                         for _, program in mentions(path.read_text(encoding="utf-8"))}))


def prose_options(path: Path) -> list[tuple[str, str, tuple[str, ...]]]:
    """(where, option, programs) for each --option in a backtick span of the prose: a span that opens with a program
    (a command, a fragment, an error message) checks its options against that program (the last it names before the
    option); any other span against the programs its doc names."""
    found = []
    for number, text in paragraphs(path):
        for span in re.findall(r"`([^`]+)`", text):
            named = mentions(span)
            opens = bool(named) and re.match(r"(?:\w+=\S+ )*(?:python3? |torchrun )?$", span[:named[0][0]])
            for option in OPTION.finditer(span):
                before = [program for at, program in named if at < option.start()]
                programs = (before[-1],) if opens and before else doc_programs(path)
                found.append((f"{relative(path)}:{number}", option.group(0), programs))
    return found


def comment_options(command: Command) -> list[tuple[str, str, tuple[str, ...]]]:
    """The --options a block command's comment names: options of the command's program (or the one the comment names)."""
    kind, program, argv = resolve(command.words)
    if program in LAUNCHED:
        program = "train.py"
    elif program == "analyze.py" and argv and argv[0] in analyze_subparsers():
        program = f"analyze.py {argv[0]}"
    named = [name for _, name in mentions(command.comment)]
    programs = (named[-1],) if named else (program,) if kind in ("ours", "mention") else ()
    return [(command.where, option, programs) for option in OPTION.findall(command.comment)]


def wrong_option(option: str, programs: tuple[str, ...]) -> str | None:
    """What is wrong with a doc's `option` of one of `programs` (none: any program of ours); None: nothing."""
    if option in FOREIGN:
        return None
    owners = option_owners(option, programs)
    if any(option in program_options(owner) for owner in owners or all_programs()):
        return None
    if any(lightning_takes(owner, option) for owner in (owners or all_programs()) if owner in ("train.py", "probe.py")):
        return None
    return f"{option} is not an option of {' or '.join(owners) or 'any program of ours'}"


LIGHTNING_CONFIGS = {"train.py": ("configs/pretrain/tiny.yaml", "configs/finetune/classify.yaml",
                                  "configs/pretrain/roberta-base.yaml"),
                     "probe.py": ("configs/probe/position.yaml", "configs/probe/classify.yaml")}


@functools.cache
def lightning_takes(program: str, option: str) -> bool:
    """Whether train.py or probe.py takes a key its parser has no action of (a class's argument under class_path:
    --model.X of fine-tuning and the probes, --trainer.logger.init_args.X, ...): parsed with a value after a config
    that sets each kind of class: taken when it parses, or when the error is about its value (`--KEY: expected ...`)."""
    if not re.fullmatch(r"--[\w.]+\+?", option):  # an index (`callbacks[0]`) is no key
        return False
    configs = LIGHTNING_CONFIGS[program]
    if option.startswith("--trainer.strategy."):  # roberta-base.yaml's strategy is a class; tiny.yaml's a name
        configs = configs[::-1]
    for config in configs:
        wrong = run_lightning(program, ["fit", "--config", config, option.rstrip("+"), "1"])
        if wrong is None or wrong.startswith(f"{program}: error: {option.rstrip('+')}: "):
            return True
    return False


# ------------------------------------------------------------------------------------------------ the links


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text as shown (no markup), lower case, punctuation dropped, spaces as -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"[`*]", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in split_doc(path)[1]:
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = slug(heading.group(1))
            found.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return frozenset(found)


def doc_links() -> list[tuple[str, Path, str, str]]:
    """(where, the doc, target, anchor) of each relative link or image in the prose."""
    found = []
    for path in DOCS:
        for number, line in enumerate(split_doc(path)[1], 1):
            line = re.sub(r"`[^`]*`", "", line)  # code spans hold no links
            for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", line):
                if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                    continue
                file, _, anchor = target.partition("#")
                found.append((f"{relative(path)}:{number}", path, file, anchor))
    return found


# ------------------------------------------------------------------------------------------------ the tests


def command_id(command: Command) -> str:
    return f"{command.where} {' '.join(command.words[:3])}"


OURS = [command for command in doc_commands() if resolve(command.words)[0] != "other"]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    return named_files(tmp_path_factory.mktemp("doc_files"))


@pytest.fixture(autouse=True)
def in_the_clone(monkeypatch):
    monkeypatch.chdir(ROOT)  # the docs' relative paths are the clone's


@pytest.mark.parametrize("command", OURS, ids=command_id)
def test_every_doc_command_parses(command, files):
    assert check_command(command, files) is None, f"{command}\n{check_command(command, files)}"


def test_the_docs_commands_are_all_found_and_every_other_is_known():
    """The extraction finds what the docs hold (the README's, the inline ones, continued lines joined) and every command
    that is not ours is one NOT_OURS lists."""
    commands = doc_commands()
    others = {resolve(command.words)[1] for command in commands if resolve(command.words)[0] == "other"}
    assert others == set(NOT_OURS)  # every command of another program is one the list knows, and the list is not stale
    text = " ".join(word for command in OURS for word in command.words)
    assert all(f"${name}" in text for name in SHELL_VARIABLES) and all(path in text for path in USER_CONFIGS)
    readme = [command for command in commands if command.where.startswith("README.md") and not command.inline]
    assert readme[0].words == ("make", "demo") and len(readme) >= 30
    joined = next(c for c in readme if c.words[:2] == ("python", "probe.py") and "--data.classes" in c.words)
    assert joined.words[-2:] == ("--trainer.default_root_dir", "runs/reviews")  # a continued line, one command
    kinds = {resolve(command.words)[1] for command in OURS}
    assert {"analyze.py", "train.py", "probe.py", "study.py", "scripts/torchrun_pretrain.sh", "benchmarks/run_all.py",
            "scripts/bigram_backcopy.py"} <= kinds
    assert any(command.inline for command in OURS) and len(OURS) >= 100


def test_every_command_the_docstrings_give_parses(files):
    """The commands of the entry points' docstrings (train.py / probe.py --help print them; analyze.py / study.py's
    --help their opening), and of the benchmarks' and scripts' docstrings, checked the same way."""
    commands = docstring_commands()
    ours = [command for command in commands if resolve(command.words)[0] != "other"]
    assert len(ours) >= 80 and {resolve(command.words)[1] for command in ours} >= {"analyze.py", "train.py",
                                                                                    "probe.py", "study.py"}
    wrong = [f"{command}\n  {message}" for command in ours for message in [check_command(command, files)] if message]
    assert wrong == []


def test_a_removed_or_misspelt_option_fails(files):
    """The check is not a yes-man: the same commands with an option that does not exist, a value of the wrong type, a
    missing config, an unknown arm or target fail."""
    wrong = [("python", "analyze.py", "outliers", "--max_sentencs", "10"),
             ("python", "analyze.py", "isotropy", "--normalize", "whitening"),
             ("python", "train.py", "fit", "--config", "configs/pretrain/tiny.yaml", "--model.positon_embeddings",
              "false"),
             ("python", "train.py", "fit", "--config", "configs/pretrain/tiny.yaml", "--model.position_embedding",
              "false"),  # an abbreviation: train.py refuses it, a doc must not write it
             ("python", "train.py", "fit", "--config", "configs/pretrain/tiny.yaml", "--trainer.max_steps", "many"),
             ("python", "train.py", "fit", "--config", "configs/pretrain/tony.yaml"),
             ("python", "train.py", "fit", "--config", "configs/finetune/sst2.yaml", "--model.reg_wieght", "1"),
             ("python", "probe.py", "fit", "--config", "configs/probe/position.yaml", "--data.max_length", "long"),
             ("python", "probe.py", "fit", "--config", "configs/probe/classify.yaml", "--model.encodr", "x"),
             ("python", "study.py", "--config", "configs/study/study.yaml", "--arms", "baseline", "no-pe"),
             ("scripts/torchrun_pretrain.sh", "configs/pretrain/roberta-base.yaml", "8", "--data.batchsize", "8"),
             ("python", "benchmarks/run_all.py", "--smok"),
             ("torchrun", "--nproc_per_node", "2", "analyze.py", "trajectory", "--runs", "x"),
             ("make", "studies")]
    for words in wrong:
        assert check_command(Command("mutation", words), files), words
    right = [("python", "train.py", "fit", "--config", "configs/pretrain/tiny.yaml", "--model.position_embeddings",
              "false"), ("python", "probe.py", "fit", "--config", "configs/probe/classify.yaml", "--model.encoder", "x")]
    for words in right:
        assert check_command(Command("control", words), files) is None, words


def test_every_option_the_prose_names_is_an_option_of_its_program():
    found = [item for path in DOCS for item in prose_options(path)]
    found += [item for command in doc_commands() if not command.inline for item in comment_options(command)]
    assert len(found) > 300
    wrong = [f"{where}: {message}" for where, option, program in found
             for message in [wrong_option(option, program)] if message]
    assert wrong == []
    assert set(FOREIGN) <= {option for _, option, _ in found}, set(FOREIGN) - {option for _, option, _ in found}


def test_the_option_check_catches_a_removed_option():
    assert wrong_option("--max_sentence", ("analyze.py outliers",))  # an abbreviation (analyze.py refuses it)
    assert wrong_option("--interventions", ("analyze.py outliers",))  # intervene's, not outliers'
    assert wrong_option("--model.reg_wieght", ("train.py",)) and wrong_option("--data.sourc", ())
    assert wrong_option("--model.encoder", ("train.py", "probe.py")) is None
    assert wrong_option("--data.max_positions", ("train.py",))  # the position probe's, not train.py's
    assert wrong_option("--gpu_onl", ("bench_train.py",)) and wrong_option("--no_such", ())
    assert wrong_option("--interventions", ("analyze.py intervene",)) is None
    assert wrong_option("--data.val_split", ("probe.py",)) is None  # a key of the probes' data module (class_path)
    assert wrong_option("--model.regularizer", ("study.py",)) is None  # an arm's train.py setting
    assert wrong_option("--trainer.logger.init_args.nam", ("train.py",))
    assert wrong_option("--trainer.logger.init_args.name", ("train.py",)) is None


def test_every_relative_link_and_anchor_exists():
    links = doc_links()
    assert len(links) > 80
    wrong = []
    for where, doc, file, anchor in links:
        target = (doc.parent / file).resolve() if file else doc
        if not target.exists():
            wrong.append(f"{where}: {file} does not exist")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            wrong.append(f"{where}: no heading #{anchor} in {relative(target)}")
    assert wrong == []


def test_slug_is_githubs():
    """GitHub's anchors of headings in these docs, as GitHub shows them (markup and punctuation dropped)."""
    assert slug("The paper's protocol, step by step") == "the-papers-protocol-step-by-step"
    assert slug("`analyze.py`: outliers and evaluations of a frozen encoder") == \
        "analyzepy-outliers-and-evaluations-of-a-frozen-encoder"
    assert slug("The verdicts (study.json's `arms[].verdict`, step 1500, margin 0.5)") == \
        "the-verdicts-studyjsons-armsverdict-step-1500-margin-05"
    assert slug("Worked example: λ ∈ {−1, 0, +1}") == "worked-example-λ--1-0-1"
    assert slug("`lightning_modules/`") == "lightning_modules"
