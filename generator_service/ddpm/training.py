"""Generator training: DDPM noise-prediction loss, label dropout for guidance, EMA weights, atomic checkpoints."""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from diffusers import UNet2DModel
from diffusers.training_utils import EMAModel
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from fedsynth.config_schema import GENERATOR_TRAIN_LR
from fedsynth.config_schema import DATASETS
from fedsynth.learning.data import ArrayDataset, load_dataset
from fedsynth.learning.unet import denoising_loss, noised_batch
from fedsynth.errors import ConfigError
from fedsynth.process.runtime import write_atomic
from generator_service.ddpm.grid import save_class_grid
from generator_service.ddpm.loss_guard import LossGuard, TrainingDiverged
from generator_service.ddpm.model import (
    METADATA_FILE,
    SIZES,
    GeneratorMetadata,
    build_unet,
    is_generator_folder,
    make_train_scheduler,
    save_generator,
)
from generator_service.ddpm.sampling import DdimSampler, SamplingConfig, resolve_device

log = logging.getLogger(__name__)
CHECKPOINTS = "checkpoints"
PROGRESS_EVERY_S = 10.0
OPTIMIZER_FILE = "optimizer.safetensors"
LEGACY_OPTIMIZER_FILE = "optimizer.pt"
# Horizontal flips are label-preserving for natural images, not for digits.
FLIP_DATASETS = frozenset({"cifar10", "cifar100"})


@dataclass(frozen=True)
class TrainConfig:
    dataset: str
    out: Path
    size: str = "tiny"
    data_dir: Path | None = None
    steps: int = 1500  # tiny on digits: recognizable images (docs/generator.md); CIFAR needs far more
    batch_size: int = 64
    lr: float | None = None  # None: the size's, GENERATOR_TRAIN_LR (2e-3 for tiny and small, 2e-4 for half and ddpm-cifar)
    warmup_steps: int = 100
    seed: int = 0
    label_dropout: float = 0.1
    ema_decay: float = 0.999
    checkpoint_every: int = 500
    resume: bool = False
    device: str = "auto"
    guidance: float = 1.0  # stored as the serving default
    ddim_steps: int = 10  # stored as the serving default
    grid_per_class: int = 10
    threads: int = 0  # torch CPU threads; 0 keeps torch's default
    progress: bool = True
    folders: Path | None = None  # a folder of client-<k>/ folders: their training images pooled (dataset is then "npz")
    schema_file: Path | None = None  # with folders: the schema to read them with (default folders/schema.toml)

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ConfigError(f"unknown dataset {self.dataset!r}; expected one of {', '.join(DATASETS)}")
        if self.size not in SIZES:
            raise ConfigError(f"unknown generator size {self.size!r}; expected one of {', '.join(SIZES)}")
        if self.lr is None:
            object.__setattr__(self, "lr", GENERATOR_TRAIN_LR[self.size])
        for name in ("steps", "batch_size", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.label_dropout < 1.0:
            raise ConfigError(f"label_dropout must be in [0, 1), got {self.label_dropout}")
        if not 0.0 < self.ema_decay < 1.0:
            raise ConfigError(f"ema_decay must be in (0, 1), got {self.ema_decay}")
        if not self.lr > 0.0 or min(self.warmup_steps, self.grid_per_class, self.threads) < 0:
            raise ConfigError(f"bad lr={self.lr}, warmup_steps={self.warmup_steps}, grid_per_class={self.grid_per_class} "
                              f"or threads={self.threads}")
        SamplingConfig(self.ddim_steps, self.guidance, 1)  # validates both


def _identity(cfg: TrainConfig) -> dict[str, object]:
    """Settings a resumed run must share with the checkpoint it continues."""
    return {k: str(v) for k, v in asdict(cfg).items()
            if k in ("dataset", "size", "seed", "batch_size", "label_dropout") or (k == "folders" and v is not None)}


def _step_generator(seed: int, step: int) -> torch.Generator:
    """All randomness of step `step` comes from (seed, step), so a resumed run repeats an uninterrupted one."""
    state = np.random.SeedSequence([seed, step]).generate_state(2, np.uint32)
    return torch.Generator().manual_seed((int(state[0]) << 31) ^ int(state[1]))


def _checkpoint_dirs(out: Path) -> list[Path]:
    root = out / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and not p.name.endswith(".tmp"))


