"""Peak memory of `analyze.py trajectory` over 4 checkpoints against 1, side by side in one run (issue 15): one
encoder is resident at a time, so the peak must stay that of one analysis.

    python benchmarks/bench_trajectory.py            # checkpoints of a 6-layer, 768-wide RoBERTa (~200 MB each)
    python benchmarks/bench_trajectory.py --quick    # 4 layers, 384 wide
    python benchmarks/bench_trajectory.py --smoke    # 2 layers, 64 wide, seconds (the test suite runs this)

The checkpoints are written as train.py writes them (hyper-parameters, `model.` weights, global_step, the tokenizer
embedded as text), each with its own random weights, so every one is read and built anew. Each trajectory runs as
`analyze.py trajectory --encoders ...` in a fresh process with a fixed glibc mmap threshold (as bench_eval.py), and
its peak resident set (ru_maxrss) is compared: 4 checkpoints against the first one alone, on the same sentences.
Output: `RATIO trajectory_peak_memory_4_vs_1 <value> target <=1.10`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_eval import analyze_peak_mib  # noqa: E402  (one child process for every analyze.py peak)

SIZES = {"full": (768, 6, 12, 3072), "quick": (384, 4, 6, 1536), "smoke": (64, 2, 4, 128)}
CHECKPOINTS = 4


def tokenizer(folder: Path, vocab_size: int = 2000):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import RobertaTokenizerFast

    from datamodules.text import DEFAULT_CORPUS

    lines = DEFAULT_CORPUS.read_text(encoding="utf-8").splitlines()[:3000]
    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(lines, vocab_size=vocab_size, min_frequency=1,
                                special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    folder.mkdir(parents=True, exist_ok=True)
    trainer.save_model(str(folder))
    return RobertaTokenizerFast(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"))


def write_checkpoints(folder: Path, size: str) -> list[Path]:
    """CHECKPOINTS checkpoints of one architecture (steps 100, 200, ...), each with its own random weights."""
    import torch

    from core.tokenizers import tokenizer_files
    from lightning_modules.mlm import ARCHITECTURE, build_model

    hidden, layers, heads, intermediate = SIZES[size]
    tok = tokenizer(folder / "tokenizer")
    hparams = {"vocab_size": len(tok), "hidden_size": hidden, "num_hidden_layers": layers,
               "num_attention_heads": heads, "intermediate_size": intermediate, "max_position_embeddings": 130,
               "position_embeddings": True, "pad_vocab_to_multiple_of": 1}
    assert set(ARCHITECTURE) <= set(hparams)
    paths = []
    for index in range(CHECKPOINTS):
        torch.manual_seed(index)
        model = build_model(len(tok), hidden, layers, heads, intermediate, 130, dropout=0.0, position_embeddings=True)
        path = folder / f"step={100 * (index + 1)}.ckpt"
        torch.save({"state_dict": {f"model.{key}": value for key, value in model.state_dict().items()},
                    "hyper_parameters": hparams, "global_step": 100 * (index + 1),
                    "MLMDataModule": {"tokenizer_files": tokenizer_files(tok)}}, path)
        paths.append(path)
    return paths


def peak(encoders: list[Path], data: Path, output: Path, sentences: int) -> float:
    return analyze_peak_mib(["trajectory", "--encoders", *map(str, encoders), "--data", str(data), "--max_sentences",
                             str(sentences), "--max_length", "64", "--num_pairs", "50", "--minibatch", "20",
                             "--output_dir", str(output), "--no_progress", "--device", "cpu"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="smallest sizes (tests)")
    args = parser.parse_args()
    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    sentences = {"smoke": 40, "quick": 100, "full": 200}[size]
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        checkpoints = write_checkpoints(folder, size)
        data = folder / "sentences.txt"
        from datamodules.text import DEFAULT_CORPUS

        lines = [line for line in DEFAULT_CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()]
        data.write_text("\n".join(lines[1000:1000 + sentences]) + "\n", encoding="utf-8")
        megabytes = checkpoints[0].stat().st_size / 2 ** 20
        one = peak(checkpoints[:1], data, folder / "one", sentences)
        many = peak(checkpoints, data, folder / "many", sentences)
        print(f"checkpoints of {megabytes:.0f} MiB: 1 checkpoint peak {one:.0f} MiB, {CHECKPOINTS} checkpoints peak "
              f"{many:.0f} MiB (holding them all would add ~{(CHECKPOINTS - 1) * megabytes:.0f} MiB)")
        print(f"METRIC trajectory_checkpoint_mib {megabytes:.1f}")
        print(f"RATIO trajectory_peak_memory_{CHECKPOINTS}_vs_1 {many / one:.3f} target <=1.10", flush=True)


if __name__ == "__main__":
    main()
