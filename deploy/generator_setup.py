"""The launcher's generator backend: a ddpm model folder (configured, or trained on first use and cached), the
run's own hold-out split (`holdout`: real held-out images, nothing to train), or a saved diffusers text-to-image
pipeline (`text2image`: generation.model_dir, never downloaded)."""

from __future__ import annotations

import os
from pathlib import Path

from deploy.processes import ProcessGroup, fedsynth_command
from fedsynth.config import RunConfig
from fedsynth.config_schema import GENERATOR_TRAIN_LR
from fedsynth.errors import ConfigError
from fedsynth.generation.generator_names import METADATA_FILE

TRAIN_TIMEOUT_S = 3 * 3600.0
LR_BEFORE_SIZES = 2e-3  # every size's training lr until 2026-12-05


def cache_root() -> Path:
    return Path(os.environ.get("FEDSYNTH_CACHE", Path.home() / ".cache" / "fedsynth"))


def default_model_dir(cfg: RunConfig) -> Path:
    g = cfg.generation
    lr = GENERATOR_TRAIN_LR[g.size]
    # Folders trained before the lr depended on the size had 2e-3: a half model cached then (collapsed) is not reused.
    trained_with = "" if lr == LR_BEFORE_SIZES else f"-lr{lr:g}"
    return cache_root() / "generators" / f"{cfg.data.dataset}-{g.size}-{g.train_steps}steps-seed{cfg.seed}{trained_with}"


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
