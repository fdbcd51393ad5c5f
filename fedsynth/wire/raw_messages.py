"""Chunk messages serialized by hand (one copy of the data, no protobuf object) and serializers that pass them through.

Every chunk-carrying message of the coordinator's protocol (ServerMessage, UpdateChunk, SyntheticChunk,
MeanDataChunk) holds `Chunk chunk = 2` (with `uint32 seq = 1; bytes data = 2`) in its oneof, so one framing
serves them all; the bytes are what protobuf's own serializer writes for the same message (tested).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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


def chunk_message(seq: int, *pieces: bytes | memoryview) -> bytes:
    """The serialized `{chunk: {seq, data}}` message whose data is the pieces joined, built with exactly one copy of
    them (flat byte views: memoryviews of format "B")."""
    size = sum(len(piece) for piece in pieces)
    inner_prefix = (_SEQ_FIELD + _varint(seq) if seq else b"") + (_CHUNK_FIELD + _varint(size) if size else b"")
    return b"".join((_CHUNK_FIELD, _varint(len(inner_prefix) + size), inner_prefix, *pieces))


@dataclass(frozen=True)
class RawChunk:
    """A chunk message parsed by hand: its data a view of the received message's bytes (protobuf's parser would copy
    them twice). Reads like the parsed message (`WhichOneof("kind")`, `.chunk.seq`, `.chunk.data`)."""

    seq: int
    data: memoryview

    @property
    def chunk(self) -> RawChunk:
        return self

    def WhichOneof(self, _group: str) -> str:  # noqa: N802 - protobuf's name
        return "chunk"


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """(value, position after it); (-1, pos) for a varint that runs past the end or over 10 bytes."""
    value = shift = 0
    for end in range(pos, min(len(data), pos + 10)):
        byte = data[end]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, end + 1
        shift += 7
    return -1, pos


def parse_chunk(data: bytes) -> RawChunk | None:
    """The chunk of a message framed as `chunk_message` frames it (protobuf's own bytes for it); None for any other
    message, which protobuf's parser then reads (a chunk framed otherwise included)."""
    if data[:1] != _CHUNK_FIELD:
        return None
    length, pos = _read_varint(data, 1)
    if length < 0 or pos + length != len(data):
        return None
    seq = 0
    if data[pos : pos + 1] == _SEQ_FIELD:
        seq, pos = _read_varint(data, pos + 1)
        if seq < 0 or seq >= 1 << 32:
            return None
    if pos == len(data):
        return RawChunk(seq, memoryview(b""))
    if data[pos : pos + 1] != _CHUNK_FIELD:
        return None
    size, pos = _read_varint(data, pos + 1)
    if size < 0 or pos + size != len(data):
        return None
    return RawChunk(seq, memoryview(data)[pos:])


def parsing_chunks(from_string: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """A deserializer for a message type whose oneof holds `Chunk chunk = 2`: chunk messages by hand (`RawChunk`),
    anything else by protobuf."""

    def parse(data: bytes) -> Any:
        return parse_chunk(data) or from_string(data)

    return parse


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


def upload_call(channel: grpc.Channel, method: str) -> grpc.StreamUnaryMultiCallable:
    """A client-streaming Coordinator method ("SubmitUpdate", "UploadSynthetic", "UploadMeanData") taking its header
    message and chunk messages already serialized by `chunk_message`."""
    from fedsynth.v1 import coordinator_pb2 as pb

    request, reply = {"SubmitUpdate": (pb.UpdateChunk, pb.SubmitReply), "UploadSynthetic": (pb.SyntheticChunk, pb.UploadReply),
                      "UploadMeanData": (pb.MeanDataChunk, pb.UploadReply)}[method]
    return channel.stream_unary(f"/fedsynth.v1.Coordinator/{method}", request_serializer=passthrough(request.SerializeToString),
                                response_deserializer=reply.FromString)


def submit_update_call(channel: grpc.Channel) -> grpc.StreamUnaryMultiCallable:
    """Coordinator.SubmitUpdate taking UpdateChunk messages or chunk messages already serialized by `chunk_message`."""
    return upload_call(channel, "SubmitUpdate")


def subscribe_call(channel: grpc.Channel) -> grpc.UnaryStreamMultiCallable:
    """Coordinator.Subscribe whose chunk messages arrive as `RawChunk`s (views of the received bytes, no copies)."""
    from fedsynth.v1 import coordinator_pb2 as pb

    return channel.unary_stream(
        "/fedsynth.v1.Coordinator/Subscribe",
        request_serializer=pb.SubscribeRequest.SerializeToString,
        response_deserializer=parsing_chunks(pb.ServerMessage.FromString),
    )
