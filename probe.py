"""Position probes and frozen-encoder sentence classifiers, every layer in one run (LightningCLI).

    python probe.py fit --config configs/probe/position.yaml --data.source core/corpus/austen.txt  # MiniLM, bundled corpus
    python probe.py fit --config configs/probe/position.yaml --model.encoder bert-base-uncased   # SST-2 (the paper's)
    python probe.py fit --config configs/probe/position.yaml --model.encoder bert-base-uncased \\
        --data.source core/corpus/austen.txt --data.max_length 128 --trainer.default_root_dir runs/probe/bert
    python probe.py fit --config configs/probe/sst2.yaml --model.encoder roberta-base --trainer.default_root_dir runs/sst2
    python probe.py fit --config configs/probe/classify.yaml --data.source reviews.csv --data.label_column stars

`fit` reads the data, runs the encoder (and a random-init twin, the baseline) once over every sentence, trains the
probes of all layers together, then tests them and writes the report into --trainer.default_root_dir
(position_probe.json or classifier.json, arrays and figures; see docs/probes.md). Input errors are one line on
stderr and exit status 2, with no report written. --seed_everything (default 0) seeds splits, baselines and probes.
"""

from __future__ import annotations

# ruff: noqa: E402  (`probe.py --help` is answered before the heavy imports below)
import sys

from core.signals import STOPS, Interrupted, exit_status, first_process, quiet_start, stop_on_signals
from core.usage import help_first

OVERRIDES = [
    ("--config FILE", "configs/probe/position.yaml (§3), sst2.yaml, imdb.yaml, sst5.yaml, classify.yaml"),
    ("--model.encoder ENCODER", "a hub id (org/name@REVISION pins one), a local directory or this project's export "
                                "(default: packaged MiniLM)"),
    ("--data.source SOURCE", "a text file, csv/tsv/jsonl, a datasets directory or NAME[:CONFIG][:SPLIT]"),
    ("--data.max_sentences N", "a seeded sample of N sentences per split (0: all)"),
    ("--data.max_length N", "tokens per sentence"),
    ("--data.exclude_special true", "leave special tokens out ([CLS], <s>: they give their position away)"),
    ("--trainer.default_root_dir DIR", "where the report, arrays and figures go"),
    ("--trainer.max_epochs N", "probe epochs (the paper: 10)"),
    ("--seed_everything N", "seeds splits, baselines and probes (default 0)"),
    ("--model.help lightning_modules.probes.PositionProbe", "the position probe's options, each with its help text"),
    ("--model.help lightning_modules.probes.SentenceClassifier", "the sentence classifiers' options"),
    ("--data.help datamodules.probing.PositionDataModule", "the probe data's options (ClassificationDataModule: the "
                                                          "classifiers' data)"),
]
if __name__ == "__main__":
    help_first("probe.py", __doc__, OVERRIDES)
    quiet_start("probe.py")  # a Ctrl-C during the imports below: one line, no traceback

import warnings
from pathlib import Path

import torch.distributed as dist
from pytorch_lightning import LightningDataModule, LightningModule

from callbacks.live import check_callbacks
from callbacks.wandb_logging import keep_runs, use_root_dir
from core.cli import ProjectCLI
from core.errors import UserError, plain_warnings

warnings.filterwarnings("ignore", ".*does not have many workers.*")  # features are cached: workers would not help


class ProbeCLI(ProjectCLI):
    program = "probe.py"

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("model.init_args.encoder", "data.init_args.encoder")
        parser.link_arguments("model.init_args.allow_random_weights", "data.init_args.allow_random_weights")
        parser.link_arguments("seed_everything", "model.init_args.seed")
        parser.link_arguments("seed_everything", "data.init_args.seed")

    def before_fit(self) -> None:
        self.lock_run()  # rank 0: one live run per directory (a directory that cannot be written: one line)
        # the data read and encoded now (Lightning's prepare_data is then a no-op), the probes built and the live
        # callbacks checked: their refusals need the cached features, and Lightning starts its loggers (a W&B run)
        # before it sets the module and the callbacks up
        self.datamodule.trainer = self.trainer  # as Lightning attaches it: its device, world size, default_root_dir
        self.datamodule.prepare_data()
        self.model.attach(self.datamodule)
        check_callbacks(self.trainer, self.model, self.datamodule)
        use_root_dir(self.trainer, "probe")  # a W&B logger (--trainer.logger): its files and kept run id in the run directory,
        ckpt_path = self.config_init[self.subcommand].get("ckpt_path")  # one run, continued by a resume
        keep_runs(self.trainer, ckpt_path if ckpt_path and Path(ckpt_path).is_file() else None)

    def before_validate(self) -> None:
        raise UserError(self.fit_only())

    def before_test(self) -> None:
        raise UserError(self.fit_only())

    def before_predict(self) -> None:
        raise UserError(self.fit_only())

    def fit_only(self) -> str:
        """Without fit the probes are untrained (their weights are kept nowhere): their accuracies would be noise."""
        return (f"probe.py {self.subcommand} is not supported: the probes are trained, validated, tested and "
                "reported in one probe.py fit run (their weights are not kept): run probe.py fit")

    def after_fit(self) -> None:
        """Test the trained probes once, then write the report (rank zero) and print a summary."""
        self.trainer.test(self.model, datamodule=self.datamodule, verbose=False)
        if self.trainer.is_global_zero:
            report = self.model.write_outputs(self.trainer.default_root_dir)
            print_summary(report, self.trainer.default_root_dir)
        self.datamodule.close()


