"""`fedsynth generator evaluate`: how good is a generator? A judge trained on real data scores its images.

Sources (exactly one): `--generator HOST:PORT` (a running `fedsynth generator serve`), `--backend NAME` with that
backend's flags (started in this process through the same server), or `--images FILE.npz` (x uint8, y labels).
Figures: recognizability (overall and per class), classification accuracy score (CAS), a Fréchet distance in the
judge's penultimate feature space (overall and per class), the judge's own test accuracy (the ceiling); see
docs/generator.md. `--json FILE` writes them all; `--grid FILE` a PNG with a row per class.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from fedsynth.wire import tls
from fedsynth.config_schema import MODELS
from fedsynth.config_schema import DATASETS
from fedsynth.errors import ConfigError
from fedsynth.process.runtime import write_json
from generator_service.backends import get_backend
from generator_service.evaluation.judge import default_recipe, load_or_train_judge, resolve_judge_device
from generator_service.evaluation.sources import GeneratedImages, from_address, from_backend, from_npz

log = logging.getLogger(__name__)
DEFAULT_PER_CLASS = 100
JUDGE_FLAGS = ("dataset", "data_dir", "seed")  # read by the judge too, so passed to a backend only if it takes them


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_argument_group("the images to score (exactly one of --generator, --backend, --images)")
    source.add_argument("--generator", metavar="HOST:PORT", help="a running `fedsynth generator serve`")
    source.add_argument("--backend", help="start this backend in this process (ddpm: --model; holdout: --dataset, "
                        "--holdout-fraction, the split seeded by --seed; text2image: --model, --dataset)")
    source.add_argument("--images", type=Path, metavar="FILE.npz", help="x (uint8 N x H x W x C) and y (labels)")
    backend = parser.add_argument_group("--backend flags (as `fedsynth generator serve` takes them)")
    backend.add_argument("--model", type=Path, default=None, help="ddpm: generator folder")
    backend.add_argument("--holdout-fraction", type=float, default=None, help="holdout: share of the training split")
    backend.add_argument("--ddim-steps", type=int, default=None, help="ddpm: DDIM steps (default: the folder's)")
    backend.add_argument("--guidance", type=float, default=None, help="ddpm: guidance weight w (default: the folder's)")
    backend.add_argument("--prompt-template", default=None, help="text2image: prompt with {name} (default: the backend's)")
    backend.add_argument("--class-names-file", type=Path, default=None, help="text2image: one class name per line")
    backend.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default %(default)s")
    backend.add_argument("--max-batch", type=int, default=64, help="images per sampling batch (default %(default)s)")
    backend.add_argument("--min-confidence", type=float, default=0.0,
                         help="serve through the quality filter at this threshold (its judge is the one below, seed 0); "
                              "0 = off (default %(default)s)")
    parser.add_argument("--dataset", choices=DATASETS, default=None,
                        help="the real data the judge learns from (default: the generator's dataset; needed with --images)")
    parser.add_argument("--data-dir", type=Path, default=None, help="folder with train.npz/test.npz (cifar, npz)")
    parser.add_argument("--per-class", type=int, default=None,
                        help=f"images per class to score (default {DEFAULT_PER_CLASS}; --images: all of the file)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the judge, the image request and the CAS classifier (default %(default)s)")
    parser.add_argument("--judge-seed", type=int, default=None,
                        help="seeds the judge alone (default: --seed): one judge for rows whose images vary by --seed")
    parser.add_argument("--judge-model", choices=MODELS, default="cnn", help="the judge's architecture (default %(default)s)")
    parser.add_argument("--judge-device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where the judge and the CAS classifier train and score: auto = cuda when torch sees a GPU "
                             "(a GPU-trained judge is cached apart from a CPU one) (default %(default)s)")
    parser.add_argument("--judge-epochs", type=int, default=None, help="judge training epochs (default: 10 for 8x8, 15 for 32x32)")
    parser.add_argument("--judge-cache", type=Path, default=None,
                        help="folder of cached judges (default $FEDSYNTH_CACHE/judges or ~/.cache/fedsynth/judges)")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    parser.add_argument("--grid", type=Path, default=None, help="write a sample grid PNG here (a row per class)")
    parser.add_argument("--grid-per-class", type=int, default=10, help="images per class in the grid (default %(default)s)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads, 0 = torch's default; 1 is fastest on a crowded CPU")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the images (default %(default)s)")
    tls.add_tls_arguments(parser, server=False)


def _check(args: argparse.Namespace) -> None:
    chosen = [flag for flag, value in (("--generator", args.generator), ("--backend", args.backend),
                                       ("--images", args.images)) if value is not None]
    if len(chosen) != 1:
        raise ConfigError(f"give exactly one of --generator, --backend, --images (got {', '.join(chosen) or 'none'})")
    if args.backend is not None:
        get_backend(args.backend)  # an unknown name fails here, naming the known ones
    if args.per_class is not None and args.per_class < 2:
        raise ConfigError(f"--per-class must be >= 2 (a covariance needs two images), got {args.per_class}")
    if args.images is not None and args.dataset is None:
        raise ConfigError("--images needs --dataset: the real data the judge learns from")
    if args.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {args.seed}")
    if args.judge_seed is not None and args.judge_seed < 0:
        raise ConfigError(f"--judge-seed must be >= 0, got {args.judge_seed}")
    if args.grid_per_class < 1:
        raise ConfigError(f"--grid-per-class must be >= 1, got {args.grid_per_class}")
    if args.min_confidence and args.backend is None:
        raise ConfigError("--min-confidence filters a backend started here: it needs --backend")
    if args.judge_epochs is not None and args.judge_epochs < 1:
        raise ConfigError(f"--judge-epochs must be >= 1, got {args.judge_epochs}")


def _serve_config(args: argparse.Namespace) -> Any:
    """The in-process server's settings: the chosen backend's flags, and any other backend's flag that was set
    (so that ServeConfig refuses it, naming it), on a free loopback port without a metrics endpoint."""
    from generator_service.serve_cmd import BACKEND_FLAGS, ServeConfig

    mine = BACKEND_FLAGS.get(args.backend, ())
    flags = {name for names in BACKEND_FLAGS.values() for name in names if hasattr(args, name)}
    chosen = {name: getattr(args, name) for name in flags
              if name in mine or (name not in JUDGE_FLAGS and getattr(args, name) is not None)}
    per_class = args.per_class or DEFAULT_PER_CLASS
    limit = max(ServeConfig.max_request_images, per_class * 1000)
    if args.min_confidence > 0:  # the filter's judge reads the data folder and the judge cache too
        chosen.update(min_confidence=args.min_confidence, judge_cache=args.judge_cache, data_dir=args.data_dir)
    return ServeConfig(backend=args.backend, device=args.device, max_batch=args.max_batch, threads=args.threads,
                       port=0, metrics_port=-1, max_request_images=limit, queue_limit=limit, **chosen)


def _images(args: argparse.Namespace) -> GeneratedImages:
    per_class = args.per_class or DEFAULT_PER_CLASS
    if args.images is not None:
        return from_npz(args.images, per_class=args.per_class)
    if args.backend is not None:
        return from_backend(_serve_config(args), per_class=per_class, seed=args.seed, timeout_s=args.timeout)
    files = tls.tls_files_from_args(args, "client-0")
    credentials = None if files is None else tls.channel_credentials(files)
    return from_address(args.generator, credentials, per_class=per_class, seed=args.seed, timeout_s=args.timeout)


def _dataset_before_drawing(args: argparse.Namespace) -> str | None:
    """The dataset the judge will need, where it is known before any image is drawn: --dataset, or a ddpm folder's own."""
    if args.dataset is not None:
        return args.dataset
    if args.backend == "ddpm" and args.model is not None:
        from generator_service.ddpm.model import is_generator_folder, read_metadata

        if is_generator_folder(args.model):
            dataset = read_metadata(args.model).dataset
            return dataset if dataset in DATASETS else None
    return None


