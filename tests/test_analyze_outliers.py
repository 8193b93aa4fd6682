"""`analyze.py outliers` end to end: the packaged MiniLM against a direct computation, DDP, and every bad input."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModel, AutoTokenizer

import analyze
from analyses import session
from datamodules.text import sample_texts
from tests.figure_data import panels, same, saved_figures
from tests.tiny import LAYERS, MAX_POSITIONS, corpus_sentences, free_port, save_tiny_encoder

ROOT = Path(__file__).resolve().parent.parent


def run(*argv: str) -> int:
    return analyze.main(["outliers", "--no_progress", *map(str, argv)])


@pytest.mark.slow
def test_minilm_end_to_end_matches_direct_computation(minilm_path, tmp_path, capsys):
    texts = corpus_sentences(40, start=2000)
    data = tmp_path / "s.txt"
    data.write_text("\n".join(texts), encoding="utf-8")
    out = tmp_path / "report"
    assert run("--encoder", minilm_path, "--data", data, "--output_dir", out, "--max_length", 48,
               "--max_sentences", 0, "--batch_size", 7) == 0
    report = json.loads((out / "outliers.json").read_text())

    tokenizer, model = AutoTokenizer.from_pretrained(minilm_path), AutoModel.from_pretrained(minilm_path).eval()
    inputs = tokenizer(texts, padding=True, truncation=True, max_length=48, return_tensors="pt")
    with torch.no_grad():
        hidden = torch.stack(model(**inputs, output_hidden_states=True).hidden_states)
    tokens = hidden[:, inputs["attention_mask"].bool()]  # [layers, tokens, hidden]
    assert report["num_tokens"] == tokens.shape[1] and report["num_sentences"] == 40
    assert report["num_truncated"] == sum(len(ids) > 48 for ids in tokenizer(texts)["input_ids"])
    assert len(report["layers"]) == len(tokens)
    counts = {}  # in how many of layers 1..L each dim is an outlier
    for index, (layer, entry) in enumerate(zip(tokens, report["layers"])):
        max_share = torch.bincount(layer.argmax(-1), minlength=384).double() / layer.shape[0]
        min_share = torch.bincount(layer.argmin(-1), minlength=384).double() / layer.shape[0]
        assert entry["argmax_dim"] == int(max_share.argmax()) and entry["argmin_dim"] == int(min_share.argmax())
        assert entry["argmax_share"] == pytest.approx(float(max_share.max()), abs=1e-6)
        assert entry["argmin_share"] == pytest.approx(float(min_share.max()), abs=1e-6)
        means = layer.double().mean(0)
        flagged = ((max_share >= 0.2) | (min_share >= 0.2)).nonzero().flatten().tolist()  # the 20% rule, by hand
        assert entry["outlier_dims"] == sorted(flagged, key=lambda d: -abs(float(means[d]))), index
        assert entry["outlier_means"] == pytest.approx([float(means[d]) for d in entry["outlier_dims"]], abs=1e-4)
        for dim in flagged if index >= 1 else []:
            counts[dim] = counts.get(dim, 0) + 1
    assert counts  # MiniLM has outlier dims: the comparisons above were not of empty lists only
    needed = (len(tokens) - 1 + 1) // 2  # at least half of layers 1..L
    assert report["persistent_dims"] == sorted((d for d, c in counts.items() if c >= needed),
                                               key=lambda d: (-counts[d], d))
    assert (out / "mean_vectors.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    first = report["layers"][1]
    assert f"{first['argmax_dim']:>10} ({first['argmax_share']:6.1%})" in printed


@pytest.mark.slow
def test_two_process_ddp_report_equals_single_process(tmp_path, bert_tok):
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    data = tmp_path / "s.txt"
    data.write_text("\n".join(corpus_sentences(45, start=300)), encoding="utf-8")  # odd count: uneven shards
    # Batch size 1: no padding, so each sentence's hidden states are bit-identical however sentences are sharded.
    args = ["--encoder", encoder, "--data", data, "--max_sentences", 0, "--batch_size", 1]
    assert run(*args, "--output_dir", tmp_path / "single") == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(ROOT / "analyze.py"), "outliers", "--no_progress", *map(str, args),
               "--output_dir", str(tmp_path / "ddp")]
    finished = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-2000:]
    single = json.loads((tmp_path / "single" / "outliers.json").read_text())
    ddp = json.loads((tmp_path / "ddp" / "outliers.json").read_text())
    for key in ("num_sentences", "num_tokens", "num_truncated", "persistent_dims"):
        assert ddp[key] == single[key]
    assert len(ddp["layers"]) == len(single["layers"]) == LAYERS + 1  # the embedding output too
    for a, b in zip(ddp["layers"], single["layers"]):
        assert (a["argmax_dim"], a["argmin_dim"], a["outlier_dims"]) == (b["argmax_dim"], b["argmin_dim"], b["outlier_dims"])
        assert (a["argmax_share"], a["argmin_share"]) == (b["argmax_share"], b["argmin_share"])
        assert a["outlier_means"] == pytest.approx(b["outlier_means"], abs=1e-5)
        assert a["magnitude_outliers"] == b["magnitude_outliers"]
        assert a["massive_activations"] == b["massive_activations"]  # the peaks merged across ranks, the histogram
        for key in ("kurtosis_sequence", "inf_norm_sequence"):
            assert a[key] == pytest.approx(b[key], rel=1e-6)
        assert (a["attention_sinks"] is None) == (b["attention_sinks"] is None) == (b is single["layers"][0])
        if b is not single["layers"][0]:  # layer 0, the embedding output, has no attention
            for key in ("sink_share", "first_token_mass", "first_token_mass_by_head", "special_token_mass"):
                assert a["attention_sinks"][key] == pytest.approx(b["attention_sinks"][key], abs=1e-6)


def _truncation_warning(truncated: int, total: int, length: int) -> str:
    return (f"warning: {truncated} of {total} sentences were longer than {length} tokens and were truncated "
            "(counted in the report as num_truncated)")


def plant_bias(model) -> None:
    """Layer 2's output LayerNorm adds 10 to dimension 5 of every token: a magnitude outlier there."""
    model.encoder.layer[1].output.LayerNorm.bias[5] = 10.0


