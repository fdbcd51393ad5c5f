"""The deployment templates stay honest: manifests validate, units parse, every command parses with the real CLI."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import json
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from coordinator.servicer import SERVICE_NAME as COORDINATOR_SERVICE
from deploy.processes import fedsynth_command
from deploy.provision import provision
from fedsynth import cli
from fedsynth.config import load_config
from fedsynth.process.runtime import EXIT_BELOW_QUORUM, EXIT_ERROR, EXIT_INTERNAL
from generator_service.serve_cmd import SERVICE_NAME as GENERATOR_SERVICE

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = ROOT / "deploy" / "templates"
KUBERNETES = TEMPLATES / "kubernetes"
KUBERNETES_VERSION = "1.32.0"  # the schemas the manifests must satisfy (strict: unknown fields fail too)
NAMESPACE = "fedsynth"
HEALTHCHECK = "fedsynth-healthcheck"  # the name the Dockerfile installs deploy/templates/docker/healthcheck.py under
SERVICE_NAMES = {"coordinator": COORDINATOR_SERVICE, "generator serve": GENERATOR_SERVICE}
EXIT_SIGTERM = 143  # the coordinator's exit code when stopped by SIGTERM (docs/runtime.md)
# Values for the placeholders in templates: systemd's %i and ${VAR}, Kubernetes' $(VAR).
SAMPLE_ENV = {"FEDSYNTH_COORDINATOR": "coord.lab:50051", "FEDSYNTH_GENERATOR": "gpu1.lab:50052", "CLIENT_ID": "3"}


def healthcheck_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fedsynth_healthcheck", TEMPLATES / "docker" / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parse(parser: argparse.ArgumentParser, argv: list[str], where: str) -> argparse.Namespace:
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            return parser.parse_args(argv)
    except SystemExit:
        refused = errors.getvalue().strip().splitlines()[-1]  # argparse's "PROG: error: ..." line
    pytest.fail(f"{where}: `{shlex.join(argv)}` is refused: {refused}")


def parse_fedsynth(argv: list[str], where: str) -> tuple[str, argparse.Namespace]:
    """argv after `fedsynth`, parsed by the sub-command's real parser, built as fedsynth.cli.main builds it."""
    resolved = cli._resolve(argv)
    assert resolved is not None, f"{where}: {argv[:2]} is not a fedsynth sub-command"
    name, rest = resolved
    parser = argparse.ArgumentParser(prog=f"fedsynth {name}")
    importlib.import_module(cli.COMMANDS[name][0]).add_arguments(parser)
    return name, _parse(parser, rest, where)


def parse_probe(argv: list[str], where: str) -> argparse.Namespace:
    assert argv[0] == HEALTHCHECK, f"{where}: probe runs {argv[0]!r}, not {HEALTHCHECK}"
    return _parse(healthcheck_module().build_parser(), argv[1:], where)


def substitute(text: str, env: dict[str, str], where: str) -> str:
    out = re.sub(r"\$\{(\w+)\}|\$\((\w+)\)", lambda m: env.get(m.group(1) or m.group(2), m.group(0)), text)
    assert "${" not in out and "$(" not in out, f"{where}: unresolved variable in {text!r}"
    return out


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


def run_toml() -> dict[str, Any]:
    return tomllib.loads((TEMPLATES / "run.toml").read_text())


# ---- systemd ---------------------------------------------------------------------------------------------------

UNITS = sorted((TEMPLATES / "systemd").glob("*.service"))


