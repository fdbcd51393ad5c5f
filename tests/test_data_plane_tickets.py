"""A data-plane ticket serves one transfer at a time (a second connection on it is refused UNAVAILABLE while the first
is under way, served once it ended), and a payload send has one deadline for the whole of it: a reader that takes a
little at a time is cut off there instead of holding a worker for as long as it keeps reading."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from fedsynth.errors import WireError
from fedsynth.v1 import coordinator_pb2 as pb
from fedsynth.v1 import coordinator_pb2_grpc as pb_grpc
from fedsynth.wire import data_plane
from runtime_harness import Runtime, channel, register_request

RPC_TIMEOUT_S = 20.0
# ResNet-18's 45 MB: far more than the loopback socket buffers hold, so a fetch whose reader waits stays under way
SETTINGS = {"runtime.data_plane": "tcp", "runtime.data_plane_min_bytes": 0, "train.model": "resnet18", "data.clients": 1,
            "train.rounds": 1, "runtime.round_timeout_s": 300.0, "runtime.heartbeat_timeout_s": 120.0}


def fetch_request(ticket: bytes) -> bytes:
    return struct.pack("<4sB16sI", data_plane.MAGIC, data_plane.FETCH, ticket, 0)


@pytest.fixture
def ticket(tmp_path: Path) -> Iterator[tuple[data_plane.Endpoint, bytes]]:
    """A registered client's round-1 task ticket, on a real coordinator (its endpoint and the ticket)."""
    with Runtime(tmp_path) as rt:
        coord = rt.coordinator(SETTINGS, tmp_path / "run")
        with channel(coord.address) as ch:
            stub = pb_grpc.CoordinatorStub(ch)
            spec = stub.GetRunSpec(pb.GetRunSpecRequest(), timeout=RPC_TIMEOUT_S, wait_for_ready=True)
            reply = stub.Register(register_request(spec, client_id=0, num_samples=100), timeout=RPC_TIMEOUT_S)
            stream = stub.Subscribe(pb.SubscribeRequest(client_id=0, session=reply.session), timeout=300)
            task = next(m.task for m in stream if m.WhichOneof("kind") == "task")
            yield data_plane.Endpoint("127.0.0.1", reply.data_port), task.data_ticket
            stream.cancel()


@pytest.mark.slow
def test_a_ticket_serves_one_transfer_at_a_time(ticket: tuple[data_plane.Endpoint, bytes]) -> None:
    endpoint, data_ticket = ticket
    with socket.create_connection((endpoint.host, endpoint.port), timeout=RPC_TIMEOUT_S) as first:
        first.sendall(fetch_request(data_ticket))
        assert data_plane.read_status(first)[0] == grpc.StatusCode.OK  # the payload follows; nobody reads it yet
        with pytest.raises(data_plane.DataPlaneError) as second:
            data_plane.fetch(endpoint, data_ticket, timeout_s=RPC_TIMEOUT_S)
        assert second.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "ticket is in use by another transfer" in second.value.details()
        (total,) = struct.unpack("<Q", data_plane.read_exact(first, 8, "the size"))
        data_plane.read_exact(first, total + data_plane.DIGEST_BYTES, "the payload")  # the first one ends
    payload = data_plane.fetch(endpoint, data_ticket, timeout_s=RPC_TIMEOUT_S)  # and the ticket serves again
    assert payload.numel() == total > 40 << 20


def test_a_send_to_a_slow_reader_ends_at_its_deadline() -> None:
    sender, reader = socket.socketpair()
    payload = torch.zeros(16 << 20, dtype=torch.uint8)
    received = 0
    done = threading.Event()

    def read_slowly() -> None:  # 64 KiB every 20 ms, ~3 MB/s: each send progresses, the whole would take 5 s
        nonlocal received
        reader.settimeout(RPC_TIMEOUT_S)
        while not done.is_set():
            data = reader.recv(64 << 10)
            if not data:
                return
            received += len(data)
            time.sleep(0.02)

    thread = threading.Thread(target=read_slowly, daemon=True)
    thread.start()
    sender.settimeout(RPC_TIMEOUT_S)  # the stall deadline: never reached, the reader keeps reading
    try:
        with pytest.raises(WireError, match=r"payload not sent within its deadline \(\d+ of 16777216 bytes\)"):
            data_plane.send_payload(sender, payload, with_size=True, deadline=time.monotonic() + 0.5)
        assert sender.gettimeout() == RPC_TIMEOUT_S  # its own timeout, back
    finally:
        done.set()
        sender.close()
        thread.join(timeout=RPC_TIMEOUT_S)
        reader.close()
    assert received < payload.numel()
