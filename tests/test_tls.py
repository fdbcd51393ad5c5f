"""Mutual TLS with certificates from `fedsynth deploy provision` and real gRPC servers: the handshake, node identity,
refusals (no certificate, another CA, a borrowed client id, revocation), plaintext only with --insecure."""

from __future__ import annotations

import json
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from cryptography import x509
from google.protobuf.descriptor import Descriptor
from prometheus_client import CollectorRegistry

from coordinator.server import CLAIMED_CLIENT_ID
from deploy.processes import Child, ProcessGroup, fedsynth_command, wait_for_file
from fedsynth import cli
from fedsynth.wire.server_check import RevokedServer, ServerUnreachable, check_servers
from fedsynth.wire import data_plane, grpcutil, tls
from fedsynth.errors import ConfigError
from fedsynth.generation.generator_client import GeneratorInfo
from fedsynth.v1 import coordinator_pb2 as pb
from fedsynth.v1 import coordinator_pb2_grpc as pb_grpc
from generator_service.ddpm.model import GeneratorMetadata, build_unet, make_train_scheduler, save_generator
from generator_service.serve_cmd import GeneratorServer, ServeConfig
from runtime_harness import START_TIMEOUT_S, overrides, read_record, wait_exit, register_request

CLIENTS = 4  # against the guarded coordinator each test uses its own identity: client-0, client-1, client-2 and 3
RPC_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pki") / "tls"
    argv = ["deploy", "provision", "--out", str(out), "--clients", str(CLIENTS), "--coordinator-hosts", "coord.example,10.0.0.5"]
    assert cli.main(argv) == 0
    return out


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("other") / "tls"
    assert cli.main(["deploy", "provision", "--out", str(out), "--clients", "1"]) == 0
    return out


def node_credentials(folder: Path, node_id: str) -> grpc.ChannelCredentials:
    return tls.channel_credentials(tls.TLSFiles.from_dir(folder, node_id))


def serial_of(folder: Path, node_id: str) -> str:
    return next(n["serial"] for n in json.loads((folder / "index.json").read_text())["nodes"] if n["node_id"] == node_id)


def start_coordinator(group: ProcessGroup, root: Path, settings: dict[str, object], *flags: str) -> tuple[Child, str]:
    port_file = root / "coordinator.port"
    sets = [item for override in overrides(settings) for item in ("--set", override)]
    child = group.start("coordinator", fedsynth_command(
        "coordinator", *sets, "--out-dir", str(root / "run"), "--port", "0", "--port-file", str(port_file), *flags))
    return child, f"127.0.0.1:{wait_for_file(port_file, child, timeout_s=START_TIMEOUT_S)}"


def call(address: str, credentials: grpc.ChannelCredentials | None, method: str, request: object) -> object:
    """One RPC on a fresh channel (no wait_for_ready: a failed handshake must show as a status, not a long wait)."""
    with grpcutil.make_channel(address, credentials) as channel:
        reply = getattr(pb_grpc.CoordinatorStub(channel), method)(request, timeout=RPC_TIMEOUT_S)
        return next(reply) if isinstance(reply, Iterator) else reply  # a server stream fails on its first read


