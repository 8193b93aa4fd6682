"""Hub ids pinned to a revision, `org/name@REVISION`, loaded offline (HF_HUB_OFFLINE=1) from a hand-built hub cache
holding two snapshots of one repository: two tiny random BERTs whose weights and tokenizers differ. What each
revision loads (through load_encoder, encoder_tokenizer, load_tokenizer, load_classifier, and `analyze.py outliers`
run as a command) equals the model and tokenizer read directly from that snapshot's directory, and the commit the
reports record (`encoder_commit`) is the name of that snapshot's directory, the hash the test made up; none for a
local directory.

    .venv/bin/pytest tests/test_hub_revisions.py -q
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import analyze
from analyses.paper_report import paper_markdown, paper_summary
from analyses.trajectory import architecture, encoder_points
from core.errors import UserError
from core.sources import hub_commit, short_name, split_revision
from core.tokenizers import fingerprint, load_tokenizer
from lightning_modules.encoder import encoder_tokenizer, load_encoder
from lightning_modules.finetune import load_classifier
from tests.hub_cache import cache_model, hub_caches
from tests.tiny import bert_tokenizer, corpus_sentences, reports_close, save_tiny_encoder

ROOT = Path(__file__).resolve().parent.parent
REPO = "someorg/tiny-bert-revs"
TEXT = corpus_sentences(8)[5]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def revisions(tmp_path_factory, bert_tok):
    """REPO cached at two commits: the first (tag v1, and the short hash an online load by it records in refs/) a BERT
    with a 600-token vocabulary, the second (refs/main) another BERT, other weights, a 500-token vocabulary."""
    root = tmp_path_factory.mktemp("hf-revisions")
    first = save_tiny_encoder(root / "src" / "one", "bert", bert_tok, seed=1)
    second = save_tiny_encoder(root / "src" / "two", "bert", bert_tokenizer(root / "tok2", vocab_size=500), seed=2)
    commits = [hashlib.sha1(name.encode()).hexdigest() for name in ("first", "second")]
    cache_model(root / "hub", REPO, first, ref="v1", commit=commits[0])
    cache_model(root / "hub", REPO, second, ref="main", commit=commits[1])
    folder = root / "hub" / "models--someorg--tiny-bert-revs"
    (folder / "refs" / commits[0][:7]).write_text(commits[0])
    return root, [folder / "snapshots" / commit for commit in commits], commits


@pytest.fixture
def offline(revisions, monkeypatch, tmp_path):
    root, snapshots, commits = revisions
    monkeypatch.chdir(tmp_path)  # no folder of the working directory shadows an id
    with hub_caches(monkeypatch, root):
        yield snapshots, commits


def hidden(model, tokenizer, text: str = TEXT) -> torch.Tensor:
    """[layers, tokens, hidden] of one sentence."""
    with torch.no_grad():
        return torch.stack(model(**tokenizer(text, return_tensors="pt"), output_hidden_states=True).hidden_states)[:, 0]


def direct(snapshot: Path):
    """The model and tokenizer of a snapshot, read from its directory (a local path: no revision, no refs)."""
    from transformers import AutoModel, AutoTokenizer

    return AutoModel.from_pretrained(snapshot).eval(), AutoTokenizer.from_pretrained(snapshot)


def same_weights(mine: dict, theirs: dict) -> bool:
    return mine.keys() == theirs.keys() and all(torch.equal(mine[key], theirs[key]) for key in mine)


def test_each_revision_loads_its_snapshot_and_the_bare_id_follows_refs_main(offline):
    snapshots, (first, second) = offline
    assert [snapshot.name for snapshot in snapshots] == [first, second]
    models = [direct(snapshot) for snapshot in snapshots]
    # the two snapshots differ in weights and tokenizer, so what loads tells them apart
    assert len(models[0][1]) == 600 != len(models[1][1]) == 500
    assert models[0][1](TEXT)["input_ids"] != models[1][1](TEXT)["input_ids"]
    layer = "encoder.layer.0.attention.self.query.weight"
    assert not torch.equal(models[0][0].state_dict()[layer], models[1][0].state_dict()[layer])
    cases = {f"{REPO}@{first}": 0, f"{REPO}@v1": 0, f"{REPO}@{first[:7]}": 0,
             f"{REPO}@{second}": 1, f"{REPO}@main": 1, REPO: 1}
    for source, which in cases.items():
        model, tokenizer = models[which]
        encoder = load_encoder(source, device="cpu")
        assert encoder.name == source and encoder.commit == snapshots[which].name == (first, second)[which], source
        assert encoder.tokenizer.get_vocab() == tokenizer.get_vocab(), source
        assert same_weights(encoder.model.state_dict(), model.state_dict()), source
        assert torch.equal(hidden(encoder.model, encoder.tokenizer), hidden(model, tokenizer)), source
        # the tokenizer alone (analyses, train.py's --data.tokenizer) and the architecture (trajectory's check)
        assert fingerprint(encoder_tokenizer(source)) == fingerprint(tokenizer), source
        assert fingerprint(load_tokenizer(source, pad=False)) == fingerprint(tokenizer), source
        assert architecture(source)["vocab_size"] == len(tokenizer), source
    assert short_name(f"{REPO}@{first}") == f"tiny-bert-revs@{first[:7]}" and short_name(f"{REPO}@v1") == \
        "tiny-bert-revs@v1" and short_name(REPO) == "tiny-bert-revs"
    # fine-tuning's classifier (train.py / probe.py --model.encoder): its encoder is the revision's
    classifier, tokenizer = load_classifier(f"{REPO}@{first}", [0, 1])
    assert tokenizer.get_vocab() == models[0][1].get_vocab()
    assert same_weights(classifier.base_model.state_dict(), models[0][0].state_dict())
    # no commit for a local path, a snapshot's directory included, nor for an id or revision the cache lacks
    for source in (snapshots[0], f"{snapshots[0]}.ckpt", "someorg/not-cached", f"{REPO}@v9", f"{REPO}@{second[:7]}",
                   "not a repo id:0"):
        assert hub_commit(source) is None, source


def test_a_revision_the_cache_lacks_offline_is_one_line_naming_the_flag(offline):
    _, (_, second) = offline
    for revision in ("v9", second[:7]):  # a tag never fetched; a short hash with no refs/ entry (offline, only a
        with pytest.raises(UserError) as error:  # full commit hash is read without one)
            load_encoder(f"{REPO}@{revision}", device="cpu")
        assert str(error.value).startswith(f"cannot load encoder '{REPO}@{revision}' (offline: HF_HUB_OFFLINE"), \
            str(error.value)


def outliers(source, output: str, *extra: str) -> dict:
    assert analyze.main(["outliers", "--encoder", str(source), "--no_progress", "--max_sentences", "6",
                         "--output_dir", output, *extra]) == 0
    return json.loads(Path(output, "outliers.json").read_text())


def test_analyze_outliers_at_a_revision_reports_what_its_snapshot_directory_gives(offline, tmp_path):
    snapshots, (first, second) = offline
    # the command as a user runs it, in its own process: the cache and the offline flag from the environment alone
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    finished = subprocess.run([sys.executable, str(ROOT / "analyze.py"), "outliers", "--encoder", f"{REPO}@{first}",
                               "--no_progress", "--max_sentences", "6", "--output_dir", "by-revision"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr
    by_revision = json.loads((tmp_path / "by-revision" / "outliers.json").read_text())
    by_tag, by_main = outliers(f"{REPO}@v1", "by-tag"), outliers(REPO, "by-main")
    by_snapshot = [outliers(snapshot, f"by-snapshot-{i}") for i, snapshot in enumerate(snapshots)]
    assert by_revision["encoder"] == f"{REPO}@{first}" and by_main["encoder"] == REPO  # the revision is recorded
    # and the commit read: the tag's (refs/v1) and the bare id's (refs/main) are the snapshots' directory names, the
    # hashes the fixture made; a snapshot's directory given as a path is a local directory: no commit
    assert [report["encoder_commit"] for report in (by_revision, by_tag, by_main, *by_snapshot)] == \
        [first, first, second, None, None] == [snapshots[0].name, snapshots[0].name, snapshots[1].name, None, None]
    # `analyze.py paper`'s summary.json takes it from its outliers.json, and paper.md names it under its title
    args = SimpleNamespace(encoder=f"{REPO}@v1", seed=0, sst2="sst2", qqp="none", wic="none", sts=[], imdb="none",
                           sst5="none")
    summary = paper_summary({"outliers": {**by_tag, "sentences_from": {"sst2": 6}, "sentences_asked": 6}}, args,
                            "none", [])
    assert summary["encoder_commit"] == first
    assert paper_markdown(summary).startswith(f"# Positional artefacts: {REPO}@v1 (commit `{first}`)\n")
    skip = (".encoder", ".encoder_commit")
    reports_close(by_revision, by_snapshot[0], skip=skip)
    reports_close(by_tag, by_snapshot[0], skip=skip, rel=0, abs=0)
    reports_close(by_main, by_snapshot[1], skip=skip, rel=0, abs=0)
    with pytest.raises(AssertionError):  # the two snapshots' reports differ: the comparison tells them apart
        reports_close(by_snapshot[0], by_snapshot[1], skip=skip)


def test_a_revision_on_a_local_path_or_an_empty_one_is_one_line_exit_2_and_nothing_written(offline, tmp_path,
                                                                                             capsys):
    snapshots, (first, _) = offline
    local = tmp_path / "model"
    local.symlink_to(snapshots[0], target_is_directory=True)
    cases = {f"{local}@v1": f"encoder '{local}@v1': a revision after '@' pins a hub id, and '{local}' is a local path "
                            "(a directory holds one version): pass it without '@v1'",
             f"{REPO}@": f"encoder '{REPO}@': nothing after '@': a hub id is pinned as org/name@REVISION",
             f"@{first}": f"encoder '@{first}': nothing before '@'",
             "./missing@v1": "encoder path not found: ./missing@v1",
             "missing@v1.ckpt": "encoder path not found: missing@v1.ckpt"}  # a file's name, never a hub id
    for case, (source, message) in enumerate(cases.items()):
        assert analyze.main(["outliers", "--encoder", source, "--output_dir", f"out{case}"]) == 2, source
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"analyze.py outliers: error: {message}"), (source, lines)
        assert not Path(f"out{case}").exists()
    # the same rule for train.py's --data.tokenizer and fine-tuning's --model.encoder
    with pytest.raises(UserError, match="^tokenizer .*: a revision after '@' pins a hub id"):
        load_tokenizer(f"{local}@v1")
    with pytest.raises(UserError, match="^encoder .*: nothing after '@'"):
        load_classifier(f"{REPO}@", [0, 1])
    # a local path wins: a directory whose name holds '@' is that directory, never split
    pinned = tmp_path / "model@v1"
    pinned.symlink_to(snapshots[1], target_is_directory=True)
    assert split_revision(str(pinned)) == (str(pinned), None) and split_revision("model@v1") == ("model@v1", None)
    assert split_revision(f"{REPO}@refs/pr/1") == (REPO, "refs/pr/1")
    encoder, (model, tokenizer) = load_encoder("model@v1", device="cpu"), direct(snapshots[1])
    assert same_weights(encoder.model.state_dict(), model.state_dict())
    assert torch.equal(hidden(encoder.model, encoder.tokenizer), hidden(model, tokenizer))


def test_trajectory_reads_a_step_from_a_revision_first(offline):
    points = encoder_points([f"{REPO}@step2000", f"{REPO}@step_1k", "someorg/tiny-step_5k@main",
                             "someorg/tiny-step_9k@step300"])
    assert [(point.source, point.step, point.step_from) for point in points] == [
        ("someorg/tiny-step_9k@step300", 300, "name"), (f"{REPO}@step_1k", 1000, "name"),
        (f"{REPO}@step2000", 2000, "name"), ("someorg/tiny-step_5k@main", 5000, "name")]


def test_a_trajectory_and_fine_tuning_record_the_commit_each_hub_revision_was_read_at(offline, tmp_path):
    from lightning_modules.finetune import FineTuneModule

    snapshots, (first, second) = offline
    # --encoders: a tag, a short hash (refs/<short>, as an online load by it leaves) and the snapshot's directory: the
    # same weights, the two ids at the fixture's first commit, the directory at none
    sources = [f"{REPO}@v1", f"{REPO}@{first[:7]}", str(snapshots[0])]
    assert analyze.main(["trajectory", "--encoders", *sources, "--no_progress", "--max_sentences", "6", "--num_pairs",
                         "6", "--minibatch", "6", "--minibatches", "1", "--output_dir", "out"]) == 0
    points = json.loads((tmp_path / "out" / "trajectory.json").read_text())["checkpoints"]
    assert [(point["path"], point["encoder_commit"]) for point in points] == \
        [(sources[0], first), (sources[1], first), (sources[2], None)]
    assert points[0]["layers"] == points[1]["layers"] == points[2]["layers"]  # one snapshot read three ways
    # fine-tuning (train.py --model.encoder): the classifier's finetune.json records the module's encoder_commit
    for source, commit in ((REPO, second), (f"{REPO}@v1", first), (snapshots[1], None)):
        assert FineTuneModule(encoder=str(source), classes=[0, 1]).encoder_commit == commit, source


def test_a_branch_that_moves_between_loads_does_not_mix_two_commits_in_one_model(revisions, bert_tok, tmp_path,
                                                                                 monkeypatch):
    """The tokenizer read first, then refs/main moved to another commit (a push while the run starts), then the
    weights: both come from the commit the first read resolved to, and that is the commit recorded. A new process
    (the memory cleared) follows refs/main to the new commit."""
    from core import sources

    root, snapshots, commits = revisions
    cache = tmp_path / "moving"
    repo = "someorg/tiny-bert-moving"
    for snapshot, commit in zip(snapshots, commits, strict=True):
        cache_model(cache / "hub", repo, snapshot, commit=commit)  # refs/main: the second, written last
    refs = cache / "hub" / "models--someorg--tiny-bert-moving" / "refs" / "main"
    refs.write_text(commits[0])
    monkeypatch.chdir(tmp_path)
    models = [direct(snapshot) for snapshot in snapshots]
    with hub_caches(monkeypatch, cache):
        tokenizer = encoder_tokenizer(repo)  # at refs/main: the first commit
        refs.write_text(commits[1])  # the branch moves
        encoder = load_encoder(repo, device="cpu")
        assert encoder.commit == sources.hub_commit(repo) == commits[0]
        assert same_weights(encoder.model.state_dict(), models[0][0].state_dict())
        assert fingerprint(tokenizer) == fingerprint(encoder.tokenizer) == fingerprint(models[0][1])
        sources._first_read.clear()  # a new process
        moved = load_encoder(repo, device="cpu")
        assert moved.commit == commits[1] and same_weights(moved.model.state_dict(), models[1][0].state_dict())
        # fine-tuning resumed after the branch moved: finetune.json names the commit the run started from (kept in
        # its checkpoint), not the one `main` gives the resuming process
        from lightning_modules.finetune import FineTuneModule

        refs.write_text(commits[0])
        sources._first_read.clear()
        started = FineTuneModule(encoder=repo, classes=[0, 1])
        checkpoint = {"hyper_parameters": dict(started.hparams)}
        started.on_save_checkpoint(checkpoint)
        refs.write_text(commits[1])
        sources._first_read.clear()  # days later, another process
        resumed = FineTuneModule(encoder=repo, classes=[0, 1])
        assert (started.encoder_commit, resumed.encoder_commit) == (commits[0], commits[1])
        resumed.on_load_checkpoint(checkpoint)
        assert resumed.encoder_commit == commits[0]


def _commit_worker(rank: int, world: int, port: int, commits: list, out: str) -> None:
    import torch.distributed as dist

    from analyses.session import same_commit

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        same_commit("someorg/x", commits[rank])
        said = "passed"
    except UserError as error:
        said = str(error)
    finally:
        dist.destroy_process_group()
    Path(f"{out}.{rank}").write_text(said)


@pytest.mark.parametrize("moved", [False, True])
def test_processes_that_read_a_hub_id_at_different_commits_are_refused_on_every_rank(moved, tmp_path):
    """Two gloo processes: the same commit (or a local path's None on both) passes; a branch that moved between the
    two ranks' loads is one line on each rank, naming both commits and the pin that would make them agree."""
    import torch.multiprocessing as mp

    from tests.tiny import free_port

    commits = ["a" * 40, "b" * 40] if moved else ["a" * 40, "a" * 40]
    out = str(tmp_path / "said")
    mp.start_processes(_commit_worker, args=(2, free_port(), commits, out), nprocs=2, start_method="spawn", join=True)
    said = [Path(f"{out}.{rank}").read_text() for rank in range(2)]
    expected = (f"the processes read someorg/x at different commits (rank 0: {'a' * 40}, rank 1: {'b' * 40}): its "
                f"branch moved while they loaded; run again, or pin one: --encoder someorg/x@{'a' * 40}")
    assert said == ([expected] * 2 if moved else ["passed"] * 2)
