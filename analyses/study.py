"""The outlier-causes study: every arm trained with every seed by train.py, one run after another, then their
trajectories compared against a null.

    python study.py --config configs/study/study.yaml --output_dir runs/study                     # make study
    python study.py --config configs/study/study.yaml --arms baseline nope --seeds 0 --max_steps 200 \\
        --output_dir runs/study-quick                                                             # a quick look

The study file (configs/study/study.yaml) names train.py's config every arm starts from (`train_config`), the arms
(`arms`: name -> train.py settings that arm changes, e.g. `model.position_embeddings: false`), the seeds (`seeds`,
default [0]; `--seeds` overrides them), the verdict (`verdict`: the null's `gaussian_samples`, the `margin`) and the options of `analyze.py
trajectory` for the comparison (`trajectory`). Each run trains in <output_dir>/<arm>/seed<k> (train.py's
`--seed_everything k`) with every periodic checkpoint kept (`--checkpoint.save_top_k -1`) and the model before its
first update (`--checkpoint.save_initial true`: step 0, null (a)); then `run_trajectories` (analyses/trajectory.py)
analyses every checkpoint of every run on the same sentences, analyses/null.py adds the Gaussian null (b), the
statistics across seeds and the verdicts, and <output_dir>/study.json and study.png are written.

Everything is checked before anything is written: the study file, every run's train.py arguments (by train.py's own
parser and checks, train.check_arguments: an unknown key or a bad value is one line naming the arm), the trajectory
options, and each run directory already there (it must hold this study's arm and seed with the same resolved config).
A re-run skips the runs finished (their export is there), resumes a run stopped midway (`--ckpt_path last`), and
redoes the
comparison.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import yaml

from core.errors import UserError
from core.output import atomic_file, check_writable, write_error
from core.signals import STOPPED, Interrupted

STUDY_KEYS = ("train_config", "arms", "seeds", "verdict", "trajectory")
VERDICT_DEFAULTS = {"gaussian_samples": 3, "margin": 0.5}  # the study file's `verdict` (analyses/null.py, docs/study.md)
ARM_FILE = "study_arm.json"  # in each run directory: its train.py arguments, resolved config and training time
SET_BY_STUDY = ("trainer.default_root_dir", "trainer.max_steps", "checkpoint.dirpath", "checkpoint.save_top_k",
                "checkpoint.save_initial", "seed_everything", "data.seed", "ckpt_path")  # the study sets these
# (one run directory per arm and seed, every checkpoint, step 0 too)
LEGACY = {"model.token_type_embeddings": True, "checkpoint.save_initial": False}  # what a run made before these
# settings existed had (a learned token-type row, no step-0 checkpoint): not this study's runs any more
TRAJECTORY_FLAGS = ("exclude_special", "no_progress", "no_attention_sinks")  # store_true trajectory options


@dataclass
class Arm:
    """One run of the study: an arm trained with one seed."""

    name: str
    seed: int
    run_dir: Path
    args: list[str]  # train.py's arguments (after "fit")
    config: dict  # the config train.py resolves from them (its --print_config)

    @property
    def label(self) -> str:
        return f"{self.name}/seed{self.seed}"

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
    unknown = sorted((str(key) for key in set(study) - set(STUDY_KEYS)), key=str)
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
    seeds = study.get("seeds", [0])
    try:
        seeds = check_seeds(seeds if isinstance(seeds, list) else [seeds])
    except UserError as error:
        raise UserError(f"study config {path}: seeds: {error}") from None
    return {"train_config": train_configs, "arms": {name: dict(settings or {}) for name, settings in arms.items()},
            "seeds": seeds, "verdict": read_verdict(study.get("verdict"), path), "trajectory": dict(trajectory)}


def arms_help(path: str | Path) -> str:
    """The arms of the study file at `path`, one line each (its name, then the train.py settings it changes), for
    study.py --help; a file that cannot be read says so in one line instead."""
    try:
        arms = read_study(path)["arms"]
    except UserError as error:
        return f"  (the arms cannot be listed: {error})"
    width = max(len(name) for name in arms)
    return "\n".join(f"  {name:<{width}}  " + (", ".join(f"{key.lstrip('-')} {setting_text(value)}"
                                                       for key, value in settings.items()) or "no change")
                     for name, settings in arms.items())


def check_seeds(seeds: list) -> list[int]:
    """Distinct non-negative integer seeds, at least one."""
    if not seeds or not all(isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0 for seed in seeds):
        raise UserError(f"seeds must be one or more non-negative integers, got {seeds}")
    if len(set(seeds)) != len(seeds):
        raise UserError(f"seed {next(seed for seed in seeds if seeds.count(seed) > 1)} given twice")
    return list(seeds)


def read_verdict(verdict, path: Path) -> dict:
    """The study file's `verdict`: the null's gaussian_samples (an integer >= 1) and the margin (a number >= 0),
    defaults filled in."""
    verdict = {} if verdict is None else verdict
    if not isinstance(verdict, dict) or set(verdict) - set(VERDICT_DEFAULTS):
        raise UserError(f"study config {path}: verdict must be a mapping with {', '.join(VERDICT_DEFAULTS)}")
    verdict = {**VERDICT_DEFAULTS, **verdict}
    samples, margin = verdict["gaussian_samples"], verdict["margin"]
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
        raise UserError(f"study config {path}: verdict.gaussian_samples must be an integer of at least 1, got "
                        f"{samples!r}")
    if not isinstance(margin, (int, float)) or isinstance(margin, bool) or margin < 0:
        raise UserError(f"study config {path}: verdict.margin must be a number of at least 0, got {margin!r}")
    return {"gaussian_samples": samples, "margin": float(margin)}


def setting_text(value) -> str:
    """A YAML value as train.py's command line takes it."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return "null" if value is None else str(value)


