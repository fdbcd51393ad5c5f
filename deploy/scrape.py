"""Read a process's Prometheus endpoint once (the launcher's final look at the generator's own counters)."""

from __future__ import annotations

import ssl
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from fedsynth.tls import TLSFiles

SCRAPE_TIMEOUT_S = 5.0


def client_context(files: TLSFiles) -> ssl.SSLContext:
    """What a scraper of an HTTPS /metrics holds: TLS >= 1.2, only the provisioned CA trusted (the server's name
    checked against its certificate), and a node's pair as the client certificate (the operator's)."""
    context = ssl.create_default_context(cafile=str(files.ca))
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(files.cert), str(files.key))
    return context


def scrape(url: str, *, tls: TLSFiles | None = None) -> dict[str, float]:
    """{sample name with its labels: value}, e.g. 'fedsynth_generator_images_total{class_id="3"}': 12.0.
    With `tls` the URL must be https:// (a process under mutual TLS serves nothing else), and the scrape presents
    tls.cert. Any failure to connect, verify or read is an OSError (ssl.SSLError and URLError are ones)."""
    if tls is not None and not url.startswith("https://"):
        raise ValueError(f"scrape with a TLS identity needs an https:// URL, got {url!r}")
    context = None if tls is None else client_context(tls)
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