def print_summary(report: dict, output_dir) -> None:
    random = {row["layer"]: row["accuracy"] for row in report["baselines"].get("random_encoder", {}).get("layers", [])}
    clipped = "accuracy_clipped" in report["layers"][0]
    print(f"\n{'position probe' if not clipped else 'sentence classifier'}: {report['encoder']} "
          f"on {report['source']} (test accuracy; dims 0-indexed; special tokens {report['special_tokens']})")
    softdecay = "accuracy_softdecay" in report["layers"][0]
    control = "control_accuracy" in report["layers"][0]  # the control task (ours, on by default): its selectivity
    width = 10 if clipped else 15  # three dims of a 4-digit hidden size
    print(f"{'layer':>5}  {'accuracy':>8}  {'clipped' if clipped else 'top dims':>{width}}  {'random enc':>10}"
          + ("   softdecay" if softdecay else "") + ("     control  selectivity" if control else ""))
    for row in report["layers"]:
        middle = (f"{row['accuracy_clipped']:>10.3f}" if clipped and row["accuracy_clipped"] is not None
                  else f"{', '.join(map(str, row.get('top_contribution_dims', [])[:3])):>{width}}")
        base = f"{random[row['layer']]:>10.3f}" if row["layer"] in random else f"{'-':>10}"
        print(f"{row['layer']:>5}  {row['accuracy']:>8.3f}  {middle}  {base}"
              + (f"  {row['accuracy_softdecay']:>10.3f}" if softdecay else "")
              + (f"  {row['control_accuracy']:>10.3f}  {row['selectivity']:>+11.3f}" if control else ""))
    tied = [row["layer"] for row in report["layers"] if any(row.get("top_contribution_ties", [])[:3])]
    if tied and not clipped:
        print(f"tied contributions among the top dims of layers {', '.join(map(str, tied))}: ties broken by the lower "
              "dim (top_contribution_ranks, top_contribution_ties in position_probe.json)")
    print(f"majority baseline {report['baselines']['majority']:.3f}, chance {report['baselines']['chance']:.3f}")
    print(f"wrote the report to {output_dir}")
    if report.get("outlier_chance_warning"):  # the outlier detection could be chance (ours: metrics/outliers.py)
        print(f"warning: {report['outlier_chance_warning']}", file=sys.stderr)


def cli_main(args: list[str] | None = None, run: bool = True) -> ProbeCLI:
    """Run the CLI; a UserError prints one line and exits with status 2, a Ctrl-C or SIGTERM one line and 130 / 143
    (Lightning's own SIGTERM handling would end the run with status 0 and no report). run=False parses the arguments
    (no subcommand) and builds the model, data module and trainer without running anything."""
    plain_warnings()
    try:
        with stop_on_signals(*STOPS):
            return ProbeCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                            seed_everything_default=0, save_config_kwargs={"overwrite": True}, args=args, run=run)
    except UserError as error:
        print(f"probe.py: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except Interrupted as stop:
        if first_process():
            print(f"probe.py: {stop} (exit status {stop.status}); its report is written whole, at the end, or not at "
                  "all: rerun the same command to train the probes again", file=sys.stderr)
        raise SystemExit(stop.status) from None
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def main(args: list[str] | None = None) -> int:
    """0 when the run ends, the status of cli_main's SystemExit otherwise (2: an input error; 130 / 143: Ctrl-C,
    SIGTERM). cli_main itself returns its ProbeCLI, which a console script would print and exit 1 with."""
    try:
        cli_main(args)
    except SystemExit as stop:
        return stop.code
    return 0


def console() -> int | None:
    """probe.py and posart-probe (setup.cfg's console script): a run Ctrl-C stopped ends by SIGINT (core.signals)."""
    return exit_status(main())


if __name__ == "__main__":
    sys.exit(console())
