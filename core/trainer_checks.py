"""The trainer's own options and the device a run asks for, checked before anything is built or written; what only
Lightning can check, translated into one line.

    check_trainer_settings(cli_trainer_config)        # ProjectCLI: before the model, data module or trainer exist
    check_unique_callbacks(callbacks)                 # ProjectCLI: before the Trainer is made from the callbacks
    with lightning_refusals():                        # Lightning's MisconfigurationException & co.: one line
        trainer = Trainer(...)
    check_device("cuda:7")                            # analyze.py --device

    python probe.py fit --config configs/probe/position.yaml --trainer.max_epochs 0
    probe.py: error: --trainer.max_epochs 0 trains nothing: give at least 1 epoch (or -1 for no limit)

Lightning itself refuses most of these only once a Trainer is being built (a 30-line traceback), some not at all
(`val_check_interval 0` divides by zero once training starts, after config.yaml is written; `max_epochs 0` writes a
report of probes that never trained).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

import torch

from core.errors import UserError, first_line
from core.wording import plural

GPU_ACCELERATORS = ("gpu", "cuda")


def check_trainer_settings(settings: Mapping | None) -> None:
    """The options of `--trainer.*` that Lightning checks late or never: limits that train nothing or are out of
    range, a validation interval of zero, and an accelerator (with its devices) this machine does not have."""
    if not settings:
        return
    get = settings.get
    if not get("fast_dev_run"):  # a smoke test sets its own limits
        check_limit("max_steps", get("max_steps"), "step")
        check_limit("max_epochs", get("max_epochs"), "epoch")
        check_train_batches(get("limit_train_batches"))
    check_val_check_interval(get("val_check_interval"))
    check_accelerator(get("accelerator"), get("devices"))
    check_launcher(get("devices"), get("num_nodes"))


TORCHRUN = ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")  # what torchrun sets (Lightning's own test of it)


def under_torchrun() -> bool:
    return all(name in os.environ for name in TORCHRUN)


def check_launcher(devices, num_nodes) -> None:
    """Under torchrun, the processes it started are one run: --trainer.devices × --trainer.num_nodes must count them.
    Fewer (a config's `devices: 1`) and each process takes itself for a run of its own, in the same directory: one is
    refused as "in use by another run" and the other trains alone until torchrun kills it, leaving a run without its
    export. Devices Lightning counts itself (auto, -1) are left to it."""
    if not under_torchrun():
        return
    wanted = requested_indices(devices)
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ["LOCAL_WORLD_SIZE"])
    nodes = num_nodes if isinstance(num_nodes, int) and num_nodes > 0 else 1
    if wanted is not None and len(wanted) * nodes != world:
        raise UserError(f"torchrun started {world} processes but --trainer.devices {devices} x --trainer.num_nodes "
                        f"{nodes} make {len(wanted) * nodes}: set --trainer.devices {local} --trainer.num_nodes "
                        f"{max(1, world // local)} (scripts/torchrun_pretrain.sh sets both)")


def check_limit(name: str, value, unit: str) -> None:
    """max_steps / max_epochs: -1 or None (no limit) or at least 1; 0 trains nothing."""
    if value is None or isinstance(value, bool) or not isinstance(value, int):
        return
    if value == 0:
        raise UserError(f"--trainer.{name} 0 trains nothing: give at least 1 {unit} (or -1 for no limit)")
    if value < -1:
        raise UserError(f"--trainer.{name} must be -1 (no limit) or at least 1, got {value}")


def check_train_batches(value) -> None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if value == 0:
        raise UserError(f"--trainer.limit_train_batches {value} trains nothing: give a fraction of the batches in (0, "
                        "1] or a number of batches of at least 1")
    if value < 0 or value != value:
        raise UserError(f"--trainer.limit_train_batches must be a fraction in (0, 1] or a number of batches of at "
                        f"least 1, got {value}")


def check_val_check_interval(value) -> None:
    """An int counts training batches (at least 1), a float is a fraction of an epoch in (0, 1] (a whole float above
    1 is a count); a time ("00:00:10:00", a dict, a timedelta) is Lightning's to read."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    fine = value >= 1 if isinstance(value, int) else (0 < value <= 1 or (value > 1 and value.is_integer()))
    if not fine:
        raise UserError("--trainer.val_check_interval must be a number of training batches (an integer of at least "
                        f"1) or a fraction of an epoch in (0, 1], got {value}")


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def no_gpu_reason() -> str:
    if torch.version.cuda is None:
        return f"this PyTorch ({torch.__version__}) is built without CUDA"
    return "CUDA sees no GPU (CUDA_VISIBLE_DEVICES, the driver?)"


def check_accelerator(accelerator, devices) -> None:
    """A GPU (or Apple MPS) asked for by name must exist, as many of them as --trainer.devices asks for."""
    if not isinstance(accelerator, str):
        return
    name = accelerator.lower()
    if name in GPU_ACCELERATORS:
        count = gpu_count()
        if count == 0:
            raise UserError(f"--trainer.accelerator {accelerator}: this machine has no CUDA GPU ({no_gpu_reason()}); "
                            "use --trainer.accelerator cpu (or auto)")
        wanted = requested_indices(devices)
        if wanted is not None and max(wanted, default=-1) >= count:
            asked = plural(len(wanted), "GPU") if isinstance(devices, int) or str(devices).isdigit() else \
                f"GPUs {sorted(wanted)}"
            raise UserError(f"--trainer.devices {devices} asks for {asked} but this machine has "
                            f"{plural(count, 'GPU')}; use --trainer.devices {count} or fewer")
    elif name == "mps" and not (torch.backends.mps.is_available()):
        raise UserError(f"--trainer.accelerator {accelerator}: Apple's MPS is not available on this machine; use "
                        "--trainer.accelerator cpu (or auto)")


def requested_indices(devices) -> list[int] | None:
    """The GPU indices `--trainer.devices` names: N → 0..N-1, a list or "0,2" → those; None for auto or -1 (all)."""
    if isinstance(devices, bool) or devices is None:
        return None
    if isinstance(devices, int):
        return list(range(devices)) if devices > 0 else None
    if isinstance(devices, (list, tuple)) and all(isinstance(d, int) and not isinstance(d, bool) for d in devices):
        return list(devices)
    if isinstance(devices, str):
        text = devices.strip()
        if text.isdigit():
            return list(range(int(text))) if int(text) > 0 else None
        parts = [part.strip() for part in text.strip(",").split(",")]
        if len(parts) > 1 or text.endswith(","):
            if all(part.isdigit() for part in parts):
                return [int(part) for part in parts]
    return None


def check_unique_callbacks(callbacks) -> None:
    """Lightning keeps one checkpoint state per stateful callback (its `state_key`): two of one kind (the config's
    OutlierStatistics and another added with --trainer.callbacks+) would be refused once the Trainer is built."""
    seen: dict[str, object] = {}
    for callback in callbacks or ():
        if not has_state(callback):
            continue
        key = callback.state_key
        if key in seen:
            name = type(callback).__name__
            raise UserError(f"--trainer.callbacks holds {name} twice: a checkpoint keeps one state per kind of "
                            f"stateful callback; keep one {name} (the config may have one already, and "
                            "--trainer.callbacks+ adds another) and set its options instead")
        seen[key] = callback


def has_state(callback) -> bool:
    from pytorch_lightning import Callback
    from pytorch_lightning.utilities.model_helpers import is_overridden

    return isinstance(callback, Callback) and is_overridden("state_dict", instance=callback, parent=Callback)


@contextlib.contextmanager
def lightning_refusals() -> Iterator[None]:
    """What only Lightning can check (a Trainer refusing its arguments: MisconfigurationException, ValueError,
    TypeError, an accelerator that fails to start) as one line."""
    from lightning_fabric.utilities.exceptions import MisconfigurationException

    try:
        yield
    except UserError:
        raise
    except (MisconfigurationException, ValueError, TypeError, RuntimeError, AssertionError) as error:
        raise UserError(f"the trainer refused its settings: {first_line(error).replace('`', '')}") from None


def check_device(device: str | None, option: str = "--device") -> None:
    """A device string torch reads, that this machine has (analyze.py's --device): cpu, cuda, cuda:N, mps."""
    if device is None:
        return
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise UserError(f"{option} {device!r} is not a device (cpu, cuda, cuda:1, mps)") from None
    if parsed.type == "cuda":
        count = gpu_count()
        if count == 0:
            raise UserError(f"{option} {device}: this machine has no CUDA GPU ({no_gpu_reason()}); use {option} cpu")
        if parsed.index is not None and parsed.index >= count:
            raise UserError(f"{option} {device}: this machine has {plural(count, 'GPU')} "
                            f"(cuda:0{f'..cuda:{count - 1}' if count > 1 else ''})")
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"{option} {device}: Apple's MPS is not available on this machine; use {option} cpu")
    elif parsed.type not in ("cpu", "cuda", "mps"):
        raise UserError(f"{option} {device}: not a device this program runs on (cpu, cuda, cuda:N, mps)")
