"""`analyze.py intervene`: each intervention against the model edited by hand, the weights untouched, the p-value on a
planted effect, the MLM loss against a hand loop with the same masks, DDP 2 == 1, and the refusals."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModel, AutoModelForMaskedLM, AutoTokenizer

import analyze
from analyses.intervene import parse_request
from core.errors import UserError
from datamodules.masking import MaskCollator
from lightning_modules.interventions import Intervention, check_intervention, intervene
from metrics.controls import control_summary, empirical_p_value
from tests.figure_data import panels, same, saved_figures
from tests.tiny import (
    HIDDEN,
    LAYERS,
    MAX_POSITIONS,
    corpus_sentences,
    free_port,
    reports_close,
    save_tiny_encoder,
    tiny_config,
)


def tiny_model(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    return AutoModel.from_config(tiny_config(kind, 600)).eval()


def inputs(kind: str, padded: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of 12 random ids (no special ids), the last padded to 7 tokens when `padded`."""
    ids = torch.randint(5, 600, (3, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        ids[2, 7:] = 1 if kind == "roberta" else 0
        mask[2, 7:] = 0
    return ids, mask


def hidden(model, ids, mask=None) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack(model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states)


def snapshot(model) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in model.state_dict().items()}


def unchanged(model, before: dict[str, torch.Tensor]) -> bool:
    after = model.state_dict()
    return after.keys() == before.keys() and all(torch.equal(after[key], before[key]) for key in before)


@pytest.mark.parametrize("kind", ["bert", "roberta"])
@pytest.mark.parametrize("name", ["position_mean", "position_shuffle", "position_zero", "token_type_zero"])
def test_embedding_interventions_equal_the_table_edited_by_hand(kind, name):
    model = tiny_model(kind)
    ids, mask = inputs(kind)
    before = snapshot(model)
    with intervene(model, Intervention(name, seed=3)):
        got = hidden(model, ids, mask)
    assert unchanged(model, before)
    edited = copy.deepcopy(model)
    with torch.no_grad():
        if name == "token_type_zero":
            edited.embeddings.token_type_embeddings.weight.zero_()
        else:  # the rows a token can read: RoBERTa's start after its padding row (padding_idx 1), BERT's at 0
            rows = edited.embeddings.position_embeddings.weight[2 if kind == "roberta" else 0:][:MAX_POSITIONS]
            order = torch.randperm(MAX_POSITIONS, generator=torch.Generator().manual_seed(3))
            rows.copy_({"position_mean": rows.mean(0).expand_as(rows), "position_zero": torch.zeros_like(rows),
                        "position_shuffle": rows[order]}[name])
    counted = mask.bool()
    torch.testing.assert_close(got[:, counted], hidden(edited, ids, mask)[:, counted], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got[:, counted], hidden(model, ids, mask)[:, counted], atol=1e-3)  # it did something


@pytest.mark.parametrize("name", ["activation_zero", "activation_mean"])
@pytest.mark.parametrize("layer", [0, 2])
def test_activation_at_layer_l_equals_layers_after_it_run_on_the_edited_state(name, layer):
    model = tiny_model("bert")
    ids, _ = inputs("bert", padded=False)
    base, got, state = edited_activation(model, ids, name, layer)
    expected = [*base[:layer], state]
    with torch.no_grad():
        for block in model.encoder.layer[layer:]:  # hidden state l + 1 is the output of encoder.layer[l]
            state = block(state)
            expected.append(state)
    torch.testing.assert_close(got, torch.stack(expected), atol=1e-5, rtol=1e-5)


def edited_activation(model, ids, name: str, layer: int, dims: tuple[int, ...] = (3, 17)):
    """The unmodified hidden states, those under `name` (activation_zero / activation_mean with seeded means) at
    `layer`, and layer `layer`'s state edited by hand; the model's weights checked unchanged afterwards."""
    base = hidden(model, ids)
    means = torch.randn(LAYERS + 1, HIDDEN, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    before = snapshot(model)
    with intervene(model, Intervention(name, dims, (layer,), means=means)):
        got = hidden(model, ids)
    assert unchanged(model, before)
    state = base[layer].clone()
    state[..., list(dims)] = 0.0 if name == "activation_zero" else means[layer, list(dims)].float()
    return base, got, state


@pytest.mark.parametrize("layers", [None, (2,)])
def test_layernorm_zero_equals_an_edited_copy(layers):
    model = tiny_model("roberta")
    ids, mask = inputs("roberta")
    dims = (5, 9)
    before = snapshot(model)
    with intervene(model, Intervention("layernorm_zero", dims, layers)):
        got = hidden(model, ids, mask)
    assert unchanged(model, before)
    edited = copy.deepcopy(model)
    with torch.no_grad():
        for module_name, module in edited.named_modules():
            if isinstance(module, nn.LayerNorm) and (layers is None or module_name.startswith("encoder.layer.1.")):
                module.weight[list(dims)] = 0
                module.bias[list(dims)] = 0
    counted = mask.bool()
    torch.testing.assert_close(got[:, counted], hidden(edited, ids, mask)[:, counted], atol=1e-5, rtol=1e-5)


def test_hooks_are_removed_on_error():
    model = tiny_model("bert")
    ids, mask = inputs("bert")
    base = hidden(model, ids, mask)
    with pytest.raises(RuntimeError), intervene(model, Intervention("activation_zero", (1, 2))):
        inside = hidden(model, ids, mask)  # the hooks act: dims 1 and 2 zero in every hidden state, the rest moved
        assert not inside[..., [1, 2]].any() and base[..., [1, 2]].abs().min() > 0
        assert not torch.allclose(inside[1:, ..., 3:], base[1:, ..., 3:], atol=1e-3)
        raise RuntimeError("inside")
    torch.testing.assert_close(hidden(model, ids, mask), base)


def test_p_value_counts_the_observed_effect_as_one_more_draw():
    observed = torch.tensor([2.0, 0.0, float("nan")])
    controls = torch.tensor([[1.0, 0.0, 1.0], [-3.0, 1.0, 1.0], [0.5, -1.0, 1.0]])
    # |controls| >= |observed|: layer 0 one (-3), layer 1 all three, layer 2 none counted (nan)
    torch.testing.assert_close(empirical_p_value(observed, controls)[:2], torch.tensor([2 / 4, 4 / 4]).double())
    assert empirical_p_value(observed, controls)[2].isnan()
    summary = control_summary(observed, controls)
    torch.testing.assert_close(summary["mean"], torch.tensor([-0.5, 0.0, 1.0]).double())
    torch.testing.assert_close(summary["sd"], controls.double().std(0))


def run(*argv) -> int:
    return analyze.main(["intervene", "--no_progress", *map(str, argv)])


def data_file(tmp_path: Path, count: int, start: int = 0) -> Path:
    path = tmp_path / "sentences.txt"
    path.write_text("\n".join(corpus_sentences(count, start)) + "\n", encoding="utf-8")
    return path


def test_planted_outlier_matters_and_random_dims_do_not(tmp_path, bert_tok, monkeypatch, capsys):
    from analyses import session

    saved = saved_figures(monkeypatch, session)

    def plant(model):  # dim 7 carries a large bias in every LayerNorm: the max of every token vector, every layer
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.bias[7] = 8.0

    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok, plant=plant)
    out = tmp_path / "out"
    assert run("--encoder", encoder, "--data", data_file(tmp_path, 30), "--max_sentences", 0, "--controls", 9,
               "--num_pairs", 15, "--output_dir", out) == 0
    report = json.loads((out / "intervene.json").read_text())
    assert 7 in report["dims"] and report["mlm"]["head"] is False and "no MLM head" in report["mlm"]["note"]
    n = report["num_tokens"]  # the baseline's ~1000 tokens: 2 x 32 x P(Binomial(n, 1 / 32) >= 0.2 n), in integers
    tail = sum(math.comb(n, k) * 31 ** (n - k) for k in range(math.ceil(0.2 * n), n + 1)) / 32 ** n
    assert report["chance_bound"] == pytest.approx(64 * tail, rel=1e-9) and report["chance_bound"] < 1e-10
    assert report["baseline"]["stats"]["share"]["7"][1:] == pytest.approx([1.0] * LAYERS, abs=0.02)
    result = report["interventions"]["layernorm_zero"]
    assert result["stats"]["share"]["7"] == pytest.approx([0.0] * (LAYERS + 1), abs=0.05)
    assert result["effects"]["outlier_share_mean"] < -0.9 and result["effects"]["anisotropy_mean"] < -0.2
    for metric in ("outlier_share_mean", "anisotropy_mean"):
        controls = result["controls"][metric]
        assert controls["p_value"] == pytest.approx(1 / 10)  # no random dim comes close
        assert abs(controls["mean"]) < 0.05 and controls["sd"] < 0.05
    drawn = report["controls"]["dims"]
    assert len(drawn) == 9 and all(len(d) == len(report["dims"]) and not set(d) & set(report["tracked_dims"])
                                   for d in drawn)
    assert (out / "intervene.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    check_intervention_figure(panels(saved["intervene.png"]), report)
    scales = {ax.get_title(): ax.get_yscale() for ax in saved["intervene.png"].axes if ax.axison}
    assert scales["kurtosis (per token, mean)"] == scales["max |activation|"] == "log"  # they span decades
    assert scales["anisotropy"] == "linear"
    check_printed_table(capsys.readouterr().out, report)


TABLE = {"outlier_share": "summed share of the dims", "kurtosis": "kurtosis (per token, mean)",
         "max_abs": "max |activation|", "anisotropy": "anisotropy", "sts": "STS Spearman x 100",
         "probe": "position probe accuracy", "mlm_loss": "MLM loss", "lm_loss": "next-token loss (ours)"}
HEADERS = ["intervention", "metric", "before", "after", "effect", "controls mean ± sd", "p"]


def check_printed_table(printed: str, report: dict) -> None:
    """The table `analyze.py intervene` prints, read by its columns' offsets, against intervene.json: a row per
    intervention and metric it has an effect for (the name on its first row only); before: the unmodified model's mean
    over layers 1..L (a loss: the loss), by hand from its per-layer values (the dims' shares summed); after: before +
    the effect, within the rounding of the intervened model's own mean; effect, controls' mean ± sd and p; 3 decimals,
    effects signed, '-' where there is none."""
    def shown(value, sign: bool = True) -> str:
        if value is None:
            return "-"
        text = "+0.000" if round(value, 3) == 0 else f"{value:+.3f}"
        return text if sign else text.lstrip("+")

    def mean(entry: dict, key: str) -> float | None:
        if key in ("mlm_loss", "lm_loss"):
            return entry["tasks"][key]
        if key == "outlier_share":
            values = [sum(entry["stats"]["share"][str(d)][layer] for d in report["dims"])
                      for layer in range(1, report["num_layers"] + 1)]
        else:
            values = [v for v in (entry["stats"].get(key) or entry["tasks"][key] or [])[1:] if v is not None]
        return sum(values) / len(values) if values else None

    lines = printed.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == HEADERS[:2])
    offsets = [0]
    for before_it, header in zip(HEADERS, HEADERS[1:]):
        offsets.append(lines[start].index(header, offsets[-1] + len(before_it)))
    expected = []
    for name, entry in report["interventions"].items():
        if "skipped" in entry:
            continue
        first = name
        for key, label in TABLE.items():
            effect_key = key if key.endswith("loss") else f"{key}_mean"
            if effect_key not in entry["effects"]:
                continue
            before, effect = mean(report["baseline"], key), entry["effects"][effect_key]
            controls = entry.get("controls", {}).get(effect_key)
            spread = "-" if controls is None else shown(controls["mean"]) + (
                "" if controls["sd"] is None else f" ± {controls['sd']:.3f}")
            p = "-" if controls is None or controls["p_value"] is None else f"{controls['p_value']:.3f}"
            after = None if before is None or effect is None else before + effect
            dims = " " + ",".join(map(str, report["dims"])) if key == "outlier_share" else ""
            expected.append(([first, label + dims, shown(before, False), shown(after, False), shown(effect), spread, p],
                             mean(entry, key)))
            first = ""
    assert expected
    for line, (cells, own) in zip(lines[start + 1:], expected, strict=False):
        read = [line[a:b].strip() for a, b in zip(offsets, [*offsets[1:], None])]
        assert read == cells, line
        if own is not None:  # after: the intervened model's own value, to the table's rounding
            assert float(read[3]) == pytest.approx(own, abs=5e-4 + 1e-6), line


def check_intervention_figure(drawn: list[dict], report: dict) -> None:
    """intervene.png, read back against intervene.json: a panel per statistic the report has (the dims' summed share,
    anisotropy, kurtosis, max |activation|), the unmodified model's line and each intervention's, and around the
    latter the band of its random-dim controls: before + their mean effect, ± their sd, per layer."""
    layers, dims = list(range(LAYERS + 1)), report["dims"]

    def per_layer(entry: dict, key: str) -> list:
        if key == "outlier_share":  # the summed share of the dims, per layer
            return [sum(entry["stats"]["share"][str(d)][layer] for d in dims) for layer in layers]
        return entry["stats"][key]

    keys = ["outlier_share", "anisotropy", "kurtosis", "max_abs"]  # no STS, probe: not asked for here
    assert len(drawn) == len(keys) and all(report["baseline"]["tasks"][key] is None for key in ("sts", "probe"))
    for panel, key in zip(drawn, keys):
        before = per_layer(report["baseline"], key)
        assert sorted(panel["lines"]) == sorted(["before (unmodified)", *(f"after {name}" for name in
                                                                          report["interventions"])]), key
        same(panel["lines"]["before (unmodified)"], layers, before, atol=1e-6)
        for name, entry in report["interventions"].items():
            same(panel["lines"][f"after {name}"], layers, per_layer(entry, key), atol=1e-6)
        (band,) = panel["bands"]  # the one intervention's controls
        controls = report["interventions"]["layernorm_zero"]["controls"][key]
        for layer in layers:
            centre = before[layer] + controls["mean"][layer]
            assert band[layer] == pytest.approx((centre - controls["sd"][layer], centre + controls["sd"][layer]),
                                                abs=1e-5), (key, layer)


def test_probe_reports_the_sentences_it_used_and_warns_once_about_dropped_positions(tmp_path, bert_tok, recwarn):
    """A text with fewer sentences than --probe_sentences (500) and two paragraphs longer than the probe's 300
    positions: the report counts the sentences and tokens the probe used (not the 500 asked for), the dropped tokens
    match the tokenizer's count, and the warning is given once (not once per probe pass) without naming probe.py's
    --data.max_positions, which analyze.py does not have; so is the probe's truncation warning."""
    length = 320
    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok, max_position_embeddings=length)
    texts = corpus_sentences(18, start=40) + [" ".join(corpus_sentences(40, start=s)) for s in (100, 200)]
    data = tmp_path / "text.txt"
    data.write_text("\n".join(texts) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    assert run("--encoder", encoder, "--data", data, "--max_length", length, "--controls", 1, "--num_pairs", 5,
               "--probe", "--probe_epochs", 1, "--output_dir", out) == 0
    probe = json.loads((out / "intervene.json").read_text())["probe"]
    lengths = [min(len(ids), length) for ids in bert_tok(texts)["input_ids"]]
    dropped = sum(max(0, n - 300) for n in lengths)
    assert dropped > 0 and probe["probe_sentences"] == 500 and probe["max_positions"] == 300
    assert probe["sentences"] == len(texts) == sum(split["sentences"] for split in probe["splits"].values())
    assert sum(split["tokens"] + split["dropped_positions"] for split in probe["splits"].values()) == sum(lengths)
    assert sum(split["dropped_positions"] for split in probe["splits"].values()) == dropped
    warned = [str(w.message) for w in recwarn if "the probe leaves out" in str(w.message)]
    assert len(warned) == 1 and f"{dropped} tokens" in warned[0] and "--data." not in warned[0]
    cut = sum(len(ids) > length for ids in bert_tok(texts)["input_ids"])  # the probe's sentences over --max_length
    truncated = [str(w.message) for w in recwarn if "were longer than" in str(w.message)]
    assert cut > 0 and truncated == [f"{cut} sentences were longer than {length} tokens and were truncated (counted "
                                     "in the report as num_truncated)"]  # once, not once per probe pass


def hand_mlm_loss(model, tokenizer, texts: list[str]) -> tuple[float, int]:
    """Each sentence alone (no padding, cut to 40 tokens), masked by MaskCollator as its own block keyed by its index,
    full logits."""
    total, count = 0.0, 0
    for index, text in enumerate(texts):
        ids = torch.tensor(tokenizer(text, truncation=True, max_length=40)["input_ids"])
        masked = MaskCollator(tokenizer, len(ids), 0.15, seed=0)({"blocks": ids[None].numpy(), "keys": [index]})
        with torch.no_grad():
            logits = model(input_ids=masked["input_ids"]).logits[0]
        chosen = masked["targets"][0] != -100
        total += nn.functional.cross_entropy(logits[masked["positions"][0][chosen]], masked["targets"][0][chosen],
                                             reduction="sum").item()
        count += int(chosen.sum())
    return total / count, count


def test_mlm_loss_equals_a_hand_loop_with_the_same_masks(tmp_path, roberta_tok, capsys):
    encoder = save_tiny_encoder(tmp_path / "roberta", "roberta", roberta_tok, masked_lm=True)
    digest = hashlib.sha256((encoder / "model.safetensors").read_bytes()).hexdigest()
    data, out = data_file(tmp_path, 14, start=50), tmp_path / "out"
    assert run("--encoder", encoder, "--data", data, "--max_sentences", 0, "--interventions", "position_mean",
               "--batch_size", 5, "--num_pairs", 7, "--max_length", 40, "--output_dir", out) == 0
    report = json.loads((out / "intervene.json").read_text())
    check_printed_table(capsys.readouterr().out, report)
    tokenizer, model = AutoTokenizer.from_pretrained(encoder), AutoModelForMaskedLM.from_pretrained(encoder).eval()
    texts = corpus_sentences(14, start=50)
    loss, count = hand_mlm_loss(model, tokenizer, texts)
    assert report["mlm"]["head"] is True and report["mlm"]["masked_tokens"] == count
    assert report["baseline"]["tasks"]["mlm_loss"] == pytest.approx(loss, abs=1e-5)
    with torch.no_grad():  # position_mean by hand: the usable rows (after RoBERTa's padding row) set to their mean
        rows = model.roberta.embeddings.position_embeddings.weight[2:]
        rows.copy_(rows.mean(0).expand_as(rows))
    edited, _ = hand_mlm_loss(model, tokenizer, texts)
    result = report["interventions"]["position_mean"]
    assert result["tasks"]["mlm_loss"] == pytest.approx(edited, abs=1e-5)
    assert result["effects"]["mlm_loss"] == pytest.approx(edited - loss, abs=1e-5)
    assert hashlib.sha256((encoder / "model.safetensors").read_bytes()).hexdigest() == digest


def _ddp_worker(rank: int, port: int, argv: list[str]) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        assert analyze.main(argv) == 0
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_two_processes_equal_one(tmp_path, roberta_tok):
    import torch.multiprocessing as mp

    encoder = save_tiny_encoder(tmp_path / "roberta", "roberta", roberta_tok, masked_lm=True)
    data = data_file(tmp_path, 21, start=100)
    argv = ["intervene", "--no_progress", "--encoder", str(encoder), "--data", str(data), "--max_sentences", "0",
            "--batch_size", "4", "--num_pairs", "10", "--controls", "2", "--dims", "3,11", "--interventions",
            "position_shuffle", "activation_mean", "--device", "cpu"]
    assert analyze.main([*argv, "--output_dir", str(tmp_path / "one")]) == 0
    mp.start_processes(_ddp_worker, args=(free_port(), [*argv, "--output_dir", str(tmp_path / "two")]), nprocs=2,
                       start_method="spawn", join=True)
    one, two = (json.loads((tmp_path / name / "intervene.json").read_text()) for name in ("one", "two"))
    assert one["mlm"]["masked_tokens"] > 0 and one["num_sentences"] == 21
    reports_close(one, two, rel=1e-4, abs=1e-5, skip=(".output_dir",))  # sums of 2 shards: another order


def test_bad_requests_are_one_line_and_write_nothing(tmp_path, bert_tok, roberta_tok, capfd):
    bert = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok)
    nope = save_tiny_encoder(tmp_path / "nope", "roberta", roberta_tok,
                             plant=lambda model: model.embeddings.position_embeddings.weight.zero_())
    distil = save_tiny_encoder(tmp_path / "distil", "distilbert", bert_tok)
    data = data_file(tmp_path, 6)
    cases = {
        "dim out of range": ([bert, "--dims", "5,32"], "--dims [32]: the dims of"),
        "layer out of range": ([bert, "--interventions", "activation_zero", "--layers", "1-4"], "--layers [4]"),
        "no position table": ([nope, "--interventions", "layernorm_zero", "position_mean"],
                              "position_mean needs an absolute position-embedding table"),
        "no token types": ([distil, "--interventions", "token_type_zero"], "token_type_zero needs token-type"),
        "bad dims": ([bert, "--dims", "a,b"], "--dims must be a list of numbers"),
        "negative controls": ([bert, "--controls", "-1"], "--controls must be 0 or more"),
        "probe without epochs": ([bert, "--probe", "--probe_epochs", "0"], "--probe needs --probe_epochs >= 1"),
        "too few control dims": ([bert, "--dims", "0-20", "--controls", "1"],  # 32 dims: fewer than 21 left once the dims and outliers are out
                                 "21 control dims wanted, but only"),
    }
    for case, ((encoder, *argv), message) in cases.items():
        out = tmp_path / f"out-{case.replace(' ', '-')}"
        assert run("--encoder", encoder, "--data", data, "--output_dir", out, *argv) == 2, case
        errors = [line for line in capfd.readouterr().err.splitlines() if "error:" in line]
        assert len(errors) == 1 and message in errors[0], (case, errors)
        assert not out.exists(), case
    args = analyze.build_parser().parse_args(["intervene", "--probe"])  # under torchrun: refused before any work
    with pytest.raises(UserError, match="--probe trains in one process"):
        parse_request(args, world=2)
    normless = AutoModel.from_pretrained(bert)  # every LayerNorm gone: nothing layernorm_zero could edit
    for module in list(normless.modules()):
        for child, value in list(module.named_children()):
            if isinstance(value, torch.nn.LayerNorm):
                setattr(module, child, torch.nn.Identity())
    with pytest.raises(UserError, match="layernorm_zero needs LayerNorms or RMSNorms over the hidden size, and x has none"):
        check_intervention(normless, "layernorm_zero", "x")
    capfd.readouterr()  # transformers' loading bar of the model built above
    with pytest.raises(SystemExit) as exit_info:  # argparse: an unknown intervention
        run("--encoder", bert, "--data", data, "--interventions", "position_median", "--output_dir", tmp_path / "x")
    assert exit_info.value.code == 2 and not (tmp_path / "x").exists()
    errors = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(errors) == 1 and "invalid choice: 'position_median'" in errors[0]


