"""`fedsynth data split`: write per-client folders (split mode's shards) and schema.toml for local mode."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from fedsynth.config import DataConfig
from fedsynth.config_schema import DATA_FORMATS, DATASETS, PARTITIONS
from fedsynth.errors import ConfigError
from fedsynth.learning.label_schema import schema_of
from fedsynth.learning.split_export import SplitRequest, write_split


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", required=True, choices=DATASETS, help="the dataset to cut (as data.dataset)")
    parser.add_argument("--data-dir", help="folder holding train.npz and test.npz (or a torchvision copy) of the dataset")
    parser.add_argument("--clients", type=int, required=True, help="number of clients K (client-0 .. client-K-1)")
    parser.add_argument("--alpha", type=float, default=0.1, help="Dirichlet concentration (default 0.1)")
    parser.add_argument("--seed", type=int, default=0, help="the run's seed: the same shards as split mode with it (default 0)")
    parser.add_argument("--partition", choices=PARTITIONS, default="dirichlet", help="partition scheme (default dirichlet)")
    parser.add_argument("--min-size", type=int, default=10, help="as data.min_size (default 10)")
    parser.add_argument("--holdout-fraction", type=float, default=0.0,
                        help="share of the training split kept out of every client and written to OUT/holdout (default 0)")
    parser.add_argument("--classes", help="class names in label order, comma-separated (needed for --dataset npz)")
    parser.add_argument("--format", choices=DATA_FORMATS, default="imagefolder",
                        help="imagefolder: train/<class>/NNNNNN.png and test/; npz: train.npz and test.npz (x, y, classes); "
                             "hf: a Hugging Face datasets save_to_disk folder (default imagefolder)")
    parser.add_argument("--image-size", type=int, default=None,
                        help="resize every image to this side (bilinear), e.g. 16 for 16x16 digits (default: as stored)")
    parser.add_argument("--out", required=True, help="folder to create (must not exist or be empty)")


def run(args: argparse.Namespace) -> int:
    classes = tuple(name.strip() for name in args.classes.split(",")) if args.classes else None
    try:
        data = DataConfig(dataset=args.dataset, data_dir=args.data_dir, clients=args.clients, partition=args.partition,
                          alpha=args.alpha, min_size=args.min_size, holdout_fraction=args.holdout_fraction, classes=classes)
    except ConfigError as exc:  # name the flag, not the config key
        raise ConfigError(str(exc).replace("data.", "--").replace("_", "-")) from None
    schema = schema_of(data)
    if schema is None:  # npz: the names from the flag, the shape from the data
        from fedsynth.learning.data import load_dataset
        from fedsynth.learning.label_schema import LabelSchema

        if classes is None:
            raise ConfigError(f"--dataset {args.dataset} needs --classes (class names in label order)")
        c, size, _ = load_dataset(args.dataset, "train", data_dir=args.data_dir).image_shape
        schema = LabelSchema(classes, size, c)
    if args.image_size is not None:
        if not 4 <= args.image_size <= 1024:
            raise ConfigError(f"--image-size must be in 4..1024, got {args.image_size}")
        schema = dataclasses.replace(schema, image_size=args.image_size)
    provenance = write_split(SplitRequest(data, args.seed, args.format, Path(args.out), args.image_size), schema)
    sizes = [sum(row) for row in provenance["train_counts"]]  # type: ignore[attr-defined]
    print(json.dumps({"out": args.out, "clients": args.clients, "train_sizes": sizes, "format": args.format}))
    return 0
