"""Local training on in-memory tensors: config, seeded minibatches and augmentation, the optimizer (train.optimizer,
train.lr_schedule), the training loop (on train.device, at train.precision), evaluation."""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedsynth.config_schema import LR_SCHEDULES, OPTIMIZERS, PRECISIONS
from fedsynth.errors import ConfigError, DataError, StopRequested
from fedsynth.learning.hardware import autocast, grad_scaler, to_device

AUGMENT_MIN_SIZE = 32  # random crop + flip only makes sense for natural images; 8x8 digits stay as they are
CROP_PADDING = 4


def images_to_tensor(x_uint8_nhwc: np.ndarray) -> torch.Tensor:
    """uint8 N x H x W x C images -> float32 N x C x H x W tensor scaled to [-1, 1], in one conversion."""
    if not isinstance(x_uint8_nhwc, np.ndarray) or x_uint8_nhwc.dtype != np.uint8 or x_uint8_nhwc.ndim != 4:
        got = f"{x_uint8_nhwc.dtype} {x_uint8_nhwc.shape}" if isinstance(x_uint8_nhwc, np.ndarray) else type(x_uint8_nhwc)
        raise DataError(f"images must be a uint8 N x H x W x C array, got {got}")
    nchw = torch.from_numpy(np.ascontiguousarray(x_uint8_nhwc)).permute(0, 3, 1, 2)
    return nchw.to(torch.float32, memory_format=torch.contiguous_format).div_(127.5).sub_(1.0)


@dataclass(frozen=True)
class LocalTrainConfig:
    """Local training settings (paper defaults: lr 1e-3, batch 64, 10 local epochs).

    `max_steps` caps the optimizer steps per round (None: run all `local_epochs`); a short-run knob for
    CPU smoke runs and tests. `should_stop` is asked before every optimizer step; once it returns True,
    training raises StopRequested (a client node passes its SIGTERM flag).

    `optimizer`: "sgd" (lr, momentum, weight_decay), "adam" or "adamw" (lr, weight_decay; torch's default betas
    (0.9, 0.999) and eps 1e-8; momentum is not used), fresh each round (make_optimizer). `lr_schedule` over the run's
    `rounds`: this round's (`round_number`, 1-based) lr is `round_lr` (scheduled_lr). `device`: a resolved torch device
    string ("cpu", "cuda:0"; fedsynth.learning.hardware), `precision`: "fp32", or autocast to "bf16" / "fp16".
    """

    lr: float = 1e-3
    momentum: float = 0.0
    weight_decay: float = 0.0
    batch_size: int = 64
    local_epochs: int = 10
    augment: bool = False
    max_steps: int | None = None
    should_stop: Callable[[], bool] | None = field(default=None, compare=False, repr=False)
    optimizer: str = "sgd"
    lr_schedule: str = "constant"
    rounds: int = 1  # T, the run's rounds: what lr_schedule spans
    round_number: int = 1  # this round (the task's), 1-based
    device: str = "cpu"
    precision: str = "fp32"

    def __post_init__(self) -> None:
        _check_real("lr", self.lr, lower=0.0, lower_inclusive=False)
        _check_real("momentum", self.momentum, lower=0.0, lower_inclusive=True, upper=1.0)
        _check_real("weight_decay", self.weight_decay, lower=0.0, lower_inclusive=True)
        _check_int("batch_size", self.batch_size)
        _check_int("local_epochs", self.local_epochs)
        if not isinstance(self.augment, bool):
            raise ConfigError(f"augment must be true or false, got {self.augment!r}")
        if self.max_steps is not None and (isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int) or self.max_steps < 0):
            raise ConfigError(f"max_steps must be an integer >= 0 (0 switches training off), got {self.max_steps!r}")
        for name, allowed in (("optimizer", OPTIMIZERS), ("lr_schedule", LR_SCHEDULES), ("precision", PRECISIONS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        _check_int("rounds", self.rounds)
        _check_int("round_number", self.round_number)
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ConfigError(f"device must name a torch device (\"cpu\", \"cuda:0\"), got {self.device!r}") from None

    @property
    def round_lr(self) -> float:
        """This round's learning rate under `lr_schedule` (exactly `lr` under "constant")."""
        return scheduled_lr(self.lr, self.lr_schedule, self.round_number, self.rounds)


def scheduled_lr(lr: float, schedule: str, round_number: int, rounds: int) -> float:
    """The lr of round `round_number` (1-based) of `rounds`:
    constant: lr;
    cosine: lr * 0.5 * (1 + cos(pi * (round - 1) / rounds)): lr in round 1, near 0 (never 0) in the last;
    step: lr, then lr * 0.1 for round > rounds / 2, lr * 0.01 for round > 3 * rounds / 4.
    A round past `rounds` (not played by the coordinator) counts as the last."""
    if schedule == "constant":
        return lr
    r = min(round_number, rounds)
    if schedule == "cosine":
        return lr * 0.5 * (1.0 + math.cos(math.pi * (r - 1) / rounds))
    if schedule == "step":
        return lr * (0.01 if r > 3 * rounds / 4 else 0.1 if r > rounds / 2 else 1.0)
    raise ConfigError(f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}, got {schedule!r}")


def make_optimizer(params: Iterable[torch.Tensor] | Iterable[dict], cfg: LocalTrainConfig) -> torch.optim.Optimizer:
    """The clients' local optimizer, fresh each round, at this round's lr: the one place every algorithm gets it."""
    lr = cfg.round_lr
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay)
    raise ConfigError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {cfg.optimizer!r}")


def train_device(model: nn.Module, cfg: LocalTrainConfig) -> torch.device:
    """Move `model` onto `cfg.device` (once: it stays there between rounds) and return that device. Every algorithm
    calls it before it copies anything of the model (FedProx's global weights, MOON's frozen copies), so those copies
    live where the model trains. The logical clients of one node each keep their model on the node's GPU."""
    device = torch.device(cfg.device)
    current = next(model.parameters()).device
    if current != device:
        model.to(device)
    return device


def _check_real(name: str, value: float, *, lower: float, lower_inclusive: bool, upper: float | None = None) -> None:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value >= lower if lower_inclusive else value > lower) and (upper is None or value < upper)
    if not ok:
        bounds = f"{'>=' if lower_inclusive else '>'} {lower}" + (f" and < {upper}" if upper is not None else "")
        raise ConfigError(f"{name} must be a finite number {bounds}, got {value!r}")


