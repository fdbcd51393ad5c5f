"""Payloads moved without extra copies: one buffer per payload, chunk messages framed once, chunks received in place.

Same checks, order and messages as `codec.assemble`: the announced size against the limit, the chunk count,
chunks in order and within the announced size, the full length, then the SHA-256 (hashed as chunks arrive).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from fedsynth.wire.codec import CHUNK_BYTES, MAX_PAYLOAD_BYTES, PayloadMeta, num_chunks
from fedsynth.errors import WireError
from fedsynth.wire.raw_messages import chunk_message
from fedsynth.wire.tensor_buffer import fresh_buffer


def byte_view(buffer: torch.Tensor) -> memoryview:
    """The bytes of a 1-D uint8 tensor, without a copy."""
    return memoryview(buffer.numpy()).cast("B")


def describe_buffer(buffer: torch.Tensor) -> PayloadMeta:
    size = buffer.numel()
    return PayloadMeta(size, hashlib.sha256(byte_view(buffer)).hexdigest(), num_chunks(size))


def chunk_views(buffer: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[int, memoryview]]:
    """(seq, memoryview) pieces of the buffer; no copies."""
    view = byte_view(buffer)
    for seq, start in enumerate(range(0, len(view), chunk_bytes)):
        yield seq, view[start : start + chunk_bytes]


def chunk_messages(buffer: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The serialized chunk messages of a payload (one copy of each chunk, made as the message is needed)."""
    for seq, piece in chunk_views(buffer, chunk_bytes):
        yield chunk_message(seq, piece)


@dataclass(frozen=True)
class PreparedPayload:
    """A payload ready for any number of receivers: its description and its chunk messages, serialized once; or, for
    the data plane (fedsynth.wire.data_plane.prepare), the buffer itself and its checksum, with no chunk messages."""

    meta: PayloadMeta
    messages: tuple[bytes, ...]
    inline: bytes = b""  # a payload that fits one chunk: sent in the task itself (Task.inline_payload), no chunks
    buffer: torch.Tensor | None = None
    digest: bytes = b""  # the data plane's checksum

    @property
    def ready(self) -> bool:
        """False once let go (every receiver had it): a late receiver needs it prepared again."""
        return bool(self.messages or self.inline) or self.buffer is not None

    @property
    def by_data_plane(self) -> bool:
        return self.buffer is not None


def prepare(buffer: torch.Tensor) -> PreparedPayload:
    """Hash once and frame once; the buffer itself is not kept. A payload that fits one chunk is kept as bytes, to
    travel in the task (0 chunks announced)."""
    meta = describe_buffer(buffer)
    if meta.num_chunks == 1:
        return PreparedPayload(PayloadMeta(meta.total_bytes, meta.sha256, 0), (), inline=bytes(byte_view(buffer)))
    return PreparedPayload(meta, tuple(chunk_messages(buffer)))


def receive_inline(meta: PayloadMeta, data: bytes, *, max_bytes: int = MAX_PAYLOAD_BYTES) -> torch.Tensor:
    """A payload that came in its task (Task.inline_payload, 0 chunks announced), checked as one chunk would be: its
    size against the announced size and the limit, its SHA-256."""
    if meta.num_chunks:
        raise WireError(f"a task with its payload inline announces 0 chunks, not {meta.num_chunks}")
    if not 0 < meta.total_bytes <= CHUNK_BYTES:
        raise WireError(f"an inline payload holds 1 to {CHUNK_BYTES} bytes; {meta.total_bytes} announced")
    return receive_into(PayloadMeta(meta.total_bytes, meta.sha256, 1), [(0, data)], max_bytes=max_bytes)


def receive_into(meta: PayloadMeta, chunks: Iterable[tuple[int, bytes]], *, max_bytes: int = MAX_PAYLOAD_BYTES) -> torch.Tensor:
    """The payload in one uint8 tensor of the announced size, each chunk written in place as it arrives."""
    if meta.total_bytes > max_bytes:
        raise WireError(f"announced payload of {meta.total_bytes} bytes exceeds the limit of {max_bytes}")
    if meta.num_chunks != num_chunks(meta.total_bytes):
        raise WireError(f"announced {meta.num_chunks} chunks for {meta.total_bytes} bytes; expected {num_chunks(meta.total_bytes)}")
    buffer = fresh_buffer(meta.total_bytes)  # untouched pages: an announced size never sent costs no memory
    view = byte_view(buffer)
    digest = hashlib.sha256()
    received = expected = 0
    for seq, data in chunks:
        if seq != expected:
            raise WireError(f"chunk {seq} arrived where chunk {expected} was expected")
        size = len(data)
        if size > CHUNK_BYTES or received + size > meta.total_bytes:
            raise WireError(f"chunk {seq} overruns the announced {meta.total_bytes} bytes")
        view[received : received + size] = data
        digest.update(data)
        received += size
        expected += 1
    if received != meta.total_bytes:
        raise WireError(f"payload ended after {received} of {meta.total_bytes} bytes ({expected} chunks)")
    if digest.hexdigest() != meta.sha256:
        raise WireError(f"payload checksum {digest.hexdigest()[:12]}… does not match the announced {meta.sha256[:12]}…")
    return buffer
