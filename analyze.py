"""Analyses of a frozen encoder: outlier neurons, clipping, and the geometry and semantic evaluations.

    python analyze.py outliers                                   # packaged MiniLM on the bundled corpus
    python analyze.py outliers --encoder bert-base-uncased --data core/corpus/austen.txt --output_dir runs/bert
    python analyze.py anisotropy --encoder roberta-base          # random token pairs, raw vs clipped, per layer
    python analyze.py self-similarity --clip 5,17                # Ethayarajh's self- and intra-sentence similarity
    python analyze.py isotropy --normalize whiten                # IsoScore, IsoScore*, singular-value spectrum
    python analyze.py isotropy --normalize softdecay             # tokenUni's SoftDecay beside raw and clipped
    python analyze.py wic --data wic/dev.jsonl                   # SuperGLUE WiC (or super_glue/wic, WiC .data.txt)
    python analyze.py sts --data stsb --static glove.840B.300d.txt   # STS-B, SICK-R, STS12-16, csv/tsv/jsonl
    python analyze.py all --wic wic/dev.jsonl --sts stsb sickr   # everything for one encoder + summary.md/json
    python analyze.py paper --encoder roberta-base               # the paper's §3-4 in one command -> paper.md
    python analyze.py trajectory --run runs/pretrain/tiny        # every checkpoint of a run, in step order
    python analyze.py trajectory --run pe=runs/a --run nope=runs/b   # several runs in one figure and one JSON
    python analyze.py intervene --interventions position_mean layernorm_zero --probe   # inside the forward pass
    python analyze.py compare runs/a/outliers.json runs/b/outliers.json   # outlier reports side by side
    torchrun --nproc_per_node 4 analyze.py all ...               # items sharded over ranks, rank 0 writes

Every evaluation reports raw values beside clipped ones (`--clip auto`, the default, zeroes the persistent outlier
dimensions detected on the same data in every non-input layer for models of at most 12 layers, as the paper's §4 clips
its base models, and each layer's own outliers in that layer for deeper ones, as its Appendix D its large ones: the
12-layer threshold is ours; `--clip per-layer` the latter at any depth; `--clip none`; given dimensions `--clip 5,17`;
or `--clip 1-10:896,10-17:678`) and, with `--normalize whiten`, `standardize` or `softdecay`, beside a post-hoc
normalisation. The runs live in analyses/ (runs.py,
outliers.py), the protocols in analyses/geometry.py and analyses/semantic.py, the tables, figures and summary in
analyses/reports.py. Dimensions and layers are 0-indexed; layer 0 is the
embedding output. Errors in the input are one line on stderr and exit status 2, with nothing written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from analyses.options import (
    INTERVENE_HELP,
    add_intervene_arguments,
    add_magnitude_arguments,
    check_magnitude_arguments,
)
from core.arguments import HelpFormatter, OneLineArgumentParser, load_runner
from core.defaults import (
    DEFAULT_CORPUS,
    DTYPES,
    FEATURE_MEMORY_GB,
    MAX_SENTENCES,
    NORMALIZATIONS,
    NUM_PAIRS,
    OUTLIER_MIN_SHARE,
    PAPER_OUTLIER_SENTENCES,
    SOFTDECAY_ALPHA,
    STS_PRESETS,
    STS_SETS,
)
from core.errors import UserError, exit_with, plain_warnings
from core.signals import STOPS, Interrupted, first_process, stop_on_signals

# Nothing above imports torch: `--help` answers at once. A subcommand's runner is named "package.module:function" and
# imported after the arguments are parsed (load_runner), as is everything `validate` needs.

PAPER_SECTION3 = (f"the paper's §3 sample is {PAPER_OUTLIER_SENTENCES:,} sentences of each of SST-2's and QQP's "
                  "training sets, which `analyze.py paper --outlier_sentences` draws")
# each subcommand's --max_sentences: its default and whose it is (the paper's sample, or ours)
SAMPLES = {
    "outliers": (MAX_SENTENCES, f"ours; {PAPER_SECTION3}"),
    "anisotropy": (MAX_SENTENCES, "the paper's §4.1 sample, one random token from each of 2 x --num_pairs of them"),
    "isotropy": (MAX_SENTENCES, "ours (the anisotropy's sample size; the paper has no isotropy scores)"),
    "self-similarity": (0, "every sentence, the paper's, which draws its words from the whole SST-2 training set; N: "
                           "the words of a seeded sample of N sentences"),
    "all": (MAX_SENTENCES, f"the paper's §4.1 anisotropy sample; ours for the outliers, as {PAPER_SECTION3}"),
    "trajectory": (MAX_SENTENCES, "ours (the same sentences at every checkpoint)"),
    "intervene": (MAX_SENTENCES, "ours"),
}

def add_common_arguments(parser: argparse.ArgumentParser, output: str, data: str | None = str(DEFAULT_CORPUS),
                         encoder: bool = True, sample: tuple[int, str] = (MAX_SENTENCES, "ours")) -> None:
    """The options every subcommand shares; `sample`: --max_sentences' default and whose it is (the paper's, ours)."""
    if encoder:
        parser.add_argument("--encoder", default=None,
                            help="hub id (org/name@REVISION pins a commit, tag or branch), local model directory, or "
                                 "this project's export (default: packaged MiniLM)")
    if data is not False:
        parser.add_argument("--data", default=data, required=data is None,
                            help="txt (a sentence a line), csv/tsv/jsonl with a text column, a datasets directory, "
                                 "or a datasets NAME[:CONFIG][:SPLIT] (default: the bundled corpus, ours, offline; "
                                 "`analyze.py paper` reads the paper's SST-2 and QQP)" if data else
                            "the pairs: a file, a datasets directory or NAME[:CONFIG][:SPLIT] (formats: "
                            "docs/analyses.md)")
    parser.add_argument("--output_dir", default=f"runs/analyze/{output}",
                        help="where the report, figures and summary go (written whole, or not at all)")
    if data is not None:  # pair data (wic, sts) is read whole, in the columns of its format: no sample, no column
        parser.add_argument("--text_column", default=None, help="column holding the text (default: auto-detected)")
    parser.add_argument("--max_length", type=int, default=None, help="tokens per sentence, longer ones truncated and "
                        "counted (default: the model's maximum; ours)")
    if data is not None:
        max_sentences, whose = sample
        parser.add_argument("--max_sentences", type=int, default=max_sentences,
                            help=f"random sample of this many sentences of --data, by --seed (0: all; default "
                                 f"{max_sentences}: {whose})")
    parser.add_argument("--batch_size", type=int, default=32, help="sentences per forward pass")
    parser.add_argument("--seed", type=int, default=0, help="the one seed of the run: sentence sample, random tokens "
                        "and pairs, mini-batches (recorded in the report)")
    parser.add_argument("--exclude_special", action="store_true", help="do not count special tokens ([CLS], <s>, ...) "
                        "(default: they count, padding never does; ours)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: CUDA when available)")
    parser.add_argument("--dtype", choices=DTYPES, default=DTYPES[0],
                        help="the precision the encoder computes in, on every device: float32, transformers' own "
                             "default; bfloat16 / float16 halve a GPU's memory, and their hidden states differ from "
                             "float32's by rounding (outlier shares by tenths of a percent; recorded in the report)")
    parser.add_argument("--no_progress", action="store_true", help="no progress bar")
    parser.add_argument("--allow_random_weights", action="store_true",
                        help="analyse an encoder whose checkpoint lacks some of its weights (or holds them in another "
                             "shape), which are then randomly initialised (default: refused)")


def add_rule_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--min_share", type=float, default=OUTLIER_MIN_SHARE,
                        help="share of the token vectors whose max or min a dimension must hold to be an outlier "
                             "(default 0.2: ours, for the paper's 'most vectors'); the report's chance_bound (ours) "
                             "bounds how often chance alone flags a dim on that many tokens, and warns above 0.01")
    parser.add_argument("--sigma", type=float, default=None,
                        help="opt-in, ours: also an outlier when the robust z-score of the dimension's mean exceeds "
                             "this (default: off)")


def add_variant_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clip", default="auto",
                        help="auto (default: the paper's two clippings told apart by depth, a threshold of ours: the "
                             "persistent outlier dims, detected on the same data, zeroed in every non-input layer for "
                             "models of at most 12 layers; each layer's own outliers in that layer for deeper ones), "
                             "per-layer (the latter at any "
                             "depth), none, dims "
                             "(557 or 77,588: every non-input layer), or layers:dims (1-10:896,10-17:678); 0-indexed")
    parser.add_argument("--normalize", choices=NORMALIZATIONS, default="none",
                        help="also report whitened (Su et al. 2021) or standardised (Timkey & van Schijndel 2021) "
                             "vectors, estimated on the token vectors of the same data (sts: on the mean-pooled "
                             "sentence embeddings of the pairs), or tokenUni's SoftDecay (Yan et al. 2022) of each "
                             "sentence's token matrix at every layer, post hoc at a fixed alpha (ours: tokenUni learn "
                             "it inside the last layer)")
    parser.add_argument("--softdecay_alpha", type=float, default=SOFTDECAY_ALPHA,
                        help=f"SoftDecay's alpha, in (-1, 0) (default {SOFTDECAY_ALPHA})")
    add_rule_arguments(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="analyze.py", description="\n\n".join(__doc__.split("\n\n")[:2]),
                                   formatter_class=HelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, run: str, help: str, output: str, data: str | None = str(DEFAULT_CORPUS),
                variants: bool = True, encoder: bool = True) -> argparse.ArgumentParser:
        """A subcommand with the common options; `run`: its runner, "package.module:function" (imported after
        parsing), called as run(args, rank, world)."""
        sub = commands.add_parser(name, help=help, description=help, formatter_class=HelpFormatter)
        add_common_arguments(sub, output, data, encoder, SAMPLES.get(name, (MAX_SENTENCES, "ours")))
        add_variant_arguments(sub) if variants else add_rule_arguments(sub)
        sub.set_defaults(run=run, ranks=True)
        return sub

    outliers = command("outliers", "analyses.outliers:run_outliers", "outlier dimensions per layer and their origins",
                       "outliers", variants=False)
    outliers.add_argument("--token_frequency", action="store_true",
                          help="opt-in, ours (Puccetti et al. 2022): Spearman between each token type's frequency in "
                               "the data and the mean |value| of each outlier dim over its tokens (a second pass)")
    add_magnitude_arguments(outliers)
    anisotropy = command("anisotropy", "analyses.runs:run_anisotropy", "mean cosine of random token pairs per layer "
                         f"({MAX_SENTENCES} sentences -> {NUM_PAIRS} pairs), raw and clipped", "anisotropy")
    isotropy = command("isotropy", "analyses.runs:run_isotropy", "IsoScore, IsoScore* and the singular-value spectrum "
                       "per layer", "isotropy")
    selfsim = command("self-similarity", "analyses.runs:run_self_similarity", "self-similarity of words in different "
                      "contexts and intra-sentence similarity of the sentences encoded (both Ethayarajh 2019's), raw "
                      f"and adjusted by the anisotropy of {2 * NUM_PAIRS} random sentences of --data", "self_similarity")
    wic = command("wic", "analyses.runs:run_wic", "Word-in-Context: cosine of the target word's vectors against a "
                  "threshold", "wic", data=None)
    wic.add_argument("--gold", default=None, help="gold file of an original WiC .data.txt (default: beside it)")
    sts = command("sts", "analyses.runs:run_sts", "STS: Spearman of mean-pooled cosine against gold scores", "sts",
                  data=None)
    sts.add_argument("--gold", default=None, help="gold file of a SentEval STS.input.*.txt (default: STS.gs.*)")
    everything = command("all", "analyses.runs:run_all", "the outlier report and every evaluation, with "
                         "summary.md/json", "all")
    everything.add_argument("--wic", default=None, help="WiC data (as for `wic --data`); skipped when not given")
    everything.add_argument("--sts", nargs="+", default=None,
                            help=f"STS data sets (files or presets {', '.join(STS_PRESETS)}); skipped when not given")
    everything.add_argument("--pool_sentences", type=int, default=0, help="sentences searched for the "
                            "self-similarity words (default 0: all of --data, streamed; N: a seeded sample of N)")
    paper = command("paper", "analyses.paper:run_paper", "the paper's experiments on one encoder (§3 outliers, "
                    "origins, position probe; §4 anisotropy, self-similarity, WiC, STS, classifiers; raw and clipped) "
                    "-> paper.md", "paper", data=False)
    for option, default, what in (("--sst2", "glue/sst2", "SST-2 (outliers, anisotropy, self-similarity, the position "
                                   "probe on its splits, a classifier)"),
                                  ("--qqp", "glue/qqp", "QQP sentences (anisotropy, self-similarity)"),
                                  ("--wic", "wic", "WiC pairs (Table 1; the preset wic: super_glue:wic:train, the paper's)"),
                                  ("--imdb", "imdb", "IMDB (a classifier)"), ("--sst5", "SetFit/sst5", "SST-5")):
        paper.add_argument(option, default=default, help=f"{what}: a datasets name, a local file or directory, or "
                           f"none (default {default})")
    for action in paper._actions:  # the common --text_column is SST-2's here: QQP has its own, the rest detect theirs
        if action.dest == "text_column":
            action.help = ("--sst2's text column, for §3, §4.1 and its position probe and classifier (default: "
                           "auto-detected, SST-2's sentence; QQP's is --qqp_column)")
        if action.dest == "max_sentences":  # §4.1's sample only: §3's is --outlier_sentences
            action.help = (f"§4.1's anisotropy sample: a random sample of this many sentences of each of --sst2 and "
                           f"--qqp, by --seed (0: all; default {MAX_SENTENCES}, the paper's); §3's outliers are "
                           "--outlier_sentences")
    paper.add_argument("--qqp_column", default="question1", help="QQP's text column (default question1)")
    paper.add_argument("--outlier_sentences", type=int, default=PAPER_OUTLIER_SENTENCES, help="§3's sentences for the "
                       "outliers: a seeded sample of this many from each of --sst2 and --qqp, together (default "
                       f"{PAPER_OUTLIER_SENTENCES} each, the paper's {PAPER_OUTLIER_SENTENCES:,} of both); a set with "
                       "fewer is used whole, and paper.md says how many were used")
    paper.add_argument("--sts", nargs="*", default=list(STS_SETS), help="STS sets (presets or files; none alone or "
                       "no value: skipped, as --sst2 none; default the seven of Table 2: " + " ".join(STS_SETS) + ")")
    paper.add_argument("--probe_sentences", type=int, default=0, help="a seeded sample of this many sentences per "
                       "split for the probes (0: all)")
    paper.add_argument("--epochs", type=int, default=10, help="probe and classifier epochs (the paper: 10)")
    paper.add_argument("--pool_sentences", type=int, default=0, help="sentences searched for the self-similarity "
                       "words (default 0: the whole of --sst2 / --qqp, streamed, as the paper; N: a seeded sample)")
    trajectory = command("trajectory", "analyses.trajectory:run_trajectory", "outlier statistics, anisotropy and "
                         "IsoScore* of every checkpoint of a run, in step order, on the same sentences", "trajectory",
                         variants=False, encoder=False)
    sources = trajectory.add_mutually_exclusive_group(required=True)
    sources.add_argument("--run", "--run_dir", dest="run_dir", metavar="[LABEL=]RUN_DIR", action="append", default=None,
                         help="a train.py run directory: every checkpoint in its checkpoints/; given several times, "
                              "the runs are drawn together (each labelled LABEL= or by its directory's name); under "
                              "torchrun write --run_dir (torchrun's own parser takes --run for its --run-path)")
    sources.add_argument("--encoders", nargs="+", default=None,
                         help="encoders (checkpoints, directories, hub ids) of one architecture, analysed by step (a "
                              "checkpoint's, or step_20k / step=100 in its name or a hub id's revision: "
                              "org/name@step3000); without steps, in the order given")
    add_magnitude_arguments(trajectory)
    intervene = command("intervene", "analyses.intervene:run_intervene", INTERVENE_HELP, "intervene", variants=False)
    add_intervene_arguments(intervene)
    for sub, whose in ((paper, "the probes' and classifiers'"), (intervene, "--probe's")):
        sub.add_argument("--max_memory_gb", type=float, default=FEATURE_MEMORY_GB, help=f"{whose} cached features: "
                         "float32 within this many GiB, else float16, and what does not fit streams from a "
                         f"memory-mapped file (default {FEATURE_MEMORY_GB:g}, as probe.py's)")
    for sub in (sts, everything, paper):
        sub.add_argument("--score_range", default="0,5", help="declared range of the gold scores LO,HI (default 0,5: "
                         "STS-B, STS12-16; SICK-R is 1-5)")
        sub.add_argument("--static", default=None, help="GloVe-format text file: a static-vector STS baseline (the "
                         "mean of the sentence's word vectors, each word looked up as written, case included: SentEval's "
                         "bag-of-words GloVe baseline; GloVe 840B is cased)")
        sub.add_argument("--static_lowercase", action="store_true", help="ours, not SentEval's: look the --static "
                         "words up lowercased, each file word lowercased and its first case variant kept (default: off, "
                         "as written)")
    for sub in (selfsim, everything, paper):
        sub.add_argument("--num_words", type=int, default=1000, help="words sampled for self-similarity (default "
                         "1000, the paper's §4.1: 1,000 words that occur in at least 10 sentences)")
        sub.add_argument("--min_sentences", type=int, default=10,
                         help="sentences a word must occur in (default 10, the paper's §4.1); also the contexts used "
                              "per word, exactly this many (ours: the paper's words occur in at least 10)")
    pairs = (f"token pairs: one random token from each of 2 x this many random sentences (default {NUM_PAIRS}, the "
             "paper's; self-similarity: its anisotropy baseline, 2 x this many sentences of --data)")
    for sub in (anisotropy, isotropy, selfsim, everything, paper, trajectory):
        sub.add_argument("--num_pairs", type=int, default=NUM_PAIRS, help=pairs if sub is not paper else (
            "§4.1's token pairs: one random token from each of 2 x this many of the --max_sentences sentences of each "
            f"of --sst2 and --qqp, paired (default {NUM_PAIRS}, the paper's); each set's anisotropy is also the "
            "baseline of its self-similarity"))
    for sub in (isotropy, everything, trajectory):
        sub.add_argument("--zeta", type=float, default=0.2, help="IsoScore* shrinkage towards the full covariance")
        sub.add_argument("--minibatch", type=int, default=250, help="tokens per IsoScore* mini-batch")
        sub.add_argument("--minibatches", type=int, default=4, help="IsoScore* mini-batches (averaged)")
    compare = commands.add_parser("compare", help="outliers.json reports side by side, layer by layer",
                                  description="outliers.json reports of `analyze.py outliers` side by side, layer by "
                                              "layer, each with its own layers and name (reads JSON only)",
                                  formatter_class=HelpFormatter)
    compare.add_argument("reports", nargs="+", metavar="[NAME=]OUTLIERS_JSON",
                         help="reports of `analyze.py outliers`, any number; NAME= labels a column (default: the "
                              "encoder's name)")
    compare.set_defaults(run="analyses.compare:run_compare", ranks=False)
    return parser


def parse_range(text: str) -> tuple[float, float]:
    try:
        low, high = (float(part) for part in text.split(","))
    except ValueError:
        raise UserError(f"--score_range must be LO,HI, got {text!r}") from None
    if not low < high:
        raise UserError(f"--score_range {text}: LO must be below HI")
    return low, high


def validate(args) -> None:
    for name in ("batch_size", "max_sentences", "max_length", "num_words", "min_sentences", "minibatch",
                 "minibatches", "pool_sentences", "num_pairs", "probe_sentences", "epochs", "outlier_sentences"):
        value = getattr(args, name, None)
        if value is not None and value < (0 if name in ("max_sentences", "pool_sentences", "probe_sentences") else 1):
            raise UserError(f"--{name} must be positive, got {value}")
    if getattr(args, "min_sentences", 2) < 2:
        raise UserError(f"--min_sentences must be at least 2, got {args.min_sentences}")
    if getattr(args, "minibatch", 2) < 2:
        raise UserError(f"--minibatch must be at least 2 (a mini-batch's covariance needs 2 tokens), "
                        f"got {args.minibatch}")
    if getattr(args, "max_memory_gb", 1) <= 0:
        raise UserError(f"--max_memory_gb must be positive, got {args.max_memory_gb}")
    if not 0 <= getattr(args, "zeta", 0) <= 1:
        raise UserError(f"--zeta must lie in [0, 1], got {args.zeta}")
    if getattr(args, "sigma", None) is not None and args.sigma <= 0:
        raise UserError(f"--sigma must be positive, got {args.sigma}")
    if not 0 < getattr(args, "min_share", OUTLIER_MIN_SHARE) <= 1:
        raise UserError(f"--min_share must lie in (0, 1], got {args.min_share}")
    if getattr(args, "normalize", "none") == "softdecay":
        from metrics.transforms import check_softdecay_alpha

        check_softdecay_alpha(args.softdecay_alpha)
    if hasattr(args, "clip"):
        from metrics.transforms import parse_clip

        args.clip = parse_clip(args.clip)
        for note in args.clip.notes:
            print(f"note: --clip {note}", file=sys.stderr)
    if hasattr(args, "score_range"):
        args.score_range = parse_range(args.score_range)
    if getattr(args, "static", None) is not None and not Path(args.static).is_file():  # before the encoder and sets
        raise UserError(f"static vectors file not found: {args.static}")
    if getattr(args, "static_lowercase", False) and getattr(args, "static", None) is None:
        raise UserError("--static_lowercase looks up the words of --static: give --static FILE")
    check_magnitude_arguments(args)
    if getattr(args, "device", None) is not None:
        from core.trainer_checks import check_device

        check_device(args.device)
    if getattr(args, "encoder", "") is None:
        from lightning_modules.encoder import default_encoder

        args.encoder = default_encoder()


def main(argv: list[str] | None = None) -> int:
    plain_warnings()
    args = build_parser().parse_args(argv)
    try:
        with stop_on_signals(*STOPS):  # Ctrl-C, SIGTERM: one line, status 130 / 143, nothing half-written
            validate(args)
            run = load_runner(args.run)
            if not args.ranks:  # reads reports only: no process group, no torch
                run(args, 0, 1)
                return 0
            from analyses.session import distributed

            with distributed() as (rank, world):
                run(args, rank, world)
    except UserError as error:
        print(f"analyze.py {args.command}: error: {error}", file=sys.stderr)
        return 2
    except Interrupted as stop:
        if first_process():
            print(f"analyze.py {args.command}: {stop} (exit status {stop.status}); its reports are written whole, at "
                  "the end, or not at all", file=sys.stderr)
        return stop.status
    return 0


def console() -> None:
    """posart-analyze (setup.cfg's console script): ends as `python analyze.py` does (a closed pipe: status 141)."""
    exit_with(main, quick_under_torchrun=True)


if __name__ == "__main__":
    console()