@pytest.mark.slow
def test_minilm_end_to_end_baseline_equals_the_other_analyses(minilm_path, tmp_path, capsys):
    """The packaged MiniLM: the baseline equals `analyze.py outliers`, `anisotropy --clip none` and `sts` on the same
    data; position_mean removes the position information the layer-0 probe reads; the file on disk is unchanged."""
    data = data_file(tmp_path, 40, start=3000)
    pairs = [(a, b, i % 6) for i, (a, b) in enumerate(zip(corpus_sentences(12, 4000), corpus_sentences(12, 4012)))]
    sts = tmp_path / "sts.tsv"
    sts.write_text("sentence1\tsentence2\tscore\n" + "".join(f"{a}\t{b}\t{s}\n" for a, b, s in pairs), "utf-8")
    weights = Path(minilm_path) / "model.safetensors"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    common = ["--encoder", minilm_path, "--data", data, "--max_sentences", 0, "--max_length", 48, "--batch_size", 8]
    out = tmp_path / "intervene"
    assert run(*common, "--interventions", "position_mean", "layernorm_zero", "--controls", 1, "--num_pairs", 20,
               "--sts", sts, "--probe", "--probe_sentences", 100, "--probe_epochs", 1, "--output_dir", out) == 0
    report = json.loads((out / "intervene.json").read_text())
    printed = capsys.readouterr().out
    check_printed_table(printed, report)
    for analysis, extra in (("outliers", []), ("anisotropy", ["--clip", "none", "--num_pairs", 20]),
                            ("sts", ["--clip", "none"])):
        argv = [analysis, "--no_progress", *map(str, common), *map(str, extra), "--output_dir", str(tmp_path / analysis)]
        if analysis == "sts":  # every pair of its file: no --max_sentences
            argv[argv.index("--data") + 1] = str(sts)
            del argv[argv.index("--max_sentences"):argv.index("--max_sentences") + 2]
        assert analyze.main(argv) == 0
    outliers = json.loads((tmp_path / "outliers" / "outliers.json").read_text())
    anisotropy = json.loads((tmp_path / "anisotropy" / "anisotropy.json").read_text())
    sts_report = json.loads((tmp_path / "sts" / "sts.json").read_text())
    baseline = report["baseline"]
    assert report["persistent_dims"] == outliers["persistent_dims"] == report["dims"]
    assert baseline["stats"]["kurtosis"] == pytest.approx([row["kurtosis_mean"] for row in outliers["layers"]],
                                                          rel=1e-5)
    assert baseline["stats"]["max_abs"] == pytest.approx([row["max_abs"] for row in outliers["layers"]], rel=1e-5)
    # the tracked dims: --dims and every layer's outliers as `analyze.py outliers` finds them
    assert report["dims"] and set(report["tracked_dims"]) == {*report["dims"], *(d for row in outliers["layers"]
                                                                              for d in row["outlier_dims"])}
    checked = 0
    for row in outliers["layers"]:  # a tracked dim's share: its share as max + its share as min (<= the top min share)
        for own, other in (("argmax", "argmin"), ("argmin", "argmax")):
            share = baseline["stats"]["share"].get(str(row[f"{own}_dim"]))
            if row[f"{own}_dim"] in row["outlier_dims"]:
                assert share is not None, (row["layer"], own)
            if share is None:
                continue
            value, checked = share[row["layer"]], checked + 1
            if row["argmax_dim"] == row["argmin_dim"]:
                assert value == pytest.approx(row["argmax_share"] + row["argmin_share"], abs=1e-6)
            else:
                assert row[f"{own}_share"] - 1e-6 <= value <= row[f"{own}_share"] + row[f"{other}_share"] + 1e-6
    assert checked > 0
    assert baseline["stats"]["anisotropy"] == pytest.approx([row["raw"] for row in anisotropy["layers"]], abs=1e-5)
    assert baseline["tasks"]["sts"] == pytest.approx([row["raw"] for row in sts_report["layers"]], abs=1e-4)
    assert report["mlm"]["head"] is False and baseline["tasks"]["mlm_loss"] is None
    position = report["interventions"]["position_mean"]["tasks"]["probe"]
    assert position[0] < baseline["tasks"]["probe"][0] - 0.1  # layer 0: the position rows were all it had
    assert set(report["interventions"]["layernorm_zero"]["controls"]) >= {"anisotropy", "probe_mean", "sts"}
    assert "layernorm_zero" in printed and "position probe accuracy" in printed
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == digest


