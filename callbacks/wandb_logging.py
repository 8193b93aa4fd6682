"""W&B by default, offline by itself, never fatal; and the logger-agnostic helpers the live-statistics callbacks use.

    python train.py fit --config configs/pretrain/tiny.yaml       # W&B: online when logged in and reachable, else offline
    WANDB_MODE=offline python train.py fit --config ...           # offline on purpose; upload later with the printed
    wandb sync runs/pretrain/tiny/wandb/offline-run-*             #   command (`wandb login` first)
    python train.py fit --config ... --trainer.logger false       # no logger at all

AutoWandbLogger (train.py's default logger) is Lightning's WandbLogger that picks its mode when the run starts, on
rank zero: WANDB_MODE when it says offline or disabled; otherwise online when W&B credentials exist (WANDB_API_KEY,
WANDB_IDENTITY_TOKEN_FILE, or the netrc entry `wandb login` writes) and the W&B host accepts a connection within 3 s,
else offline, saying so in one line on stderr with the `wandb sync` command. A W&B that fails to start (online, then
offline) or fails mid-run gives one warning (LoggingWarning) and training goes on without it. `save_dir` defaults to
the trainer's default_root_dir (`use_root_dir`, called by train.py); the run is finished when the trainer finalises
the logger, so several fits in one process each get their own run.

One W&B run per training run (`keep_runs`, called by train.py and probe.py): its id is kept in the run directory
(RUN_ID_FILE) and in every checkpoint (KeepRunId, key CHECKPOINT_KEY), and a resume (--ckpt_path last, a SIGTERM /
SLURM requeue, a re-run of a finished run) continues that run (resume="allow" with the kept id), its history at the
resumed step. An id given by the user (--trainer.logger.init_args.id) wins; a fresh start gets a new run. Only global
rank zero ever starts one. Offline, each resume writes one more `offline-run-*-<id>` directory of the same run (`-<id>-1` when two start within
the same second): `wandb sync <root>/wandb/offline-run-*-<id>*` uploads them together, in order, as that one run.

log_scalars / log_figure / log_table / log_summary / log_settings / define_step_metrics send to each of the trainer's loggers what
it can take: scalars to every logger (CSV, TensorBoard, W&B), lists beside them to W&B only; figures to W&B and
TensorBoard; tables to W&B (as a markdown text to TensorBoard); summaries and step metrics to W&B; settings to every
logger's hyperparameters. Rank zero only. A logger that raises is warned
about once and skipped from then on. `image_loggers` are those that keep images (a disabled W&B run keeps nothing).
"""

from __future__ import annotations

import netrc
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from pytorch_lightning.callbacks import Callback
from pytorch_lightning.loggers import TensorBoardLogger, WandbLogger
from pytorch_lightning.loggers.logger import DummyExperiment, DummyLogger, rank_zero_experiment
from pytorch_lightning.utilities import rank_zero_only

from core.figures import figure_array
from core.output import atomic_file, disk_full, failed_file, write_error
from core.sources import reachable

DEFAULT_HOST = "https://api.wandb.ai"
STEP_METRIC = "trainer/global_step"
RUN_ID_FILE = "wandb_run_id"  # in the run directory: the id of the training run's one W&B run
CHECKPOINT_KEY = "wandb_run_id"  # the same id in every checkpoint
BEST = {"val/loss": "min", "val/accuracy": "max"}  # run summary: {"min"/"max": best, "last": latest} of these


class LoggingWarning(UserWarning):
    """A logger failed to start or to log; training continues."""


