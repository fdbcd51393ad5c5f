"""--metrics-linger-s: a process that ends with its run waits (bounded) for one more scrape of its final counters."""

from __future__ import annotations

import argparse
import threading
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from fedsynth.errors import ConfigError
from fedsynth.process.metrics import add_metrics_arguments, linger_for_final_scrape, serve_metrics, serve_metrics_from_args

pytestmark = pytest.mark.serial  # asserts time bounds: runs alone, after the parallel tests


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


@pytest.fixture
def served() -> tuple:
    registry = CollectorRegistry()
    counter = Counter("fedsynth_test_final", "a counter set at the end of a run", registry=registry)
    server = serve_metrics(0, registry=registry)
    assert server is not None
    yield server, counter
    server.shutdown()
    server.server_close()


def test_the_wait_ends_with_the_first_scrape_after_it_began(served: tuple) -> None:
    server, counter = served
    scrape(server.server_port)  # answered before the run ended: it does not count
    counter.inc(7)
    seen: list[str] = []
    later = threading.Timer(0.5, lambda: seen.append(scrape(server.server_port)))
    later.start()
    began = time.monotonic()
    assert server.wait_for_next_request(timeout_s=30)
    waited = time.monotonic() - began
    later.join()
    assert 0.4 < waited < 10
    assert "fedsynth_test_final_total 7.0" in seen[0]


def test_without_a_scrape_the_wait_is_bounded_and_a_signal_ends_it(served: tuple) -> None:
    server, _ = served
    began = time.monotonic()
    assert not server.wait_for_next_request(timeout_s=0.5)
    assert 0.45 < time.monotonic() - began < 5
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    began = time.monotonic()
    linger_for_final_scrape(server, 60, stop)
    assert time.monotonic() - began < 5


def test_a_bad_linger_is_refused_before_anything_is_served() -> None:
    parser = argparse.ArgumentParser()
    add_metrics_arguments(parser, linger=True)
    for bad in ("-1", "nan", "inf"):
        args = parser.parse_args(["--metrics-port", "0", "--metrics-linger-s", bad])
        with pytest.raises(ConfigError, match=f"--metrics-linger-s must be a finite number >= 0, got {bad}"):
            serve_metrics_from_args(args, None)