def test_the_magnitudes_table_shows_a_bpe_token_as_its_text_and_the_json_keeps_the_raw_token(tmp_path, roberta_tok,
                                                                                            capsys):
    """Byte-level BPE writes a word-initial token as 'Ġword': the table shows what it reads as, quoted (' word'), while
    outliers.json keeps the tokenizer's own token beside that text."""
    texts = [text for text in corpus_sentences(60, start=700) if text and len(roberta_tok(text)["input_ids"]) <= 40][:6]
    tokens = roberta_tok.convert_ids_to_tokens(roberta_tok(texts[0])["input_ids"])
    word = next(token for token in tokens if token.startswith("Ġ") and token[1:].isalpha() and len(token) > 2)
    token_id = roberta_tok.convert_tokens_to_ids(word)

    def plant(model):  # layer 0 (the embeddings) peaks on dim 5 of this token wherever it stands
        model.embeddings.word_embeddings.weight[token_id, 5] = 1000.0

    encoder = save_tiny_encoder(tmp_path / "roberta", "roberta", roberta_tok, plant=plant)
    data = tmp_path / "s.txt"
    data.write_text("\n".join(texts) + "\n", encoding="utf-8")
    assert run("--encoder", encoder, "--data", data, "--output_dir", tmp_path / "out", "--max_sentences", 0,
               "--no_attention_sinks") == 0
    top = json.loads((tmp_path / "out" / "outliers.json").read_text())["layers"][0]["massive_activations"]["top"][0]
    readable = " " + word[1:]  # by hand: Ġ is the byte-level BPE's space
    assert (top["dim"], top["token"], top["token_id"], top["text"]) == (5, word, token_id, readable)
    table = capsys.readouterr().out.split("massive: ", 1)[1].splitlines()[2:]  # the magnitudes table's rows
    assert f" 5 @ '{readable}' (" in table[0] and table[0].split()[0] == "0"
    assert "Ġ" not in "\n".join(table)


