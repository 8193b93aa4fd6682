"""The defaults the entry points' parsers show and the code uses, torch-free: `analyze.py --help` imports this, not
the modules that use them (which import torch).

    from core.defaults import OUTLIER_MIN_SHARE, NORMALIZATIONS, STS_PRESETS, DEFAULT_CORPUS

Each value lives here once; the modules named beside it use it from here (metrics.outliers.OutlierRule,
metrics.transforms, datamodules.pairs, datamodules.text, analyses.paper).
"""

from __future__ import annotations

from pathlib import Path

# the bundled corpus (Jane Austen's novels): every analysis's default --data (datamodules.text)
DEFAULT_CORPUS = Path(__file__).resolve().parent.parent / "data" / "austen.txt"

# the outlier rule's share (metrics.outliers.OutlierRule): ours, for the paper's "most vectors"
OUTLIER_MIN_SHARE = 0.2

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
