"""The on-disk caches the Hugging Face libraries leave, written by hand, for tests that load hub ids and `datasets` names
offline (HF_HUB_OFFLINE=1, as on compute nodes without internet) without a hub.

    commit = cache_model(hub_cache, "someorg/tiny-bert", saved_dir)   # models--someorg--tiny-bert/{blobs,refs,snapshots}
    cache_model(hub_cache, "tiny-bert", saved_dir, ref="v1")          # a legacy id (no org); refs/v1, not refs/main
    cache_dataset(datasets_cache, "someorg/tiny-sst2", {"train": rows, "validation": rows}, config="default")
    with hub_caches(monkeypatch, tmp_path) as (hub_cache, datasets_cache): ...   # both libraries read them, offline

huggingface_hub's layout (file_download.py: repo_folder_name, _create_symlink, _cache_commit_hash_for_specific_revision):
`models--<org>--<name>/refs/<ref>` holds the commit hash (no newline), `snapshots/<commit>/<file>` is a relative symlink
to `blobs/<etag>`, the etag a file's git blob sha1, or an LFS file's (weights') sha256. `datasets`, offline, reads a hub
dataset name only from its prepared Arrow cache (load.py: dataset_module_factory falls back to
CachedDatasetModuleFactory; the hub snapshot of the dataset repo is not read): `<org>___<name>/<config>/<version>/
<hash>/` as the builder of a parquet repository writes it, which `cache_dataset` runs (the same code an online
load_dataset runs after downloading the files).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".h5", ".msgpack", ".model")  # files the hub keeps in LFS


def etag(path: Path) -> str:
    """The name of a file's blob: sha256 for an LFS file (weights), else its git blob sha1."""
    data = path.read_bytes()
    if path.suffix in LFS_SUFFIXES:
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def cache_model(hub_cache: Path, repo_id: str, source: Path, ref: str = "main", commit: str | None = None,
                repo_type: str = "model") -> str:
    """The files of `source` (a save_pretrained directory) as huggingface_hub caches repository `repo_id` at `ref`;
    the commit hash (a made-up one unless given)."""
    commit = commit or hashlib.sha1(f"{repo_id}@{ref}".encode()).hexdigest()
    folder = Path(hub_cache) / "--".join([f"{repo_type}s", *repo_id.split("/")])
    snapshot = folder / "snapshots" / commit
    (folder / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(Path(source).rglob("*")):
        if not file.is_file():
            continue
        blob = folder / "blobs" / etag(file)
        if not blob.exists():
            blob.write_bytes(file.read_bytes())
        link = snapshot / file.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / ref).write_text(commit)
    return commit


def cache_dataset(datasets_cache: Path, name: str, splits: dict[str, list[dict]], config: str = "default",
                  commit: str | None = None) -> Path:
    """The prepared Arrow cache a (non-streaming) `load_dataset(name, config)` of a parquet hub repository leaves: the
    rows of each split written as parquet files, then prepared by the Parquet builder with the hub builder's own
    arguments (repo_id, dataset_name, config, the commit as hash). The prepared directory."""
    import datasets
    from datasets.naming import camelcase_to_snakecase
    from datasets.packaged_modules.parquet.parquet import Parquet

    commit = commit or hashlib.sha1(f"{name}:{config}".encode()).hexdigest()
    files = Path(datasets_cache).parent / f"parquet-{name.replace('/', '--')}-{config}"
    files.mkdir(parents=True, exist_ok=True)
    data_files = {}
    for split, rows in splits.items():
        data_files[split] = str(files / f"{split}-00000-of-00001.parquet")
        datasets.Dataset.from_list(rows).to_parquet(data_files[split])
    # the hub builder's data files are hf://datasets/<name>@<commit>/... URLs, which it checks; these are local: the
    # builder is made without its repo_id, which is then set before the cache directory is named from it
    builder = Parquet(cache_dir=str(datasets_cache), dataset_name=camelcase_to_snakecase(name.split("/")[-1]),
                      config_name=config, config_id=config, data_files=data_files, hash=commit)
    builder.repo_id = name
    builder._cache_dir = builder._output_dir = builder._build_cache_dir()
    builder.download_and_prepare()
    return Path(builder.cache_dir)


@contextlib.contextmanager
def hub_caches(monkeypatch, root: Path):
    """Within: huggingface_hub (so transformers) and `datasets` read their caches under `root` and are told to stay
    offline; their import-time constants are patched too. Yields (hub cache, datasets cache)."""
    import datasets.config
    import huggingface_hub.constants

    hub_cache, datasets_cache = Path(root) / "hub", Path(root) / "datasets"
    hub_cache.mkdir(parents=True, exist_ok=True)
    datasets_cache.mkdir(parents=True, exist_ok=True)
    for flag in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(flag, "1")
    monkeypatch.setenv("HF_HOME", str(root))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(datasets_cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", datasets_cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    yield hub_cache, datasets_cache