def test_a_checkpoints_head_gives_the_training_loss(tmp_path, roberta_tok):
    """A train.py .ckpt with a padded vocabulary: load_encoder(masked_lm=True) keeps its head, and masked_lm_loss on
    padded sentences equals the training loss (lightning_modules.mlm.mlm_loss, padding rows cut) of each alone."""
    from core.tokenizers import tokenizer_files, vocab_limit
    from datamodules.masking import SentenceMasker
    from lightning_modules.encoder import load_encoder
    from lightning_modules.interventions import masked_lm_loss
    from lightning_modules.mlm import build_model, mlm_loss, padded_vocab

    vocab = vocab_limit(roberta_tok)
    hparams = {"vocab_size": vocab, "hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 4,
               "intermediate_size": 64, "max_position_embeddings": 66, "position_embeddings": True,
               "pad_vocab_to_multiple_of": 64}
    torch.manual_seed(0)
    model = build_model(padded_vocab(vocab, 64), HIDDEN, 2, 4, 64, 66, dropout=0.0, position_embeddings=True).eval()
    assert model.config.vocab_size > vocab  # the head has padding rows
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {f"model.{key}": value for key, value in model.state_dict().items()},
                "hyper_parameters": hparams, "global_step": 1,
                "MLMDataModule": {"tokenizer_files": tokenizer_files(roberta_tok)}}, path)
    encoder = load_encoder(path, device="cpu", masked_lm=True)
    assert encoder.masked_lm is not None and encoder.mlm_vocab_size == vocab
    inputs, _ = encoder.tokenize(corpus_sentences(4, start=200), max_length=24)
    batch = SentenceMasker(roberta_tok, seed=0)(inputs["input_ids"], inputs["attention_mask"], [0, 1, 2, 3])
    loss, count = masked_lm_loss(encoder, batch)
    total, expected_count = 0.0, 0
    for row in range(4):
        length = int(inputs["attention_mask"][row].sum())
        alone = {"input_ids": batch["input_ids"][row:row + 1, :length], "positions": batch["positions"][row:row + 1],
                 "targets": batch["targets"][row:row + 1]}
        with torch.no_grad():
            value, n = mlm_loss(model, alone, vocab_size=vocab)
        total, expected_count = total + value.item() * int(n), expected_count + int(n)
    assert int(count) == expected_count and loss.item() == pytest.approx(total / expected_count, abs=1e-5)