def test_a_token_reads_as_the_text_it_stands_for(roberta_tok):
    """Byte-level BPE's markers become the space and newline they encode; a byte of a longer character stays its raw
    token (no replacement character); SentencePiece's '▁' keeps its space, which its decoder drops at a text's start."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from core.tables import shown_token
    from core.tokenizers import readable_token

    accented = roberta_tok.convert_ids_to_tokens(roberta_tok("é")["input_ids"])[1:-1]  # two byte tokens, 'Ã', '©'
    assert len(accented) == 2 and all(readable_token(roberta_tok, token) == token for token in accented)
    assert [readable_token(roberta_tok, token) for token in ("Ġs", "Ċ", "<s>")] == [" s", "\n", "<s>"]
    backend = Tokenizer(models.WordLevel({"<unk>": 0, "\u2581the": 1, "cat": 2}, unk_token="<unk>"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    spm = PreTrainedTokenizerFast(tokenizer_object=backend)
    assert [readable_token(spm, token) for token in ("\u2581the", "cat")] == [" the", "cat"]
    assert [shown_token(entry) for entry in ({"token": "Ġs", "text": " s"}, {"token": "Ġs"}, {"token": None})] == \
        ["' s'", "'Ġs'", "-"]  # an older report without `text`: its raw token


def check_magnitudes_figure(drawn: list[dict], report: dict) -> None:
    """magnitudes.png against outliers.json (whose numbers the test checks against the model's own): per layer, the
    3 largest peaks |x| with the median |x| and the massive rule's level (ratio x median); the kurtosis per token and
    per sequence; the attention sinks (none at layer 0)."""
    rows, layers = report["layers"], range(len(report["layers"]))
    ratio = report["massive_rule"]["ratio"]
    peaks, kurtosis, sinks = drawn
    expected = {**{f"top {i + 1} peak |x|": [abs(row["massive_activations"]["top"][i]["value"]) for row in rows]
                   for i in range(3)},
                "median |x|": [row["massive_activations"]["median_abs"] for row in rows],
                f"massive from (x {ratio:g} median)": [ratio * row["massive_activations"]["median_abs"] for row in rows]}
    assert list(peaks["lines"]) == list(expected)
    for name, values in expected.items():
        same(peaks["lines"][name], layers, values)
    assert list(kurtosis["lines"]) == ["per token, mean (ours)", "per sequence (Bondarenko et al.)"]
    same(kurtosis["lines"]["per token, mean (ours)"], layers, [row["kurtosis_mean"] for row in rows])
    same(kurtosis["lines"]["per sequence (Bondarenko et al.)"], layers, [row["kurtosis_sequence"] for row in rows])
    for name, key in (("share of heads that are sinks", "sink_share"), ("attention on the first token",
                                                                        "first_token_mass"),
                      ("attention on special tokens", "special_token_mass")):
        same(sinks["lines"][name], layers, [None] + [row["attention_sinks"][key] for row in rows[1:]])


def test_magnitudes_in_the_report_equal_a_direct_computation(tmp_path, bert_tok, monkeypatch):
    """massive_activations, magnitude_outliers, kurtosis_sequence / inf_norm_sequence and attention_sinks of
    outliers.json against the tiny model's own hidden states and eager attention weights, computed here by hand."""
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok, plant=plant_bias)
    texts = [text for text in corpus_sentences(60, start=500) if text and len(bert_tok(text)["input_ids"]) <= 40][:12]
    data = tmp_path / "s.txt"
    data.write_text("\n".join(texts) + "\n", encoding="utf-8")
    model = AutoModel.from_pretrained(encoder, attn_implementation="eager").eval()
    inputs = bert_tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        output = model(**inputs, output_hidden_states=True, output_attentions=True)
    mask = inputs["attention_mask"].bool()
    first = torch.stack([a[:, :, :, 0] for a in output.attentions])  # [layers, batch, heads, queries]
    per_head = (first * mask[None, :, None, :]).sum(-1) / mask.sum(1)[None, :, None]  # mean over real queries
    epsilon = float(per_head[1].flatten().median()) + 1e-4  # a share strictly between 0 and 1 in layer 2
    saved = saved_figures(monkeypatch, session)
    assert run("--encoder", encoder, "--data", data, "--output_dir", tmp_path / "out", "--max_sentences", 0,
               "--sink_epsilon", epsilon, "--batch_size", 5) == 0
    report = json.loads((tmp_path / "out" / "outliers.json").read_text())
    assert (tmp_path / "out" / "magnitudes.png").read_bytes()[:4] == b"\x89PNG"
    check_magnitudes_figure(panels(saved["magnitudes.png"]), report)
    sep, cls = bert_tok.sep_token_id, bert_tok.cls_token_id
    for layer, row in enumerate(report["layers"]):
        hidden = output.hidden_states[layer]  # [batch, seq, hidden]
        tokens = hidden[mask]
        peak = tokens.abs().amax(0)
        dim = int(peak.argmax())
        flat = (hidden.abs()[..., dim] * mask).flatten().argmax()
        b, position = divmod(int(flat), hidden.shape[1])
        top = row["massive_activations"]["top"][0]
        assert (top["dim"], top["position"], top["token"]) == (dim, position, bert_tok.convert_ids_to_tokens(
            int(inputs["input_ids"][b, position])))
        assert top["value"] == pytest.approx(float(hidden[b, position, dim]), abs=1e-4)
        assert row["massive_activations"]["median_abs"] == pytest.approx(float(tokens.abs().median()), rel=0.02)
        rms = tokens.pow(2).mean(-1, keepdim=True).sqrt()
        share = (tokens.abs() > 4 * rms).double().mean(0)
        assert [entry["dim"] for entry in row["magnitude_outliers"]["dims"]] == \
            sorted((share >= 0.2).nonzero().flatten().tolist(), key=lambda d: -float(share[d]))
        sequences = [hidden[i, mask[i]].flatten().double() for i in range(len(texts))]
        kurtosis = [((x - x.mean()) ** 4).mean() / (x.std() ** 4 + 1e-6) for x in sequences]
        assert row["kurtosis_sequence"] == pytest.approx(float(sum(kurtosis) / len(kurtosis)), rel=1e-4)
        assert row["inf_norm_sequence"] == pytest.approx(float(sum(x.abs().max() for x in sequences)) / len(texts),
                                                         rel=1e-5)
        sinks = row["attention_sinks"]
        if layer == 0:
            assert sinks is None
            continue
        heads = per_head[layer - 1]  # [batch, heads]
        assert sinks["sink_share"] == pytest.approx(float((heads > epsilon).double().mean()), abs=1e-6)
        assert sinks["first_token_mass"] == pytest.approx(float(heads.mean()), abs=1e-5)
        attention = output.attentions[layer - 1]  # [batch, heads, queries, keys]
        for token, name in ((cls, "[CLS]"), (sep, "[SEP]")):
            keys = (inputs["input_ids"] == token) & mask
            mass = (attention * keys[:, None, None, :]).sum(-1)  # [batch, heads, queries]
            expected = ((mass * mask[:, None, :]).sum(-1) / mask.sum(1)[:, None]).mean()
            assert sinks["special_token_mass_by_token"][name] == pytest.approx(float(expected), abs=1e-5)
    assert 0 < report["layers"][2]["attention_sinks"]["sink_share"] < 1
    assert [entry["dim"] for entry in report["layers"][2]["magnitude_outliers"]["dims"]] == [5]


