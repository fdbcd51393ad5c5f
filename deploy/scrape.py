"""Read a process's Prometheus endpoint once (the launcher's final look at the generator's own counters)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

SCRAPE_TIMEOUT_S = 5.0


def scrape(url: str) -> dict[str, float]:
    """{sample name with its labels: value}, e.g. 'fedsynth_generator_images_total{class_id="3"}': 12.0."""
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as response:  # noqa: S310 - our own local endpoint
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
