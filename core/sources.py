"""The one rule that tells a local path from a hub id or a `datasets` name, for models, tokenizers and data alike.

    looks_local("core/corpus/austen.txt")        # True: a file suffix this project reads
    looks_local("bert-base-uncased")      # False: a hub id ("name" or "org/name")
    looks_local("glue/sst2")              # False, unless ./glue is a directory here
    split_revision("org/name@v1.0")       # ("org/name", "v1.0"): a hub id pinned to a branch, tag or commit; a path
                                          # that exists is never split ("runs/x@2" is that directory: (text, None))
    pretrained(AutoModel, "org/name@v1.0", dtype=...)   # AutoModel.from_pretrained("org/name", revision="v1.0", ...):
                                          # the one call that reads a model, config or tokenizer by path or hub id
    local_path("runs/tiny-pe", "encoder") # Path(...) when it exists; UserError "encoder path not found: ..." when it
                                          # looks local but is not there; None for a hub id or datasets name
    hub_commit("org/name@v1.0")           # "<40 hex digits>": the commit a hub id just loaded was read at (a report
                                          # records it as encoder_commit); None for a local path or checkpoint
    read_at("org/name")                   # ("org/name", "<commit>") once a read of it in this process resolved main to
                                          # that commit (every later read asks for it); before: split_revision's
    short_name("runs/x/export")           # "x": a readable name for a model path (".../models--org--x/snapshots/<commit>"
                                          # of the hub's cache: "x")
    check_hub("bert-base-uncased", "encoder")   # before a hub id or datasets name is fetched: offline (no network
                                          # and no HF_HUB_OFFLINE) it is one line in at most 3 s, not minutes of retries
    raise cannot_load("encoder", "bert-base-uncased", reason)   # "cannot load encoder 'bert-base-uncased' (offline:
                                          # HF_HUB_OFFLINE is set): <reason>": the note only for a hub name, flag set
"""

from __future__ import annotations

import os
import re
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

from core.errors import UserError

# file suffixes only a local file has (hub ids and datasets names never end in them)
LOCAL_SUFFIXES = frozenset({".txt", ".text", ".csv", ".tsv", ".json", ".jsonl", ".ckpt", ".safetensors", ".bin",
                            ".pt", ".npy"})


def looks_local(source: str | os.PathLike) -> bool:
    """A local path rather than a hub id (`name`, `org/name`) or a datasets name (`NAME[:CONFIG][:SPLIT]`): it
    exists here, starts with '.', '/' or '~', has more than one '/', its first component is a directory here, or it
    ends in a file suffix this project reads (LOCAL_SUFFIXES)."""
    text = os.fspath(source)
    path = Path(text).expanduser()
    parts = Path(text).parts
    return (path.exists() or text.startswith((".", "/", "~")) or len(parts) > 2
            or (len(parts) == 2 and Path(parts[0]).is_dir()) or Path(text).suffix.lower() in LOCAL_SUFFIXES)


OFFLINE_FLAGS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
# the flags in the order each library reads them: huggingface_hub (so transformers: models, tokenizers) the first of
# HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE that is set and not empty; datasets HF_DATASETS_OFFLINE when it is set at all,
# else huggingface_hub's rule
HUB_FLAGS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
DATASETS_FLAGS = ("HF_DATASETS_OFFLINE", *HUB_FLAGS)
HUB = "https://huggingface.co"
_answered: dict[str, bool] = {}  # the hub's reachability, asked once per process


def split_revision(source: str | os.PathLike) -> tuple[str, str | None]:
    """(`org/name`, `REVISION`) of a hub id pinned to a revision, `org/name@REVISION` (a branch, a tag, a commit hash:
    the first '@' splits, as a hub id holds none); (the text, None) when it holds no '@', is a path that exists (a
    local path wins: a directory `runs/x@2` is that directory, never `runs/x` at revision 2) or ends in a file suffix
    this project reads (`model@v1.ckpt` is a file, found or not, never `model` at revision `v1.ckpt`)."""
    text = os.fspath(source)
    if "@" not in text or Path(text).expanduser().exists() or Path(text).suffix.lower() in LOCAL_SUFFIXES:
        return text, None
    name, revision = text.split("@", 1)
    return name, revision


def pretrained(auto_class, source: str | os.PathLike, **kwargs):
    """`auto_class.from_pretrained` (AutoConfig, AutoTokenizer, AutoModel...) of a model source that `local_path` has
    passed: a local path as it is, a hub id at its revision (`org/name@v1.0`: config, weights and tokenizer files all
    read at that revision; none: the repository's main branch). The one call through which every loader reads a model,
    a config or a tokenizer; remote code never runs. A hub id read before in this process is read at the commit that
    first read resolved to (`read_at`), so a model's config, tokenizer and weights come from one snapshot even when its
    branch moves between their loads."""
    name, revision = read_at(source)
    if revision is not None:
        kwargs["revision"] = revision
    loaded = auto_class.from_pretrained(name, trust_remote_code=False, **kwargs)
    key = _pin_key(source)
    if key is not None and key not in _first_read and (commit := _cached_commit(*key[1:])) is not None:
        _first_read[key] = commit
    return loaded


