"""The outlier-causes study (docs/study.md): baseline (PE), no PE, clipped softmax and gated attention, each trained
with every seed on one small recipe, then every checkpoint of every run analysed on the same sentences, against a
null (the same run at step 0, Gaussian vectors), with a verdict per arm over the seeds.

    python study.py --config configs/study/study.yaml --output_dir runs/study                 # make study
    python study.py --config configs/study/study.yaml --seeds 0 --arms baseline nope --max_steps 200 --output_dir runs/quick
    python study.py --config configs/study/study.yaml --output_dir runs/study                 # again: finished runs
                                                                                              # skipped, others resumed
Writes <output_dir>/<arm>/seed<k>/ (train.py's run: checkpoints, export), <output_dir>/study.json and study.png.
Errors in the input are one line on stderr and exit status 2, with nothing written.
"""

from __future__ import annotations

import sys

import analyze
from core.arguments import HelpFormatter, OneLineArgumentParser
from core.errors import UserError, exit_with, plain_warnings


def build_parser() -> OneLineArgumentParser:
    parser = OneLineArgumentParser(prog="study.py", description="\n\n".join(__doc__.split("\n\n")[:2]),
                                   formatter_class=HelpFormatter)
    parser.add_argument("--config", default="configs/study/study.yaml", help="the study file: its arms, seeds, recipe "
                        "and comparison options")
    parser.add_argument("--output_dir", default="runs/study", help="one run directory per arm and seed "
                        "(<arm>/seed<k>), study.json, study.png")
    parser.add_argument("--arms", nargs="+", default=None, help="a subset of the study's arms, in this order "
                        "(default: all of them)")
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
    args = build_parser().parse_args(argv)
    try:
        from analyses.study import run_study  # imported after parsing: --help imports no torch

        run_study(args.config, args.output_dir, parse_trajectory, args.arms, args.max_steps, args.seeds)
    except UserError as error:
        print(f"study.py: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    exit_with(main)
