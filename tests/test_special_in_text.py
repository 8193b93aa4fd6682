"""Issue 31: special tokens written in the text are special tokens. `--exclude_special` drops every token whose id is
a special id ([CLS], [SEP], [PAD], [MASK], <s>, </s> ... written in a line, not only those the tokenizer adds; [UNK]
stands for a word and counts), padding never counts, and every report says how many it found in the text
(`num_special_in_text`). Counts planted in the sentences, checked against the tokens of the same sentences with the
special tokens taken out of the text (docs/analyses.md).

    .venv/bin/pytest tests/test_special_in_text.py -q
"""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

import analyze
from datamodules.probing import PositionDataModule
from datamodules.words import WORD, special_pattern, word_contexts, word_matches
from lightning_modules.encoder import FrozenEncoder, load_encoder
from tests.tiny import save_tiny_encoder

# (sentence, special tokens written in it): BERT's ids; [UNK] is a word the vocabulary lacks, not a special token
BERT_LINES = [("he said [SEP] no more", 1), ("[CLS] she came [MASK] late [PAD] and left", 3),
              ("the house was quiet", 0), ("an [UNK] word stays", 0), ("[SEP][SEP] two at once", 2)]
ROBERTA_LINES = [("first part </s> second part", 1), ("<s> a <mask> b <pad>", 3), ("no special here", 0)]
SPECIALS = ("[SEP]", "[CLS]", "[MASK]", "[PAD]", "</s>", "<s>", "<mask>", "<pad>")


def counted_by_hand(tokenizer, lines) -> int:
    """The tokens that count with --exclude_special: those of the pieces of each line between its special tokens,
    each piece tokenised alone, none added (as a tokenizer splits a text at its special tokens first)."""
    pattern = "|".join(re.escape(token) for token in SPECIALS)
    return sum(len(tokenizer(piece, add_special_tokens=False)["input_ids"]) for text, _ in lines
               for piece in re.split(pattern, text) if piece)


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_the_encoder_excludes_special_tokens_written_in_the_text_and_counts_them(kind, bert_tok, roberta_tok,
                                                                                  tmp_path):
    tokenizer, lines = (bert_tok, BERT_LINES) if kind == "bert" else (roberta_tok, ROBERTA_LINES)
    encoder = load_encoder(save_tiny_encoder(tmp_path / kind, kind, tokenizer), device="cpu", exclude_special=True)
    texts = [text for text, _ in lines]
    batches = list(encoder.batches(texts, batch_size=2, progress=False))  # padded: [PAD] ids beyond each line
    assert sum(b.num_special_in_text for b in batches) == sum(n for _, n in lines)
    assert sum(int(b.mask.sum()) for b in batches) == counted_by_hand(tokenizer, lines)
    for batch in batches:  # a planted special id never counts where it stands; padding never does either
        kept = batch.input_ids[batch.mask]
        assert not set(kept.tolist()) & set(tokenizer.all_special_ids) - {tokenizer.unk_token_id}
    included = FrozenEncoder(encoder.model, tokenizer, exclude_special=False)
    every = sum(len(ids) for ids in tokenizer(texts)["input_ids"])  # the added ones and those in the text
    assert sum(int(b.mask.sum()) for b in included.batches(texts, batch_size=2, progress=False)) == every


def test_every_report_says_how_many_special_tokens_it_found_in_the_text(bert_tok, tmp_path):
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    lines = BERT_LINES * 4  # 20 sentences: anisotropy's pairs need a few
    data = tmp_path / "lines.txt"
    data.write_text("".join(f"{text}\n" for text, _ in lines))
    planted = sum(n for _, n in lines)
    common = ["--encoder", str(encoder), "--data", str(data), "--no_progress", "--clip", "none"]
    reports = {}
    for name, extra in (("outliers", ["--exclude_special"]), ("anisotropy", ["--exclude_special", "--num_pairs", "5"]),
                        ("outliers-included", [])):
        command = name.split("-")[0]
        out = tmp_path / name
        argv = [command, *common, "--output_dir", str(out), *extra]
        if command == "outliers":
            argv.remove("--clip"), argv.remove("none")
        assert analyze.main(argv) == 0
        reports[name] = json.loads((out / f"{command}.json").read_text())
    for name in ("outliers", "anisotropy"):
        assert reports[name]["special_tokens"] == "excluded" and reports[name]["num_special_in_text"] == planted
    assert reports["outliers"]["num_tokens"] == counted_by_hand(bert_tok, lines)
    included = reports["outliers-included"]
    assert included["special_tokens"] == "included" and included["num_special_in_text"] == planted
    assert included["num_tokens"] == sum(len(ids) for ids in bert_tok([t for t, _ in lines])["input_ids"])