# (hub cache, hub id, revision asked) -> the commit its first read in this process resolved to
_first_read: dict[tuple[str, str, str], str] = {}


def _pin_key(source: str | os.PathLike) -> tuple[str, str, str] | None:
    name, revision = split_revision(source)
    if looks_local(name):
        return None
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE), name, revision or "main"


def read_at(source: str | os.PathLike) -> tuple[str, str | None]:
    """(name, revision) that `source` is read at: a hub id at the commit its first read in this process resolved to,
    if any; else `split_revision`'s."""
    name, revision = split_revision(source)
    return name, _first_read.get(_pin_key(source), revision)


def model_file(source: str | os.PathLike, filename: str) -> Path | None:
    """The path of one file of a model source, as `pretrained` would read it: a local directory's own file, or a hub
    id's from the hub (or its cache, offline) at its revision (`read_at`); None when the source has no such file."""
    from transformers.utils import cached_file

    name, revision = read_at(source)
    found = cached_file(name, filename, revision=revision, _raise_exceptions_for_missing_entries=False)
    return Path(found) if found else None


def safetensors_of(source: str | os.PathLike) -> list[Path] | None:
    """The safetensors files of a model source, each found as `model_file` finds it: the shards its
    model.safetensors.index.json lists, else its one model.safetensors; None when it has neither (pytorch_model.bin
    alone, or not in the cache offline)."""
    import json

    index = model_file(source, "model.safetensors.index.json")
    if index is None:
        single = model_file(source, "model.safetensors")
        return None if single is None else [single]
    shards = dict.fromkeys(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
    files = [model_file(source, shard) for shard in shards]
    return None if None in files else files


def hub_commit(source: str | os.PathLike) -> str | None:
    """The commit hash at which `source`, a hub id loaded already (`pretrained`), was read: the commit its first read in
    this process resolved to, i.e. the snapshot directory of the hub's cache, `.../models--org--name/snapshots/<commit>/`,
    that its config.json resolved to at its revision (`org/name@v1.0`: that branch, tag or hash; none: main), through
    the cache's refs/<revision>, which the load itself wrote (online) or read (offline). The hub is never asked. None
    for a local path or checkpoint (a directory, even a snapshot's, records no hash: none is made up) and for an id
    whose file the cache does not hold."""
    key = _pin_key(source)
    if key is None:
        return None
    return _first_read.get(key) or _cached_commit(*split_revision(source))


def _cached_commit(name: str, revision: str | None) -> str | None:
    """The snapshot of the hub cache that `name`'s config.json resolves to at `revision` (None: not cached, not an id)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(name, "config.json", revision=revision)
    except ValueError:  # not a valid repository id (huggingface_hub's HFValidationError)
        return None
    commit = Path(found).parent.name if isinstance(found, str) else ""
    return commit if re.fullmatch("[0-9a-f]{40}", commit) else None


def local_path(source: str | os.PathLike, what: str) -> Path | None:
    """The existing local path `source` names (user directory expanded), None when it is a hub id (pinned to a revision
    or not: `org/name@v1.0`) or a datasets name; a UserError "`what` path not found: `source`" when it looks local but
    does not exist (`not_found`). A revision on a local path (`runs/x@v1`: a directory is one version already) and an
    empty one (`org/name@`) are refused in one line."""
    name, revision = split_revision(source)
    if revision is not None:
        text = os.fspath(source)
        if name and looks_local(name):
            if not Path(name).expanduser().exists():
                raise not_found(source, what)
            raise UserError(f"{what} {text!r}: a revision after '@' pins a hub id, and {name!r} is a local path (a "
                            f"directory holds one version): pass it without '@{revision}'")
        if not name or not revision:
            raise UserError(f"{what} {text!r}: nothing {'after' if name else 'before'} '@': a hub id is pinned as "
                            "org/name@REVISION (a branch, a tag or a commit hash)")
        return None
    if not looks_local(source):
        return None
    path = Path(os.fspath(source)).expanduser()
    if not path.exists():
        raise not_found(source, what)
    return path


def not_found(source: str | os.PathLike, what: str) -> UserError:
    """"`what` path not found: `source`", and when `source` reads as a path only because its first component is a
    directory here (`someorg/tiny-bert` beside a folder `someorg/`), that it was read so and not as a hub id."""
    text = os.fspath(source)
    parts = Path(text).parts
    why = ""
    if (len(parts) == 2 and Path(parts[0]).is_dir() and not text.startswith((".", "/", "~"))
            and Path(text).suffix.lower() not in LOCAL_SUFFIXES):
        why = (f" (read as a local path because ./{parts[0]} is a directory here; to load the hub name {text!r}, run "
               "from a directory without it)")
    return UserError(f"{what} path not found: {text}{why}")


def short_name(source: str) -> str:
    """A readable name for a model path: its last component that is not a generic folder name; for a snapshot of the
    hub's cache (`.../models--org--name/snapshots/<commit>`), the repository's name; for a hub id at a revision,
    `name@revision` (a commit hash shortened to its first 7 characters); for a checkpoint file, its run's name and the
    file's ("tiny/last.ckpt"); for "." or "..", that folder's name."""
    name, revision = split_revision(source)
    if revision is not None:
        return f"{short_name(name)}@{revision[:7] if re.fullmatch('[0-9a-f]{40}', revision) else revision}"
    path = Path(str(source))
    if path.name in ("", ".", ".."):  # "." or "..": the folder's own name
        path = path.resolve()
    if path.suffix == ".ckpt":  # a run's checkpoint: the run's name and the file's ("tiny/last.ckpt")
        return f"{short_name(str(path.parent))}/{path.name}"
    parts = path.parts
    for index in range(len(parts) - 2, 0, -1):
        if parts[index] == "snapshots" and parts[index - 1].startswith("models--"):
            return parts[index - 1].split("--")[-1]
    for part in reversed(parts):
        if part not in ("model", "export", "snapshots", "checkpoints", "/"):
            return part
    return str(source)


def _true(value: str | None) -> bool:
    return (value or "").upper() in ("1", "TRUE", "YES", "ON")  # the libraries' own test (no stripping)


def offline_flags(what: str = "encoder") -> list[str]:
    """The variables that tell the library fetching `what` ("dataset": datasets; anything else: transformers) to stay
    offline, as it reads them: none when the one it goes by is unset or false; else that one and any later one that is
    true too (it would take over were that one unset)."""
    chain = DATASETS_FLAGS if what == "dataset" else HUB_FLAGS
    for index, flag in enumerate(chain):
        value = os.environ.get(flag)
        if value is None or (value == "" and flag in HUB_FLAGS):  # datasets goes by HF_DATASETS_OFFLINE="" (false)
            continue
        return [later for later in chain[index:] if _true(os.environ.get(later))] if _true(value) else []
    return []


def hub_offline(what: str = "encoder") -> bool:
    """Whether the library fetching `what` is told to stay offline (it reads its local cache, without retries)."""
    return bool(offline_flags(what))


def cannot_load(what: str, source: str | os.PathLike, reason: str) -> UserError:
    """The one line when `what` ("encoder", "tokenizer", "dataset") named by `source` does not load: "cannot load
    what 'source': reason", and for a hub name while the library fetching it is told to stay offline, the variables
    that tell it so, " (offline: HF_HUB_OFFLINE is set)", before the reason (the library's own line then says only
    that the files are not in its cache)."""
    flags = [] if looks_local(split_revision(source)[0]) else offline_flags(what)
    named = ", ".join(flags[:-1]) + " and " + flags[-1] if len(flags) > 1 else "".join(flags)
    note = f" (offline: {named} {'is' if len(flags) == 1 else 'are'} set)" if flags else ""
    return UserError(f"cannot load {what} {os.fspath(source)!r}{note}: {reason}")


def reachable(url: str, timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the host of `url` opens within `timeout` seconds (name lookup included)."""
    parsed = urlparse(url)
    port = parsed.port or (80 if parsed.scheme == "http" else 443)
    opened: list[bool] = []

    def connect() -> None:
        try:
            socket.create_connection((parsed.hostname, port), timeout=timeout).close()
            opened.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(opened)


def check_hub(source: str | os.PathLike, what: str) -> None:
    """Before `source`, a hub id or datasets name (not local_path's), is fetched: unless the libraries are told to stay
    offline (HF_HUB_OFFLINE and the like, as `offline_flags` reads them: they read their cache), the hub (HF_ENDPOINT)
    must accept a connection within 3 s; else one line saying what to do, instead of the libraries' minutes of
    retries."""
    if hub_offline(what):
        return
    endpoint = os.environ.get("HF_ENDPOINT") or HUB
    if endpoint not in _answered:
        _answered[endpoint] = reachable(endpoint)
    if not _answered[endpoint]:
        raise UserError(f"{what} {os.fspath(source)!r} is a hub name and {urlparse(endpoint).hostname} cannot be "
                        "reached: pass a local path, or set HF_HUB_OFFLINE=1 to use the local cache")
