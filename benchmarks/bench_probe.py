"""Cost of the position probe against the encoder pass it rests on, measured side by side in one run (issue 4).

    python benchmarks/bench_probe.py            # packaged MiniLM on 2000 sentences, then a bert-base-size encoder
    python benchmarks/bench_probe.py --quick    # MiniLM on 200 sentences
    python benchmarks/bench_probe.py --smoke    # MiniLM on 40 sentences, seconds (the test suite runs this)

1. The full position probe as probe.py runs it (features of every layer extracted once, the stacked probes of all
   layers trained 10 epochs with Adam at batch 128 token vectors, validated each epoch, tested, contributions computed,
   report and figures written) against one plain encoder pass (FrozenEncoder.batches) over the same sentences:
   at most 2x. The random-encoder baseline is off here: it is a second encoder pass, by design.
2. The naive way, re-running the encoder for every layer and epoch: one (layer, epoch) unit is measured for real
   (encoder forward per batch, then that layer's probe step), and the whole costs layers x epochs units; the cached
   probe must be at least 10x faster.
3. The control task (Hewitt & Liang 2019, on by default in probe.py): the position probe trained, validated and tested
   on the cached features with and without its control probes (one per layer, stacked with the task's, reading the
   same features), alternately over a few rounds: the control probes' added time over the probe they control (the
   task's probes alone) is at most 1.2x. Its spread over the rounds is printed.
4. (full mode) The same as 1 on bert-base-uncased's architecture with random weights (the paper's model size,
   offline; the cost does not depend on the weights), 400 sentences.
Times are process CPU seconds with one intra-op thread (the work done, not the share of a busy machine); the encoder
pass is measured before and after the probe and the faster run counts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import pytorch_lightning as pl  # noqa: E402

from core.errors import plain_warnings  # noqa: E402
from datamodules.probing import PositionDataModule  # noqa: E402
from datamodules.text import DEFAULT_CORPUS, iter_texts, sample_texts  # noqa: E402
from lightning_modules.encoder import FrozenEncoder, default_encoder, load_encoder  # noqa: E402
from lightning_modules.probes import PositionProbe  # noqa: E402

EPOCHS, BATCH, ENCODE_BATCH, MAX_POSITIONS = 10, 128, 32, 300


def encoder_pass(encoder, texts: list[str]) -> float:
    start = time.process_time()
    for _ in encoder.batches(texts, ENCODE_BATCH, progress=False):
        pass
    return time.process_time() - start


def full_probe(encoder, texts: list[str], output_dir: Path) -> tuple[dict[str, float], PositionProbe]:
    """probe.py's work, phase by phase: (CPU seconds per phase, the trained probe)."""
    times, start = {}, time.process_time()

    def lap(name: str) -> None:
        nonlocal start
        times[name], start = time.process_time() - start, time.process_time()

    dm = PositionDataModule(encoder=encoder, source=str(output_dir / "sentences.txt"), max_sentences=0,
                            batch_size=BATCH, encode_batch_size=ENCODE_BATCH, max_positions=MAX_POSITIONS,
                            random_baseline=False, control_task=False, progress=False)
    trainer = pl.Trainer(max_epochs=EPOCHS, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         default_root_dir=str(output_dir))
    dm.trainer = trainer
    dm.prepare_data()  # what trainer.fit would do first
    lap("extract")
    model = PositionProbe()
    trainer.fit(model, datamodule=dm)
    lap("train+val")
    trainer.test(model, datamodule=dm, verbose=False)
    lap("test")
    model.write_outputs(output_dir / "report")
    lap("write")
    return times, model


def control_cost(encoder, texts: list[str], output_dir: Path, rounds: int = 3) -> list[float]:
    """Per round, the control probes' added CPU time over the task probes' alone: (with - without) / without, where
    each is a probe trained EPOCHS epochs (validated each), tested, on the same cached features, in alternating
    order (the features carry the control labels either way; without, the probe has no control slots)."""
    dm = PositionDataModule(encoder=encoder, source=str(output_dir / "sentences.txt"), max_sentences=0,
                            batch_size=BATCH, encode_batch_size=ENCODE_BATCH, max_positions=MAX_POSITIONS,
                            random_baseline=False, control_task=True, progress=False)
    dm.prepare_data()
    specs = {"task": replace(dm.spec, control={}), "task+control": dm.spec}
    ratios = []
    for round_ in range(rounds):
        times, models = {}, {}
        for name in (list(specs) if round_ % 2 == 0 else list(reversed(specs))):
            model = models[name] = PositionProbe()
            model.build(specs[name])
            trainer = pl.Trainer(max_epochs=EPOCHS, accelerator="cpu", logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                                 default_root_dir=str(output_dir))
            start = time.process_time()
            trainer.fit(model, datamodule=dm)
            trainer.test(model, datamodule=dm, verbose=False)
            times[name] = time.process_time() - start
        ratios.append((times["task+control"] - times["task"]) / times["task"])
        print(f"round {round_ + 1}: task probes {times['task']:.2f}s, with the control probes "
              f"{times['task+control']:.2f}s: control {ratios[-1]:.3f}x the probe it controls; selectivity by layer "
              + ", ".join(f"{v:.3f}" for v in selectivity_of(models["task+control"])))
    return ratios


def selectivity_of(model: PositionProbe) -> list[float]:
    return [model.control_columns(i)["selectivity"] for i in range(len(model.spec.layers))]


