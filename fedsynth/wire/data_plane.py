"""The data plane: model payloads as raw bytes over one TCP (or mutual-TLS) connection per transfer, beside gRPC.

Why: a gRPC stream from Python moves ResNet-18's 45 MB in 43 messages at ~1 GB/s here, a plain socket at several GB/s,
and SHA-256 (37 ms for 45 MB) costs twenty times XXH3-128 (1.6 ms) on this CPU (docs/runtime.md). gRPC keeps the
control: the task (with a ticket), the update's header, every deadline and every refusal's status code.

The checksum is XXH3-128, not a cryptographic hash, on purpose: it travels on the same connection as the bytes it
covers, so whoever can change the bytes can change it too, and it can only ever catch accidents, which 128 bits of a
well-mixed checksum catch as surely as SHA-256. Against tampering, the run's mutual TLS authenticates every byte.

One request per connection; integers little-endian; a status is a grpc.StatusCode's number (0 OK) and a UTF-8 message:

    request   b"FSD2" | op u8 | ticket 16 B | header length u32 | header (a serialized UpdateHeader for SUBMIT, else empty)
    FETCH     <- status | total u64 | total bytes | XXH3-128 digest 16 B
    SUBMIT    <- status (the header fits the open round and a receive slot is held)
              -> total bytes (the header's payload.total_bytes) | XXH3-128 digest 16 B
              <- status (verified, checked and folded, or why not)

The ticket is a secret of one client's task, sent down its (authenticated) dispatch stream; with mutual TLS the
connection's certificate must also be that client's. No pickle, no torch.load: bytes land in one buffer that
fedsynth.wire.tensor_buffer decodes as views.
"""

from __future__ import annotations

import socket
import ssl
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc
import torch
import xxhash

from fedsynth.wire.codec import CHUNK_BYTES, MAX_PAYLOAD_BYTES, PayloadMeta
from fedsynth.errors import WireError
from fedsynth.wire.tensor_buffer import ReceiveBuffers, fresh_buffer
from fedsynth.wire.transfer import PreparedPayload, byte_view

MAGIC = b"FSD2"  # FSD1 (2026-12-04) carried a 32-byte BLAKE3 digest
FETCH, SUBMIT = 1, 2
TICKET_BYTES = 16
DIGEST_BYTES = 16
MAX_HEADER_BYTES = 1 << 16  # an UpdateHeader is a few hundred bytes
MAX_MESSAGE_BYTES = 1 << 12
_REQUEST = struct.Struct(f"<4sB{TICKET_BYTES}sI")
_STATUS = struct.Struct("<BI")
_TOTAL = struct.Struct("<Q")
PIECE_BYTES = 4 * CHUNK_BYTES  # sent and hashed per piece: each piece is one trip back to the GIL, beside other threads
SMALL_PART_BYTES = 64 << 10  # parts smaller than this are joined into one piece: no send per bias vector
SEND_SLICE_BYTES = 64 << 10  # the most one send() moves under TLS, where it moves all or nothing (see send_payload)
STALL_S = 60.0  # no byte for this long (or no answer: a receive slot, a fold) and a transfer counts as broken


Payload = torch.Tensor | Sequence[memoryview]  # one 1-D uint8 buffer, or its bytes as parts in order (flat, format "B")


class DataPlaneError(grpc.RpcError, grpc.Call):  # type: ignore[misc]
    """A refusal or a broken transfer, with the status code gRPC would have given: the client's handling of gRPC errors
    (retry UNAVAILABLE, reconnect, give up on INVALID_ARGUMENT) applies unchanged."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def initial_metadata(self) -> tuple[()]:
        return ()

    def trailing_metadata(self) -> tuple[()]:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float | None:
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return False


class ConnectionClosed(WireError):
    """The peer closed the connection early: a refusal naming the shortfall to a sender, a broken link to a client."""


_CODES = {code.value[0]: code for code in grpc.StatusCode}


@dataclass(frozen=True)
class Endpoint:
    """Where a client reaches the coordinator's data plane: the coordinator's host, the port it announced at
    registration, and the client's TLS context (None: plaintext, as the gRPC channel)."""

    host: str
    port: int
    tls: ssl.SSLContext | None = None

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def host_of(target: str) -> str:
    """The host of the coordinator's gRPC target (HOST:PORT, [V6]:PORT or dns:///NAME:PORT): its data plane's host."""
    return target.removeprefix("dns:///").rpartition(":")[0].strip("[]")


# ---- framing, both sides -------------------------------------------------------------------------------------------

def read_exact(sock: socket.socket, size: int, what: str) -> bytes:
    out = bytearray(size)
    view, got = memoryview(out), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionClosed(f"the data-plane connection closed after {got} of {size} bytes of {what}")
        got += n
    return bytes(out)


