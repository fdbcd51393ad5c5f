"""`fedsynth generator dpgan`: train a DP WGAN-GP on a local .npz of images and write M unlabelled samples.

An SDA-FL client node runs this as a child process on its own shard: the private images stay on its
machine, and only the samples (post-processing of a DP critic) and the (epsilon, delta) leave it.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import sys
from pathlib import Path

import numpy as np

from fedsynth.errors import ConfigError, DataError
from fedsynth.process.runtime import setup_logging, write_atomic, write_json
from generator_service.dpgan import DPGANConfig, sample_images, train_dp_wgan

log = logging.getLogger("dpgan")
CONFIG_KEYS = {
    "latent_dim", "generator_width", "critic_width", "steps", "n_critic", "batch_size", "lr", "gp_lambda",
    "max_grad_norm", "noise_multiplier", "target_epsilon", "delta", "accountant", "seed", "secure_noise",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, help=".npz with x: uint8 N x H x W x C (labels are not read); "
                        "- reads it from stdin (how a client node hands over its private shard: never on disk)")
    parser.add_argument("--out", required=True, help="folder for samples.npz and privacy.json")
    parser.add_argument("--count", type=int, required=True, help="samples to generate (M)")
    parser.add_argument("--sample-seed", type=int, default=0)
    parser.add_argument("--config-json", default="{}", help=f"DPGANConfig fields as JSON: {', '.join(sorted(CONFIG_KEYS))}")
    parser.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    setup_logging("dpgan", args.log_level)
    if args.count < 1:
        raise ConfigError(f"--count must be >= 1, got {args.count}")
    try:
        fields = json.loads(args.config_json)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--config-json is not JSON ({exc})") from exc
    unknown = sorted(set(fields) - CONFIG_KEYS)
    if unknown:
        raise ConfigError(f"--config-json has unknown keys {unknown}")
    cfg = DPGANConfig(**fields)
    source = io.BytesIO(sys.stdin.buffer.read()) if args.data == "-" else args.data
    try:
        with np.load(source, allow_pickle=False) as archive:
            x = np.ascontiguousarray(archive["x"])
    except (OSError, EOFError, KeyError, ValueError) as exc:
        raise DataError(f"{'stdin' if args.data == '-' else args.data}: expected an .npz with an array 'x' ({exc})") from exc
    result = train_dp_wgan(x, cfg)
    log.info("trained: %s in %.1fs", result.privacy_statement(), result.train_seconds)
    samples = sample_images(result.generator, args.count, seed=args.sample_seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    np.savez(buffer, x=samples)
    write_atomic(out / "samples.npz", buffer.getvalue())
    write_json(
        out / "privacy.json",
        {
            "epsilon": result.epsilon,
            "delta": result.delta,
            "noise_multiplier": result.noise_multiplier,
            "sample_rate": result.sample_rate,
            "critic_steps": result.critic_steps,
            "accountant": result.accountant,
            "gan_seconds": result.train_seconds,
            "statement": result.privacy_statement(),
        },
    )
    return 0
