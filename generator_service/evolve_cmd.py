"""`fedsynth generator evolve`: Private Evolution over the runtime (`fedsynth run` with the "pe" algorithm): a public
generator's images, selected by the clients' noisy nearest-neighbour votes, written as a servable generator folder."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file

from fedsynth.assembly import algorithm_for, clients_per_round
from fedsynth.config import RunConfig, load_config
from fedsynth.config_schema import DP_LEVELS
from fedsynth.errors import ConfigError, FedsynthError
from fedsynth.generation.generator_names import METADATA_FILE, PUBLIC_FILE
from fedsynth.learning.partition import check_partition
from fedsynth.learning.public_embedder import RECORD, weights_sha256
from fedsynth.process.runtime import write_atomic, write_json
from generator_service.evolved import EVOLVED_FILE, evolved_model_id, save_class_grid_of
from generator_service.run_launch import run_in_child

log = logging.getLogger("evolve")
RUN_FOLDER = "run"  # DIR/run: the launcher's run folder (checkpoint, logs, report); rerunning the command resumes it
CHECKPOINT = "checkpoint.safetensors"
PUBLIC_MODEL_FILES = ("config.json", "diffusion_pytorch_model.safetensors", "scheduler_config.json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="run config (TOML), as `fedsynth run` takes it: data, clients, runtime, [evolve]")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. data.clients=2 or evolve.threshold=3 (the flags below win)")
    parser.add_argument("--public-model", type=Path, required=True,
                        help="a ddpm generator folder trained on public data only (its public.json says on what)")
    parser.add_argument("--iterations", type=int, default=None, help="T: vote-and-vary iterations (train.rounds)")
    parser.add_argument("--candidates-per-class", type=int, default=None, help="M: candidates a class votes among (evolve.candidates_per_class)")
    parser.add_argument("--dp", choices=DP_LEVELS, default=None,
                        help="sample (one image is one vote) | user (a client's votes, L2-normalised) | none (evolve.dp)")
    parser.add_argument("--target-epsilon", type=float, default=None, help="epsilon for the whole run; picks sigma (evolve.target_epsilon)")
    parser.add_argument("--delta", type=float, default=None, help="delta of the guarantee (evolve.delta)")
    parser.add_argument("--embedder-model", type=Path, default=None,
                        help="vote in the features of this public classifier (scripts/train_public_embedder.py) instead "
                             "of pixels; every client node needs the same folder at the same path (its hash is pinned)")
    parser.add_argument("--out", type=Path, required=True, help="the generator folder to write (DIR/run holds the run)")
    parser.add_argument("--grid-per-class", type=int, default=10, help="evolved images per class in DIR/samples.png, 0 for none (default %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="log one line per iteration instead of a progress bar")
    parser.add_argument("--log-level", default="INFO")


def read_public(folder: Path) -> dict[str, Any]:
    """The public model's account of its data; ConfigError when the folder does not say it is public."""
    if not (folder / METADATA_FILE).is_file():
        raise ConfigError(f"--public-model {str(folder)!r} is not a generator folder ({METADATA_FILE} is missing)")
    path = folder / PUBLIC_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--public-model {str(folder)!r} does not say it was trained on public data: {PUBLIC_FILE} is "
                          f"missing or unreadable ({exc}). Write one ({{\"public_data\": ..., \"relation_to_clients\": ...}}) "
                          "only for a model no client's data shaped (docs/private-evolution.md)") from None
    if not isinstance(record, dict) or not all(isinstance(record.get(k), str) and record[k] for k in ("public_data", "relation_to_clients")):
        raise ConfigError(f"{path} must name \"public_data\" and \"relation_to_clients\" (non-empty strings), got {record!r}")
    return record


def run_overrides(args: argparse.Namespace) -> list[str]:
    """What makes a `fedsynth run` evolve: the algorithm, the public model, the user's --set, then the flags."""
    forced = ['train.algorithm="pe"', 'train.model="pe-votes"', 'generation.policy="none"', 'generation.backend="ddpm"',
              f"generation.model_dir={json.dumps(str(args.public_model.resolve()))}", "generation.evaluate_per_class=0"]
    flags = {"train.rounds": args.iterations, "evolve.candidates_per_class": args.candidates_per_class, "evolve.dp": args.dp,
             "evolve.target_epsilon": args.target_epsilon, "evolve.delta": args.delta}
    if args.embedder_model is not None:
        flags.update({"evolve.embedder": "classifier", "evolve.embedder_model": str(args.embedder_model.resolve()),
                      "evolve.embedder_sha256": weights_sha256(args.embedder_model)})
    return [*forced, *args.set, *(f"{key}={json.dumps(value)}" for key, value in flags.items() if value is not None)]


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    public = read_public(args.public_model)
    overrides = run_overrides(args)
    cfg = load_config(args.config, overrides)
    check_partition(cfg)
    algorithm_for(cfg).check_privacy([])  # type: ignore[attr-defined]  # an unreachable target names evolve.target_epsilon
    out = Path(args.out)
    if (out / METADATA_FILE).is_file():
        raise ConfigError(f"--out {out} already holds a generator; pick another folder")
    run_dir = out / RUN_FOLDER
    code = run_in_child(args, overrides, run_dir)
    if code != 0:
        log.error("the evolution failed (exit code %d); see %s (rerun the same command to resume)", code, run_dir / "report.json")
        return code
    export(cfg, run_dir, out, public_model=args.public_model, public=public, grid_per_class=args.grid_per_class)
    print(f"generator written to {out}")
    return 0


