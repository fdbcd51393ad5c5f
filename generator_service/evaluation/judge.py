"""The judge: a classifier trained on a dataset's real training split with a fixed, seeded recipe, cached on disk.

The cache folder is keyed by dataset, data folder, seed, recipe and a digest of the training data, so a changed
recipe or dataset never reuses a stale judge, and by the device type when that is not the CPU (a judge trained on a
GPU has other weights). It holds the weights (safetensors), the feature statistics of the real
training split (the Fréchet reference) and `judge.json`, written last: its presence marks a complete folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from fedsynth.learning.data import ArrayDataset, load_dataset
from fedsynth.errors import ConfigError
from fedsynth.learning.models import build_model
from fedsynth.process.runtime import write_atomic
from fedsynth.learning.training import LocalTrainConfig, TrainData, evaluate, images_to_tensor, run_local_sgd
from generator_service.evaluation.metrics import FeatureStats, feature_stats

log = logging.getLogger(__name__)
JUDGE_FILE = "judge.json"
WEIGHTS_FILE = "weights.safetensors"
REFERENCE_FILE = "reference.npz"
FORMAT = 1  # bump when the cache layout or the training code changes meaning
STALE_SCRATCH_S = 3600.0  # write_atomic's scratch folder of a judge, this old: its writer was killed mid-write


@dataclass(frozen=True)
class JudgeRecipe:
    """How the judge is trained (and, with `cas_steps`, the classifier behind the classification accuracy score)."""

    model: str = "cnn"
    epochs: int = 10
    batch_size: int = 64
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    augment: bool = False  # random crop + flip; only applies to images of 32x32 and more
    cas_steps: int = 300  # optimizer steps of the CAS classifier, whatever the number of generated images


def default_recipe(image_size: int, model: str = "cnn") -> JudgeRecipe:
    """digits (8x8): 10 epochs (98.9% test accuracy, seed 0); 32x32 natural images: 15 epochs with crop + flip."""
    if image_size < 32:
        return JudgeRecipe(model=model)
    return JudgeRecipe(model=model, epochs=15, augment=True, cas_steps=1500)


def resolve_judge_device(name: str, flag: str = "--judge-device") -> torch.device:
    """auto: cuda when torch sees a GPU, else cpu; cuda without one is a ConfigError naming `flag` and the value."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"{flag} {name}: expected auto, cpu or cuda")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{flag} cuda was asked for but torch sees no CUDA device (torch.cuda.is_available() is "
                          f"False); use {flag} cpu or auto")
    return torch.device(name)


def cache_root() -> Path:
    return Path(os.environ.get("FEDSYNTH_CACHE", Path.home() / ".cache" / "fedsynth")) / "judges"


@dataclass
class Judge:
    model: nn.Module
    recipe: JudgeRecipe
    dataset: str
    num_classes: int
    image_shape: tuple[int, int, int]  # (channels, height, width)
    folder: Path
    test_accuracy: float
    train_accuracy: float
    reference: FeatureStats  # judge features of the real training split, overall and per class
    cached: bool  # True: loaded from the folder; False: trained by this call
    seconds: float

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def score(self, images: np.ndarray, batch_size: int = 512) -> tuple[np.ndarray, np.ndarray]:
        """(features N x D float64, class probabilities N x C) of uint8 N x H x W x C images."""
        return judge_outputs(self.model, images, batch_size)