def test_the_probes_features_exclude_special_tokens_written_in_the_text(bert_tok, tmp_path):
    encoder = load_encoder(save_tiny_encoder(tmp_path / "bert", "bert", bert_tok), device="cpu", exclude_special=True)
    lines = BERT_LINES * 4
    data = tmp_path / "lines.txt"
    data.write_text("".join(f"{text}\n" for text, _ in lines))
    module = PositionDataModule(source=str(data), encoder=encoder, exclude_special=True, random_baseline=False,
                                max_length=16, max_positions=16, progress=False)
    module.setup("fit")
    assert module.spec.data["num_special_in_text"] == sum(n for _, n in lines)
    assert sum(split["tokens"] for split in module.spec.counts.values()) == counted_by_hand(bert_tok, lines)
    module.close()


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_a_word_written_as_a_special_token_has_no_vector(kind, bert_tok, roberta_tok, tmp_path):
    """Self-similarity and WiC find a word's tokens by character offsets: the "sep" of a literal "[SEP]" (or the "s"
    of "</s>") is not a word, and the special token's vector is never taken for it; the words around it are found
    with the tokens the tokenizer gives them, looked up here in its own offsets."""
    from lightning_modules.pooling import span_tokens

    tokenizer, lines = (bert_tok, BERT_LINES) if kind == "bert" else (roberta_tok, ROBERTA_LINES)
    encoder = load_encoder(save_tiny_encoder(tmp_path / kind, kind, tokenizer), device="cpu")
    texts = [text for text, _ in lines]
    inputs, _ = encoder.tokenize(texts, offsets=True)
    special = set(tokenizer.all_special_ids) - {tokenizer.unk_token_id}
    plain = tokenizer(texts, return_offsets_mapping=True)
    for row, (text, ids, offsets) in enumerate(zip(texts, plain["input_ids"], plain["offset_mapping"], strict=True)):
        for match in re.finditer(r"\w+", text):
            expected = [j for j, ((a, b), token) in enumerate(zip(offsets, ids, strict=True))
                        if b > a and a < match.end() and b > match.start() and token not in special]
            assert span_tokens(inputs["offsets"][row], match.span()) == expected
            inside_special = any(text[a:b] in SPECIALS and a <= match.start() and match.end() <= b
                                 for (a, b), token in zip(offsets, ids, strict=True) if token in special)
            assert (expected == []) == inside_special, (text, match.group())


CASES = ["a [MASK] b, [mask] c and [Mask]d", "x<unk>y <UNK> unk<unk>unk", "a <mask> b</s>c<s>d<pad>pad",
         "[UNK] [SEP][SEP]sep [CLS]cls", "plain words only"]


