"""Hub ids and `datasets` names loaded offline from a populated cache (HF_HUB_OFFLINE=1, as on compute nodes without
internet): the cache layouts are written by hand (tests/hub_cache.py), and what our loaders read from them equals what
was put there (weights and hidden states of the source model, the rows written), computed from the source itself."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import analyze
import probe
from core.errors import UserError
from core.sources import short_name
from core.tokenizers import fingerprint, load_tokenizer
from datamodules.pairs import read_sts, read_wic
from datamodules.text import iter_records, iter_texts, split_names
from lightning_modules.encoder import load_encoder
from tests.hub_cache import cache_dataset, cache_model, hub_caches
from tests.tiny import corpus_sentences, reports_close, roberta_tokenizer, save_tiny_encoder
from tests.tiny_families import decoder_tokenizer, save_tiny_family

pytestmark = pytest.mark.usefixtures("one_thread")
SENTENCES = corpus_sentences(60)


def sst2_rows(start: int, stop: int) -> list[dict]:
    return [{"sentence": text, "label": int(index % 3 != 0), "idx": index}
            for index, text in enumerate(SENTENCES[start:stop], start)]


def wic_rows() -> list[dict]:
    rows = []
    for text in SENTENCES[:12]:
        word = max(text.split(), key=len).strip(".,;:!?\"'")
        start = text.index(word)
        rows.append({"word": word.lower(), "sentence1": text, "sentence2": text, "start1": start, "end1": start + len(word),
                     "start2": start, "end2": start + len(word), "idx": len(rows), "label": len(rows) % 2})
    return rows


STS_ROWS = [{"split": "test", "sentence1": SENTENCES[i], "sentence2": SENTENCES[i + 1], "score": (i * 0.7) % 5}
            for i in range(8)]


@pytest.fixture(scope="module")
def caches(tmp_path_factory, bert_tok):
    """Sources saved with save_pretrained, then cached as the hub leaves them: a BERT as `someorg/tiny-bert` (main)
    and a RoBERTa as its tag `v2`, a GPT-2 under a legacy id without an org (`tiny-gpt2`, as `bert-base-uncased`), the
    BERT's weights in safetensors shards and in a pytorch_model.bin;
    datasets: a parquet repo `someorg/tiny-sst2`, a `tiny-glue` with config `sst2`, a `tiny-wikitext` with config
    `tiny-raw-v1`, and the STS-B and WiC presets' own names (mteb/stsbenchmark-sts, super_glue:wic)."""
    from transformers import AutoModel

    root = tmp_path_factory.mktemp("hf")
    sources = {"bert": save_tiny_encoder(root / "src" / "bert", "bert", bert_tok),
               "roberta": save_tiny_encoder(root / "src" / "roberta", "roberta", roberta_tokenizer(root / "rtok")),
               "gpt2": save_tiny_family(root / "src" / "gpt2", "gpt2", decoder_tokenizer(root / "gtok"))}
    hub, data = root / "hub", root / "datasets"
    commits = {"main": cache_model(hub, "someorg/tiny-bert", sources["bert"]),
               "v2": cache_model(hub, "someorg/tiny-bert", sources["roberta"], ref="v2")}
    cache_model(hub, "someorg/tiny-roberta", sources["roberta"])
    cache_model(hub, "tiny-gpt2", sources["gpt2"])
    # the weights as bigger and older repositories hold them: safetensors shards with their index, pytorch_model.bin
    model = AutoModel.from_pretrained(sources["bert"])
    model.save_pretrained(root / "src" / "sharded", max_shard_size="100KB")
    bert_tok.save_pretrained(root / "src" / "sharded")
    cache_model(hub, "someorg/tiny-bert-sharded", root / "src" / "sharded")
    legacy = root / "src" / "bin"
    bert_tok.save_pretrained(legacy)
    shutil.copy(sources["bert"] / "config.json", legacy)
    torch.save(model.state_dict(), legacy / "pytorch_model.bin")
    cache_model(hub, "someorg/tiny-bert-bin", legacy)
    splits = {"train": sst2_rows(0, 40), "validation": sst2_rows(40, 50), "test": sst2_rows(50, 60)}
    cache_dataset(data, "someorg/tiny-sst2", splits)
    hidden_labels = [{**row, "label": -1} for row in splits["test"]]  # GLUE's test split: labels hidden (-1)
    cache_dataset(data, "tiny-glue", {**splits, "test": hidden_labels}, config="sst2")
    cache_dataset(data, "tiny-wikitext", {"train": [{"text": t} for t in [*SENTENCES[:20], "", " "]],
                                          "validation": [{"text": t} for t in SENTENCES[20:25]]}, config="tiny-raw-v1")
    cache_dataset(data, "mteb/stsbenchmark-sts", {"test": STS_ROWS})
    cache_dataset(data, "super_glue", {"train": wic_rows(), "validation": wic_rows()[:4]}, config="wic")
    return root, sources, commits


