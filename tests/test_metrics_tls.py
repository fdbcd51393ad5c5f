"""/metrics over HTTPS with the provisioned certificates: real processes, real handshakes, a real Prometheus scrape."""

from __future__ import annotations

import http.client
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from prometheus_client import CollectorRegistry, Counter

from deploy.processes import Child, ProcessGroup, fedsynth_command, wait_for_file
from deploy.prometheus.render_targets import JOBS, write_targets
from deploy.scrape import scrape, total
from fedsynth import cli
from fedsynth.errors import ConfigError
from fedsynth.process.metrics import MAX_CONNECTIONS, choose_metrics_tls, serve_metrics, serves_https
from fedsynth.wire.tls import TLSFiles
from runtime_harness import START_TIMEOUT_S, wait_until
from test_prometheus import Prometheus, free_port, tool

REPO = Path(__file__).resolve().parents[1]
TLS_CONFIG = REPO / "deploy" / "prometheus" / "prometheus-tls.yml"
HOLDOUT = ["--backend", "holdout", "--dataset", "digits", "--holdout-fraction", "0.2", "--seed", "0"]
PLAIN_OFF_LOOPBACK = ("--metrics-host 0.0.0.0 is not loopback and /metrics would be plain HTTP: run with --tls-dir (then "
                      "/metrics is HTTPS, client certificate required) or pass --metrics-insecure")


def provision(folder: Path, *extra: str) -> Path:
    assert cli.main(["deploy", "provision", "--out", str(folder), "--clients", "1", *extra]) == 0
    return folder


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Client certificates that may serve HTTPS too (--client-hosts)."""
    return provision(tmp_path_factory.mktemp("pki") / "tls", "--client-hosts", "client0.example")


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessGroup]:
    processes = ProcessGroup(tmp_path_factory.mktemp("logs"))
    yield processes
    processes.stop_all(grace_s=3.0)


@pytest.fixture(scope="module")
def generator(pki: Path, group: ProcessGroup, tmp_path_factory: pytest.TempPathFactory) -> tuple[Child, int, Path]:
    """A holdout generator under mutual TLS, /metrics on 127.0.0.1 (HTTPS by default), client-0 revoked."""
    root = tmp_path_factory.mktemp("generator")
    (root / "revoked.txt").write_text("client-0\n")
    child = group.start("generator", fedsynth_command(
        "generator", "serve", *HOLDOUT, "--port", "0", "--metrics-port", "0", "--metrics-port-file", str(root / "mport"),
        "--metrics-host", "127.0.0.1", "--tls-dir", str(pki), "--revoked", str(root / "revoked.txt"), "--threads", "1"))
    return child, int(wait_for_file(root / "mport", child, timeout_s=START_TIMEOUT_S)), root / "revoked.txt"


def context(pki: Path, node_id: str | None, *, ca: Path | None = None) -> ssl.SSLContext:
    """What a scraper holds: the provisioned CA, and a node's pair (None: no client certificate)."""
    ctx = ssl.create_default_context(cafile=str(ca or pki / "ca.pem"))
    if node_id is not None:
        ctx.load_cert_chain(str(pki / f"{node_id}.pem"), str(pki / f"{node_id}-key.pem"))
    return ctx


def get(port: int, ctx: ssl.SSLContext | None) -> tuple[int, str]:
    """GET /metrics on 127.0.0.1: HTTPS with `ctx`, plain HTTP without."""
    conn = (http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=10) if ctx is not None
            else http.client.HTTPConnection("127.0.0.1", port, timeout=10))
    try:
        conn.request("GET", "/metrics")
        reply = conn.getresponse()
        return reply.status, reply.read().decode()
    finally:
        conn.close()


# ---- fast: which scheme, and the refusals ----------------------------------------------------------------------