def _check_match(generated: GeneratedImages, num_classes: int, image_shape: tuple[int, int, int], dataset: str) -> None:
    _, h, w, c = generated.images.shape
    if generated.num_classes != num_classes:
        raise ConfigError(f"the images have {generated.num_classes} classes but {dataset} has {num_classes}")
    if (c, h, w) != image_shape:
        raise ConfigError(f"the images are {c}x{h}x{w} (CxHxW) but {dataset}'s are {'x'.join(map(str, image_shape))}")
    counts = [int((generated.labels == k).sum()) for k in range(num_classes)]
    if min(counts) < 2:
        raise ConfigError(f"every class needs at least 2 images; per-class counts are {counts}")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    started = time.perf_counter()
    _check(args)
    judge_device = resolve_judge_device(args.judge_device)  # before any image is drawn or judge trained
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.images is not None and not args.images.is_file():  # before training a judge
        raise ConfigError(f"--images {str(args.images)!r} does not exist or is not a file")
    from fedsynth.learning.data import load_dataset
    from generator_service.evaluation.report import evaluate_images

    known = _dataset_before_drawing(args)
    if known is not None:  # a missing data folder is an error before minutes of sampling, not after
        load_dataset(known, "test", data_dir=args.data_dir)
    generated = _images(args)
    dataset = args.dataset or generated.dataset
    if dataset not in DATASETS:
        raise ConfigError(f"the generator does not name a known dataset ({generated.dataset!r}); pass --dataset")
    image_size = load_dataset(dataset, "test", data_dir=args.data_dir).image_shape[1]
    recipe = default_recipe(image_size, args.judge_model)
    if args.judge_epochs is not None:
        recipe = dataclasses.replace(recipe, epochs=args.judge_epochs)
    judge_seed = args.seed if args.judge_seed is None else args.judge_seed
    judge = load_or_train_judge(dataset, data_dir=args.data_dir, seed=judge_seed, recipe=recipe, root=args.judge_cache,
                                device=judge_device)
    _check_match(generated, judge.num_classes, judge.image_shape, dataset)
    result = evaluate_images(judge, generated, seed=args.seed, data_dir=args.data_dir)
    result["judge_seed"] = judge_seed
    result["seconds"]["total"] = time.perf_counter() - started
    if args.grid is not None:
        _grid(generated, args.grid, judge.num_classes, args.grid_per_class)
    if args.json is not None:
        write_json(args.json, result)
    print(f"{generated.backend} {generated.model_id}: recognizability {result['recognizability']:.4f} "
          f"(judge test accuracy {judge.test_accuracy:.4f}, chance {result['chance']:.2f}), CAS {result['cas']:.4f}, "
          f"Fréchet {result['frechet']:.3f} (real test {result['real_test_frechet']:.3f}); "
          f"{result['n_images']} images in {result['seconds']['total']:.1f}s", flush=True)
    return 0


def _grid(generated: GeneratedImages, path: Path, num_classes: int, per_class: int) -> None:
    import numpy as np

    from generator_service.ddpm.grid import save_image_grid

    per_class = min(per_class, min(int((generated.labels == c).sum()) for c in range(num_classes)))
    rows = np.concatenate([generated.images[generated.labels == c][:per_class] for c in range(num_classes)])
    path.parent.mkdir(parents=True, exist_ok=True)
    save_image_grid(rows, path, num_classes=num_classes, per_class=per_class)
