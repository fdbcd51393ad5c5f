"""The data plane (runtime.data_plane = "tcp"): framing and integrity on a socket pair, then a real coordinator process
refusing bad transfers by name with the status gRPC would give, its model untouched, and the same final model as gRPC."""

from __future__ import annotations

import math
import re
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from coordinator import checkpoint
from fedsynth.wire import codec, data_plane, grpcutil
from fedsynth.errors import WireError
from fedsynth.wire.tensor_buffer import decode_views, encode_parts, encode_to_buffer
from fedsynth.v1 import coordinator_pb2 as pb
from fedsynth.v1 import coordinator_pb2_grpc as pb_grpc
from runtime_harness import Runtime, channel, wait_until, register_request

TCP = {"runtime.data_plane": "tcp", "runtime.data_plane_min_bytes": 0}  # the small CNN's 0.2 MB go by the data plane too
RPC_TIMEOUT_S = 20.0
StateDict = dict[str, torch.Tensor]


def as_buffer(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


# ---- framing and integrity, on a socket pair -----------------------------------------------------------------------


def transfer(send: Callable[[socket.socket], None], total: int) -> torch.Tensor:
    """What receive_payload makes of the bytes `send` writes into the other end (which is then closed)."""
    left, right = socket.socketpair()
    left.settimeout(10), right.settimeout(10)

    def sender() -> None:
        with right:
            send(right)

    thread = threading.Thread(target=sender)
    thread.start()
    try:
        with left:
            return data_plane.receive_payload(left, total, deadline=float("inf"))
    finally:
        thread.join(10)


def test_a_payload_arrives_whole_and_verified() -> None:
    data = bytes(range(256)) * 9000  # 2.3 MB: several pieces
    received = transfer(lambda s: data_plane.send_payload(s, as_buffer(data)), len(data))
    assert bytes(received.numpy()) == data


def test_an_update_sent_from_its_tensors_own_memory_arrives_as_its_encoded_buffer() -> None:
    """encode_parts + send_payload (the client's upload: no encoded copy) deliver exactly encode_to_buffer's bytes, with
    their digest: small tensors joined into pieces, large ones sliced, an empty one and a bfloat16 one among them."""
    g = torch.Generator().manual_seed(0)
    tensors = {"conv": torch.randn(data_plane.PIECE_BYTES // 4 + 1000, generator=g), "bias": torch.randn(10, generator=g), "empty": torch.empty(0, 3),
               "half": torch.randn(40_000, generator=g).bfloat16(), "count": torch.tensor(5), "mid": torch.randn(20_000, generator=g)}
    expected = encode_to_buffer(tensors)
    parts = encode_parts(tensors)
    assert sum(part.nbytes for part in parts) == expected.numel()
    received = transfer(lambda s: data_plane.send_payload(s, parts), expected.numel())
    assert torch.equal(received, expected)


def test_one_changed_byte_is_refused_by_its_checksum() -> None:
    data = bytes(range(256)) * 9000
    digest = data_plane.digest_of(data)
    tampered = bytearray(data)
    tampered[1_500_000] ^= 1
    with pytest.raises(WireError, match="payload checksum .* does not match the announced " + digest.hex()[:12]):
        transfer(lambda s: data_plane.send_payload(s, as_buffer(bytes(tampered)), digest), len(data))


def test_a_payload_cut_short_is_refused_naming_how_much_arrived() -> None:
    with pytest.raises(WireError, match="payload ended after 1000 of 5000 bytes"):
        transfer(lambda s: s.sendall(b"x" * 1000), 5000)
    with pytest.raises(WireError, match=f"closed after 0 of {data_plane.DIGEST_BYTES} bytes of the payload digest"):
        transfer(lambda s: s.sendall(b"x" * 5000), 5000)


@pytest.mark.parametrize(("request_bytes", "text"), [
    (b"GET / HTTP/1.1\r\n\r\n" + b"\0" * 16, "not a fedsynth data-plane request (magic b'GET '"),
    (struct.pack("<4sB16sI", b"FSD1", 1, b"\0" * 16, 0), "not a fedsynth data-plane request (magic b'FSD1', expected b'FSD2')"),
    (struct.pack("<4sB16sI", data_plane.MAGIC, 9, b"\0" * 16, 0), "unknown data-plane operation 9"),
    (struct.pack("<4sB16sI", data_plane.MAGIC, 2, b"\0" * 16, 1 << 30), "request header of 1073741824 bytes exceeds the limit"),
])
def test_malformed_requests_are_named(request_bytes: bytes, text: str) -> None:
    left, right = socket.socketpair()
    with left, right:
        right.sendall(request_bytes)
        with pytest.raises(WireError, match=re.escape(text)):
            data_plane.read_request(left)


def test_only_unavailable_is_retried() -> None:
    calls: list[grpc.StatusCode] = []

    def failing(code: grpc.StatusCode) -> Callable[[], None]:
        def fn() -> None:
            calls.append(code)
            if len(calls) < 3 or code != grpc.StatusCode.UNAVAILABLE:
                raise data_plane.DataPlaneError(code, "no")
        return fn

    grpcutil.call_with_retry(failing(grpc.StatusCode.UNAVAILABLE), deadline_s=30, what="test")
    assert calls == [grpc.StatusCode.UNAVAILABLE] * 3
    calls.clear()
    with pytest.raises(data_plane.DataPlaneError) as refused:
        grpcutil.call_with_retry(failing(grpc.StatusCode.INVALID_ARGUMENT), deadline_s=30, what="test")
    assert calls == [grpc.StatusCode.INVALID_ARGUMENT] and refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# ---- a real coordinator: refusals by name, the model untouched -----------------------------------------------------


@dataclass
class OpenRound:
    """Client 0's registered session and its round-1 task, fetched over the data plane as a real client does. A refused
    update is its sender's answer to the round, so each bad transfer speaks for a client of its own (`speaker`), holding
    its own task (and ticket) of round 1."""

    stream: Iterator[pb.ServerMessage]
    session: str
    stale_session: str
    endpoint: data_plane.Endpoint
    task: pb.Task
    model: StateDict
    out_dir: Path
    sessions: dict[int, str]
    tasks: dict[int, pb.Task]
    others: list[Any]  # the other clients' dispatch streams
    sent: set[str]
    speaker: int = 0

    @property
    def ticket(self) -> bytes:
        return self.task.data_ticket if self.speaker == 0 else self.tasks[self.speaker].data_ticket


def next_task(stream: Iterator[pb.ServerMessage], endpoint: data_plane.Endpoint) -> tuple[pb.Task, StateDict]:
    task = next(m.task for m in stream if m.WhichOneof("kind") == "task")
    assert task.data_ticket and task.payload.total_bytes and not task.payload.num_chunks and not task.payload.sha256
    model = codec.split_prefixed(decode_views(data_plane.fetch(endpoint, task.data_ticket, timeout_s=RPC_TIMEOUT_S)))["model"]
    return task, {key: value.clone() for key, value in model.items()}


@pytest.fixture(scope="module")
def open_round(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenRound]:
    root = tmp_path_factory.mktemp("data-plane")
    # every client sampled; a round closes with client 0's answer alone once the others were refused (or left)
    settings = {**TCP, "data.clients": CLIENTS, "data.partition": "iid", "train.rounds": 2, "runtime.quorum": 0.01,
                "runtime.round_timeout_s": 120.0, "runtime.rejoin_grace_s": 1.0}
    with Runtime(root) as rt:
        coord = rt.coordinator(settings, root / "run")
        with channel(coord.address) as ch:
            stub = pb_grpc.CoordinatorStub(ch)
            spec = stub.GetRunSpec(pb.GetRunSpecRequest(), timeout=RPC_TIMEOUT_S, wait_for_ready=True)
            register = register_request(spec, client_id=0, num_samples=100)
            stale = stub.Register(register, timeout=RPC_TIMEOUT_S).session
            reply = stub.Register(register, timeout=RPC_TIMEOUT_S)
            assert reply.data_port > 0
            sessions = {c: stub.Register(register_request(spec, client_id=c, num_samples=100), timeout=RPC_TIMEOUT_S).session
                        for c in range(1, CLIENTS)}
            others = {c: stub.Subscribe(pb.SubscribeRequest(client_id=c, session=sessions[c]), timeout=300) for c in sessions}
            tasks = {c: next(m.task for m in other if m.WhichOneof("kind") == "task") for c, other in others.items()}
            endpoint = data_plane.Endpoint("127.0.0.1", reply.data_port)
            stream = stub.Subscribe(pb.SubscribeRequest(client_id=0, session=reply.session), timeout=300)
            task, model = next_task(stream, endpoint)
            yield OpenRound(stream, reply.session, stale, endpoint, task, model, root / "run", {0: reply.session, **sessions},
                            tasks, list(others.values()), set())
            stream.cancel()
            for other in others.values():
                other.cancel()


def header(rnd: OpenRound, size: int, **changes: object) -> bytes:
    task = rnd.task if rnd.speaker == 0 else rnd.tasks[rnd.speaker]
    fields: dict[str, object] = {"client_id": rnd.speaker, "session": rnd.sessions[rnd.speaker], "round": task.round, "task_id": task.task_id,
                                 "payload": pb.Payload(total_bytes=size), "train_seconds": 0.1, "train_loss": 1.0}
    return pb.UpdateHeader(**{**fields, **changes}).SerializeToString()


def submit(rnd: OpenRound, model: StateDict, **changes: object) -> None:
    payload = encode_to_buffer(codec.join_prefixed(model=model))
    data_plane.submit(rnd.endpoint, rnd.ticket, header(rnd, payload.numel(), **changes), payload, timeout_s=RPC_TIMEOUT_S)


def changed(rnd: OpenRound, key: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> StateDict:
    return {**rnd.model, key: fn(rnd.model[key])}


def nan_at_zero(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t[0] = math.nan
    return t


def raw_exchange(rnd: OpenRound, request: bytes, after_go: bytes | None = None) -> tuple[grpc.StatusCode, str]:
    """Send a hand-made request (and, once told to go, `after_go`); the coordinator's final status."""
    with socket.create_connection((rnd.endpoint.host, rnd.endpoint.port), timeout=RPC_TIMEOUT_S) as sock:
        sock.sendall(request)
        code, message = data_plane.read_status(sock)
        if code != grpc.StatusCode.OK or after_go is None:
            return code, message
        sock.sendall(after_go)
        sock.shutdown(socket.SHUT_WR)
        return data_plane.read_status(sock)


def submit_request(rnd: OpenRound, header_bytes: bytes, ticket: bytes | None = None) -> bytes:
    ticket = rnd.ticket if ticket is None else ticket
    return struct.pack("<4sB16sI", data_plane.MAGIC, data_plane.SUBMIT, ticket, len(header_bytes)) + header_bytes


def valid_bytes(rnd: OpenRound) -> bytes:
    return bytes(encode_to_buffer(codec.join_prefixed(model=rnd.model)).numpy())


INVALID, PRECONDITION, DENIED = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED

# name -> (what the test sends, the status it must get, text the message must contain)
CASES: dict[str, tuple[Callable[[OpenRound], tuple[grpc.StatusCode, str]], grpc.StatusCode, str]] = {}


def case(name: str, code: grpc.StatusCode, text: str) -> Callable[[Callable[[OpenRound], None]], None]:
    def register(send: Callable[[OpenRound], None]) -> None:
        def run(rnd: OpenRound) -> tuple[grpc.StatusCode, str]:
            try:
                send(rnd)
            except data_plane.DataPlaneError as exc:
                return exc.code(), exc.details()
            raise AssertionError(f"{name}: accepted")
        CASES[name] = (run, code, text)
    return register


case("wrong shape", INVALID, "'classifier.weight' has shape (5, 128)")(lambda r: submit(r, changed(r, "classifier.weight", lambda t: t[:5])))
case("NaN values", INVALID, "'classifier.bias' contains NaN")(lambda r: submit(r, changed(r, "classifier.bias", nan_at_zero)))
case("missing tensor", INVALID, "missing tensors ['classifier.bias']")(
    lambda r: submit(r, {k: v for k, v in r.model.items() if k != "classifier.bias"}))
case("stale session", PRECONDITION, "session is stale")(lambda r: submit(r, r.model, session=r.stale_session))
case("another client's header", DENIED, "the update names client 500")(lambda r: submit(r, r.model, client_id=500))
case("another task's header", DENIED, "task 'feedface'")(lambda r: submit(r, r.model, task_id="feedfacefeedface"))
case("unknown ticket", PRECONDITION, "unknown data-plane ticket")(
    lambda r: data_plane.fetch(r.endpoint, b"\x01" * 16, timeout_s=RPC_TIMEOUT_S))
CASES["oversized announced total"] = (
    lambda r: raw_exchange(r, submit_request(r, header(r, 10**12))), INVALID, "announced payload of 1000000000000 bytes exceeds")
CASES["payload inline in the header"] = (
    lambda r: raw_exchange(r, submit_request(r, header(r, 4000, inline_payload=b"x" * 4000))), INVALID, "not inline in it")
CASES["garbage header"] = (lambda r: raw_exchange(r, submit_request(r, b"\xff\xff\xff")), INVALID, "not an UpdateHeader")
CASES["bad magic"] = (lambda r: raw_exchange(r, b"HELO" + submit_request(r, b"")[4:]), INVALID, "not a fedsynth data-plane request")
CASES["tampered bytes"] = (
    lambda r: raw_exchange(r, submit_request(r, header(r, len(valid_bytes(r)))),
                           b"\0" + valid_bytes(r)[1:] + data_plane.digest_of(valid_bytes(r))),
    INVALID, "does not match the announced")
CASES["fewer bytes than announced"] = (
    lambda r: raw_exchange(r, submit_request(r, header(r, len(valid_bytes(r)))), valid_bytes(r)[:-10]), INVALID, "payload ended after")
CASES["garbage payload"] = (
    lambda r: raw_exchange(r, submit_request(r, header(r, 4000)), b"x" * 4000 + data_plane.digest_of(b"x" * 4000)),
    INVALID, "payload is not valid safetensors")


CASE_CLIENT = {name: client for client, name in enumerate(CASES, start=1)}
CLIENTS = len(CASES) + 1


def assert_refused(rnd: OpenRound, name: str) -> None:
    """Send the case once, from its own client."""
    if name in rnd.sent:
        return
    rnd.sent.add(name)
    send, code, text = CASES[name]
    rnd.speaker = CASE_CLIENT[name]
    try:
        got, message = send(rnd)
    finally:
        rnd.speaker = 0
    assert got == code, f"{name}: {got} {message}"
    assert text in message, f"{name}: {message!r} does not name the problem ({text!r})"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_a_bad_transfer_is_refused_with_a_message_naming_the_problem(open_round: OpenRound, name: str) -> None:
    assert_refused(open_round, name)


@pytest.mark.slow
def test_refused_transfers_leave_the_global_model_unchanged(open_round: OpenRound) -> None:
    for name in CASES:  # again, so this test does not depend on the order the others ran in
        assert_refused(open_round, name)
    shifted = {key: value + 0.5 for key, value in open_round.model.items()}  # every value moves, exactly representable
    submit(open_round, shifted)
    for other in open_round.others:  # the clients of cases refused before their round was known never answer: gone
        other.cancel()

    # With one client, the next global model is exactly its update: nothing refused was folded in.
    task, round_two = next_task(open_round.stream, open_round.endpoint)
    assert task.round == 2 and task.data_ticket != open_round.task.data_ticket
    saved = wait_until(lambda: checkpoint.load(open_round.out_dir), timeout_s=30, what="round-1 checkpoint")
    assert saved.completed_rounds == 1
    for key, value in shifted.items():
        assert torch.equal(round_two[key], value), key
        assert torch.equal(saved.global_state[key], value), key

    # Round 1's ticket died with its round; the round-2 answer ends the run.
    with pytest.raises(data_plane.DataPlaneError) as late:
        submit(open_round, shifted)
    assert late.value.code() == PRECONDITION and "unknown data-plane ticket" in late.value.details()
    open_round.task, open_round.model = task, round_two
    submit(open_round, round_two)
    finished = [m.finished for m in open_round.stream if m.WhichOneof("kind") == "finished"]
    assert finished and finished[0].success


# ---- the same run over either plane --------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_over_the_data_plane_ends_with_the_same_model_as_over_grpc(tmp_path: Path) -> None:
    # two clients: a float64 sum of two updates is the same in either arrival order (docs/runtime.md, Determinism)
    settings = {"seed": 3, "data.clients": 2, "train.rounds": 2, "train.local_epochs": 1}
    models = {}
    for plane in ("grpc", "tcp"):
        with Runtime(tmp_path / plane) as rt:
            coord = rt.coordinator({**settings, **(TCP if plane == "tcp" else {})}, tmp_path / plane / "run")
            clients = rt.clients(coord.address, "0-1")
            assert coord.wait(120) == 0, coord.log()[-2000:]
            assert clients.process.wait(30) == 0
        saved = checkpoint.load(tmp_path / plane / "run")
        assert saved is not None and saved.completed_rounds == 2
        models[plane] = saved.global_state
        log = coord.log()
        assert ("data plane on port" in log) == (plane == "tcp")
    assert models["grpc"].keys() == models["tcp"].keys()
    for key, value in models["grpc"].items():
        assert torch.equal(value, models["tcp"][key]), key