def send_status(sock: socket.socket, code: grpc.StatusCode, message: str = "") -> None:
    text = message.encode()[:MAX_MESSAGE_BYTES]
    sock.sendall(_STATUS.pack(code.value[0], len(text)) + text)


def read_status(sock: socket.socket) -> tuple[grpc.StatusCode, str]:
    number, size = _STATUS.unpack(read_exact(sock, _STATUS.size, "a status"))
    if size > MAX_MESSAGE_BYTES or number not in _CODES:
        raise WireError(f"malformed data-plane status (code {number}, {size}-byte message)")
    return _CODES[number], read_exact(sock, size, "a status message").decode(errors="replace")


REQUEST_BYTES = _REQUEST.size


def parse_request(head: bytes) -> tuple[int, bytes, int]:
    """(op, ticket, header length) of a request's first REQUEST_BYTES bytes, or WireError naming what is malformed."""
    magic, op, ticket, header_len = _REQUEST.unpack(head)
    if magic != MAGIC:
        raise WireError(f"not a fedsynth data-plane request (magic {magic!r}, expected {MAGIC!r})")
    if op not in (FETCH, SUBMIT):
        raise WireError(f"unknown data-plane operation {op}")
    if header_len > MAX_HEADER_BYTES:
        raise WireError(f"request header of {header_len} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    return op, ticket, header_len


def read_request(sock: socket.socket) -> tuple[int, bytes, bytes]:
    """(op, ticket, header) of a request, or WireError naming what is malformed."""
    op, ticket, header_len = parse_request(read_exact(sock, _REQUEST.size, "the request"))
    return op, ticket, read_exact(sock, header_len, "the request header")


def new_checksum() -> xxhash.xxh3_128:
    """The checksum a payload travels with (XXH3-128, see above), to feed piece by piece."""
    return xxhash.xxh3_128()


def digest_of(data: bytes | memoryview) -> bytes:
    checksum = new_checksum()
    checksum.update(data)
    return checksum.digest()


def prepare(buffer: torch.Tensor) -> PreparedPayload:
    """A task payload for the data plane: kept as it is, its checksum computed once; no SHA-256 and no chunks (nobody
    receives it over gRPC): the task announces its size, with 0 chunks to follow."""
    return PreparedPayload(PayloadMeta(buffer.numel(), "", 0), (), buffer=buffer, digest=digest_of(byte_view(buffer)))


def send_payload(sock: socket.socket, payload: Payload, digest: bytes | None = None, *, with_size: bool = False,
                 deadline: float | None = None) -> None:
    """The payload's bytes (after their size, `with_size`), then their checksum (computed piece by piece as sent,
    unless given). The socket's own timeout bounds each stall, not the whole send: it fails (TimeoutError naming how
    much went) only once the peer took no byte for that long, so a peer that keeps reading, however slowly, gets the
    payload. With a `deadline` (time.monotonic()), all of it by then, or WireError naming how much went: that bounds
    the whole send (a peer reading a little at a time)."""
    parts = [byte_view(payload)] if isinstance(payload, torch.Tensor) else payload
    total = sum(part.nbytes for part in parts)
    stall = sock.gettimeout()
    # Under TLS one send() moves its whole slice or nothing (no partial writes), so a slice is the most that must move
    # within one stall timeout: 64 KiB takes 0.65 s at 100 kB/s. A plain socket's send() returns what the kernel took.
    most = SEND_SLICE_BYTES if isinstance(sock, ssl.SSLSocket) else PIECE_BYTES
    sent = 0

    def send(data: bytes | memoryview) -> None:
        nonlocal sent
        view = memoryview(data)
        while view.nbytes:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WireError(f"payload not sent within its deadline ({sent} of {total} bytes)")
                sock.settimeout(left if stall is None else min(stall, left))
            try:
                moved = sock.send(view[:most])
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise WireError(f"payload not sent within its deadline ({sent} of {total} bytes)") from None
                raise TimeoutError(f"the peer took no byte for {sock.gettimeout():g}s ({sent} of {total} bytes of the "
                                   "payload sent)") from None
            view = view[moved:]
            sent += moved

    try:
        if with_size:
            send(_TOTAL.pack(total))
            sent = 0
        hasher = None if digest is not None else new_checksum()
        for piece in _pieces(parts):
            send(piece)
            if hasher is not None:
                hasher.update(piece)
        send(digest if digest is not None else hasher.digest())  # type: ignore[union-attr]
    finally:
        if deadline is not None:
            sock.settimeout(stall)


def _pieces(parts: Sequence[memoryview]) -> Iterator[memoryview]:
    """The parts' bytes in order, in pieces of at most PIECE_BYTES: large parts sliced, runs of small ones (a model's
    biases and norms) joined into one piece, the only bytes copied."""
    small = bytearray()
    for part in parts:
        if part.nbytes < SMALL_PART_BYTES and len(small) + part.nbytes <= PIECE_BYTES:
            small += part
            continue
        if small:
            yield memoryview(small)
            small = bytearray()
        if part.nbytes < SMALL_PART_BYTES:
            small += part
            continue
        for start in range(0, part.nbytes, PIECE_BYTES):
            yield part[start : start + PIECE_BYTES]
    if small:
        yield memoryview(small)


def receive_payload(sock: socket.socket, total: int, *, deadline: float, buffers: ReceiveBuffers | None = None) -> torch.Tensor:
    """`total` bytes into one fresh buffer, hashed as they arrive, then checked against the sender's digest."""
    # untouched pages: an announced size never sent costs no memory
    buffer = fresh_buffer(total) if buffers is None else buffers.take(total)
    view = byte_view(buffer)
    hasher = new_checksum()
    got = hashed = 0
    while got < total:
        if time.monotonic() > deadline:
            raise WireError(f"payload not received within its deadline ({got} of {total} bytes)")
        n = sock.recv_into(view[got : min(total, got + PIECE_BYTES)])
        if n == 0:
            raise ConnectionClosed(f"payload ended after {got} of {total} bytes")
        got += n
        if got - hashed >= PIECE_BYTES or got == total:
            hasher.update(view[hashed:got])
            hashed = got
    announced = read_exact(sock, DIGEST_BYTES, "the payload digest")
    if hasher.digest() != announced:
        raise WireError(f"payload checksum {hasher.hexdigest()[:12]}… does not match the announced {announced.hex()[:12]}…")
    return buffer


# ---- the client side -------------------------------------------------------------------------------------------------

def _connect(endpoint: Endpoint, timeout_s: float) -> socket.socket:
    try:
        sock = socket.create_connection((endpoint.host, endpoint.port), timeout=min(timeout_s, STALL_S))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if endpoint.tls is not None:
            sock = endpoint.tls.wrap_socket(sock, server_hostname=endpoint.host)
        return sock
    except (OSError, ssl.SSLError) as exc:
        raise DataPlaneError(grpc.StatusCode.UNAVAILABLE, f"data plane {endpoint}: {exc}") from exc


def _request(sock: socket.socket, op: int, ticket: bytes, header: bytes = b"") -> None:
    sock.sendall(_REQUEST.pack(MAGIC, op, ticket, len(header)) + header)


def _raise_unless_ok(sock: socket.socket) -> None:
    code, message = read_status(sock)
    if code != grpc.StatusCode.OK:
        raise DataPlaneError(code, message)


def fetch(endpoint: Endpoint, ticket: bytes, *, timeout_s: float, max_bytes: int = MAX_PAYLOAD_BYTES,
          buffers: ReceiveBuffers | None = None) -> torch.Tensor:
    """The task payload this ticket names, verified; DataPlaneError (UNAVAILABLE when the link failed, else the
    coordinator's refusal) or WireError (the bytes are not what was announced)."""
    deadline = time.monotonic() + timeout_s
    with _connect(endpoint, timeout_s) as sock:
        try:
            _request(sock, FETCH, ticket)
            _raise_unless_ok(sock)
            (total,) = _TOTAL.unpack(read_exact(sock, _TOTAL.size, "the payload size"))
            if total > max_bytes:
                raise WireError(f"announced payload of {total} bytes exceeds the limit of {max_bytes}")
            return receive_payload(sock, total, deadline=deadline, buffers=buffers)
        except (OSError, ssl.SSLError, ConnectionClosed) as exc:  # a broken link: retried, or the client reconnects
            raise DataPlaneError(grpc.StatusCode.UNAVAILABLE, f"data plane {endpoint}: {exc}") from exc


def submit(endpoint: Endpoint, ticket: bytes, header: bytes, payload: Payload, *, timeout_s: float) -> None:
    """Send an update (its serialized UpdateHeader, whose payload.total_bytes is `payload`'s size) and wait until the
    coordinator has verified, checked and folded it; DataPlaneError with its status otherwise. `payload`: one buffer,
    or `tensor_buffer.encode_parts` of the update's tensors, sent from their own memory (no encoded copy)."""
    with _connect(endpoint, timeout_s) as sock:
        try:
            _request(sock, SUBMIT, ticket, header)
            _raise_unless_ok(sock)  # the header fits the round and a receive slot is ours: send
            send_payload(sock, payload)
            _raise_unless_ok(sock)
        except (OSError, ssl.SSLError, ConnectionClosed) as exc:  # a broken link: retried, or the client reconnects
            raise DataPlaneError(grpc.StatusCode.UNAVAILABLE, f"data plane {endpoint}: {exc}") from exc