def _first_line(error: BaseException) -> str:
    where = failed_file(error) if disk_full(error) else None
    if where:  # a full disk under W&B's files (media written by the client itself): the file and the disk
        return f"cannot write {where}: {write_error(error, where)}"
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def has_credentials(host: str) -> bool:
    """Whether W&B credentials are configured for `host` (only their presence is checked)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    try:
        return netrc.netrc(os.environ.get("NETRC") or None).authenticators(urlparse(host).hostname or "") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def choose_mode(offline: bool = False) -> tuple[str, str | None]:
    """("online" | "offline" | "disabled", why offline)."""
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if offline:
        return "offline", "offline=true"
    if env in ("offline", "dryrun"):
        return "offline", f"WANDB_MODE={env}"
    if env == "disabled":
        return "disabled", None
    host = os.environ.get("WANDB_BASE_URL", DEFAULT_HOST)
    if not has_credentials(host):
        return "offline", "no W&B credentials: set WANDB_API_KEY or run `wandb login`"
    if not reachable(host):
        return "offline", f"{urlparse(host).hostname} cannot be reached"
    return "online", None


class AutoWandbLogger(WandbLogger):
    """WandbLogger that goes offline by itself without credentials or network and never stops training.

    Args:
        name: the run's display name (W&B picks one when None).
        save_dir: where `wandb/` goes (default: the trainer's default_root_dir, else the working directory).
        project: the W&B project.
        offline: always offline.
        kwargs: the rest of Lightning's WandbLogger / wandb.init arguments (entity, tags, group, id, ...).
    """

    def __init__(self, name: str | None = None, save_dir: str | None = None, project: str = "positional-artefacts",
                 offline: bool = False, **kwargs: Any) -> None:
        # LightningCLI resolves **kwargs down to wandb.init's signature and hands every one of them over, unset ones
        # as None: dropped here, so that Lightning's defaults (resume="allow") and the quiet offline start stand
        kwargs = {key: value for key, value in kwargs.items() if value is not None}
        super().__init__(name=name, save_dir=save_dir, project=project, **kwargs)
        self._force_offline = offline
        self._failed = False
        self._run_dir: Path | None = None  # where RUN_ID_FILE goes (keep_run)
        self.mode: str | None = None  # "online" / "offline" once started
        self.url: str | None = None

    @property
    def run_id(self) -> str | None:
        """The W&B run's id: the started run's, else the one it will resume (kept or given), else None."""
        return self._wandb_init.get("id")

    def keep_run(self, run_dir: str | os.PathLike, resumed: str | None) -> None:
        """Keep this training run's W&B run: its id written to `run_dir`/RUN_ID_FILE when it starts, and `resumed` (the
        id kept by the run being resumed, or None for a fresh start) continued, unless the user gave an id."""
        self._run_dir = Path(run_dir)
        if resumed and not self._wandb_init.get("id") and self._experiment is None:
            self._wandb_init["id"] = self._id = resumed
            self._wandb_init["resume"] = "allow"

    def offline_dirs(self) -> list[Path]:
        """This run's offline directories (one per start: the first and each resume), oldest first."""
        if self.run_id is None or self._wandb_init.get("dir") is None:
            return []
        return sorted((Path(self._wandb_init["dir"]) / "wandb").glob(f"offline-run-*-{self.run_id}*"))

    def sync_command(self) -> str | None:
        """The command that uploads every offline part of this run (None unless it ran offline)."""
        if self.mode != "offline" or self._wandb_init.get("dir") is None:
            return None
        return f"wandb sync {Path(self._wandb_init['dir']) / 'wandb'}/offline-run-*-{self.run_id}*"

    def use_dir(self, directory: str | os.PathLike, job_type: str | None = None) -> None:
        """Set save_dir unless one was given, and name the run after `directory` (its last two parts: `pretrain/tiny`)
        and its `job_type` (pretrain, finetune, probe, validate) unless the user named them, before the run starts."""
        if self._experiment is not None:
            return
        if self._save_dir is None:
            self._save_dir = self._wandb_init["dir"] = os.fspath(directory)
        if not self._wandb_init.get("name"):
            self._name = self._wandb_init["name"] = run_name(directory)
        if job_type and not self._wandb_init.get("job_type"):
            self._wandb_init["job_type"] = job_type

    @property
    @rank_zero_experiment
    def experiment(self):
        if self._experiment is None and not self._failed:
            self._experiment = self._start()
        return self._experiment if self._experiment is not None else DummyExperiment()

    def _start(self):
        import wandb

        mode, reason = choose_mode(self._force_offline)
        init = {key: value for key, value in self._wandb_init.items() if value is not None or key != "anonymous"}
        mode = init.pop("mode", None) or mode
        init.update(grouping(init))
        if init.get("dir"):
            Path(init["dir"]).mkdir(parents=True, exist_ok=True)
        if wandb.run is not None:
            return wandb.run
        attempts = [(mode, reason)] + ([("offline", "W&B did not start online")] if mode == "online" else [])
        for attempt, why in attempts:
            try:
                quiet = {"settings": wandb.Settings(silent=True)} if attempt == "offline" and "settings" not in init else {}
                run = wandb.init(**init, **quiet, mode=attempt)  # offline: the one line below replaces W&B's banner
            except Exception as error:  # wandb raises many types (CommError, UsageError, timeouts)
                warnings.warn(f"W&B could not start {attempt} ({_first_line(error)})", LoggingWarning, stacklevel=2)
                continue
            self._wandb_init["id"] = run.id  # a later re-start (after finish) resumes this run
            self.mode, self.url = attempt, getattr(run, "url", None) if attempt == "online" else None
            self._write_run_id(run.id)
            if hasattr(run, "define_metric"):
                run.define_metric(STEP_METRIC)
                run.define_metric("*", step_metric=STEP_METRIC, step_sync=True)
                for key, best in BEST.items():  # the summary keeps the best value beside the last
                    run.define_metric(key, step_metric=STEP_METRIC, step_sync=True, summary=f"{best},last")
            if attempt == "offline":
                directory = Path(run.dir).parent
                parts = len(self.offline_dirs())
                kept = f"part {parts} of run {run.id} is kept in {directory}" if parts > 1 else \
                    f"the run is kept in {directory}"
                print(f"W&B: offline ({why}); {kept}; upload it later with: {self.sync_command()}", file=sys.stderr,
                      flush=True)
            return run
        self._failed = True
        warnings.warn("W&B is off for this run: training continues without it", LoggingWarning, stacklevel=2)
        return None

    def _write_run_id(self, run_id: str) -> None:
        if self._run_dir is None:
            return
        try:
            with atomic_file(self._run_dir / RUN_ID_FILE) as handle:
                handle.write(f"{run_id}\n".encode())
        except OSError as error:  # the checkpoints keep it too
            warnings.warn(f"cannot keep the W&B run id in {self._run_dir} ({_first_line(error)})", LoggingWarning,
                          stacklevel=3)

    def _guard(self, call, *args) -> None:
        if self._failed:
            return
        try:
            call(*args)
        except Exception as error:  # anything from the W&B client: never stop training for it
            self._failed = True
            warnings.warn(f"W&B failed mid-run ({_first_line(error)}); training continues without W&B logging",
                          LoggingWarning, stacklevel=3)

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self._guard(super().log_metrics, metrics, step)

    @rank_zero_only
    def log_hyperparams(self, params) -> None:
        self._guard(super().log_hyperparams, params)

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self._guard(super().finalize, status)
        run, self._experiment = self._experiment, None
        if run is not None and not isinstance(run, DummyExperiment):
            try:
                run.finish(exit_code=0 if status == "success" else 1)
            except Exception as error:  # the data is on disk already; finishing is best effort
                warnings.warn(f"W&B did not finish cleanly ({_first_line(error)})", LoggingWarning, stacklevel=2)


