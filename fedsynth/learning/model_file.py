"""The trained model back: a safetensors state dict and its JSON sidecar (`fedsynth export`), the model rebuilt from
them (`fedsynth.load_model`), and images prepared exactly as a client's local data loader prepares them
(`fedsynth predict`). Only safetensors is ever read: no pickle, no torch.load.

The sidecar, FILE with the suffix `.json` beside FILE: {"format": "fedsynth-model", "version": 1, "classes" (names in
label order), "image_size", "channels", "normalisation", "resize", "model" (train.model), "algorithm",
"moon_projection_dim" (0 unless MOON's projection head wraps the model), "run_id", "rounds", "final_accuracy",
"accuracy_source", "sha256" (of FILE)}.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fedsynth.errors import ConfigError, DataError
from fedsynth.learning.local_data import DECODE_THREADS, IMAGE_SUFFIXES, FolderRules, _decode
from fedsynth.learning.models import ProjectedModel, build_model
from fedsynth.learning.training import images_to_tensor

FORMAT = "fedsynth-model"
VERSION = 1
MODEL_PREFIX = "model/"  # the global model's tensors in a coordinator checkpoint
SIDECAR_FIELDS = ("classes", "image_size", "channels", "model", "sha256")  # what load_model cannot do without


def normalisation(channels: int) -> dict[str, Any]:
    """How pixels become the model's input: fedsynth.learning.training.images_to_tensor, said exactly."""
    return {
        "input": "uint8 pixels 0..255, N x C x H x W (channels first)",
        "formula": "x / 127.5 - 1",
        "range": [-1.0, 1.0],
        "mean": [0.5] * channels,  # the same, as mean/std of pixels first scaled to [0, 1]: (x / 255 - 0.5) / 0.5
        "std": [0.5] * channels,
    }


RESIZE = ("square images of another side are resized to image_size (bilinear, Pillow); images that are not square "
          "are refused; grayscale (L) for 1 channel, RGB for 3; palette images become RGB, 1-bit images L")


def sidecar_path(weights: str | Path) -> Path:
    """FILE -> FILE with the suffix .json (model.safetensors -> model.json)."""
    return Path(weights).with_suffix(".json")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ---- reading a checkpoint and writing a model file ------------------------------------------------

def read_checkpoint_model(path: str | Path) -> tuple[dict[str, torch.Tensor], int, dict[str, Any]]:
    """(the global model's state dict, completed rounds, the checkpoint's record) of a coordinator's
    checkpoint.safetensors, read with safetensors only (the layout coordinator/checkpoint.py writes)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no checkpoint (the coordinator writes checkpoint.safetensors after each round)")
    try:
        with safe_open(str(path), framework="pt") as handle:  # the model's tensors only, not the server state
            meta = handle.metadata() or {}
            state = {key[len(MODEL_PREFIX):]: handle.get_tensor(key) for key in handle.keys()
                     if key.startswith(MODEL_PREFIX)}
        rounds = int(meta["completed_rounds"])
        record = json.loads(meta.get("record") or "{}")
    except (SafetensorError, OSError, KeyError, ValueError) as exc:
        raise DataError(f"{path}: not a fedsynth checkpoint ({type(exc).__name__}: {exc})") from None
    if not state:
        raise DataError(f"{path}: holds no model/ tensors (not a fedsynth checkpoint)")
    return state, rounds, record


def write_model_file(out: str | Path, state: dict[str, torch.Tensor], sidecar: dict[str, Any]) -> tuple[Path, Path]:
    """Write the weights (safetensors) and the sidecar beside them; the sidecar's sha256 is the weights file's."""
    from safetensors.torch import save_file

    weights = Path(out)
    if weights.suffix == ".json":
        raise ConfigError(f"--out {str(out)!r}: the weights file's name must not end in .json (its sidecar does)")
    weights.parent.mkdir(parents=True, exist_ok=True)
    tmp = weights.with_name(f".{weights.name}.tmp")
    save_file({key: value.contiguous() for key, value in state.items()}, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, weights)
    content = {"format": FORMAT, "version": VERSION, **sidecar, "sha256": sha256_of(weights)}
    side = sidecar_path(weights)
    tmp = side.with_name(f".{side.name}.tmp")
    tmp.write_text(json.dumps(content, indent=2) + "\n")
    os.replace(tmp, side)
    return weights, side


# ---- loading ----------------------------------------------------------------------------------------

def read_sidecar(weights: str | Path) -> dict[str, Any]:
    """The sidecar of the weights file `weights`, checked for the fields load_model needs."""
    weights = Path(weights)
    side = sidecar_path(weights)
    if weights.suffix == ".json":
        raise DataError(f"{weights}: a sidecar; pass the weights file beside it (the safetensors file)")
    if not weights.is_file():
        raise DataError(f"{weights}: no such model file")
    if not side.is_file():
        raise DataError(f"{weights}: its sidecar {side} is missing (`fedsynth export` writes both)")
    try:
        content = json.loads(side.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{side}: not a readable JSON sidecar ({exc})") from None
    if not isinstance(content, dict) or content.get("format") != FORMAT:
        raise DataError(f"{side}: not a fedsynth model sidecar (no \"format\": \"{FORMAT}\")")
    if content.get("version") != VERSION:
        raise DataError(f"{side}: sidecar version {content.get('version')!r}; this fedsynth reads version {VERSION}")
    missing = [key for key in SIDECAR_FIELDS if key not in content]
    if missing:
        raise DataError(f"{side}: the sidecar has no {missing[0]!r}")
    classes = content["classes"]
    if not isinstance(classes, list) or len(classes) < 2 or not all(isinstance(c, str) for c in classes):
        raise DataError(f"{side}: \"classes\" must list at least 2 class names")
    for key in ("image_size", "channels"):
        if isinstance(content[key], bool) or not isinstance(content[key], int) or content[key] < 1:
            raise DataError(f"{side}: {key!r} must be a positive integer, got {content[key]!r}")
    return content


def build_from_sidecar(sidecar: dict[str, Any]) -> nn.Module:
    """The sidecar's model, freshly initialised: train.model built as the run built it (assembly.model_for), with
    MOON's projection head when moon_projection_dim is set."""
    num_classes = len(sidecar["classes"])
    model = build_model(sidecar["model"], num_classes=num_classes, in_channels=sidecar["channels"],
                        image_size=sidecar["image_size"])
    projection_dim = int(sidecar.get("moon_projection_dim") or 0)
    if projection_dim:
        model = ProjectedModel(model, num_classes=num_classes, projection_dim=projection_dim)
    return model


