"""The semantic protocols: WiC (Luo et al. §4.2, Table 1) and STS (§4.3, Table 2), per layer and per variant.

    wic(setting, items, reference.variants)           # best accuracy over layers and thresholds 0.1..0.9
    sts(setting, pairs, reference.variants, static=None)   # Spearman x 100 of mean-pooled cosines, per layer

Pairs are sharded over ranks (both sides of a pair on one rank), each pair scored once into a PairCosine metric
whose sum reduction assembles every pair's cosine on every rank.
"""

from __future__ import annotations

import torch
from torch import Tensor

from analyses.reference import Setting, counter, number, per_layer, views
from core.errors import UserError
from core.wording import plural
from datamodules.pairs import StsPair, WicItem
from datamodules.words import read_static_vectors, sentence_words, static_sentence_vector
from lightning_modules.pooling import lost_spans, mean_pool, span_vectors
from metrics.geometry import cosine
from metrics.similarity import PairCosine, spearman, threshold_accuracy
from metrics.transforms import Variant

THRESHOLDS = [round(0.1 * t, 1) for t in range(1, 10)]  # WiC: same sense iff cosine >= threshold


def _pair_loop(setting: Setting, texts: list[str], variants: list[Variant], num_pairs: int, vectors_of,
               offsets: bool, desc: str, spans: list | None = None) -> tuple[dict[str, PairCosine], int, dict]:
    """Encode the flattened pairs (pair p = texts 2p, 2p+1) and score each pair once both sides are encoded; each
    group of variants takes its vectors from its own view of the batch (reference.views: SoftDecay's states).
    With `spans` (each text's target), a target not found is lost to truncation or written inside a special token
    (counts["targets_in_special_tokens"]); without, every sentence not found is lost.

    A chunk of sorted sentences always holds both sides of its pairs (even sizes), so at most a chunk is pending.
    """
    encoder = setting.encoder
    metrics = {v.key: PairCosine(num_pairs, encoder.num_hidden_states).to(encoder.device) for v in variants}
    lost, truncated, special, inside, unknown = (counter(encoder.device) for _ in range(5))
    pending: dict[int, list] = {}
    for batch in setting.batches(texts, offsets, desc, pairs=True):
        rows = batch.rows
        groups = views(batch, variants)
        picked = [vectors_of(rows, view) for _, view, _ in groups]  # per group: ([layers, found, hidden], found)
        found = picked[0][1]
        if spans is None:
            lost.update(len(rows) - len(found))
        else:
            cut, within = lost_spans(batch, [[spans[row]] for row in rows], [(row, 0) for row in found])
            lost.update(cut)
            inside.update(within)
        truncated.update(batch.num_truncated)
        special.update(batch.num_special_in_text)
        unknown.update(batch.num_unknown)
        for column, row in enumerate(found):
            pending.setdefault(rows[row] // 2, [None, None])[rows[row] % 2] = [v[:, column] for v, _ in picked]
        done = [p for p, sides in pending.items() if sides[0] is not None and sides[1] is not None]
        if done:
            for index, (_, _, group) in enumerate(groups):
                a = torch.stack([pending[p][0][index] for p in done], 1)
                b = torch.stack([pending[p][1][index] for p in done], 1)
                for variant in group:
                    metrics[variant.key].update(torch.tensor(done), variant.apply(a), variant.apply(b))
            for p in done:
                del pending[p]
    for metric in metrics.values():  # no pair scored here (this rank, or all lost): its zeros are its part of the sum
        if not metric.update_called:
            empty = torch.zeros(encoder.num_hidden_states, 0, encoder.hidden_size, device=encoder.device)
            metric.update(torch.zeros(0, dtype=torch.long), empty, empty)
    counts = {"num_truncated": int(truncated.compute()), "num_special_in_text": int(special.compute()),
              "num_unknown": int(unknown.compute())}
    if spans is not None:
        counts["targets_in_special_tokens"] = int(inside.compute())
    return metrics, int(lost.compute()), counts


def wic(setting: Setting, items: list[WicItem], variants: list[Variant]) -> dict:
    """Luo et al. (2021) §4.2 / Pilehvar & Camacho-Collados (2019): same sense iff the cosine of the target word's
    vectors (sub-word pieces averaged) in the two sentences reaches a threshold; the best threshold of 0.1..0.9 and
    the best layer of 1..L (the embedding output is reported, not searched), on the given data (an oracle choice, as
    in the paper)."""
    texts = [s for item in items for s in (item.sentence1, item.sentence2)]
    spans = [span for item in items for span in (item.span1, item.span2)]

    def vectors_of(rows, batch):
        vectors, found = span_vectors(batch, [[spans[row]] for row in rows])
        return vectors, [r for r, _ in found]

    metrics, lost, counts = _pair_loop(setting, texts, variants, len(items), vectors_of, True, "wic", spans)
    labels = torch.tensor([item.label for item in items])
    thresholds = torch.tensor(THRESHOLDS, dtype=torch.float64)
    report = {"num_pairs": len(items), "targets_lost_to_truncation": lost, **counts, "thresholds": THRESHOLDS}
    per_variant = {}
    for variant in variants:
        cosines, seen = metrics[variant.key].compute()
        seen = seen.reshape(-1).cpu()  # [pairs] (metrics/base.py keeps a one-pair state [1])
        if int(seen.sum()) < 2:
            raise UserError(f"only {plural(int(seen.sum()), 'WiC pair')} could be scored "
                            f"({plural(lost, 'sentence')} lost their target word to truncation; a larger --max_length keeps "
                            "it" + (f"; {counts['targets_in_special_tokens']} have it written inside a special token, "
                                    "as 'mask' in '[MASK]'" if counts["targets_in_special_tokens"] else "")
                            + "): WiC needs at least 2")
        cosines, gold = cosines.reshape(len(items), -1)[seen].cpu(), labels[seen]
        accuracy = threshold_accuracy(cosines, gold, thresholds)  # [layers, thresholds]
        best_t = accuracy.argmax(1)
        per_variant[variant.key] = [{"accuracy": round(float(accuracy[layer, t]), 6), "threshold": THRESHOLDS[t]}
                                    for layer, t in enumerate(best_t.tolist())]
        layer = 1 + int(accuracy[1:].max(1).values.argmax())  # the best of layers 1..L (0: the embeddings)
        key = "best" if variant.key == "raw" else f"best_{variant.key}"
        report[key] = {"accuracy": round(float(accuracy[layer].max()), 6), "layer": layer,
                       "threshold": THRESHOLDS[int(best_t[layer])]}
        report["num_scored"] = int(seen.sum())
        report["baseline"] = round(float(gold.double().mean()), 6) if gold.numel() else None  # all "same sense"
    report["layers"] = [{"layer": layer, **{key: rows[layer] for key, rows in per_variant.items()}}
                        for layer in range(setting.encoder.num_hidden_states)]
    return report


def sts(setting: Setting, pairs: list[StsPair], variants: list[Variant], static: str | None = None,
        static_lowercase: bool = False) -> dict:
    """Spearman x 100 between the cosine of mean-pooled sentence embeddings (padding excluded) and the gold
    scores, per layer and variant; optionally the same for averaged static word vectors (GloVe format; words as
    written, or lowercased with `static_lowercase`: ours)."""
    texts = [s for pair in pairs for s in (pair.sentence1, pair.sentence2)]

    def vectors_of(rows, batch):
        return mean_pool(batch.hidden_states, batch.mask), list(range(len(rows)))

    metrics, _, counts = _pair_loop(setting, texts, variants, len(pairs), vectors_of, False, "sts")
    gold = torch.tensor([pair.score for pair in pairs], dtype=torch.float64)
    report = {"num_pairs": len(pairs), **counts}
    per_variant, constant = {}, []
    for variant in variants:
        cosines, seen = metrics[variant.key].compute()
        rho = 100 * spearman(cosines.reshape(len(pairs), -1).cpu(), gold)
        per_variant[variant.key] = rho
        layer = 1 + int(rho[1:].nan_to_num(float("-inf")).argmax())  # the best of layers 1..L
        key = "best" if variant.key == "raw" else f"best_{variant.key}"
        report[key] = {"spearman": number(rho[layer]), "layer": layer if not rho[layer].isnan() else None}
        if rho.isnan().all() and len(pairs) > 1 and len(set(gold.tolist())) > 1:  # the gold is fine: the cosines
            constant.append(variant.key)
    if constant:
        report["spearman_warning"] = (f"Spearman not computed ('-') for {', '.join(constant)}: every pair's cosine "
                                      "is the same in every layer (the sentences' vectors do not differ: does "
                                      "--max_length leave only the special tokens?)")
    report["layers"] = per_layer(per_variant, setting.encoder.num_hidden_states)
    report["static_baseline"] = static_baseline(pairs, gold, static, setting.progress, static_lowercase) \
        if static else None
    return report


def static_baseline(pairs: list[StsPair], gold: Tensor, path: str, progress: bool = False,
                    lowercase: bool = False) -> dict:
    """Spearman x 100 of averaged static word vectors (the paper's GloVe row: SentEval's bag of words, each word
    looked up as written; `lowercase`: lowercased, ours), with the word coverage and the case used."""
    vocabulary = set().union(*(sentence_words(p.sentence1, lowercase) | sentence_words(p.sentence2, lowercase)
                               for p in pairs))
    vectors, dim = read_static_vectors(path, vocabulary, progress, lowercase)
    a = torch.stack([static_sentence_vector(p.sentence1, vectors, dim, lowercase) for p in pairs])
    b = torch.stack([static_sentence_vector(p.sentence2, vectors, dim, lowercase) for p in pairs])
    rho = 100 * spearman(cosine(a, b), gold)
    return {"file": str(path), "spearman": number(rho), "dim": dim,
            "word_coverage": round(len(vectors) / max(len(vocabulary), 1), 6),
            "word_case": "lowercased (--static_lowercase, ours)" if lowercase else "as written (SentEval's lookup)"}
