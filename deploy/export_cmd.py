"""`fedsynth export RUN_DIR --out FILE`: the run's final global model as a safetensors state dict (FILE) and a JSON
sidecar beside it (FILE with the suffix .json): what `fedsynth predict` and `fedsynth.load_model` read.

RUN_DIR is a `fedsynth run` folder (report.json, config.json, checkpoint.safetensors) or a coordinator's run folder
(coordinator.json, checkpoint.safetensors). The checkpoint is read with safetensors only, and its model tensors are
checked against the model the run's config builds (assembly.model_for) before anything is written."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from fedsynth.errors import ConfigError, DataError

CHECKPOINT = "checkpoint.safetensors"  # coordinator/checkpoint.py's FILE_NAME (a role's module: not imported here)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR",
                        help="a run folder (`fedsynth run`: report.json, config.json) or a coordinator's run folder "
                             "(coordinator.json), holding checkpoint.safetensors")
    parser.add_argument("--out", required=True, metavar="FILE",
                        help="the weights file to write (safetensors); its sidecar is FILE with the suffix .json")


def _json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        content = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(content, dict):
        raise DataError(f"{path}: not a JSON object")
    return content


def _run_config(folder: Path, coordinator: dict[str, Any] | None, report: dict[str, Any] | None) -> Any:
    from fedsynth.config import from_dict

    sources = [(folder / "config.json", _json(folder / "config.json")),
               (folder / "coordinator.json", (coordinator or {}).get("config")),
               (folder / "report.json", (report or {}).get("config"))]
    for path, raw in sources:
        if isinstance(raw, dict):
            try:
                return from_dict(raw)
            except ConfigError as exc:
                raise ConfigError(f"{path}: the run's config: {exc}") from None
    raise DataError(f"{folder}: holds no run config (config.json, or coordinator.json's \"config\"): not a run folder")


def _classes_and_shape(cfg: Any) -> tuple[list[str], int, int]:
    """(class names in label order, image side, channels): the run's label schema (data.classes or the built-in
    dataset's), else, as the coordinator does, the dataset's test split (names "0".."C-1")."""
    from fedsynth.learning.label_schema import schema_of

    schema = schema_of(cfg.data)
    if schema is not None:
        return list(schema.classes), schema.image_size, schema.channels
    from fedsynth.learning.data import load_dataset

    try:
        test = load_dataset(cfg.data.dataset, "test", data_dir=cfg.data.data_dir, download=False)
    except DataError as exc:
        raise DataError(f"the run's data.classes is not set and its test data cannot be read for the class count "
                        f"({exc})") from None
    channels, size, _ = test.image_shape
    return [str(c) for c in range(test.num_classes)], size, channels


def _final_accuracy(rounds_done: int, coordinator: dict[str, Any] | None,
                    report: dict[str, Any] | None) -> float | None:
    """The accuracy the run recorded for the checkpoint's round (None: not recorded, e.g. off eval_every)."""
    for record in (report, coordinator):
        if not record:
            continue
        if rounds_done == 0:
            initial = record.get("initial_accuracy", (record.get("initial") or {}).get("accuracy"))
            return None if initial is None else float(initial)
        for entry in record.get("rounds") or []:
            if isinstance(entry, dict) and entry.get("round") == rounds_done:
                accuracy = entry.get("accuracy")
                return None if accuracy is None else float(accuracy)
    return None


def export(run_dir: str | Path, out: str | Path) -> tuple[Path, Path]:
    """Write the model file and its sidecar; return both paths."""
    from fedsynth.assembly import algorithm_for, model_for
    from fedsynth.learning.model_file import RESIZE, check_state, normalisation, read_checkpoint_model, write_model_file

    folder = Path(run_dir)
    if not folder.is_dir():
        raise ConfigError(f"run folder {str(folder)!r} does not exist" if not folder.exists() else f"{str(folder)!r} is not a folder")
    if not (folder / CHECKPOINT).is_file():
        raise DataError(f"{folder}: no {CHECKPOINT} (the coordinator writes it after each completed round)")
    coordinator, report = _json(folder / "coordinator.json"), _json(folder / "report.json")
    cfg = _run_config(folder, coordinator, report)
    if cfg.train.algorithm == "ddpm":
        raise ConfigError(f"{folder}: a federated generator run (train.algorithm = \"ddpm\"): its UNet is served by "
                          "`fedsynth generator serve`, not exported as a classifier")
    state, rounds_done, record = read_checkpoint_model(folder / CHECKPOINT)
    classes, image_size, channels = _classes_and_shape(cfg)
    model = model_for(cfg, num_classes=len(classes), in_channels=channels, image_size=image_size)
    check_state(state, model.state_dict(), f"{folder / CHECKPOINT} against train.model = {cfg.train.model!r}")
    model.load_state_dict(state, strict=True)
    projection_dim = int(getattr(algorithm_for(cfg), "projection_dim", 0)) if cfg.train.algorithm == "moon" else 0
    source = (report or {}).get("accuracy_source") or ("federated" if cfg.train.evaluation == "federated" else "server")
    sidecar = {
        "classes": classes,
        "image_size": image_size,
        "channels": channels,
        "normalisation": normalisation(channels),
        "resize": RESIZE,
        "model": cfg.train.model,
        "algorithm": cfg.train.algorithm,
        "moon_projection_dim": projection_dim,
        "run_id": record.get("fingerprint") or (coordinator or {}).get("run_id") or (report or {}).get("run_id"),
        "rounds": rounds_done,
        "final_accuracy": _final_accuracy(rounds_done, coordinator, report),
        "accuracy_source": source,
    }
    return write_model_file(out, state, sidecar)


def run(args: argparse.Namespace) -> int:
    for path in export(args.run_dir, args.out):
        print(path)
    return 0