@pytest.fixture
def offline(caches, monkeypatch, tmp_path):
    root, sources, commits = caches
    monkeypatch.chdir(tmp_path)  # no folder of the working directory shadows an id
    with hub_caches(monkeypatch, root):
        yield sources, commits, root


def hidden(model, tokenizer, text: str) -> torch.Tensor:
    """[layers, tokens, hidden] of one sentence."""
    with torch.no_grad():
        inputs = tokenizer(text, truncation=True, max_length=32, return_tensors="pt")
        return torch.stack(model(**inputs, output_hidden_states=True).hidden_states)[:, 0]


def test_hub_ids_load_from_the_cache_with_the_source_models_weights(offline):
    from transformers import AutoModel, AutoTokenizer

    sources, commits, root = offline
    text = SENTENCES[3]
    for repo, source in (("someorg/tiny-bert", "bert"), ("someorg/tiny-roberta", "roberta"), ("tiny-gpt2", "gpt2"),
                         ("someorg/tiny-bert-sharded", "bert"), ("someorg/tiny-bert-bin", "bert")):
        encoder = load_encoder(repo, device="cpu")
        direct = AutoModel.from_pretrained(sources[source]).eval()  # from the saved directory, not the cache
        tokenizer = AutoTokenizer.from_pretrained(sources[source])
        assert encoder.name == repo and encoder.short_name == repo.split("/")[-1]
        assert encoder.tokenizer.get_vocab() == tokenizer.get_vocab()
        mine, theirs = encoder.model.state_dict(), direct.state_dict()
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
        assert torch.equal(hidden(encoder.model, encoder.tokenizer, text), hidden(direct, tokenizer, text))
    # the files read are the snapshot of refs/main: its commit's folder, symlinks into blobs/
    snapshot = root / "hub" / "models--someorg--tiny-bert" / "snapshots" / commits["main"]
    assert (snapshot / "model.safetensors").is_symlink()
    shards = list((root / "hub" / "models--someorg--tiny-bert-sharded").glob("snapshots/*/model-*.safetensors"))
    assert len(shards) >= 2 and all(shard.is_symlink() for shard in shards)
    from huggingface_hub import try_to_load_from_cache

    assert try_to_load_from_cache("someorg/tiny-bert", "config.json") == str(snapshot / "config.json")
    # the tokenizer as train.py's --data.tokenizer loads it: the source's definition
    assert fingerprint(load_tokenizer("someorg/tiny-roberta")) == fingerprint(
        AutoTokenizer.from_pretrained(sources["roberta"]))


