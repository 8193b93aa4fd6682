"""The study's null, seeds and verdicts (metrics/null.py, lightning_modules/null.py, analyses/null.py), on synthetic
hidden states and reports: the Gaussian null against its closed forms and a direct sample, the seed statistics
against numbers computed by hand, the verdict on a planted outlier dimension and on pure noise; the outlier rule's
chance bound against a direct binomial sum, the birthday problem, scipy at large n and a Monte-Carlo of Gaussian
states through the rule.

    .venv/bin/pytest tests/test_null.py -q
"""

from __future__ import annotations

import math
import statistics
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import analyze
from analyses.null import STATISTICS, seed_statistics
from analyses.trajectory import Point, analyse
from lightning_modules.encoder import FrozenEncoder
from lightning_modules.null import GaussianStates, gaussian_encoder
from metrics.neuron_stats import NeuronStatistics
from metrics.null import (
    across_seeds,
    beyond,
    binomial_tail,
    chance_outlier_bound,
    expected_kurtosis,
    expected_top_share,
    gaussian_states,
    share_count,
    top_share_sd,
)
from metrics.outliers import OutlierRule, detect_outliers
from tests.tiny import corpus_sentences, tiny_config

# ---- the Gaussian null against its closed forms and a direct computation ----


@pytest.mark.parametrize("hidden", [16, 128])
def test_gaussian_states_give_the_closed_forms_and_the_direct_statistics(hidden):
    generator = torch.Generator().manual_seed(0)
    tokens = 20_000
    states = gaussian_states((2, tokens, hidden), generator)  # two layers
    metric = NeuronStatistics(2, hidden)
    metric.update(states)
    result = metric.compute()
    # closed form: E[b2] = 3 (d - 1) / (d + 1) for the kurtosis around each vector's own mean (3 as d grows)
    sd_of_mean = 3 * math.sqrt(24 / hidden) / math.sqrt(tokens)  # b2's sd is ~ sqrt(24 / d): a generous bound
    assert abs(float(result.kurtosis_mean[0]) - expected_kurtosis(hidden)) < sd_of_mean
    assert expected_kurtosis(10 ** 6) == pytest.approx(3, abs=1e-5)
    # closed form: every dimension holds the max (and the min) of a token with probability 1 / d
    shares = torch.cat([result.argmax_share[0], result.argmin_share[0]])
    spread = top_share_sd(hidden, tokens)  # the tolerance below: Binomial(n, 1 / d) / n's sd, checked by hand first
    assert expected_top_share(hidden) == 1 / hidden
    assert spread == pytest.approx(math.sqrt((1 / hidden) * (1 - 1 / hidden) / tokens), rel=1e-12)
    assert torch.all((shares - expected_top_share(hidden)).abs() < 5 * spread)
    assert expected_top_share(hidden) < float(shares.max()) < expected_top_share(hidden) + 5 * spread
    # a direct computation on the same draws (numpy, float64)
    x = states[0].double().numpy()
    centred = x - x.mean(1, keepdims=True)
    direct = (centred ** 4).mean(1) / (centred ** 2).mean(1) ** 2
    assert float(result.kurtosis_mean[0]) == pytest.approx(direct.mean(), rel=1e-6)
    assert float(result.kurtosis_max[0]) == pytest.approx(direct.max(), rel=1e-6)
    assert float(result.layer_max_abs[0]) == pytest.approx(np.abs(x).max(), rel=1e-6)
    assert float(result.layer_scale[0]) == pytest.approx(np.median(np.sqrt((x ** 2).mean(0))), rel=1e-6)
    assert np.bincount(x.argmax(1), minlength=hidden).tolist() == result.argmax_count[0].tolist()


@pytest.mark.filterwarnings("ignore:.*sentences were longer than")
def test_the_gaussian_twin_is_the_seeded_formula_on_the_encoders_tokens(bert_tok):
    from transformers import AutoModel

    torch.manual_seed(0)
    real = FrozenEncoder(AutoModel.from_config(tiny_config("bert", len(bert_tok))), bert_tok, exclude_special=True)
    texts = corpus_sentences(12, start=50)
    twin = gaussian_encoder(real, seed=3)
    assert (twin.hidden_size, twin.num_hidden_states, twin.max_length) == (real.hidden_size, real.num_hidden_states,
                                                                            real.max_length)
    generator = torch.Generator().manual_seed(3)  # the formula drawn by hand, batch after batch
    for ours, theirs in zip(twin.batches(texts, 5, progress=False), real.batches(texts, 5, progress=False)):
        assert torch.equal(ours.mask, theirs.mask)  # the same tokens count (special tokens excluded as in the real one)
        expected = gaussian_states((real.num_hidden_states, *ours.mask.shape, real.hidden_size), generator)
        assert torch.equal(ours.hidden_states, expected)
    again = next(iter(gaussian_encoder(real, seed=3).batches(texts, 5, progress=False))).hidden_states
    first = next(iter(twin.batches(texts, 5, progress=False)))  # the twin drew on: a new sample
    assert torch.equal(again, next(iter(gaussian_encoder(real, 3).batches(texts, 5, progress=False))).hidden_states)
    assert not torch.equal(again, first.hidden_states)


