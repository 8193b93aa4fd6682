"""Opening a user's checkpoint without ever running code from it: weights-only, with an allow-list.

    checkpoint = load_weights_only("runs/tiny/checkpoints/last.ckpt")   # tensors and plain data, or one clear line
    trainer.strategy.checkpoint_io = WeightsOnlyCheckpointIO()           # Lightning's own resume, the same way

A .ckpt is a pickle, and unpickling a crafted one runs whatever it names (`os.system`, ...). torch's weights-only
unpickler builds nothing but tensors, numbers, strings and plain containers (dict, list, tuple, OrderedDict, set),
plus the types in SAFE_GLOBALS: this project's checkpoints hold no other type (its tokenizer is embedded as text, its
callbacks' states are tensors and lists), so the allow-list is empty and stays short. A checkpoint that needs
anything else is refused with one line naming what it would have built.
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from pytorch_lightning.plugins.io import TorchCheckpointIO

from core.errors import UserError

# Types beyond torch's weights-only defaults that this project's checkpoints may hold. Add one here only when a
# checkpoint of this project needs it, and only a plain data type whose construction runs no user-chosen code.
SAFE_GLOBALS: list = []


def load_weights_only(path: str | os.PathLike, what: str = "checkpoint", mmap: bool = False) -> Any:
    """torch.load(path) weights-only on the CPU; a UserError naming `path` when the file is empty, truncated or
    corrupt, or would build anything but data (then nothing of it ran)."""
    path = Path(path)
    if path.is_file() and path.stat().st_size == 0:
        raise UserError(f"cannot read {what} {path}: the file is empty")
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on old pickle protocols: the line below says what matters
            return torch.load(str(path), map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        raise UserError(refusal(path, error, what)) from None
    except Exception as error:  # torch raises many types for a bad file; its messages run over several sentences
        text = str(error).splitlines()[0] if str(error) else type(error).__name__
        reason = "not a torch.save zip archive" if "mmap can only be used" in text else text.split(". ")[0]
        raise UserError(f"cannot read {what} {path}: truncated or corrupt ({reason})") from None


def refusal(path: Path, error: Exception, what: str = "checkpoint") -> str:
    """The one line for an unpickling error: a refusal naming the global a crafted (or foreign) checkpoint needs, or,
    for a file that is no pickle at all (random bytes), truncated or corrupt."""
    text = str(error)
    if "Weights only load failed" not in text and "WeightsUnpickler" not in text:
        return f"cannot read {what} {path}: truncated or corrupt ({text.splitlines()[0].split('. ')[0] or 'bad pickle'})"
    found = re.search(r"GLOBAL ([\w.]+)", text) or re.search(r"unrecognized function ([^\s.]+(?:\.\w+)*)", text)
    if found is None and "Unsupported operand" in text:  # random bytes, or a plain pickle torch.save did not write
        return f"cannot read {what} {path}: truncated or corrupt (not a checkpoint torch.save wrote)"
    needs = f"{found.group(1)!r}" if found else "an object that is not plain data"
    return (f"refused to load {what} {path}: it needs {needs}, which is code, not data (checkpoints load "
            "weights-only: tensors, numbers, strings and plain containers); nothing in it was run")


class WeightsOnlyCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO, reading local files weights-only onto the CPU (Lightning moves the states to the
    device as it restores them), whatever `--weights_only` or TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD ask (Lightning passes
    weights_only=None, which torch reads as False when that variable is set)."""

    def load_checkpoint(self, path, map_location=None, weights_only: bool | None = None) -> dict[str, Any]:
        if not Path(path).is_file():  # a URL too: only local files are read
            raise UserError(f"checkpoint not found: {path}")
        return load_weights_only(path)
