"""Checking and folding one ResNet-18 update beside busy Python threads: tensor by tensor against one pass per run.

Each torch call lets go of the GIL; when another thread is running Python, getting it back waits up to the
interpreter's switch interval (5 ms). The coordinator checks and folds updates while other upload threads run Python,
and a client node's logical clients share one interpreter, so a check or fold that makes one call per tensor (ResNet-18:
122 tensors, several calls each) stalls there. This times, in one process and one run, the tensor-by-tensor way (what
fedsynth did before 2026-12-04) and fedsynth's own `codec.check_like` + `Aggregator.add`, with 0 and N threads spinning
in Python beside them, and checks that both ways give the same sum, bit for bit. Prints a markdown table.

    python benchmarks/gil_convoy.py [--spinners 0 1 3] [--repeats 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import torch
import torchvision

from fedsynth.wire import codec
from fedsynth.algorithms.base import Aggregator
from fedsynth.wire.tensor_buffer import decode_views, encode_to_buffer


def check_tensor_by_tensor(received: dict[str, torch.Tensor], layout: codec.Layout) -> None:
    for name, (shape, dtype) in layout.items():
        got = received[name]
        assert tuple(got.shape) == shape and got.dtype == dtype
        assert not got.is_floating_point() or codec.all_finite(got)


def fold_tensor_by_tensor(sums: dict[str, torch.Tensor], state: dict[str, torch.Tensor], weight: float) -> None:
    for key, value in state.items():
        sums[key].add_(value.detach().to("cpu", torch.float64), alpha=weight)


def timed(work, repeats: int) -> float:
    work()  # warm
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spinners", type=int, nargs="+", default=[0, 1, 3])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    state = {k: v.detach().clone() for k, v in torchvision.models.resnet18(num_classes=10).state_dict().items()}
    update = decode_views(encode_to_buffer({k: v + 1 if v.is_floating_point() else v for k, v in state.items()}))
    layout = codec.layout_of(state)
    old_sums = {key: torch.zeros(value.shape, dtype=torch.float64) for key, value in state.items()}
    aggregator = Aggregator(state)
    rows = []
    for spinners in args.spinners:
        stop = [False]

        def spin() -> None:  # pure bytecode: it holds the GIL until the interpreter asks it to drop it
            count = 0
            while not stop[0]:
                count += 1

        threads = [threading.Thread(target=spin, daemon=True) for _ in range(spinners)]
        for thread in threads:
            thread.start()
        row = {
            "spinners": spinners,
            "check_tensor_by_tensor_s": timed(lambda: check_tensor_by_tensor(update, layout), args.repeats),
            "check_like_s": timed(lambda: codec.check_like(update, layout, what="update"), args.repeats),
            "fold_tensor_by_tensor_s": timed(lambda: fold_tensor_by_tensor(old_sums, update, 2.0), args.repeats),
            "aggregator_add_s": timed(lambda: aggregator.add(update, {}, 2.0, layout_checked=True), args.repeats),
        }
        stop[0] = True
        for thread in threads:
            thread.join()
        rows.append(row)
    same_bits = all(torch.equal(old_sums[key], aggregator._sums[key]) for key in state)
    print(f"ResNet-18 update ({len(state)} tensors), torch threads 1, median of {args.repeats}; same sum bit for bit: {same_bits}\n")
    print("| threads spinning in Python | check, tensor by tensor s | codec.check_like s | fold, tensor by tensor s | Aggregator.add s |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['spinners']} | {r['check_tensor_by_tensor_s']:.4f} | {r['check_like_s']:.4f} | "
              f"{r['fold_tensor_by_tensor_s']:.4f} | {r['aggregator_add_s']:.4f} |")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "same_bits": same_bits}, indent=1))


if __name__ == "__main__":
    main()
