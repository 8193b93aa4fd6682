"""Issue 17's failures, tried as a new user would: each is one line on stderr (nothing before it: no traceback, no
Lightning banner, no usage), exit status 2, and nothing written; the quieter ones warn (docs/errors.md).

    .venv/bin/pytest tests/test_refusals.py -q
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import analyze
import probe
import train
from core.models import quiet_transformers
from core.tokenizers import tokenizer_files
from lightning_modules.mlm import build_model, check_warmup
from tests.test_train import tiny_args
from tests.test_untrusted import ARCHITECTURE, probe_args
from tests.tiny import corpus_sentences, save_tiny_encoder

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")


BANNER = ("GPU available", "TPU available", "Tip:", "Seed set", "Traceback", "usage:")  # never before an error


def stderr_lines(capfd) -> list[str]:
    return [line for line in capfd.readouterr().err.splitlines() if line.strip()]


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


def foreign_checkpoint(path: Path, drop: str | None = None, state: dict | None = None) -> Path:
    """A checkpoint of plain data shaped like this project's, without hyper-parameter `drop`, or with `state`."""
    current = {**ARCHITECTURE, "token_type_embeddings": False}  # a checkpoint of today's default (fairseq's zero row)
    hparams = {key: value for key, value in current.items() if key != drop}
    torch.save({"state_dict": state or {}, "hyper_parameters": hparams, "global_step": 3}, path)
    return path


def not_a_dataset(folder: Path) -> Path:
    folder.mkdir()
    (folder / "README.md").write_text("# My project\n")
    (folder / "readme.txt").write_text("A line of notes that is no corpus.\n")
    return folder


# ---- train.py -------------------------------------------------------------------------------------------------------