# ---- the outlier rule's chance bound (ours) ----


@pytest.mark.parametrize("n, d, share", [(7, 384, 0.2), (8, 64, 0.2), (30, 10, 0.1), (40, 3, 0.3), (1, 5, 0.2),
                                         (26, 384, 0.2), (200, 50, 0.05), (12, 4, 1.0)])
def test_the_chance_bound_is_twice_d_times_a_direct_binomial_sum(n, d, share):
    """The count a dim needs, found by scanning c / n >= share as the rule compares (0.1 * 30 rounds above 3, 3 / 30
    does not), and the tail as a float64 sum of the binomial terms; both branches of binomial_tail (above and below the
    mean n / d: (40, 3, 0.3) and (200, 50, 0.05) sit below it)."""
    needed = next(c for c in range(n + 2) if c > n or c / n >= share)
    assert share_count(n, share) == needed
    p = 1 / d
    direct = math.fsum(math.comb(n, k) * p ** k * (1 - p) ** (n - k) for k in range(needed, n + 1))
    assert binomial_tail(n, p, needed) == pytest.approx(direct, rel=1e-12, abs=1e-300)
    assert chance_outlier_bound(n, d, share) == pytest.approx(min(1.0, 2 * d * direct), rel=1e-12, abs=1e-300)


def test_the_chance_bound_is_nearly_the_birthday_probability_where_two_tokens_suffice():
    """7 tokens of width 384 at share 0.2: two tokens sharing a dim's max is an outlier; the chance that some two of
    7 maxima fall on one dim is the birthday problem's 1 - prod(1 - i / d), which the bound's half (the max alone)
    covers and nearly equals (the union bound is tight for rare events), the 0.108 the docs quote."""
    birthday = 1 - math.prod(1 - i / 384 for i in range(7))
    half = chance_outlier_bound(7, 384, 0.2) / 2
    assert birthday <= half <= 1.02 * birthday
    assert round(2 * half, 3) == 0.108


def test_the_binomial_tail_is_stable_at_large_n():
    """Up to n = 1e8 against scipy (boost's incomplete beta), on both sides of the mean and far out in the tail."""
    from scipy.stats import binom

    for n, p, k in [(10 ** 8, 0.2, 20_010_000), (10 ** 8, 0.2, 19_990_000), (10 ** 8, 1 / 384, 2 * 10 ** 7),
                    (10 ** 6, 1 / 384, 3000), (3 * 10 ** 7, 1 / 3, 10 ** 7 + 3000)]:
        expected = binom.sf(k - 1, n, p)
        assert binomial_tail(n, p, k) == pytest.approx(expected, rel=1e-5, abs=1e-300)
    assert chance_outlier_bound(10 ** 8, 384, 0.2) == 0.0  # underflows: 2e7 maxima on one dim of 384
    assert chance_outlier_bound(0, 384, 0.2) == 1.0  # no tokens: the rule says nothing


def test_gaussian_states_through_the_real_rule_find_chance_outliers_no_more_often_than_the_bound():
    """3000 seeded draws of 8 Gaussian token vectors of width 64 (each draw one 'layer' of NeuronStatistics), through
    detect_outliers at share 0.2 (two tokens on one dim's max or min): the share of draws with an outlier is at most the
    bound, and the bound is not vacuous (within a factor 1.5; about 0.60 observed against 0.82)."""
    draws, tokens, width = 3000, 8, 64
    states = gaussian_states((draws, 1, tokens, width), torch.Generator().manual_seed(0))
    metric = NeuronStatistics(draws, width)
    metric.update(states)
    observed = sum(bool(layer.outlier_dims) for layer in detect_outliers(metric.compute(), OutlierRule(0.2))) / draws
    bound = chance_outlier_bound(tokens, width, 0.2)
    assert observed <= bound <= 1.5 * observed
    assert 0.5 < observed < 0.7  # the max's birthday problem and the min's, about independent: 1 - 0.635^2