def test_plain_http_off_loopback_needs_metrics_insecure(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ConfigError) as refused:
        choose_metrics_tls(0, "0.0.0.0", False, None)
    assert str(refused.value) == PLAIN_OFF_LOOPBACK
    assert choose_metrics_tls(0, "127.0.0.1", False, None) is None and not caplog.records
    assert choose_metrics_tls(-1, "0.0.0.0", False, None) is None  # disabled: nothing to refuse
    assert choose_metrics_tls(0, "0.0.0.0", True, None) is None
    assert "plain HTTP /metrics on 0.0.0.0 (--metrics-insecure)" in caplog.text
    with pytest.raises(ConfigError, match="--metrics-port must be in -1..65535, got 70000"):
        choose_metrics_tls(70000, "127.0.0.1", False, None)
    pki = provision(tmp_path / "tls")  # client certificates without --client-hosts: clientAuth only
    server, client = TLSFiles.from_dir(pki, "generator"), TLSFiles.from_dir(pki, "client-0")
    assert choose_metrics_tls(0, "10.0.0.5", False, server) == server
    assert choose_metrics_tls(0, "127.0.0.1", True, server) is None
    assert not serves_https(client) and choose_metrics_tls(0, "127.0.0.1", False, client) is None
    with pytest.raises(ConfigError, match=f"certificate {client.cert} is for TLS clients only.*--client-hosts HOST"):
        choose_metrics_tls(0, "10.0.0.5", False, client)


@pytest.mark.parametrize("command", [
    ["coordinator", "--port", "0"],
    ["client", "--coordinator", "127.0.0.1:1"],
    ["generator", "serve", *HOLDOUT, "--port", "0"],
])
def test_every_role_refuses_plain_metrics_off_loopback(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*command, "--insecure", "--metrics-port", "0", "--metrics-host", "0.0.0.0"]
    assert cli.main(argv) == 1
    prog = " ".join(command[:2] if command[0] == "generator" else command[:1])
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"fedsynth {prog}: error: {PLAIN_OFF_LOOPBACK}"


def test_client_hosts_make_client_certificates_server_certificates(pki: Path) -> None:
    cert = x509.load_pem_x509_certificate((pki / "client-0.pem").read_bytes())
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH}
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(n.value) for n in names] == ["spiffe://fedsynth/client/0", "localhost", "127.0.0.1", "client0.example"]
    assert not serves_https(TLSFiles.from_dir(pki, "operator"))


def test_scrape_reads_https_metrics_with_the_operator_pair(pki: Path, tmp_path: Path) -> None:
    """What `fedsynth run` with runtime.tls_dir does at the end: read the generator's HTTPS /metrics as `operator`."""
    registry = CollectorRegistry()
    Counter("fedsynth_generator_images", "images", ["class_id"], registry=registry).labels(class_id="3").inc(12)
    server = serve_metrics(0, tls=TLSFiles.from_dir(pki, "generator"), registry=registry)
    assert server is not None
    url = f"https://127.0.0.1:{server.server_port}/metrics"
    try:
        values = scrape(url, tls=TLSFiles.from_dir(pki, "operator"))
        assert values['fedsynth_generator_images_total{class_id="3"}'] == 12.0
        assert total(values, "fedsynth_generator_images_total") == 12.0
        with pytest.raises(ValueError, match="needs an https:// URL"):
            scrape(url.replace("https://", "http://"), tls=TLSFiles.from_dir(pki, "operator"))
        with pytest.raises(OSError, match="CERTIFICATE_VERIFY_FAILED"):
            scrape(url)  # no TLS identity: the system's CAs do not know the provisioned one
        other = provision(tmp_path / "other")
        with pytest.raises(OSError, match="CERTIFICATE_VERIFY_FAILED"):
            scrape(url, tls=TLSFiles.from_dir(other, "operator"))  # the scraper trusts another CA
    finally:
        server.shutdown()
        server.server_close()


def _connection_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "metrics-connection")


