"""MLM pretraining of RoBERTa with or without positional embeddings (LightningCLI).

    python train.py fit --config configs/pretrain/tiny.yaml                                  # CPU, minutes
    python train.py fit --config configs/pretrain/tiny.yaml --model.position_embeddings false \\
        --trainer.default_root_dir runs/pretrain/tiny-nope
    python train.py fit --config configs/pretrain/roberta-base.yaml --trainer.devices 4      # the paper's Table 4
    python train.py fit --config configs/pretrain/roberta-base.yaml --config configs/pretrain/roberta-base-nope.yaml  # no PE
    python train.py fit --config configs/pretrain/roberta-base.yaml --ckpt_path last         # exact resume
    sbatch scripts/slurm_pretrain.sh configs/pretrain/roberta-base.yaml                      # multi-node

Checkpoints go to <default_root_dir>/checkpoints (last.ckpt every --checkpoint.every_n_train_steps and at the end),
written atomically (a kill mid-write keeps the previous one). SIGTERM (SLURM pre-emption, scancel, a time limit) saves
last.ckpt at the next optimizer step and exits with status 143; rerun with --ckpt_path last to resume exactly.
The model is exported to <default_root_dir>/export (AutoModelForMaskedLM.from_pretrained and analyze.py read it).
The global batch (--data.global_batch_size) stays fixed: gradient accumulation is derived from devices × nodes,
and --ckpt_path last resumes exactly on another device or node count too (a streaming run: on its own only).
Errors in the input are one line on stderr and exit status 2.

Fine-tuning (a config whose model is lightning_modules.finetune.FineTuneModule, configs/finetune/*.yaml) runs through
the same checkpoints, lock, logger and resume, and writes <default_root_dir>/export and finetune.json:
    python train.py fit --config configs/finetune/classify.yaml --model.encoder E --data.source F
    python train.py fit --config configs/finetune/sst2.yaml --model.regularizer istar --model.reg_weight -1
"""

from __future__ import annotations

# ruff: noqa: E402  (`train.py --help` is answered before the heavy imports below)
import sys

from core.signals import Interrupted, exit_status, first_process, quiet_start, stop_on_signals
from core.usage import help_first

OVERRIDES = [
    ("--config FILE", "configs/pretrain/*.yaml, configs/finetune/*.yaml; several merge in order"),
    ("--trainer.default_root_dir DIR", "the run directory: checkpoints/, export/, wandb/ (one live run each)"),
    ("--ckpt_path last", "resume the run in default_root_dir exactly (or re-export a finished one)"),
    ("--model.position_embeddings false", "pretrain without positional embeddings (Table 4's no-PE arm)"),
    ("--trainer.max_steps N", "optimizer steps (the schedule follows)"),
    ("--trainer.devices N --trainer.num_nodes M", "DDP; the global batch stays --data.global_batch_size"),
    ("--data.corpus SOURCE", "a text file, csv/tsv/jsonl, a datasets directory or NAME[:CONFIG][:SPLIT]"),
    ("--data.batch_size N", "sequences per device and micro-batch (accumulation makes up the global batch)"),
    ("--model.encoder ENCODER", "fine-tuning: a hub id (org/name@REVISION pins one), a local directory or this "
                                "project's export"),
    ("--trainer.logger false", "no W&B (it is offline by itself without credentials or network)"),
    ("--seed_everything N", "the run's one seed (default 0)"),
]
if __name__ == "__main__":
    help_first("train.py", __doc__, OVERRIDES)
    quiet_start("train.py")  # a Ctrl-C during the imports below: one line, no traceback

import json
import signal
import traceback
from operator import itemgetter
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from jsonargparse import lazy_instance
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from pytorch_lightning.utilities.exceptions import SIGTERMException

from callbacks.checkpointing import (
    LAST,
    PREEMPTED_EXIT,
    PREVIOUS,
    AtomicCheckpointIO,
    LoggingStep,
    Preempted,
    PretrainCheckpoint,
    check_fits,
    check_fresh_start,
    check_resume,
    check_resume_directory,
    checkpoint_dir,
    hpc_checkpoint,
    last_checkpoint,
    resume_target,
)
from callbacks.live import check_callbacks
from callbacks.summary import RunSummary, run_summary, summary_lines
from callbacks.wandb_logging import AutoWandbLogger, keep_runs, use_root_dir
from core.cli import HeldLogs, ProjectCLI
from core.errors import UserError, plain_warnings
from core.wording import plural
from datamodules.finetune import FineTuneDataModule
from datamodules.mlm import MLMDataModule, check_block_length
from lightning_modules.checkpoints import read_checkpoint
from lightning_modules.finetune import REPORT, FineTuneModule
from lightning_modules.mlm import MLMModule
from lightning_modules.training import check_warmup, schedule_end