# ---- statistics across seeds, by hand ----


def synthetic_point(step: int, rows: list[dict], val_loss: float | None = None) -> dict:
    layers = []
    for layer, row in enumerate(rows):
        layers.append({"layer": layer, "argmax_dim": row.get("dim", 0), "argmax_share": row["share"],
                       "argmin_dim": 1, "argmin_share": row.get("min_share", 0.01), "outlier_dims": [],
                       "kurtosis_sequence": row["kurtosis"], "kurtosis_max": row["kurtosis"] + 1, "inf_norm_sequence": row["max_abs"],
                       "top1_share": 0.1, "scale": row.get("scale", 1.0), "anisotropy": row.get("anisotropy", 0.2),
                       "isoscore_star": 0.3})
    return {"step": step, "layers": layers, "val_loss": val_loss, "num_tokens": 100, "persistent_dims": []}


def test_seed_statistics_equal_the_hand_computed_means_sds_and_nulls():
    # two seeds, three layers (0 = embeddings, ignored by the summaries), steps 0 and 10
    values = {0: {"share": [0.5, 0.1, 0.3], "kurtosis": [9.0, 3.0, 5.0], "max_abs": [20.0, 4.0, 8.0],
                  "scale": [1.0, 1.0, 2.0]},
              1: {"share": [0.5, 0.4, 0.2], "kurtosis": [9.0, 4.0, 3.5], "max_abs": [20.0, 6.0, 5.0],
                  "scale": [1.0, 1.0, 1.0]}}
    runs = []
    for seed, v in values.items():
        initial = synthetic_point(0, [{"share": 0.1, "kurtosis": 3.0, "max_abs": 4.0, "scale": 1.0}] * 3)
        final = synthetic_point(10, [{"share": v["share"][i], "kurtosis": v["kurtosis"][i], "max_abs": v["max_abs"][i],
                                      "scale": v["scale"][i], "anisotropy": 0.1 * (i + seed)} for i in range(3)],
                                val_loss=5.0 + seed)
        runs.append({"label": f"a/seed{seed}", "checkpoints": [initial, final]})
    noise = synthetic_point(0, [{"share": 0.02, "kurtosis": 2.9, "max_abs": 4.5, "scale": 0.5}] * 3)
    nulls = [{"runs": ["a/seed0", "a/seed1"], "samples": [noise]}]
    arm, = seed_statistics({"runs": runs}, {"a": [(0, "a/seed0"), (1, "a/seed1")]}, nulls, margin=0.5)
    final = arm["checkpoints"][1]
    assert final["step"] == 10 and final["seeds"] == [0, 1]
    # the summaries: the largest over layers 1..2 of each seed, then mean and sample sd (statistics.stdev)
    by_hand = {"top_share": [0.3, 0.4], "kurtosis_sequence": [5.0, 4.0], "inf_norm_sequence": [8.0, 6.0]}
    for key, seeds in by_hand.items():
        entry = final["summary"][key]
        assert entry["seeds"] == {"0": seeds[0], "1": seeds[1]}
        assert entry["mean"] == pytest.approx(statistics.mean(seeds)) and entry["sd"] == pytest.approx(
            statistics.stdev(seeds))
    anisotropy = [statistics.mean([0.1, 0.2]), statistics.mean([0.2, 0.3])]  # mean over layers 1..2
    assert final["summary"]["anisotropy"]["mean"] == pytest.approx(statistics.mean(anisotropy))
    assert final["val_loss"]["mean"] == 5.5 and final["val_loss"]["sd"] == pytest.approx(statistics.stdev([5, 6]))
    assert final["layers"][2]["kurtosis_sequence"]["sd"] == pytest.approx(statistics.stdev([5.0, 3.5]))
    assert final["layers"][1]["argmax_dim"] == {"seeds": {"0": 0, "1": 0}}
    # the nulls: step 0 (scaled by the checkpoint's scale for max |x|) and the Gaussian sample (scale 0.5 -> x2, x4)
    max_abs = final["null"]["inf_norm_sequence"]["seeds"]
    assert max_abs["0"]["null_step0"] == pytest.approx(max(4.0 * 1, 4.0 * 2))  # layer 2 at scale 2
    assert max_abs["0"]["null_gaussian"] == pytest.approx(max(4.5 * 1 / 0.5, 4.5 * 2 / 0.5))  # 18
    assert max_abs["1"]["null"] == pytest.approx(9.0) and max_abs["1"]["excess"] == pytest.approx(6.0 - 9.0)
    share = final["null"]["top_share"]["seeds"]  # scale-free: the largest null share, 0.1 at step 0
    assert share["0"]["null"] == 0.1 and share["0"]["ratio"] == pytest.approx(3.0) and share["0"]["beyond"]
    assert share["1"]["excess"] == pytest.approx(0.3)
    assert final["null"]["top_share"]["excess"]["mean"] == pytest.approx(statistics.mean([0.2, 0.3]))
    kurtosis = final["null"]["kurtosis_sequence"]
    assert [kurtosis["seeds"][s]["beyond"] for s in "01"] == [5.0 > 1.5 * 3.0, 4.0 > 1.5 * 3.0] == [True, False]
    assert arm["verdict"] == {"step": 10, **{key: {"beyond": b, "of": 2, "verdict": f"beyond the null in {b} of 2 seeds"}
                                            for key, b in (("top_share", 2), ("kurtosis_sequence", 1), ("inf_norm_sequence", 0))}}


