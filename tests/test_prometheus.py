"""A real Prometheus scrapes a real FedEAS run (coordinator, generator, client nodes): what it records equals the plan."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from prometheus_client import CollectorRegistry

from client_node.metrics import ClientMetrics
from coordinator.metrics import CoordinatorMetrics
from deploy.processes import Child, fedsynth_command, wait_for_file
from deploy.prometheus import render_targets
from deploy.prometheus.render_targets import JOBS, ROLES, resolve_target, write_targets
from fedsynth.allocation import fedeas_generation_row
from fedsynth.assembly import client_shard
from fedsynth.config import RunConfig
from generator_service.metrics import GeneratorMetrics
from runtime_harness import START_TIMEOUT_S, Runtime, config, overrides, wait_exit, wait_until, watch_rounds

REPO = Path(__file__).resolve().parents[1]
SHIPPED_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "fedsynth-dashboard.json"
METRICS_DOC = REPO / "docs" / "metrics.md"
INSTALL = "bash scripts/install_prometheus.sh"

# 3 clients, 6 rounds, FedEAS at beta 4 (148 images on this partition): small enough for a 1-step DDIM generator.
RUN: dict[str, Any] = {
    "seed": 0,
    "data.clients": 3,
    "train.rounds": 6,
    "train.local_epochs": 3,
    "generation.policy": "fedeas",
    "generation.beta": 4.0,
}
CLIENT_PROCESSES = ("0", "1-2")  # two client targets, one of them hosting two logical clients
# Each process waits (at most this long) for one more scrape after its run ends, so Prometheus holds its final counters
# however late file_sd discovery and the first scrape come (5 s and more under load; the run can be over by then).
LINGER_S = 60
RECENT = "5m"  # last_over_time window: a series of an exited process is stale at "now" but its samples remain


# ---- the metric names our processes expose ---------------------------------------------------------------------


def exposed_families() -> dict[str, str]:
    """{family name as scraped (counters with _total, info with _info): type} for the three roles' metrics."""
    registry = CollectorRegistry()
    CoordinatorMetrics(registry)
    ClientMetrics(registry)
    GeneratorMetrics(registry)
    suffix = {"counter": "_total", "info": "_info"}
    return {family.name + suffix.get(family.type, ""): family.type for family in registry.collect()}


def exposed_series_names() -> set[str]:
    """Every series name a scrape can hold, e.g. histograms' _bucket/_sum/_count and counters' _created."""
    names: set[str] = set()
    for name, kind in exposed_families().items():
        if kind == "histogram":
            names.update(name + s for s in ("_bucket", "_sum", "_count", "_created"))
        elif kind == "counter":
            names.update((name, name.removesuffix("_total") + "_created"))
        else:
            names.add(name)
    return names


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of the Grafana dashboard."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels if p.get("type") != "row" for t in p["targets"]]


def test_metric_names_follow_prometheus_conventions_and_are_documented() -> None:
    families = exposed_families()
    doc = METRICS_DOC.read_text()
    for name, kind in families.items():
        assert re.fullmatch(r"fedsynth_(coordinator|client|generator)_[a-z0-9_]+", name), name
        assert (kind == "counter") == name.endswith("_total"), f"{name} is a {kind}"
        assert f"`{name}`" in doc, f"{name} is missing from {METRICS_DOC.name}"


def test_dashboard_queries_name_only_series_we_expose() -> None:
    queries = dashboard_queries()
    assert len(queries) >= 12, queries
    known = exposed_series_names()
    for title, expr in queries:
        used = set(re.findall(r"\bfedsynth_[a-z0-9_]+", expr))
        assert used, f"panel {title!r}: {expr} names no fedsynth metric"
        assert used <= known, f"panel {title!r} names unknown series {sorted(used - known)}"


# ---- Prometheus, the real binary ----------------------------------------------------------------------------------


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"the {name} binary is not on PATH: run `{INSTALL}` (Debian's prometheus package)")
    return path


