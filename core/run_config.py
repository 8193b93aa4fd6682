"""The resolved configuration of a train.py / probe.py run as the W&B run's config, beside the versions it ran with.

    W&B config of `python train.py fit --config configs/pretrain/tiny.yaml`:
    model.hidden_size 128, data.block_length 128, trainer.max_steps 200, trainer.callbacks[i].init_args.every_n_steps,
    seed_everything 0, ckpt_path, checkpoint.*, versions.positional-artefacts 0.1.0, versions.torch ...

The sections are config.yaml's (the same dump, Lightning's `parser.dump`), so the run's W&B page reads as the file
in its run directory does; W&B records the git commit itself (the run's overview, when started inside the
repository). The module's and data module's own hyper-parameters stay as Lightning logs them (flat keys beside).
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

import yaml

PACKAGES = ("positional-artefacts", "torch", "pytorch-lightning", "transformers", "datasets", "torchmetrics", "wandb")


def versions() -> dict[str, str | None]:
    """The installed versions of this project and the libraries its numbers depend on (None: not installed)."""
    found = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def resolved_config(parser, config) -> dict[str, Any]:
    """The subcommand's whole resolved configuration (what config.yaml holds) as plain data, and `versions`."""
    resolved = yaml.safe_load(parser.dump(config, skip_none=False)) or {}
    resolved.pop("__path__", None)
    return {**resolved, "versions": versions()}