def read_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """systemd's ini dialect: repeated keys accumulate, '#'/';' comments, no interpolation."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, sep, value = line.partition("=")
        assert current is not None and sep, f"{path.name}:{number}: not `Key=Value` inside a section: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_unit_files_are_the_three_roles() -> None:
    assert [u.name for u in UNITS] == ["fedsynth-client@.service", "fedsynth-coordinator.service", "fedsynth-generator.service"]


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_unit_has_required_keys_and_real_flags(unit: Path) -> None:
    sections = read_unit(unit)
    for section, keys in {"Unit": ["Description"], "Service": ["ExecStart", "User", "Restart"], "Install": ["WantedBy"]}.items():
        for key in keys:
            assert sections.get(section, {}).get(key), f"{unit.name}: [{section}] {key}= missing"
    service = sections["Service"]
    env = dict(SAMPLE_ENV)
    for assignment in service.get("Environment", []):
        for item in shlex.split(assignment):
            key, _, value = item.partition("=")
            env[key] = value
    (exec_start,) = service["ExecStart"]
    argv = shlex.split(substitute(exec_start.replace("%i", "3"), env, unit.name))
    assert argv[0].startswith("/") and argv[0].endswith("/fedsynth"), f"{unit.name}: ExecStart runs {argv[0]!r}"
    role, args = parse_fedsynth(argv[1:], unit.name)
    assert role == {"client@": "client", "coordinator": "coordinator", "generator": "generator serve"}[
        unit.name.removeprefix("fedsynth-").removesuffix(".service")]
    assert args.tls_dir is not None and not args.insecure, f"{unit.name}: runs without mutual TLS"
    if role == "client":
        assert args.clients == "3", f"{unit.name}: the instance name must be the client id (--clients %i)"
    else:
        assert args.host == "0.0.0.0" and args.port in (50051, 50052), f"{unit.name}: --host/--port"
    # Exit 1 (bad config or TLS files), 3 (below quorum) and 4 (internal error) are final: a restart would only
    # repeat them.
    final = {int(code) for line in service.get("RestartPreventExitStatus", []) for code in line.split()}
    assert final == ({EXIT_ERROR} if role == "generator serve" else {EXIT_ERROR, EXIT_BELOW_QUORUM, EXIT_INTERNAL}), unit.name
    if role == "coordinator":  # stopped by SIGTERM, checkpoint kept: not a failure
        assert service.get("SuccessExitStatus") == [str(EXIT_SIGTERM)], unit.name


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_analyze_verify_is_clean(unit: Path, tmp_path: Path) -> None:
    """systemd's own parser: unknown keys or bad values are warnings (exit 0), so any output about the unit fails."""
    binary = shutil.which("fedsynth") or str(Path(sys.executable).parent / "fedsynth")
    copy = tmp_path / unit.name
    copy.write_text(unit.read_text().replace("/opt/fedsynth/venv/bin/fedsynth", binary))  # verify wants it to exist
    name = copy.name.replace("@.service", "@3.service")
    result = subprocess.run(["systemd-analyze", "verify", f"./{name}"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=30)
    complaints = [line for line in (result.stdout + result.stderr).splitlines() if unit.name.split("@")[0] in line]
    assert result.returncode == 0 and not complaints, result.stdout + result.stderr


# ---- Docker ----------------------------------------------------------------------------------------------------

def dockerfile() -> list[tuple[str, str]]:
    text = (TEMPLATES / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_dockerfile_runs_a_real_subcommand_and_installs_the_probe() -> None:
    instructions = dockerfile()
    values = {kind: value for kind, value in instructions}
    assert values["FROM"] == "python:3.11-slim"
    assert any(v.startswith("TORCH_INDEX_URL") for k, v in instructions if k == "ARG")
    assert json.loads(values["ENTRYPOINT"]) == ["fedsynth"]
    parse_fedsynth(json.loads(values["CMD"]), "Dockerfile CMD")
    assert any(f"healthcheck.py /usr/local/bin/{HEALTHCHECK}" in v for k, v in instructions if k == "RUN")
    for kind, value in instructions:
        if kind == "COPY":
            *sources, _target = value.split()
            for source in sources:
                assert (ROOT / source).exists(), f"Dockerfile: COPY {source} does not exist in the build context"


# ---- compose ---------------------------------------------------------------------------------------------------

def compose() -> dict[str, Any]:
    return yaml.safe_load((TEMPLATES / "docker" / "compose.yaml").read_text())


def compose_commands() -> dict[str, tuple[str, argparse.Namespace]]:
    """Every fedsynth service's command, parsed (the image's ENTRYPOINT is `fedsynth`)."""
    return {name: parse_fedsynth([str(a) for a in svc["command"]], f"compose service {name}")
            for name, svc in compose()["services"].items() if str(svc.get("image", "")).startswith("fedsynth:")}


def test_compose_commands_and_healthchecks_use_real_flags() -> None:
    doc, commands = compose(), compose_commands()
    assert {role for role, _ in commands.values()} == {"coordinator", "generator serve", "generator train", "client"}
    for name, (role, args) in commands.items():
        service = doc["services"][name]
        if role == "generator train":
            continue
        assert args.tls_dir == Path("/run/secrets") and not args.insecure, f"{name}: runs without mutual TLS"
        own = {"coordinator": ["coordinator"], "generator serve": ["generator"]}.get(role) or [f"client-{args.clients}"]
        wanted = {"ca.pem"} | {f"{node}{suffix}" for node in own for suffix in (".pem", "-key.pem")}
        if "healthcheck" in service:
            probe = parse_probe(service["healthcheck"]["test"][1:], f"compose {name} healthcheck")
            assert probe.service == SERVICE_NAMES[role] and port_of(probe.address) == args.port, name
            assert probe.tls_dir == args.tls_dir, name
            wanted |= {"operator.pem", "operator-key.pem"}
        assert set(service["secrets"]) == wanted, f"{name}: secrets {service['secrets']}, needs {sorted(wanted)}"
    files = {name: spec["file"] for name, spec in doc["secrets"].items()}
    assert all(path == "${FEDSYNTH_TLS_DIR:?}/" + name for name, path in files.items()) and "ca-key.pem" not in files
    assert Path(TEMPLATES / "docker" / doc["configs"]["run_config"]["file"]).resolve() == TEMPLATES / "run.toml"


def test_compose_clients_match_the_run_and_prometheus_scrapes_every_process() -> None:
    doc, commands = compose(), compose_commands()
    servers = {role: args for role, args in commands.values() if role in ("coordinator", "generator serve")}
    clients = [args for role, args in commands.values() if role == "client"]
    assert sorted(int(a.clients) for a in clients) == list(range(run_toml()["data"]["clients"]))
    for args in clients:
        assert port_of(args.coordinator) == servers["coordinator"].port
        assert port_of(args.generator) == servers["generator serve"].port
    metrics = {f"127.0.0.1:{args.metrics_port}" for role, args in commands.values() if role != "generator train"}
    config = yaml.safe_load(doc["configs"]["prometheus_config"]["content"])
    scraped = {t for job in config["scrape_configs"] for group in job["static_configs"] for t in group["targets"]}
    assert scraped == metrics
    shipped = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    assert {j["job_name"] for j in config["scrape_configs"]} == {j["job_name"] for j in shipped["scrape_configs"]}


def test_compose_prometheus_scrapes_https_with_the_operator_pair(tmp_path: Path) -> None:
    """Every role runs --tls-dir, so every /metrics is HTTPS: the jobs of prometheus-tls.yml, the CA and the operator
    pair from Prometheus's own secrets, read as the uid that owns them (as the fedsynth services do)."""
    doc = compose()
    service = doc["services"]["prometheus"]
    content = doc["configs"]["prometheus_config"]["content"]
    shipped = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus-tls.yml").read_text())
    files_of = {job["job_name"]: job["tls_config"] for job in shipped["scrape_configs"]}
    for job in yaml.safe_load(content)["scrape_configs"]:
        tls = job["tls_config"]
        assert job["scheme"] == "https" and tls.get("min_version") == "TLS12", job["job_name"]
        assert {k: f"/run/secrets/{Path(v).name}" for k, v in files_of[job["job_name"]].items() if k.endswith("_file")} \
            == {k: v for k, v in tls.items() if k.endswith("_file")}, job["job_name"]
    assert set(service["secrets"]) == {"ca.pem", "operator.pem", "operator-key.pem"}
    assert service["user"] == doc["x-fedsynth"]["user"]  # operator-key.pem is 0600, owned by $FEDSYNTH_UID
    owner = doc["services"][next(iter(service["depends_on"]))]  # gives the TSDB volume (the image's, for nobody) to it
    assert owner["entrypoint"] == ["chown", service["user"], "/prometheus"] and owner["volumes"] == service["volumes"]
    promtool = shutil.which("promtool")
    if promtool is None:  # scripts/test.sh installs it: a missing one is a failure, not a skipped check
        pytest.fail("promtool is not on PATH: run `bash scripts/install_prometheus.sh` (Debian's prometheus package)",
                    pytrace=False)
    provision(tmp_path / "tls", 1)
    config = tmp_path / "prometheus.yml"
    config.write_text(content.replace("/run/secrets/", f"{tmp_path / 'tls'}/"))
    check = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


# ---- Kubernetes ------------------------------------------------------------------------------------------------

MANIFESTS = sorted(KUBERNETES.glob("*.yaml"))


def resources() -> list[dict[str, Any]]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def containers() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(doc, c) for doc in resources() if doc["kind"] in ("Deployment", "StatefulSet", "Job")
            for c in doc["spec"]["template"]["spec"]["containers"]]


def container_command(container: dict[str, Any], where: str) -> tuple[str, argparse.Namespace]:
    assert "command" not in container, f"{where}: keep the image's ENTRYPOINT (fedsynth)"
    env = {**SAMPLE_ENV, **{e["name"]: SAMPLE_ENV.get(e["name"], "x") for e in container.get("env", [])}}
    for arg in container["args"]:
        for name in re.findall(r"\$\((\w+)\)", arg):
            assert name in {e["name"] for e in container.get("env", [])}, f"{where}: $({name}) is not in env"
    return parse_fedsynth([substitute(str(a), env, where) for a in container["args"]], where)


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates_against_kubernetes_schema(manifest: Path) -> None:
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail("kubernetes-validate is not installed: pip install -e '.[dev]'")
    docs = [doc for doc in yaml.safe_load_all(manifest.read_text()) if doc]
    assert docs, f"{manifest.name} is empty"
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{manifest.name} {doc['kind']}/{doc['metadata']['name']}: {exc}")
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == NAMESPACE, f"{doc['kind']}/{doc['metadata']['name']}"


def test_kubernetes_commands_probes_and_services_agree() -> None:
    docs = resources()
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    parsed = {}
    for workload, container in containers():
        where = f"{workload['kind']}/{workload['metadata']['name']}"
        role, args = container_command(container, where)
        parsed[role] = (workload, container, args)
        if role == "generator train":
            continue
        assert args.tls_dir is not None and not args.insecure, f"{where}: runs without mutual TLS"
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        secret = volumes[mounts[str(args.tls_dir)]].get("secret")
        assert secret and secret["defaultMode"] == 0o440, f"{where}: --tls-dir must be a Secret, files 0440 (fsGroup)"
        if role == "client":
            assert "readinessProbe" not in container and "ports" not in container  # nothing dials a client
            continue
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == {"grpc": args.port, "metrics": args.metrics_port} and args.host == "0.0.0.0", where
        assert args.metrics_host == "0.0.0.0", f"{where}: /metrics must be reachable from a Prometheus pod"
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = parse_probe(container[kind]["exec"]["command"], f"{where} {kind}")
            assert probe.address == f"localhost:{args.port}" and probe.service == SERVICE_NAMES[role], f"{where} {kind}"
            assert probe.tls_dir == args.tls_dir and probe.alive == (kind != "readinessProbe"), f"{where} {kind}"
        selector = workload["spec"]["selector"]["matchLabels"]
        (service,) = [s for s in services.values() if s["spec"]["selector"] == selector]
        (port,) = service["spec"]["ports"]
        assert port["targetPort"] == "grpc" and port["port"] == args.port, f"Service {service['metadata']['name']}"
        (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy" and d["spec"]["podSelector"]["matchLabels"] == selector]
        admitted = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
        assert admitted == {args.port, args.metrics_port}, f"NetworkPolicy {policy['metadata']['name']}: {admitted}"
    client = parsed["client"][2]
    for flag, role in (("coordinator", "coordinator"), ("generator", "generator serve")):
        host, _, port = getattr(client, flag).removeprefix("dns:///").rpartition(":")
        assert host in services and int(port) == parsed[role][2].port, f"client --{flag} {getattr(client, flag)}"
    assert parsed["generator serve"][1]["resources"]["limits"]["nvidia.com/gpu"] == 1
    generator_workload = parsed["generator serve"][0]
    assert generator_workload["spec"]["replicas"] >= 2 and client.generator.startswith("dns:///")  # replicas, round_robin
    (generator_service,) = [s for s in services.values()
                            if s["spec"]["selector"] == generator_workload["spec"]["selector"]["matchLabels"]]
    assert generator_service["spec"]["clusterIP"] == "None"  # headless: DNS answers every replica's address
    assert parsed["generator serve"][2].model == parsed["generator train"][2].out


def test_kubernetes_run_config_is_the_template_and_matches_the_clients() -> None:
    docs = resources()
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert configmap["data"]["run.toml"] == (TEMPLATES / "run.toml").read_text()
    cfg = load_config(TEMPLATES / "run.toml")
    (clients,) = [d for d in docs if d["kind"] == "StatefulSet"]
    assert clients["spec"]["replicas"] == cfg.data.clients
    (env,) = clients["spec"]["template"]["spec"]["containers"][0]["env"]
    pod_index = "metadata.labels['apps.kubernetes.io/pod-index']"  # pod fedsynth-client-K has index K
    assert env == {"name": "CLIENT_ID", "valueFrom": {"fieldRef": {"fieldPath": pod_index}}}
    (_, coordinator) = [(w, c) for w, c in containers() if c["name"] == "coordinator"][0]
    _, args = container_command(coordinator, "coordinator")
    assert args.port == cfg.runtime.coordinator_port and Path(args.config).name == "run.toml"


# ---- the probe against a real coordinator ----------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def with_value(argv: list[str], flag: str, value: str) -> list[str]:
    i = argv.index(flag)
    return [*argv[: i + 1], value, *argv[i + 2:]]


def test_kubernetes_probe_passes_over_mutual_tls_where_a_plaintext_grpc_probe_fails(tmp_path: Path) -> None:
    """The coordinator container's own args and readiness probe, with paths and ports moved into tmp_path."""
    provision(tmp_path / "tls", 1)
    (tmp_path / "run.toml").write_text((TEMPLATES / "run.toml").read_text())
    (_, container) = [(w, c) for w, c in containers() if c["name"] == "coordinator"][0]
    port = free_port()
    argv = [str(a) for a in container["args"]]
    moved = {"--config": tmp_path / "run.toml", "--out-dir": tmp_path / "run", "--tls-dir": tmp_path / "tls",
             "--host": "127.0.0.1", "--port": port, "--metrics-port": -1}
    for flag, value in moved.items():
        argv = with_value(argv, flag, str(value))
    probe = [str(a) for a in container["readinessProbe"]["exec"]["command"]]
    probe = [sys.executable, str(TEMPLATES / "docker" / "healthcheck.py"),
             *with_value(with_value(probe[1:], "--address", f"localhost:{port}"), "--tls-dir", str(tmp_path / "tls"))]
    log = (tmp_path / "coordinator.log").open("wb")
    process = subprocess.Popen(fedsynth_command(*argv), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            result = subprocess.run(probe, capture_output=True, text=True, timeout=30)
            if result.returncode == 0 or time.monotonic() > deadline or process.poll() is not None:
                break
            time.sleep(0.5)
        assert result.returncode == 0, f"{result.stderr}\n{(tmp_path / 'coordinator.log').read_text()[-2000:]}"
        assert "SERVING" in result.stdout
        # What the kubelet's `grpc:` probe does: a plaintext Check. The mutual-TLS server never answers it.
        plaintext = [*probe[:2], "--address", f"localhost:{port}", "--service", COORDINATOR_SERVICE,
                     "--insecure", "--timeout", "2"]
        assert subprocess.run(plaintext, capture_output=True, timeout=30).returncode == 2
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=30)
        log.close()
    assert code == EXIT_SIGTERM


def test_every_client_mounts_only_its_own_data_read_only_in_local_mode() -> None:
    """Local mode (each client its own folder, the coordinator none): compose mounts $FEDSYNTH_DATA_DIR/client-K into
    client K's container alone, Kubernetes a data volume per client pod, systemd a folder per instance; --data names
    the mount."""
    assert run_toml()["data"]["source"] == "local"
    doc = compose()
    for name, (role, args) in compose_commands().items():
        if role != "client":
            assert all("FEDSYNTH_DATA_DIR" not in str(v) for v in doc["services"][name].get("volumes", [])), name
            continue
        mounts = {str(v).removesuffix(":ro").rpartition(":")[2]: str(v) for v in doc["services"][name]["volumes"]}
        assert mounts[str(args.data[0])] == f"${{FEDSYNTH_DATA_DIR:?}}/client-{args.clients}:{args.data[0]}:ro", name
    (clients,) = [d for d in resources() if d["kind"] == "StatefulSet"]
    (container,) = clients["spec"]["template"]["spec"]["containers"]
    _, args = container_command(container, "StatefulSet/fedsynth-client")
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == args.data[0]]
    assert mount["readOnly"] is True
    assert mount["name"] in {t["metadata"]["name"] for t in clients["spec"]["volumeClaimTemplates"]}  # one per pod
    unit = read_unit(TEMPLATES / "systemd" / "fedsynth-client@.service")
    assert "--data /var/lib/fedsynth/client-%i/data" in unit["Service"]["ExecStart"][0]
