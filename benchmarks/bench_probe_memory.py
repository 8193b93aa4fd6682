"""The position probe at SST-2's size within its memory budget (issue 13), and its time against one encoder pass.

    python benchmarks/bench_probe_memory.py            # 0.7M tokens x 13 layers x 768 (SST-2's size), ~14 GB float16
    python benchmarks/bench_probe_memory.py --quick    # 70k tokens
    python benchmarks/bench_probe_memory.py --smoke    # 7k tokens, seconds (the test suite runs this)

The features are synthetic (a stand-in encoder of bert-base's shape whose hidden states are a cheap, position-
decodable function of the input: 13 layers x 768) so that extraction costs no real encoder time; the budget
(--data.max_memory_gb) is set to a quarter of the float32 features, so they are held in float16 and part of them
streams from a memory-mapped file. Peak memory is the process's anonymous resident memory (/proc/self/status RssAnon,
sampled every 20 ms: the page cache of the memory-mapped file is the kernel's to evict and is not counted) above what
it was before the probe, against the budget plus 1 GiB for what is not features (the probe and its optimiser, one
evaluation batch of 4096 vectors, the stand-in encoder, Lightning): float32 features of SST-2's size would be 27 GiB. The probe's time (extraction + `--epochs` epochs + test) is set against one pass of
bert-base's architecture (random weights, the paper's model size) over the same sentences, measured on a sample of
them and scaled by their token count (an encoder pass is linear in tokens at these lengths).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import pytorch_lightning as pl  # noqa: E402

from datamodules.features import GIB  # noqa: E402
from datamodules.probing import PositionDataModule  # noqa: E402
from datamodules.text import DEFAULT_CORPUS, iter_texts  # noqa: E402
from lightning_modules.encoder import FrozenEncoder, default_encoder, load_encoder  # noqa: E402
from lightning_modules.probes import PositionProbe  # noqa: E402

LAYERS, HIDDEN, MAX_LENGTH = 13, 768, 24
FIXED = GIB  # what is not features: the probe and its optimiser, one evaluation batch, the stand-in, Lightning


class StandIn(nn.Module):
    """bert-base's shape (13 hidden states x 768) at almost no cost: token and position tables, scaled per layer."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        from transformers import BertConfig

        self.config = BertConfig(vocab_size=vocab_size, hidden_size=HIDDEN, num_hidden_layers=LAYERS - 1,
                                 max_position_embeddings=512)
        generator = torch.Generator().manual_seed(0)
        self.tokens = nn.Parameter(torch.randn(vocab_size, HIDDEN, generator=generator))
        self.positions = nn.Parameter(torch.randn(512, HIDDEN, generator=generator))

    def forward(self, input_ids, attention_mask, output_hidden_states=True, return_dict=True):
        base = self.tokens[input_ids] + self.positions[: input_ids.shape[1]]
        return SimpleNamespace(hidden_states=tuple(base * (1 + 0.1 * layer) for layer in range(LAYERS)))


class AnonymousPeak:
    """The peak of RssAnon (bytes) while the block runs, sampled in a thread."""

    def __enter__(self) -> AnonymousPeak:
        self.start = self.peak = self.read()
        self.running = True
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.running = False
        self.thread.join()

    def sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.read())
            time.sleep(0.02)

    @staticmethod
    def read() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
        return 0


def sentences(tokens: int, tokenizer) -> list[str]:
    """Corpus sentences (repeated as needed) until their tokens, cut at MAX_LENGTH, reach `tokens`."""
    texts, total, corpus = [], 0, list(iter_texts(DEFAULT_CORPUS))
    while total < tokens:
        for text in corpus:
            texts.append(text)
            total += min(len(tokenizer(text)["input_ids"]), MAX_LENGTH)
            if total >= tokens:
                break
    return texts