@pytest.mark.parametrize("kind", ["minilm", "roberta"])
def test_the_words_inside_special_tokens_are_those_the_tokenizer_reads_as_special_tokens(kind, minilm_path,
                                                                                         roberta_tok):
    """`word_matches` leaves out exactly the words that the tokenizer itself reads as part of a special token written
    in the text, found here in its own offsets: case as it matches them (the packaged MiniLM, BERT uncased, lowercases
    the text but matches "[MASK]" before that: "[mask]" and "[Mask]" are the word in brackets; RoBERTa reads "<unk>"
    as its unknown token, "<UNK>" as letters)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_path) if kind == "minilm" else roberta_tok
    specials, ids = set(tokenizer.all_special_tokens), set(tokenizer.all_special_ids)
    pattern = special_pattern(tokenizer.all_special_tokens)
    left_out = 0
    for text in CASES:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        inside = [(a, b) for token, (a, b) in zip(encoded["input_ids"], encoded["offset_mapping"], strict=True)
                  if token in ids and text[a:b] in specials]
        words = [m.span() for m in WORD.finditer(text)]
        expected = [(s, e) for s, e in words if not any(a <= s and e <= b for a, b in inside)]
        assert [m.span() for m in word_matches(text, pattern)] == expected, text
        assert [m.span() for m in word_matches(text)] == words  # no special tokens given: every word counts
        left_out += len(words) - len(expected)
    assert left_out == (5 if kind == "minilm" else 6)  # MASK, UNK SEP SEP CLS; unk unk, mask s s pad


def test_the_paper_samples_its_words_outside_its_tokenizers_special_tokens(roberta_tok, tmp_path):
    """analyze.py paper draws each training set's self-similarity words with its encoder's special tokens: WikiText's
    "<unk>" gives no word "unk" (counted by hand with the special tokens cut out)."""
    from argparse import Namespace

    from analyses.paper import Inputs, read_contexts

    lines = [f"the {word} <unk> of {word} {n}" for n in range(4) for word in ("cat", "dog", "owl")] + \
        [f"<unk> <unk> {n}" for n in range(3)]  # distinct lines (a repeated one is one context): digits are no words
    data = tmp_path / "wiki.txt"
    data.write_text("".join(f"{line}\n" for line in lines))
    counts = words_by_hand(lines, roberta_tok.all_special_tokens)
    qualifying = sorted(w for w, n in counts.items() if n >= 4)
    inputs = Inputs(None, None, sources={"sst2": (str(data), None)})
    args = Namespace(pool_sentences=0, num_words=len(qualifying), min_sentences=4, seed=0, no_progress=True)
    read_contexts(args, inputs, roberta_tok)
    contexts = inputs.contexts["sst2"]
    assert contexts.num_candidates == len(qualifying) == 5 and sorted(contexts.words) == qualifying
    assert "unk" not in contexts.words


def words_by_hand(lines, specials) -> Counter:
    """The sentences each word occurs in, counted with the special tokens cut out of each line first (as the
    tokenizer splits a text at them before anything else)."""
    pattern = "|".join(re.escape(token) for token in specials)
    return Counter(word for line in lines for word in {w.lower() for w in re.findall(r"[^\W\d_]+",
                                                                                       re.sub(pattern, " ", line))})


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_self_similarity_never_samples_a_word_written_only_inside_special_tokens(kind, bert_tok, roberta_tok,
                                                                                 tmp_path):
    """A word that occurs only inside the tokenizer's special tokens written in the text (BERT's "[MASK]"; RoBERTa's
    "<unk>", as WikiText writes its unknown words) is no candidate: it was sampled, and then had no token of its own
    (`contexts_in_special_tokens`, num_words below the number asked) or the special token's (<unk> is a word's
    stand-in, so its vector was taken for "unk"). Planted with --max_length 16 (14 tokens of text; a word has at least
    one token and at most one a byte): the candidates are counted by hand with the special tokens cut out; the
    occurrence after 20 other words, past the cut, is never drawn; none is inside a special token."""
    tokenizer, special = (bert_tok, "[MASK]") if kind == "bert" else (roberta_tok, "<unk>")
    word = special.strip("[]<>").lower()
    filler = " ".join(f"w{chr(97 + i)}" for i in range(20))  # 20 words in 3 lines: never a candidate
    lines = [f"alpha {special} beta lamp", f"gamma {special} lamp",  # the special word in 4 lines, never outside one
             f"{special} {filler}", f"{filler} {special}",
             f"{filler} house",  # house: past the cut
             "house kappa lamp", "house lambda lamp", "house omega", "house sigma"]  # house: read four times; lamp too
    counts = words_by_hand(lines, tokenizer.all_special_tokens)
    qualifying = sorted(w for w, n in counts.items() if n >= 4)
    assert qualifying == ["house", "lamp"] and word not in counts  # the plant: the special word has no occurrence
    assert word in word_contexts(lines, 3, 4).words  # without the tokenizer's special tokens it was a candidate
    data = tmp_path / "lines.txt"
    data.write_text("".join(f"{line}\n" for line in lines))
    encoder = save_tiny_encoder(tmp_path / kind, kind, tokenizer)
    out = tmp_path / "out"
    assert analyze.main(["self-similarity", "--encoder", str(encoder), "--data", str(data), "--num_words", "2",
                         "--min_sentences", "4", "--max_length", "16", "--num_pairs", "2", "--no_progress",
                         "--output_dir", str(out)]) == 0
    report = json.loads((out / "self_similarity.json").read_text())
    assert report["num_candidates"] == len(qualifying) and sorted(report["words"]) == qualifying
    assert report["contexts_in_special_tokens"] == 0 and report["contexts_lost_to_truncation"] == 0
    assert report["num_words"] == 2  # as asked: house and lamp with 4 contexts each
    encoded = [line for line in lines if {"house", "lamp"} & set(line.split()) and filler not in line]  # those read
    assert report["num_sentences"] == len(encoded) and report["num_truncated"] == 0
    written = sum(line.count(special) for line in encoded)  # <unk> stands for a word: never a special in the text
    assert report["num_special_in_text"] == (0 if special == tokenizer.unk_token else written)
    assert all(row["raw"]["self_similarity"] is not None for row in report["layers"])


def test_wic_counts_targets_inside_special_tokens_apart_from_truncated_ones(bert_tok, tmp_path):
    """WiC pairs whose target is the "MASK" of a literal "[MASK]" (2 sentences) or stands after the --max_length cut
    (1 sentence: after 20 words, at most 14 tokens kept) are not scored; each is counted under its own key."""
    filler = " ".join(f"w{chr(97 + i)}" for i in range(20))
    pairs = [("the [MASK] here", "a MASK there", True),  # target in a special token, then a plain word
             ("one MASK", "two [MASK]", False),  # a plain word, then a special token at the end of the line
             (f"{filler} MASK", "three MASK", True),  # cut off by truncation
             ("four MASK", "five MASK", True), ("six MASK", "seven MASK", False)]  # scored
    rows = [{"word": "mask", "sentence1": a, "sentence2": b, "start1": a.rindex("MASK"), "end1": a.rindex("MASK") + 4,
             "start2": b.rindex("MASK"), "end2": b.rindex("MASK") + 4, "label": label} for a, b, label in pairs]
    data = tmp_path / "wic.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    assert analyze.main(["wic", "--encoder", str(encoder), "--data", str(data), "--max_length", "16", "--clip", "none",
                         "--no_progress", "--output_dir", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "wic.json").read_text())
    assert report["targets_in_special_tokens"] == 2 and report["targets_lost_to_truncation"] == 1
    assert report["num_scored"] == 2 and report["num_truncated"] == 1 and report["num_special_in_text"] == 2


def test_added_tokens_marked_special_are_special_tokens_for_the_words_too(minilm_path, tmp_path):
    """A tokenizer's added token marked special (`add_tokens(..., special_tokens=True)`, a hub tokenizer's reserved
    tokens, a bare tokenizers file's unnamed ones) is read as one token wherever it is written, though
    `all_special_tokens` leaves it out: "ent" of "<ent>" is no word (it had the vector of the token <ent>). Expected
    from the tokenizer's own tokens: the words whose characters lie inside a token that is an added special one."""
    from argparse import Namespace

    from transformers import AutoTokenizer

    from analyses.paper import Inputs, read_contexts
    from core.tokenizers import special_strings

    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    tokenizer.add_tokens(["<ent>", "<|reserved_0|>"], special_tokens=True)
    assert "<ent>" not in tokenizer.all_special_tokens  # the plant: a special token all_special_tokens misses
    added = {token.content for token in tokenizer.added_tokens_decoder.values() if token.special}
    lines = [f"the {word} met <ent> today <|reserved_0|> [MASK]" for word in ("cat", "dog", "owl", "fox")]
    inside = set()
    for text in lines:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        spans = [(a, b) for token, (a, b) in zip(encoded["input_ids"], encoded["offset_mapping"], strict=True)
                 if tokenizer.convert_ids_to_tokens(token) in added]
        inside |= {m.group().lower() for m in WORD.finditer(text) if any(a <= m.start() and m.end() <= b
                                                                         for a, b in spans)}
    assert inside == {"ent", "reserved", "mask"}
    assert set(special_strings(tokenizer)) == added | set(tokenizer.all_special_tokens)
    data = tmp_path / "lines.txt"
    data.write_text("".join(f"{line}\n" for line in lines))
    counts = Counter(word for line in lines for word in {m.group().lower() for m in WORD.finditer(line)})
    qualifying = sorted(word for word, n in counts.items() if n >= 4 and word not in inside)
    inputs = Inputs(None, None, sources={"sst2": (str(data), None)})
    read_contexts(Namespace(pool_sentences=0, num_words=len(qualifying), min_sentences=4, seed=0, no_progress=True), inputs, tokenizer)
    assert inputs.contexts["sst2"].num_candidates == len(qualifying) == 3  # the, met, today
    assert sorted(inputs.contexts["sst2"].words) == qualifying


