"""What the quality filter (`--min-confidence`) costs: acceptance rate and device-seconds by threshold and backend.

    python benchmarks/quality_filter_cost.py [--per-class 100] [--thresholds 0 0.5 0.9] [--ddpm DIR] [--threads 1] \
        [--filter-batches 1 8]

For each backend (holdout on digits; a trained ddpm folder with --ddpm) and threshold it serves one request of
--per-class images of every class through the public in-process server, and reads the server's own counters:
candidates drawn, accepted, rejected, fedsynth_generator_device_seconds_total (every candidate and the judge) and the
share spent on candidates not served (rejected, or spare). The judge is `fedsynth generator evaluate`'s (cached in $FEDSYNTH_CACHE/judges).
Each filtered setting runs once per --filter-batches value (backend batches of keys the filter takes at once), side by
side: the served bytes are the same, the candidates drawn and the device-seconds are not.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from fedsynth.wire import grpcutil
from fedsynth.generation.generator_client import fetch_images
from fedsynth.generation.generator_names import (
    DEVICE_SECONDS_TOTAL,
    FILTER_ACCEPTED_TOTAL,
    FILTER_CANDIDATES_TOTAL,
    FILTER_JUDGE_SECONDS_TOTAL,
    FILTER_REJECTED_TOTAL,
    FILTER_UNSERVED_DEVICE_SECONDS_TOTAL,
)
from generator_service import ServeConfig, create_server

CLASSES = 10


def _total(registry: CollectorRegistry, name: str) -> float:
    return sum(s.value for metric in registry.collect() for s in metric.samples if s.name == name)


def measure(settings: dict[str, Any], min_confidence: float, per_class: int, threads: int,
            filter_batches: int) -> dict[str, float]:
    registry = CollectorRegistry()
    if not min_confidence and settings["backend"] == "ddpm":  # ddpm reads --data-dir only for the filter's judge
        settings = {k: v for k, v in settings.items() if k != "data_dir"}
    server = create_server(ServeConfig(**settings, min_confidence=min_confidence, threads=threads, port=0,
                                       metrics_port=-1, max_batch=64, filter_batches=filter_batches), registry=registry)
    port = server.start()
    try:
        server.load()
        channel = grpcutil.make_channel(f"127.0.0.1:{port}")
        fetch_images(channel, [per_class] * CLASSES, seed=0, timeout_s=3600, on_batch=lambda *_: None)
        channel.close()
    finally:
        server.stop(0)
    served = per_class * CLASSES
    return {"candidates": _total(registry, FILTER_CANDIDATES_TOTAL) or served,
            "accepted": _total(registry, FILTER_ACCEPTED_TOTAL) or served, "rejected": _total(registry, FILTER_REJECTED_TOTAL),
            "device_s": _total(registry, DEVICE_SECONDS_TOTAL),
            "unserved_s": _total(registry, FILTER_UNSERVED_DEVICE_SECONDS_TOTAL),
            "judge_s": _total(registry, FILTER_JUDGE_SECONDS_TOTAL)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-class", type=int, default=100)
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.0, 0.5, 0.9])
    parser.add_argument("--ddpm", type=Path, default=None, help="a trained ddpm folder (e.g. the launcher's "
                        "$FEDSYNTH_CACHE/generators/digits-tiny-1500steps-seed0)")
    parser.add_argument("--data-dir", type=Path, default=None, help="the --ddpm model's dataset folder (cifar10, "
                        "cifar100, npz), from whose training split the judge learns")
    parser.add_argument("--ddim-steps", type=int, default=10)
    parser.add_argument("--guidance", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--filter-batches", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    backends: dict[str, dict[str, Any]] = {
        "holdout digits (f 0.2)": {"backend": "holdout", "dataset": "digits", "holdout_fraction": 0.2, "seed": 0}}
    if args.ddpm is not None:
        backends[f"ddpm {args.ddpm.name} ({args.ddim_steps} steps, w {args.guidance:g})"] = {
            "backend": "ddpm", "model": args.ddpm, "ddim_steps": args.ddim_steps, "guidance": args.guidance,
            "data_dir": args.data_dir}
    print(f"{args.per_class} images per class, {CLASSES} classes, one request, --threads {args.threads}\n")
    print("| backend | min_confidence | filter batches | candidates drawn | per image served | rejected "
          "| acceptance rate | device-s | of which unserved | judge-s | device-s vs unfiltered |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, settings in backends.items():
        base = None
        for threshold in args.thresholds:
            for filter_batches in args.filter_batches if threshold > 0 else args.filter_batches[:1]:
                m = measure(settings, threshold, args.per_class, args.threads, filter_batches)
                base = m["device_s"] if base is None else base
                print(f"| {name} | {threshold:g} | {filter_batches if threshold > 0 else '-'} | {m['candidates']:.0f} "
                      f"| {m['candidates'] / (args.per_class * CLASSES):.2f} | {m['rejected']:.0f} "
                      f"| {m['accepted'] / (m['accepted'] + m['rejected']):.1%} "
                      f"| {m['device_s']:.2f} | {m['unserved_s']:.2f} | {m['judge_s']:.2f} "
                      f"| {m['device_s'] / base:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
