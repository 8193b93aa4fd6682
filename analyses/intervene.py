"""`analyze.py intervene`: test causes, not only correlations: interventions inside the forward pass of an encoder
(lightning_modules/interventions.py), each dimension-based one beside the same intervention on random dimensions.

    python analyze.py intervene          # packaged MiniLM: layernorm_zero of its persistent outliers vs 10 controls
    python analyze.py intervene --interventions position_mean token_type_zero layernorm_zero --probe
    python analyze.py intervene --encoder runs/demo/tiny-pe --interventions position_mean activation_zero  # + MLM loss
    python analyze.py intervene --interventions activation_mean --dims 223 --layers 1-3 --controls 20 --sts stsb
    python analyze.py intervene --encoder gpt2 --interventions position_mean activation_zero   # + next-token loss
    torchrun --nproc_per_node 2 analyze.py intervene ...      # sentences (and STS pairs) sharded, metrics synced

The sentences are tokenised once (analyses.reference.Setting's replay) and every variant of the model reads the same
padded batches: the unmodified model (the baseline), each intervention, and each control, one encoder pass each (a
second one over the masked copy for the MLM loss, and the STS pairs and the probe's data, when asked for; a causal
model's next-token loss, ours, comes from the same pass: its LM head reads the last hidden state). Each pass
is the reference pass of `analyze.py outliers` and `anisotropy` (NeuronStatistics; the paper's seeded random-token
sample, the same tokens for every variant, so differences are paired), under the intervention. The baseline also
gives the dimensions (`--dims auto`: the persistent outliers by the outliers analysis' rule, --min_share / --sigma)
and the per-dim means activation_mean sets. The report and figure: analyses/intervene_report.py.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import tempfile
import warnings
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from analyses import semantic
from analyses.geometry import pair_anisotropy
from analyses.intervene_report import PROBE, intervention_figure, print_intervene, report_of
from analyses.paper import fit_probe
from analyses.reference import Setting, counter, reference_pass
from analyses.session import collectively, finish, prepare, read_sentences, setting_of, warn_text_counts
from core.errors import UserError
from core.models import layer_norms
from datamodules.masking import SentenceMasker
from datamodules.pairs import read_sts
from datamodules.probing import PositionDataModule
from lightning_modules.encoder import FrozenEncoder
from lightning_modules.interventions import (
    DIMENSION_BASED,
    Intervention,
    check_intervention,
    intervene,
    masked_lm_loss,
    next_token_loss,
)
from lightning_modules.probes import PositionProbe
from metrics.controls import control_summary
from metrics.neuron_stats import NeuronStatisticsResult
from metrics.outliers import OutlierRule, all_outlier_dims, detect_outliers, persistent_dims
from metrics.transforms import RAW

MLM_PROBABILITY = 0.15


@dataclass
class Request:
    names: list[str]
    dims: list[int] | None  # None: auto
    layers: list[int] | None  # None: all


def parse_numbers(text: str, option: str) -> list[int]:
    """"1-3,6" -> [1, 2, 3, 6]."""
    numbers = []
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            numbers += range(int(low), int(high or low) + 1)
    except ValueError:
        raise UserError(f"{option} must be a list of numbers and ranges (1-3,6), got {text!r}") from None
    if not numbers:
        raise UserError(f"{option} {text!r} names nothing")
    return sorted(set(numbers))


def parse_request(args, world: int) -> Request:
    """What to do, checked before anything is read or loaded."""
    if args.controls < 0:
        raise UserError(f"--controls must be 0 or more, got {args.controls}")
    if args.probe and (args.probe_epochs < 1 or args.probe_sentences < 10):
        raise UserError(f"--probe needs --probe_epochs >= 1 and --probe_sentences >= 10, got {args.probe_epochs} "
                        f"and {args.probe_sentences}")
    if args.probe and world > 1:
        raise UserError("--probe trains in one process (its feature cache lives in one process): run intervene "
                        "without torchrun, or without --probe")
    dims = None if args.dims == "auto" else parse_numbers(args.dims, "--dims")
    layers = None if args.layers == "all" else parse_numbers(args.layers, "--layers")
    return Request(list(dict.fromkeys(args.interventions)), dims, layers)


def check_request(request: Request, encoder: FrozenEncoder, controls: int) -> None:
    """One line, before any pass, when the model cannot take an intervention, a dim or layer is out of range, or
    given --dims leave too few other dims for the controls (each is as many dims, none of them chosen: the bound known
    before the pass; control_dims checks again once the baseline's outliers are left out too)."""
    for name in request.names:
        check_intervention(encoder.model, name, encoder.name)
    bad = [d for d in request.dims or [] if not 0 <= d < encoder.hidden_size]
    if bad:
        raise UserError(f"--dims {bad}: the dims of {encoder.name} run 0..{encoder.hidden_size - 1} (0-indexed)")
    bad = [layer for layer in request.layers or [] if not 0 <= layer < encoder.num_hidden_states]
    if bad:
        raise UserError(f"--layers {bad}: the layers of {encoder.name} run 0..{encoder.num_hidden_states - 1} "
                        "(0 = embedding output)")
    wanted = len(request.dims or [])
    if controls and wanted and any(name in DIMENSION_BASED for name in request.names) \
            and encoder.hidden_size - wanted < wanted:
        raise UserError(f"{wanted} control dims wanted, but only {encoder.hidden_size - wanted} of the "
                        f"{encoder.hidden_size} dims of {encoder.name} are not in --dims (and its outliers are left "
                        f"out too): give at most {encoder.hidden_size // 2} dims in --dims, or --controls 0")
    if "layernorm_zero" in request.names and request.layers is not None and not any(
            set(written) & set(request.layers) for _, written, _ in layer_norms(encoder.model)):
        raise UserError(f"layernorm_zero --layers {','.join(map(str, request.layers))}: no LayerNorm or RMSNorm of "
                        f"{encoder.name} writes these layers, so nothing would be zeroed (a norm inside block l writes "
                        "layer l, a final norm layer L; layer 0 only an embedding norm)")


@dataclass
class Measured:
    """What one encoder pass of one variant of the model gives."""

    statistics: NeuronStatisticsResult
    anisotropy: Tensor  # [layers]
    num_pairs: int
    num_sentences: int
    num_truncated: int
    num_unknown: int = 0  # the tokenizer's unknown tokens in the sentences
    mlm_loss: float | None = None
    masked_tokens: int = 0
    lm_loss: float | None = None  # a causal model's next-token loss (ours), from the same pass
    lm_tokens: int = 0
    sts: Tensor | None = None  # [layers], Spearman x 100
    probe: Tensor | None = None  # [layers], test accuracy

    @property
    def share(self) -> Tensor:
        """[layers, hidden]: the share of the token vectors whose max or min lies on each dim."""
        return self.statistics.argmax_share + self.statistics.argmin_share

    def series(self) -> dict[str, Tensor]:
        """The per-layer values the effects compare."""
        values = {"kurtosis": self.statistics.kurtosis_mean, "max_abs": self.statistics.layer_max_abs,
                  "anisotropy": self.anisotropy}
        return {**values, **({"sts": self.sts} if self.sts is not None else {}),
                **({"probe": self.probe} if self.probe is not None else {})}


@dataclass
class Run:
    args: argparse.Namespace
    encoder: FrozenEncoder
    setting: Setting
    sentences: list[str]
    sts_pairs: list | None = None
    masks: list[dict] | None = None  # the masked copy of every batch (MLM loss), None without an MLM head
    causal: bool = False  # a causal model with its LM head: the next-token loss of the reference pass's batches
    passes: list[str] = field(default_factory=list)
    probe_splits: dict | None = None  # --probe: max_positions and each split's sentences, tokens, dropped positions


def mlm_pass(run: Run, desc: str) -> tuple[float, int]:
    """The MLM loss over every masked token of this rank's sentences (synced): (mean cross-entropy, masked tokens)."""
    device = run.encoder.device
    total, count = counter(device), counter(device)
    for batch in run.masks:
        loss, masked = masked_lm_loss(run.encoder, batch)
        if int(masked):
            total.update(loss.double() * masked)
            count.update(masked)
    return float(total.compute() / count.compute().clamp_min(1)), int(count.compute())


class NextTokenMeter:
    """A causal model's next-token loss over the batches of the reference pass as it reads them (no pass of its own:
    the LM head reads hidden_states[L]); synced on compute."""

    def __init__(self, encoder: FrozenEncoder) -> None:
        self.encoder, self.total, self.count = encoder, counter(encoder.device), counter(encoder.device)

    def update(self, batch) -> None:
        total, count = next_token_loss(self.encoder, batch.hidden_states[-1], batch.input_ids, batch.attention_mask)
        self.total.update(total)
        self.count.update(count)

    def compute(self) -> tuple[float, int]:
        return float(self.total.compute() / self.count.compute().clamp_min(1)), int(self.count.compute())


@contextlib.contextmanager
def quiet_lightning():
    """Lightning's banner lines and data-loader advice silenced for the probes trained inside one report."""
    logger = logging.getLogger("pytorch_lightning")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*(num_workers|does not have many workers|LeafSpec).*")
            yield
    finally:
        logger.setLevel(level)


def probe_pass(run: Run) -> Tensor:
    """The all-layer position probe's test accuracy [layers] on the encoder as it is now (under the intervention).
    The first pass keeps its splits' counts in `run.probe_splits` (the same sentences and tokens in every pass: their
    warnings, such as tokens beyond the probe's positions, are given once)."""
    args = run.args
    with tempfile.TemporaryDirectory() as root, quiet_lightning(), warnings.catch_warnings():
        if run.probe_splits is not None:  # the same sentences as the first pass: its warnings were given
            warnings.filterwarnings("ignore", message="the probe leaves out ")
            warnings.filterwarnings("ignore", message=r".* (sentence was|sentences were) longer than .* and (was|were) "
                                    "truncated")
        data = PositionDataModule(source=args.data, encoder=run.encoder, text_column=args.text_column,
                                  max_length=args.max_length, max_sentences=args.probe_sentences,
                                  batch_size=PROBE["batch_size"], random_baseline=False,
                                  exclude_special=args.exclude_special, seed=args.seed, progress=False, cache_dir=root,
                                  max_memory_gb=args.max_memory_gb)
        data.max_positions_option, data.max_memory_option = None, "--max_memory_gb"  # analyze.py's options
        model = PositionProbe(lr=PROBE["lr"], seed=args.seed)
        fit_probe(model, data, args.probe_epochs, False, root)
        if run.probe_splits is None:
            run.probe_splits = {"max_positions": data.max_positions, "splits": data.spec.counts}
        data.close()
    return torch.tensor(model.accuracy_of("encoder"), dtype=torch.float64)


def measure(run: Run, intervention: Intervention | None, desc: str) -> Measured:
    """One pass of the model under `intervention` (None: unmodified) over the sentences, and the tasks asked for."""
    args = run.args
    run.passes.append(desc)
    with intervene(run.encoder.model, intervention):
        meter = NextTokenMeter(run.encoder) if run.causal else None  # updated with every batch, as magnitudes are
        reference = reference_pass(run.setting, run.sentences, statistics=True, sample=2 * args.num_pairs, desc=desc,
                                   magnitudes=meter)
        anisotropy, pairs = pair_anisotropy(reference.sample, [RAW], args.seed)
        measured = Measured(reference.statistics, anisotropy[RAW.key].cpu(), pairs, reference.num_sentences,
                            reference.num_truncated, reference.num_unknown)
        if meter is not None:
            measured.lm_loss, measured.lm_tokens = meter.compute()
        if run.masks is not None:
            measured.mlm_loss, measured.masked_tokens = mlm_pass(run, desc)
        if run.sts_pairs is not None:
            layers = semantic.sts(run.setting, run.sts_pairs, [RAW])["layers"]
            measured.sts = torch.tensor([float("nan") if row[RAW.key] is None else row[RAW.key] for row in layers],
                                        dtype=torch.float64)
        if args.probe:
            measured.probe = probe_pass(run)
    return measured


def effects(after: Measured, before: Measured, dims: list[int]) -> dict[str, Tensor]:
    """after - before: per layer (0..L), and the mean over the non-input layers 1..L (`<name>_mean`); the summed share
    of `dims` (outlier_share) when there are dims; the MLM loss and a causal model's next-token loss (numbers) when
    measured."""
    changes = {"outlier_share": (after.share[:, dims].sum(1) - before.share[:, dims].sum(1)).cpu()} if dims else {}
    changes.update({key: (value.double().cpu() - before.series()[key].double().cpu())
                    for key, value in after.series().items()})
    result = {}
    for key, change in changes.items():
        result[key] = change
        result[f"{key}_mean"] = change[1:].nanmean()
    for key in ("mlm_loss", "lm_loss"):
        if getattr(after, key) is not None:
            result[key] = torch.tensor(getattr(after, key) - getattr(before, key), dtype=torch.float64)
    return result


def control_dims(hidden: int, excluded: set[int], size: int, count: int, seed: int) -> list[list[int]]:
    """`count` seeded random sets of `size` dims, none of them in `excluded` (the outliers and the chosen dims). Too
    few candidates is refused here only when the baseline's outliers take them (--dims auto, or the outliers outside
    the given --dims): check_request refuses given --dims that leave too few before any pass."""
    candidates = [d for d in range(hidden) if d not in excluded]
    if count and len(candidates) < size:
        raise UserError(f"{size} control dims wanted, but only {len(candidates)} dims are not outliers or chosen")
    generator = torch.Generator().manual_seed(seed)
    return [sorted(candidates[i] for i in torch.randperm(len(candidates), generator=generator)[:size].tolist())
            for _ in range(count)]


def intervention_result(run: Run, name: str, request: Request, baseline: Measured, dims: list[int],
                        controls: list[list[int]]) -> dict:
    """One intervention's pass, its effects, and (dimension-based) its controls' passes and summary."""
    dimensional = name in DIMENSION_BASED
    if dimensional and not dims:
        return {"skipped": "no dims: the unmodified model has no persistent outlier dims on this data (give --dims)"}
    layers = tuple(request.layers) if request.layers is not None and dimensional else None
    means = baseline.statistics.mean if name == "activation_mean" else None
    after = measure(run, Intervention(name, tuple(dims), layers, run.args.seed, means), name)
    entry = {"measured": after, "effects": effects(after, baseline, dims), "layers": layers}
    if dimensional and controls:
        drawn = [effects(measure(run, Intervention(name, tuple(chosen), layers, run.args.seed, means),
                                 f"{name} control {i + 1}/{len(controls)}"), baseline, dims)
                 for i, chosen in enumerate(controls)]
        entry["controls"] = {key: control_summary(value, torch.stack([d[key] for d in drawn]))
                             for key, value in entry["effects"].items()}
    return entry


def run_intervene(args, rank: int, world: int) -> dict:
    request = parse_request(args, world)

    def read():
        sentences = read_sentences(args)  # every rank holds them all; Setting shards them
        return sentences, read_sts(args.sts, None, args.score_range)[0] if args.sts else None

    (sentences, sts_pairs), encoder = prepare(args, rank, read, masked_lm=True)
    collectively(lambda: check_request(request, encoder, args.controls))
    setting = replace(setting_of(args, encoder, rank, world), replay={})  # tokenised once, replayed for every variant
    run = Run(args, encoder, setting, sentences, sts_pairs, causal=encoder.causal_lm is not None)
    if encoder.masked_lm is not None:  # the same masks for every variant: tied to (seed, sentence index)
        masker = SentenceMasker(encoder.tokenizer, MLM_PROBABILITY, args.seed)
        run.masks = [masker(item.inputs["input_ids"], item.inputs["attention_mask"], item.rows)
                     for item in setting.tokenized(sentences)]
    baseline = measure(run, None, "unmodified model")
    if baseline.statistics.num_tokens == 0:
        raise UserError("no tokens counted (all special tokens excluded?)")
    rule = OutlierRule(args.min_share, args.sigma)
    outliers = detect_outliers(baseline.statistics, rule)
    dims = persistent_dims(outliers) if request.dims is None else request.dims
    controls = control_dims(encoder.hidden_size, set(all_outlier_dims(outliers)) | set(dims), len(dims),
                            args.controls, args.seed) if dims and any(n in DIMENSION_BASED for n in request.names) \
        else []
    results = {name: intervention_result(run, name, request, baseline, dims, controls) for name in request.names}
    report = report_of(args, encoder, run, baseline, results, dims, outliers, rule, controls)
    figures = {"intervene.png": lambda: intervention_figure(report, encoder.short_name)}
    finish(args, rank, {"intervene.json": report}, figures)
    if rank == 0:
        print_intervene(report)
        warn_text_counts({"intervene": report})
    return report