def test_promtool_accepts_the_shipped_config() -> None:
    check = subprocess.run([tool("promtool"), "check", "config", str(SHIPPED_CONFIG)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    shipped = yaml.safe_load(SHIPPED_CONFIG.read_text())
    assert [job["job_name"] for job in shipped["scrape_configs"]] == [JOBS[role] for role in ROLES]


def test_render_targets_reads_port_files_and_names_bad_targets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "coordinator.mport").write_text("9123\n")
    out = tmp_path / "targets"
    assert render_targets.main(["--out-dir", str(out), "--coordinator", str(tmp_path / "coordinator.mport"),
                                "--client", "10.0.0.5:9101", "--client", "10.0.0.6:9101", "--label", "run=a01"]) == 0
    assert json.loads((out / "coordinator.json").read_text()) == [{"targets": ["127.0.0.1:9123"], "labels": {"run": "a01"}}]
    assert json.loads((out / "client.json").read_text())[0]["targets"] == ["10.0.0.5:9101", "10.0.0.6:9101"]
    assert not (out / "generator.json").exists()
    for bad, named in ((["--client", "nohost"], "'nohost'"), (["--client", "h:1", "--label", "1x=2"], "'1x=2'"), ([], "--client")):
        assert render_targets.main(["--out-dir", str(out), *bad]) == 1
        assert named in capsys.readouterr().err


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def write_test_config(folder: Path) -> Path:
    """The shipped config (its jobs and file_sd paths) with a 0.5 s scrape interval, next to an empty targets/."""
    settings = yaml.safe_load(SHIPPED_CONFIG.read_text())
    settings["global"].update(scrape_interval="500ms", scrape_timeout="500ms", evaluation_interval="1s")
    for role in ROLES:
        write_targets(folder / "targets", role, [])
    path = folder / "prometheus.yml"
    path.write_text(yaml.safe_dump(settings, sort_keys=False))
    check = subprocess.run([tool("promtool"), "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    return path


class Prometheus:
    def __init__(self, child: Child, port: int) -> None:
        self.child = child
        self.url = f"http://127.0.0.1:{port}"

    def ready(self) -> bool:
        if self.child.process.poll() is not None:
            pytest.fail(f"prometheus exited with code {self.child.process.returncode}:\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, ConnectionError):
            return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector of `expr` now; AssertionError with Prometheus's message when it refuses the query."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                body = json.load(reply)
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"prometheus refused {expr!r}: {exc.read().decode(errors='replace')}") from None
        assert body["status"] == "success", body
        return body["data"]["result"]

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        assert len(result) <= 1, f"{expr} returned {len(result)} series"
        return float(result[0]["value"][1]) if result else None

    def log_tail(self) -> str:
        return "\n".join(self.child.log_path.read_text(errors="replace").splitlines()[-20:])


def start_prometheus(runtime: Runtime, folder: Path) -> Prometheus:
    config_path = write_test_config(folder)
    port = free_port()
    command = [
        tool("prometheus"), f"--config.file={config_path}", f"--storage.tsdb.path={folder / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
    ]
    prometheus = Prometheus(runtime.group.start("prometheus", command), port)
    wait_until(prometheus.ready, timeout_s=60, what="prometheus /-/ready", interval_s=0.2)
    return prometheus


# ---- the run ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def generator_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny DDPM trained for 4 steps: its images are noise, but each one is generated and counted for real."""
    out = tmp_path_factory.mktemp("generator") / "model"
    command = fedsynth_command(
        "generator", "train", "--dataset", "digits", "--size", "tiny", "--steps", "4", "--batch-size", "16",
        "--out", str(out), "--grid-per-class", "0", "--threads", "1", "--no-progress",
    )
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return out


def planned_generation(cfg: RunConfig) -> np.ndarray:
    """K x C: what each client computes from its own shard's label counts at the run's beta."""
    rows = []
    for k in range(cfg.data.clients):
        shard = client_shard(cfg, k)
        rows.append(fedeas_generation_row(np.bincount(shard.y, minlength=shard.num_classes), cfg.generation.beta))
    return np.stack(rows)


def logged_metrics_port(child: Child) -> int | None:
    """`fedsynth generator serve` prints its metrics port ("... (metrics port N)"); it has no metrics port file."""
    found = re.search(r"\(metrics port (\d+)\)", child.log_path.read_text(errors="replace"))
    return int(found.group(1)) if found else None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_prometheus_records_the_planned_images_and_the_rounds(
    runtime: Runtime, tmp_path: Path, generator_model: Path
) -> None:
    cfg = config(RUN)
    plan = planned_generation(cfg)
    assert plan.sum() > 0
    targets = tmp_path / "prometheus" / "targets"
    prometheus = start_prometheus(runtime, tmp_path / "prometheus")

    generator = runtime.group.start("generator", fedsynth_command(
        "generator", "serve", "--model", str(generator_model), "--port", "0", "--port-file", str(tmp_path / "generator.port"),
        "--metrics-port", "0", "--ddim-steps", "1", "--guidance", "0", "--threads", "1", "--insecure",
    ))
    generator_address = "127.0.0.1:" + wait_for_file(tmp_path / "generator.port", generator, timeout_s=START_TIMEOUT_S)
    metrics_port = wait_until(lambda: logged_metrics_port(generator), timeout_s=10, what="the generator's metrics port")
    write_targets(targets, "generator", [f"127.0.0.1:{metrics_port}"])  # clients wait for it to load (they retry)

    sets = [item for override in overrides(RUN) for item in ("--set", override)]
    coordinator = runtime.group.start("coordinator", fedsynth_command(
        "coordinator", *sets, "--out-dir", str(tmp_path / "run"), "--host", "127.0.0.1", "--port", "0",
        "--port-file", str(tmp_path / "coordinator.port"), "--metrics-port", "0",
        "--metrics-port-file", str(tmp_path / "coordinator.mport"), "--metrics-linger-s", str(LINGER_S), "--insecure",
    ))
    coordinator_address = "127.0.0.1:" + wait_for_file(tmp_path / "coordinator.port", coordinator, timeout_s=START_TIMEOUT_S)
    write_targets(targets, "coordinator", [resolve_target(str(tmp_path / "coordinator.mport"))])

    clients = []
    for ids in CLIENT_PROCESSES:
        clients.append(runtime.group.start(f"client-{ids}", fedsynth_command(
            "client", "--coordinator", coordinator_address, "--clients", ids, "--generator", generator_address,
            "--cache-dir", str(tmp_path / "cache"), "--torch-threads", "1", "--reconnect-timeout", "60",
            "--metrics-port", "0", "--metrics-port-file", str(tmp_path / f"client-{ids}.mport"),
            "--metrics-linger-s", str(LINGER_S), "--insecure",
        )))
    # gRPC from this process only after the last fork: a child forked while gRPC is busy here can abort (SIGABRT in
    # gRPC's fork handlers, seen as exit -6 before the child ran a line of ours).
    for ids, child in zip(CLIENT_PROCESSES, clients):
        wait_for_file(tmp_path / f"client-{ids}.mport", child, timeout_s=START_TIMEOUT_S)
    write_targets(targets, "client", [resolve_target(str(tmp_path / f"client-{ids}.mport")) for ids in CLIENT_PROCESSES])

    for summary in watch_rounds(coordinator_address, timeout_s=180):
        if summary.finished:
            assert summary.success, summary.message
            break
    assert wait_exit(coordinator, 30) == 0, coordinator.log_path.read_text()[-3000:]
    assert [wait_exit(child, 30) for child in clients] == [0] * len(clients)

    def settled(expr: str, expected: float) -> None:
        """Poll (bounded) until Prometheus reports `expected`; fail with what it reports instead."""
        try:
            wait_until(lambda: prometheus.value(expr) == expected, timeout_s=20, what=expr, interval_s=0.5)
        except TimeoutError:
            pytest.fail(f"prometheus reports {expr} = {prometheus.value(expr)}, expected {expected}")

    total = float(plan.sum())
    settled(f"sum(last_over_time(fedsynth_generator_images_total[{RECENT}]))", total)
    settled(f"sum(last_over_time(fedsynth_client_images_received_total[{RECENT}]))", total)
    settled(f"sum(last_over_time(fedsynth_client_images_requested_total[{RECENT}]))", total)
    settled(f"last_over_time(fedsynth_coordinator_rounds_completed_total[{RECENT}])", float(cfg.train.rounds))

    per_class = prometheus.query(f"sum by (class_id) (last_over_time(fedsynth_generator_images_total[{RECENT}]))")
    recorded = {int(r["metric"]["class_id"]): int(float(r["value"][1])) for r in per_class}
    assert recorded == {c: int(n) for c, n in enumerate(plan.sum(axis=0)) if n > 0}

    jobs = {r["metric"]["job"]: int(float(r["value"][1])) for r in prometheus.query(f"count by (job) (last_over_time(up[{RECENT}]))")}
    assert jobs == {JOBS["coordinator"]: 1, JOBS["client"]: len(CLIENT_PROCESSES), JOBS["generator"]: 1}

    for title, expr in dashboard_queries():  # every dashboard query is valid PromQL on the real server
        grafana_free = expr.replace("$__rate_interval", "1m").replace("$__range", RECENT).replace("$__interval", "5s")
        prometheus.query(grafana_free)
