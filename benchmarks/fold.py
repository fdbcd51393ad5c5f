"""Folding one ResNet-18 update (float32, as received) into the coordinator's float64 sum: one torch._foreach_add_ of
the update as it is, against fedsynth's `fold` through a reused float64 scratch, with malloc tuned as in the
coordinator (fedsynth.process.allocator: blocks of 1 MiB and more are fresh mappings) and as glibc leaves it.

torch upcasts each float32 tensor into a temporary the size of the tensor before adding it; under the coordinator's
tuning every such temporary is a fresh mapping whose pages all fault on first write. Both ways give the same bits
(tests/test_codec_zero_copy.py). Milliseconds per fold, median of --repeats, each malloc setting in its own process:

    python benchmarks/fold.py [--repeats 9]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MALLOC = ("tuned", "glibc default")


def measure(malloc: str, repeats: int) -> dict[str, float]:
    from fedsynth.process import allocator

    if malloc == "tuned":
        allocator.tune_for_large_buffers()
    import torch

    from fedsynth.wire import codec
    from fedsynth.algorithms import snapshot_state
    from fedsynth.algorithms.base import FOLD_SCRATCH_ELEMENTS, float64_zeros, fold, fold_scratches
    from fedsynth.learning.models import build_model
    from fedsynth.wire.tensor_buffer import decode_views, encode_to_buffer

    torch.set_num_threads(1)  # runtime.torch_threads' default
    state = snapshot_state(build_model("resnet18", num_classes=10, in_channels=3, image_size=32))
    update = codec.split_prefixed(decode_views(encode_to_buffer(codec.join_prefixed(model=state))))["model"]
    sums = {key: torch.zeros(value.shape, dtype=torch.float64) for key, value in update.items()}
    scratch = [torch.empty(FOLD_SCRATCH_ELEMENTS, dtype=torch.float64)]
    scratches = fold_scratches(sum(value.numel() for value in update.values()))
    keys = list(update)

    def one_call() -> None:
        torch._foreach_add_([sums[key] for key in keys], [update[key] for key in keys], alpha=3.0)

    shapes = {key: tuple(value.shape) for key, value in update.items()}
    ways = {
        "one _foreach_add_": one_call, "fold via a scratch": lambda: fold(sums, update, 3.0, scratch),
        f"fold, {len(scratches)} threads": lambda: fold(sums, update, 3.0, scratches),
        "zeros: torch.zeros per key": lambda: {key: torch.zeros(shape, dtype=torch.float64) for key, shape in shapes.items()},
        "zeros: float64_zeros": lambda: float64_zeros(shapes),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):  # interleaved: the machine's noise falls on both
        for name, way in ways.items():
            started = time.perf_counter()
            way()
            times[name].append(time.perf_counter() - started)
    return {name: 1000 * statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--child", choices=MALLOC, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.repeats)))
        return
    rows = {}
    for malloc in MALLOC:
        out = subprocess.run([sys.executable, __file__, "--child", malloc, "--repeats", str(args.repeats)],
                             check=True, capture_output=True, text=True, timeout=600).stdout
        rows[malloc] = json.loads(out.strip().splitlines()[-1])
    print(f"ResNet-18 update (11.2 M floats) into a float64 sum; ms, median of {args.repeats}; {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}\n")
    ways = list(next(iter(rows.values())))
    print("| malloc | " + " | ".join(ways) + " |\n|---|" + "---:|" * len(ways))
    for malloc, row in rows.items():
        print(f"| {malloc} | " + " | ".join(f"{row[w]:.1f}" for w in ways) + " |")


if __name__ == "__main__":
    main()