def test_long_sentences_are_truncated_counted_and_warned(tmp_path, bert_tok, capsys):
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    texts = ["Short one here.", " ".join(["word"] * 100), "Another short one.", *corpus_sentences(6, start=700),
             " ".join(["again"] * 70)]
    data = tmp_path / "s.txt"
    data.write_text("\n".join(texts) + "\n", encoding="utf-8")
    lengths = [len(ids) for ids in bert_tok(texts)["input_ids"]]  # tokenised here, independently of the encoder
    long = sum(n > MAX_POSITIONS for n in lengths)
    assert 0 < long < len(texts)
    assert run("--encoder", encoder, "--data", data, "--output_dir", tmp_path / "out", "--max_sentences", 0) == 0
    report = json.loads((tmp_path / "out" / "outliers.json").read_text())
    assert report["num_truncated"] == long and report["max_length"] == MAX_POSITIONS
    assert report["num_tokens"] == sum(min(n, MAX_POSITIONS) for n in lengths)
    captured = capsys.readouterr()
    assert [line for line in captured.err.splitlines() if "warning" in line] == [
        _truncation_warning(long, len(texts), MAX_POSITIONS)]
    assert "warning" not in captured.out

    # Any subcommand whose report counts truncations warns the same way (here at --max_length 16).
    short = sum(n > 16 for n in lengths)
    assert long < short < len(texts)
    assert analyze.main(["anisotropy", "--no_progress", "--encoder", str(encoder), "--data", str(data),
                         "--output_dir", str(tmp_path / "aniso"), "--max_sentences", "0", "--max_length", "16",
                         "--clip", "none"]) == 0
    assert json.loads((tmp_path / "aniso" / "anisotropy.json").read_text())["num_truncated"] == short
    err = capsys.readouterr().err
    pairs = len(texts) // 2  # one random token from each sentence, two a pair: 10 sentences give 5 of the 1000 pairs
    shortfall = (f"warning: anisotropy from {pairs} random token pairs, not --num_pairs 1000: one random token from "
                 f"each of 2000 sentences needs 2000 sentences with a token, got {len(texts)}")
    assert [line for line in err.splitlines() if "warning" in line] == [
        shortfall, _truncation_warning(short, len(texts), 16)]