TRAINER_DEFAULTS = {"use_distributed_sampler": False,  # the datamodule shards batches itself (same global batch)
                    "logger": lazy_instance(AutoWandbLogger)}  # W&B; offline by itself without credentials or network


class TrainCLI(ProjectCLI):
    """What pretraining and fine-tuning share: atomic checkpoints (last.ckpt replaced in place, the one before kept as
    previous.ckpt, never versioned as last-v1.ckpt), the run directory's lock, the resume target and checks."""

    program = "train.py"
    checkpoint_io_class = AtomicCheckpointIO
    apply_checkpoint_hparams = False  # the config stays authoritative: before_fit refuses a checkpoint that differs
    kind = "mlm"  # the checkpoints' kind (lightning_modules/checkpoints.py)
    job_type = "pretrain"  # the W&B run's job type

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(PretrainCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.save_top_k": 0,
                             "checkpoint.every_n_train_steps": 1000, "checkpoint.enable_version_counter": False})
        parser.link_arguments("trainer.default_root_dir", "checkpoint.dirpath", compute_fn=checkpoint_dir)

    def check_settings(self, accumulation: int) -> None:
        """The checks both share that read no data and write nothing (study.py checks its arms with them too)."""
        model, data, trainer = self.model, self.datamodule, self.trainer
        if trainer.fast_dev_run:  # a smoke test: the schedule's end, no warm-up warning
            schedule_end(model.hparams.decay_steps, trainer.max_steps)
        else:
            check_warmup(model.hparams.warmup_steps, model.hparams.decay_steps, trainer.max_steps)
        data.check_trainer(trainer, apply=False)
        check_static_graph(trainer, accumulation)
        check_callbacks(trainer, model)  # live-statistics callbacks: hidden states capturable, layers valid
        if isinstance(trainer.checkpoint_callback, PretrainCheckpoint):
            trainer.checkpoint_callback.check_settings()

    def check_run(self, accumulation: int) -> None:
        """The checks both share, then the run directory's lock and the resume target (weights-only; previous.ckpt
        when last.ckpt is torn; a fresh start never overwrites an earlier run)."""
        model, data, trainer = self.model, self.datamodule, self.trainer
        self.check_settings(accumulation)
        use_root_dir(trainer, self.job_type)  # W&B's files go under default_root_dir unless its save_dir is set
        self.lock_run()  # rank 0: one live run per directory
        arguments = self.config_init[self.subcommand]
        ckpt_path = arguments.get("ckpt_path")
        folder = Path(trainer.checkpoint_callback.dirpath)
        path = self.checkpoint_path(ckpt_path, "resume a run")
        if path is not None:
            # a resume writes into default_root_dir: never over another run (a path of another run, a link to one)
            check_resume_directory(path, ckpt_path, trainer.default_root_dir, folder)
            path = resume_target(path, self.kind)  # a torn last.ckpt: previous.ckpt, saying so
            check_resume(path, model, data, trainer.world_size, self.kind, trainer.max_steps)
            arguments["ckpt_path"] = str(path)
        elif ckpt_path in (None, "last"):
            check_fresh_start(trainer.default_root_dir)
            arguments["ckpt_path"] = None
        keep_runs(trainer, path)  # one W&B run per training run: a resume continues the one it kept
        trainer.callbacks.insert(0, LoggingStep())  # a resume from step 0 logs every step at its own step

    def checkpoint_path(self, ckpt_path: str | None, purpose: str) -> Path | None:
        """The file --ckpt_path names: `last` (the run's last.ckpt, or last.ckpt to fall back from when only
        previous.ckpt is left; None when the run has neither), `hpc`, or a file; None without --ckpt_path."""
        folder = Path(self.trainer.checkpoint_callback.dirpath)
        if ckpt_path == "last":
            return last_checkpoint(folder) or (folder / LAST if (folder / PREVIOUS).is_file() else None)
        if ckpt_path == "hpc":
            return hpc_checkpoint(self.trainer.default_root_dir)
        if ckpt_path in ("best", "registry"):
            raise UserError(f"--ckpt_path {ckpt_path} cannot {purpose}: give last, hpc or a checkpoint file")
        if ckpt_path and not Path(ckpt_path).is_file():
            raise UserError(f"checkpoint not found: {ckpt_path}")
        return Path(ckpt_path) if ckpt_path else None

    def before_validate(self) -> None:
        """`train.py validate --ckpt_path last|hpc|FILE`: fit's validation (its val/ keys and the live statistics'
        val_ ones) of a checkpoint's weights, nothing trained or saved. The checkpoint is read weights-only and must
        fit the config as a resume must; the values are logged at the checkpoint's step, to a W&B run of their own
        under default_root_dir: the training run's W&B run, its kept id and its config.yaml stay as they are."""
        model, data, trainer = self.model, self.datamodule, self.trainer
        self.check_data()
        data.check_trainer(trainer, apply=False)
        check_callbacks(trainer, model)
        arguments = self.config_init[self.subcommand]
        if not arguments.get("ckpt_path"):
            raise UserError("train.py validate needs the weights to validate: --ckpt_path last (the run in "
                            "--trainer.default_root_dir), hpc or a checkpoint file")
        path = self.checkpoint_path(arguments["ckpt_path"], "be validated")
        if path is None:
            raise UserError(f"--ckpt_path last: no checkpoint in {trainer.checkpoint_callback.dirpath} to validate")
        use_root_dir(trainer, "validate")  # W&B's files under default_root_dir, a run of their own (no kept id)
        self.lock_run()  # rank 0: one live run per directory; checkpoints read weights-only
        path = resume_target(path, self.kind)  # a torn last.ckpt: previous.ckpt, saying so
        checkpoint = read_checkpoint(path, self.kind)
        check_fits(checkpoint, path, model, data)
        arguments["ckpt_path"] = str(path)
        # logged at the number of updates the weights had (Lightning's validate leaves the loops at 0)
        trainer.fit_loop.epoch_loop._batches_that_stepped = int(checkpoint.get("global_step", 0))

    def before_test(self) -> None:
        raise UserError(self.no_test)

    def before_predict(self) -> None:
        raise UserError("train.py predict is not supported: the export (<default_root_dir>/export) loads in "
                        "transformers, and analyze.py reads it")

    def _run_subcommand(self, subcommand: str) -> None:
        try:
            super()._run_subcommand(subcommand)
        except BaseException as error:
            launcher = getattr(self.trainer.strategy, "launcher", None)
            # workers Lightning started (not torchrun's); after a SIGTERM they stop by themselves, like this rank
            if isinstance(launcher, _SubprocessScriptLauncher) and not isinstance(error, Preempted):
                launcher.kill(getattr(signal, "SIGKILL", signal.SIGTERM))
            raise


