"""Write a seeded, class-stratified fraction of a train.npz/test.npz dataset folder, for reduced-scale experiments.

    python scripts/subset_dataset.py --data-dir ../shared/data/cifar10 --train-fraction 0.1 --out /tmp/cifar10-10pct

Each class keeps round(fraction * count) of its images (at least one), chosen by `--seed`, in the input's order;
the test split is copied whole unless --test-fraction is given. The output folder is a `data.data_dir`.
`--public-out DIR` also writes the training images the subset left out (and the same test split), with the
public.json that `fedsynth generator train` copies into a public model (docs/private-evolution.md): data disjoint
from every client's shard, for a Private Evolution public generator or embedder.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def stratified_indices(labels: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """round(fraction * n_c) indices of each class c, drawn without replacement, in ascending order."""
    rng = np.random.default_rng(seed)
    chosen = []
    for cls in np.unique(labels):
        members = np.flatnonzero(labels == cls)
        keep = max(1, int(round(fraction * len(members))))
        chosen.append(rng.choice(members, size=keep, replace=False))
    return np.sort(np.concatenate(chosen))


def write_split(source: Path, target: Path, fraction: float, seed: int, left_out: Path | None = None) -> dict[str, int]:
    with np.load(source, allow_pickle=False) as archive:
        x, y = archive["x"], archive["y"]
    keep = stratified_indices(y, fraction, seed) if fraction < 1.0 else np.arange(len(y))
    np.savez(target, x=x[keep], y=y[keep])
    if left_out is not None:
        rest = np.setdiff1d(np.arange(len(y)), keep)
        np.savez(left_out, x=x[rest], y=y[rest])
    return {"images": int(len(keep)), **{f"class_{c}": int(n) for c, n in enumerate(np.bincount(y[keep]))}}


def public_record(data_dir: Path, train_fraction: float, seed: int, images: int) -> dict[str, str]:
    return {
        "public_data": f"{data_dir.name} training images outside the reduced {train_fraction:.0%} subset "
                       f"(scripts/subset_dataset.py seed {seed}): {images:,} images; no client's shard is drawn from them",
        "relation_to_clients": "in-distribution: the same dataset and classes as the clients' images (the favourable "
                               "case the DP literature also reports), disjoint from every client's shard",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, required=True, help="folder with train.npz and test.npz")
    parser.add_argument("--train-fraction", type=float, required=True, help="share of each class's train images to keep, in (0, 1]")
    parser.add_argument("--test-fraction", type=float, default=1.0, help="share of each class's test images to keep (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="folder to write train.npz, test.npz and subset.json")
    parser.add_argument("--public-out", type=Path, help="folder to write the left-out training images, the same test split and public.json")
    args = parser.parse_args()
    for name in ("train_fraction", "test_fraction"):
        value = getattr(args, name)
        if not 0.0 < value <= 1.0:
            parser.error(f"--{name.replace('_', '-')} must be in (0, 1], got {value}")
    missing = [str(args.data_dir / f"{split}.npz") for split in ("train", "test") if not (args.data_dir / f"{split}.npz").is_file()]
    if missing:
        parser.error(f"no such file: {', '.join(missing)}")
    if args.out.resolve() == args.data_dir.resolve():
        parser.error(f"--out {args.out} is the --data-dir: the subset would overwrite its source")
    if args.public_out is not None and args.public_out.resolve() in (args.out.resolve(), args.data_dir.resolve()):
        parser.error(f"--public-out {args.public_out} must be a folder of its own, not --out or --data-dir")
    if args.public_out is not None and args.train_fraction == 1.0:
        parser.error("--public-out needs --train-fraction below 1: no training image would be left out")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.public_out is not None:
        args.public_out.mkdir(parents=True, exist_ok=True)
    counts = {
        split: write_split(args.data_dir / f"{split}.npz", args.out / f"{split}.npz", fraction, args.seed,
                           args.public_out / "train.npz" if args.public_out is not None and split == "train" else None)
        for split, fraction in (("train", args.train_fraction), ("test", args.test_fraction))
    }
    if args.public_out is not None:
        # the public folder's test split is the subset's, so that a public model is judged on the clients' test images
        (args.public_out / "test.npz").write_bytes((args.out / "test.npz").read_bytes())
        with np.load(args.public_out / "train.npz", allow_pickle=False) as archive:
            images = len(archive["y"])
        record = public_record(args.data_dir.resolve(), args.train_fraction, args.seed, images)
        (args.public_out / "public.json").write_text(json.dumps(record) + "\n")
    record = {"source": str(args.data_dir.resolve()), "seed": args.seed, "train_fraction": args.train_fraction,
              "test_fraction": args.test_fraction, "counts": counts}
    (args.out / "subset.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record["counts"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
