"""The tokenizer's unknown token ([UNK]) in the text: counted in every report (`num_unknown`) and said in one warning
line. An English WordPiece vocabulary reads Chinese, Greek outside its alphabet, emoji and many symbols as [UNK]: with
the packaged MiniLM half the tokens of a Chinese text and three quarters of an emoji-rich one were [UNK], and the
outlier report, the anisotropy and the probes described that one token's vectors without a word about it. Counts
checked against the tokenizer run by hand on the same lines.

    .venv/bin/pytest tests/test_unknown_tokens.py -q
"""

from __future__ import annotations

import json
import re

import torch

import analyze
from core.tokenizers import unknown_count, unknown_id, unknown_line
from datamodules.probing import PositionDataModule
from tests.tiny import save_tiny_encoder

# ☃ and ✈ are in no tiny vocabulary: each is one [UNK] (BERT's basic tokenizer splits symbols off as words)
LINES = ["the house ☃ was quiet", "he said ✈ ☃ no more", "she came late", "an [UNK] word written as such"] * 3


def unknown_by_hand(tokenizer, lines) -> tuple[int, int]:
    """(the [UNK] tokens of the lines, all their tokens), each line tokenised alone (no padding)."""
    ids = [tokenizer(line)["input_ids"] for line in lines]
    return sum(row.count(tokenizer.unk_token_id) for row in ids), sum(len(row) for row in ids)


def test_unknown_id_is_a_words_stand_in_and_padding_never_counts(bert_tok, minilm_path, tmp_path):
    from transformers import AutoTokenizer

    from tests.tiny_families import decoder_tokenizer

    assert unknown_id(bert_tok) == bert_tok.unk_token_id
    gpt2 = decoder_tokenizer(tmp_path / "gpt2")  # its unk is its eos: a byte-level vocabulary lacks no text
    assert gpt2.unk_token_id == gpt2.eos_token_id and unknown_id(gpt2) is None
    padded = AutoTokenizer.from_pretrained(minilm_path)
    padded.pad_token = padded.unk_token  # pads with its unk (some Llama exports): the padding is no unknown text
    unk = unknown_id(padded)
    ids = torch.tensor([[101, unk, 7, 102], [101, unk, unk, unk]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    assert unk == padded.unk_token_id and unknown_count(ids, mask, unk) == 2 and unknown_count(ids, mask, None) == 0


def test_every_report_counts_the_unknown_tokens_and_says_so_once(bert_tok, tmp_path, capfd):
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    data = tmp_path / "lines.txt"
    data.write_text("".join(f"{line}\n" for line in LINES), encoding="utf-8")
    unknown, tokens = unknown_by_hand(bert_tok, LINES)
    assert unknown == 3 * (1 + 2 + 0 + 1)  # planted: ☃, ✈ ☃, and the [UNK] written in the text (one word)
    common = ["--encoder", str(encoder), "--data", str(data), "--no_progress", "--max_sentences", "0"]
    for command, extra in (("outliers", ["--no_attention_sinks"]), ("anisotropy", ["--num_pairs", "5"])):
        capfd.readouterr()
        assert analyze.main([command, *common, "--output_dir", str(tmp_path / command), *extra]) == 0
        report = json.loads((tmp_path / command / f"{command}.json").read_text())
        assert report["num_unknown"] == unknown
        lines = [line for line in capfd.readouterr().err.splitlines() if "unknown token" in line]
        share = f"{unknown} of the {tokens} tokens ({100 * unknown / tokens:.2g}%)" if command == "outliers" else \
            f"{unknown} tokens"
        assert lines == [f"warning: {share} are the tokenizer's unknown token: text its vocabulary lacks (emoji, "
                         "another script, ...), each read as the one unknown token's vector, not as what was written "
                         "(counted in the report as num_unknown)"]
    assert json.loads((tmp_path / "outliers" / "outliers.json").read_text())["num_tokens"] == tokens
    clean = tmp_path / "clean.txt"  # no unknown token: 0 in the report, no line
    clean.write_text("the house was quiet\nhe said no more\n", encoding="utf-8")
    capfd.readouterr()
    assert analyze.main(["outliers", *common[:2], "--data", str(clean), "--no_progress", "--no_attention_sinks",
                         "--output_dir", str(tmp_path / "clean")]) == 0
    assert json.loads((tmp_path / "clean" / "outliers.json").read_text())["num_unknown"] == 0
    assert "unknown token" not in capfd.readouterr().err


def test_the_probes_report_counts_the_unknown_tokens_of_all_splits(bert_tok, tmp_path, recwarn):
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    lines = [f"{line} {letter}" for letter, line in zip("abcdefghijklmnopqrstuvwx", LINES * 2)]  # 24 distinct
    data = tmp_path / "lines.txt"
    data.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    module = PositionDataModule(source=str(data), encoder=str(encoder), progress=False, random_baseline=False,
                                control_task=False)
    module.prepare_data()
    unknown, tokens = unknown_by_hand(bert_tok, lines)
    assert unknown == 6 * 4 and module.spec.data["num_unknown"] == unknown
    said = [str(w.message) for w in recwarn if "unknown token" in str(w.message)]
    assert len(said) == 1 and re.match(rf"{unknown} of the {tokens} tokens \(", said[0])


def test_the_unknown_line_agrees_in_number_with_its_count():
    assert unknown_line(1, 400).startswith("1 of the 400 tokens (0.25%) is the tokenizer's unknown token:")
    assert unknown_line(1).startswith("1 token is the tokenizer's unknown token:")
    assert unknown_line(3, 400).startswith("3 of the 400 tokens (0.75%) are the tokenizer's unknown token:")
    assert unknown_line(2).startswith("2 tokens are the ")