def test_max_sentences_and_seed_choose_the_sample(tmp_path, bert_tok):
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    lines = [line for line in corpus_sentences(40, start=900) if line][:30]  # sentences of varied lengths
    data = tmp_path / "s.txt"
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")

    def report(seed: int, out: str) -> dict:
        assert run("--encoder", encoder, "--data", data, "--output_dir", tmp_path / out, "--max_sentences", 8,
                   "--seed", seed) == 0
        return json.loads((tmp_path / out / "outliers.json").read_text())

    def tokens_of(seed: int) -> int:
        picked = sample_texts(iter(lines), 8, seed)
        assert len(picked) == 8 and set(picked) <= set(lines)
        return sum(min(len(ids), MAX_POSITIONS) for ids in bert_tok(picked)["input_ids"])

    first, again, other = report(3, "a"), report(3, "b"), report(4, "c")
    assert first == again
    assert tokens_of(3) != tokens_of(4)  # the two seeds pick samples with different token counts
    for result, seed in ((first, 3), (other, 4)):
        assert result["num_sentences"] == 8 < len(lines) and result["seed"] == seed
        assert result["num_tokens"] == tokens_of(seed)


def test_a_second_run_into_one_directory_leaves_no_figure_of_the_first_model(tmp_path, bert_tok):
    """BERT's outliers then RoFormer's (rotary: no position table) into one --output_dir: the directory holds what the
    RoFormer run wrote, not BERT's position_embeddings.png beside RoFormer's report; a file of another subcommand
    stays."""
    from tests.tiny_families import save_tiny_family

    bert = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    roformer = save_tiny_family(tmp_path / "roformer", "roformer", bert_tok)
    data = tmp_path / "s.txt"
    data.write_text("\n".join(corpus_sentences(6)) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    (out / "anisotropy.json").parent.mkdir()
    (out / "anisotropy.json").write_text("{}")  # another report in the same directory
    common = ("--data", data, "--output_dir", out, "--no_attention_sinks")
    assert run("--encoder", bert, *common) == 0
    assert (out / "position_embeddings.png").is_file()
    assert run("--encoder", roformer, *common) == 0
    report = json.loads((out / "outliers.json").read_text())
    assert report["encoder"] == str(roformer) and report["origins"]["position_embeddings"] is None
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "anisotropy.json", "magnitudes.png", "mean_vectors.png", "outliers.json"]


