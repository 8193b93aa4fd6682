"""What train.py and probe.py share as LightningCLI programs: one-line parse errors, no banner before an error,
weights-only checkpoints, and the run directory's lock.

    class PretrainCLI(ProjectCLI):
        program = "train.py"
        def before_fit(self):
            ...                   # the run's own checks: nothing is written yet
            self.lock_run()       # then weights-only checkpoint IO and the lock (rank 0); Lightning's held lines
                                  # print once the data module is prepared and set up

    python train.py fit --config c.yaml      # c.yaml: `model: {hiden_size: 32}` →
    train.py: error: unknown option 'model.hiden_size' (did you mean 'model.hidden_size'?)
    python train.py fit --config c.yaml --trainer.callbacks[0].init_args.every_n_steps 5   # no index taken →
    train.py: error: --trainer.callbacks[0].init_args.every_n_steps: an option takes no index (...); the no-index form
    (the last callback) and docs/live-statistics.md's "Changing one callback's arguments" (any other one)

Lightning's banner ("GPU available ...", "Seed set to 0", its tips) is held back while the arguments are parsed and
checked and the data is prepared: it prints once they pass, and not at all when they do not, so an error is the only
line a bad input prints.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import logging
import os
import re
import sys
from pathlib import Path

from pytorch_lightning.callbacks import Callback
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from pytorch_lightning.plugins.io import TorchCheckpointIO

from core.errors import UserError
from core.lock import RunLock
from core.output import disk_full, failed_file, write_error
from core.quiet import quiet_trainer
from core.run_config import resolved_config
from core.safe_load import WeightsOnlyCheckpointIO, load_weights_only
from core.trainer_checks import check_trainer_settings, check_unique_callbacks, lightning_refusals

LIGHTNING_LOGGERS = ("pytorch_lightning", "lightning_fabric", "lightning.pytorch", "lightning.fabric")


class OneLineParser(LightningArgumentParser):
    """jsonargparse's parser, whose errors are one line (a UserError) instead of the usage and a nested report; no
    option is taken abbreviated (jsonargparse 4 expands `--trainer.max_step` to --trainer.max_steps with a deprecation
    warning; its v5 refuses it, as this parser does now: an unknown option)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)  # LightningCLI builds each subcommand's parser with this class too
        super().__init__(*args, **kwargs)

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:  # an inner parse that jsonargparse itself recovers from
            return super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        raise UserError(parse_error_line(message, parser)) from None


def parse_error_line(message: str, parser) -> str:
    """One line for a jsonargparse error: an unknown key with the closest valid one, else the message's first line
    with its indented details folded in."""
    indexed = indexed_option_line(message)
    if indexed:
        return indexed
    nested = re.search(r"Parser key \"([\w.]+)\".*?class_path '([\w.]+)':\s*Option '(\w+)' is not accepted", message,
                       re.S)
    if nested:
        group, class_path, option = nested.groups()
        return unknown_key(f"{group}.{option}", [f"{group}.{name}" for name in init_arguments(class_path)])
    unknown = (re.search(r"does not accept (?:option|nested key) '([\w.]+)'", message)
               or re.search(r"unrecognized arguments: --([^\s=]+)", message)
               or re.search(r"Key \"([\w.]+)\" is not expected", message))
    if unknown:
        return unknown_key(unknown.group(1), valid_keys(parser))
    bad_value = bad_value_line(message)
    if bad_value:
        return bad_value
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    text = " ".join(lines[:3]) if lines else "invalid arguments"
    return re.sub(r"<class '(\w+)'>", r"\1", text)


def bad_value_line(message: str) -> str | None:
    """A value its key's type refuses, naming the key: `--model.lr: expected a float, got nan`, also inside a
    class given by class_path (probe.py's --model.* and --data.*), where jsonargparse only names the group."""
    nested = re.search(r"Parser key \"([\w.]+)\":.*?Problem with given class_path '[\w.]+':\s*Parser key \"([\w.]+)\":"
                       r"\s*(.+)", message, re.S)
    flat = re.match(r"\s*Parser key \"([\w.]+)\":\s*\n\s*(?!Does not validate)(.+)", message, re.S)
    if nested:
        key, detail = f"{nested.group(1)}.{nested.group(2)}", nested.group(3)
    elif flat:
        key, detail = flat.groups()
    else:
        return None
    detail = detail.strip().splitlines()[0].strip()
    expected = re.fullmatch(r"Expected a <class '(\w+)'>\. Got value: (.*)", detail)
    if expected:
        detail = f"expected {'an' if expected.group(1)[0] in 'aeiou' else 'a'} {expected.group(1)}, got " \
                 f"{expected.group(2)}"
    return f"--{key}: " + re.sub(r"<class '(\w+)'>", r"\1", detail)


