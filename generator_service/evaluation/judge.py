"""The judge: a classifier trained on a dataset's real training split with a fixed, seeded recipe, cached on disk.

The cache folder is keyed by dataset, data folder, seed, recipe and a digest of the training data, so a changed
recipe or dataset never reuses a stale judge. It holds the weights (safetensors), the feature statistics of the real
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

from fedsynth.data import ArrayDataset, load_dataset
from fedsynth.models import build_model
from fedsynth.runtime import write_atomic
from fedsynth.training import LocalTrainConfig, TrainData, evaluate, images_to_tensor, run_local_sgd
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

    def score(self, images: np.ndarray, batch_size: int = 512) -> tuple[np.ndarray, np.ndarray]:
        """(features N x D float64, class probabilities N x C) of uint8 N x H x W x C images."""
        return judge_outputs(self.model, images, batch_size)


def judge_outputs(model: nn.Module, images: np.ndarray, batch_size: int = 512) -> tuple[np.ndarray, np.ndarray]:
    features, probs = [], []
    model.eval()
    with torch.inference_mode():
        for start in range(0, len(images), batch_size):
            rep = model.features(images_to_tensor(images[start : start + batch_size]))  # type: ignore[operator]
            features.append(rep.double().numpy())
            probs.append(F.softmax(model.head(rep), dim=1).double().numpy())  # type: ignore[operator]
    return np.concatenate(features), np.concatenate(probs)


def _data_digest(data: ArrayDataset) -> str:
    digest = hashlib.sha256(np.ascontiguousarray(data.x).tobytes())
    digest.update(data.y.astype("<i8").tobytes())
    return digest.hexdigest()


def _new_model(recipe: JudgeRecipe, data: ArrayDataset, seed: int) -> nn.Module:
    channels, height, _ = data.image_shape
    torch.manual_seed(seed)
    return build_model(recipe.model, num_classes=data.num_classes, in_channels=channels, image_size=height)


def train_classifier(recipe: JudgeRecipe, data: ArrayDataset, seed: int, *, steps: int | None = None) -> nn.Module:
    """A fresh model trained with `recipe` on `data`: `recipe.epochs` epochs, or exactly `steps` optimizer steps."""
    model = _new_model(recipe, data, seed)
    train = TrainData(images_to_tensor(data.x), torch.from_numpy(data.y.astype(np.int64)))
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


def load_or_train_judge(dataset: str, *, data_dir: Path | None, seed: int, recipe: JudgeRecipe | None = None,
                        root: Path | None = None) -> Judge:
    """The cached judge for (dataset, data_dir, seed, recipe, training data), trained and cached when absent."""
    started = time.perf_counter()
    train = load_dataset(dataset, "train", data_dir=data_dir)
    test = load_dataset(dataset, "test", data_dir=data_dir)
    recipe = recipe or default_recipe(train.image_shape[1])
    key = {"format": FORMAT, "dataset": dataset, "data_dir": None if data_dir is None else str(Path(data_dir).resolve()),
           "seed": seed, "recipe": dataclasses.asdict(recipe), "train_sha256": _data_digest(train)}
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    folder = (root or cache_root()) / f"{dataset}-{recipe.model}-seed{seed}-{name}"
    if (folder / JUDGE_FILE).is_file():
        meta = json.loads((folder / JUDGE_FILE).read_text())
        model = _new_model(recipe, train, seed)
        model.load_state_dict(load_file(folder / WEIGHTS_FILE))
        with np.load(folder / REFERENCE_FILE, allow_pickle=False) as arrays:
            reference = FeatureStats.from_arrays(arrays, "train")
        log.info("judge loaded from %s (test accuracy %.4f)", folder, meta["test_accuracy"])
        return Judge(model.eval(), recipe, dataset, train.num_classes, train.image_shape, folder, meta["test_accuracy"],
                     meta["train_accuracy"], reference, True, time.perf_counter() - started)
    log.info("training the judge (%s, %d epochs, seed %d) on %d real images; cached in %s",
             recipe.model, recipe.epochs, seed, len(train.y), folder)
    model = train_classifier(recipe, train, seed)
    reference = _stats(model, train)
    meta = {"key": key, "test_accuracy": accuracy(model, test), "train_accuracy": accuracy(model, train),
            "train_seconds": time.perf_counter() - started, "num_classes": train.num_classes,
            "image_shape": list(train.image_shape)}

    def write(tmp: Path) -> None:
        tmp.mkdir()
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp / WEIGHTS_FILE)
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
            "cached": judge.cached, "test_accuracy": judge.test_accuracy, "train_accuracy": judge.train_accuracy,
            "features": f"{judge.recipe.model} penultimate layer ({judge.reference.dim}-d)"}