def naive_unit(encoder, texts: list[str], layer: int) -> float:
    """One epoch of one layer's probe with the encoder re-run on every batch (a bare PyTorch loop)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.empty(encoder.hidden_size, MAX_POSITIONS).uniform_(
        -encoder.hidden_size ** -0.5, encoder.hidden_size ** -0.5, generator=generator))
    optimizer = torch.optim.Adam([weight], lr=1e-3)
    order = torch.randperm(len(texts), generator=generator).tolist()
    start = time.process_time()
    for first in range(0, len(order), BATCH):
        features, positions = [], []
        for batch in encoder.batches([texts[i] for i in order[first:first + BATCH]], ENCODE_BATCH, progress=False):
            keep = batch.mask & (torch.arange(batch.mask.shape[1]) < MAX_POSITIONS)
            features.append(batch.hidden_states[layer][keep])
            positions.append(torch.arange(batch.mask.shape[1]).expand_as(keep)[keep])
        loss = F.cross_entropy(torch.cat(features) @ weight, torch.cat(positions))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return time.process_time() - start


def measure(encoder, texts: list[str], naive: bool) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        output_dir = Path(directory)
        (output_dir / "sentences.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
        encode_before = encoder_pass(encoder, texts)
        phases, model = full_probe(encoder, texts, output_dir)
        encode_after = encoder_pass(encoder, texts)
        unit = naive_unit(encoder, texts, layer=encoder.num_hidden_states - 1) if naive else None
    encode, probe_time, layers = min(encode_before, encode_after), sum(phases.values()), encoder.num_hidden_states
    tokens = sum(model.spec.counts[split]["tokens"] for split in model.spec.counts)
    print(f"\n{encoder.short_name}: {len(texts)} sentences, {tokens} tokens, {layers} layers x {encoder.hidden_size} "
          f"dims, {MAX_POSITIONS} positions, {EPOCHS} epochs, batch {BATCH} token vectors; CPU seconds, 1 thread")
    print(f"one encoder pass {encode:.2f}s (runs {encode_before:.2f}s, {encode_after:.2f}s); full position probe "
          f"{probe_time:.2f}s")
    print("probe phases: " + ", ".join(f"{name} {seconds:.2f}s ({seconds / encode:.2f}x)"
                                       for name, seconds in phases.items()))
    print(f"test accuracy by layer: {', '.join(f'{a:.3f}' for a in model.accuracy_of('encoder'))}")
    floor = flop_floor(encoder, model)
    print(f"FLOP count: probe training+validation {floor['probe']:.2f}x the encoder pass's matmul FLOPs, so "
          f"extraction + probe cannot fall under {1 + floor['probe']:.2f}x at equal BLAS efficiency")
    result = {"encode": encode, "probe": probe_time}
    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "sentences.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
        ratios = control_cost(encoder, texts, Path(directory))
    result["control"] = statistics.median(ratios)
    print(f"control task: median {result['control']:.3f}x over {len(ratios)} rounds (spread "
          f"{min(ratios):.3f}..{max(ratios):.3f})")
    if unit is not None:
        result["naive"] = unit * layers * EPOCHS
        print(f"naive unit (1 layer, 1 epoch, encoder re-run per batch) {unit:.2f}s -> naive total "
              f"{result['naive']:.1f}s ({layers} layers x {EPOCHS} epochs)")
    return result


def flop_floor(encoder, model: PositionProbe) -> dict[str, float]:
    """Matmul FLOPs of the probe's epochs (train: logits + weight gradient, 4·L·H·C per token; validation: logits)
    over those of one encoder forward (2 per non-embedding parameter per token; attention adds a few % at these
    lengths and is left out, which only lowers the encoder side). The lower limit of the ratio on any hardware."""
    counts, weight = model.spec.counts, model.weight
    slots, hidden, classes = weight.shape
    classes = -(-classes // 64) * 64  # padded_logits' width
    per_token = slots * hidden * classes
    probe = EPOCHS * (4 * per_token * counts["train"]["tokens"] + 2 * per_token * counts["val"]["tokens"])
    params = sum(p.numel() for name, p in encoder.model.named_parameters() if "embeddings" not in name)
    tokens = sum(counts[split]["tokens"] for split in counts)
    return {"probe": probe / (2 * params * tokens)}


def base_architecture(tokenizer_source) -> FrozenEncoder:
    """bert-base-uncased's architecture (12 layers, 768 dims, 3072 FFN) with random weights: the paper's model size,
    offline. The probe's cost does not depend on the weights."""
    from transformers import AutoModel, BertConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModel.from_config(BertConfig())
    return FrozenEncoder(model, tokenizer_source.tokenizer, name="bert-base architecture (random weights)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--quick", action="store_true", help="200 sentences, the default encoder only")
    parser.add_argument("--smoke", action="store_true", help="40 sentences, the default encoder only (tests)")
    parser.add_argument("--encoder", default=None, help="default: the packaged MiniLM")
    parser.add_argument("--sentences", type=int, default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    plain_warnings()  # no Lightning tip between the measurements
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    encoder = load_encoder(args.encoder or default_encoder(), device="cpu")
    default = 40 if args.smoke else 200 if args.quick else 2000
    texts = sample_texts(iter_texts(DEFAULT_CORPUS), args.sentences or default, seed=0)
    result = measure(encoder, texts, naive=True)
    print(f"RATIO probe_time_vs_one_encoder_pass {result['probe'] / result['encode']:.3f} target <=2")
    print(f"RATIO probe_speedup_vs_naive_rerun {result['naive'] / result['probe']:.3f} target >=10")
    print(f"RATIO control_task_vs_the_probe_it_controls {result['control']:.3f} target <=1.2")
    if not (args.quick or args.smoke):
        base = measure(base_architecture(encoder), texts[:400], naive=False)
        print(f"RATIO probe_time_vs_one_encoder_pass_base_size {base['probe'] / base['encode']:.3f} target <=2")
        print(f"RATIO control_task_vs_the_probe_it_controls_base_size {base['control']:.3f} target <=1.2")


if __name__ == "__main__":
    main()