def train_cases(tmp: Path) -> dict[str, tuple[tuple, str]]:
    """name: (extra arguments (ROOT stands for the run directory), the line after `train.py: error: `)."""
    (tmp / "a-file").write_text("not a directory")
    typo = tmp / "typo.yaml"
    typo.write_text("model:\n  hiden_size: 32\n")
    table = tmp / "table.csv"
    table.write_text("id,score\n1,2\n")
    bare = tmp / "bare-tokenizer"
    bare.mkdir()
    (bare / "tokenizer_config.json").write_text('{"tokenizer_class": "RobertaTokenizer"}')
    lacking = foreign_checkpoint(tmp / "other-project.ckpt", drop="vocab_size")
    alien = foreign_checkpoint(tmp / "alien.ckpt", state={"model.encoder.weight": torch.zeros(3)})
    latin1 = tmp / "latin1.yaml"
    latin1.write_bytes("model:\n  hidden_size: 32  # größer\n".encode("latin-1"))
    blank = tmp / "blank.csv"
    blank.write_text("id,text\n1,\n2, \n")
    small = tmp / "small.txt"  # 30 texts: --data.val_texts 2000 (streaming) held them all out for validation
    small.write_text("".join(f"Line {n} of a small corpus.\n" for n in range(30)))
    return {
        "negative learning rate": (("--model.lr", "-1"), "--model.lr must be a positive number, got -1.0"),
        "end learning rate above the peak": (("--model.end_lr", "1"), "--model.end_lr must be between 0 and "
                                             "--model.lr, got 1.0"),
        "default_root_dir is a file": (("--trainer.default_root_dir", str(tmp / "a-file")),
                                       f"cannot write to output directory {tmp / 'a-file'}: File exists"),
        "default_root_dir under a file": (("--trainer.default_root_dir", str(tmp / "a-file" / "run")),
                                          f"cannot write to output directory {tmp / 'a-file' / 'run'}: Not a "
                                          "directory"),
        "a typo in a YAML key": (("--config", str(typo)),
                                 "unknown option 'model.hiden_size' (did you mean 'model.hidden_size'?)"),
        "a typo on the command line": (("--trainer.max_stepz", "3"),
                                       "unknown option 'trainer.max_stepz' (did you mean 'trainer.max_steps'?)"),
        "no text column": (("--data.corpus", str(table)),
                           f"no text column in {table} (columns: ['id', 'score']); pass --data.text_column"),
        "a directory that is no dataset": (("--data.corpus", str(not_a_dataset(tmp / "notes"))),
                                           f"data directory {tmp / 'notes'} is not a datasets directory "
                                           "(save_to_disk output, or parquet, arrow, csv, tsv or jsonl data files); "
                                           "give a text, csv, tsv or jsonl file instead"),
        "a tokenizer directory without tokenizer files": (
            ("--data.tokenizer", str(bare)), f"cannot load tokenizer '{bare}': {bare} holds no tokenizer files "
                                             "(tokenizer.json, vocab.json + merges.txt, vocab.txt, or a SentencePiece "
                                             "model)"),
        "a checkpoint whose hyper-parameters lack vocab_size": (
            ("--ckpt_path", str(lacking)),
            f"{lacking} is not a checkpoint of this project's MLM pretraining: its hyper-parameters lack vocab_size"),
        "a checkpoint whose weights do not fit": (("--ckpt_path", str(alien)), f"checkpoint {alien}: its weights do "
                                                  "not fit the model (missing ['model.roberta.embeddings."),
        "a fresh start over an earlier run": (("EARLIER",), "ROOT holds an earlier run (last.ckpt): resume it with "
                                              "--ckpt_path last, or start this one in another "
                                              "--trainer.default_root_dir (or remove that run first)"),
        "a config file that is not UTF-8": (("--config", str(latin1)),
                                            f"config file {latin1} is not UTF-8 text (bad byte at offset 30)"),
        "a corpus whose texts are all empty": (("--data.corpus", str(blank)),
                                               f"no text in {blank}: every row's text is empty"),
        "an unknown attention variant": (("--model.attention", "sparsemax"), "--model.attention must be one of "
                                         "softmax, clipped_softmax, gated, got 'sparsemax'"),
        "a clipped softmax gamma above 0": (("--model.attention", "clipped_softmax", "--model.clip_softmax_gamma",
                                             "0.1"), "--model.clip_softmax_gamma must be at most 0 (clip((zeta - "
                                            "gamma) softmax + gamma, 0, 1) reaches exact zeros only for gamma <= 0), "
                                            "got 0.1"),
        "a clipped softmax zeta below 1": (("--model.attention", "clipped_softmax", "--model.clip_softmax_zeta", "0.5"),
                                           "--model.clip_softmax_zeta must be at least 1 (an attention weight must be "
                                           "able to reach 1), got 0.5"),
        "a gate parameter with softmax attention": (("--model.attention_gate_init", "0.3"),
                                                    "--model.attention_gate_init is a parameter of --model.attention "
                                                    "gated, not of softmax"),
        "a streaming corpus held out whole for validation (found in prepare_data)": (
            ("--data.corpus", str(small), "--data.streaming", "true"),
            f"--data.val_texts 2000 holds out all 30 texts of corpus {small} for validation (--data.streaming true), "
            "leaving none to train on: lower --data.val_texts, or read the corpus without --data.streaming"),
        "a corpus too small for the global batch (found in prepare_data)": (
            ("--data.global_batch_size", "64"), "55 training blocks make no full global batch of 64"),
        "an index into the callbacks list": (
            ("--trainer.callbacks[0].init_args.every_n_steps", "5"),
            "--trainer.callbacks[0].init_args.every_n_steps: an option takes no index (it cannot pick one item of a "
            "list); --trainer.callbacks.init_args.every_n_steps VALUE (no index) changes the last callback, and another "
            "one is changed by a YAML file of your own holding the whole list, given as a later --config "
            "(docs/live-statistics.md, \"Changing one callback's arguments\")"),
    }