class PretrainCLI(TrainCLI):
    def add_arguments_to_parser(self, parser) -> None:
        super().add_arguments_to_parser(parser)
        parser.link_arguments("data.model_vocab_size", "model.vocab_size", apply_on="instantiate")
        parser.link_arguments("model.objective", "data.objective")  # causal arms: unmasked blocks, next tokens
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):  # the tokenizer's (1/0/2 for the trained BPE)
            parser.link_arguments("data.model_special_ids", f"model.{key}", compute_fn=itemgetter(key),
                                  apply_on="instantiate")

    def check_arguments(self) -> None:
        """What before_fit checks without reading data or writing anything (study.py's arms, built with run=False)."""
        check_block_length(self.datamodule.hparams.block_length, self.model)
        self.check_settings(self.datamodule.accumulation(self.trainer.world_size))

    no_test = ("train.py test: MLM pretraining has no test set; train.py validate --ckpt_path last gives a "
               "checkpoint's validation loss and perplexity")

    def check_data(self) -> None:
        """The block length against the model's positions, a cached tokenizer's ids and block count (on every rank;
        prepare_data checks what it makes)."""
        check_block_length(self.datamodule.hparams.block_length, self.model)
        self.datamodule.check_cache(self.model.vocab_size, self.trainer.world_size)

    def before_fit(self) -> None:
        """Cheap checks before any process group, cache or file: global batch, block length, the schedule (a warning
        for a warm-up that does not end before it), a cached tokenizer's ids and block count; then the run
        directory's lock and the resume target. A tokenizer or blocks not cached yet are checked by prepare_data once
        made, which Lightning runs before its loggers and callbacks write anything."""
        self.check_data()
        self.check_run(self.datamodule.accumulation(self.trainer.world_size))
        add_run_summary(self.trainer)  # the last validation loss, for the summary after the fit

    def before_validate(self) -> None:
        super().before_validate()
        add_run_summary(self.trainer)  # its state in the checkpoint has its callback (as a resume's)

    def after_fit(self) -> None:
        """Where the export, checkpoints and W&B run are, the last validation loss and outlier verdict."""
        if self.trainer.is_global_zero:
            print("\n" + "\n".join(summary_lines(run_summary(self.trainer))), flush=True)


