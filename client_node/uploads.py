"""How a client streams an upload to the coordinator (an update, SDA-FL's synthetic samples, FedMix's means): its
header message, then the payload's chunk messages framed by hand from the bytes' own memory (one copy each), the
XXH3-128 announced in the header; retried while the link is down."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import grpc

from fedsynth.wire import codec, grpcutil
from fedsynth.wire.transfer import chunk_messages, describe_parts
from fedsynth.v1 import coordinator_pb2 as pb


def payload_message(meta: codec.PayloadMeta) -> pb.Payload:
    return pb.Payload(total_bytes=meta.total_bytes, sha256=meta.sha256, num_chunks=meta.num_chunks, xxh3_128=meta.xxh3_128)


def stream_upload(call: grpc.StreamUnaryMultiCallable, header_for: Callable[[codec.PayloadMeta, bytes], Any],
                  parts: Sequence[memoryview], *, timeout_s: float, what: str, inline: bool = False) -> Any:
    """Send `header_for(meta, inline_bytes)` (the stream's opening message), then the chunk messages of `parts` (flat
    byte views, e.g. `tensor_buffer.encode_parts`; they must not change until the call returns) and return the reply.
    With `inline`, a payload that fits one chunk travels in the header instead (0 chunks announced, nothing follows)."""
    meta = describe_parts(parts)
    inline_bytes = b""
    if inline and meta.num_chunks == 1:
        meta, inline_bytes = replace(meta, num_chunks=0), b"".join(parts)
    header = header_for(meta, inline_bytes)

    def messages() -> Iterator[Any]:
        yield header
        if not inline_bytes:
            yield from chunk_messages(parts)

    return grpcutil.call_with_retry(lambda: call(messages(), timeout=timeout_s), deadline_s=timeout_s, what=what)
