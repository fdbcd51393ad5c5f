"""Generator throughput: images/s by UNet size, batch and DDIM steps, and the dynamic-batching efficiency.

    python benchmarks/generation_throughput.py [--threads N] [--quick]

Prints markdown tables. On a CPU it measures the tiny (digits, 8x8) and half-width (CIFAR, 32x32) UNets;
on a GPU it also measures the DDPM-CIFAR size (35.7M) in bf16. Weights are untrained (same cost as trained).
Guidance is on (w = 1), so every image costs two UNet rows per step.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import tempfile
import threading
import time
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

from fedsynth import grpcutil
from fedsynth.generator_client import fetch_images
from generator_service.ddpm.model import (
    GeneratorMetadata,
    build_unet,
    make_train_scheduler,
    parameter_count,
    save_generator,
)
from generator_service.ddpm.sampling import DdimSampler, ImageKey, SamplingConfig, resolve_device
from generator_service.serve_cmd import GeneratorServer, ServeConfig

GUIDANCE = 1.0
SHAPES = {"tiny": ("digits", (1, 8, 8)), "half": ("cifar10", (3, 32, 32)), "ddpm-cifar": ("cifar10", (3, 32, 32))}


def _plan(device: torch.device, quick: bool) -> list[tuple[str, int, int]]:
    """(size, batch, ddim steps) to measure."""
    if device.type == "cuda":
        plan = [(s, b, n) for s in SHAPES for b in (64, 256) for n in (10, 50)]
    else:
        plan = [("tiny", b, n) for b in (16, 64) for n in (10, 25)] + [("half", b, 10) for b in (16, 64)]
    return plan[:3] if quick else plan


def _sampler(size: str, batch: int, steps: int, device: torch.device) -> tuple[DdimSampler, int]:
    _, shape = SHAPES[size]
    unet = build_unet(size, num_classes=10, image_shape=shape, seed=0)
    config = SamplingConfig(steps=steps, guidance=GUIDANCE, batch_size=batch)
    sampler = DdimSampler(unet, dict(make_train_scheduler().config), num_classes=10, image_shape=shape,
                          config=config, device=device)
    return sampler, parameter_count(unet)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure_throughput(size: str, batch: int, steps: int, device: torch.device) -> dict[str, object]:
    sampler, params = _sampler(size, batch, steps, device)
    keys = [ImageKey(0, i % 10, i) for i in range(batch)]
    sampler.sample(keys)  # warm-up: allocator, kernels
    _sync(device)
    repeats, started = 0, time.perf_counter()
    while repeats < 2 or time.perf_counter() - started < 3.0:
        sampler.sample(keys)
        _sync(device)
        repeats += 1
    seconds = (time.perf_counter() - started) / repeats
    return {"size": size, "params": params, "shape": "x".join(map(str, SHAPES[size][1])),
            "dtype": str(sampler.dtype).removeprefix("torch."), "batch": batch, "steps": steps,
            "images_per_s": batch / seconds, "image_steps_per_s": batch * steps / seconds}


def measure_batching(size: str, steps: int, device_name: str, threads: int) -> dict[str, float]:
    """Wall time of one request of 200 images vs 10 concurrent requests of 20, through a real gRPC server."""
    dataset, shape = SHAPES[size]
    with tempfile.TemporaryDirectory() as folder:
        save_generator(Path(folder), build_unet(size, num_classes=10, image_shape=shape, seed=0), make_train_scheduler(),
                       GeneratorMetadata(dataset, 10, shape, size, training_steps=0, guidance=GUIDANCE, ddim_steps=steps))
        server = GeneratorServer(ServeConfig(model=Path(folder), max_batch=64, max_wait_ms=20, metrics_port=-1,
                                             device=device_name, threads=threads), registry=CollectorRegistry())
        port = server.start()
        server.load()
        channel = grpcutil.make_channel(f"127.0.0.1:{port}")

        def fetch(count: int, seed: int) -> None:
            counts = [count // 10] * 10
            fetch_images(channel, counts, seed=seed, timeout_s=1800, on_batch=lambda *_: None)

        fetch(20, 99)  # warm-up
        started = time.perf_counter()
        fetch(200, 0)
        single = time.perf_counter() - started
        workers = [threading.Thread(target=fetch, args=(20, seed)) for seed in range(10)]
        started = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        concurrent = time.perf_counter() - started
        channel.close()
        server.stop(0)
    return {"single_s": single, "concurrent_s": concurrent, "ratio": single / concurrent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--quick", action="store_true", help="only the first three configurations")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    gpu = torch.cuda.get_device_name(0) if device.type == "cuda" else "none"
    print(f"# Generation throughput, {datetime.date.today()}\n")
    print(f"machine: {platform.machine()} {os.cpu_count()} CPUs ({platform.processor() or 'cpu'}), "
          f"torch {torch.__version__} with {torch.get_num_threads()} threads, GPU: {gpu}, "
          f"load average {os.getloadavg()[0]:.1f}; guidance w = {GUIDANCE} (2 UNet rows per image and step)\n")
    print("| size | parameters | image | device | dtype | batch | DDIM steps | images/s | image-steps/s |")
    print("|---|---:|---|---|---|---:|---:|---:|---:|")
    for size, batch, steps in _plan(device, args.quick):
        r = measure_throughput(size, batch, steps, device)
        print(f"| {size} | {r['params']:,} | {r['shape']} | {device.type} | {r['dtype']} | {batch} | {steps} "
              f"| {r['images_per_s']:.1f} | {r['image_steps_per_s']:.0f} |", flush=True)
    print("\n| size | DDIM steps | 1 request x 200 (s) | 10 concurrent x 20 (s) | efficiency (1x200 / 10x20) |")
    print("|---|---:|---:|---:|---:|")
    sizes = ["tiny"] if device.type == "cpu" else list(SHAPES)
    for size in sizes:
        b = measure_batching(size, 10, args.device, args.threads)
        print(f"| {size} | 10 | {b['single_s']:.2f} | {b['concurrent_s']:.2f} | {b['ratio']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
