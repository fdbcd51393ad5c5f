"""The launcher's generator backend: a ddpm model folder (configured, or trained on first use and cached), the
run's own hold-out split (`holdout`: real held-out images, nothing to train), or a saved diffusers text-to-image
pipeline (`text2image`: generation.model_dir, never downloaded)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from pathlib import Path

from tqdm import tqdm

from deploy.processes import Child, ProcessGroup, fedsynth_command
from fedsynth.config import RunConfig
from fedsynth.config_schema import BUILTIN_SCHEMAS, GENERATOR_SIDE_DIVISOR, GENERATOR_TRAIN_LR
from fedsynth.errors import ConfigError
from fedsynth.generation.generator_names import METADATA_FILE
from fedsynth.learning.label_schema import SCHEMA_FILE, schema_of

log = logging.getLogger("launcher")

TRAIN_TIMEOUT_S = 3 * 3600.0
LR_BEFORE_SIZES = 2e-3  # every size's training lr until 2026-12-05
PROGRESS_LINE = re.compile(r"step (\d+)/(\d+) loss (\S+) (\S+) steps/s about (\d+)s left")
FOLLOW_POLL_S = 1.0


def cache_root() -> Path:
    return Path(os.environ.get("FEDSYNTH_CACHE", Path.home() / ".cache" / "fedsynth"))


def default_model_dir(cfg: RunConfig) -> Path:
    g = cfg.generation
    lr = GENERATOR_TRAIN_LR[g.size]
    # Folders trained before the lr depended on the size had 2e-3: a half model cached then (collapsed) is not reused.
    trained_with = "" if lr == LR_BEFORE_SIZES else f"-lr{lr:g}"
    data = cfg.data.dataset
    if cfg.data.source == "local":  # the client folders pooled, at the schema's size: their path and schema name them
        schema = schema_of(cfg.data)
        identity = json.dumps([str(Path(str(cfg.data.local_dir)).resolve()), schema.digest() if schema else None])
        data = f"folders-{hashlib.sha256(identity.encode()).hexdigest()[:12]}"
    return cache_root() / "generators" / f"{data}-{g.size}-{g.train_steps}steps-seed{cfg.seed}{trained_with}"


def run_shape(cfg: RunConfig) -> tuple[int, tuple[int, int, int]] | None:
    """(classes, (channels, height, width)) of the run's images; None where the schema is left to an npz file."""
    schema = schema_of(cfg.data)
    if schema is None:
        return None
    return len(schema.classes), (schema.channels, schema.image_size, schema.image_size)


