"""Payloads moved without extra copies: one buffer per payload, chunk messages framed once, chunks received in place.

Same checks, order and messages as `codec.assemble`: the announced size against the limit, the chunk count,
chunks in order and within the announced size, the full length, then the checksum (computed as chunks arrive).

The checksum senders announce is XXH3-128 (`Payload.xxh3_128`), as on the data plane: 45 MB in ~2 ms where SHA-256
takes ~37 ms, and it was paid three times a round trip (the client's push, its reply, the coordinator's receive). It
only has to catch accidents, which 128 well-mixed bits catch as surely as SHA-256: it travels beside the bytes it
covers, so whoever can change the bytes could change either digest, and against that the run's mutual TLS
authenticates every byte (docs/security.md). A payload that announces a SHA-256 only (an older sender) is checked
against it; one that announces neither is refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch
import xxhash

from fedsynth.wire.codec import CHUNK_BYTES, MAX_PAYLOAD_BYTES, Checksum, PayloadMeta, num_chunks
from fedsynth.errors import WireError
from fedsynth.wire.raw_messages import chunk_message
from fedsynth.wire.tensor_buffer import ReceiveBuffers, fresh_buffer


def byte_view(buffer: torch.Tensor) -> memoryview:
    """The bytes of a 1-D uint8 tensor, without a copy."""
    return memoryview(buffer.numpy()).cast("B")


def describe_parts(parts: Sequence[memoryview]) -> PayloadMeta:
    """The size, chunk count and XXH3-128 of the bytes the parts hold in order (flat byte views)."""
    digest = xxhash.xxh3_128()
    for part in parts:
        digest.update(part)
    size = sum(part.nbytes for part in parts)
    return PayloadMeta(size, "", num_chunks(size), digest.digest())


def describe_buffer(buffer: torch.Tensor) -> PayloadMeta:
    return describe_parts([byte_view(buffer)])


def chunk_views(buffer: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[int, memoryview]]:
    """(seq, memoryview) pieces of the buffer; no copies."""
    view = byte_view(buffer)
    for seq, start in enumerate(range(0, len(view), chunk_bytes)):
        yield seq, view[start : start + chunk_bytes]


def chunk_messages(payload: torch.Tensor | Sequence[memoryview], chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The serialized chunk messages of a payload: one buffer, or its bytes as parts in order (`encode_parts`: a
    chunk may span several), one copy of each byte, made as the message is needed."""
    parts = [byte_view(payload)] if isinstance(payload, torch.Tensor) else payload
    pieces: list[memoryview] = []
    size = seq = 0
    for part in parts:
        start = 0
        while start < part.nbytes:
            take = min(chunk_bytes - size, part.nbytes - start)
            pieces.append(part[start : start + take])
            size, start = size + take, start + take
            if size == chunk_bytes:
                yield chunk_message(seq, *pieces)
                pieces, size, seq = [], 0, seq + 1
    if size:
        yield chunk_message(seq, *pieces)


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


def prepare(payload: torch.Tensor | Sequence[memoryview]) -> PreparedPayload:
    """Hash once and frame once, from one buffer or from the parts `tensor_buffer.encode_parts` gives (each byte copied
    once, into its chunk message); neither is kept. A payload that fits one chunk is kept as bytes, to travel in the
    task (0 chunks announced)."""
    parts = [byte_view(payload)] if isinstance(payload, torch.Tensor) else payload
    meta = describe_parts(parts)
    if meta.num_chunks == 1:
        return PreparedPayload(replace(meta, num_chunks=0), (), inline=b"".join(parts))
    return PreparedPayload(meta, tuple(chunk_messages(parts)))


def receive_inline(meta: PayloadMeta, data: bytes, *, max_bytes: int = MAX_PAYLOAD_BYTES) -> torch.Tensor:
    """A payload that came in its task (Task.inline_payload, 0 chunks announced), checked as one chunk would be: its
    size against the announced size and the limit, its SHA-256."""
    if meta.num_chunks:
        raise WireError(f"a task with its payload inline announces 0 chunks, not {meta.num_chunks}")
    if not 0 < meta.total_bytes <= CHUNK_BYTES:
        raise WireError(f"an inline payload holds 1 to {CHUNK_BYTES} bytes; {meta.total_bytes} announced")
    return receive_into(replace(meta, num_chunks=1), [(0, data)], max_bytes=max_bytes)


def receive_into(meta: PayloadMeta, chunks: Iterable[tuple[int, bytes | memoryview]], *, max_bytes: int = MAX_PAYLOAD_BYTES,
                 buffers: ReceiveBuffers | None = None) -> torch.Tensor:
    """The payload in one uint8 tensor of the announced size, each chunk written in place as it arrives: fresh memory,
    or a free buffer of `buffers` (a receiver of the same size every round)."""
    if meta.total_bytes > max_bytes:
        raise WireError(f"announced payload of {meta.total_bytes} bytes exceeds the limit of {max_bytes}")
    if meta.num_chunks != num_chunks(meta.total_bytes):
        raise WireError(f"announced {meta.num_chunks} chunks for {meta.total_bytes} bytes; expected {num_chunks(meta.total_bytes)}")
    digest = Checksum(meta)
    # untouched pages: an announced size never sent costs no memory
    buffer = fresh_buffer(meta.total_bytes) if buffers is None else buffers.take(meta.total_bytes)
    view = byte_view(buffer)
    update = digest.hasher.update
    received = expected = 0
    for seq, data in chunks:
        if seq != expected:
            raise WireError(f"chunk {seq} arrived where chunk {expected} was expected")
        size = len(data)
        if size > CHUNK_BYTES or received + size > meta.total_bytes:
            raise WireError(f"chunk {seq} overruns the announced {meta.total_bytes} bytes")
        view[received : received + size] = data
        update(data)
        received += size
        expected += 1
    if received != meta.total_bytes:
        raise WireError(f"payload ended after {received} of {meta.total_bytes} bytes ({expected} chunks)")
    digest.check()
    return buffer