def test_the_encoder_computes_in_float32_on_a_gpu_too_unless_dtype_asks_otherwise(tmp_path, bert_tok, monkeypatch):
    """A CUDA machine analyses in float32 by default, as the CPU and transformers do (load_encoder alone picks
    bfloat16 on CUDA, whose hidden states move outlier shares by tenths of a percent); --dtype bfloat16 asks for it,
    and the report says which: its statistics equal those of the model loaded by transformers in that dtype."""
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    asked, load = [], session.load_encoder

    def on_cpu(source, **options):  # what a CUDA machine's run asks for, loaded on this CPU
        asked.append(options.get("dtype"))
        return load(source, **{**options, "device": "cpu"})

    monkeypatch.setattr(session, "load_encoder", on_cpu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = analyze.build_parser().parse_args(["outliers", "--encoder", str(encoder)])
    assert session.open_encoder(args).model.dtype == torch.float32 and asked == [torch.float32]
    monkeypatch.undo()

    texts = corpus_sentences(12, start=300)
    data = tmp_path / "s.txt"
    data.write_text("\n".join(texts) + "\n", encoding="utf-8")
    inputs = bert_tok(texts, padding=True, truncation=True, return_tensors="pt")
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / dtype
        extra = [] if dtype == "float32" else ["--dtype", dtype]
        assert run("--encoder", encoder, "--data", data, "--output_dir", out, "--no_attention_sinks", *extra) == 0
        report = json.loads((out / "outliers.json").read_text())
        model = AutoModel.from_pretrained(encoder, dtype=getattr(torch, dtype)).eval()
        with torch.no_grad():
            hidden = torch.stack(model(**inputs, output_hidden_states=True).hidden_states).float()
        tokens = hidden[:, inputs["attention_mask"].bool()]
        assert report["dtype"] == dtype and report["num_tokens"] == tokens.shape[1]
        for layer, entry in zip(tokens, report["layers"], strict=True):
            holders = (layer == layer.amax(-1, keepdim=True)).double()  # bf16 ties: 1/k to each of the k dims
            share = (holders / holders.sum(-1, keepdim=True)).sum(0) / layer.shape[0]
            assert entry["argmax_share"] == pytest.approx(float(share.max()), abs=1e-6)
            assert entry["max_abs"] == pytest.approx(float(layer.abs().max()), rel=1e-5)


def _bad_inputs(tmp_path: Path, encoder: Path) -> dict[str, tuple[list, str]]:
    from transformers import BartConfig, BartModel

    BartModel(BartConfig(encoder_layers=1, decoder_layers=1, d_model=16, encoder_attention_heads=2,
                         decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, vocab_size=50)
              ).save_pretrained(tmp_path / "bart")
    good = tmp_path / "good.txt"
    good.write_text("One sentence.\nTwo sentences.\n", encoding="utf-8")
    files = {"empty.txt": b"", "binary.txt": b"\x00\x01\x02PNG", "latin1.txt": b"na\xefve caf\xe9\n"}
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    with (tmp_path / "nocol.csv").open("w", newline="") as handle:
        csv.writer(handle).writerows([["id", "score", "label"], [1, "x", "y"]])
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a directory")
    return {
        "unknown hub id": (["--encoder", "no-such-org/no-such-model", "--data", good],
                           "cannot load encoder 'no-such-org/no-such-model'"),
        "missing encoder path": (["--encoder", tmp_path / "nowhere", "--data", good], "encoder path not found"),
        "missing data path": (["--encoder", encoder, "--data", tmp_path / "nowhere.txt"], "data path not found"),
        "an encoder-decoder": (["--encoder", tmp_path / "bart", "--data", good], "encoder-decoder model"),
        "empty file": (["--encoder", encoder, "--data", tmp_path / "empty.txt"], "data file is empty"),
        "binary file": (["--encoder", encoder, "--data", tmp_path / "binary.txt"], "looks binary"),
        "not utf-8": (["--encoder", encoder, "--data", tmp_path / "latin1.txt"], "not UTF-8"),
        "no text column": (["--encoder", encoder, "--data", tmp_path / "nocol.csv"], "no text column"),
        "max_length too long": (["--encoder", encoder, "--data", good, "--max_length", 1000], "exceeds the 64 positions"),
        "unwritable output": (["--encoder", encoder, "--data", good, "--output_dir", blocker / "out"],
                              "cannot write to output directory"),
        "bad batch size": (["--encoder", encoder, "--data", good, "--batch_size", 0], "--batch_size must be positive"),
        "bad sink epsilon": (["--encoder", encoder, "--data", good, "--sink_epsilon", 1.5], "--sink_epsilon must lie"),
        "bad massive ratio": (["--encoder", encoder, "--data", good, "--massive_ratio", 0],
                              "--massive_ratio must be positive"),
    }


def test_bad_inputs_give_one_line_and_write_nothing(tmp_path, bert_tok, capfd):
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    for case, (argv, message) in _bad_inputs(tmp_path, encoder).items():
        out = tmp_path / f"out-{case.replace(' ', '-')}"
        argv = argv if "--output_dir" in argv else [*argv, "--output_dir", out]
        assert run(*argv) == 2, case
        errors = [line for line in capfd.readouterr().err.splitlines() if "error:" in line]
        assert len(errors) == 1 and message in errors[0], (case, errors)
        assert not out.exists(), case


def test_console_script_reports_the_error_and_exit_status(tmp_path):
    finished = subprocess.run([sys.executable, str(ROOT / "analyze.py"), "outliers", "--encoder", str(tmp_path / "x"),
                               "--output_dir", str(tmp_path / "o")], capture_output=True, text=True, cwd=ROOT)
    assert finished.returncode == 2
    assert finished.stderr.strip().splitlines()[-1].startswith("analyze.py outliers: error: encoder path not found")


def _collective_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from core.errors import UserError

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        def step():
            if rank == 1:
                raise UserError("rank 1 found a bad shard")
            return "fine"

        try:
            session.collectively(step)
            outcome = "returned"
        except UserError as error:
            outcome = str(error)
        Path(f"{out}.{rank}").write_text(outcome)
    finally:
        dist.destroy_process_group()


def test_an_error_on_one_rank_stops_every_rank(tmp_path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "outcome")
    mp.start_processes(_collective_worker, args=(free_port(), out), nprocs=2, start_method="spawn", join=True)
    assert [Path(f"{out}.{rank}").read_text() for rank in (0, 1)] == ["rank 1 found a bad shard"] * 2
