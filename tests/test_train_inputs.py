"""train.py's rejections of bad model, data and tokenizer settings (beyond tests/test_train.py's): one line on stderr
(`train.py: error: ...`), exit status 2, nothing written under --trainer.default_root_dir.

    .venv/bin/pytest tests/test_train_inputs.py -q
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import train
from core.errors import UserError
from tests.test_train import tiny_args
from tests.tiny import corpus_sentences

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")


def rejected(root: Path, corpus: Path, cache: Path, capsys, *extra: str) -> str:
    """train.py's error line for `extra`, checked to be one line and exit status 2."""
    assert train.cli_main(tiny_args(root, corpus, cache, *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert [line for line in err if line.startswith("train.py:")] == err[-1:] and "Traceback" not in "\n".join(err)
    assert err[-1].startswith("train.py: error: ")
    return err[-1].removeprefix("train.py: error: ")


def written(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*")) if root.exists() else []


@pytest.mark.parametrize("extra, message", [
    (("--model.hidden_size", "30"), "--model.hidden_size 30 is not a multiple of num_attention_heads 4"),
    (("--data.block_length", "3"), "--data.block_length too small: 3 (at least 4)"),
    (("--data.batch_size", "0"), "--data.batch_size too small: 0 (at least 1)"),
    (("--data.global_batch_size", "4"), "--data.global_batch_size 4 is below --data.batch_size 8"),
    (("--data.mlm_probability", "1.0"), "--data.mlm_probability must lie in (0, 1), got 1.0"),
    (("--data.val_fraction", "0"), "--data.val_fraction must lie in (0, 1), got 0.0"),
    (("--model.pad_vocab_to_multiple_of", "0"), "--model.pad_vocab_to_multiple_of must be at least 1, got 0"),
    (("--checkpoint.sigterm_every_n_steps", "0"), "--checkpoint.sigterm_every_n_steps must be at least 1, got 0"),
    (("--data.vocab_size", "100"), "--data.vocab_size must be at least 261 for a byte-level BPE, got 100"),
    (("--data.corpus", "EMPTY"), "data file is empty: EMPTY"),
])  # 261: the 5 special tokens and the 256 bytes
def test_bad_model_and_data_settings_are_one_line_exit_2_and_write_nothing(corpus, cache, tmp_path, capsys, extra,
                                                                           message):
    root, empty = tmp_path / "run", tmp_path / "empty.txt"
    empty.write_text("")
    extra = tuple(str(empty) if value == "EMPTY" else value for value in extra)
    assert rejected(root, corpus, cache, capsys, *extra) == message.replace("EMPTY", str(empty))
    assert written(root) == [] and not root.exists()


def save_tokenizer_without_mask(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1, "the": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]").save_pretrained(directory)


def test_a_tokenizer_that_cannot_be_used_is_one_line_exit_2_and_writes_nothing(corpus, cache, tmp_path, capsys):
    root, empty, no_mask = tmp_path / "run", tmp_path / "empty-dir", tmp_path / "no-mask"
    empty.mkdir()
    assert rejected(root, corpus, cache, capsys, "--data.tokenizer", str(empty)).startswith(
        f"cannot load tokenizer '{empty}': ")  # then transformers' first line
    hub_id = "no-such-org/no-such-tokenizer"  # hub-shaped, no such local directory: asked of the (offline) hub
    assert rejected(root, corpus, cache, capsys, "--data.tokenizer", hub_id).startswith(
        f"cannot load tokenizer '{hub_id}' (offline: ")  # the flags that say so (tests/test_offline.py)
    save_tokenizer_without_mask(no_mask)
    assert rejected(root, corpus, cache, capsys, "--data.tokenizer", str(no_mask)) == \
        f"tokenizer {no_mask} has no mask token, needed for MLM; name it: " \
        "PreTrainedTokenizerFast(tokenizer_file=..., mask_token=...).save_pretrained(DIR)"
    assert not root.exists()


def train_bare_tokenizer(style: str):
    """A tokenizer trained with the `tokenizers` library alone, as its documentation shows: byte-level BPE with
    RoBERTa's special-token names, or BERT's WordPiece with its [CLS] [SEP] [PAD] [UNK] [MASK]."""
    from tokenizers import BertWordPieceTokenizer, ByteLevelBPETokenizer

    texts = corpus_sentences(200)
    if style == "bpe":
        trainer = ByteLevelBPETokenizer()
        trainer.train_from_iterator(texts, vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
                                    show_progress=False)
    else:
        trainer = BertWordPieceTokenizer(lowercase=True)
        trainer.train_from_iterator(texts, vocab_size=300, show_progress=False)
    return trainer


@pytest.mark.parametrize("style, form", [("bpe", "directory"), ("bpe", "file"), ("wordpiece", "directory")])
def test_a_tokenizer_saved_by_the_tokenizers_library_takes_its_special_tokens_roles_from_their_names(tmp_path, style,
                                                                                                     form):
    """`Tokenizer.save("DIR/tokenizer.json")` (or a .json file itself) names no token's role; load_tokenizer takes
    them from the tokens' conventional names, with one warning, so MLM finds its mask and pad and the blocks their
    bos / eos (or [CLS] / [SEP]); the ids are the ones the trained vocabulary gives those names."""
    import warnings

    from core.tokenizers import boundary_ids, fingerprint, load_tokenizer

    trainer = train_bare_tokenizer(style)
    target = tmp_path / "tok" / "tokenizer.json" if form == "directory" else tmp_path / "tok.json"
    target.parent.mkdir(exist_ok=True)
    trainer.save(str(target))
    given = target.parent if form == "directory" else target
    with pytest.warns(UserWarning, match="names no special-token roles") as caught:
        tokenizer = load_tokenizer(given)
    vocab = trainer.get_vocab()
    names = ("<mask>", "<pad>", "<s>", "</s>") if style == "bpe" else ("[MASK]", "[PAD]", "[CLS]", "[SEP]")
    assert (tokenizer.mask_token_id, tokenizer.pad_token_id, *boundary_ids(tokenizer)) == tuple(vocab[n] for n in names)
    said = [str(w.message) for w in caught if "special-token roles" in str(w.message)]
    assert len(said) == 1 and all(name in said[0] for name in names)
    # the bare file adds nothing around a text; the model's blocks are <s> piece </s>: texts are framed the same way
    text = corpus_sentences(1, start=700)[0]
    assert trainer.encode(text).ids[0] != vocab[names[2]]
    assert tokenizer(text)["input_ids"] == [vocab[names[2]], *trainer.encode(text).ids, vocab[names[3]]]
    assert said[0].endswith(f"; each text framed {names[2]} ... {names[3]}, as the model's blocks are")
    again = tmp_path / "again"
    tokenizer.save_pretrained(again)  # as a checkpoint embeds it: roles and frame kept, nothing to warn about
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reloaded = load_tokenizer(again)
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"] and fingerprint(reloaded) == fingerprint(tokenizer)


def test_a_tokenizers_file_that_frames_its_texts_keeps_its_frame_and_takes_the_frames_names(tmp_path):
    """A WordPiece file with a [CLS] $A [SEP] template that also holds <s> and </s> (other special tokens): roles were
    taken as <s> / </s> (blocks framed <s> ... </s>, texts [CLS] ... [SEP]) and a second template was chained after
    the file's own, which the tokenizers library panics on at the first text (not even a Python exception). Now: the
    file's frame, once, and the roles of its convention, [CLS] [SEP] [PAD] [UNK] [MASK] (ids from the trained vocab)."""
    from tokenizers import processors

    from core.tokenizers import boundary_ids, load_tokenizer

    trainer = train_bare_tokenizer("wordpiece")
    trainer.add_special_tokens(["<s>", "</s>"])
    vocab = trainer.get_vocab()
    trainer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    target = tmp_path / "framed.json"
    trainer.save(str(target))
    with pytest.warns(UserWarning, match="names no special-token roles") as caught:
        tokenizer = load_tokenizer(target)
    text = corpus_sentences(1, start=700)[0]
    plain = trainer.encode(text, add_special_tokens=False).ids
    assert tokenizer(text)["input_ids"] == [vocab["[CLS]"], *plain, vocab["[SEP]"]]
    assert boundary_ids(tokenizer) == (vocab["[CLS]"], vocab["[SEP]"]) and tokenizer.bos_token is None
    assert (tokenizer.mask_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id) == (
        vocab["[MASK]"], vocab["[PAD]"], vocab["[UNK]"])
    said = [str(w.message) for w in caught if "special-token roles" in str(w.message)]
    assert len(said) == 1 and "each text framed" not in said[0]


@pytest.mark.parametrize("files, message", [
    (("vocab.json", "merges.txt"), "holds vocab.json + merges.txt alone, which does not say what tokenizer it is"),
    (("vocab.txt",), "holds vocab.txt alone, which does not say what tokenizer it is"),
    (("tok.model.bin",), "is a file; give the directory holding the tokenizer, or a tokenizers file (.json)"),
])
def test_tokenizer_files_that_do_not_say_what_tokenizer_they_are_are_one_line_exit_2(corpus, cache, tmp_path, capsys,
                                                                                     files, message):
    """`save_model` of the `tokenizers` library writes vocab.json + merges.txt (BPE) or vocab.txt (WordPiece) without
    saying which tokenizer they make (transformers' own error ends in "from one of: (1) ..."); a file that is not a
    tokenizers .json is not a tokenizer either: one line naming the remedy, nothing written."""
    root, folder = tmp_path / "run", tmp_path / "saved"
    folder.mkdir()
    if files[0].endswith(".bin"):
        (tmp_path / files[0]).write_bytes(b"\0\1")
        given = tmp_path / files[0]
    else:
        train_bare_tokenizer("bpe" if "merges.txt" in files else "wordpiece").save_model(str(folder))
        assert sorted(path.name for path in folder.iterdir()) == sorted(files)
        given = folder
    line = rejected(root, corpus, cache, capsys, "--data.tokenizer", str(given))
    assert line.startswith(f"cannot load tokenizer '{given}': {given} ") and message in line
    assert not root.exists()


@pytest.mark.parametrize("name", ["/ABSENT", "./absent-tokenizer", "SUBDIR/absent", "SUBDIR/nested/absent"])
def test_a_missing_tokenizer_path_is_named_not_taken_for_a_hub_id(corpus, cache, tmp_path, capsys, monkeypatch, name):
    """A path that is not there (absolute, ./relative, or under a directory that exists) is named as missing, not
    passed to the hub as a malformed repo id."""
    (tmp_path / "SUBDIR").mkdir()
    monkeypatch.chdir(tmp_path)
    name = name.replace("/ABSENT", str(tmp_path / "absent"))
    root = tmp_path / "run"
    hint = (" (read as a local path because ./SUBDIR is a directory here; to load the hub name 'SUBDIR/absent', run "
            "from a directory without it)") if name == "SUBDIR/absent" else ""
    assert rejected(root, corpus, cache, capsys, "--data.tokenizer", name) == f"tokenizer path not found: {name}{hint}"
    assert not root.exists() and not Path(name).exists()


def test_no_end_for_the_learning_rate_schedule_is_one_line_exit_2(corpus, cache, tmp_path, capsys):
    root = tmp_path / "run"
    message = rejected(root, corpus, cache, capsys, "--trainer.max_steps", "-1", "--trainer.max_epochs", "1",
                       "--model.decay_steps", "null")
    assert message == "set --trainer.max_steps or --model.decay_steps: the learning-rate schedule needs an end"
    assert written(root) == [] and not root.exists()


def no_prepare_data(monkeypatch) -> None:
    """From here on the error must come from train.py's checks before the fit (on every rank), not prepare_data's."""
    from datamodules.mlm import MLMDataModule

    def refuse(self):
        raise AssertionError("prepare_data reached")
    monkeypatch.setattr(MLMDataModule, "prepare_data", refuse)


def test_a_corpus_too_small_for_one_global_batch_is_one_line_exit_2(corpus, tmp_path, capsys, monkeypatch):
    import datasets

    root, cache = tmp_path / "run", tmp_path / "cache"
    extra = ("--data.batch_size", "64", "--data.global_batch_size", "64")
    message = rejected(root, corpus, cache, capsys, *extra)  # found in prepare_data, once the blocks are made
    (blocks,) = (cache / "blocks").iterdir()  # the packed corpus train.py made before it found out
    assert message == f"{len(datasets.load_from_disk(str(blocks))['train'])} training blocks make no full global " \
                      "batch of 64"
    assert written(root) == [] and not root.exists()
    no_prepare_data(monkeypatch)
    assert rejected(root, corpus, cache, capsys, *extra) == message  # found before the fit, from the cache
    assert written(root) == [] and not root.exists()


def test_a_cached_tokenizer_with_more_ids_than_the_model_is_one_line_exit_2(corpus, tmp_path, capsys, monkeypatch):
    from datamodules.mlm import MLMDataModule
    from datamodules.tokenizer import train_tokenizer

    root, cache = tmp_path / "run", tmp_path / "cache"
    planted = train_tokenizer(iter(corpus_sentences(2000)), vocab_size=700)  # edited by hand into the vocab 600 slot
    planted.save_pretrained(MLMDataModule(corpus=str(corpus), vocab_size=600, cache_dir=str(cache)).cache.tokenizer_dir(600, 1_000_000))
    top = max(planted.get_vocab().values())
    assert top >= 600
    no_prepare_data(monkeypatch)
    assert rejected(root, corpus, cache, capsys) == f"the tokenizer has ids up to {top} but the model only 600 " \
                                                    "embedding rows"
    assert written(root) == [] and not root.exists()


def test_a_sentence_transformers_tokenizer_pretrains_on_its_first_run(corpus, tmp_path, minilm_path):
    """MiniLM's tokenizer.json saves truncation and fixed padding, which its first call clears: the block cache is
    found under the key it was built with (before, the first run stopped with "block cache missing" after its logger
    started), and the blocks are the corpus's texts tokenised without special tokens, each followed by [SEP], framed
    [CLS] ... [SEP] (datamodules/blocks.py), computed directly with the tokenizer."""
    import datasets
    from transformers import AutoTokenizer

    root, cache = tmp_path / "run", tmp_path / "cache"
    assert train.cli_main(tiny_args(root, corpus, cache, "--data.tokenizer", minilm_path, "--trainer.max_steps", "2",
                                    "--model.decay_steps", "2", "--model.warmup_steps", "1")) == 0
    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    stream = [i for text in corpus.read_text(encoding="utf-8").splitlines() if text.strip()
              for i in (*tokenizer(text.strip(), add_special_tokens=False)["input_ids"], sep)]
    (built,) = (cache / "blocks").iterdir()
    blocks = datasets.load_from_disk(str(built))
    rows = [*blocks["train"]["input_ids"], *blocks["validation"]["input_ids"]]
    pieces = [stream[i * 30:(i + 1) * 30] for i in range(len(stream) // 30)]
    assert sorted(rows) == sorted([cls, *piece, sep] for piece in pieces)
    assert (root / "export" / "model.safetensors").is_file()


@pytest.mark.slow
def test_too_few_validation_blocks_for_the_ddp_processes_are_one_line_exit_2_and_write_nothing(corpus, cache, tmp_path):
    """A validation split of one block cannot give each of 2 DDP processes a batch: Lightning stops the rank without
    one with a traceback and the other with a gloo error, after the loggers wrote. Refused in prepare_data, before
    anything is written, and again from the block cache (before the fit, on every rank)."""
    import os
    import subprocess
    import sys

    from datamodules.mlm import MLMDataModule
    from tests.tiny import free_port

    root = tmp_path / "run"
    command = [sys.executable, str(Path(train.__file__)), *tiny_args(root, corpus, cache, "--data.max_val_blocks", "1",
                                                                     "--data.batch_size", "4", "--trainer.devices", "2",
                                                                     "--trainer.strategy", "ddp")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}
    finished = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    message = ("1 validation block cannot give each of the 2 processes one: raise --data.val_fraction (or "
               "--data.max_val_blocks), or train on fewer devices")
    assert finished.returncode == 2, finished.stderr[-2000:]
    assert finished.stderr.strip().splitlines()[-1] == f"train.py: error: {message}"
    assert "Traceback" not in finished.stderr and written(root) == []
    # the blocks are cached now: their counts, read another way, and the same refusal from the cache
    info = next(cache.rglob("blocks.json"), None)
    data = MLMDataModule(corpus=str(corpus), vocab_size=600, block_length=32, batch_size=4, global_batch_size=8,
                         val_fraction=0.1, max_val_blocks=1, cache_dir=str(cache))
    counts = json.loads((data.blocks_dir(data.cached_tokenizer()) / "blocks.json").read_text())
    assert info is not None and counts["validation"] == 1 and counts["train"] >= 8
    data.check_cache(600, 1)  # one process: its one validation block is enough
    with pytest.raises(UserError, match=re.escape(message)):
        data.check_cache(600, 2)


def test_a_gpt2_style_tokenizer_trains_the_causal_rotary_arm_and_its_pad_is_added(corpus, cache, tmp_path, capsys):
    """GPT-2's and Llama's tokenizers have no mask and no pad token. The causal arms need no mask; a pad token is
    added (its id after the vocabulary, which no block holds), said in one warning, and the export carries it. The
    learned-table arm cannot take that id (RoBERTa's positions start after the pad id): one line, nothing written."""
    from transformers import AutoTokenizer

    from tests.tiny_families import decoder_tokenizer

    source = tmp_path / "gpt2-style"
    original = decoder_tokenizer(tmp_path / "bpe", vocab_size=400)
    original.save_pretrained(source)
    assert original.mask_token_id is None and original.pad_token_id is None
    root = tmp_path / "learned"
    assert rejected(root, corpus, cache, capsys, "--data.tokenizer", str(source), "--model.objective", "causal") \
        .startswith(f"the tokenizer's pad id {len(original)} leaves no row of RoBERTa's position table")
    assert not root.exists()
    assert rejected(root, corpus, cache, capsys, "--data.tokenizer", str(source)) == (
        f"tokenizer {source} has no mask token, needed for MLM; name it: "
        "PreTrainedTokenizerFast(tokenizer_file=..., mask_token=...).save_pretrained(DIR)")

    root = tmp_path / "rope"
    with pytest.warns(UserWarning, match=f"has no pad token: added <pad> as id {len(original)} \\(the model's "
                                         "pad_token_id, which no training block holds\\)"):
        assert train.cli_main(tiny_args(root, corpus, cache, "--data.tokenizer", str(source), "--model.objective",
                                        "causal", "--model.positions", "rope")) == 0
    exported = AutoTokenizer.from_pretrained(root / "export")
    assert exported.pad_token == "<pad>" and exported.pad_token_id == len(original)
    text = "It is a truth universally acknowledged."
    assert exported(text)["input_ids"] == original(text)["input_ids"]  # the same ids for every text
    config = json.loads((root / "export" / "config.json").read_text())
    assert config["pad_token_id"] == len(original) and config["vocab_size"] >= len(original) + 1


def test_the_pad_token_is_never_in_a_training_block(bert_tok, tmp_path):
    """A text that writes the pad token ("[PAD]" in scraped text) loses it, and nothing else, when it is made into
    blocks: the pad id is the model's zero padding row, and where RoBERTa's positions restart. A tokenizer whose pad
    token is also its eos (GPT-2 fine-tunes pad with </s>) gets a dedicated pad, said in one warning."""
    from core.tokenizers import load_tokenizer
    from datamodules.blocks import tokenize_texts
    from tests.tiny_families import decoder_tokenizer

    texts = ["the [PAD] house [PAD]", "no pad here"]
    rows = tokenize_texts(texts, bert_tok)
    assert rows == [bert_tok(text.replace("[PAD]", " "), add_special_tokens=False)["input_ids"] for text in texts]
    assert bert_tok.pad_token_id in bert_tok(texts[0], add_special_tokens=False)["input_ids"]  # the text does hold it

    shared = decoder_tokenizer(tmp_path / "bpe", vocab_size=400)
    shared.pad_token = shared.eos_token
    shared.save_pretrained(tmp_path / "pads-with-eos")
    with pytest.warns(UserWarning, match=f"pads with its eos token </s>: added <pad> as id {len(shared)} "):
        loaded = load_tokenizer(tmp_path / "pads-with-eos", mask=False)
    assert loaded.pad_token == "<pad>" and loaded.pad_token_id == len(shared) != loaded.eos_token_id
    text = "It is a truth universally acknowledged <pad> that </s>"
    assert tokenize_texts([text], loaded) == [shared(text.replace("<pad>", ""), add_special_tokens=False)["input_ids"]]



def test_a_dotted_callback_option_changes_the_last_callback_and_a_later_config_any_one(tmp_path, capsys):
    """docs/live-statistics.md's 'Changing one callback's arguments', parsed by train.py as written there (installed
    jsonargparse): the dotted option changes the last callback only, an index is refused, and the documented YAML given
    as a second --config changes OutlierStatistics alone, every other callback argument as configs/pretrain/tiny.yaml
    has it (read from the file here)."""
    import yaml

    root = Path(__file__).resolve().parent.parent
    text = (root / "docs" / "live-statistics.md").read_text(encoding="utf-8")
    section = text[text.index("## Changing one callback's arguments"):]
    section = section[:section.index("\n## ", 1)]
    (block,) = re.findall(r"```yaml\n(.*?)```", section, re.S)
    (tmp_path / "callbacks.yaml").write_text(block, encoding="utf-8")
    commands = [line.split("  #")[0].split() for code in re.findall(r"```bash\n(.*?)```", section, re.S)
                for line in code.splitlines() if line.strip()]
    dotted = re.search(r"`(python train\.py fit [^`]*--trainer\.callbacks\.init_args\.every_n_steps 10)`", section)
    index = re.search(r"`(--trainer\.callbacks\.0\.[^`]*)`", section).group(1)
    configured = yaml.safe_load((root / "configs" / "pretrain" / "tiny.yaml").read_text())["trainer"]["callbacks"]

    def parsed(argv: list[str]) -> list[tuple[str, dict]]:
        argv = [str(root / arg) if arg.startswith("configs/") else str(tmp_path / arg) if arg == "callbacks.yaml"
                else arg for arg in argv]
        assert argv[:3] == ["python", "train.py", "fit"]
        with pytest.raises(SystemExit) as stop:
            train.cli_main([*argv[2:], *([] if "--print_config" in argv else ["--print_config"])])
        assert stop.value.code in (0, None)
        return [(item["class_path"], item["init_args"])
                for item in yaml.safe_load(capsys.readouterr().out)["trainer"]["callbacks"]]

    def expected(changed: dict[int, int]) -> list[tuple[str, int]]:
        return [(item["class_path"], changed.get(i, item["init_args"]["every_n_steps"]))
                for i, item in enumerate(configured)]

    last = len(configured) - 1
    assert last >= 2  # several callbacks: the case the section is about
    got = parsed(dotted.group(1).split())
    assert [(path, args["every_n_steps"]) for path, args in got] == expected({last: 10}) != expected({})
    for command in commands:
        got = parsed(command)
        assert [(path, args["every_n_steps"]) for path, args in got] == expected({0: 10})
        for (path, args), item in zip(got, configured, strict=True):  # every other argument as the config has it
            assert all(args[key] == value for key, value in item["init_args"].items() if key != "every_n_steps"), path
    bracket = re.search(r"`(--trainer\.callbacks\[0\][^`]*)`", section).group(1)
    for option in (index.split()[0], bracket.split()[0]):  # refused, pointing at this section and the no-index form
        assert train.cli_main(["fit", "--config", str(root / "configs" / "pretrain" / "tiny.yaml"), option, "10",
                               "--print_config"]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"train.py: error: {option}: an option takes no index (it cannot pick one item of a list); "
            "--trainer.callbacks.every_n_steps VALUE (no index) changes the last callback, and another one is changed by "
            "a YAML file of your own holding the whole list, given as a later --config (docs/live-statistics.md, "
            "\"Changing one callback's arguments\")"]