TRAIN_CASES = [
    "negative learning rate", "end learning rate above the peak",
    "default_root_dir is a file", "default_root_dir under a file", "a typo in a YAML key",
    "a typo on the command line", "no text column", "a directory that is no dataset",
    "a tokenizer directory without tokenizer files", "a checkpoint whose hyper-parameters lack vocab_size",
    "a checkpoint whose weights do not fit", "a fresh start over an earlier run", "a config file that is not UTF-8",
    "a corpus whose texts are all empty", "an unknown attention variant", "a clipped softmax gamma above 0",
    "a clipped softmax zeta below 1", "a gate parameter with softmax attention",
    "a corpus too small for the global batch (found in prepare_data)", "an index into the callbacks list",
    "a streaming corpus held out whole for validation (found in prepare_data)"]


@pytest.mark.parametrize("case", TRAIN_CASES)
def test_train_failures_are_one_line_exit_2_and_write_nothing(case, corpus, cache, tmp_path, capfd):
    extra, message = train_cases(tmp_path)[case]
    root = tmp_path / "run"
    if extra == ("EARLIER",):  # a finished run's checkpoint (its content is not read: a fresh start is refused)
        (root / "checkpoints").mkdir(parents=True)
        (root / "checkpoints" / "last.ckpt").write_bytes(b"an earlier run's weights")
        extra = ()
    before = files_under(tmp_path)
    assert train.cli_main(tiny_args(root, corpus, cache, *extra)) == 2
    lines = stderr_lines(capfd)
    if "prepare_data" in case:  # the tokenizer and blocks made first (once per cache): their progress lines only
        assert not any(banner in line for line in lines for banner in BANNER), lines
        lines = lines[-1:]
    if case != "a checkpoint whose weights do not fit":  # (its line, in full, below)
        assert lines == ["train.py: error: " + message.replace("ROOT", str(root))]
    assert files_under(tmp_path) == before  # nothing written (a lock taken and released, its directory removed)


def test_a_checkpoint_whose_weights_do_not_fit_names_them(corpus, cache, tmp_path, capfd):
    _, message = train_cases(tmp_path)["a checkpoint whose weights do not fit"]
    assert train.cli_main(tiny_args(tmp_path / "run", corpus, cache, "--ckpt_path", str(tmp_path / "alien.ckpt"))) == 2
    (line,) = stderr_lines(capfd)
    assert line.startswith("train.py: error: " + message) and "unexpected ['model.encoder.weight']" in line