def judge_outputs(model: nn.Module, images: np.ndarray, batch_size: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """Run on the model's device; numpy arrays on the CPU back."""
    device = next(model.parameters()).device
    features, probs = [], []
    model.eval()
    with torch.inference_mode():
        for start in range(0, len(images), batch_size):
            x = images_to_tensor(images[start : start + batch_size]).to(device)
            rep = model.features(x)  # type: ignore[operator]
            features.append(rep.double().cpu().numpy())
            probs.append(F.softmax(model.head(rep), dim=1).double().cpu().numpy())  # type: ignore[operator]
    return np.concatenate(features), np.concatenate(probs)


def _data_digest(data: ArrayDataset) -> str:
    digest = hashlib.sha256(np.ascontiguousarray(data.x).tobytes())
    digest.update(data.y.astype("<i8").tobytes())
    return digest.hexdigest()


def _new_model(recipe: JudgeRecipe, data: ArrayDataset, seed: int) -> nn.Module:
    channels, height, _ = data.image_shape
    torch.manual_seed(seed)
    return build_model(recipe.model, num_classes=data.num_classes, in_channels=channels, image_size=height)


def train_classifier(recipe: JudgeRecipe, data: ArrayDataset, seed: int, *, steps: int | None = None,
                     device: torch.device | str = "cpu") -> nn.Module:
    """A fresh model trained with `recipe` on `data`: `recipe.epochs` epochs, or exactly `steps` optimizer steps, on
    `device`. The same seed gives the same initial weights and batch order on every device (both drawn on the CPU);
    the data lives on `device` (CIFAR-10's training split: 0.6 GB as float32)."""
    device = torch.device(device)
    if device.type == "cuda":  # as the DDIM sampler does: no autotuned, run-dependent kernel choice
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    model = _new_model(recipe, data, seed).to(device)
    train = TrainData(images_to_tensor(data.x).to(device), torch.from_numpy(data.y.astype(np.int64)).to(device))
    epochs = recipe.epochs if steps is None else math.ceil(steps / math.ceil(len(train) / recipe.batch_size))
    cfg = LocalTrainConfig(lr=recipe.lr, momentum=recipe.momentum, weight_decay=recipe.weight_decay,
                           batch_size=recipe.batch_size, local_epochs=epochs, augment=recipe.augment, max_steps=steps)
    run_local_sgd(model, train, cfg, torch.Generator().manual_seed(seed),
                  loss_fn=lambda x, y: F.cross_entropy(model(x), y))
    return model.eval()


def accuracy(model: nn.Module, data: ArrayDataset) -> float:
    return evaluate(model, TrainData(images_to_tensor(data.x), torch.from_numpy(data.y.astype(np.int64))))[1]


def _stats(model: nn.Module, data: ArrayDataset) -> FeatureStats:
    features, _ = judge_outputs(model, data.x)
    return feature_stats(features, data.y, data.num_classes)


def judge_key(dataset: str, *, data_dir: Path | None, seed: int, recipe: JudgeRecipe, train_sha256: str,
              device: torch.device | str = "cpu") -> tuple[dict[str, Any], str]:
    """(the cache key, the cache folder's name) of a judge."""
    key: dict[str, Any] = {"format": FORMAT, "dataset": dataset, "seed": seed, "recipe": dataclasses.asdict(recipe),
                           "data_dir": None if data_dir is None else str(Path(data_dir).resolve()),
                           "train_sha256": train_sha256}
    # The device type joins the key only when it is not the CPU: the key of a CPU judge is the one used before
    # --judge-device existed, so the judges already cached (all trained on the CPU) are still found under their names.
    device_type = torch.device(device).type
    if device_type != "cpu":
        key["device"] = device_type
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return key, f"{dataset}-{recipe.model}-seed{seed}-{name}"


def load_or_train_judge(dataset: str, *, data_dir: Path | None, seed: int, recipe: JudgeRecipe | None = None,
                        root: Path | None = None, device: torch.device | str = "cpu") -> Judge:
    """The cached judge for (dataset, data_dir, seed, recipe, training data, device type), trained and cached when
    absent; it trains and scores on `device`. The quality filter keeps the CPU default: its accept/reject decisions
    must be the same on every replica whatever device serves it (`JudgeScorer` scores fixed 64-row CPU batches)."""
    started = time.perf_counter()
    device = torch.device(device)
    train = load_dataset(dataset, "train", data_dir=data_dir)
    test = load_dataset(dataset, "test", data_dir=data_dir)
    recipe = recipe or default_recipe(train.image_shape[1])
    key, name = judge_key(dataset, data_dir=data_dir, seed=seed, recipe=recipe, train_sha256=_data_digest(train),
                          device=device)
    folder = (root or cache_root()) / name
    if (folder / JUDGE_FILE).is_file():
        meta = json.loads((folder / JUDGE_FILE).read_text())
        model = _new_model(recipe, train, seed)
        model.load_state_dict(load_file(folder / WEIGHTS_FILE))
        model.to(device)
        with np.load(folder / REFERENCE_FILE, allow_pickle=False) as arrays:
            reference = FeatureStats.from_arrays(arrays, "train")
        log.info("judge loaded from %s (test accuracy %.4f)", folder, meta["test_accuracy"])
        return Judge(model.eval(), recipe, dataset, train.num_classes, train.image_shape, folder, meta["test_accuracy"],
                     meta["train_accuracy"], reference, True, time.perf_counter() - started)
    log.info("training the judge (%s, %d epochs, seed %d) on %d real images on %s; cached in %s",
             recipe.model, recipe.epochs, seed, len(train.y), device, folder)
    model = train_classifier(recipe, train, seed, device=device)
    reference = _stats(model, train)
    meta = {"key": key, "test_accuracy": accuracy(model, test), "train_accuracy": accuracy(model, train),
            "train_seconds": time.perf_counter() - started, "num_classes": train.num_classes,
            "image_shape": list(train.image_shape), "trained_on": trained_on(device)}

    def write(tmp: Path) -> None:
        tmp.mkdir()
        save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, tmp / WEIGHTS_FILE)
        np.savez(tmp / REFERENCE_FILE, **reference.to_arrays("train"))
        (tmp / JUDGE_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")

    if not (folder / JUDGE_FILE).is_file():  # another process may have finished the same judge meanwhile
        remove_stale_scratch(folder)
        try:
            write_atomic(folder, write)
        except OSError as exc:  # a folder left without judge.json (or a race): keep going, uncached
            log.warning("could not cache the judge in %s (%s)", folder, exc)
    log.info("judge trained in %.1fs: test accuracy %.4f", meta["train_seconds"], meta["test_accuracy"])
    return Judge(model, recipe, dataset, train.num_classes, train.image_shape, folder, meta["test_accuracy"],
                 meta["train_accuracy"], reference, False, time.perf_counter() - started)


def trained_on(device: torch.device | str) -> dict[str, Any]:
    """Where the judge's bits came from: the same recipe and seed give other weights under another torch or other CPU
    kernels (docs/generator.md), so judge.json records them."""
    return {"device": torch.device(device).type, "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}


def remove_stale_scratch(folder: Path) -> None:
    """Delete what a process killed while writing `folder` left beside it (write_atomic's `.<name>-*.tmp` scratch
    folder; lookups never read it). Only scratch older than STALE_SCRATCH_S: a younger one may be another process's
    write in progress (a write takes well under a second)."""
    for scratch in folder.parent.glob(f".{folder.name}-*.tmp"):
        try:
            if time.time() - scratch.stat().st_mtime > STALE_SCRATCH_S:
                shutil.rmtree(scratch, ignore_errors=True)
        except OSError:  # gone meanwhile
            pass


def describe(judge: Judge) -> dict[str, Any]:
    return {"model": judge.recipe.model, "recipe": dataclasses.asdict(judge.recipe), "folder": str(judge.folder),
            "device": judge.device.type,
            "cached": judge.cached, "test_accuracy": judge.test_accuracy, "train_accuracy": judge.train_accuracy,
            "features": f"{judge.recipe.model} penultimate layer ({judge.reference.dim}-d)"}
