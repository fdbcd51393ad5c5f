"""`fedsynth generator train`: train the class-conditional DDPM on a dataset's full training split, or on a local-mode
federation's client folders pooled (`--data`, at the schema's image size)."""

from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path

from fedsynth.errors import ConfigError
from fedsynth.generation.generator_names import PUBLIC_FILE
from generator_service.ddpm.model import SIZES
from generator_service.ddpm.training import TrainConfig, train_generator

DEFAULTS = TrainConfig(dataset="digits", out=Path("generator"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--dataset", help="digits, cifar10, cifar100 or npz (training split, all of it)")
    source.add_argument("--data", type=Path, default=None, metavar="DIR",
                        help="a folder of client-<k>/ folders (as `fedsynth data split` writes them): every client's "
                             "training images pooled, read at the schema's image size")
    parser.add_argument("--data-dir", type=Path, default=None, help="folder with train.npz/test.npz (cifar, npz)")
    parser.add_argument("--schema", type=Path, default=None,
                        help="with --data: the schema file ([data] classes, image_size, channels) (default DIR/schema.toml)")
    parser.add_argument("--size", choices=list(SIZES), default=d.size,
                        help="UNet size: tiny (~0.7M, CPU), half (~9M), ddpm-cifar (35.7M, GPU) (default %(default)s)")
    parser.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="default %(default)s")
    parser.add_argument("--lr", type=float, default=None,
                        help="AdamW learning rate after warm-up (default: the size's, 2e-3 for tiny and small, "
                             "2e-4 for half and ddpm-cifar)")
    parser.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="linear lr warm-up (default %(default)s)")
    parser.add_argument("--out", type=Path, required=True, help="generator folder to write (checkpoints go in OUT/checkpoints)")
    parser.add_argument("--seed", type=int, default=d.seed, help="seeds init, batches, noise and dropout (default %(default)s)")
    parser.add_argument("--label-dropout", type=float, default=d.label_dropout,
                        help="probability of training with the null label, for classifier-free guidance (default %(default)s)")
    parser.add_argument("--ema-decay", type=float, default=d.ema_decay, help="EMA decay of the saved weights (default %(default)s)")
    parser.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                        help="steps between atomic checkpoints (default %(default)s)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in OUT/checkpoints")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default=d.device, help="default %(default)s")
    parser.add_argument("--guidance", type=float, default=d.guidance,
                        help="serving default for the guidance weight w, stored in the folder (default %(default)s)")
    parser.add_argument("--ddim-steps", type=int, default=d.ddim_steps,
                        help="serving default for DDIM steps, stored in the folder (default %(default)s)")
    parser.add_argument("--grid-per-class", type=int, default=d.grid_per_class,
                        help="samples per class in OUT/samples.png, 0 for none (default %(default)s)")
    parser.add_argument("--threads", type=int, default=d.threads,
                        help="torch CPU threads, 0 = torch's default; 1 is fastest on a crowded CPU (default %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        dataset=args.dataset or "npz", out=args.out, size=args.size, data_dir=args.data_dir, steps=args.steps,
        folders=args.data, schema_file=args.schema,
        batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup_steps, seed=args.seed,
        label_dropout=args.label_dropout, ema_decay=args.ema_decay, checkpoint_every=args.checkpoint_every,
        resume=args.resume, device=args.device, guidance=args.guidance, ddim_steps=args.ddim_steps,
        grid_per_class=args.grid_per_class, threads=args.threads, progress=not args.no_progress,
    )


def run(args: argparse.Namespace) -> int:
    if args.schema is not None and args.data is None:
        raise ConfigError("--schema goes with --data (the schema the client folders are read with)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    out = train_generator(config_from_args(args))
    public = None if args.data_dir is None else Path(args.data_dir) / PUBLIC_FILE
    if public is not None and public.is_file():  # the data's own account of being public travels with the model
        shutil.copyfile(public, Path(out) / PUBLIC_FILE)
    print(f"generator written to {out}")
    return 0