def run_directory(output_dir: Path, name: str, seed: int) -> Path:
    return output_dir / name / f"seed{seed}"


def arm_arguments(study: dict, name: str, seed: int, output_dir: Path, max_steps: int | None) -> list[str]:
    args = [argument for config in study["train_config"] for argument in ("--config", config)]
    for key, value in study["arms"][name].items():
        args += [f"--{key.lstrip('-')}", setting_text(value)]
    # the seed of the blocks' order and masks too, said outright: a run made when the data seed was 0 for every seed
    # (it did not follow --seed_everything) resolves to another config, and is refused
    args += ["--seed_everything", str(seed), "--data.seed", str(seed), "--trainer.default_root_dir",
             str(run_directory(output_dir, name, seed)), "--checkpoint.save_top_k", "-1", "--checkpoint.save_initial",
             "true"]
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


def check_processes(arm: Arm) -> None:
    """An arm of several processes runs under torchrun, which starts every rank of the study: Lightning's own launcher
    would start each arm's second process as a whole study.py of its own (it runs the command again), training along
    but then comparing, writing the records and study.json a second time."""
    from core.trainer_checks import requested_indices, under_torchrun

    trainer = arm.config.get("trainer") or {}
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes") or 1
    count = len(requested_indices(devices) or [0]) * nodes
    if count > 1 and not under_torchrun():
        raise UserError(f"arm {arm.label}: --trainer.devices {devices} x --trainer.num_nodes {nodes} is {count} "
                        f"processes: start the study under torchrun (torchrun --nproc_per_node {count // nodes} "
                        "study.py ...; docs/study.md), whose processes every arm's run joins")


def check_arm_directory(arm: Arm) -> None:
    """A run directory already there must hold this study's arm and seed with the same resolved config (on the keys
    both configs have; a key the older one lacks counts as LEGACY says)."""
    parent = arm.run_dir.parent
    if (parent / ARM_FILE).is_file():
        raise UserError(f"arm {arm.label}: {parent} holds a run of an older study.py (one seed, in the arm's "
                        "directory itself): use another --output_dir or remove it")
    if parent.exists() and not parent.is_dir():
        raise UserError(f"arm {arm.label}: {parent} is not a directory")
    foreign = sorted(p.name for p in parent.iterdir() if not (p.is_dir() and re.fullmatch(r"seed\d+", p.name))) \
        if parent.is_dir() else []
    if foreign:
        raise UserError(f"arm {arm.label}: {parent} holds {foreign[0]}, not a study run (seed<k>/): choose another "
                        "--output_dir or remove it")
    if not arm.run_dir.exists():
        return
    if not arm.run_dir.is_dir():
        raise UserError(f"arm {arm.label}: {arm.run_dir} is not a directory")
    record = arm.run_dir / ARM_FILE
    if not record.is_file():
        if any(arm.run_dir.iterdir()):
            raise UserError(f"arm {arm.label}: {arm.run_dir} holds files but no {ARM_FILE} (not a study run): choose "
                            "another --output_dir or remove it")
        return
    try:
        saved = json.loads(record.read_text(encoding="utf-8"))
        old, new = {**LEGACY, **flat(saved["config"])}, flat(arm.config)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise UserError(f"arm {arm.label}: {record} cannot be read: remove {arm.run_dir} to train it again") from None
    # a key only one side has is one a newer train.py added (its default then): not a change of the arm's settings
    differ = sorted(key for key in set(old) & set(new) if old[key] != new[key])
    if differ:
        key = differ[0]
        raise UserError(f"arm {arm.label}: {arm.run_dir} was trained with other settings ({key}: {old.get(key)!r} "
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
               max_steps: int | None = None, write_check: bool = True, seeds: list[int] | None = None
               ) -> tuple[dict, list[Arm], object]:
    """Everything checked, nothing written: the study, its runs (every arm with every seed, resolved by train.py's
    parser) and the trajectory options (`parse_trajectory`: analyze.py's parser and checks, given by study.py)."""
    study = read_study(config)
    output_dir = Path(output_dir)
    if max_steps is not None and max_steps < 1:
        raise UserError(f"--max_steps must be at least 1, got {max_steps}")
    if seeds is not None:
        study["seeds"] = check_seeds(list(seeds))
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
        for seed in study["seeds"]:
            args = arm_arguments(study, name, seed, output_dir, max_steps)
            planned.append(Arm(name, seed, run_directory(output_dir, name, seed), args, resolve(name, args)))
    for arm in planned:
        check_processes(arm)
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
            print(f"study: run {arm.label} is finished ({arm.run_dir / 'export'}): skipped")
        return None
    record = arm.run_dir / ARM_FILE
    if rank == 0:
        write_record(record, {"arm": arm.name, "seed": arm.seed, "train_args": ["fit", *arm.args, "--ckpt_path", "last"],
                              "config": arm.config})
        print(f"study: training {arm.label} in {arm.run_dir}")
    started = time.perf_counter()
    with quiet_cli(), wandb_grouping(arm):
        # resumes an arm stopped midway; under torchrun the next arm (and the comparison) joins its process group
        code = train.cli_main(["fit", *arm.args, "--ckpt_path", "last"], keep_process_group=True)
    if code in STOPPED:  # Ctrl-C or SIGTERM (train.py said where it stopped): the study stops with that status
        stop = Interrupted(code - 128)
        stop.detail = f" while training arm {arm.label}"
        raise stop
    if code != 0:
        if rank == 0 and forget_untrained(arm.run_dir, record):
            raise UserError(f"arm {arm.label}: train.py refused it before training (its error above, exit status "
                            f"{code}); nothing of it was kept: change the arm and rerun the study")
        raise UserError(f"arm {arm.label}: train.py exited with status {code} (rerun the study to resume it)")
    seconds = time.perf_counter() - started
    if rank != 0:
        return seconds
    saved = json.loads(record.read_text(encoding="utf-8"))
    saved["train_seconds"] = round(seconds + saved.get("train_seconds", 0.0), 1)  # a resumed arm adds up
    write_record(record, saved)
    return seconds