def test_added_tokens_marked_special_are_excluded_and_counted_as_special_tokens_in_the_text(minilm_path):
    """--exclude_special drops an added token marked special written in a text ("<ent>", which `all_special_ids`
    leaves out) as it drops a literal [SEP], and counts it in num_special_in_text; expected from the tokenizer's own
    ids: the tokens kept are those that are neither added around the text nor a special or added-special id."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    tokenizer.add_tokens(["<ent>"], special_tokens=True)
    ent = tokenizer.convert_tokens_to_ids("<ent>")
    assert ent not in tokenizer.all_special_ids  # the plant
    model = AutoModel.from_pretrained(minilm_path)
    model.resize_token_embeddings(len(tokenizer))
    texts = ["the cat <ent> sat [SEP] down", "<ent><ent> a dog", "no specials at all here"]
    encoder = FrozenEncoder(model, tokenizer, exclude_special=True)
    batches = list(encoder.batches(texts, batch_size=2, progress=False))
    special = set(tokenizer.all_special_ids) - {tokenizer.unk_token_id} | {ent}
    written = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    assert sum(b.num_special_in_text for b in batches) == sum(token in special for ids in written for token in ids) == 4
    kept = sorted(token for batch in batches for token in batch.input_ids[batch.mask].tolist())
    assert kept == sorted(token for ids in written for token in ids if token not in special)


def test_one_list_of_special_ids_holds_the_added_special_tokens_everywhere(minilm_path):
    """core.tokenizers.special_ids: the ids of every token MiniLM's tokenizer holds as special, expected from its own
    added_tokens_decoder (its [PAD] [UNK] [CLS] [SEP] [MASK] and two planted added tokens marked special, which
    `all_special_ids` leaves out; a plain added token is not one). The same list, and no other, is used by the MLM
    masking (an added special token is never masked nor drawn as a random replacement), by the attention sinks'
    special tokens and a massive activation's `special` (pad left out of the sinks), which are --exclude_special's ([UNK]
    left out: it stands for a word)."""
    import numpy as np
    from transformers import AutoModel, AutoTokenizer

    from analyses.magnitudes import Magnitudes, token_kind
    from core.tokenizers import special_ids
    from datamodules.masking import MaskCollator
    from tests.tiny import tiny_config

    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    tokenizer.add_tokens(["<ent>", "<|reserved_0|>"], special_tokens=True)
    tokenizer.add_tokens(["<plain>"])  # added, not special
    expected = {index for index, token in tokenizer.added_tokens_decoder.items() if token.special}
    planted = set(tokenizer.convert_tokens_to_ids(["<ent>", "<|reserved_0|>"]))
    plain = tokenizer.convert_tokens_to_ids("<plain>")
    assert planted <= expected and not planted & set(tokenizer.all_special_ids) and plain not in expected  # the plant
    assert len(expected) == 7 and special_ids(tokenizer) == sorted(expected)
    assert special_ids(tokenizer, unknown=False) == sorted(expected - {tokenizer.unk_token_id})

    # masking: blocks of [CLS], ordinary words and the planted tokens; a share that asks for every ordinary token
    words = tokenizer("the cat sat on a mat while the dog slept by the door", add_special_tokens=False)["input_ids"]
    ent, reserved = sorted(planted)
    row = [tokenizer.cls_token_id, *[token for word in words for token in (word, ent, reserved)], tokenizer.sep_token_id]
    collator = MaskCollator(tokenizer, block_length=len(row), mlm_probability=len(words) / (len(row) - 2), seed=0)
    assert collator.k == len(words)
    batch = collator({"blocks": [row] * 20, "keys": list(range(20))})
    blocks = np.array([row] * 20)
    chosen = np.take_along_axis(blocks, batch["positions"].numpy(), axis=1)
    assert sorted(chosen[0].tolist()) == sorted(words) and not np.isin(chosen, list(expected)).any()
    assert (batch["input_ids"].numpy()[np.isin(blocks, list(expected))] == blocks[np.isin(blocks, list(expected))]).all()
    assert not np.isin(collator.random_ids, list(expected)).any() and plain in collator.random_ids

    # the encoder and the attention sinks
    model = AutoModel.from_config(tiny_config("bert", len(tokenizer)))
    encoder = FrozenEncoder(model, tokenizer)
    assert encoder.special_ids.tolist() == sorted(expected - {tokenizer.unk_token_id})
    magnitudes = Magnitudes(encoder)
    assert magnitudes.special_ids == sorted(expected - {tokenizer.pad_token_id, tokenizer.unk_token_id})
    assert set(magnitudes.header()["attention_sinks"]["special_tokens"]) >= {"<ent>", "<|reserved_0|>", "[CLS]"}
    ids = tokenizer(["a <ent> b <|reserved_0|> <plain>"], return_tensors="pt")["input_ids"]
    order = sorted(expected - {tokenizer.pad_token_id, tokenizer.unk_token_id})
    assert magnitudes.kinds(ids)[0].tolist() == [order.index(i) if i in order else -1 for i in ids[0].tolist()]
    special = set(encoder.special_ids.tolist())
    assert token_kind(tokenizer, ent, 2, special)["special"] and not token_kind(tokenizer, plain, 4, special)["special"]


def test_a_decoders_unknown_token_that_is_also_its_eos_is_special_and_the_sinks_read_the_same_tokens(bert_tok,
                                                                                                     tmp_path):
    """GPT-2's <|endoftext|> is its unk, bos and eos at once (the tiny decoder's "</s>" too): written between two
    documents of a line, it is their eos, not a word, so --exclude_special drops it and the report counts it. BERT's
    [UNK] stays a word: the attention sinks' special tokens are the same ids --exclude_special drops (no [UNK]), and
    the mass on them is computed here from the model's own attention weights."""
    import torch

    from tests.tiny_families import decoder_tokenizer, save_tiny_family

    tokenizer = decoder_tokenizer(tmp_path / "gpt2_tokenizer")
    assert tokenizer.unk_token_id == tokenizer.eos_token_id == tokenizer.bos_token_id
    gpt2 = save_tiny_family(tmp_path / "gpt2", "gpt2", tokenizer)
    lines = ["The first day.</s>The second day came.", "Another line here.</s>And one more.</s>", "No end here."]
    data = tmp_path / "docs.txt"
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "gpt2_out"
    assert analyze.main(["outliers", "--encoder", str(gpt2), "--data", str(data), "--output_dir", str(out),
                         "--exclude_special", "--no_progress", "--no_attention_sinks"]) == 0
    report = json.loads((out / "outliers.json").read_text())
    pieces = [piece for text in lines for piece in text.split("</s>") if piece]
    assert report["num_special_in_text"] == 3
    assert report["num_tokens"] == sum(len(tokenizer(piece)["input_ids"]) for piece in pieces)

    bert = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    texts = ["an [UNK] word stays", "the house was quiet", "he said [SEP] no more"]
    (tmp_path / "bert.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    out = tmp_path / "bert_out"
    assert analyze.main(["outliers", "--encoder", str(bert), "--data", str(tmp_path / "bert.txt"), "--output_dir",
                         str(out), "--no_progress", "--max_sentences", "0"]) == 0
    report = json.loads((out / "outliers.json").read_text())
    named = report["attention_sinks"]["special_tokens"]
    assert "[UNK]" not in named and set(named) == {"[CLS]", "[SEP]", "[MASK]"}
    model = load_encoder(bert, device="cpu").model
    model.set_attn_implementation("eager")
    layer = report["layers"][1]["attention_sinks"]
    mass, pairs = {name: 0.0 for name in named}, 0
    for text in texts:  # one sentence at a time: no padding; every token is a query
        inputs = bert_tok(text, return_tensors="pt")
        with torch.no_grad():
            weights = model(**inputs, output_attentions=True).attentions[0][0]  # layer 1: [heads, query, key]
        keys = weights.mean(1)  # [heads, key]: the mean over the queries
        pairs += keys.shape[0]
        for name in named:
            mass[name] += float(keys[:, inputs["input_ids"][0] == bert_tok.convert_tokens_to_ids(name)].sum())
    assert layer["special_token_mass_by_token"] == pytest.approx({n: m / pairs for n, m in mass.items()}, abs=1e-5)


def test_an_unknown_token_that_is_only_the_pad_stays_a_word(minilm_path):
    """A tokenizer that pads with its unk (some Llama exports): [UNK] written for an unknown word is still that word
    for --exclude_special (its pad role never shows in the text: padding is masked), while an unk that is also the eos
    (GPT-2's <|endoftext|>) is special."""
    from transformers import AutoTokenizer

    from core.tokenizers import special_ids

    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    named = set(tokenizer.all_special_ids)
    tokenizer.pad_token = tokenizer.unk_token
    assert tokenizer.pad_token_id == tokenizer.unk_token_id
    assert special_ids(tokenizer, unknown=False) == sorted(named - {tokenizer.unk_token_id})
    tokenizer.eos_token = tokenizer.unk_token
    assert special_ids(tokenizer, unknown=False) == sorted(named | {tokenizer.unk_token_id})