def _check_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class TrainData:
    """Training samples as tensors: x float N x C x H x W (see images_to_tensor), y int64 labels.

    The client concatenates its real shard and its synthetic images before building this.
    """

    x: torch.Tensor
    y: torch.Tensor

    def __post_init__(self) -> None:
        if not torch.is_floating_point(self.x) or self.x.ndim != 4:
            raise DataError(f"TrainData.x must be a float N x C x H x W tensor, got {self.x.dtype} {tuple(self.x.shape)}")
        if self.y.dtype != torch.int64 or self.y.ndim != 1 or len(self.y) != len(self.x):
            raise DataError(f"TrainData.y must be {len(self.x)} int64 labels, got {self.y.dtype} {tuple(self.y.shape)}")
        if len(self.x) == 0:
            raise DataError("TrainData holds no samples")

    def __len__(self) -> int:
        return len(self.y)


def batches(data: TrainData, batch_size: int, generator: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of shuffled minibatches; the order depends only on `generator`. The last batch may be smaller."""
    order = torch.randperm(len(data), generator=generator, device=generator.device).to(data.x.device)
    for start in range(0, len(order), batch_size):
        index = order[start : start + batch_size]
        yield data.x[index], data.y[index]


def augment_batch(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random crop (zero-pixel padding of 4, i.e. -1 after scaling) and horizontal flip, per sample, seeded.

    Images smaller than 32x32 (digits) are returned unchanged.
    """
    n, _, h, w = x.shape
    if h < AUGMENT_MIN_SIZE or w < AUGMENT_MIN_SIZE:
        return x
    pad = CROP_PADDING
    offsets = torch.randint(0, 2 * pad + 1, (n, 2), generator=generator, device=generator.device).to(x.device)
    flip = (torch.rand(n, generator=generator, device=generator.device) < 0.5).to(x.device)
    padded = F.pad(x, (pad, pad, pad, pad), value=-1.0).permute(0, 2, 3, 1)  # N x H' x W' x C
    rows = offsets[:, 0:1] + torch.arange(h, device=x.device)
    cols = offsets[:, 1:2] + torch.arange(w, device=x.device)
    cols = torch.where(flip[:, None], cols.flip(1), cols)  # a flipped crop reads its columns right to left
    sample = torch.arange(n, device=x.device)[:, None, None]
    return padded[sample, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2).contiguous()


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def run_local_sgd(
    model: nn.Module,
    data: TrainData,
    cfg: LocalTrainConfig,
    generator: torch.Generator,
    *,
    loss_fn: LossFn,
    adjust_gradients: Callable[[], None] | None = None,
) -> tuple[int, float]:
    """Local training over `cfg.local_epochs` epochs (or `cfg.max_steps` steps) with a fresh optimizer (make_optimizer)
    on `cfg.device` (train_device), the forward pass and loss under autocast at `cfg.precision`.

    `loss_fn(x, y)` returns the scalar loss of a batch already on the model's device;
    `adjust_gradients()` runs between backward and the optimizer step (SCAFFOLD's correction), on unscaled gradients
    under fp16's GradScaler. Returns (optimizer steps taken, mean batch loss over those steps); raises StopRequested
    when `cfg.should_stop()` turns True, leaving the model part-trained.
    """
    device = train_device(model, cfg)
    optimizer = make_optimizer(model.parameters(), cfg)
    scaler = grad_scaler(device, cfg.precision)
    model.train()
    step_limit = cfg.max_steps if cfg.max_steps is not None else math.inf
    steps, loss_sum = 0, torch.zeros((), dtype=torch.float64, device=device)  # one .item() at the end, no per-step sync
    for _ in range(cfg.local_epochs):
        if steps >= step_limit:
            break
        for x, y in batches(data, cfg.batch_size, generator):
            if steps >= step_limit:
                break
            if cfg.should_stop is not None and cfg.should_stop():
                raise StopRequested(f"local training stopped after {steps} optimizer steps")
            x, y = to_device(x, device), to_device(y, device)
            if cfg.augment:  # the draws come from the (CPU) generator wherever the batch is: the same crops and flips
                x = augment_batch(x, generator)
            with autocast(device, cfg.precision):
                loss = loss_fn(x, y)
            optimizer.zero_grad(set_to_none=True)
            if scaler is None:
                loss.backward()
                if adjust_gradients is not None:
                    adjust_gradients()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                if adjust_gradients is not None:
                    scaler.unscale_(optimizer)
                    adjust_gradients()
                scaler.step(optimizer)  # skipped (and the scale lowered) where a gradient overflowed
                scaler.update()
            steps += 1
            loss_sum += loss.detach()
    return steps, (loss_sum.item() / steps if steps else float("nan"))


def evaluate(model: nn.Module, data: TrainData, batch_size: int = 512, *, precision: str = "fp32") -> tuple[float, float]:
    """(mean cross-entropy loss, accuracy) of `model` on `data`, in eval mode, on the model's device (batches moved
    there), the forward pass under autocast at `precision`; restores the previous mode."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    loss_sum, correct = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(data), batch_size):
            x = to_device(data.x[start : start + batch_size], device)
            y = to_device(data.y[start : start + batch_size], device)
            with autocast(device, precision):
                logits = model(x)
            loss_sum += F.cross_entropy(logits.float(), y, reduction="sum").item()
            correct += int((logits.argmax(dim=1) == y).sum().item())
    model.train(was_training)
    return loss_sum / len(data), correct / len(data)


class DeviceEvaluator:
    """`evaluate` on train.device for a model that lives on the CPU (the coordinator's global model): a replica on the
    device, loaded with the model's weights at each call. On the CPU at fp32: `evaluate` on the model itself, as before."""

    def __init__(self, device: torch.device, precision: str = "fp32") -> None:
        self.device, self.precision = device, precision
        self._replica: nn.Module | None = None

    def __call__(self, model: nn.Module, data: TrainData, batch_size: int = 512) -> tuple[float, float]:
        if self.device.type == "cpu":
            return evaluate(model, data, batch_size, precision=self.precision)
        if self._replica is None:
            self._replica = copy.deepcopy(model).to(self.device)
        self._replica.load_state_dict(model.state_dict())
        return evaluate(self._replica, data, batch_size, precision=self.precision)
