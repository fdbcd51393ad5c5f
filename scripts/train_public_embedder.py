"""Train a public feature extractor for Private Evolution's votes (`generator evolve --embedder-model DIR`): a
classifier on a PUBLIC train.npz/test.npz folder that holds a public.json (what the images are, how far they are from
the clients'), e.g. the folder scripts/public_digits.py writes, or CIFAR-10's training images outside the clients'.

    python scripts/train_public_embedder.py --data-dir runs/mnist8 --out runs/embedder-mnist8 [--model cnn] [--epochs 5]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fedsynth.learning.public_embedder import train_public_embedder, weights_sha256


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, required=True, help="public train.npz, test.npz and public.json")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="cnn", help="a train.model with features(x) and head(rep) (default cnn)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    public_file = args.data_dir / "public.json"
    if not public_file.is_file():
        parser.error(f"{public_file} is missing: say what the public images are (public_data, relation_to_clients)")
    record = train_public_embedder(args.data_dir, args.out, model=args.model, epochs=args.epochs, seed=args.seed,
                                   public=json.loads(public_file.read_text()))
    print(json.dumps({**record, "sha256": weights_sha256(args.out)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