class FineTuneCLI(TrainCLI):
    """train.py for configs whose model is a FineTuneModule: the data are read (and checked) first, their classes
    size the model's head."""

    kind = "finetune"
    job_type = "finetune"

    def add_arguments_to_parser(self, parser) -> None:
        super().add_arguments_to_parser(parser)
        parser.link_arguments("data.label_names", "model.init_args.classes", apply_on="instantiate")

    no_test = ("train.py test: fine-tuning tests its final weights at the end of fit (finetune.json); train.py "
               "validate --ckpt_path last gives a checkpoint's validation loss and accuracy")

    def check_data(self) -> None:
        self.datamodule.check_max_length(self.model.max_length)

    def before_fit(self) -> None:
        self.check_data()
        self.datamodule.check_examples(self.trainer.world_size)
        self.check_run(self.datamodule.accumulation(self.trainer.world_size))

    def after_fit(self) -> None:
        if self.trainer.is_global_zero:
            report = Path(self.trainer.default_root_dir) / REPORT
            print_summary(json.loads(report.read_text()), report)


def add_run_summary(trainer) -> None:
    """A RunSummary, before the checkpoint callbacks: a validation's loss is in the checkpoint saved after it
    (PretrainCheckpoint saves the step's checkpoint again once the validation that follows it ends)."""
    checkpoints = [i for i, callback in enumerate(trainer.callbacks) if isinstance(callback, ModelCheckpoint)]
    trainer.callbacks.insert(checkpoints[0] if checkpoints else len(trainer.callbacks), RunSummary())


def print_summary(report: dict, path: Path) -> None:
    weight = f" (λ = {report['reg_weight']:g}, layers {report['reg_layers']})" if report["regularizer"] != "none" else ""
    print(f"\nfine-tuned {report['encoder']} for {plural(report['steps'], 'step')}, regularizer {report['regularizer']}{weight}: "
          f"test accuracy {report['accuracy']:.3f} (majority {report['majority']['test_accuracy']:.3f}), "
          f"validation {report['val_accuracy']:.3f}")
    print("IsoScore* of the test tokens by layer: " + ", ".join(f"{row['layer']}: {row['isoscore_star']:.3f}"
                                                               for row in report["layers"]))
    print(f"wrote {path} and {path.parent / 'export'}")


def check_arguments(args: list[str]) -> None:
    """train.py's own checks of pretraining arguments (those after `fit`), nothing run or written: its parser, each
    class's checks as it is built, the trainer's options, and what before_fit checks before it reads data. study.py
    checks every arm with it before it trains any."""
    held = HeldLogs()  # Lightning's banner of a trainer that is only built: not printed
    try:
        cli = PretrainCLI(MLMModule, MLMDataModule, seed_everything_default=0, trainer_defaults=TRAINER_DEFAULTS,
                          args=args, run=False)
        cli.check_arguments()
    finally:
        held.release(emit=False)


