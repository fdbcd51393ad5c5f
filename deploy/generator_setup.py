"""The launcher's generator model: the configured folder, or a tiny one trained on first use and cached."""

from __future__ import annotations

import os
from pathlib import Path

from deploy.processes import ProcessGroup, fedsynth_command
from fedsynth.config import RunConfig
from fedsynth.errors import ConfigError

METADATA_FILE = "fedsynth_generator.json"  # written last by `fedsynth generator train`: its presence marks a whole model
TRAIN_TIMEOUT_S = 3 * 3600.0


def cache_root() -> Path:
    return Path(os.environ.get("FEDSYNTH_CACHE", Path.home() / ".cache" / "fedsynth"))


def default_model_dir(cfg: RunConfig) -> Path:
    g = cfg.generation
    return cache_root() / "generators" / f"{cfg.data.dataset}-{g.size}-{g.train_steps}steps-seed{cfg.seed}"


def ensure_generator_model(cfg: RunConfig, group: ProcessGroup) -> Path:
    """Return a trained generator folder, training one (resumable, in a child process) when none is there."""
    if cfg.generation.model_dir is not None:
        folder = Path(cfg.generation.model_dir)
        if not (folder / METADATA_FILE).is_file():
            raise ConfigError(f"generation.model_dir {str(folder)!r} holds no trained generator ({METADATA_FILE} is missing)")
        return folder
    folder = default_model_dir(cfg)
    if (folder / METADATA_FILE).is_file():
        return folder
    command = fedsynth_command(
        "generator", "train", "--dataset", cfg.data.dataset, "--size", cfg.generation.size,
        "--steps", str(cfg.generation.train_steps), "--seed", str(cfg.seed), "--out", str(folder), "--no-progress",
    )
    if cfg.data.data_dir:
        command += ["--data-dir", cfg.data.data_dir]
    if (folder / "checkpoints").is_dir():
        command.append("--resume")
    child = group.start("generator-train", command)
    code = child.process.wait(timeout=TRAIN_TIMEOUT_S)
    if code != 0 or not (folder / METADATA_FILE).is_file():
        tail = child.log_path.read_text(errors="replace").strip().splitlines()[-3:]
        raise ConfigError(f"training the generator failed (exit {code}); see {child.log_path}:\n  " + "\n  ".join(tail))
    return folder
