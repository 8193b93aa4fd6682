"""Read what an offline W&B run logged, from its `.wandb` record log (wandb 0.31 writes no summary json offline).

    run = read_run(next(Path(tmp).glob("wandb/offline-run-*")))
    run.history            # [{"trainer/global_step": 10, "outliers/layer_3/argmax_share": 0.61, ...}, ...]
    run.summary            # {"outliers/layer_3/argmax_share": 0.61, ...}: last summary update per key
    run.metrics            # {"outliers/*": "trainer/global_step", ...}: define_metric step metrics
    run.media              # files under files/media (images, tables)
    run.name, run.job_type, run.group, run.tags, run.git_commit   # the run record's

The log is a leveldb-style record log: a 7-byte header (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of
records, each with a 7-byte header (crc32, length, type FULL/FIRST/MIDDLE/LAST) holding a protobuf `Record`.
"""

from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path):
    """Yield the protobuf Records of a .wandb file in order."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1 and version == 0, f"not a W&B record log: {path}"
    position, pending = 7, b""
    while position + 7 <= len(data):
        left_in_block = BLOCK - position % BLOCK
        if left_in_block < 7:
            position += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position:position + 7])
        payload = data[position + 7:position + 7 + length]
        if len(payload) < length:  # still being written
            return
        position += 7 + length
        if kind == 0 and length == 0:  # zero padding at the end of a block
            position += BLOCK - position % BLOCK if position % BLOCK else 0
            continue
        if kind == FULL:
            pending = payload
        elif kind == FIRST:
            pending = payload
            continue
        elif kind == MIDDLE:
            pending += payload
            continue
        elif kind == LAST:
            pending += payload
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        yield record
        pending = b""


@dataclass
class OfflineRun:
    directory: Path
    history: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    name: str = ""
    job_type: str = ""
    group: str = ""
    tags: list = field(default_factory=list)
    git_commit: str = ""

    @property
    def media(self) -> list[Path]:
        return sorted((self.directory / "files" / "media").rglob("*"))

    def values(self, key: str) -> list:
        return [row[key] for row in self.history if key in row]


def read_run(directory: Path, timeout: float = 30.0) -> OfflineRun:
    """Parse history rows, summary updates, define_metric step metrics and config of an offline run directory.

    wandb-core may still be flushing after `finish()` returns: the log is re-read until its exit record is in.
    """
    directory = Path(directory)
    (log,) = directory.glob("*.wandb")
    deadline = time.monotonic() + timeout
    while True:
        logged = list(records(log))
        if any(r.WhichOneof("record_type") == "exit" for r in logged) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    run = OfflineRun(directory)
    for record in logged:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.name, run.job_type, run.group = record.run.display_name, record.run.job_type, record.run.run_group
            run.tags, run.git_commit = list(record.run.tags), record.run.git.commit
            for item in record.run.config.update:
                run.config[item.key] = json.loads(item.value_json)
        elif kind == "history":
            run.history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                for item in record.history.item})
        elif kind == "summary":
            for item in record.summary.update:
                run.summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind == "metric":
            name = record.metric.name or record.metric.glob_name
            run.metrics[name] = record.metric.step_metric
        elif kind == "config":
            for item in record.config.update:
                run.config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return run
