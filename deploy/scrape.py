"""Read a process's Prometheus endpoint once (the launcher's final look at the generator's own counters)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from fedsynth.wire.tls import TLSFiles, ssl_client_context

SCRAPE_TIMEOUT_S = 5.0


def scrape(url: str, *, tls: TLSFiles | None = None) -> dict[str, float]:
    """{sample name with its labels: value}, e.g. 'fedsynth_generator_images_total{class_id="3"}': 12.0.
    With `tls` the URL must be https:// (a process under mutual TLS serves nothing else), and the scrape presents
    tls.cert. Any failure to connect, verify or read is an OSError (ssl.SSLError and URLError are ones)."""
    if tls is not None and not url.startswith("https://"):
        raise ValueError(f"scrape with a TLS identity needs an https:// URL, got {url!r}")
    context = None if tls is None else ssl_client_context(tls)
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S, context=context) as response:  # noqa: S310 - ours
        text = response.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return values


def total(values: dict[str, float], name: str) -> float:
    """Sum of one metric over all its label sets."""
    return sum(v for k, v in values.items() if k == name or k.startswith(name + "{"))
