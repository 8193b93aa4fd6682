"""The outlier-causes study: arms trained one after another by train.py, then their trajectories compared.

    python study.py --config configs/study/study.yaml --output_dir runs/study              # make study
    python study.py --config configs/study/study.yaml --arms baseline nope --max_steps 200 \\
        --output_dir runs/study-quick                                                             # a quick look

The study file (configs/study/study.yaml) names train.py's config every arm starts from (`train_config`), the arms
(`arms`: name -> train.py settings that arm changes, e.g. `model.position_embeddings: false`) and the options of
`analyze.py trajectory` for the comparison (`trajectory`). Each arm trains in <output_dir>/<arm> with every periodic
checkpoint kept (`--checkpoint.save_top_k -1`); then `compare_runs` (analyses/trajectory.py) analyses every
checkpoint of every arm on the same sentences and writes <output_dir>/study.json (per arm, per checkpoint, per layer:
outlier dims and shares, kurtosis, max |activation|, anisotropy, IsoScore*; per checkpoint the MLM validation loss it
records) and study.png (the arms as lines against the step).

Everything is checked before anything is written: the study file, every arm's train.py arguments (by train.py's own
parser and checks, train.check_arguments: an unknown key or a bad value is one line naming the arm), the trajectory
options, and each arm directory already there (it must hold this study's arm with the same resolved config). A re-run
skips the arms finished (their export is there), resumes an arm stopped midway (`--ckpt_path last`), and redoes the
comparison.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import yaml

from core.errors import UserError
from core.output import atomic_file, check_writable, write_error

STUDY_KEYS = ("train_config", "arms", "trajectory")
ARM_FILE = "study_arm.json"  # in each arm's run directory: its train.py arguments, resolved config and training time
SET_BY_STUDY = ("trainer.default_root_dir", "trainer.max_steps", "checkpoint.dirpath", "checkpoint.save_top_k",
                "ckpt_path")  # an arm may not set these: the study does (one run directory per arm, every checkpoint)
TRAJECTORY_FLAGS = ("exclude_special", "no_progress", "no_attention_sinks")  # store_true trajectory options


@dataclass
class Arm:
    name: str
    run_dir: Path
    args: list[str]  # train.py's arguments (after "fit")
    config: dict  # the config train.py resolves from them (its --print_config)

    @property
    def finished(self) -> bool:
        return (self.run_dir / "export" / "config.json").is_file()


def read_study(path: str | Path) -> dict:
    """The study file, checked: a mapping with train_config (an existing file), arms (name -> mapping) and trajectory
    (a mapping of analyze.py trajectory options)."""
    path = Path(path)
    try:
        study = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise UserError(f"cannot read study config {path}: {error.strerror or error}") from None
    except (UnicodeDecodeError, yaml.YAMLError) as error:
        raise UserError(f"study config {path} is not valid YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(study, dict):
        raise UserError(f"study config {path} must be a mapping with {', '.join(STUDY_KEYS)}")
    unknown = sorted(set(study) - set(STUDY_KEYS))
    if unknown:
        raise UserError(f"study config {path}: unknown key {unknown[0]!r} (expected {', '.join(STUDY_KEYS)})")
    given = study.get("train_config")
    given = [given] if isinstance(given, str) else given
    if not isinstance(given, list) or not given or not all(isinstance(item, str) for item in given):
        raise UserError(f"study config {path}: train_config must name train.py's config file (or a list of them, "
                        "applied in order)")
    train_configs = []
    for item in given:
        candidates = [Path(item)] if Path(item).is_absolute() else [path.parent / item, Path(item)]
        found = next((candidate for candidate in candidates if candidate.is_file()), None)
        if found is None:
            raise UserError(f"study config {path}: train_config {item} not found (relative to {path.parent} or the "
                            "working directory)")
        train_configs.append(str(found))
    arms = study.get("arms")
    if not isinstance(arms, dict) or not arms:
        raise UserError(f"study config {path}: arms must map each arm's name to its train.py settings")
    for name, settings in arms.items():
        if not isinstance(name, str) or not name.replace("_", "").replace("-", "").isalnum():
            raise UserError(f"study config {path}: arm name {name!r} must be letters, digits, '_' or '-'")
        if settings is not None and not isinstance(settings, dict):
            raise UserError(f"study config {path}: arm {name}'s settings must be a mapping (key: value), got "
                            f"{type(settings).__name__}")
        for key in settings or {}:
            if not isinstance(key, str) or key.lstrip("-") in SET_BY_STUDY:
                raise UserError(f"study config {path}: arm {name} may not set {key} (the study sets it for every arm)")
    trajectory = study.get("trajectory") or {}
    if not isinstance(trajectory, dict):
        raise UserError(f"study config {path}: trajectory must be a mapping of analyze.py trajectory options")
    return {"train_config": train_configs, "arms": {name: dict(settings or {}) for name, settings in arms.items()},
            "trajectory": dict(trajectory)}


def setting_text(value) -> str:
    """A YAML value as train.py's command line takes it."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return "null" if value is None else str(value)


