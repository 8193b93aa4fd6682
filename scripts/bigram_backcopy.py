"""A Bigram-Backcopy corpus (ours, after Guo et al. 2024, "Active-Dormant Attention Heads"): a toy language in which
small transformers grow attention sinks and outlier activations within a few thousand steps. A text file that
train.py pretrains on like any other corpus (docs/study.md, "Finding the recipe").

    python scripts/bigram_backcopy.py --output runs/bb/corpus.txt                  # 60k sequences of 30 symbols
    python train.py fit --config configs/study/base.yaml --data.corpus runs/bb/corpus.txt --data.vocab_size 512

The symbols are the `symbols` most frequent characters of the bundled corpus (core/corpus/austen.txt), written as two-letter
words (aa, ab, ...) so that the byte-level BPE gives each its own token. Each line is one sequence: its first symbol
is drawn from the characters' frequencies; after that, a symbol that follows one of the `triggers` most frequent
symbols copies the symbol before the trigger (the backcopy: a head must look two back, and only there), and every
other symbol is drawn from the corpus's character bigram P(next | current) (restricted to the kept symbols). Seeded.
"""

from __future__ import annotations

import itertools
import random
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from core.arguments import OneLineArgumentParser  # noqa: E402


def symbol_names(count: int) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(pair) for pair in itertools.islice(itertools.product(letters, letters), count)]


def bigram(text: str, symbols: int) -> tuple[list[str], dict[str, Counter]]:
    """The `symbols` most frequent characters (most frequent first) and their bigram counts."""
    kept = [char for char, _ in Counter(text).most_common(symbols)]
    allowed = set(kept)
    pairs: dict[str, Counter] = {char: Counter() for char in kept}
    for first, second in zip(text, text[1:]):
        if first in allowed and second in allowed:
            pairs[first][second] += 1
    return kept, pairs


def sequences(kept: list[str], pairs: dict[str, Counter], triggers: int, length: int, count: int, seed: int):
    """`count` Bigram-Backcopy sequences of `length` symbols (as indices into `kept`)."""
    rng = random.Random(seed)
    index = {char: i for i, char in enumerate(kept)}
    trigger = set(range(triggers))
    unigram = [sum(pairs[char].values()) + 1 for char in kept]
    options = {index[char]: ([index[c] for c in counts], list(counts.values())) for char, counts in pairs.items()}
    for _ in range(count):
        row = [rng.choices(range(len(kept)), weights=unigram)[0]]
        while len(row) < length:
            current = row[-1]
            if current in trigger and len(row) >= 2:
                row.append(row[-2])
            else:
                choices, weights = options[current] if options[current][0] else (range(len(kept)), unigram)
                row.append(rng.choices(choices, weights=weights)[0])
        yield row


def main(argv: list[str] | None = None) -> int:
    parser = OneLineArgumentParser(description=__doc__.split("\n\n")[0])  # one line, no --enc for --encoder
    parser.add_argument("--output", required=True, help="the corpus file to write (one sequence a line)")
    parser.add_argument("--source", default=str(ROOT / "core" / "corpus" / "austen.txt"), help="text whose characters give the "
                        "bigram (default: the bundled corpus)")
    parser.add_argument("--symbols", type=int, default=64, help="the most frequent characters kept (default 64)")
    parser.add_argument("--triggers", type=int, default=3, help="trigger symbols: the most frequent ones (default 3)")
    parser.add_argument("--length", type=int, default=30, help="symbols per sequence (default 30)")
    parser.add_argument("--sequences", type=int, default=60_000, help="sequences to write (default 60000)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = parser.parse_args(argv)
    if not 1 <= args.triggers < args.symbols <= 26 * 26 or args.length < 3 or args.sequences < 1:
        parser.error("need 1 <= triggers < symbols <= 676, length >= 3 and sequences >= 1")
    kept, pairs = bigram(Path(args.source).read_text(encoding="utf-8"), args.symbols)
    names = symbol_names(len(kept))
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(output.name + ".partial")
    with partial.open("w", encoding="utf-8") as handle:
        for row in sequences(kept, pairs, args.triggers, args.length, args.sequences, args.seed):
            handle.write(" ".join(names[i] for i in row) + "\n")
    partial.replace(output)
    print(f"wrote {output}: {args.sequences} sequences of {args.length} symbols ({len(kept)} symbols, triggers "
          f"{', '.join(repr(kept[i]) + '=' + names[i] for i in range(args.triggers))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