def grouping(init: Mapping[str, Any]) -> dict:
    """The run's group and tags from WANDB_RUN_GROUP / WANDB_TAGS (comma-separated) where `init` sets none: handed
    to wandb.init itself, as W&B reads its variables once per process (study.py sets them for each arm it trains)."""
    found = {}
    if not init.get("group") and os.environ.get("WANDB_RUN_GROUP"):
        found["group"] = os.environ["WANDB_RUN_GROUP"]
    if not init.get("tags") and os.environ.get("WANDB_TAGS"):
        found["tags"] = [tag for tag in os.environ["WANDB_TAGS"].split(",") if tag]
    return found


def run_name(directory: str | os.PathLike) -> str:
    """A W&B run's default name: the run directory's last two parts (`runs/pretrain/tiny` -> `pretrain/tiny`), so
    that arms and seeds read apart in the workspace (W&B would pick a random name)."""
    parts = Path(os.path.abspath(directory)).parts[1:]
    return "/".join(parts[-2:]) or "run"


def use_root_dir(trainer, job_type: str | None = None) -> None:
    """Point every AutoWandbLogger without a save_dir at the trainer's default_root_dir, naming its run after it and
    giving it `job_type`, unless the user set them (--trainer.logger.init_args.name / job_type)."""
    for logger in trainer.loggers:
        if isinstance(logger, AutoWandbLogger):
            logger.use_dir(trainer.default_root_dir, job_type)


def kept_run_id(checkpoint: str | os.PathLike | None, run_dir: str | os.PathLike) -> str | None:
    """The W&B run id a resume from `checkpoint` continues: the checkpoint's own, else the one kept in `run_dir`
    (a checkpoint written before ids were kept); None for a fresh start (`checkpoint` None)."""
    if checkpoint is None:
        return None
    from core.safe_load import load_weights_only

    kept = load_weights_only(checkpoint, mmap=True).get(CHECKPOINT_KEY)
    if kept:
        return str(kept)
    path = Path(run_dir) / RUN_ID_FILE
    return path.read_text(encoding="utf-8").strip() or None if path.is_file() else None


def keep_runs(trainer, checkpoint: str | os.PathLike | None) -> None:
    """One W&B run per training run: every AutoWandbLogger of `trainer` keeps its run id in default_root_dir and in
    the checkpoints (a KeepRunId callback), and a resume from `checkpoint` continues the run it kept."""
    loggers = [logger for logger in trainer.loggers if isinstance(logger, AutoWandbLogger)]
    if not loggers:
        return
    resumed = kept_run_id(checkpoint, trainer.default_root_dir)
    for logger in loggers:
        logger.keep_run(trainer.default_root_dir, resumed)
    if not any(isinstance(callback, KeepRunId) for callback in trainer.callbacks):
        trainer.callbacks.append(KeepRunId())