def test_across_seeds_and_beyond_by_hand():
    assert across_seeds([1.0, 2.0, 4.0]) == {"mean": pytest.approx(7 / 3), "sd": pytest.approx(statistics.stdev([1, 2, 4]))}
    assert across_seeds([3.0, None]) == {"mean": 3.0, "sd": None} and across_seeds([]) == {"mean": None, "sd": None}
    assert beyond(1.51, 1.0, 0.5) and not beyond(1.5, 1.0, 0.5) and not beyond(None, 1.0, 0.5)


# ---- the verdict on a planted outlier dimension, and on pure noise ----


class PlantedStates(GaussianStates):
    """Gaussian hidden states with one dimension shifted by `offset` in the transformer layers (1..L)."""

    def __init__(self, config, seed: int, dim: int, offset: float) -> None:
        super().__init__(config, seed)
        self.dim, self.offset = dim, offset

    def forward(self, input_ids, attention_mask=None, **kwargs):
        states = torch.stack(super().forward(input_ids, attention_mask).hidden_states)
        states[1:, ..., self.dim] += self.offset
        return SimpleNamespace(hidden_states=tuple(states))


@pytest.mark.parametrize("offset, expected", [(-12.0, 3), (0.0, 0)])
def test_a_planted_outlier_dimension_is_beyond_the_null_and_pure_noise_is_not(bert_tok, tmp_path, offset, expected):
    config = tiny_config("bert", len(bert_tok))
    texts = corpus_sentences(60, start=100)
    data = tmp_path / "sentences.txt"
    data.write_text("\n".join(texts) + "\n", encoding="utf-8")
    args = analyze.build_parser().parse_args(["trajectory", "--encoders", "x", "--data", str(data), "--no_progress",
                                              "--num_pairs", "20", "--minibatch", "10", "--output_dir", str(tmp_path)])
    analyze.validate(args)

    def point(model, step):
        encoder = FrozenEncoder(model, bert_tok, exclude_special=True)
        return analyse(args, Point(f"synthetic:{step}", step, "synthetic"), texts, 0, 1, encoder=encoder)[0]

    runs, arms = [], []
    for seed in range(3):  # the "model before training": noise; "after": noise with (or without) the planted dim
        runs.append({"label": f"planted/seed{seed}", "checkpoints": [
            point(GaussianStates(config, 100 + seed), 0), point(PlantedStates(config, 200 + seed, 7, offset), 50)]})
        arms.append((seed, f"planted/seed{seed}"))
    base = FrozenEncoder(GaussianStates(config, 0), bert_tok, exclude_special=True)
    samples = [{"seed": k, **analyse(args, Point("g", 0, "gaussian"), texts, 0, 1,
                                     encoder=gaussian_encoder(base, k))[0]} for k in range(2)]
    arm, = seed_statistics({"runs": runs}, {"planted": arms}, [{"runs": [r["label"] for r in runs],
                                                               "samples": samples}], margin=0.5)
    verdict = arm["verdict"]
    assert verdict["step"] == 50
    for key in STATISTICS:
        assert verdict[key]["beyond"] == expected, (key, arm["checkpoints"][-1]["null"][key])
        assert verdict[key]["verdict"] == f"beyond the null in {expected} of 3 seeds"
    if expected:  # the planted dimension is the one the paper's rule finds, in every transformer layer
        final = arm["checkpoints"][-1]["layers"]
        assert all(final[layer]["argmin_dim"]["seeds"] == {"0": 7, "1": 7, "2": 7} for layer in (1, 2, 3))