def _ended_by_server(sock: socket.socket, *, trickle: bytes = b"", timeout_s: float = 60.0) -> bool:
    """Whether the server closes this connection within timeout_s while the peer stays silent (or sends `trickle`,
    one byte every 0.3 s: each read is quick, only a whole-request deadline ends it)."""
    stop_at = time.monotonic() + timeout_s
    sock.settimeout(0.3)
    sent = 0
    while time.monotonic() < stop_at:
        try:
            if not sock.recv(4096):
                return True
        except TimeoutError:
            pass
        except OSError:  # reset
            return True
        if trickle:
            try:
                sock.sendall(trickle[sent % len(trickle):][:1])
            except OSError:
                return True
            sent += 1
    return False


def test_a_flood_of_idle_connections_holds_a_bounded_number_of_threads_and_a_scrape_still_succeeds(pki: Path) -> None:
    """Four times the connection cap of silent TCP peers: no more than MAX_CONNECTIONS connection threads ever run,
    a scrape with the operator's certificate is answered in the middle of the flood, and every idle peer is hung up on."""
    registry = CollectorRegistry()
    Counter("fedsynth_probe", "probe", registry=registry).inc(3)
    server = serve_metrics(0, tls=TLSFiles.from_dir(pki, "generator"), registry=registry)
    assert server is not None
    port, idle, most = server.server_port, [], 0
    try:
        for _ in range(4 * MAX_CONNECTIONS):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=30))
            most = max(most, _connection_threads())
        wait_until(lambda: server.slots.open_count() == MAX_CONNECTIONS, timeout_s=30, what="the cap filled")
        most = max(most, _connection_threads())
        status, body = get(port, context(pki, "operator"))
        assert status == 200 and "fedsynth_probe_total 3.0" in body
        most = max(most, _connection_threads())
        assert most <= MAX_CONNECTIONS
        assert all(_ended_by_server(sock) for sock in idle)
        wait_until(lambda: server.slots.open_count() == 0, timeout_s=30, what="every slot released")
    finally:
        for sock in idle:
            sock.close()
        server.shutdown()
        server.server_close()


def test_a_trickling_peer_is_ended_at_the_request_deadline_not_per_read() -> None:
    """Plain HTTP on loopback: a peer that sends its request line one byte every 0.3 s (every read well inside the
    per-read timeout) is hung up on; the endpoint keeps answering."""
    registry = CollectorRegistry()
    server = serve_metrics(0, registry=registry)
    assert server is not None
    try:
        with socket.create_connection(("127.0.0.1", server.server_port), timeout=30) as sock:
            request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-Padding: " + b"a" * 4000
            assert _ended_by_server(sock, trickle=request)
        assert get(server.server_port, None)[0] == 200
    finally:
        server.shutdown()
        server.server_close()


# ---- a real generator process: HTTPS only, client certificate of the CA only -----------------------------------


@pytest.mark.slow
def test_https_with_a_client_certificate_of_the_ca(generator: tuple[Child, int, Path], pki: Path) -> None:
    child, port, revoked = generator
    status, body = get(port, context(pki, "operator"))
    assert status == 200 and "fedsynth_generator_model_load_seconds" in body
    assert get(port, context(pki, "client-0")) == (403, f"node client-0 is revoked ({revoked})")
    log = child.log_path.read_text()
    assert f"metrics on https://127.0.0.1:{port}/metrics" in log and "PRIVATE KEY" not in log


@pytest.mark.slow
def test_no_client_certificate_plain_http_and_foreign_certificates_are_refused(
        generator: tuple[Child, int, Path], pki: Path, tmp_path: Path) -> None:
    _, port = generator[:2]
    with pytest.raises(ssl.SSLError, match="CERTIFICATE_REQUIRED"):
        get(port, context(pki, None))
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        get(port, None)  # plain HTTP: the server reads "GET /" as a broken ClientHello and hangs up
    other = provision(tmp_path / "other")
    with pytest.raises(ssl.SSLError, match="UNKNOWN_CA"):
        get(port, context(other, "operator", ca=pki / "ca.pem"))  # a client certificate of another CA
    with pytest.raises(ssl.SSLError, match="UNSUPPORTED_CERTIFICATE"):
        get(port, context(pki, "generator"))  # a server certificate (serverAuth only) as a client certificate
    with pytest.raises(ssl.SSLError, match="CERTIFICATE_VERIFY_FAILED"):
        get(port, context(other, "operator"))  # the scraper trusts another CA: the generator's certificate fails