def export(cfg: RunConfig, run_dir: Path, out: Path, *, public_model: Path, public: dict[str, Any], grid_per_class: int) -> Path:
    """The last population (the variations of the last draw, as PE's output S_T) beside a copy of the public model,
    then provenance.json and report.json; fedsynth_generator.json last, so its presence marks a whole folder."""
    tensors = load_file(str(run_dir / CHECKPOINT))
    population = tensors.get("server/candidates")
    if population is None:
        raise FedsynthError(f"{run_dir / CHECKPOINT} holds no population: it is not a Private Evolution run")
    m = cfg.evolve.candidates_per_class
    labels = np.repeat(np.arange(len(population) // m), m)
    out.mkdir(parents=True, exist_ok=True)
    for name in PUBLIC_MODEL_FILES:
        shutil.copyfile(public_model / name, out / name)
    np.savez(out / EVOLVED_FILE, x=population, y=labels)
    report = json.loads((run_dir / "report.json").read_text())
    privacy = report.get("privacy") or {}
    metadata = json.loads((public_model / METADATA_FILE).read_text())
    provenance = {
        "method": "Private Evolution (Lin et al., ICLR 2024), federated",
        "public_model": {"path": str(public_model.resolve()), "model_id": metadata.get("model_id"), **public},
        "embedder": embedder_provenance(cfg),
        "iterations": len(report.get("rounds", [])),
        "candidates_per_class": m,
        "dp": cfg.evolve.dp,
        "epsilon": privacy.get("epsilon"),
        "delta": privacy.get("delta"),
        "noise_multiplier": privacy.get("noise_multiplier"),
        "sample_rate": privacy.get("sample_rate"),
        "accountant": privacy.get("accountant"),
        "threshold": privacy.get("threshold"),
        "strength": [cfg.evolve.strength_start, cfg.evolve.strength_end],
        "clients": cfg.data.clients,
        "clients_per_round": clients_per_round(cfg),
        "dataset": cfg.data.dataset,
        "data_source": cfg.data.source,
        "partition": {"kind": cfg.data.partition, "alpha": cfg.data.alpha} if cfg.data.source == "split" else None,
        "seed": cfg.seed,
        "run_id": report.get("run_id"),
    }
    write_json(out / "provenance.json", provenance)
    write_json(out / "report.json", {**report, "model_dir": str(out), "provenance": provenance})
    evolved = {"public_model_id": metadata.get("model_id"), "candidates_per_class": m, "strength": cfg.evolve.strength_end,
               "dp": cfg.evolve.dp, "epsilon": privacy.get("epsilon"), "delta": privacy.get("delta"),
               "iterations": provenance["iterations"], "clients": cfg.data.clients, "seed": cfg.seed}
    metadata.update(model_id=evolved_model_id(out, metadata.get("model_id", "")),
                    extra={**metadata.get("extra", {}), "evolved": evolved})
    if grid_per_class:
        save_class_grid_of(population, labels, out / "samples.png", per_class=grid_per_class)
    write_atomic(out / METADATA_FILE, json.dumps(metadata, indent=2) + "\n")
    log.info("wrote the evolved generator %s to %s (%s)", metadata["model_id"], out, _describe(provenance))
    return out


def embedder_provenance(cfg: RunConfig) -> dict[str, Any]:
    e = cfg.evolve
    if e.embedder == "pixels":
        return {"name": "pixels", "trained_on": "nothing: hand-built (the image's pixels)"}
    assert e.embedder_model is not None
    record = json.loads((Path(e.embedder_model) / RECORD).read_text())
    return {"name": "classifier", "path": e.embedder_model, "sha256": e.embedder_sha256, "model": record["model"],
            "test_accuracy": record["test_accuracy"], "trained_on": record["public"]}


def _describe(provenance: dict[str, Any]) -> str:
    if provenance["epsilon"] is None:
        return f"{provenance['iterations']} iterations, no differential privacy"
    return (f"{provenance['iterations']} iterations, dp {provenance['dp']}: epsilon {provenance['epsilon']:.3g} "
            f"at delta {provenance['delta']:g}")
