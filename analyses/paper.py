"""The paper's experiments on one encoder, in one command: §3 outliers, origins and the position probe; §4
anisotropy and self-similarity, WiC, STS and frozen-encoder classifiers, raw and clipped; written as paper.md.

    python analyze.py paper --encoder roberta-base --output_dir runs/paper/roberta-base
    python analyze.py paper --encoder bert-base-uncased --sst2 data/sst2 --qqp qqp.csv --wic wic.jsonl \\
        --sts STS.input.x.txt sick.txt --imdb none --sst5 sst5/ --output_dir runs/paper/bert     # local stand-ins

Every dataset is a `datasets` name (the defaults) or a local file or directory in its place; `none` skips it with a
note. The outliers are detected once, on --outlier_sentences (10k) of each of the SST-2 and QQP training sets
together (the paper's "10k sentences from the training sets of both SST-2 and QQP", 3.68M tokens), and the clipping they give (--clip auto: the persistent dims in every non-input layer for base-depth models,
each layer's own outliers for deeper ones) is the one every evaluation and classifier uses. Self-similarity draws its
words from the whole of each training set (streamed); Figure 6 shows it adjusted (minus the anisotropy of the same
layer and variant). WiC is its training split (`wic`). Everything is written to a staging directory and lands in
--output_dir at once, or not at all. It runs in one process (the probes train on one device).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytorch_lightning as pl

from analyses import geometry, semantic
from analyses.outliers import outlier_figures, outliers_report, warn_chance
from analyses.paper_report import figure6, paper_markdown, paper_summary
from analyses.reference import Setting
from analyses.reports import figures_of
from analyses.session import (
    dataset_name,
    open_encoder,
    pair_sentences,
    readable,
    reference_of,
    run_header,
    setting_of,
)
from core.errors import UserError
from core.figures import save_figure
from core.output import check_writable, staged_output, write_json
from core.tokenizers import lowercases, special_strings
from core.wording import plural
from datamodules.pairs import read_sts, read_wic, wic_source
from datamodules.probing import ClassificationDataModule, PositionDataModule
from datamodules.text import iter_texts, sample_texts
from datamodules.words import source_words
from lightning_modules.encoder import FrozenEncoder, encoder_tokenizer
from lightning_modules.probes import PositionProbe, SentenceClassifier
from metrics.transforms import parse_clip

CLASSIFIERS = {"sst2": 768, "imdb": 128, "sst5": 1536}  # the paper's batch sizes (§4.4)


@dataclass
class Inputs:
    """What is read before any encoder runs (a bad source fails here, before anything is written)."""

    sst2: list[str] | None
    qqp: list[str] | None
    outlier_sentences: list[str] = field(default_factory=list)  # §3: SST-2's and QQP's together
    outlier_sources: dict = field(default_factory=dict)  # {"sst2": count used, "qqp": count used}
    contexts: dict = field(default_factory=dict)  # {"sst2": WordSample, ...}: read_contexts; WordContexts once loaded
    sources: dict = field(default_factory=dict)  # {"sst2": (source, column), ...}: the training sets read
    wic: tuple | None = None  # (items, skipped)
    wic_source: dict = field(default_factory=dict)  # {"data", "split"}
    sts: dict = field(default_factory=dict)  # {name: (pairs, unscored)}
    notes: list[str] = field(default_factory=list)


def sentences_of(source: str, column: str | None, limit: int, seed: int) -> list[str]:
    texts = sample_texts(iter_texts(source, column), limit, seed)
    if not texts:
        raise UserError(f"no sentences in {source}")
    return texts


SEED_OFFSETS = {"sst2": 0, "qqp": 1}  # each training set's sample seed is --seed + this, whichever others are read


def outlier_sample(args, sources: dict[str, tuple[str, str | None]]) -> tuple[list[str], dict[str, int]]:
    """§3's sentences: a seeded sample of --outlier_sentences from each given training set (the paper's "10k sentences
    from the training sets of both SST-2 and QQP ... 3.68M tokens": 10k of each), together, SST-2's first; a set with
    fewer sentences is used whole (not topped up from the other). Returns (sentences, {name: count used})."""
    picked = {name: sentences_of(source, column, args.outlier_sentences, args.seed + SEED_OFFSETS[name])
              for name, (source, column) in sources.items()}
    return [text for texts in picked.values() for text in texts], {name: len(texts) for name, texts in picked.items()}


def read_inputs(args) -> Inputs:
    if "none" in (args.sts or []):  # as every other set's `none`; no value at all skips them too
        if args.sts != ["none"]:  # never a set named "none": refused before anything is read
            raise UserError(f"--sts: none cannot be combined with other sets (got: {' '.join(args.sts)})")
        args.sts = []
    skip = {name: getattr(args, name) in (None, "none") for name in ("sst2", "qqp", "wic", "imdb", "sst5")}
    if skip["sst2"] and skip["qqp"]:
        raise UserError("--sst2 and --qqp are both none: the outliers (§3) need the sentences of one of them at least")
    columns = (("sst2", args.text_column), ("qqp", args.qqp_column))  # --text_column: SST-2's (None: detected)
    sources = {name: (getattr(args, name), column) for name, column in columns if not skip[name]}
    inputs = Inputs(*(None if skip[name] else sentences_of(getattr(args, name), column, args.max_sentences, args.seed)
                      for name, column in columns))
    inputs.outlier_sentences, inputs.outlier_sources = outlier_sample(args, sources)
    inputs.sources = sources
    if not skip["wic"]:
        inputs.wic, inputs.wic_source = read_wic(args.wic, None), wic_source(args.wic)
    for name in args.sts or []:
        inputs.sts[name] = read_sts(name, None, (1.0, 5.0) if name == "sickr" else args.score_range)
    inputs.notes = [f"{name} skipped (--{name} none)" for name, skipped in skip.items() if skipped]
    if not args.sts:
        inputs.notes.append("STS skipped (no --sts sets)")
    return inputs


def read_contexts(args, inputs: Inputs, tokenizer) -> None:
    """Each training set's self-similarity words, drawn with the encoder's tokenizer (loaded alone, before its weights:
    too few words is refused before a hub model downloads): a word written inside one of its special tokens ("unk" of
    WikiText's "<unk>") does not occur there, and in its case (case-folded only when the tokenizer lowercases)."""
    specials, lowercase = special_strings(tokenizer), lowercases(tokenizer)
    for name, (source, column) in inputs.sources.items():
        inputs.contexts[name] = source_words(source, column, args.pool_sentences, args.num_words,
                                             args.min_sentences, args.seed, special_tokens=specials,
                                             lowercase=lowercase, progress=not args.no_progress)


def explicit_clip(clipped: dict[int, list[int]] | None) -> str:
    """The resolved {layer: dims} as a --clip text every later step uses as it is ("none" when empty)."""
    if not clipped:
        return "none"
    return ",".join(f"{layer}:{'+'.join(map(str, dims))}" for layer, dims in sorted(clipped.items()))


def evaluations(args, setting: Setting, inputs: Inputs) -> tuple[dict, dict, str]:
    """(reports, the outlier statistics, the resolved clip text) of §3's outliers and §4's intrinsic evaluations."""
    encoder = setting.encoder
    reports = {}
    args.data = " + ".join(f"{plural(inputs.outlier_sources[name], 'sentence')} of {getattr(args, name)}"
                           for name in inputs.outlier_sources)
    found = reference_of(args, setting, inputs.outlier_sentences, statistics=True)
    reports["outliers"] = {**outliers_report(args, encoder, found, more="more sentences (--outlier_sentences)"),
                           "sentences_from": inputs.outlier_sources, "sentences_asked": args.outlier_sentences}
    clip = explicit_clip(found.clipped)
    rule = f"{found.clip_rule}; detected on {args.data} and applied as {clip}"
    args.clip = replace(parse_clip(clip), origin=rule)  # the outliers found on SST-2 and QQP, everywhere after
    for name, sentences in (("sst2", inputs.sst2), ("qqp", inputs.qqp)):
        if sentences is None:
            continue
        args.data = args.sst2 if name == "sst2" else args.qqp
        reference = reference_of(args, setting, sentences, sample=2 * args.num_pairs)
        header = run_header(args, encoder, reference)
        reports[f"anisotropy_{name}"] = {**header, **geometry.anisotropy(setting, reference, args.num_pairs)}
        baseline = geometry.Baseline(reports[f"anisotropy_{name}"], f"anisotropy_{name}.json", args.num_pairs)
        reports[f"self_similarity_{name}"] = {**header, **geometry.self_similarity(
            setting, inputs.contexts[name], reference.variants, baseline)}
    if inputs.wic is not None:
        args.data = args.wic
        items, skipped = inputs.wic
        reference = reference_of(args, setting, pair_sentences(items))
        reports["wic"] = {**run_header(args, encoder, reference), **inputs.wic_source, "skipped": skipped.to_dict(),
                          **semantic.wic(setting, items, reference.variants)}
    for name, (pairs, unscored) in inputs.sts.items():
        args.data = name
        reference = reference_of(args, setting, pair_sentences(pairs), fit="sentences")
        reports[f"sts_{dataset_name(name, reports)}"] = {**run_header(args, encoder, reference), "unscored": unscored,
                                                         **semantic.sts(setting, pairs, reference.variants, args.static,
                                                                        args.static_lowercase)}
    reports = {name: report if name == "outliers" else found.with_chance(report) for name, report in reports.items()}
    return reports, found.statistics, clip  # each evaluation with the chance of the detection that chose its clipping


def fit_probe(model: pl.LightningModule, data: pl.LightningDataModule, epochs: int, progress: bool, root) -> None:
    """Fit on one device (every epoch validated), then test with each layer's best-validation weights."""
    trainer = pl.Trainer(max_epochs=epochs, accelerator="gpu" if data.encoder.device.type == "cuda" else "cpu",
                         devices=1, logger=False, enable_checkpointing=False, check_val_every_n_epoch=1,
                         num_sanity_val_steps=0, enable_progress_bar=progress, enable_model_summary=False,
                         default_root_dir=str(root))
    trainer.fit(model, datamodule=data)
    trainer.test(model, datamodule=data, verbose=False)


def train_probe(args, model: pl.LightningModule, data: pl.LightningDataModule, output_dir) -> dict:
    """Fit (every epoch validated), test with each layer's best-validation weights, write the probe's report."""
    fit_probe(model, data, args.epochs, not args.no_progress, output_dir)
    report = model.write_outputs(output_dir)
    data.close()
    return report


def probes(args, encoder: FrozenEncoder, clip: str, stage) -> dict:
    """§3's position probe on SST-2's splits (unless --sst2 none) and §4.4's classifiers, raw and clipped."""
    common = dict(encoder=encoder, max_length=args.max_length, max_sentences=args.probe_sentences,
                  seed=args.seed, progress=not args.no_progress, exclude_special=args.exclude_special,
                  cache_dir=str(stage), max_memory_gb=args.max_memory_gb)
    reports = {}
    if args.sst2 not in (None, "none"):
        data = PositionDataModule(source=args.sst2, batch_size=128, text_column=args.text_column, **common)
        data.max_positions_option, data.max_memory_option = None, "--max_memory_gb"  # analyze.py's options
        reports["position_probe"] = train_probe(args, PositionProbe(lr=1e-3, seed=args.seed), data,
                                                stage / "position_probe")
    for name, batch_size in CLASSIFIERS.items():
        source = getattr(args, name)
        if source in (None, "none"):
            continue
        model = SentenceClassifier(lr=1e-3, clip=clip, seed=args.seed)
        data = ClassificationDataModule(source=source, batch_size=batch_size, label_column="label",
                                        text_column=args.text_column if name == "sst2" else None, **common)
        data.label_hint = f"the paper's classifier on --{name} reads its labels from it (or --{name} none)"
        data.max_memory_option = "--max_memory_gb"
        reports[f"classifier_{name}"] = train_probe(args, model, data, stage / f"classifier_{name}")
    return reports


def run_paper(args, rank: int, world: int) -> dict:
    if world > 1:
        raise UserError("analyze.py paper runs in one process (its probes train on one device): run it without "
                        "torchrun")
    inputs = read_inputs(args)
    tokenizer = encoder_tokenizer(args.encoder)  # its weights are read only once the words are drawn
    read_contexts(args, inputs, tokenizer)
    check_writable(args.output_dir)
    encoder = open_encoder(args, tokenizer=tokenizer)
    visible = readable(encoder, args.max_length)  # each word's contexts where the encoder's tokens reach
    inputs.contexts = {name: words.contexts(visible, not args.no_progress) for name, words in inputs.contexts.items()}
    for note in inputs.notes:
        print(f"note: {note}")
    setting = setting_of(args, encoder)
    with staged_output(args.output_dir, owner="paper") as stage:  # an earlier paper's files not written again go
        reports, statistics, clip = evaluations(args, setting, inputs)
        reports.update(probes(args, encoder, clip, stage))
        summary = paper_summary(reports, args, clip, inputs.notes)
        (stage / "outliers").mkdir()
        write_json(stage / "outliers" / "outliers.json", reports["outliers"])
        for file, make in outlier_figures(reports["outliers"], statistics, encoder).items():
            save_figure(make(), stage / "outliers" / file)
        for name, report in reports.items():
            if name.startswith(("anisotropy", "self_similarity", "wic", "sts")):
                write_json(stage / f"{name}.json", report)
                kind = name.rsplit("_", 1)[0] if not name.startswith(("wic", "sts")) else name.split("_")[0]
                for file, make in figures_of(kind, report, encoder.short_name).items():
                    save_figure(make(), stage / file.replace(f"{kind}.png", f"{name}.png"))
        save_figure(figure6(reports, encoder.short_name), stage / "figure6.png")
        write_json(stage / "paper.json", summary)
        markdown = paper_markdown(summary)
        (stage / "paper.md").write_text(markdown, encoding="utf-8")
    print(markdown)
    print(f"wrote {args.output_dir}/paper.md, paper.json and the reports and figures beside them")
    warn_chance(reports["outliers"])
    return summary
