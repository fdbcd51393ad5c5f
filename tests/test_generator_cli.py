"""`fedsynth generator serve` as a real process: port file, health, Generate, /metrics, clean SIGTERM exit."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch

from fedsynth.wire import grpcutil
from fedsynth.generation.generator_client import GeneratorInfo, fetch_images
from generator_service.ddpm.model import (
    GeneratorMetadata,
    build_unet,
    load_generator,
    make_train_scheduler,
    save_generator,
)
from generator_service.ddpm.sampling import DdimSampler, ImageKey, SamplingConfig
from generator_service.serve_cmd import SERVICE_NAME


def _fedsynth(*args: str) -> list[str]:
    return [sys.executable, "-m", "fedsynth.cli", *args]


def _wait_for_file(path: Path, proc: subprocess.Popen[str], timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, f"no port file after {timeout_s}s"
        time.sleep(0.05)
    return int(path.read_text())


def test_serve_process_answers_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    model = tmp_path / "model"
    save_generator(model, build_unet("tiny", num_classes=10, image_shape=(1, 8, 8), seed=1), make_train_scheduler(),
                   GeneratorMetadata("digits", 10, (1, 8, 8), "tiny", training_steps=0, guidance=1.0, ddim_steps=2))
    port_file = tmp_path / "run" / "generator.port"
    proc = subprocess.Popen(
        _fedsynth("generator", "serve", "--model", str(model), "--port", "0", "--port-file", str(port_file),
                  "--metrics-port", "0", "--max-batch", "16", "--threads", "1", "--insecure"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        port = _wait_for_file(port_file, proc, timeout_s=120)
        assert proc.stdout is not None
        banner = proc.stdout.readline()
        assert f":{port} " in banner, banner
        metrics_port = int(re.search(r"metrics port (\d+)", banner).group(1))  # type: ignore[union-attr]
        channel = grpcutil.make_channel(f"127.0.0.1:{port}")
        grpcutil.wait_for_serving(channel, SERVICE_NAME, timeout_s=60)
        info = GeneratorInfo.fetch(channel, timeout_s=10)
        batches: list[tuple[np.ndarray, np.ndarray, int]] = []
        total = fetch_images(channel, [2, 3], seed=4, timeout_s=60, on_batch=lambda *b: batches.append(b))
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr
    assert total == 5 and info.model_id.startswith("ddpm-tiny-digits-")
    assert 'fedsynth_generator_images_total{class_id="1"} 3.0' in metrics
    # Another process, same model and settings: the very same bytes.
    loaded = load_generator(model)
    sampler = DdimSampler(loaded.unet, loaded.scheduler_config, num_classes=10, image_shape=(1, 8, 8),
                          config=SamplingConfig(2, 1.0, 16), device=torch.device("cpu"))
    local = sampler.sample([ImageKey(4, 0, 0), ImageKey(4, 0, 1), ImageKey(4, 1, 0), ImageKey(4, 1, 1), ImageKey(4, 1, 2)])
    assert np.concatenate([b[1] for b in batches]).tobytes() == local.tobytes()


def test_serve_reports_a_missing_model_in_one_line(tmp_path: Path) -> None:
    result = subprocess.run(_fedsynth("generator", "serve", "--model", str(tmp_path / "absent"), "--insecure"),
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"fedsynth generator serve: error: {tmp_path / 'absent'} is not a generator folder: "
        + "fedsynth_generator.json is missing (train one with `fedsynth generator train`)"
    ]