CALLBACK_DOCS = "docs/live-statistics.md, \"Changing one callback's arguments\""


def indexed_option_line(message: str) -> str | None:
    """One line for an option that picks a list item by its index (`--trainer.callbacks[0].init_args.every_n_steps`,
    `--trainer.callbacks.0.every_n_steps`), which jsonargparse does not take: what is wrong and the form that works (a
    dotted option without the index changes the list's last item; any other one needs the whole list)."""
    flat = re.search(r"unrecognized arguments: --([\w.]+)\[(\d+)\]((?:\.[\w.]+)?)", message)
    nested = re.search(r"Parser key \"([\w.]+)\":.*?(?:unrecognized arguments: --|Option ')(\d+)((?:\.[\w.]+)?)[=' \n]",
                       message + "\n", re.S)
    found = flat or nested
    if not found:
        return None
    key, index, rest = found.groups()
    given = f"--{key}[{index}]{rest}" if flat else f"--{key}.{index}{rest}"
    line = f"{given}: an option takes no index (it cannot pick one item of a list)"
    if key.rsplit(".", 1)[-1] != "callbacks":
        return f"{line}; give --{key} its whole value (a list with all its items, here or in a config file)"
    return (f"{line}; --{key}{rest or '.init_args.NAME'} VALUE (no index) changes the last callback, and another one is "
            f"changed by a YAML file of your own holding the whole list, given as a later --config ({CALLBACK_DOCS})")


def unknown_key(key: str, candidates: list[str]) -> str:
    """"unknown option 'KEY'", with the closest of `candidates` (never KEY itself: no help) when one is close."""
    candidates = [candidate for candidate in candidates if candidate != key]
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    if not close:  # the last part alone: a typo in a group name
        tail = difflib.get_close_matches(key.rsplit(".", 1)[-1], [c.rsplit(".", 1)[-1] for c in candidates], n=1)
        close = [c for c in candidates if tail and c.rsplit(".", 1)[-1] == tail[0]][:1]
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"unknown option '{key}'{hint}"


def valid_keys(parser) -> list[str]:
    try:
        return [key for key in parser.get_defaults().keys() if not key.endswith(".help")]
    except Exception:  # a parser that cannot list its defaults: no hint, still one line
        return []


