"""The one rule that tells a local path from a hub id or a `datasets` name, for models, tokenizers and data alike.

    looks_local("data/austen.txt")        # True: a file suffix this project reads
    looks_local("bert-base-uncased")      # False: a hub id ("name" or "org/name")
    looks_local("glue/sst2")              # False, unless ./glue is a directory here
    local_path("runs/tiny-pe", "encoder") # Path(...) when it exists; UserError "encoder path not found: ..." when it
                                          # looks local but is not there; None for a hub id or datasets name
    short_name("runs/x/export")           # "x": a readable name for a model path
"""

from __future__ import annotations

import os
from pathlib import Path

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


def local_path(source: str | os.PathLike, what: str) -> Path | None:
    """The existing local path `source` names (user directory expanded), None when it is a hub id or datasets name;
    a UserError "`what` path not found: `source`" when it looks local but does not exist."""
    if not looks_local(source):
        return None
    path = Path(os.fspath(source)).expanduser()
    if not path.exists():
        raise UserError(f"{what} path not found: {os.fspath(source)}")
    return path


def short_name(source: str) -> str:
    """A readable name for a model path: its last component that is not a generic folder name."""
    for part in reversed(Path(str(source)).parts):
        if part not in ("model", "export", "snapshots", "checkpoints", "/"):
            return part
    return str(source)