def model_class_path(argv: list[str]) -> str | None:
    """The model's class_path the arguments give (the last --config file naming one, or --model /
    --model.class_path), without parsing them: which of train.py's programs they are for."""
    found = None
    for flag, value in zip(argv, [*argv[1:], None]):
        flag = str(flag)
        if flag in ("--config", "-c") or flag.startswith("--config="):
            path = flag.split("=", 1)[1] if "=" in flag else value
            try:
                config = yaml.safe_load(Path(str(path)).read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, yaml.YAMLError):
                continue  # jsonargparse names what is wrong with it
            model = config.get("model") if isinstance(config, dict) else None
            if isinstance(model, dict) and isinstance(model.get("class_path"), str):
                found = model["class_path"]
        elif flag in ("--model", "--model.class_path") and value is not None:
            found = str(value)
        elif flag.startswith(("--model=", "--model.class_path=")):
            found = flag.split("=", 1)[1]
    return found


def check_static_graph(trainer, accumulation: int) -> None:
    """DDP's static_graph breaks under gradient accumulation (no_sync): an internal assert on the first backward, or,
    patched past it, gradients no longer all-reduced (pytorch/pytorch#143580). Refused before anything runs."""
    if accumulation > 1 and getattr(trainer.strategy, "_ddp_kwargs", {}).get("static_graph"):
        raise UserError(f"DDP static_graph does not work with gradient accumulation (here {accumulation} micro-batches "
                        "a step; pytorch/pytorch#143580): set --data.batch_size to the global batch / (devices × "
                        "nodes), or --trainer.strategy.init_args.static_graph false")


def cli_main(args: list[str] | None = None, keep_process_group: bool = False) -> int:
    """train.py; `keep_process_group`: a run that ends well leaves its DDP process group for the next one (study.py's
    arms under torchrun: a group destroyed and made again on torchrun's store can read the last group's stale
    addresses, and the second arm's ranks fail to connect). A failed run always leaves it, so the other ranks stop."""
    code = 1
    try:
        code = _cli_main(args)
    finally:
        if dist.is_available() and dist.is_initialized() and not (keep_process_group and code == 0):
            dist.destroy_process_group()
    return code


def _cli_main(args: list[str] | None = None) -> int:
    plain_warnings()
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")
    argv = [str(a) for a in (sys.argv[1:] if args is None else args)] if not isinstance(args, dict) else []
    try:
        with stop_on_signals(signal.SIGINT):  # Ctrl-C: stop at once (SIGTERM: PretrainCheckpoint saves first)
            if (model_class_path(argv) or "").rsplit(".", 1)[-1] == FineTuneModule.__name__:
                FineTuneCLI(FineTuneModule, FineTuneDataModule, subclass_mode_model=True, subclass_mode_data=True,
                            seed_everything_default=0, trainer_defaults=TRAINER_DEFAULTS,
                            save_config_kwargs={"overwrite": True}, args=args)
            else:
                PretrainCLI(MLMModule, MLMDataModule, seed_everything_default=0, trainer_defaults=TRAINER_DEFAULTS,
                            save_config_kwargs={"overwrite": True}, args=args)
    except UserError as error:
        print(f"train.py: error: {error}", file=sys.stderr)
        return 2
    except Interrupted as stop:  # the run's checkpoint callback adds where it stopped and what to resume from
        if first_process():
            print(f"train.py: {stop}{stop.detail} (exit status {stop.status})", file=sys.stderr)
        return stop.status
    except Preempted as stop:
        if stop.rank == 0:
            saved = f"saved {stop.path}" if stop.path else "no checkpoint saved (--checkpoint.save_last false)"
            print(f"train.py: stopped by SIGTERM after step {stop.step}: {saved}; rerun with --ckpt_path last to "
                  f"resume (exit status {PREEMPTED_EXIT})", file=sys.stderr)
        return PREEMPTED_EXIT
    except SIGTERMException:  # a SIGTERM during the set-up, stopped by Lightning inside an accumulation window
        print("train.py: stopped by SIGTERM before a whole optimizer step; last.ckpt is unchanged; rerun with "
              f"--ckpt_path last to resume (exit status {PREEMPTED_EXIT})", file=sys.stderr)
        return PREEMPTED_EXIT
    except Exception:
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            raise
        # The other ranks stop as soon as this one leaves the process group (below), and Lightning's launcher may
        # kill this process then: say which rank failed and why first.
        print(f"train.py: error on rank {dist.get_rank()} of {dist.get_world_size()}:", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    return 0


def console() -> int | None:
    """train.py and posart-train (setup.cfg's console script): a run Ctrl-C stopped ends by SIGINT (core.signals)."""
    return exit_status(cli_main())


if __name__ == "__main__":
    sys.exit(console())
