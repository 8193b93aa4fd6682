"""The defaults the entry points' parsers show and the code uses, torch-free: `analyze.py --help` imports this, not
the modules that use them (which import torch).

    from core.defaults import OUTLIER_MIN_SHARE, NORMALIZATIONS, STS_PRESETS, DEFAULT_CORPUS, MAX_SENTENCES

Each value lives here once; the modules named beside it use it from here (metrics.outliers.OutlierRule,
metrics.transforms, datamodules.pairs, datamodules.text, analyses.paper).
"""

from __future__ import annotations

from pathlib import Path

# the bundled corpus (Jane Austen's novels; core/corpus/, package data: a wheel install has it too): every entry
# point's default --data, --data.corpus and --data.source (datamodules.text)
DEFAULT_CORPUS = Path(__file__).resolve().parent / "corpus" / "austen.txt"

# analyze.py's sentence sample and token pairs (--max_sentences, --num_pairs): the paper's §4.1 anisotropy sample, 1000
# pairs of random tokens from 2000 random sentences; ours for every other analysis that samples sentences of --data
MAX_SENTENCES = 2000
NUM_PAIRS = 1000
# the paper's §3 sample for the outliers: 10k sentences of each of SST-2's and QQP's training sets (analyze.py paper
# --outlier_sentences; analyses.paper)
PAPER_OUTLIER_SENTENCES = 10000

# the probes' feature budget in GiB (datamodules.probing, datamodules.features): float32 within it, else float16, then
# memory-mapped files; probe.py's --data.max_memory_gb, analyze.py paper's and intervene's --max_memory_gb
FEATURE_MEMORY_GB = 4.0

# the outlier rule's share (metrics.outliers.OutlierRule): ours, for the paper's "most vectors"
OUTLIER_MIN_SHARE = 0.2

# analyze.py --dtype: the precision the encoder computes in (analyses.session.open_encoder); float32 is the default
# on every device, so a GPU's report equals the CPU's and a direct float32 computation (transformers' own default)
DTYPES = ("float32", "bfloat16", "float16")

# --normalize's choices and --softdecay_alpha's default (metrics.transforms)
NORMALIZATIONS = ("none", "whiten", "standardize", "softdecay")
SOFTDECAY_ALPHA = -0.2

# name -> (datasets source, {column: value} a row must have) (datamodules.pairs). SICK-R: the SemEval-2014 Task 1
# test portion of SICK (the SemEval_set column; SentEval's SICK_test_annotated.txt, which it mirrors, can be passed
# as a file). STS12-16: each year's subsets pooled into one set of pairs, as the mteb test splits hold them.
STS_PRESETS = {
    "stsb": ("mteb/stsbenchmark-sts::test", {}),
    "sickr": ("RobZamp/sick::test", {"SemEval_set": "TEST"}),
    **{f"sts{year}": (f"mteb/sts{year}-sts::test", {}) for year in range(12, 17)},
}
# the seven STS sets of the paper's Table 2 (analyses.paper)
STS_SETS = ("sts12", "sts13", "sts14", "sts15", "sts16", "stsb", "sickr")

# massive activations (metrics.massive): the rules and their parameters; ratio is ours, sun is Sun et al. 2024's
MASSIVE_RULES = ("ratio", "sun")
MASSIVE_DEFAULTS = {"ratio": {"ratio": 20.0, "min_abs": 0.0}, "sun": {"ratio": 1000.0, "min_abs": 100.0}}
MASSIVE_TOP_K = 5  # dimensions of largest peak |x| reported per layer (analyses.magnitudes)
# magnitude outliers (metrics.magnitude): rms is ours, int8 LLM.int8's (Dettmers et al. 2022)
MAGNITUDE_RULES = ("rms", "int8")
MAGNITUDE_DEFAULTS = {"rms": {"threshold": 4.0, "min_share": 0.2}, "int8": {"threshold": 6.0, "min_share": 0.06}}
# attention sinks (metrics.sinks): Gu et al.'s epsilon
SINK_EPSILON = 0.3

# analyze.py intervene (lightning_modules.interventions): each intervention and what it does
INTERVENTIONS = {
    "position_mean": "every usable row of the absolute position table replaced by their mean row",
    "position_shuffle": "the usable rows of the absolute position table permuted (seeded)",
    "position_zero": "the usable rows of the absolute position table zeroed",
    "token_type_zero": "the token-type embedding rows zeroed",
    "layernorm_zero": "gamma and beta (an RMSNorm: its gain, it has no bias) of the dims zeroed in every LayerNorm "
                      "or RMSNorm over the hidden size (or those of --layers)",
    "activation_zero": "the dims of the hidden state set to 0 at --layers (later layers see the change)",
    "activation_mean": "the dims of the hidden state set to their mean over the data (the unmodified model's) at "
                       "--layers (later layers see the change)",
}
# --probe's quick settings (ours; the paper trains 10 epochs) (analyses.intervene)
INTERVENE_PROBE = {"epochs": 2, "sentences": 500, "batch_size": 128, "lr": 1e-2}
