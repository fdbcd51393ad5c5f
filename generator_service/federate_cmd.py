"""`fedsynth generator federate`: train the class-conditional UNet across client nodes (`fedsynth run` with the "ddpm"
algorithm), then write the server's EMA weights as a generator folder with provenance.json and report.json."""

from __future__ import annotations

import argparse
import json
import logging
import tomllib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from fedsynth.assembly import algorithm_for, client_shard, clients_per_round
from fedsynth.config import RunConfig, load_config
from fedsynth.config_schema import DP_LEVELS, GENERATOR_SIZES
from fedsynth.errors import ConfigError, FedsynthError
from fedsynth.learning.data import load_dataset
from fedsynth.learning.label_schema import schema_of
from fedsynth.learning.partition import check_partition
from fedsynth.process.runtime import write_json
from generator_service.ddpm.grid import save_class_grid
from generator_service.ddpm.model import GeneratorMetadata, build_unet, is_generator_folder, make_train_scheduler, read_metadata, save_generator
from generator_service.ddpm.sampling import DdimSampler, SamplingConfig
from generator_service.run_launch import run_in_child

log = logging.getLogger("federate")
RUN_FOLDER = "run"  # DIR/run: the launcher's run folder (checkpoint, logs, report); rerunning the command resumes it
CHECKPOINT = "checkpoint.safetensors"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="run config (TOML), as `fedsynth run` takes it: data, clients, runtime, [federate]")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. data.clients=2 or federate.clip=0.5 (the flags below win)")
    parser.add_argument("--size", choices=GENERATOR_SIZES, default=None, help="UNet size (default: tiny, or the config's unet-*)")
    parser.add_argument("--rounds", type=int, default=None, help="federated rounds (train.rounds)")
    parser.add_argument("--local-steps", type=int, default=None, help="optimizer steps per client per round (federate.local_steps)")
    parser.add_argument("--dp", choices=DP_LEVELS, default=None,
                        help="none | user (DP-FedAvg: a client's whole data) | sample (DP-SGD: one image) (federate.dp)")
    parser.add_argument("--target-epsilon", type=float, default=None, help="epsilon for the whole run; picks sigma (federate.target_epsilon)")
    parser.add_argument("--delta", type=float, default=None, help="delta of the guarantee (federate.delta)")
    parser.add_argument("--init", type=Path, default=None,
                        help="warm start from this generator folder, trained on public data only (federate.init)")
    parser.add_argument("--out", type=Path, required=True, help="the generator folder to write (DIR/run holds the run)")
    parser.add_argument("--guidance", type=float, default=1.0, help="serving default for w, stored in the folder (default %(default)s)")
    parser.add_argument("--ddim-steps", type=int, default=10, help="serving default for DDIM steps (default %(default)s)")
    parser.add_argument("--grid-per-class", type=int, default=10, help="samples per class in DIR/samples.png, 0 for none (default %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="log one line per round instead of a progress bar")
    parser.add_argument("--log-level", default="INFO")


def run_overrides(args: argparse.Namespace) -> list[str]:
    """What makes a `fedsynth run` train the generator: the algorithm and model first, the user's --set, then the flags."""
    forced = ['train.algorithm="ddpm"', 'generation.policy="none"']
    if args.size is not None:
        forced_model = [f'train.model="unet-{args.size}"']
    elif any(item.strip().startswith("train.model=") for item in args.set) or _file_names_a_unet(args.config):
        forced_model = []
    else:
        forced_model = ['train.model="unet-tiny"']
    flags = {"train.rounds": args.rounds, "federate.local_steps": args.local_steps, "federate.dp": args.dp,
             "federate.target_epsilon": args.target_epsilon, "federate.delta": args.delta,
             "federate.init": None if args.init is None else str(args.init.resolve())}
    return [*forced, *forced_model, *args.set, *(f"{key}={json.dumps(value)}" for key, value in flags.items() if value is not None)]


def _file_names_a_unet(path: str | None) -> bool:
    """Whether the --config file sets train.model to a unet-* (then it, not tiny, is the default size)."""
    if path is None or not Path(path).is_file():
        return False
    try:
        model = tomllib.loads(Path(path).read_text()).get("train", {}).get("model", "")
    except (tomllib.TOMLDecodeError, AttributeError):
        return False  # load_config names what is wrong with the file
    return isinstance(model, str) and model.startswith("unet-")


def check_before_start(cfg: RunConfig) -> None:
    """Everything that can be refused in seconds, before any process starts: the split, sigma for the target epsilon
    (an unreachable target names federate.target_epsilon), the warm-start folder."""
    if cfg.federate.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("federate.device=\"cuda\" but torch sees no CUDA device here (\"auto\" uses one when present)")
    check_partition(cfg)
    algorithm = algorithm_for(cfg)
    sizes = [len(client_shard(cfg, k).y) for k in range(cfg.data.clients)] if cfg.federate.dp == "sample" else []
    algorithm.check_privacy(sizes)  # type: ignore[attr-defined]
    if cfg.federate.init is not None:
        folder = Path(cfg.federate.init)
        if not is_generator_folder(folder):
            raise ConfigError(f"federate.init={str(folder)!r} is not a generator folder (train one with `fedsynth generator train`)")
        meta = read_metadata(folder)
        if meta.size != cfg.train.model.removeprefix("unet-"):
            raise ConfigError(f"federate.init={str(folder)!r} holds a {meta.size!r} UNet, not the {cfg.train.model!r} this run trains")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    overrides = run_overrides(args)
    cfg = load_config(args.config, overrides)
    check_before_start(cfg)
    out = Path(args.out)
    if is_generator_folder(out):
        raise ConfigError(f"--out {out} already holds a generator; pick another folder")
    run_dir = out / RUN_FOLDER
    code = run_in_child(args, overrides, run_dir)
    if code != 0:
        log.error("the federated run failed (exit code %d); see %s (rerun the same command to resume)", code, run_dir / "report.json")
        return code
    export(cfg, run_dir, out, guidance=args.guidance, ddim_steps=args.ddim_steps, grid_per_class=args.grid_per_class)
    print(f"generator written to {out}")
    return 0


def export(cfg: RunConfig, run_dir: Path, out: Path, *, guidance: float, ddim_steps: int, grid_per_class: int) -> Path:
    """The server's EMA weights from the run's last checkpoint as a generator folder, then provenance.json and report.json."""
    tensors = load_file(str(run_dir / CHECKPOINT))
    prefix = "server/ema."
    ema = {name.removeprefix(prefix): value for name, value in tensors.items() if name.startswith(prefix)}
    if not ema:
        raise FedsynthError(f"{run_dir / CHECKPOINT} holds no EMA weights: it is not a federated generator's run")
    num_classes, image_shape = _run_shape(cfg)
    size = cfg.train.model.removeprefix("unet-")
    unet = build_unet(size, num_classes=num_classes, image_shape=image_shape)
    unet.load_state_dict(ema)
    report = json.loads((run_dir / "report.json").read_text())
    privacy = report.get("privacy") or {}
    rounds = len(report.get("rounds", []))
    provenance = {
        "federated": True,
        "dp": cfg.federate.dp,
        "epsilon": privacy.get("epsilon"),
        "delta": privacy.get("delta"),
        "noise_multiplier": privacy.get("noise_multiplier"),
        "clip": privacy.get("clip"),
        "sample_rate": privacy.get("sample_rate"),
        "accountant": privacy.get("accountant"),
        "per_client": privacy.get("per_client"),
        "rounds": rounds,
        "clients": cfg.data.clients,
        "clients_per_round": clients_per_round(cfg),
        "local_steps": cfg.federate.local_steps,
        "batch_size": cfg.federate.batch_size,
        "dataset": cfg.data.dataset,
        "data_source": cfg.data.source,  # local: each client trained on its own folder (no partition was cut)
        "partition": {"kind": cfg.data.partition, "alpha": cfg.data.alpha} if cfg.data.source == "split" else None,
        "size": size,
        "seed": cfg.seed,
        "init": cfg.federate.init,
        "run_id": report.get("run_id"),
        "weights": "the server's EMA of the global model",
    }
    metadata = GeneratorMetadata(
        dataset=cfg.data.dataset, num_classes=num_classes, image_shape=image_shape, size=size,
        training_steps=rounds * cfg.federate.local_steps, guidance=guidance, ddim_steps=ddim_steps,
        extra={"federated": True, "dp": cfg.federate.dp, "epsilon": privacy.get("epsilon"), "delta": privacy.get("delta"),
               "rounds": rounds, "clients": cfg.data.clients, "seed": cfg.seed},
    )
    metadata = save_generator(out, unet.eval(), make_train_scheduler(), metadata)
    write_json(out / "provenance.json", {**provenance, "model_id": metadata.model_id})
    write_json(out / "report.json", {**report, "model_dir": str(out), "provenance": provenance})
    if grid_per_class:
        sampler = DdimSampler(unet, dict(make_train_scheduler().config), num_classes=num_classes, image_shape=image_shape,
                              config=SamplingConfig(ddim_steps, guidance, 64), device=torch.device("cpu"))
        save_class_grid(sampler, out / "samples.png", per_class=grid_per_class, seed=cfg.seed)
    log.info("wrote generator %s to %s (%s)", metadata.model_id, out, _describe(provenance))
    return out


def _run_shape(cfg: RunConfig) -> tuple[int, tuple[int, int, int]]:
    """(classes, (channels, height, width)) the clients trained at: the run's schema (local mode's folders are read at
    data.image_size), else the dataset's test split."""
    schema = schema_of(cfg.data)
    if schema is not None:
        return len(schema.classes), (schema.channels, schema.image_size, schema.image_size)
    test = load_dataset(cfg.data.dataset, "test", data_dir=cfg.data.data_dir, download=cfg.data.download)
    return test.num_classes, test.image_shape


def _describe(provenance: dict[str, Any]) -> str:
    if provenance["epsilon"] is None:
        return f"{provenance['rounds']} rounds, no differential privacy"
    return f"{provenance['rounds']} rounds, dp {provenance['dp']}: epsilon {provenance['epsilon']:.3g} at delta {provenance['delta']:g}"