@contextlib.contextmanager
def wandb_grouping(arm: Arm):
    """The arm's W&B run grouped under its study (the output directory's name) and tagged with its arm and seed,
    through WANDB_RUN_GROUP and WANDB_TAGS (which AutoWandbLogger hands to wandb.init: callbacks.wandb_logging.grouping):
    the workspace shows a study's runs together and filters them by arm or seed. A group or tags the user set (those
    variables, or the logger's init_args) win."""
    study = Path(os.path.abspath(arm.run_dir)).parent.parent.name
    values = {"WANDB_RUN_GROUP": study, "WANDB_TAGS": f"{arm.name.replace(',', '_')},seed{arm.seed}"}
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update({key: value for key, value in values.items() if not saved[key]})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def forget_untrained(run_dir: Path, record: Path) -> bool:
    """A run that train.py refused before it wrote anything (its bad input is found only with the data: the study
    checked what it could): its record removed, and the directories it leaves empty, so a rerun with the arm changed
    is not taken for a changed run. True when it was so."""
    if not run_dir.is_dir() or [path.name for path in run_dir.iterdir()] != [record.name]:
        return False
    record.unlink()
    for directory in (run_dir, run_dir.parent):
        if not any(directory.iterdir()):
            directory.rmdir()
    return True


def write_record(record: Path, payload: dict) -> None:
    """An arm's study_arm.json, whole or not at all (a full disk: one line naming it and the disk)."""
    try:
        with atomic_file(record) as handle:
            handle.write(json.dumps(payload, indent=2).encode())
    except OSError as error:
        raise UserError(f"cannot write {record}: {write_error(error, record)}") from None


def run_study(config: str | Path, output_dir: str | Path, parse_trajectory, arms: list[str] | None = None,
              max_steps: int | None = None, seeds: list[int] | None = None) -> dict:
    """Train every arm with every seed in sequence (skipping finished runs), then compare them against the null:
    <output_dir>/study.json and study.png. Returns study.json's content."""
    from analyses.session import distributed, leave_process_group
    from analyses.study_report import compare_study

    rank = int(os.environ.get("RANK", "0"))  # torchrun: every rank runs the study (train.py forms its group)
    study, planned, trajectory = plan_study(config, output_dir, parse_trajectory, arms, max_steps, write_check=rank == 0,
                                            seeds=seeds)
    fresh, done = not Path(output_dir).exists(), False
    try:  # under torchrun the arms keep their process group: the next arm and the comparison join it
        try:
            for arm in planned:
                train_arm(arm, rank)
        except UserError:
            if fresh and rank == 0 and Path(output_dir).is_dir() and not any(Path(output_dir).iterdir()):
                Path(output_dir).rmdir()  # the first arm refused before training: no directory left behind
            raise
        with distributed() as (rank, world):  # the comparison sharded over the ranks, rank 0 writes
            report = compare_study(trajectory, [(arm.name, arm.seed, str(arm.run_dir)) for arm in planned],
                                   str(output_dir), study["verdict"], rank=rank, world=world)
        done = True
    finally:
        leave_process_group(barrier=done)
    return report