def refusal(address: str, credentials: grpc.ChannelCredentials | None, method: str, request: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call(address, credentials, method, request)
    return caught.value


def update_stream(client_id: int) -> Iterator[pb.UpdateChunk]:
    yield pb.UpdateChunk(header=pb.UpdateHeader(client_id=client_id, session="s", round=1, task_id="t"))
    yield pb.UpdateChunk(chunk=pb.Chunk(seq=0, data=b"x"))


# ---- provisioning ---------------------------------------------------------------------------------------------------


def test_provision_writes_a_ca_and_one_identity_per_node(pki: Path) -> None:
    index = json.loads((pki / "index.json").read_text())
    expected = ["coordinator", "generator", "operator", *(f"client-{k}" for k in range(CLIENTS))]
    assert [n["node_id"] for n in index["nodes"]] == expected
    ca = x509.load_pem_x509_certificate((pki / "ca.pem").read_bytes())
    for node in index["nodes"]:
        assert stat.S_IMODE((pki / node["key"]).stat().st_mode) == 0o600, node["key"]
        cert = x509.load_pem_x509_certificate((pki / node["cert"]).read_bytes())
        cert.verify_directly_issued_by(ca)
        assert f"0x{cert.serial_number:x}" == node["serial"]
        unit = cert.subject.get_attributes_for_oid(x509.NameOID.ORGANIZATIONAL_UNIT_NAME)[0].value
        assert unit == node["role"] and tls.TLSFiles.from_dir(pki, node["node_id"]).identity().node_id == node["node_id"]
    assert stat.S_IMODE((pki / "ca-key.pem").stat().st_mode) == 0o600
    client = tls.TLSFiles.from_dir(pki, "client-2").identity()
    assert (client.role, client.client_id, f"0x{client.serial:x}") == ("client", 2, serial_of(pki, "client-2"))
    sans = {n["node_id"]: n["subject_alt_names"] for n in index["nodes"]}
    assert sans["client-2"] == ["spiffe://fedsynth/client/2"]
    assert sans["coordinator"] == ["spiffe://fedsynth/coordinator", "localhost", "127.0.0.1", "coord.example", "10.0.0.5"]
    assert sans["generator"] == ["spiffe://fedsynth/generator", "localhost", "127.0.0.1"]


def test_provision_refuses_to_replace_a_ca_without_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tls"
    assert cli.main(["deploy", "provision", "--out", str(out), "--clients", "3"]) == 0
    first_ca = (out / "ca.pem").read_bytes()
    capsys.readouterr()
    assert cli.main(["deploy", "provision", "--out", str(out), "--clients", "2"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"fedsynth deploy provision: error: {out / 'ca.pem'} exists: refusing to replace the CA (every certificate it "
        "signed would stop working); pass --force to replace it"]
    assert (out / "ca.pem").read_bytes() == first_ca and (out / "client-2.pem").is_file()
    assert cli.main(["deploy", "provision", "--out", str(out), "--clients", "2", "--force"]) == 0
    assert (out / "ca.pem").read_bytes() != first_ca
    assert not (out / "client-2.pem").exists()  # no certificate of the replaced CA is left behind



def test_tls_files_name_the_file_that_is_wrong(pki: Path, other_pki: Path) -> None:
    with pytest.raises(ConfigError, match=f"TLS private key '{pki / 'client-9-key.pem'}' does not exist"):
        tls.TLSFiles(pki / "ca.pem", pki / "client-0.pem", pki / "client-9-key.pem")
    with pytest.raises(ConfigError, match=f"private key {pki / 'client-1-key.pem'} does not belong to certificate"):
        tls.channel_credentials(tls.TLSFiles(pki / "ca.pem", pki / "client-0.pem", pki / "client-1-key.pem"))
    with pytest.raises(ConfigError, match=f"certificate {other_pki / 'client-0.pem'} was not issued by the CA in"):
        tls.server_credentials(tls.TLSFiles(pki / "ca.pem", other_pki / "client-0.pem", other_pki / "client-0-key.pem"))
    with pytest.raises(ConfigError, match=f"{pki / 'index.json'} is not a PEM certificate"):
        tls.channel_credentials(tls.TLSFiles(pki / "index.json", pki / "client-0.pem", pki / "client-0-key.pem"))

# ---- a coordinator that demands mutual TLS (it waits for clients that never come) ----------------------------------


@pytest.fixture(scope="module")
def guarded(pki: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    root = tmp_path_factory.mktemp("guarded")
    revoked = root / "revoked.txt"
    revoked.write_text(f"# revoked by serial, as index.json prints it\n{serial_of(pki, 'client-2')}\n")
    group = ProcessGroup(root / "logs")
    try:
        settings = {"data.clients": CLIENTS, "runtime.registration_timeout_s": 600.0, "runtime.heartbeat_s": 0.5}
        _, address = start_coordinator(group, root, settings, "--tls-dir", str(pki), "--revoked", str(revoked))
        yield address, revoked
    finally:
        group.stop_all(grace_s=3.0)


def test_a_client_without_a_certificate_or_with_plaintext_is_refused_at_the_handshake(guarded: tuple[str, Path], pki: Path) -> None:
    address, _ = guarded
    no_certificate = grpc.ssl_channel_credentials(root_certificates=(pki / "ca.pem").read_bytes())
    for credentials in (no_certificate, None):
        error = refusal(address, credentials, "GetRunSpec", pb.GetRunSpecRequest())
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()


def test_certificates_of_another_ca_are_refused_both_ways(guarded: tuple[str, Path], pki: Path, other_pki: Path) -> None:
    address, _ = guarded
    foreign_client = grpc.ssl_channel_credentials(
        root_certificates=(pki / "ca.pem").read_bytes(),
        private_key=(other_pki / "client-0-key.pem").read_bytes(), certificate_chain=(other_pki / "client-0.pem").read_bytes())
    error = refusal(address, foreign_client, "GetRunSpec", pb.GetRunSpecRequest())
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
    # A client of the other CA does not trust this coordinator's certificate either.
    error = refusal(address, node_credentials(other_pki, "client-0"), "GetRunSpec", pb.GetRunSpecRequest())
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "CERTIFICATE_VERIFY_FAILED" in str(error.details())


def test_a_client_certificate_cannot_claim_another_client_id(guarded: tuple[str, Path], pki: Path) -> None:
    address, _ = guarded
    client_1 = node_credentials(pki, "client-1")
    assert call(address, client_1, "GetRunSpec", pb.GetRunSpecRequest()).num_clients == CLIENTS  # type: ignore[attr-defined]
    for method, request in (("Register", pb.RegisterRequest(client_id=0)), ("Subscribe", pb.SubscribeRequest(client_id=0)),
                            ("SubmitUpdate", update_stream(0))):
        error = refusal(address, client_1, method, request)
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED, (method, error.details())
        assert error.details() == f"the certificate of client-1 may not act as client 0 ({method})"
    error = refusal(address, node_credentials(pki, "operator"), "Register", pb.RegisterRequest(client_id=0))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "operator" in str(error.details())


def test_one_certificate_holds_at_most_two_upload_streams_open(guarded: tuple[str, Path], pki: Path) -> None:
    address, _ = guarded
    release = threading.Event()

    def never_sends() -> Iterator[pb.UpdateChunk]:  # opens the stream, then holds it without a header
        release.wait(60)
        return
        yield

    with grpcutil.make_channel(address, node_credentials(pki, "client-1")) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        held = [stub.SubmitUpdate.future(never_sends(), timeout=RPC_TIMEOUT_S) for _ in range(2)]
        time.sleep(1.0)  # both streams reach the server and take their slots
        try:
            error = refusal(address, node_credentials(pki, "client-1"), "SubmitUpdate", update_stream(1))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
            assert error.details() == ("client-1 holds 2 upload streams open already (at most 2 per certificate; "
                                       "SubmitUpdate)")
            # another identity is not held back by client-1's streams
            error = refusal(address, node_credentials(pki, "client-0"), "SubmitUpdate", update_stream(0))
            assert error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
        finally:
            release.set()
        for future in held:  # a stream that ends without a header is refused by the servicer, and its slot freed
            assert future.exception(timeout=30) is not None
        error = refusal(address, node_credentials(pki, "client-1"), "SubmitUpdate", update_stream(1))
        assert error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()


def test_only_the_operator_may_release_clients_or_watch_rounds(guarded: tuple[str, Path], pki: Path) -> None:
    address, _ = guarded
    request = pb.ReleaseRequest(client_ids=[0], reason="client-0 exited")
    error = refusal(address, node_credentials(pki, "client-1"), "ReleaseClients", request)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error.details() == "ReleaseClients is the operator's (the launcher's); the caller's certificate is client-1's"
    # a client's certificate cannot hold the progress streams either (each pins a worker thread): WatchRounds is bound to
    # the operator's identity
    error = refusal(address, node_credentials(pki, "client-1"), "WatchRounds", pb.WatchRequest())
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error.details() == "WatchRounds is the operator's (the launcher's); the caller's certificate is client-1's"
    error = refusal(address, node_credentials(pki, "operator"), "ReleaseClients", pb.ReleaseRequest(client_ids=[99]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()  # past the guard: the operator's own mistake


def test_revoked_certificates_are_refused_on_every_call(guarded: tuple[str, Path], pki: Path) -> None:
    address, revoked = guarded
    error = refusal(address, node_credentials(pki, "client-2"), "GetRunSpec", pb.GetRunSpecRequest())
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert error.details() == f"certificate serial {serial_of(pki, 'client-2')} of client-2 is revoked ({revoked})"
    client_3 = node_credentials(pki, "client-3")
    assert call(address, client_3, "GetRunSpec", pb.GetRunSpecRequest())
    revoked.write_text(revoked.read_text() + "client-3\n")  # re-read on the next call: no restart needed
    error = refusal(address, client_3, "GetRunSpec", pb.GetRunSpecRequest())
    assert (error.code(), error.details()) == (grpc.StatusCode.UNAUTHENTICATED, f"node client-3 is revoked ({revoked})")



@pytest.mark.serial  # asserts a time bound
def test_revoking_a_node_ends_the_stream_it_holds_open(guarded: tuple[str, Path], pki: Path) -> None:
    address, revoked = guarded
    with grpcutil.make_channel(address, node_credentials(pki, "client-0")) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        spec = stub.GetRunSpec(pb.GetRunSpecRequest(), timeout=RPC_TIMEOUT_S)
        session = stub.Register(register_request(spec, client_id=0, num_samples=10), timeout=RPC_TIMEOUT_S).session
        stream = stub.Subscribe(pb.SubscribeRequest(client_id=0, session=session), timeout=RPC_TIMEOUT_S)
        assert next(stream).WhichOneof("kind") == "heartbeat"
        revoked.write_text(revoked.read_text() + "client-0\n")
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as caught:
            for _ in stream:  # heartbeats every 0.5 s until the next one finds the node revoked
                pass
    assert (caught.value.code(), caught.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, f"node client-0 is revoked ({revoked})")
    assert time.monotonic() - started < 3.0


def test_every_rpc_that_names_a_client_is_checked_against_the_certificate() -> None:
    """A new RPC carrying a client_id (in its request or its stream's header) must join CLAIMED_CLIENT_ID."""
    def names_a_client(message: Descriptor) -> bool:
        header = message.fields_by_name.get("header")
        return "client_id" in message.fields_by_name or (header is not None and "client_id" in header.message_type.fields_by_name)

    service = pb.DESCRIPTOR.services_by_name["Coordinator"]
    assert {m.name for m in service.methods if names_a_client(m.input_type)} == set(CLAIMED_CLIENT_ID)

def test_a_client_refuses_a_coordinator_whose_certificate_its_revocation_list_names(
        guarded: tuple[str, Path], pki: Path, tmp_path: Path) -> None:
    """`fedsynth client --revoked`: the coordinator's certificate (read in a handshake of the client's own) is revoked
    there, so the client exits 1 naming it, before it registers."""
    address, _ = guarded
    revoked = tmp_path / "client-revoked.txt"
    revoked.write_text(f"{serial_of(pki, 'coordinator')}  # the coordinator's key was stolen\n")
    group = ProcessGroup(tmp_path / "logs")
    try:
        client = group.start("client", fedsynth_command(
            "client", "--coordinator", address, "--clients", "1", "--cache-dir", str(tmp_path / "cache"),
            "--tls-dir", str(pki), "--revoked", str(revoked), "--reconnect-timeout", "60"))
        assert wait_exit(client, 120) == 1
    finally:
        group.stop_all(grace_s=3.0)
    log = client.log_path.read_text()
    assert (f"client 1: refusing the coordinator at {address}: certificate serial {serial_of(pki, 'coordinator')} of "
            f"coordinator is revoked ({revoked})") in log
    assert "registered" not in log


def test_a_client_checks_every_generator_certificate_against_its_revocation_list(pki: Path, tmp_path: Path) -> None:
    """check_servers, as the client node calls it before it asks a generator for images: a real TLS generator on
    port 0, addressed as HOST:PORT and as dns:///NAME:PORT; by node id and by serial; a live edit of the list."""
    threads = torch.get_num_threads()
    model = tmp_path / "model"
    save_generator(model, build_unet("tiny", num_classes=10, image_shape=(1, 8, 8), seed=0), make_train_scheduler(),
                   GeneratorMetadata("digits", 10, (1, 8, 8), "tiny", training_steps=0, guidance=1.0, ddim_steps=2))
    server = GeneratorServer(ServeConfig(model=model, metrics_port=-1, threads=1), registry=CollectorRegistry(),
                             security=tls.ServerSecurity(tls.TLSFiles.from_dir(pki, "generator")))
    revoked = tmp_path / "revoked.txt"
    revoked.write_text("client-2\ncoordinator\n")
    client = tls.TLSFiles.from_dir(pki, "client-0")
    try:
        port = server.start()
        listed = tls.RevocationList(revoked)
        for target in (f"127.0.0.1:{port}", f"dns:///localhost:{port}"):
            assert [i.node_id for i in check_servers(target, client, listed, what="generator", timeout_s=10)] == ["generator"]
        revoked.write_text(f"{serial_of(pki, 'generator')}\n")  # re-read on the next check
        with pytest.raises(RevokedServer, match=f"refusing the generator at 127.0.0.1:{port}: certificate serial "):
            check_servers(f"127.0.0.1:{port}", client, listed, what="generator", timeout_s=10)
        revoked.write_text("generator\n")
        with pytest.raises(RevokedServer, match="node generator is revoked"):
            check_servers(f"dns:///localhost:{port}", client, listed, what="generator", timeout_s=10)
    finally:
        server.stop(0)
    with pytest.raises(ServerUnreachable, match=f"cannot read the certificate of the generator at 127.0.0.1:{port}"):
        check_servers(f"127.0.0.1:{port}", client, listed, what="generator", timeout_s=10)  # stopped: retried as a lost link
        torch.set_num_threads(threads)


# ---- a whole run over mutual TLS ------------------------------------------------------------------------------------


@pytest.mark.parametrize("plane", ["grpc", "tcp"])
def test_two_clients_in_one_process_train_over_mutual_tls(pki: Path, tmp_path: Path, plane: str) -> None:
    settings = {"seed": 1, "data.clients": 2, "train.rounds": 2, "train.local_epochs": 1, "runtime.data_plane": plane,
                "runtime.data_plane_min_bytes": 0}
    group = ProcessGroup(tmp_path / "logs")
    try:
        coordinator, address = start_coordinator(group, tmp_path, settings, "--tls-dir", str(pki))
        (tmp_path / "revoked.txt").write_text("client-3\noperator\n")  # the client checks the coordinator: not listed
        clients = group.start("clients", fedsynth_command(
            "client", "--coordinator", address, "--clients", "0-1", "--cache-dir", str(tmp_path / "cache"),
            "--tls-dir", str(pki), "--reconnect-timeout", "60", "--revoked", str(tmp_path / "revoked.txt")))
        with grpcutil.make_channel(address, node_credentials(pki, "operator")) as channel:
            summaries = list(pb_grpc.CoordinatorStub(channel).WatchRounds(pb.WatchRequest(), timeout=120, wait_for_ready=True))
        assert wait_exit(coordinator, 60) == 0, coordinator.log_path.read_text()[-2000:]
        assert wait_exit(clients, 30) == 0, clients.log_path.read_text()[-2000:]
    finally:
        group.stop_all(grace_s=3.0)
    assert [s.round for s in summaries if not s.finished] == [1, 2] and summaries[-1].success
    record = read_record(tmp_path / "run")
    assert record["success"] and [sorted(r["participants"]) for r in record["rounds"]] == [[0, 1], [0, 1]]
    log = coordinator.log_path.read_text()
    assert "mutual TLS" in log and "PRIVATE KEY" not in log + clients.log_path.read_text()
    assert ("data plane on port" in log and "(mutual TLS)" in log) == (plane == "tcp")
    assert sum(r["bytes_received"] for r in record["rounds"]) > 0


def test_the_data_plane_serves_a_ticket_to_its_own_clients_certificate_only(pki: Path, tmp_path: Path) -> None:
    settings = {"data.clients": 1, "train.rounds": 1, "runtime.data_plane": "tcp", "runtime.data_plane_min_bytes": 0}
    group = ProcessGroup(tmp_path / "logs")
    try:
        _, address = start_coordinator(group, tmp_path, settings, "--tls-dir", str(pki))
        with grpcutil.make_channel(address, node_credentials(pki, "client-0")) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            spec = stub.GetRunSpec(pb.GetRunSpecRequest(), timeout=RPC_TIMEOUT_S, wait_for_ready=True)
            reply = stub.Register(register_request(spec, client_id=0, num_samples=10), timeout=RPC_TIMEOUT_S)
            stream = stub.Subscribe(pb.SubscribeRequest(client_id=0, session=reply.session), timeout=60)
            task = next(m.task for m in stream if m.WhichOneof("kind") == "task")

            def endpoint(node_id: str | None) -> data_plane.Endpoint:
                context = None if node_id is None else tls.ssl_client_context(tls.TLSFiles.from_dir(pki, node_id))
                return data_plane.Endpoint("127.0.0.1", reply.data_port, context)

            with pytest.raises(data_plane.DataPlaneError) as borrowed:
                data_plane.fetch(endpoint("client-1"), task.data_ticket, timeout_s=RPC_TIMEOUT_S)
            assert borrowed.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "client-1 presented client 0's data-plane ticket" in borrowed.value.details()
            with pytest.raises(data_plane.DataPlaneError) as plaintext:  # no TLS: the handshake fails, nothing is served
                data_plane.fetch(endpoint(None), task.data_ticket, timeout_s=RPC_TIMEOUT_S)
            assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE
            payload = data_plane.fetch(endpoint("client-0"), task.data_ticket, timeout_s=RPC_TIMEOUT_S)
            assert payload.numel() == task.payload.total_bytes
            stream.cancel()
    finally:
        group.stop_all(grace_s=3.0)


# ---- the generator service over mutual TLS (in-process server, untrained tiny model) -------------------------------


def test_generator_serves_only_authenticated_unrevoked_clients(pki: Path, tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    model = tmp_path / "model"
    save_generator(model, build_unet("tiny", num_classes=10, image_shape=(1, 8, 8), seed=0), make_train_scheduler(),
                   GeneratorMetadata("digits", 10, (1, 8, 8), "tiny", training_steps=0, guidance=1.0, ddim_steps=2))
    revoked = tmp_path / "revoked.txt"
    revoked.write_text("client-2\n")
    security = tls.ServerSecurity(tls.TLSFiles.from_dir(pki, "generator"), tls.RevocationList(revoked))
    server = GeneratorServer(ServeConfig(model=model, metrics_port=-1, threads=1), security=security)
    try:
        port = server.start()
        server.load()
        address = f"localhost:{port}"  # the DNS name in the certificate, this time
        with grpcutil.make_channel(address, node_credentials(pki, "client-0")) as channel:
            assert GeneratorInfo.fetch(channel, timeout_s=RPC_TIMEOUT_S).num_classes == 10
        for credentials, code in ((node_credentials(pki, "client-2"), grpc.StatusCode.UNAUTHENTICATED),
                                  (grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes()), grpc.StatusCode.UNAVAILABLE)):
            with grpcutil.make_channel(address, credentials) as channel, pytest.raises(grpc.RpcError) as caught:
                GeneratorInfo.fetch(channel, timeout_s=RPC_TIMEOUT_S)
            assert caught.value.code() == code, caught.value.details()
    finally:
        server.stop(0)
        torch.set_num_threads(threads)


# ---- plaintext only when asked for ------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["coordinator", "--port", "0"], ["client", "--coordinator", "127.0.0.1:1"],
                                     ["generator", "serve", "--model", "absent"]])
def test_plaintext_needs_an_explicit_insecure_flag(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(command) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"fedsynth {' '.join(command[:2] if command[0] == 'generator' else command[:1])}: error: no transport security "
        "chosen: pass --tls-dir DIR (mutual TLS; make one with `fedsynth deploy provision`) or --insecure (plaintext, "
        "for this machine only)"]


def test_insecure_binds_loopback_unless_a_host_is_given(caplog: pytest.LogCaptureFixture) -> None:
    plaintext = tls.ServerSecurity(files=None)
    assert plaintext.bind_host(None, "0.0.0.0") == "127.0.0.1"  # a config file alone does not open plaintext up
    assert not caplog.records
    assert plaintext.bind_host("0.0.0.0", "127.0.0.1") == "0.0.0.0"
    assert "plaintext gRPC on 0.0.0.0" in caplog.text