def _save_checkpoint(out: Path, step: int, unet: UNet2DModel, ema: EMAModel, ema_unet: UNet2DModel,
                     optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> None:
    """Write the folder step-N atomically, then delete older checkpoints."""
    final = out / CHECKPOINTS / f"step-{step:08d}"

    def write(folder: Path) -> None:
        unet.save_pretrained(folder / "unet", safe_serialization=True)
        ema.copy_to(ema_unet.parameters())
        ema_unet.save_pretrained(folder / "ema", safe_serialization=True)
        save_optimizer_state(optimizer, folder)
        (folder / "state.json").write_text(json.dumps({"step": step, "identity": _identity(cfg)}))

    write_atomic(final, write)
    for older in _checkpoint_dirs(out):
        if older != final:
            shutil.rmtree(older, ignore_errors=True)


def save_optimizer_state(optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """The AdamW state as safetensors (per-parameter tensors) and JSON (hyperparameters): no pickle."""
    state = optimizer.state_dict()
    tensors = {f"{index}.{name}": value.detach().cpu().contiguous()
               for index, entry in state["state"].items() for name, value in entry.items()}
    save_file(tensors, folder / OPTIMIZER_FILE, metadata={"param_groups": json.dumps(state["param_groups"])})


def read_optimizer_state(folder: Path) -> dict[str, object]:
    path = folder / OPTIMIZER_FILE
    if not path.exists() and (folder / LEGACY_OPTIMIZER_FILE).exists():
        # checkpoints written before 2026-12-06; fedsynth wrote them into the operator's own folder
        return torch.load(folder / LEGACY_OPTIMIZER_FILE, weights_only=True)  # type: ignore[no-any-return]
    state: dict[int, dict[str, torch.Tensor]] = {}
    with safe_open(path, framework="pt") as archive:
        groups = json.loads(archive.metadata()["param_groups"])
        for key in archive.keys():
            index, name = key.split(".", 1)
            state.setdefault(int(index), {})[name] = archive.get_tensor(key)
    for group in groups:
        group["betas"] = tuple(group["betas"])
    return {"state": state, "param_groups": groups}


def _read_unet(folder: Path) -> UNet2DModel:
    return UNet2DModel.from_pretrained(folder, use_safetensors=True, low_cpu_mem_usage=False)


def _load_checkpoint(path: Path, cfg: TrainConfig, unet: UNet2DModel, ema: EMAModel,
                     optimizer: torch.optim.Optimizer) -> int:
    state = json.loads((path / "state.json").read_text())
    if state["identity"] != _identity(cfg):
        raise ConfigError(f"cannot resume from {path}: it was trained with {state['identity']}, not {_identity(cfg)}")
    unet.load_state_dict(_read_unet(path / "unet").state_dict())
    ema_weights = _read_unet(path / "ema")
    ema.shadow_params = [p.detach().clone().to(q.device) for p, q in zip(ema_weights.parameters(), unet.parameters())]
    ema.optimization_step = int(state["step"])
    optimizer.load_state_dict(read_optimizer_state(path))
    return int(state["step"])


def train_generator(cfg: TrainConfig) -> Path:
    """Train on the dataset's full training split and write a generator folder to cfg.out; return it."""
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _train(cfg)
    finally:
        torch.set_num_threads(threads)


def _train(cfg: TrainConfig) -> Path:
    out = Path(cfg.out)
    if is_generator_folder(out) and not cfg.resume:
        raise ConfigError(f"{out} already holds a trained generator; pass --resume to continue it or pick another --out")
    checkpoints = _checkpoint_dirs(out)
    if checkpoints and not cfg.resume:
        raise ConfigError(f"{out} holds checkpoints ({checkpoints[-1].name}); pass --resume or pick another --out")
    device = resolve_device(cfg.device)
    data = training_images(cfg)
    images = torch.from_numpy(data.x).permute(0, 3, 1, 2).contiguous()  # uint8 N x C x H x W, converted per batch
    unet = build_unet(cfg.size, num_classes=data.num_classes, image_shape=data.image_shape, seed=cfg.seed).to(device)
    ema_unet = build_unet(cfg.size, num_classes=data.num_classes, image_shape=data.image_shape, seed=cfg.seed)
    ema = EMAModel(unet.parameters(), decay=cfg.ema_decay)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=cfg.lr, weight_decay=0.0)
    scheduler = make_train_scheduler()
    start = _load_checkpoint(checkpoints[-1], cfg, unet, ema, optimizer) if checkpoints else 0
    if start:
        log.info("resuming %s from step %d", out, start)
    autocast = torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    flip = cfg.dataset in FLIP_DATASETS
    unet.train()
    bar = tqdm(total=cfg.steps, initial=min(start, cfg.steps), desc=f"train {cfg.size} on {cfg.folders or cfg.dataset}",
               disable=not cfg.progress, dynamic_ncols=True)
    guard = LossGuard(warmup_steps=cfg.warmup_steps)
    progress = ProgressLine(start, cfg.steps)
    for step in range(start, cfg.steps):
        g = _step_generator(cfg.seed, step)
        idx = torch.randint(len(images), (cfg.batch_size,), generator=g)
        x0 = images[idx].float().div(127.5).sub(1.0)
        if flip:
            x0 = torch.where(torch.rand(cfg.batch_size, 1, 1, 1, generator=g) < 0.5, x0.flip(3), x0)
        noisy, t, labels, noise = noised_batch(scheduler, x0.to(device), torch.from_numpy(data.y)[idx],
                                               num_classes=data.num_classes, label_dropout=cfg.label_dropout, generator=g)
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr * min(1.0, (step + 1) / max(1, cfg.warmup_steps))
        with autocast:
            loss = denoising_loss(unet, noisy, t, labels, noise)
        why = guard.check(step, loss.item())
        if why:
            bar.close()
            raise _diverged(cfg, out, f"stopped before updating the weights: {why}")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        optimizer.step()
        ema.step(unet.parameters())
        bar.update(1)
        bar.set_postfix(loss=f"{guard.smoothed:.4f}")
        progress.step_done(step + 1, guard.smoothed)
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            with torch.no_grad(), autocast:  # the step's loss judged the weights before it, not after
                after = denoising_loss(unet, noisy, t, labels, noise).item()
            if not math.isfinite(after):
                bar.close()
                raise _diverged(cfg, out, f"the weights after step {step + 1} give a loss of {after}, so they were not saved")
            _save_checkpoint(out, step + 1, unet, ema, ema_unet, optimizer, cfg)
    bar.close()
    return _finish(cfg, out, data.num_classes, data.image_shape, unet, ema, ema_unet, device)


class ProgressLine:
    """A log line every PROGRESS_EVERY_S seconds and at the end: the step, the loss, the rate and the time left (what
    `fedsynth run` shows while it trains a generator on first use, and what a log file keeps without a terminal)."""

    def __init__(self, start: int, total: int) -> None:
        self.start, self.total = start, total
        self.started = self.last = time.monotonic()

    def step_done(self, step: int, loss: float) -> None:
        now = time.monotonic()
        if now - self.last < PROGRESS_EVERY_S and step != self.total:
            return
        self.last = now
        rate = (step - self.start) / max(now - self.started, 1e-9)
        left = (self.total - step) / rate if rate > 0 else float("inf")
        log.info("step %d/%d loss %.4f %.2f steps/s about %.0fs left", step, self.total, loss, rate, left)


def training_images(cfg: TrainConfig) -> ArrayDataset:
    """The images to learn: the dataset's training split, or the client folders' training images pooled."""
    if cfg.folders is None:
        return load_dataset(cfg.dataset, "train", data_dir=cfg.data_dir)
    from fedsynth.learning.federation_folders import folder_schema, pooled

    data = pooled(cfg.folders, folder_schema(cfg.folders, cfg.schema_file), "train")
    log.info("training on %d images pooled from the client folders in %s", len(data.y), cfg.folders)
    return data


def _diverged(cfg: TrainConfig, out: Path, why: str) -> TrainingDiverged:
    kept = _checkpoint_dirs(out)
    advice = (f"--resume from the last checkpoint, {kept[-1]}, with a lower --lr, or start again with one" if kept
              else "start again with a lower --lr")
    return TrainingDiverged(f"training {cfg.size} on {cfg.dataset} at lr {cfg.lr:g}: {why}. {advice}")


def _finish(cfg: TrainConfig, out: Path, num_classes: int, image_shape: tuple[int, int, int],
            unet: UNet2DModel, ema: EMAModel, ema_unet: UNet2DModel, device: torch.device) -> Path:
    """Save the EMA weights as the generator, then a sample grid (a row per class)."""
    ema.copy_to(ema_unet.parameters())
    metadata = GeneratorMetadata(
        dataset=cfg.dataset, num_classes=num_classes, image_shape=image_shape, size=cfg.size,
        training_steps=ema.optimization_step, guidance=cfg.guidance, ddim_steps=cfg.ddim_steps,
        extra={"seed": cfg.seed, "batch_size": cfg.batch_size, "lr": cfg.lr, "label_dropout": cfg.label_dropout,
               "ema_decay": cfg.ema_decay, **({"folders": str(cfg.folders)} if cfg.folders is not None else {})},
    )
    (out / METADATA_FILE).unlink(missing_ok=True)  # the folder is incomplete until save_generator rewrites it
    metadata = save_generator(out, ema_unet.eval(), make_train_scheduler(), metadata)
    if cfg.grid_per_class:
        sampler = DdimSampler(ema_unet, dict(make_train_scheduler().config), num_classes=num_classes,
                              image_shape=image_shape, config=SamplingConfig(cfg.ddim_steps, cfg.guidance, 64),
                              device=device)
        save_class_grid(sampler, out / "samples.png", per_class=cfg.grid_per_class, seed=cfg.seed)
    log.info("wrote generator %s to %s", metadata.model_id, out)
    return out