class KeepRunId(Callback):
    """Writes the W&B run id into every checkpoint (CHECKPOINT_KEY), so that a resume from it continues that run."""

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, AutoWandbLogger) and logger.run_id:
                checkpoint[CHECKPOINT_KEY] = logger.run_id


# ---- helpers for callbacks: each logger gets what it supports ----

def real_loggers(trainer) -> list:
    """The trainer's loggers, without fast_dev_run's DummyLogger and without loggers that failed before."""
    return [logger for logger in trainer.loggers
            if not isinstance(logger, DummyLogger) and not getattr(logger, "_posart_failed", False)
            and not getattr(logger, "_failed", False)]


def _safely(logger, what: str, call, *args, **kwargs) -> None:
    try:
        call(*args, **kwargs)
    except Exception as error:  # a logger must never stop training
        logger._posart_failed = True
        warnings.warn(f"{type(logger).__name__} failed to log {what} ({_first_line(error)}); training continues "
                      "without it", LoggingWarning, stacklevel=3)


@rank_zero_only
def log_scalars(trainer, metrics: Mapping[str, float], step: int, lists: Mapping[str, list] | None = None) -> None:
    """Plain float scalars to every logger, at the trainer's global step `step`; `lists` (e.g. outlier dims) to W&B
    only, in the same history row (the run summary keeps the latest of each), as CSV and TensorBoard take numbers
    only."""
    for logger in real_loggers(trainer):
        values = {**metrics, **lists} if lists and isinstance(logger, WandbLogger) else dict(metrics)
        _safely(logger, "metrics", logger.log_metrics, values, step)


@rank_zero_only
def log_settings(trainer, values: Mapping[str, Any]) -> None:
    """Settings a callback resolves when it starts (which special tokens it counts) as every logger's hyperparameters:
    W&B's run config, CSV's hparams.yaml, TensorBoard's hparams."""
    for logger in real_loggers(trainer):
        _safely(logger, "settings", logger.log_hyperparams, dict(values))


def image_loggers(trainer) -> list:
    """The real loggers that keep images: TensorBoard, and W&B unless its run is disabled (WANDB_MODE=disabled keeps
    nothing: a figure drawn and encoded for it is work thrown away)."""
    return [logger for logger in real_loggers(trainer) if isinstance(logger, TensorBoardLogger) or
            isinstance(logger, WandbLogger) and getattr(logger.experiment, "disabled", False) is not True]


def wants_images(trainer) -> bool:
    return bool(image_loggers(trainer))


@rank_zero_only
def log_figure(trainer, key: str, fig, step: int) -> None:
    """A figure to W&B (image) and TensorBoard (add_image); closed in any case."""
    image = figure_array(fig)
    for logger in real_loggers(trainer):
        if isinstance(logger, WandbLogger):
            _safely(logger, key, logger.log_image, key, [image], step=step)
        elif isinstance(logger, TensorBoardLogger):
            _safely(logger, key, _tensorboard, logger, "add_image", key, image, step, dataformats="HWC")


@rank_zero_only
def log_table(trainer, key: str, columns: Sequence[str], rows: Sequence[Sequence], step: int) -> None:
    """A table to W&B (wandb.Table) and TensorBoard (markdown text)."""
    for logger in real_loggers(trainer):
        if isinstance(logger, WandbLogger):
            _safely(logger, key, logger.log_table, key, list(columns), [list(r) for r in rows], step=step)
        elif isinstance(logger, TensorBoardLogger):
            text = "\n".join(["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
                             + ["| " + " | ".join(map(str, row)) + " |" for row in rows])
            _safely(logger, key, _tensorboard, logger, "add_text", key, text, step)


@rank_zero_only
def log_summary(trainer, values: Mapping[str, Any]) -> None:
    """Run summary entries (lists allowed) in W&B: the latest values, shown on the run's overview."""
    for logger in real_loggers(trainer):
        if isinstance(logger, WandbLogger):
            _safely(logger, "summary", _update_summary, logger, values)


@rank_zero_only
def define_step_metrics(trainer, patterns: Sequence[str]) -> None:
    """W&B charts of keys matching `patterns` (globs) against the trainer's global step."""
    for logger in real_loggers(trainer):
        if isinstance(logger, WandbLogger):
            for pattern in patterns:
                _safely(logger, "define_metric", _define_metric, logger, pattern)


def _tensorboard(logger, method: str, *args, **kwargs) -> None:
    getattr(logger.experiment, method)(*args, **kwargs)


def _update_summary(logger, values: Mapping[str, Any]) -> None:
    logger.experiment.summary.update(dict(values))


def _define_metric(logger, pattern: str) -> None:
    logger.experiment.define_metric(pattern, step_metric=STEP_METRIC, step_sync=True)