def test_hidden_states_past_float16s_range_are_one_line_and_write_nothing(tmp_path, bert_tok, capfd):
    """Dim 5 of every token's embedding sums to 120,000, past float16's 65,504: inf, then nan after the embedding
    LayerNorm. The massive activations' histogram crashed on it (torch's bincount) and every other statistic counted
    it; in float32 the same model runs."""
    def plant(model):
        model.embeddings.word_embeddings.weight[:, 5] = 6e4
        model.embeddings.position_embeddings.weight[:, 5] = 6e4

    encoder = save_tiny_encoder(tmp_path / "bert", "bert", bert_tok, plant=plant)
    data = data_file(tmp_path, 6)
    for command in (["outliers"], ["intervene", "--dims", "5"]):
        out = tmp_path / command[0]
        argv = [*command, "--no_progress", "--encoder", str(encoder), "--data", str(data), "--device", "cpu"]
        assert analyze.main([*argv, "--dtype", "float16", "--output_dir", str(out)]) == 2
        errors = [line for line in capfd.readouterr().err.splitlines() if "error:" in line]
        assert len(errors) == 1 and "its hidden states hold inf or nan in float16 (from layer 0" in errors[0], errors
        assert not out.exists()
    assert analyze.main([*argv, "--dtype", "float32", "--output_dir", str(out)]) == 0
    report = json.loads((out / "intervene.json").read_text())
    assert report["baseline"]["stats"]["share"]["5"][0] == 1.0  # after the LayerNorm dim 5 is every token's max
