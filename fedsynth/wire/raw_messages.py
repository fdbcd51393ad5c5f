"""Chunk messages serialized by hand (one copy of the data, no protobuf object) and serializers that pass them through.

Every chunk-carrying message of the coordinator's protocol (ServerMessage, UpdateChunk, SyntheticChunk,
MeanDataChunk) holds `Chunk chunk = 2` (with `uint32 seq = 1; bytes data = 2`) in its oneof, so one framing
serves them all; the bytes are what protobuf's own serializer writes for the same message (tested).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

_CHUNK_FIELD = b"\x12"  # field 2, length-delimited: the oneof's chunk, and Chunk's data
_SEQ_FIELD = b"\x08"  # field 1, varint
_TASK_FIELD = b"\x0a"  # ServerMessage's field 1, length-delimited: the oneof's task
_INLINE_FIELD = b"\x3a"  # Task's field 7, length-delimited: inline_payload


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def chunk_message(seq: int, data: bytes | memoryview) -> bytes:
    """The serialized `{chunk: {seq, data}}` message, built with exactly one copy of `data`."""
    size = len(data)
    inner_prefix = (_SEQ_FIELD + _varint(seq) if seq else b"") + (_CHUNK_FIELD + _varint(size) if size else b"")
    return b"".join((_CHUNK_FIELD, _varint(len(inner_prefix) + size), inner_prefix, data))


def task_message(task: bytes, inline: bytes) -> bytes:
    """The serialized `ServerMessage{task}` of a serialized Task (without inline_payload) and its inline payload, built
    with one copy of `inline` (protobuf's own serializer, from message objects, copies it three times); a field appended
    to a message's bytes is part of it, and as inline_payload is Task's last field these are protobuf's bytes too."""
    field = _INLINE_FIELD + _varint(len(inline)) if inline else b""
    return b"".join((_TASK_FIELD, _varint(len(task) + len(field) + len(inline)), task, field, inline))


def passthrough(serialize: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
    """A serializer that sends bytes as they are (messages serialized beforehand) and serializes anything else."""

    def serialize_unless_bytes(message: Any) -> bytes:
        return message if isinstance(message, bytes) else serialize(message)

    return serialize_unless_bytes


def submit_update_call(channel: grpc.Channel) -> grpc.StreamUnaryMultiCallable:
    """Coordinator.SubmitUpdate taking UpdateChunk messages or chunk messages already serialized by `chunk_message`."""
    from fedsynth.v1 import coordinator_pb2 as pb

    return channel.stream_unary(
        "/fedsynth.v1.Coordinator/SubmitUpdate",
        request_serializer=passthrough(pb.UpdateChunk.SerializeToString),
        response_deserializer=pb.SubmitReply.FromString,
    )