def encoder_pass_seconds(texts: list[str], tokenizer, sample: int) -> tuple[float, float]:
    """(seconds of one bert-base-architecture pass over a sample of `texts`, scaled to all their tokens; the sample's
    share of the tokens)."""
    from transformers import AutoModel, BertConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        base = FrozenEncoder(AutoModel.from_config(BertConfig()), tokenizer, name="bert-base architecture")
    chosen = texts[:sample]
    count = sum(min(len(tokenizer(t)["input_ids"]), MAX_LENGTH) for t in chosen)
    total = sum(min(len(tokenizer(t)["input_ids"]), MAX_LENGTH) for t in texts)
    start = time.perf_counter()
    for _ in base.batches(chosen, 32, MAX_LENGTH, progress=False):
        pass
    return (time.perf_counter() - start) * total / count, count / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--quick", action="store_true", help="70k tokens")
    parser.add_argument("--smoke", action="store_true", help="7k tokens, seconds (tests)")
    parser.add_argument("--tokens", type=int, default=None, help="default 700000 (SST-2's size)")
    parser.add_argument("--epochs", type=int, default=1, help="probe epochs timed (the paper trains 10)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    pl.seed_everything(0, verbose=False)
    tokenizer = load_encoder(default_encoder(), device="cpu").tokenizer
    target = args.tokens or (7_000 if args.smoke else 70_000 if args.quick else 700_000)
    texts = sentences(target, tokenizer)
    encoder = FrozenEncoder(StandIn(len(tokenizer)), tokenizer, name="bert-base-shaped stand-in")
    float32 = target * LAYERS * HIDDEN * 4
    budget = float32 / 4 / GIB  # float16 then, and only half of that fits: part streams from the file
    with tempfile.TemporaryDirectory() as directory:
        source = Path(directory) / "sentences.txt"
        source.write_text("\n".join(texts) + "\n", encoding="utf-8")
        data = PositionDataModule(source=str(source), encoder=encoder, max_length=MAX_LENGTH, random_baseline=False,
                                  max_memory_gb=budget, cache_dir=directory, progress=False)
        trainer = pl.Trainer(max_epochs=args.epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                             default_root_dir=directory)
        model = PositionProbe()
        start = time.perf_counter()
        with AnonymousPeak() as memory:
            trainer.fit(model, datamodule=data)
            trainer.test(model, datamodule=data, verbose=False)
        probe_seconds = time.perf_counter() - start
        storage = data.spec.data["features"]
        tokens = sum(split["tokens"] for split in data.spec.counts.values())
        data.close()
    encoder_seconds, share = encoder_pass_seconds(texts, tokenizer, sample=max(64, len(texts) // 50))
    grown = memory.peak - memory.start
    print(f"{len(texts)} sentences, {tokens} tokens x {LAYERS} layers x {HIDDEN}: features {float32 / GIB:.2f} GiB "
          f"in float32; budget {budget:.3f} GiB -> held as {storage['dtype']} ({storage['gib']:.3f} GiB), splits "
          f"{storage['splits']}")
    print(f"anonymous memory: {memory.start / GIB:.2f} GiB before, peak {memory.peak / GIB:.2f} GiB "
          f"(+{grown / GIB:.3f} GiB)")
    print(f"probe (extraction + {args.epochs} epoch(s) + test) {probe_seconds:.1f}s; one bert-base-architecture "
          f"pass over the same sentences {encoder_seconds:.1f}s (measured on {share:.1%} of the tokens, scaled)")
    print(f"METRIC probe_peak_anonymous_gib {grown / GIB:.3f}  (budget {budget:.3f} GiB)")
    allowance = budget * GIB + FIXED  # the features' budget, and the rest: probe, optimiser, one eval batch, Lightning
    print(f"RATIO probe_memory_growth_vs_budget_plus_1gib {grown / allowance:.3f} target <=1")
    print(f"RATIO probe_time_per_epoch_vs_one_encoder_pass {probe_seconds / args.epochs / encoder_seconds:.3f} "
          "target <=2")


if __name__ == "__main__":
    main()
