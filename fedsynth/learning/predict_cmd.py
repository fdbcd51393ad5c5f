"""`fedsynth predict --model FILE IMAGE_OR_DIR... [--json]`: class name and probability per image, with the model that
`fedsynth export` wrote; images are read as a client's local data loader reads them (docs/guides/model-back.md)."""

from __future__ import annotations

import argparse
import json

from fedsynth.errors import ConfigError
from fedsynth.learning.model_file import decode_for_model, image_paths, load_with_sidecar, predict


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="FILE",
                        help="the weights file `fedsynth export` wrote (its .json sidecar beside it)")
    parser.add_argument("inputs", nargs="+", metavar="IMAGE_OR_DIR",
                        help="PNG or JPEG files, or folders (their .png/.jpg/.jpeg files at any depth, sorted)")
    parser.add_argument("--json", action="store_true",
                        help='print one JSON object {"predictions": [{"path", "class", "label", "probability"}, ...]}')
    parser.add_argument("--batch-size", type=int, default=512, help="images per forward pass (default 512)")


def run(args: argparse.Namespace) -> int:
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {args.batch_size}")
    model, sidecar = load_with_sidecar(args.model)
    paths = image_paths(args.inputs)  # a missing path fails here, before any image is decoded
    classes = sidecar["classes"]
    predictions = []
    for start in range(0, len(paths), args.batch_size):  # decoded a batch at a time: a large folder fits in memory
        chunk = paths[start : start + args.batch_size]
        labels, probabilities = predict(model, decode_for_model(chunk, sidecar), args.batch_size)
        predictions += [{"path": str(path), "class": classes[int(label)], "label": int(label), "probability": float(p)}
                        for path, label, p in zip(chunk, labels, probabilities)]
    # printed only once every image was read: a bad file is one line on stderr and nothing half-written on stdout
    if args.json:
        print(json.dumps({"predictions": predictions}))
    else:
        print("\n".join(f"{p['path']}\t{p['class']}\t{p['probability']:.6f}" for p in predictions))
    return 0