@pytest.mark.slow
@pytest.mark.serial  # asserts a time bound
def test_an_idle_connection_does_not_stall_the_endpoint(generator: tuple[Child, int, Path], pki: Path) -> None:
    """The handshake runs in the connection's thread: a silent TCP peer (a port scan) blocks no scrape."""
    port = generator[1]
    with socket.create_connection(("127.0.0.1", port)):
        time.sleep(0.2)
        started = time.monotonic()
        assert get(port, context(pki, "operator"))[0] == 200
        assert time.monotonic() - started < 5.0


# ---- a real Prometheus with the shipped TLS config ---------------------------------------------------------------


def write_tls_config(folder: Path, pki: Path) -> Path:
    """deploy/prometheus/prometheus-tls.yml with the certificate folder moved to `pki` and a 0.5 s interval."""
    settings = yaml.safe_load(TLS_CONFIG.read_text())
    assert [job["job_name"] for job in settings["scrape_configs"]] == list(JOBS.values())
    for job in settings["scrape_configs"]:
        files = job["tls_config"]
        assert job["scheme"] == "https" and {k: Path(files[k]).name for k in ("ca_file", "cert_file", "key_file")} == \
            {"ca_file": "ca.pem", "cert_file": "operator.pem", "key_file": "operator-key.pem"}
        files.update({k: str(pki / Path(files[k]).name) for k in ("ca_file", "cert_file", "key_file")})
    settings["global"].update(scrape_interval="500ms", scrape_timeout="500ms", evaluation_interval="1s")
    path = folder / "prometheus.yml"
    path.write_text(yaml.safe_dump(settings, sort_keys=False))
    check = subprocess.run([tool("promtool"), "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    return path


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_prometheus_scrapes_the_generator_and_a_client_node_over_tls(
        generator: tuple[Child, int, Path], pki: Path, group: ProcessGroup, tmp_path: Path) -> None:
    config = write_tls_config(tmp_path, pki)
    client = group.start("client", fedsynth_command(  # its coordinator never answers: it retries, serving /metrics
        "client", "--coordinator", f"127.0.0.1:{free_port()}", "--clients", "0", "--cache-dir", str(tmp_path / "cache"),
        "--tls-dir", str(pki), "--reconnect-timeout", "240", "--metrics-port", "0",
        "--metrics-port-file", str(tmp_path / "client.mport")))
    client_port = int(wait_for_file(tmp_path / "client.mport", client, timeout_s=START_TIMEOUT_S))
    assert get(client_port, context(pki, "operator"))[0] == 200  # the client node serves HTTPS with client-0's pair
    write_targets(tmp_path / "targets", "generator", [f"127.0.0.1:{generator[1]}"])
    write_targets(tmp_path / "targets", "client", [f"127.0.0.1:{client_port}"])
    write_targets(tmp_path / "targets", "coordinator", [])
    listen = free_port()
    prometheus = Prometheus(group.start("prometheus", [
        tool("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
        f"--web.listen-address=127.0.0.1:{listen}", "--log.level=warn"]), listen)
    wait_until(prometheus.ready, timeout_s=60, what="prometheus /-/ready", interval_s=0.2)

    def up() -> dict[str, float]:
        return {r["metric"]["job"]: float(r["value"][1]) for r in prometheus.query("up")}

    try:
        wait_until(lambda: up() == {JOBS["generator"]: 1.0, JOBS["client"]: 1.0}, timeout_s=30, what="up == 1",
                   interval_s=0.5)
    except TimeoutError:
        pytest.fail(f"prometheus reports up = {up()}; its targets: {prometheus.log_tail()}")
    assert prometheus.value("fedsynth_generator_model_load_seconds") is not None
    assert prometheus.value("fedsynth_client_rounds_total") == 0.0
    assert "PRIVATE KEY" not in client.log_path.read_text()
