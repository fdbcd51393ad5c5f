"""Local training on in-memory tensors: config, seeded minibatches and augmentation, the SGD loop, evaluation."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedsynth.errors import ConfigError, DataError, StopRequested

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
    """Local SGD settings (paper defaults: lr 1e-3, batch 64, 10 local epochs).

    `max_steps` caps the optimizer steps per round (None: run all `local_epochs`); a short-run knob for
    CPU smoke runs and tests. `should_stop` is asked before every optimizer step; once it returns True,
    training raises StopRequested (a client node passes its SIGTERM flag).
    """

    lr: float = 1e-3
    momentum: float = 0.0
    weight_decay: float = 0.0
    batch_size: int = 64
    local_epochs: int = 10
    augment: bool = False
    max_steps: int | None = None
    should_stop: Callable[[], bool] | None = field(default=None, compare=False, repr=False)

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
    """Plain SGD over `cfg.local_epochs` epochs (or `cfg.max_steps` steps) with a fresh optimizer.

    `loss_fn(x, y)` returns the scalar loss of a batch already on the model's device;
    `adjust_gradients()` runs between backward and the optimizer step (SCAFFOLD's correction).
    Returns (optimizer steps taken, mean batch loss over those steps); raises StopRequested when
    `cfg.should_stop()` turns True, leaving the model part-trained.
    """
    device = next(model.parameters()).device
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
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
            if cfg.augment:
                x = augment_batch(x, generator)
            loss = loss_fn(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if adjust_gradients is not None:
                adjust_gradients()
            optimizer.step()
            steps += 1
            loss_sum += loss.detach()
    return steps, (loss_sum.item() / steps if steps else float("nan"))


def evaluate(model: nn.Module, data: TrainData, batch_size: int = 512) -> tuple[float, float]:
    """(mean cross-entropy loss, accuracy) of `model` on `data`, in eval mode; restores the previous mode."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    loss_sum, correct = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(data), batch_size):
            x = data.x[start : start + batch_size].to(device)
            y = data.y[start : start + batch_size].to(device)
            logits = model(x)
            loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
            correct += int((logits.argmax(dim=1) == y).sum().item())
    model.train(was_training)
    return loss_sum / len(data), correct / len(data)
