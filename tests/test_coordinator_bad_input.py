"""Malformed and out-of-place updates sent over real gRPC to a coordinator process: refused by name, model untouched.

A refused update is its sender's answer to the round (it takes no second try), so each case speaks for a client of its
own, all registered and holding the task of round 1; client 0 sends the valid updates."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from coordinator import checkpoint
from fedsynth.wire import codec
from fedsynth.wire.transfer import receive_inline
from fedsynth.v1 import coordinator_pb2 as pb
from fedsynth.v1 import coordinator_pb2_grpc as pb_grpc
from runtime_harness import Runtime, channel, read_record, register_request, wait_until

CLIENT_ID = 0  # the client that sends the valid updates
RPC_TIMEOUT_S = 20.0
SMALL_CHUNK = 64 * 1024  # several chunks per payload, so order and count can be broken
StateDict = dict[str, torch.Tensor]


@dataclass
class OpenRound:
    """A registered session of client 0 holding the task of round 1, as a real client would."""

    stub: pb_grpc.CoordinatorStub
    stream: Iterator[pb.ServerMessage]
    session: str
    stale_session: str
    task: pb.Task
    payload: bytes
    out_dir: Path
    sessions: dict[int, str]  # every client's
    others: list[Any]  # the dispatch streams of the clients the cases speak for
    sent: set[str]  # the cases sent so far (each once: its client's round is over after it)
    speaker: int = CLIENT_ID  # the client the next update speaks for

    @property
    def model(self) -> StateDict:
        return codec.split_prefixed(codec.decode(self.payload))["model"]


def receive_task(stream: Iterator[pb.ServerMessage]) -> tuple[pb.Task, bytes]:
    """The next task header and its payload, checked against the announced size and SHA-256."""
    for message in stream:
        kind = message.WhichOneof("kind")
        if kind == "heartbeat":
            continue
        assert kind == "task", f"expected a task, got {kind}: {message}"
        task = message.task
        meta = codec.meta_of(task.payload)
        if task.inline_payload:  # a payload that fits one chunk travels in its task
            return task, bytes(receive_inline(meta, task.inline_payload).numpy())
        chunks = []
        while len(chunks) < task.payload.num_chunks:
            message = next(stream)
            if message.WhichOneof("kind") == "chunk":
                chunks.append((message.chunk.seq, message.chunk.data))
        return task, codec.assemble(meta, chunks)
    raise AssertionError("the dispatch stream ended without a task")


@pytest.fixture(scope="module")
def open_round(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenRound]:
    root = tmp_path_factory.mktemp("bad-input")
    with Runtime(root) as rt:
        coord = rt.coordinator(SETTINGS, root / "run")
        with channel(coord.address) as ch:
            stub = pb_grpc.CoordinatorStub(ch)
            spec = stub.GetRunSpec(pb.GetRunSpecRequest(), timeout=RPC_TIMEOUT_S, wait_for_ready=True)
            register = register_request(spec, client_id=CLIENT_ID, num_samples=100)
            stale = stub.Register(register, timeout=RPC_TIMEOUT_S).session
            session = stub.Register(register, timeout=RPC_TIMEOUT_S).session  # supersedes the first session
            sessions = {CLIENT_ID: session}
            for client in range(1, CLIENTS):
                sessions[client] = stub.Register(register_request(spec, client_id=client, num_samples=100), timeout=RPC_TIMEOUT_S).session
            others = [stub.Subscribe(pb.SubscribeRequest(client_id=c, session=sessions[c]), timeout=300) for c in range(1, CLIENTS)]
            stream = stub.Subscribe(pb.SubscribeRequest(client_id=CLIENT_ID, session=session), timeout=300)
            task, payload = receive_task(stream)
            yield OpenRound(stub, stream, session, stale, task, payload, root / "run", sessions, others, set())
            stream.cancel()
            for other in others:
                other.cancel()


# ---- building update streams ---------------------------------------------------------------------


def header(rnd: OpenRound, data: bytes, **changes: object) -> pb.UpdateHeader:
    meta = codec.describe(data)
    client = int(changes.get("client_id", rnd.speaker))  # type: ignore[call-overload]
    fields: dict[str, object] = {
        "client_id": client,
        "session": rnd.sessions.get(client, rnd.session),
        "round": rnd.task.round,
        "task_id": rnd.task.task_id,
        "payload": pb.Payload(total_bytes=meta.total_bytes, sha256=meta.sha256, num_chunks=meta.num_chunks),
        "train_seconds": 0.1,
        "train_loss": 1.0,
        "num_steps": 1,
        "train_samples": 100,
    }
    fields.update(changes)
    return pb.UpdateHeader(**fields)


def chunk_messages(data: bytes, size: int = SMALL_CHUNK) -> list[pb.UpdateChunk]:
    return [pb.UpdateChunk(chunk=pb.Chunk(seq=seq, data=piece)) for seq, piece in codec.split(data, size)]


def stream_of(rnd: OpenRound, data: bytes, **changes: object) -> list[pb.UpdateChunk]:
    return [pb.UpdateChunk(header=header(rnd, data, **changes)), *chunk_messages(data)]


def inline_of(rnd: OpenRound, data: bytes, **changes: object) -> list[pb.UpdateChunk]:
    """An update in one message, its bytes in the header (as a client sends one that fits a chunk)."""
    fields: dict[str, object] = {"payload": pb.Payload(total_bytes=len(data), sha256=codec.sha256(data)), "inline_payload": data}
    return [pb.UpdateChunk(header=header(rnd, data, **{**fields, **changes}))]


def encoded(model: StateDict, **extra_groups: StateDict) -> bytes:
    return codec.encode(codec.join_prefixed(model=model, **extra_groups))


def changed(rnd: OpenRound, key: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> bytes:
    model = rnd.model
    model[key] = fn(model[key])
    return encoded(model)


def payload_meta(total_bytes: int, sha: str = "0" * 64) -> pb.Payload:
    return pb.Payload(total_bytes=total_bytes, sha256=sha, num_chunks=codec.num_chunks(total_bytes))


def valid(rnd: OpenRound) -> bytes:
    return encoded(rnd.model)


def reorder(messages: list[pb.UpdateChunk]) -> list[pb.UpdateChunk]:
    head, first, second, *rest = messages
    return [head, second, first, *rest]


def nan_bias(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t[0] = math.nan
    return t


INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
GARBAGE = b"\x93NUMPY not a safetensors file " * 4000

# name -> (the update stream, the expected status, text the message must contain)
CASES: dict[str, tuple[Callable[[OpenRound], list[pb.UpdateChunk]], grpc.StatusCode, str]] = {
    "wrong shape": (lambda r: stream_of(r, changed(r, "classifier.weight", lambda t: t[:5])), INVALID, "'classifier.weight' has shape (5, 128)"),
    "wrong dtype": (lambda r: stream_of(r, changed(r, "classifier.bias", lambda t: t.double())), INVALID, "'classifier.bias' has dtype torch.float64"),
    "NaN values": (lambda r: stream_of(r, changed(r, "classifier.bias", nan_bias)), INVALID, "'classifier.bias' contains NaN"),
    "missing tensor": (lambda r: stream_of(r, encoded({k: v for k, v in r.model.items() if k != "classifier.bias"})), INVALID, "missing tensors ['classifier.bias']"),
    "unknown group": (lambda r: stream_of(r, encoded(r.model, spare={"x": torch.zeros(2)})), INVALID, "unknown tensor groups ['spare']"),
    "unknown round": (lambda r: stream_of(r, valid(r), round=7), PRECONDITION, "update for round 7"),
    "unknown task id": (lambda r: stream_of(r, valid(r), task_id="feedfacefeedface"), PRECONDITION, "(task feedface)"),
    "unregistered client": (lambda r: stream_of(r, valid(r), client_id=500), PRECONDITION, "client 500 is not registered"),
    "stale session": (lambda r: stream_of(r, valid(r), session=r.stale_session), PRECONDITION, "session is stale"),
    "chunks out of order": (lambda r: reorder(stream_of(r, valid(r))), INVALID, "chunk 1 arrived where chunk 0 was expected"),
    "bad sha256": (lambda r: stream_of(r, valid(r), payload=payload_meta(len(valid(r)))), INVALID, "does not match the announced 000000000000"),
    "more bytes than announced": (
        lambda r: stream_of(r, valid(r), payload=payload_meta(len(valid(r)) - 10, hashlib.sha256(valid(r)).hexdigest())),
        INVALID,
        "overruns the announced",
    ),
    "fewer bytes than announced": (lambda r: stream_of(r, valid(r))[:-1], INVALID, "payload ended after"),
    "oversized announced total": (lambda r: stream_of(r, valid(r), payload=payload_meta(10**12)), INVALID, "announced payload of 1000000000000 bytes exceeds"),
    "wrong chunk count": (
        lambda r: stream_of(r, valid(r), payload=pb.Payload(total_bytes=len(valid(r)), sha256=codec.sha256(valid(r)), num_chunks=9)),
        INVALID,
        "announced 9 chunks",
    ),
    "garbage bytes": (lambda r: stream_of(r, GARBAGE), INVALID, "payload is not valid safetensors"),
    "no header": (lambda r: chunk_messages(valid(r)), INVALID, "must start with an UpdateHeader"),
    "empty stream": (lambda r: [], INVALID, "must start with an UpdateHeader"),
    "second header": (lambda r: [*stream_of(r, valid(r)), pb.UpdateChunk(header=header(r, valid(r)))], INVALID, "one header, then only chunks"),
    "inline: NaN values": (lambda r: inline_of(r, changed(r, "classifier.bias", nan_bias)), INVALID, "'classifier.bias' contains NaN"),
    "inline: bad sha256": (lambda r: inline_of(r, valid(r), payload=pb.Payload(total_bytes=len(valid(r)), sha256="0" * 64)), INVALID,
                           "does not match the announced 000000000000"),
    "inline: chunks announced": (lambda r: inline_of(r, valid(r), payload=payload_meta(len(valid(r)), codec.sha256(valid(r)))), INVALID,
                                 "announces 0 chunks, not 1"),
    "inline: fewer bytes than announced": (
        lambda r: inline_of(r, valid(r)[:-10], payload=pb.Payload(total_bytes=len(valid(r)), sha256=codec.sha256(valid(r)))),
        INVALID,
        "payload ended after",
    ),
    "inline, then a chunk": (lambda r: [*inline_of(r, valid(r)), *chunk_messages(valid(r))[:1]], INVALID, "followed by chunks"),
}


CASE_CLIENT = {name: client for client, name in enumerate(CASES, start=1)}
CLIENTS = len(CASES) + 1
# Every client sampled; a round closes with client 0's answer alone once the others were refused (or, in round 2, left).
SETTINGS = {"data.clients": CLIENTS, "data.partition": "iid", "train.rounds": 2, "runtime.quorum": 0.01,
            "runtime.round_timeout_s": 120.0, "runtime.rejoin_grace_s": 1.0}


def submit(rnd: OpenRound, messages: list[pb.UpdateChunk]) -> pb.SubmitReply:
    return rnd.stub.SubmitUpdate(iter(messages), timeout=RPC_TIMEOUT_S)


def assert_refused(rnd: OpenRound, name: str) -> None:
    """Send the case once, from its own client."""
    if name in rnd.sent:
        return
    rnd.sent.add(name)
    build, code, text = CASES[name]
    rnd.speaker = CASE_CLIENT[name]
    try:
        with pytest.raises(grpc.RpcError) as refused:
            submit(rnd, build(rnd))
    finally:
        rnd.speaker = CLIENT_ID
    assert refused.value.code() == code, f"{name}: {refused.value.code()} {refused.value.details()}"
    assert text in refused.value.details(), f"{name}: {refused.value.details()!r} does not name the problem ({text!r})"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_bad_update_is_refused_with_a_message_naming_the_problem(open_round: OpenRound, name: str) -> None:
    assert_refused(open_round, name)


@pytest.mark.slow
def test_refused_updates_leave_the_global_model_unchanged(open_round: OpenRound) -> None:
    for name in CASES:  # again, so this test does not depend on the order the others ran in
        assert_refused(open_round, name)
    before = open_round.model
    shifted = {key: value + 0.5 for key, value in before.items()}  # every value moves, exactly representable
    assert submit(open_round, inline_of(open_round, encoded(shifted))).accepted
    for other in open_round.others:  # the clients of cases refused before their round was known never answer: gone
        other.cancel()

    # With one client, the next global model is exactly its update: nothing refused was folded in.
    task, payload = receive_task(open_round.stream)
    assert task.round == 2 and task.task_id != open_round.task.task_id
    round_two = codec.split_prefixed(codec.decode(payload))["model"]
    saved = wait_until(lambda: checkpoint.load(open_round.out_dir), timeout_s=30, what="round-1 checkpoint")
    assert saved.completed_rounds == 1
    for key, value in shifted.items():
        assert torch.equal(round_two[key], value), key
        assert torch.equal(saved.global_state[key], value), key

    # A second answer to round 1 is refused too; the others leave, and the round-2 answer ends the run.
    with pytest.raises(grpc.RpcError) as late:
        submit(open_round, stream_of(open_round, encoded(shifted)))
    assert late.value.code() == PRECONDITION and "update for round 1" in late.value.details()
    open_round.task, open_round.payload = task, payload
    assert submit(open_round, stream_of(open_round, encoded(round_two))).accepted
    finished = [m.finished for m in open_round.stream if m.WhichOneof("kind") == "finished"]
    assert finished and finished[0].success

    # Each refused answer to round 1 is named in the run's record, with its client.
    record = wait_until(lambda: (open_round.out_dir / "coordinator.json").is_file() and read_record(open_round.out_dir),
                        timeout_s=30, what="coordinator.json")
    named = {(entry["round"], entry["client"]) for entry in record["refused_updates"]}
    for name, (_, code, _) in CASES.items():
        if code == INVALID and name not in ("no header", "empty stream", "second header"):  # no header: nobody to name
            assert (1, CASE_CLIENT[name]) in named, name
