"""The outlier-causes study (docs/study.md): the study file's arms (below: each changes a few train.py settings of one
recipe), each trained with every seed, then every checkpoint of every run analysed on the same sentences, against a
null (the same run at step 0, Gaussian vectors), with a verdict per arm over the seeds.

    python study.py --config configs/study/study.yaml --output_dir runs/study                 # make study
    python study.py --config configs/study/study.yaml --seeds 0 --arms baseline nope --max_steps 200 --output_dir runs/quick
    python study.py --config configs/study/study.yaml --output_dir runs/study                 # again: finished runs
                                                                                              # skipped, others resumed
Writes <output_dir>/<arm>/seed<k>/ (train.py's run: checkpoints, export), <output_dir>/study.json and study.png.
Errors in the input are one line on stderr and exit status 2, with nothing written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import analyze
from analyses.study import arms_help
from core.arguments import HelpFormatter, OneLineArgumentParser
from core.errors import UserError, exit_with, plain_warnings
from core.signals import STOPS, Interrupted, first_process, stop_on_signals

DEFAULT_STUDY = "configs/study/study.yaml"


def study_file(config: str | None) -> Path:
    """The study file: --config as given; else configs/study/study.yaml in the working directory, else the clone's
    beside this program (`python /path/to/clone/study.py` run from elsewhere). A pip install ships no configs/
    (docs/install.md): there the default names a file that is not there, and main says so in one line."""
    if config is not None:
        return Path(config)
    return Path(DEFAULT_STUDY) if Path(DEFAULT_STUDY).is_file() else Path(__file__).resolve().parent / DEFAULT_STUDY


def build_parser(config: str | None = None) -> OneLineArgumentParser:
    """study.py's parser; its help lists the arms of `config` (default: the default study file), read from it."""
    path = study_file(config)
    parser = OneLineArgumentParser(prog="study.py", description="\n\n".join(__doc__.split("\n\n")[:2]),
                                   epilog=f"arms of {config or DEFAULT_STUDY} (train.py settings each changes):\n"
                                          f"{arms_help(path)}",
                                   formatter_class=HelpFormatter)
    parser.add_argument("--config", default=None, help="the study file: its arms, seeds, recipe and comparison "
                        f"options (default: {DEFAULT_STUDY} in the working directory, else the clone's beside "
                        "study.py)")
    parser.add_argument("--output_dir", default="runs/study", help="one run directory per arm and seed "
                        "(<arm>/seed<k>), study.json, study.png")
    parser.add_argument("--arms", nargs="+", default=None, help="a subset of the study's arms (below), in this "
                        "order (default: all of them)")
    parser.add_argument("--seeds", nargs="+", type=int, default=None,
                        help="train every arm with each of these seeds (default: the study file's `seeds`, else 0)")
    parser.add_argument("--max_steps", type=int, default=None,
                        help="train every arm this many steps instead of the config's (a quick look; the learning-"
                             "rate schedule follows it; default: the config's)")
    return parser


def parse_trajectory(argv: list[str]):
    """analyze.py trajectory's own parser and checks, for the study's comparison options."""
    args = analyze.build_parser().parse_args(argv)
    analyze.validate(args)
    return args


def main(argv: list[str] | None = None) -> int:
    plain_warnings()
    peek = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # the study file first: --help lists its arms
    peek.add_argument("--config", default=None)
    args = build_parser(peek.parse_known_args(argv)[0].config).parse_args(argv)
    try:
        with stop_on_signals(*STOPS):  # Ctrl-C, SIGTERM: one line, status 130 / 143 (an arm's SIGTERM: its last.ckpt)
            config = study_file(args.config)
            if args.config is None and not config.is_file():
                raise UserError(f"no --config given, and no {DEFAULT_STUDY} in the working directory or beside "
                                "study.py (a pip install ships no configs/: pass --config, e.g. a clone's "
                                "configs/study/study.yaml)")
            from analyses.study import run_study  # imported after parsing: --help imports no torch

            run_study(config, args.output_dir, parse_trajectory, args.arms, args.max_steps, args.seeds)
    except UserError as error:
        print(f"study.py: error: {error}", file=sys.stderr)
        return 2
    except Interrupted as stop:
        if first_process():
            print(f"study.py: {stop}{stop.detail} (exit status {stop.status}); rerun the same command to go on: "
                  "finished arms are skipped, a stopped one resumes from its last checkpoint", file=sys.stderr)
        return stop.status
    return 0


def console() -> None:
    """posart-study (setup.cfg's console script): ends as `python study.py` does."""
    exit_with(main)


if __name__ == "__main__":
    console()