def arm_arguments(study: dict, name: str, output_dir: Path, max_steps: int | None) -> list[str]:
    args = [argument for config in study["train_config"] for argument in ("--config", config)]
    for key, value in study["arms"][name].items():
        args += [f"--{key.lstrip('-')}", setting_text(value)]
    args += ["--trainer.default_root_dir", str(output_dir / name), "--checkpoint.save_top_k", "-1"]
    if max_steps is not None:
        args += ["--trainer.max_steps", str(max_steps)]
    return args


@contextlib.contextmanager
def quiet_cli():
    """LightningCLI warns when given arguments while the process has its own (study.py's): expected here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        yield


def resolve(name: str, args: list[str]) -> dict:
    """The config train.py resolves from `args` (its own parser: --print_config), without running anything."""
    from train import TRAINER_DEFAULTS, MLMDataModule, MLMModule, PretrainCLI, check_arguments

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), quiet_cli():
            PretrainCLI(MLMModule, MLMDataModule, seed_everything_default=0, trainer_defaults=TRAINER_DEFAULTS,
                        args=["fit", *args, "--print_config"])
    except UserError as error:
        raise UserError(f"arm {name}: {error}") from None
    except SystemExit as stop:
        if stop.code not in (0, None):
            raise UserError(f"arm {name}: train.py refused its arguments (exit status {stop.code})") from None
    config = yaml.safe_load(out.getvalue())
    if not isinstance(config, dict) or "model" not in config:
        raise UserError(f"arm {name}: train.py resolved no config from {' '.join(args)}")
    try:  # its values too, as train.py checks them before it reads data (an unknown attention variant, ...)
        with quiet_cli(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the arm's own warnings come when it trains
            check_arguments(args)
    except UserError as error:
        raise UserError(f"arm {name}: {error}") from None
    config.pop("ckpt_path", None)
    return config


def flat(config: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def check_arm_directory(arm: Arm) -> None:
    """An arm directory already there must hold this study's arm with the same resolved config (on the keys both
    configs have)."""
    if not arm.run_dir.exists():
        return
    if not arm.run_dir.is_dir():
        raise UserError(f"arm {arm.name}: {arm.run_dir} is not a directory")
    record = arm.run_dir / ARM_FILE
    if not record.is_file():
        if any(arm.run_dir.iterdir()):
            raise UserError(f"arm {arm.name}: {arm.run_dir} holds files but no {ARM_FILE} (not a study arm): choose "
                            "another --output_dir or remove it")
        return
    try:
        saved = json.loads(record.read_text(encoding="utf-8"))
        old, new = flat(saved["config"]), flat(arm.config)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise UserError(f"arm {arm.name}: {record} cannot be read: remove {arm.run_dir} to train the arm again") \
            from None
    # a key only one side has is one a newer train.py added (its default then): not a change of the arm's settings
    differ = sorted(key for key in set(old) & set(new) if old[key] != new[key])
    if differ:
        key = differ[0]
        raise UserError(f"arm {arm.name}: {arm.run_dir} was trained with other settings ({key}: {old.get(key)!r} "
                        f"there, {new.get(key)!r} now{f', and {len(differ) - 1} more' if len(differ) > 1 else ''}): "
                        "use another --output_dir or remove it")


def trajectory_arguments(options: dict, output_dir: Path, parse_trajectory):
    """analyze.py trajectory's options for the comparison, parsed and validated by analyze.py itself:
    `parse_trajectory(argv)` is its parser plus checks (given by the entry point, study.py)."""
    argv = ["trajectory", "--run", str(output_dir), "--output_dir", str(output_dir)]
    for key, value in options.items():
        if key in ("run", "run_dir", "encoders", "output_dir"):
            raise UserError(f"study trajectory options may not set {key} (the study sets it)")
        if key in TRAJECTORY_FLAGS:
            argv += [f"--{key}"] if value else []
        else:
            argv += [f"--{key}", setting_text(value)]
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            args = parse_trajectory(argv)
    except SystemExit:
        message = errors.getvalue().strip().splitlines()
        raise UserError(f"study trajectory options: {message[-1].split('error: ', 1)[-1] if message else argv}") \
            from None
    return args


def plan_study(config: str | Path, output_dir: str | Path, parse_trajectory, arms: list[str] | None = None,
               max_steps: int | None = None, write_check: bool = True) -> tuple[dict, list[Arm], object]:
    """Everything checked, nothing written: the study, its arms (resolved by train.py's parser) and the trajectory
    options (`parse_trajectory`: analyze.py's parser and checks, given by study.py)."""
    study = read_study(config)
    output_dir = Path(output_dir)
    if max_steps is not None and max_steps < 1:
        raise UserError(f"--max_steps must be at least 1, got {max_steps}")
    names = list(study["arms"]) if not arms else list(arms)
    unknown = [name for name in names if name not in study["arms"]]
    if unknown:
        raise UserError(f"unknown arm {unknown[0]!r} (the study's arms: {', '.join(study['arms'])})")
    if len(set(names)) != len(names):
        raise UserError(f"arm {next(n for n in names if names.count(n) > 1)!r} given twice in --arms")
    if output_dir.exists() and not output_dir.is_dir():
        raise UserError(f"output directory {output_dir} is a file")
    planned = []
    for name in names:
        args = arm_arguments(study, name, output_dir, max_steps)
        planned.append(Arm(name, output_dir / name, args, resolve(name, args)))
    for arm in planned:
        check_arm_directory(arm)
    trajectory = trajectory_arguments(study["trajectory"], output_dir, parse_trajectory)
    if write_check:
        check_writable(output_dir)
    return study, planned, trajectory


def train_arm(arm: Arm, rank: int = 0) -> float | None:
    """Train one arm (or resume it; a finished one is skipped): the seconds it took, None when skipped. Under
    torchrun every rank calls it (train.py joins them); rank 0 writes the arm's record."""
    import train

    if arm.finished:
        if rank == 0:
            print(f"study: arm {arm.name} is finished ({arm.run_dir / 'export'}): skipped")
        return None
    record = arm.run_dir / ARM_FILE
    if rank == 0:
        write_record(record, {"arm": arm.name, "train_args": ["fit", *arm.args, "--ckpt_path", "last"],
                              "config": arm.config})
        print(f"study: training arm {arm.name} in {arm.run_dir}")
    started = time.perf_counter()
    with quiet_cli():
        code = train.cli_main(["fit", *arm.args, "--ckpt_path", "last"])  # resumes an arm stopped midway
    if code != 0:
        raise UserError(f"arm {arm.name}: train.py exited with status {code} (rerun the study to resume it)")
    seconds = time.perf_counter() - started
    if rank != 0:
        return seconds
    saved = json.loads(record.read_text(encoding="utf-8"))
    saved["train_seconds"] = round(seconds + saved.get("train_seconds", 0.0), 1)  # a resumed arm adds up
    write_record(record, saved)
    return seconds


def write_record(record: Path, payload: dict) -> None:
    """An arm's study_arm.json, whole or not at all (a full disk: one line naming it and the disk)."""
    try:
        with atomic_file(record) as handle:
            handle.write(json.dumps(payload, indent=2).encode())
    except OSError as error:
        raise UserError(f"cannot write {record}: {write_error(error, record)}") from None


def run_study(config: str | Path, output_dir: str | Path, parse_trajectory, arms: list[str] | None = None,
              max_steps: int | None = None) -> dict:
    """Train the arms in sequence (skipping finished ones), then compare them: <output_dir>/study.json and study.png.
    Returns study.json's content."""
    from analyses.session import distributed
    from analyses.trajectory import compare_runs

    rank = int(os.environ.get("RANK", "0"))  # torchrun: every rank runs the study (train.py forms its group)
    study, planned, trajectory = plan_study(config, output_dir, parse_trajectory, arms, max_steps, write_check=rank == 0)
    for arm in planned:
        train_arm(arm, rank)
    with distributed() as (rank, world):  # the comparison sharded over the ranks, rank 0 writes
        report = compare_runs(trajectory, [(arm.name, str(arm.run_dir)) for arm in planned], str(output_dir),
                              stem="study", rank=rank, world=world)
    if rank == 0:
        print_study(report)
    return report


def print_study(report: dict) -> None:
    """One line per arm and checkpoint: the top outlier share over layers 1..L with its dimension, kurtosis, max
    |activation|, anisotropy and the validation loss."""
    print(f"\n{'arm':<16} {'step':>6}  {'top share (layer, dim)':<24} {'kurtosis':>9} {'max|x|':>8} {'aniso':>6} "
          f"{'val loss':>8}")
    for run in report["runs"]:
        for point in run["checkpoints"]:
            rows = point["layers"][1:] or point["layers"]
            best = max(rows, key=lambda row: max(row["argmax_share"], row["argmin_share"]))
            share, dim = max((best["argmax_share"], best["argmax_dim"]), (best["argmin_share"], best["argmin_dim"]))
            kurtosis = max(row["kurtosis_mean"] for row in rows)
            max_abs = max(row["max_abs"] for row in rows)
            anisotropy = [row["anisotropy"] for row in rows if row["anisotropy"] is not None]
            loss = point.get("val_loss")
            where = f"{share:.1%} ({best['layer']}, {dim})"
            mean_anisotropy = sum(anisotropy) / len(anisotropy) if anisotropy else float("nan")
            print(f"{run['label']:<16} {point['step']:>6}  {where:<24} {kurtosis:>9.2f} {max_abs:>8.3g} "
                  f"{mean_anisotropy:>6.3f} {'-' if loss is None else f'{loss:.3f}':>8}")