def test_a_directory_that_cannot_be_written_is_one_line(corpus, cache, tmp_path, capfd, monkeypatch):
    def denied(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", denied)  # as a read-only directory is to any user but root
    root = tmp_path / "locked" / "run"
    assert train.cli_main(tiny_args(root, corpus, cache)) == 2
    assert stderr_lines(capfd) == [f"train.py: error: cannot write to output directory {root}: Permission denied"]


def test_a_warm_up_as_long_as_the_schedule_or_the_run_warns():
    with pytest.warns(UserWarning) as said:
        check_warmup(10, decay_steps=10, max_steps=10)
    assert [str(w.message) for w in said] == [
        "--model.warmup_steps 10 does not end before the learning-rate schedule does (step 10, --model.decay_steps): "
        "the rate never decays; lower --model.warmup_steps for a whole schedule"]
    with pytest.warns(UserWarning, match=r"this run stops at step 100 \(--trainer.max_steps\), inside the warm-up of "
                                         r"500 steps: the learning rate stays below --model.lr"):
        check_warmup(500, decay_steps=10_000, max_steps=100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_warmup(20, decay_steps=None, max_steps=200)  # the tiny config: nothing to say


# ---- probe.py -------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def encoder(tmp_path_factory, bert_tok) -> Path:
    return save_tiny_encoder(tmp_path_factory.mktemp("encoder") / "bert", "bert", bert_tok)


def truncated_copy(encoder: Path, folder: Path, name: str = "model.safetensors") -> Path:
    shutil.copytree(encoder, folder)
    data = (folder / name).read_bytes()
    (folder / name).write_bytes(data[: len(data) // 2])
    return folder


def mismatched_encoder(folder: Path, encoder: Path) -> tuple[Path, str]:
    """DistilBERT's weights under `encoder`'s BERT config.json (issue 31), and how the refusal describes them: the
    BERT weights (pooler aside) the DistilBERT checkpoint lacks, counted by name."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    with quiet_transformers():  # no "Writing model shards" bar among the lines the tests read
        save_tiny_encoder(folder, "distilbert", AutoTokenizer.from_pretrained(encoder))
    shutil.copy(encoder / "config.json", folder / "config.json")
    with safe_open(str(folder / "model.safetensors"), "pt") as saved:
        present = set(saved.keys())
    wanted = [key for key in AutoModel.from_config(AutoConfig.from_pretrained(encoder)).state_dict()
              if not key.startswith("pooler.")]
    missing = sorted(key for key in wanted if key not in present)
    assert 0 < len(missing) < len(wanted)  # a few embeddings share their names: "most weights missing"
    return folder, (f"encoder {folder}: {len(missing)} of its {len(wanted)} weights are not in the checkpoint (e.g. "
                    f"{missing[0]}): its weights do not match its config.json (another architecture's?), so they "
                    "would be randomly initialised; ")


def probe_cases(tmp: Path, encoder: Path) -> dict[str, tuple[tuple, str]]:
    (tmp / "a-file").write_text("not a directory")
    typo = tmp / "typo.yaml"
    typo.write_text("data:\n  init_args:\n    max_sentence: 10\n")
    table = tmp / "table.csv"
    table.write_text("id,score\n1,2\n")
    torn = truncated_copy(encoder, tmp / "torn-bert")
    mixed, refused = mismatched_encoder(tmp / "mixed", encoder)
    return {
        "weights that do not match the config": (("--model.encoder", mixed), refused + "--model.allow_random_weights "
                                                 "true analyses such a partly random model"),
        "negative learning rate": (("--model.lr", "-1"), "--model.lr must be a positive number, got -1.0"),
        "default_root_dir is a file": (("--trainer.default_root_dir", tmp / "a-file"),
                                       f"cannot write to output directory {tmp / 'a-file'}: File exists"),
        "a truncated model.safetensors": (("--model.encoder", torn),
                                          f"cannot load encoder '{torn}': model.safetensors is truncated or corrupt "
                                          "(Error while deserializing header: incomplete metadata, file not fully "
                                          "covered)"),
        "a typo in a YAML key": (("--config", typo),
                                 "unknown option 'data.max_sentence' (did you mean 'data.max_sentences'?)"),
        "no text column": (("--data.source", table),
                           f"no text column in {table} (columns: ['id', 'score']); pass --data.text_column"),
        "a directory that is no dataset": (("--data.source", not_a_dataset(tmp / "notes")),
                                           f"data directory {tmp / 'notes'} is not a datasets directory "
                                           "(save_to_disk output, or parquet, arrow, csv, tsv or jsonl data files); "
                                           "give a text, csv, tsv or jsonl file instead"),
        "missing data (found in prepare_data)": (("--data.source", tmp / "nope.txt"),
                                                 f"data path not found: {tmp / 'nope.txt'}"),
    }


PROBE_CASES = ["weights that do not match the config", "negative learning rate", "default_root_dir is a file", "a truncated model.safetensors",
               "a typo in a YAML key", "no text column", "a directory that is no dataset",
               "missing data (found in prepare_data)"]


@pytest.mark.parametrize("case", PROBE_CASES)
def test_probe_failures_are_one_line_exit_2_and_write_nothing(case, encoder, sentences_file, tmp_path, capfd):
    extra, message = probe_cases(tmp_path, encoder)[case]
    before = files_under(tmp_path)
    with pytest.raises(SystemExit) as exited:
        probe.cli_main(probe_args(encoder, sentences_file, tmp_path / "out", *extra))
    assert exited.value.code == 2
    assert stderr_lines(capfd) == ["probe.py: error: " + message]
    assert files_under(tmp_path) == before


# ---- analyze.py -----------------------------------------------------------------------------------------------------

def analyze_cases(tmp: Path, encoder: Path, sentences: Path) -> dict[str, tuple[list, str]]:
    torn = truncated_copy(encoder, tmp / "torn-bert")
    lacking = foreign_checkpoint(tmp / "other-project.ckpt", drop="vocab_size")
    wic = tmp / "wic.jsonl"
    item = {"word": "bank", "sentence1": "He sat on the bank of the river.", "sentence2": "The bank closed early.",
            "start1": 14, "end1": 18, "start2": 4, "end2": 8, "label": False}
    wic.write_text(json.dumps(item) + "\n" + json.dumps({**item, "start1": 0, "end1": 4}) + "\n")
    bare = tmp / "bare-encoder"
    bare.mkdir()
    shutil.copy(encoder / "config.json", bare / "config.json")
    (bare / "tokenizer_config.json").write_text("{}")
    data = ["--data", str(sentences)]
    words = "one two three four five six seven eight nine ten by the bank"  # the target after --max_length 8
    at = words.index("bank")
    far = {"word": "bank", "sentence1": words, "sentence2": words.replace(" by ", " at "), "start1": at,
           "end1": at + 4, "start2": at, "end2": at + 4, "label": True}
    lost = tmp / "lost.jsonl"
    lost.write_text(json.dumps(far) + "\n" + json.dumps({**far, "label": False}) + "\n")
    nonsense = tmp / "nonsense.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {**ARCHITECTURE, "hidden_size": 30}}, nonsense)
    torn_tokenizer = truncated_copy(encoder, tmp / "torn-tokenizer", "tokenizer.json")
    wide = tmp / "wide.csv"
    wide.write_text("text\n" + "x" * (16 * 2**20 + 1) + "\n")
    mixed, refused = mismatched_encoder(tmp / "mixed", encoder)
    return {
        "weights that do not match the config": (["outliers", "--encoder", str(mixed), *data],
                                                 refused + "--allow_random_weights analyses such a partly random "
                                                 "model"),
        "a truncated model.safetensors": (["outliers", "--encoder", str(torn), *data],
                                          f"cannot load encoder '{torn}': model.safetensors is truncated or corrupt "
                                          "(Error while deserializing header: incomplete metadata, file not fully "
                                          "covered)"),
        "a checkpoint whose hyper-parameters lack vocab_size": (
            ["outliers", "--encoder", str(lacking), *data],
            f"{lacking} is not a checkpoint of this project's MLM pretraining: its hyper-parameters lack vocab_size"),
        "a WiC file with one scorable pair": (["wic", "--encoder", str(encoder), "--data", str(wic)],
                                              f"WiC needs at least 2 scorable pairs, but only 1 item of {wic} has "
                                              "its target word at its offsets (1 skipped)"),
        "a directory that is no dataset": (["outliers", "--encoder", str(encoder), "--data",
                                            str(not_a_dataset(tmp / "notes"))],
                                           f"data directory {tmp / 'notes'} is not a datasets directory "
                                           "(save_to_disk output, or parquet, arrow, csv, tsv or jsonl data files); "
                                           "give a text, csv, tsv or jsonl file instead"),
        "--max_length that only the special tokens fill": (
            ["anisotropy", "--encoder", str(encoder), *data, "--max_length", "2", "--exclude_special"],
            "--max_length 2 leaves no token to count: the 2 special tokens of each sentence fill it and "
            "--exclude_special drops them; use --max_length 3 or more"),
        "WiC targets all lost to truncation": (["wic", "--encoder", str(encoder), "--data", str(lost),
                                                "--max_length", "8"],
                                               "only 0 WiC pairs could be scored (4 sentences lost their target word "
                                               "to truncation; a larger --max_length keeps it): WiC needs at least 2"),
        "a checkpoint whose hyper-parameters describe no model": (
            ["outliers", "--encoder", str(nonsense), *data], f"{nonsense}: its hyper-parameters describe no model "
                                                             "(The hidden size (30) is not a multiple of the number "
                                                             "of attention heads (4))"),
        "a torn tokenizer.json": (["outliers", "--encoder", str(torn_tokenizer), *data],
                                  f"cannot load encoder '{torn_tokenizer}': its tokenizer: a JSON file is truncated or "
                                  "corrupt ("),
        "a csv field over 16 MiB": (["outliers", "--encoder", str(encoder), "--data", str(wide)],
                                    f"{wide}: row 1 is not csv (field larger than field limit (16777216))"),
        "an encoder directory without tokenizer files": (
            ["outliers", "--encoder", str(bare), *data],
            f"cannot load encoder '{bare}': {bare} holds no tokenizer files (tokenizer.json, vocab.json + "
            "merges.txt, vocab.txt, or a SentencePiece model)"),
    }


ANALYZE_CASES = ["weights that do not match the config", "a truncated model.safetensors", "a checkpoint whose hyper-parameters lack vocab_size",
                 "a WiC file with one scorable pair", "a directory that is no dataset",
                 "--max_length that only the special tokens fill", "an encoder directory without tokenizer files",
                 "WiC targets all lost to truncation", "a checkpoint whose hyper-parameters describe no model",
                 "a torn tokenizer.json", "a csv field over 16 MiB"]


@pytest.mark.parametrize("case", ANALYZE_CASES)
def test_analyze_failures_are_one_line_exit_2_and_write_nothing(case, encoder, sentences_file, tmp_path, capfd,
                                                                 recwarn):
    argv, message = analyze_cases(tmp_path, encoder, sentences_file)[case]
    out = tmp_path / "out"
    before = files_under(tmp_path)
    assert analyze.main([*argv, "--output_dir", str(out), "--no_progress"]) == 2
    assert not [w for w in recwarn if "before the ``update``" in str(w.message)]  # torchmetrics' noise: none
    lines = stderr_lines(capfd)
    if case == "a torn tokenizer.json":  # the tokenizers library's own words follow
        lines = [line[:len(f"analyze.py {argv[0]}: error: {message}")] for line in lines]
    assert lines == [f"analyze.py {argv[0]}: error: {message}"]
    assert files_under(tmp_path) == before


def test_a_partly_random_model_is_analysed_only_when_asked_for(encoder, sentences_file, tmp_path, recwarn):
    mixed, refused = mismatched_encoder(tmp_path / "mixed", encoder)
    count = refused.split(": ", 1)[1].split(" of ")[0]
    out = tmp_path / "out"
    assert analyze.main(["outliers", "--encoder", str(mixed), "--data", str(sentences_file), "--output_dir", str(out),
                         "--no_progress", "--max_length", "16", "--allow_random_weights"]) == 0
    said = [str(w.message) for w in recwarn if "randomly initialised" in str(w.message)]
    assert len(said) == 1 and said[0].endswith(f"({count} in all)"), said  # named, and the run goes on
    assert json.loads((out / "outliers.json").read_text())["encoder"] == str(mixed)
    cli = probe.cli_main(probe_args(mixed, sentences_file, tmp_path / "probe", "--model.allow_random_weights",
                                    "true")[1:], run=False)  # (no subcommand: built, not run)
    assert cli.datamodule.hparams.allow_random_weights is True  # the data module loads the encoder: linked


def test_an_unknown_analyze_option_is_one_line_with_the_closest(encoder, sentences_file, tmp_path, capfd):
    with pytest.raises(SystemExit) as exited:
        analyze.main(["outliers", "--encodr", str(encoder), "--data", str(sentences_file)])
    assert exited.value.code == 2
    assert stderr_lines(capfd) == ["analyze.py: error: unknown option --encodr (did you mean --encoder?)"]
    with pytest.raises(SystemExit) as exited:  # another subcommand's option: not "did you mean --no_progress?"
        analyze.main(["compare", str(tmp_path / "outliers.json"), "--no_progress"])
    assert exited.value.code == 2
    assert stderr_lines(capfd) == ["analyze.py: error: unknown option --no_progress for this subcommand (another "
                                   "subcommand takes it; analyze.py <subcommand> --help lists each one's options)"]


def test_did_you_mean_never_names_the_option_given(encoder, sentences_file, capfd):
    """The rewording of an unknown option (core.cli.unknown_key, LightningCLI's; core.arguments, argparse's) names the
    closest other option, never the one given (a key cut short at a '[' once read 'unknown option
    'trainer.callbacks' (did you mean 'trainer.callbacks'?)'): for every key of a list, the hint is difflib's closest
    among the others; and an argparse option with an index is named whole, with the option it is close to."""
    import difflib
    import re

    from core.cli import unknown_key

    candidates = ["trainer.callbacks", "trainer.max_steps", "trainer.log_every_n_steps", "model.lr", "model.end_lr",
                  "data.corpus", "data.cache_dir"]
    for key in candidates:
        hint = re.fullmatch(rf"unknown option '{re.escape(key)}'(?: \(did you mean '(.+)'\?\))?",
                            unknown_key(key, candidates))
        others = [candidate for candidate in candidates if candidate != key]
        assert hint and hint.group(1) != key
        assert hint.group(1) in (difflib.get_close_matches(key, others, n=1) or [None, *others])
    assert unknown_key("model.lr", ["model.lr"]) == "unknown option 'model.lr'"
    with pytest.raises(SystemExit) as exited:
        analyze.main(["outliers", "--encoder[0]", str(encoder), "--data", str(sentences_file)])
    assert exited.value.code == 2
    assert stderr_lines(capfd) == ["analyze.py: error: unknown option --encoder[0] (did you mean --encoder?)"]


# ---- the quieter ones: warnings, and a run directory without export/ --------------------------------------------------

@pytest.mark.parametrize("scores, warning", [
    ([3.0] * 8, "the gold scores of {} are all 3: Spearman correlation is undefined for constant scores; every "
                "value is reported as null"),
    ([2.0], "{} has only 1 scored pair: a Spearman correlation needs at least 3 to mean anything; every value is "
            "reported as null"),
])
def test_sts_that_gives_no_correlation_warns_and_reports_null(scores, warning, encoder, tmp_path, recwarn):
    sentences = corpus_sentences(2 * len(scores), start=100)
    path = tmp_path / "sts.jsonl"
    path.write_text("".join(json.dumps({"sentence1": sentences[2 * i][:80], "sentence2": sentences[2 * i + 1][:80],
                                        "score": score}) + "\n" for i, score in enumerate(scores)))
    out = tmp_path / "out"
    assert analyze.main(["sts", "--encoder", str(encoder), "--data", str(path), "--clip", "none", "--output_dir",
                         str(out), "--no_progress"]) == 0
    assert warning.format(path) in [str(caught.message) for caught in recwarn]
    report = json.loads((out / "sts.json").read_text())
    assert report["best"]["spearman"] is None and {row["raw"] for row in report["layers"]} == {None}


def test_warnings_print_as_one_line_each():
    from core.errors import plain_warnings

    plain_warnings()
    assert warnings.formatwarning("4 of 40 sentences were truncated", UserWarning, "x.py", 3) == \
        "warning: 4 of 40 sentences were truncated\n"


def test_lightning_lines_with_nothing_to_act_on_are_dropped_and_its_other_lines_kept():
    """Lightning logs a tip (an advert for its cloud logger) whenever a Trainer is made, "GPU available: False" on a CPU,
    "Seed set to 0": after plain_warnings none reaches a handler, whether logged directly or held back and handed over
    by core.cli.HeldLogs; a line to act on ("GPU available: True, used: False") stays."""
    import logging

    import pytorch_lightning as pl
    from pytorch_lightning.utilities import rank_zero_info

    from core.cli import HeldLogs
    from core.errors import plain_warnings

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__()
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    keep, packages = Keep(), [logging.getLogger(name) for name in ("pytorch_lightning", "lightning_fabric")]
    for package in packages:
        package.addHandler(keep)
    holders = [holder for name in ("pytorch_lightning", "pytorch_lightning.utilities.rank_zero", "lightning_fabric",
                                   "lightning_fabric.utilities.seed")
               for holder in (logging.getLogger(name), *logging.getLogger(name).handlers)]
    saved = [holder.filters[:] for holder in holders]
    for holder in holders:  # as before any plain_warnings() of an earlier test
        holder.filters = [f for f in holder.filters if type(f).__name__ != "_Unactionable"]
    actionable = "GPU available: True, used: False"
    try:
        pl.Trainer(logger=False, enable_progress_bar=False)
        pl.seed_everything(0)
        assert any(line.startswith("💡 Tip") for line in keep.lines)  # what Lightning does on its own
        assert "GPU available: False, used: False" in keep.lines and "Seed set to 0" in keep.lines
        plain_warnings()
        keep.lines.clear()
        pl.Trainer(logger=False, enable_progress_bar=False)
        pl.seed_everything(0)
        rank_zero_info(actionable)
        held = HeldLogs()
        pl.Trainer(logger=False, enable_progress_bar=False)
        pl.seed_everything(0)
        rank_zero_info(actionable)
        held.release(emit=True)
    finally:
        for package in packages:
            package.removeHandler(keep)
        for holder, filters in zip(holders, saved):
            holder.filters = filters
    assert not any("Tip" in line or "available: False" in line or line.startswith("Seed set") for line in keep.lines)
    assert keep.lines.count(actionable) == 2  # direct and held


def run_checkpoint(path: Path, roberta_tok) -> None:
    """A checkpoint as train.py saves one mid-run (tiny RoBERTa weights, hyper-parameters, the tokenizer as text)."""
    torch.manual_seed(0)
    model = build_model(len(roberta_tok), 32, 2, 4, 64, 66, dropout=0.0, position_embeddings=True)
    state = {f"model.{key}": value for key, value in model.state_dict().items()}
    hparams = {**ARCHITECTURE, "vocab_size": len(roberta_tok), "max_position_embeddings": 66}
    path.parent.mkdir(parents=True)
    torch.save({"state_dict": state, "hyper_parameters": hparams, "global_step": 4,
                "MLMDataModule": {"tokenizer_files": tokenizer_files(roberta_tok)}}, path)


def test_a_run_directory_without_export_says_it_uses_the_mid_run_checkpoint(roberta_tok, sentences_file, tmp_path,
                                                                            recwarn):
    run = tmp_path / "run"
    last = run / "checkpoints" / "last.ckpt"
    run_checkpoint(last, roberta_tok)
    reports = {}
    for name, encoder in (("run", run), ("ckpt", last)):
        out = tmp_path / name
        assert analyze.main(["outliers", "--encoder", str(encoder), "--data", str(sentences_file), "--output_dir",
                             str(out), "--no_progress"]) == 0
        reports[name] = json.loads((out / "outliers.json").read_text())
        said = [str(caught.message) for caught in recwarn if "no export/" in str(caught.message)]
        assert said == ([f"{run} has no export/ yet (its run has not finished): using its mid-run checkpoint {last}"]
                        if name == "run" else [])
        recwarn.clear()
    reports["run"].pop("encoder"), reports["ckpt"].pop("encoder")
    assert reports["run"] == reports["ckpt"]  # the run directory resolved to exactly that checkpoint
