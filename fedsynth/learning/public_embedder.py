"""A public feature extractor for Private Evolution's votes: a classifier trained on PUBLIC images only, whose
penultimate features (model.features) stand in for the Inception embeddings DPSDA uses. Saved as a folder:
`embedder.safetensors` (the state dict, never pickle) and `embedder.json` (architecture, classes, image shape, its
test accuracy, and the public data's own public.json)."""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from fedsynth.errors import ConfigError
from fedsynth.learning.data import load_dataset
from fedsynth.learning.models import build_model, has_features_head
from fedsynth.learning.training import LocalTrainConfig, TrainData, evaluate, images_to_tensor, run_local_sgd

WEIGHTS = "embedder.safetensors"
RECORD = "embedder.json"
_LOADING = threading.Lock()  # the logical clients of one node ask at once; load the file once


def train_public_embedder(data_dir: Path, out: Path, *, model: str = "cnn", epochs: int = 5, seed: int = 0,
                          lr: float = 1e-3, public: dict[str, Any]) -> dict[str, Any]:
    """Train `model` on data_dir/train.npz (public images), score it on data_dir/test.npz, write the folder."""
    train, test = load_dataset("npz", "train", data_dir=data_dir), load_dataset("npz", "test", data_dir=data_dir)
    channels, height, _ = train.image_shape
    torch.manual_seed(seed)
    net = build_model(model, num_classes=train.num_classes, in_channels=channels, image_size=height)
    if not has_features_head(net):
        raise ConfigError(f"--model {model!r} has no features(x) / head(rep) split to embed with")
    data = TrainData(images_to_tensor(train.x), torch.as_tensor(train.y))
    cfg = LocalTrainConfig(lr=lr, batch_size=64, local_epochs=epochs, optimizer="adam", augment=channels == 3)
    steps, loss = run_local_sgd(net, data, cfg, torch.Generator().manual_seed(seed), loss_fn=lambda x, y: nn.functional.cross_entropy(net(x), y))
    _, accuracy = evaluate(net, TrainData(images_to_tensor(test.x), torch.as_tensor(test.y)))
    out.mkdir(parents=True, exist_ok=True)
    save_file({key: value.contiguous() for key, value in net.state_dict().items()}, str(out / WEIGHTS))
    record = {"model": model, "num_classes": train.num_classes, "image_shape": [channels, height, height], "epochs": epochs,
              "steps": steps, "train_loss": loss, "test_accuracy": accuracy, "seed": seed, "public": public}
    (out / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return record


def weights_sha256(folder: Path) -> str:
    """What a run pins (evolve.embedder_sha256): every node checks its copy against it before voting."""
    try:
        return hashlib.sha256((Path(folder) / WEIGHTS).read_bytes()).hexdigest()
    except OSError as exc:
        raise ConfigError(f"evolve.embedder_model {str(folder)!r}: {WEIGHTS} cannot be read ({exc.strerror})") from None


@functools.lru_cache(maxsize=4)
def _load(folder: str, sha256: str) -> nn.Module:
    found = weights_sha256(Path(folder))
    if found != sha256:
        raise ConfigError(f"evolve.embedder_model {folder!r} holds weights of sha256 {found[:16]}..., but the run pins "
                          f"evolve.embedder_sha256 {sha256[:16]}...: every node must embed with the same public model")
    record = json.loads((Path(folder) / RECORD).read_text())
    channels, height, _ = record["image_shape"]
    net = build_model(record["model"], num_classes=record["num_classes"], in_channels=channels, image_size=height)
    net.load_state_dict(load_file(str(Path(folder) / WEIGHTS)))
    return net.eval()


def load_public_embedder(folder: str, sha256: str) -> nn.Module:
    """The classifier in `folder`, checked against the pinned hash, loaded once per process (eval mode)."""
    with _LOADING:
        return _load(folder, sha256)
