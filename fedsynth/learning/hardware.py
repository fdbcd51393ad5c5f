"""Where training runs and at what precision: `train.device` and `train.precision` resolved in this process
(docs/guides/gpus.md).

Every process resolves the device itself, against the hardware it has: "auto" is the first visible GPU where
torch.cuda.is_available(), else the CPU; "cuda" / "cuda:N" on a process without that GPU is a ConfigError of one line
naming the key and what this machine has. A client node started with `fedsynth client --device D` trains on D whatever
the run config says (`set_node_device`): a coordinator's config may say "auto" or "cuda" while a node without a GPU
trains on its CPU. fp16 needs a GPU (CPU autocast supports bfloat16 only); bf16 runs on both.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

from fedsynth.errors import ConfigError

DEVICE_KEY = "train.device"
PRECISION_KEY = "train.precision"
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

_node_device: str | None = None  # `fedsynth client --device`: overrides train.device for this process's clients


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def machine_gpus() -> str:
    """What this machine has, in words, for an error message."""
    count = gpu_count()
    if count == 0:
        return "this machine has no CUDA GPU (torch.cuda.is_available() is False)"
    return f"this machine has {count} CUDA GPU{'s' if count > 1 else ''} (cuda:0{f' .. cuda:{count - 1}' if count > 1 else ''})"


def resolve_device(spec: str, *, key: str = DEVICE_KEY) -> torch.device:
    """The torch.device `spec` names on this machine ("cuda" is the current GPU, as "cuda:N"); ConfigError naming `key`
    and this machine's GPUs where it has no such GPU."""
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if spec == "cuda" or (spec.startswith("cuda:") and spec[5:].isdigit()):
        count = gpu_count()
        index = None if spec == "cuda" else int(spec[5:])
        if count == 0 or (index is not None and index >= count):
            raise ConfigError(f"{_named(key, spec)} but {machine_gpus()}: use \"auto\" (a GPU where there is one) or \"cpu\"")
        return torch.device("cuda", torch.cuda.current_device() if index is None else index)
    raise ConfigError(f"{key} must be \"auto\", \"cpu\", \"cuda\" or \"cuda:N\", got {spec!r}")


def _named(key: str, spec: str) -> str:
    return f"{key} {spec}" if key.startswith("--") else f"{key} = {spec!r}"


def check_precision(precision: str, device: torch.device, *, why: str = "") -> None:
    """ConfigError for fp16 off a GPU (CPU autocast has bfloat16 only); `why` says where the device came from."""
    if precision not in ("fp32", *AUTOCAST_DTYPES):
        raise ConfigError(f"{PRECISION_KEY} must be one of fp32, bf16, fp16, got {precision!r}")
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError(f"{PRECISION_KEY} = 'fp16' needs a GPU, and training runs on the CPU here{why}: use \"bf16\" "
                          "(CPU autocast has it) or \"fp32\"")


def resolve_hardware(device: str, precision: str, *, key: str = DEVICE_KEY) -> torch.device:
    """train.device resolved on this machine, with train.precision checked against it (the launcher and the coordinator
    call it before they start anything)."""
    resolved = resolve_device(device, key=key)
    check_precision(precision, resolved, why=f" ({_named(key, device)})")
    return resolved


def set_node_device(spec: str | None) -> torch.device | None:
    """`fedsynth client --device`: checked at once (ConfigError naming --device), then used by this process's clients
    instead of the run config's train.device. None clears it."""
    global _node_device
    resolved = None if spec is None else resolve_device(spec, key="--device")
    _node_device = spec
    return resolved


def node_device(configured: str) -> tuple[str, str]:
    """(the device spec this process trains on, the key it came from): --device when given, else train.device."""
    return (_node_device, "--device") if _node_device is not None else (configured, DEVICE_KEY)


def autocast(device: torch.device, precision: str) -> ContextManager[object]:
    """torch.autocast to bfloat16 / float16 on `device`'s type; fp32: no context at all (the default path as it was)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[precision])


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler | None:
    """A GradScaler for fp16 on a GPU (float16 gradients underflow without one); None otherwise."""
    if precision == "fp16" and device.type == "cuda":
        return torch.amp.GradScaler("cuda")
    return None


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch onto `device`: on a GPU from pinned memory without blocking (the copy overlaps the host's next work);
    on the CPU the tensor itself, as before."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device, non_blocking=True)