def check_state(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], where: str) -> None:
    """Strict: the same keys, shapes and dtypes; a DataError naming `where` and the first key that differs."""
    for key, value in expected.items():
        if key not in state:
            raise DataError(f"{where}: no tensor {key!r}, which the model needs")
        got = state[key]
        if tuple(got.shape) != tuple(value.shape):
            raise DataError(f"{where}: tensor {key!r} has shape {list(got.shape)}, the model's is {list(value.shape)}")
        if got.dtype != value.dtype:
            raise DataError(f"{where}: tensor {key!r} is {got.dtype}, the model's is {value.dtype}")
    extra = sorted(set(state) - set(expected))
    if extra:
        raise DataError(f"{where}: tensor {extra[0]!r} is not in the model")


def load_with_sidecar(path: str | Path) -> tuple[nn.Module, dict[str, Any]]:
    """(the model in eval mode on the CPU, its sidecar); the weights file's SHA-256 must be the sidecar's."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights = Path(path)
    sidecar = read_sidecar(weights)
    digest = sha256_of(weights)
    if digest != sidecar["sha256"]:
        raise DataError(f"{weights}: sha256 {digest} is not the sidecar's {sidecar['sha256']} "
                        f"({sidecar_path(weights).name}): the weights file was changed or belongs to another export")
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as exc:
        raise DataError(f"{weights}: not a readable safetensors file ({exc})") from None
    model = build_from_sidecar(sidecar)
    check_state(state, model.state_dict(), str(weights))
    model.load_state_dict(state, strict=True)
    return model.eval(), sidecar


def load_model(path: str | Path) -> nn.Module:
    """`fedsynth.load_model(FILE)`: the exported model, weights loaded strictly, in eval mode."""
    return load_with_sidecar(path)[0]


# ---- images, as a client's local data loader reads them ---------------------------------------------

def image_paths(inputs: Sequence[str | Path]) -> list[Path]:
    """Files as given; a folder: its PNG and JPEG files at any depth (hidden ones left out), sorted."""
    found: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            inside = sorted(p for p in path.rglob("*") if p.is_file() and p.name.lower().endswith(IMAGE_SUFFIXES)
                            and not any(part.startswith(".") for part in p.relative_to(path).parts))
            if not inside:
                raise DataError(f"{path}: a folder with no PNG or JPEG file (.png, .jpg, .jpeg) at any depth")
            found += inside
        elif path.is_file():
            found.append(path)
        else:
            raise DataError(f"{path}: no such file or folder")
    return found


def decode_for_model(paths: Sequence[Path], sidecar: dict[str, Any]) -> np.ndarray:
    """N x S x S x C uint8, each file decoded as local data decodes a client's image (local_data._decode: palette and
    1-bit converted, square images resized to S, others refused); a file whose channels are not the model's is
    refused, as the coordinator refuses such a client."""
    size, channels = sidecar["image_size"], sidecar["channels"]
    rules = FolderRules(Path("/"), "image", follow_symlinks=True)
    if not paths:
        return np.zeros((0, size, size, channels), np.uint8)
    with ThreadPoolExecutor(DECODE_THREADS) as pool:
        decoded = list(pool.map(lambda p: _decode(p, size, str(p), rules), paths))
    for path, image in zip(paths, decoded):
        if image.shape[2] != channels:
            kind = {1: "grayscale", 3: "RGB"}
            raise DataError(f"image: {path}: {image.shape[2]} channel(s) ({kind.get(image.shape[2], '?')}); the model "
                            f"takes {channels} ({kind.get(channels, '?')}) images of {size}x{size}")
    return np.stack(decoded)


def predict(model: nn.Module, x_uint8: np.ndarray, batch_size: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels, their softmax probabilities) of uint8 N x H x W x C images, scaled as in training (images_to_tensor);
    the label is the logits' argmax, as the run's evaluation counts it."""
    device = next(model.parameters()).device
    labels, probabilities = [], []
    with torch.inference_mode():
        for start in range(0, len(x_uint8), batch_size):
            logits = model(images_to_tensor(x_uint8[start : start + batch_size]).to(device)).float()
            label = logits.argmax(dim=1)
            labels.append(label.cpu())
            probabilities.append(torch.softmax(logits, dim=1).gather(1, label[:, None])[:, 0].cpu())
    if not labels:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0)
    return torch.cat(labels), torch.cat(probabilities)