def init_arguments(class_path: str) -> list[str]:
    """The keyword arguments a class's __init__ takes (its bases' too when it passes **kwargs up)."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return []
    names: list[str] = []
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        parameters = inspect.signature(klass.__init__).parameters.values()
        names += [p.name for p in parameters if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    return list(dict.fromkeys(names))


class HeldLogs:
    """Hold back what Lightning logs (its banner, "Seed set to", tips) until `release(emit=True)` prints it, or
    `release(emit=False)` drops it (a bad input: its one-line error is all that is printed)."""

    def __init__(self, names: tuple[str, ...] = LIGHTNING_LOGGERS) -> None:
        self.records: list[logging.LogRecord] = []
        self.saved = {}
        for name in names:
            logger = logging.getLogger(name)
            self.saved[name] = (logger.handlers[:], logger.propagate)
            logger.handlers = [_Collect(self.records)]
            logger.propagate = False

    def release(self, emit: bool) -> None:
        for name, (handlers, propagate) in self.saved.items():
            logger = logging.getLogger(name)
            logger.handlers, logger.propagate = handlers, propagate
        records, self.records[:], self.saved = list(self.records), [], {}
        for record in records if emit else []:
            for name in LIGHTNING_LOGGERS:  # through the handlers of the logger it was held at
                if record.name == name or record.name.startswith(name + "."):
                    logging.getLogger(name).handle(record)
                    break


class _Collect(logging.Handler):
    def __init__(self, records: list) -> None:
        super().__init__()
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class _ReleaseHeld(Callback):
    """Prints Lightning's held lines once the data module is prepared and set up (Lightning calls callbacks' setup
    after the data module's prepare_data and setup, where the data's input errors are found)."""

    def __init__(self, held: HeldLogs) -> None:
        self.held = held

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.held.release(emit=True)


class ProjectCLI(LightningCLI):
    """LightningCLI with one-line errors, a held banner, weights-only checkpoints, and a locked run directory."""

    program = "lightning"
    checkpoint_io_class: type[TorchCheckpointIO] = WeightsOnlyCheckpointIO
    apply_checkpoint_hparams = True  # Lightning's: an explicit --ckpt_path's hyper-parameters override the model's

    def __init__(self, *args, **kwargs) -> None:
        self._held = HeldLogs()
        self._lock: RunLock | None = None
        kwargs.setdefault("parser_class", OneLineParser)
        kwargs.setdefault("save_config_callback", AtomicSaveConfig)
        try:
            super().__init__(*args, **kwargs)
        except BaseException:
            self._held.release(emit=False)
            raise
        self._held.release(emit=True)

    def parse_arguments(self, parser, args) -> None:
        """Lightning's, after a look at each --config file: one that is not UTF-8 text is one line (jsonargparse
        would raise UnicodeDecodeError)."""
        argv = sys.argv[1:] if args is None else args
        for path in config_paths(argv) if isinstance(argv, (list, tuple)) else []:
            try:
                Path(path).read_text(encoding="utf-8")
            except UnicodeDecodeError as error:
                raise UserError(f"config file {path} is not UTF-8 text (bad byte at offset {error.start})") from None
            except OSError:
                continue  # missing or unreadable: jsonargparse names it
        super().parse_arguments(parser, args)

    def instantiate_classes(self) -> None:
        """Lightning's, after the trainer's own options are checked (nothing is built before); a UserError raised by
        a class's __init__ (a bad argument) comes out as itself, not inside jsonargparse's report of every type it
        tried."""
        check_trainer_settings(self._get(self.config, "trainer"))
        try:
            super().instantiate_classes()
            quiet_trainer(self.trainer)  # a one-line model summary; a step-bounded run's bar counts steps
        except Exception as error:
            cause: BaseException | None = error
            while cause is not None and not isinstance(cause, UserError):
                cause = cause.__cause__ or cause.__context__
            if cause is None:
                raise
            raise UserError(str(cause)) from None

    def instantiate_trainer(self, **kwargs):
        """Lightning's, its callbacks checked first (no stateful one twice) and its refusals one line (core/
        trainer_checks.py)."""
        settings = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        callbacks = settings.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        extra = [self._get(self.config_init, key) for key in self._parser(self.subcommand).callback_keys]
        check_unique_callbacks([*callbacks, *extra])
        with lightning_refusals():
            return super().instantiate_trainer(**kwargs)

    def _parse_ckpt_path(self) -> None:
        """Lightning's: a checkpoint's hyper-parameters override the config's model arguments; here read weights-only
        (one line for a checkpoint that is not plain data) and only from a file that exists."""
        if not self.config.get("subcommand"):
            return
        arguments = self.config[self.config.subcommand]
        if arguments.get("weights_only") is False:
            raise UserError("--weights_only false is not supported: checkpoints are always read weights-only (a "
                            "checkpoint that needs anything else is refused)")
        ckpt_path = arguments.get("ckpt_path")
        if not ckpt_path or ckpt_path in ("last", "best", "hpc", "registry"):
            return
        if not Path(ckpt_path).is_file():
            raise UserError(f"checkpoint not found: {ckpt_path}")
        if not self.apply_checkpoint_hparams:
            return
        hparams = load_weights_only(ckpt_path, mmap=True).get("hyper_parameters") or {}
        hparams = {key: value for key, value in hparams.items() if key != "_instantiator"}
        if hparams:
            if "_class_path" in hparams:
                hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
            self.config = self.parser.parse_object({self.config.subcommand: {"model": hparams}}, self.config)

    def lock_run(self) -> None:
        """Once the run's own checks pass, before anything is written: read checkpoints weights-only, and lock the run
        directory (global rank 0 only: the other ranks are the same run)."""
        trainer = self.trainer
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # not a plugin the user chose
            trainer.strategy.checkpoint_io = self.checkpoint_io_class()
        if trainer.global_rank == 0 and self._lock is None:
            self._lock = RunLock(trainer.default_root_dir, self.program)
            self._lock.acquire()

    def _run_subcommand(self, subcommand: str) -> None:
        """Lightning's: before_<subcommand>, the trainer's method, after_<subcommand>; Lightning's held lines print
        once the data is prepared and set up (the last input errors are behind), and the lock goes however the run
        ends."""
        try:
            before = getattr(self, f"before_{subcommand}", None)
            if callable(before):
                before()
            self.trainer.callbacks.insert(0, _ReleaseHeld(self._held))
            run = getattr(self, subcommand, getattr(self.trainer, subcommand))
            run(**self._prepare_subcommand_kwargs(subcommand))
            after = getattr(self, f"after_{subcommand}", None)
            if callable(after):
                after()
        except BaseException as error:
            self._held.release(emit=False)
            full = full_disk_error(error, self.trainer.default_root_dir)
            if full is not None:
                raise full from None
            raise
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None


def full_disk_error(error: BaseException, root) -> UserError | None:
    """A full disk met anywhere in a run (config.yaml, a logger's files, a report) as one line naming the file (or the
    run directory) and the disk; the writers of checkpoints, exports and reports say it themselves."""
    if isinstance(error, UserError) or not disk_full(error):
        return None
    where = failed_file(error) or root
    return UserError(f"cannot write {where}: {write_error(error, where)}")


class AtomicSaveConfig(SaveConfigCallback):
    """Lightning's config.yaml, written whole (a temporary file beside it, renamed into place) or not at all: a full
    disk leaves a resumed run's earlier config.yaml as it was. Written when the stage starts (`on_fit_start`, ...),
    not at `setup` as Lightning writes it: a refusal raised after that (a module's own `setup`, a checkpoint that does
    not fit the model) leaves no config.yaml behind, and a resumed run's as it was. Only `fit` writes it: the
    config.yaml of a run directory says how its run was trained, and `train.py validate` of one of its checkpoints
    leaves it so; a validate run still gives its W&B run its own resolved config (save_config), writing no file."""

    _stage: str | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._stage = stage if stage in ("fit", "validate") else None

    def _write(self, trainer, pl_module) -> None:
        if self._stage is None:  # written already, or no setup: every rank returns here alike (the write broadcasts)
            return
        stage, self._stage = self._stage, None
        if stage == "validate":  # no config.yaml: only the W&B run's config, from rank zero (no collective here)
            if trainer.is_global_zero:
                self.save_config(trainer, pl_module, stage)
            return
        parser, self.parser = self.parser, _AtomicSave(self.parser)
        try:
            super().setup(trainer, pl_module, stage)
        finally:
            self.parser = parser

    def save_config(self, trainer, pl_module, stage: str) -> None:
        """Rank zero, with config.yaml: the same resolved config (every section, the seed, each callback's options)
        and the package versions as each W&B logger's run config (core/run_config.py)."""
        from pytorch_lightning.loggers import WandbLogger

        loggers = [logger for logger in trainer.loggers if isinstance(logger, WandbLogger)]
        if loggers:
            values = resolved_config(self.parser, self.config)
            for logger in loggers:
                logger.log_hyperparams(values)

    def on_fit_start(self, trainer, pl_module) -> None:
        self._write(trainer, pl_module)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._write(trainer, pl_module)

    def on_test_start(self, trainer, pl_module) -> None:
        self._write(trainer, pl_module)

    def on_predict_start(self, trainer, pl_module) -> None:
        self._write(trainer, pl_module)


class _AtomicSave:
    """A parser whose `save` of one local file goes through a temporary file and `os.replace`."""

    def __init__(self, parser) -> None:
        self._parser = parser

    def __getattr__(self, name: str):
        return getattr(self._parser, name)

    def save(self, config, path, **kwargs) -> None:
        if kwargs.get("multifile") or "://" in str(path):
            return self._parser.save(config, path, **kwargs)
        target = Path(path)
        temporary = target.with_name(f".{target.name}.tmp")
        try:
            self._parser.save(config, str(temporary), **{**kwargs, "overwrite": True})
            os.replace(temporary, target)
        finally:
            temporary.unlink(missing_ok=True)


def config_paths(argv) -> list[str]:
    """The files given with --config / -c (also --config=FILE)."""
    paths = []
    for flag, value in zip(argv, [*argv[1:], None]):
        flag = str(flag)
        if flag in ("--config", "-c") and value is not None:
            paths.append(str(value))
        elif flag.startswith("--config="):
            paths.append(flag.split("=", 1)[1])
    return paths
