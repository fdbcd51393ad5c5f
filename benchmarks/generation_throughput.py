"""Generator throughput: images/s by UNet size, batch and DDIM steps, and the dynamic-batching efficiency.

    python benchmarks/generation_throughput.py [--threads N] [--quick]

Prints markdown tables. On a CPU it measures the tiny (digits, 8x8) and half-width (CIFAR, 32x32) UNets;
on a GPU it also measures the DDPM-CIFAR size (35.7M) in bf16. Each model folder comes from
`fedsynth generator train --steps 1` (the cost of sampling does not depend on training), and every figure is
measured through the public in-process server: images/s is images over the server's own
fedsynth_generator_device_seconds_total. Guidance is on (w = 1), so every image costs two UNet rows per step.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import torch
from prometheus_client import CollectorRegistry

from deploy.processes import fedsynth_command
from fedsynth.wire import grpcutil
from fedsynth.generation.generator_client import GeneratorInfo, fetch_images
from fedsynth.generation.generator_names import DEVICE_SECONDS_TOTAL
from generator_service import GeneratorServer, ServeConfig, create_server

GUIDANCE = 1.0
CLASSES = 10
SHAPES = {"tiny": ("digits", (1, 8, 8)), "half": ("cifar10", (3, 32, 32)), "ddpm-cifar": ("cifar10", (3, 32, 32))}


def _plan(device: str, quick: bool) -> list[tuple[str, int, int]]:
    """(size, batch, ddim steps) to measure."""
    if device == "cuda":
        plan = [(s, b, n) for s in SHAPES for b in (64, 256) for n in (10, 50)]
    else:
        plan = [("tiny", b, n) for b in (16, 64) for n in (10, 25)] + [("half", b, 10) for b in (16, 64)]
    return plan[:3] if quick else plan


def make_model(size: str, root: Path, device: str, threads: int) -> Path:
    """A model folder of this size, trained for one step with `fedsynth generator train`."""
    dataset, (channels, height, width) = SHAPES[size]
    out = root / size
    command = ["generator", "train", "--dataset", dataset, "--size", size, "--steps", "1", "--batch-size", "8",
               "--out", str(out), "--device", device, "--threads", str(threads), "--grid-per-class", "0", "--no-progress"]
    if dataset != "digits":  # random images of CIFAR's shape: no download, same cost
        data = root / f"{size}-data"
        data.mkdir()
        rng = np.random.default_rng(0)
        np.savez(data / "train.npz", x=rng.integers(0, 256, (64, height, width, channels), dtype=np.uint8),
                 y=np.arange(64) % CLASSES)
        command += ["--data-dir", str(data)]
    subprocess.run(fedsynth_command(*command), check=True, capture_output=True, timeout=1800)
    return out


def _server(model: Path, *, batch: int, steps: int, device: str, threads: int,
            registry: CollectorRegistry) -> tuple[GeneratorServer, grpc.Channel]:
    server = create_server(ServeConfig(model=model, max_batch=batch, max_wait_ms=20, metrics_port=-1, device=device,
                                       threads=threads, ddim_steps=steps, guidance=GUIDANCE), registry=registry)
    port = server.start()
    server.load()
    return server, grpcutil.make_channel(f"127.0.0.1:{port}")


def _fetch(channel: grpc.Channel, count: int, seed: int) -> None:
    counts = [count // CLASSES + (1 if c < count % CLASSES else 0) for c in range(CLASSES)]
    fetch_images(channel, counts, seed=seed, timeout_s=1800, on_batch=lambda *_: None)


def measure_throughput(model: Path, size: str, batch: int, steps: int, device: str, threads: int) -> dict[str, object]:
    """Requests of one full batch each, for at least 2 batches and 3 s, against the server's device-seconds."""
    registry = CollectorRegistry()
    server, channel = _server(model, batch=batch, steps=steps, device=device, threads=threads, registry=registry)
    try:
        info = GeneratorInfo.fetch(channel, timeout_s=60)
        _fetch(channel, batch, seed=99)  # warm-up: allocator, kernels
        device_before = registry.get_sample_value(DEVICE_SECONDS_TOTAL) or 0.0
        images, started = 0, time.perf_counter()
        while images < 2 * batch or time.perf_counter() - started < 3.0:
            _fetch(channel, batch, seed=images)
            images += batch
        seconds = (registry.get_sample_value(DEVICE_SECONDS_TOTAL) or 0.0) - device_before
    finally:
        channel.close()
        server.stop(0)
    return {"size": size, "params": info.parameters, "shape": "x".join(map(str, info.image_shape)),
            "device": info.device, "dtype": info.dtype, "batch": batch, "steps": steps,
            "images_per_s": images / seconds, "image_steps_per_s": images * steps / seconds}


def measure_batching(model: Path, steps: int, device: str, threads: int) -> dict[str, float]:
    """Wall time of one request of 200 images vs 10 concurrent requests of 20, through a real gRPC server."""
    server, channel = _server(model, batch=64, steps=steps, device=device, threads=threads, registry=CollectorRegistry())
    try:
        _fetch(channel, 20, 99)  # warm-up
        started = time.perf_counter()
        _fetch(channel, 200, 0)
        single = time.perf_counter() - started
        workers = [threading.Thread(target=_fetch, args=(channel, 20, seed)) for seed in range(10)]
        started = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        concurrent = time.perf_counter() - started
    finally:
        channel.close()
        server.stop(0)
    return {"single_s": single, "concurrent_s": concurrent, "ratio": single / concurrent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--quick", action="store_true", help="only the first three configurations")
    args = parser.parse_args()
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "none"
    print(f"# Generation throughput, {datetime.date.today()}\n")
    print(f"machine: {platform.machine()} {os.cpu_count()} CPUs ({platform.processor() or 'cpu'}), "
          f"torch {torch.__version__} with {args.threads or torch.get_num_threads()} threads, GPU: {gpu}, "
          f"load average {os.getloadavg()[0]:.1f}; guidance w = {GUIDANCE} (2 UNet rows per image and step)\n")
    plan = _plan(device, args.quick)
    sizes = ["tiny"] if device == "cpu" else list(SHAPES)
    with tempfile.TemporaryDirectory() as folder:
        models = {size: make_model(size, Path(folder), device, args.threads)
                  for size in dict.fromkeys([s for s, _, _ in plan] + sizes)}
        print("| size | parameters | image | device | dtype | batch | DDIM steps | images/s | image-steps/s |")
        print("|---|---:|---|---|---|---:|---:|---:|---:|")
        for size, batch, steps in plan:
            r = measure_throughput(models[size], size, batch, steps, device, args.threads)
            print(f"| {size} | {r['params']:,} | {r['shape']} | {r['device']} | {r['dtype']} | {batch} | {steps} "
                  f"| {r['images_per_s']:.1f} | {r['image_steps_per_s']:.0f} |", flush=True)
        print("\n| size | DDIM steps | 1 request x 200 (s) | 10 concurrent x 20 (s) | efficiency (1x200 / 10x20) |")
        print("|---|---:|---:|---:|---:|")
        for size in sizes:
            b = measure_batching(models[size], 10, device, args.threads)
            print(f"| {size} | 10 | {b['single_s']:.2f} | {b['concurrent_s']:.2f} | {b['ratio']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