def test_analyze_on_a_hub_id_reports_what_the_local_directory_gives_and_an_uncached_id_is_one_line(offline, capsys):
    sources, commits, root = offline
    common = ["outliers", "--no_progress", "--max_sentences", "6"]
    assert analyze.main([*common, "--encoder", "someorg/tiny-bert", "--output_dir", "by-id"]) == 0
    assert analyze.main([*common, "--encoder", str(sources["bert"]), "--output_dir", "by-path"]) == 0
    by_id, by_path = (json.loads(open(f"{name}/outliers.json").read()) for name in ("by-id", "by-path"))
    assert by_id["encoder"] == "someorg/tiny-bert" and by_path["encoder"] == str(sources["bert"])
    # the commit read: refs/main's, the snapshot's directory name; none for a local directory
    refs_main = (root / "hub" / "models--someorg--tiny-bert" / "refs" / "main").read_text()
    assert by_id["encoder_commit"] == refs_main == commits["main"] and by_path["encoder_commit"] is None
    reports_close(by_id, by_path, skip=(".encoder", ".encoder_commit"), rel=0, abs=0)
    capsys.readouterr()
    assert analyze.main([*common, "--encoder", "someorg/not-cached", "--output_dir", "none"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("analyze.py outliers: error: cannot load encoder "
                                                   "'someorg/not-cached' (offline: HF_HUB_OFFLINE")
    assert not os.path.exists("none")


def test_a_snapshot_directory_loads_under_its_name_and_a_local_folder_named_as_an_id_wins(offline, tmp_path):
    from transformers import AutoModel

    sources, commits, root = offline
    # the snapshot of refs/v2 (the RoBERTa), passed as a directory, loads under the repository's name
    folder = root / "hub" / "models--someorg--tiny-bert"
    snapshot = folder / "snapshots" / (folder / "refs" / "v2").read_text()
    assert snapshot.name == commits["v2"]
    encoder = load_encoder(str(snapshot), device="cpu")
    assert encoder.short_name == "tiny-bert" == short_name(str(snapshot))
    direct = AutoModel.from_pretrained(sources["roberta"]).state_dict()
    assert all(torch.equal(value, direct[key]) for key, value in encoder.model.state_dict().items())
    # a folder of the working directory named as a legacy id is that folder (the path rule: it exists here)
    (tmp_path / "tiny-gpt2").symlink_to(sources["bert"], target_is_directory=True)
    assert encoder_type(load_encoder("tiny-gpt2", device="cpu")) == "bert"
    # `org/name` beside a folder `org/`: read as a path, and the line says why
    (tmp_path / "someorg").mkdir()
    with pytest.raises(UserError) as error:
        load_encoder("someorg/tiny-bert", device="cpu")
    assert str(error.value) == ("encoder path not found: someorg/tiny-bert (read as a local path because ./someorg is "
                                "a directory here; to load the hub name 'someorg/tiny-bert', run from a directory "
                                "without it)")
    with pytest.raises(UserError) as error:  # with a revision too: a path, not found, and why
        load_encoder("someorg/tiny-bert@v2", device="cpu")
    assert str(error.value).startswith("encoder path not found: someorg/tiny-bert@v2 (read as a local path because "
                                       "./someorg is a directory here")
    with pytest.raises(UserError, match=r"^data path not found: someorg/tiny-sst2 \(read as a local path because "):
        list(iter_records("someorg/tiny-sst2"))


def encoder_type(encoder) -> str:
    return encoder.model.config.model_type


def test_datasets_names_read_the_rows_of_the_prepared_cache(offline):
    assert split_names("someorg/tiny-sst2") == ["train", "validation", "test"]
    assert list(iter_records("someorg/tiny-sst2")) == sst2_rows(0, 40)  # train, the default split
    assert list(iter_records("someorg/tiny-sst2:default:test")) == sst2_rows(50, 60)
    # NAME/CONFIG read as name and config when no repository NAME/CONFIG is cached; NAME:CONFIG:SPLIT
    assert list(iter_records("tiny-glue/sst2", split="validation")) == sst2_rows(40, 50)
    assert list(iter_records("tiny-glue:sst2:validation")) == sst2_rows(40, 50)
    # a corpus name as train.py's --data.corpus reads it: blank rows skipped
    assert list(iter_texts("tiny-wikitext:tiny-raw-v1:train")) == SENTENCES[:20]
    # the analyses' presets name hub datasets: stsb (mteb/stsbenchmark-sts::test) and wic (super_glue:wic:train)
    pairs, unscored = read_sts("stsb")
    assert unscored == 0 and [(p.sentence1, p.sentence2, p.score) for p in pairs] == \
        [(r["sentence1"], r["sentence2"], pytest.approx(r["score"])) for r in STS_ROWS]
    items, skipped = read_wic("wic")
    assert skipped.count == 0 and [(i.word, i.sentence1, i.span1, i.label) for i in items] == \
        [(r["word"], r["sentence1"], (r["start1"], r["end1"]), bool(r["label"])) for r in wic_rows()]
    with pytest.raises(UserError) as error:
        list(iter_records("someorg/not-cached"))
    assert str(error.value).startswith("cannot load dataset 'someorg/not-cached' (offline: HF_DATASETS_OFFLINE")


@pytest.mark.slow
def test_probe_fit_on_a_hub_id_and_a_datasets_name(offline):
    _, commits, _ = offline
    quiet = ["--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.accelerator", "cpu",
             "--trainer.enable_model_summary", "false", "--data.progress", "false"]
    config = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "probe", "sst2.yaml")
    probe.cli_main(["fit", "--config", config, *quiet, "--model.encoder", "someorg/tiny-bert", "--data.source",
                    "tiny-glue/sst2", "--trainer.max_epochs", "1", "--data.random_baseline", "false",
                    "--data.control_task", "false", "--trainer.default_root_dir", "run"])
    report = json.loads(open("run/classifier.json").read())
    assert report["encoder"] == "someorg/tiny-bert" and report["source"] == "tiny-glue/sst2"
    assert report["encoder_commit"] == commits["main"]  # the snapshot refs/main names, the hash the fixture made
    # GLUE's test labels hidden: its validation split is the test set, validation carved from train (10%)
    assert report["splits"] == {"train": {"sentences": 36}, "val": {"sentences": 4}, "test": {"sentences": 10}}
    train, test = [r["label"] for r in sst2_rows(0, 40)], [r["label"] for r in sst2_rows(40, 50)]
    majority = max(set(train), key=train.count)
    assert report["majority_baseline"] == pytest.approx(test.count(majority) / len(test))


@pytest.mark.slow
def test_train_fit_with_a_hub_tokenizer_and_a_datasets_corpus(offline, tmp_path):
    import yaml
    from transformers import AutoTokenizer

    import train
    from tests.test_train import tiny_args

    sources, _, _ = offline
    args = tiny_args(tmp_path / "run", "tiny-wikitext:tiny-raw-v1:train", tmp_path / "blocks",
                     "--data.tokenizer", "someorg/tiny-roberta", "--trainer.max_steps", "2")
    assert train.cli_main(args) == 0
    source = AutoTokenizer.from_pretrained(sources["roberta"])
    export = tmp_path / "run" / "export"
    assert AutoTokenizer.from_pretrained(export).get_vocab() == source.get_vocab()
    config = json.loads((export / "config.json").read_text())
    assert config["vocab_size"] == len(source) and config["pad_token_id"] == source.pad_token_id
    recorded = yaml.safe_load(next((tmp_path / "run").rglob("config.yaml")).read_text())["data"]  # the logger's copy
    assert (recorded["tokenizer"], recorded["corpus"]) == ("someorg/tiny-roberta", "tiny-wikitext:tiny-raw-v1:train")


def test_a_checkpoint_is_named_by_its_run_and_a_dot_by_its_folder(tmp_path, monkeypatch):
    """Figure titles and compare's columns: two runs' last.ckpt are told apart, and `--encoder .` is its folder."""
    assert short_name("runs/tiny/checkpoints/last.ckpt") == "tiny/last.ckpt"
    assert short_name(str(tmp_path / "run-a" / "checkpoints" / "epoch=0-step=5.ckpt")) == "run-a/epoch=0-step=5.ckpt"
    assert short_name("runs/tiny/export") == "tiny"
    (tmp_path / "my-model" / "sub").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "my-model")
    assert short_name(".") == "my-model" and short_name("sub/..") == "my-model"