def check_generator_shape(cfg: RunConfig) -> None:
    """Before any process starts: the ddpm generator the launcher would serve makes the run's classes and image shape
    (a FedEAS client cannot train on 8x8 synthetic digits beside 16x16 real ones)."""
    g = cfg.generation
    wanted = run_shape(cfg)
    if g.policy == "none" or g.generator is not None or g.backend != "ddpm" or wanted is None:
        return
    classes, (channels, size, _) = wanted
    asked = f"data.image_size = {size} and data.channels = {channels} ({channels}x{size}x{size}, {classes} classes)"
    if g.model_dir is not None:
        path = Path(g.model_dir) / METADATA_FILE
        try:
            meta = json.loads(path.read_text())
            made = (int(meta["num_classes"]), tuple(int(n) for n in meta["image_shape"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"generation.model_dir {g.model_dir!r}: {METADATA_FILE} is missing or unreadable ({exc})") from None
        if made != wanted:
            c, h, w = made[1]
            raise ConfigError(
                f"generation.model_dir {g.model_dir!r} makes {c}x{h}x{w} images of {made[0]} classes, but the run's "
                f"{asked}: train a generator at that size (`fedsynth generator train --data DIR`, docs/generator.md) "
                "or run without one (generation.policy = \"none\")")
    elif cfg.data.source == "local" and size % GENERATOR_SIDE_DIVISOR[g.size]:
        fits = [name for name, divisor in GENERATOR_SIDE_DIVISOR.items() if size % divisor == 0]
        raise ConfigError(
            f"generation.size = {g.size!r} (the UNet trained on first use) needs data.image_size divisible by "
            f"{GENERATOR_SIDE_DIVISOR[g.size]}, got {size}: "
            + (f"use generation.size = {fits[0]!r}" if fits else "use an even data.image_size"))
    elif cfg.data.source != "local" and cfg.data.dataset in BUILTIN_SCHEMAS:
        names, native, native_channels = BUILTIN_SCHEMAS[cfg.data.dataset]
        if (len(names), (native_channels, native, native)) != wanted:
            raise ConfigError(
                f"the generator trained on first use learns {cfg.data.dataset}'s own {native_channels}x{native}x{native} "
                f"images, but the run's {asked}: use client folders at that size (`fedsynth data split --image-size "
                f"{size}`, data.source = \"local\"; the generator then learns them) or set generation.model_dir")


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
    if cfg.data.source == "local":  # the operator's test bench holds every client folder: learn them, at the run's size
        schema = schema_of(cfg.data)
        assert schema is not None  # local mode needs the schema (DataConfig.check)
        schema_file = group.log_dir.parent / SCHEMA_FILE
        schema_file.parent.mkdir(parents=True, exist_ok=True)
        schema_file.write_text(schema.to_toml())
        source = ["--data", str(cfg.data.local_dir), "--schema", str(schema_file)]
    else:
        source = ["--dataset", cfg.data.dataset] + (["--data-dir", cfg.data.data_dir] if cfg.data.data_dir else [])
    command = fedsynth_command(
        "generator", "train", *source, "--size", cfg.generation.size,
        "--steps", str(cfg.generation.train_steps), "--seed", str(cfg.seed), "--out", str(folder), "--no-progress",
        # one thread per process unless set: torch's default (every core) beside the other processes ran ~9x slower here
        "--threads", str(cfg.runtime.torch_threads),
    )
    if (folder / "checkpoints").is_dir():
        command.append("--resume")
    child = group.start("generator-train", command)
    log.info("training the generator on first use (%s UNet, %d steps; cached in %s for later runs); log: %s",
             cfg.generation.size, cfg.generation.train_steps, folder, child.log_path)
    code = follow_training(child, cfg.generation.train_steps)
    if code != 0 or not (folder / METADATA_FILE).is_file():
        tail = child.log_path.read_text(errors="replace").strip().splitlines()[-3:]
        raise ConfigError(f"training the generator failed (exit {code}); see {child.log_path}:\n  " + "\n  ".join(tail))
    return folder


def follow_training(child: Child, steps: int) -> int:
    """Wait for `generator train` (at most TRAIN_TIMEOUT_S), showing its progress lines as a bar with an estimate on
    a terminal, else as a log line a minute; its exit code."""
    bar = tqdm(total=steps, desc="generator training", unit="step", disable=None, dynamic_ncols=True)
    stop_at, logged = time.monotonic() + TRAIN_TIMEOUT_S, time.monotonic()
    try:
        while child.process.poll() is None:
            if time.monotonic() > stop_at:
                child.process.kill()
                raise ConfigError(f"training the generator took more than {TRAIN_TIMEOUT_S:.0f}s; see {child.log_path}")
            time.sleep(FOLLOW_POLL_S)
            found = PROGRESS_LINE.findall(child.log_path.read_text(errors="replace")[-4096:])
            if not found:
                continue
            step, total, loss, _rate, left = found[-1]
            bar.n = int(step)
            bar.set_postfix(loss=loss, left=f"{int(left) // 60}m{int(left) % 60:02d}s")
            if bar.disable and time.monotonic() - logged >= 60:
                logged = time.monotonic()
                log.info("generator training: step %s/%s, loss %s, about %ss left", step, total, loss, left)
        return child.process.returncode
    finally:
        bar.close()


def check_backend(cfg: RunConfig) -> None:
    """Refuse a configuration whose backend cannot serve this run, naming the keys to change."""
    if cfg.generation.backend == "holdout" and cfg.data.source == "local":
        if cfg.generation.generator is None and not (Path(str(cfg.data.local_dir)) / "holdout").is_dir():
            raise ConfigError(
                f"generation.backend = 'holdout' in local mode serves data.local_dir/holdout, but {cfg.data.local_dir!r} "
                "has none; write one with `fedsynth data split --holdout-fraction F`, or use generation.backend = 'ddpm'"
            )
    elif cfg.generation.backend == "holdout" and cfg.data.holdout_fraction == 0:
        raise ConfigError(
            "generation.backend = 'holdout' serves held-out real images, but data.holdout_fraction = 0 holds none out; "
            "set data.holdout_fraction in (0, 1), e.g. 0.1, or use generation.backend = 'ddpm'"
        )
    if cfg.generation.min_confidence > 0 and cfg.generation.generator is not None:
        raise ConfigError(
            f"generation.min_confidence = {cfg.generation.min_confidence!r} is a setting of the generator the launcher "
            f"starts, but generation.generator = {cfg.generation.generator!r} names a running one: start that one with "
            "`fedsynth generator serve --min-confidence ...` and leave generation.min_confidence at 0"
        )
    if cfg.generation.backend == "text2image" and cfg.generation.model_dir is None and cfg.generation.generator is None:
        raise ConfigError(
            "generation.backend = 'text2image' needs generation.model_dir: a folder written by a diffusers pipeline's "
            "save_pretrained (nothing is downloaded; see docs/generator.md)"
        )


def serve_arguments(cfg: RunConfig, group: ProcessGroup) -> list[str]:
    """The flags for `fedsynth generator serve`: the backend's and the quality filter's."""
    flags = backend_arguments(cfg, group)
    if cfg.generation.min_confidence > 0:  # the judge learns from the run's real training split
        flags += ["--min-confidence", repr(cfg.generation.min_confidence)]
        if cfg.data.data_dir and "--data-dir" not in flags:
            flags += ["--data-dir", cfg.data.data_dir]
    return flags


def backend_arguments(cfg: RunConfig, group: ProcessGroup) -> list[str]:
    """The backend's flags for `fedsynth generator serve`; trains the ddpm model first when none is cached."""
    check_backend(cfg)
    g = cfg.generation
    if g.backend == "holdout" and cfg.data.source == "local":  # the held-out folder `data split` wrote beside the clients'
        return ["--backend", "holdout", "--holdout-dir", str(Path(str(cfg.data.local_dir)) / "holdout")]
    if g.backend == "holdout":  # the same split as the coordinator and clients: same dataset, fraction and seed
        flags = ["--backend", "holdout", "--dataset", cfg.data.dataset,
                 "--holdout-fraction", repr(cfg.data.holdout_fraction), "--seed", str(cfg.seed)]
        return flags + (["--data-dir", cfg.data.data_dir] if cfg.data.data_dir else [])
    if g.backend == "text2image":  # steps and w as for ddpm (diffusers' guidance_scale = 1 + w); prompts from the data
        assert g.model_dir is not None
        flags = ["--backend", "text2image", "--model", g.model_dir, "--dataset", cfg.data.dataset,
                 "--ddim-steps", str(g.ddim_steps), "--guidance", str(g.guidance), "--prompt-template", g.prompt_template]
        flags += ["--data-dir", cfg.data.data_dir] if cfg.data.data_dir else []
        names_file = g.class_names_file
        if names_file is None and cfg.data.classes is not None:  # the federation's schema names the classes: prompt those
            names_path = group.log_dir.parent / "class_names.txt"
            names_path.parent.mkdir(parents=True, exist_ok=True)
            names_path.write_text("".join(f"{name.replace('_', ' ')}\n" for name in cfg.data.classes))
            names_file = str(names_path)
        return flags + (["--class-names-file", names_file] if names_file else [])
    model_dir = ensure_generator_model(cfg, group)
    return ["--backend", "ddpm", "--model", str(model_dir), "--ddim-steps", str(g.ddim_steps), "--guidance", str(g.guidance)]
