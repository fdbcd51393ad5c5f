"""`fedsynth run` with runtime.tls_dir reads the generator's counters from its HTTPS /metrics, as `operator`."""

from __future__ import annotations

import argparse
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Info

from deploy.launcher import Launcher
from fedsynth import cli
from fedsynth.config import load_config
from fedsynth.generation.generator_names import DEVICE_SECONDS_TOTAL, IMAGES_TOTAL, INFO, REQUESTS_TOTAL
from fedsynth.process.metrics import serve_metrics
from fedsynth.wire.tls import TLSFiles


def test_generator_counters_over_https_with_the_operator_pair(tmp_path: Path) -> None:
    pki = tmp_path / "tls"
    assert cli.main(["deploy", "provision", "--out", str(pki), "--clients", "1"]) == 0
    registry = CollectorRegistry()  # the generator's own names, as `fedsynth generator serve` exports them
    images = Counter(IMAGES_TOTAL.removesuffix("_total"), "images", ["class_id"], registry=registry)
    images.labels(class_id="0").inc(5)
    images.labels(class_id="1").inc(7)
    Counter(DEVICE_SECONDS_TOTAL.removesuffix("_total"), "seconds", registry=registry).inc(1.5)
    Counter(REQUESTS_TOTAL.removesuffix("_total"), "requests", ["method", "code"], registry=registry).labels(
        method="Generate", code="OK").inc(2)
    Info(INFO.removesuffix("_info"), "model", registry=registry).info({"backend": "holdout", "model_id": "m1"})
    server = serve_metrics(0, tls=TLSFiles.from_dir(pki, "generator"), registry=registry)
    assert server is not None
    try:
        cfg = load_config(None, [f"runtime.tls_dir={pki}"])
        launcher = Launcher(cfg, argparse.Namespace(config=None, set=[]), tmp_path / "run")
        launcher.generator_metrics_file = tmp_path / "generator.metrics-port"
        launcher.generator_metrics_file.write_text(f"{server.server_port}\n")
        assert launcher.generator_counters() == {"backend": "holdout", "model_id": "m1", "device": "", "dtype": "",
                                                 "images_total": 12, "device_seconds": 1.5, "requests_total": 2,
                                                 "quality_filter": None}
    finally:
        server.shutdown()
        server.server_close()
