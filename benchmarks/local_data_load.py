"""Loading a client's own folder of PNGs: decode time cold (no cache) and warm (the decoded-image cache), for N
CIFAR-10 training images written as an ImageFolder (train/<class>/NNNNNN.png) into a temporary folder.

Cold: the folder is listed, every PNG decoded (PIL, DECODE_THREADS threads) and the cache written. Warm: the folder
is listed (names, sizes, mtimes) and the cache read and checked by SHA-256. Both through
`fedsynth.learning.local_data.load_client_data`, exactly as a client node loads. The PNGs are written from
../shared/data/cifar10/train.npz (not timed) and removed afterwards.

    python benchmarks/local_data_load.py --images 5000 50000 [--repeats 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from fedsynth.config_schema import CIFAR10_CLASSES
from fedsynth.learning.label_schema import LabelSchema
from fedsynth.learning.local_data import DECODE_THREADS, load_client_data

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "cifar10" / "train.npz"  # ../shared
SCHEMA = LabelSchema(CIFAR10_CLASSES, 32, 3)


def write_pngs(x: np.ndarray, y: np.ndarray, folder: Path) -> None:
    for name in CIFAR10_CLASSES:
        (folder / "train" / name).mkdir(parents=True)
    for row in range(len(y)):
        Image.fromarray(x[row]).save(folder / "train" / CIFAR10_CLASSES[int(y[row])] / f"{row:06d}.png")


def measure(folder: Path, cache: Path, repeats: int) -> dict[str, Any]:
    cold, warm = [], []
    for _ in range(repeats):
        shutil.rmtree(cache, ignore_errors=True)
        started = time.perf_counter()
        first = load_client_data(folder, SCHEMA, client_id=0, cache_dir=cache)
        cold.append(time.perf_counter() - started)
        started = time.perf_counter()
        again = load_client_data(folder, SCHEMA, client_id=0, cache_dir=cache)
        warm.append(time.perf_counter() - started)
        assert np.array_equal(first.train.x, again.train.x)
    cache_bytes = sum(f.stat().st_size for f in cache.glob("*.npz"))
    return {"cold_s": min(cold), "warm_s": min(warm), "cold_all_s": cold, "warm_all_s": warm, "cache_bytes": cache_bytes,
            "speedup": min(cold) / min(warm)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, nargs="+", default=[5000])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="CIFAR-10 train.npz (x uint8 N x 32 x 32 x 3, y)")
    parser.add_argument("--repeats", type=int, default=3, help="cold/warm pairs per size; the minimum is reported")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with np.load(args.data, allow_pickle=False) as archive:
        x, y = archive["x"], archive["y"]
    results = []
    for n in args.images:
        root = Path(tempfile.mkdtemp(prefix="fedsynth-local-load-"))
        try:
            started = time.perf_counter()
            write_pngs(x[:n], y[:n], root / "client")
            written = time.perf_counter() - started
            png_bytes = sum(p.stat().st_size for p in (root / "client").rglob("*.png"))
            row = {"images": n, "png_bytes": png_bytes, "write_s": written, **measure(root / "client", root / "cache", args.repeats)}
        finally:
            shutil.rmtree(root, ignore_errors=True)
        results.append(row)
    print(f"| PNGs | on disk | cold: list + decode + write cache (s) | warm: list + read cache (s) | cold / warm | cache |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['images']:,} | {r['png_bytes'] / 2**20:.1f} MiB | {r['cold_s']:.2f} | {r['warm_s']:.3f} | "
              f"{r['speedup']:.0f}x | {r['cache_bytes'] / 2**20:.1f} MiB |")
    meta = {"cpus": os.cpu_count(), "decode_threads": DECODE_THREADS, "python": platform.python_version(),
            "pillow": Image.__version__ if hasattr(Image, "__version__") else None}
    if args.json is not None:
        args.json.write_text(json.dumps({"results": results, "machine": meta}, indent=2))


if __name__ == "__main__":
    main()
