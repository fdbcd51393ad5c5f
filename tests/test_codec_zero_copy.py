"""The zero-copy payload path: one-buffer encode, in-place receive, views decode, hand-framed chunk messages."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import load_file

from fedsynth.wire import codec
from fedsynth.algorithms.base import Aggregator, fold
from fedsynth.errors import WireError
from fedsynth.wire.raw_messages import RawChunk, chunk_message, parse_chunk, parsing_chunks, passthrough, task_message
from fedsynth.wire.tensor_buffer import (
    HUGE_PAGE_BYTES, ReceiveBuffers, decode_views, encode_parts, encode_to_buffer, fresh_buffer, write_safetensors,
)
from fedsynth.wire.transfer import (
    byte_view, chunk_messages, chunk_views, describe_buffer, describe_parts, prepare, receive_inline, receive_into,
)
from fedsynth.v1 import coordinator_pb2 as pb

CHUNK = codec.CHUNK_BYTES
Chunks = list[tuple[int, bytes]]


def mixed_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model/conv.weight": torch.randn(4, 3, 3, 3, generator=g),
        "model/bn.num_batches_tracked": torch.tensor(7),
        "model/odd": torch.randn(3, generator=g).half(),
        "model/empty": torch.zeros(0, 5),
        "extra/bf16": torch.randn(5, generator=g).bfloat16(),
        "extra/bytes": torch.arange(5, dtype=torch.uint8),
        "extra/flags": torch.tensor([True, False, True]),
        "extra/f64": torch.randn(2, 2, generator=g, dtype=torch.float64),
    }


def payload_of(size: int) -> bytes:
    return bytes((i * 7919) % 251 for i in range(size))


def pieces(data: bytes, size: int = CHUNK) -> Chunks:
    return list(codec.split(data, size))


def as_buffer(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def shares_memory(view: torch.Tensor, buffer: torch.Tensor) -> bool:
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    return view.numel() == 0 or start <= view.data_ptr() < end


# ---- encode and decode --------------------------------------------------------------------------


def test_encoded_buffer_is_safetensors_both_ways() -> None:
    tensors = mixed_tensors()
    buffer = encode_to_buffer(tensors)
    loaded = st_load(bytes(byte_view(buffer)))  # safetensors' own reader accepts what we write
    views = decode_views(as_buffer(codec.encode(tensors)))  # and we read what safetensors writes
    for name, value in tensors.items():
        assert loaded[name].dtype == value.dtype and torch.equal(loaded[name], value), name
        assert views[name].dtype == value.dtype and torch.equal(views[name], value), name


def test_a_file_written_tensor_by_tensor_is_safetensors_with_its_metadata(tmp_path) -> None:
    """The coordinator's checkpoint writer: safetensors' own reader gets every tensor and the metadata back."""
    tensors = mixed_tensors()
    path = tmp_path / "checkpoint.safetensors"
    write_safetensors(path, tensors, {"completed_rounds": "3"})
    loaded = load_file(str(path))
    assert loaded.keys() == tensors.keys()
    for name, value in tensors.items():
        assert loaded[name].dtype == value.dtype and torch.equal(loaded[name], value), name
    with safe_open(str(path), "pt") as handle:
        assert handle.metadata() == {"completed_rounds": "3"}


def test_decoded_tensors_are_views_of_the_received_buffer() -> None:
    tensors = mixed_tensors()
    buffer = encode_to_buffer(tensors)
    views = decode_views(buffer)
    for name, value in views.items():
        assert shares_memory(value, buffer), name
        assert torch.equal(value, tensors[name]), name
    buffer.zero_()  # the same memory: no copy was made
    assert not views["model/conv.weight"].any()


def test_an_unaligned_tensor_from_another_encoder_is_read_correctly() -> None:
    value = torch.arange(6, dtype=torch.float32)
    header = {"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
              "b": {"dtype": "F32", "shape": [2, 3], "data_offsets": [1, 25]}}
    text = json.dumps(header).encode()
    data = len(text).to_bytes(8, "little") + text + b"\x05" + value.numpy().tobytes()
    views = decode_views(as_buffer(data))
    assert torch.equal(views["b"], value.view(2, 3)) and int(views["a"]) == 5


def raw_safetensors(header: object, data: bytes = b"", *, length: int | None = None) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return (len(text) if length is None else length).to_bytes(8, "little") + text + data


F32_2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
MALFORMED = {
    "garbage": b"\x93NUMPY not a safetensors file " * 40,
    "too short for a header length": b"\x01\x02",
    "header longer than the payload": raw_safetensors({"a": F32_2}, bytes(8), length=10**6),
    "header not JSON": raw_safetensors(b"{not json", bytes(8)),
    "header not an object": raw_safetensors([1, 2]),
    "duplicate tensor name": raw_safetensors(b'{"a":' + json.dumps(F32_2).encode() + b',"a":' + json.dumps(F32_2).encode() + b"}", bytes(8)),
    "unknown dtype": raw_safetensors({"a": {**F32_2, "dtype": "F128"}}, bytes(8)),
    "extra entry field": raw_safetensors({"a": {**F32_2, "offset": 3}}, bytes(8)),
    "negative dimension": raw_safetensors({"a": {**F32_2, "shape": [-2]}}, bytes(8)),
    "size disagrees with shape": raw_safetensors({"a": {**F32_2, "shape": [3]}}, bytes(8)),
    "reversed offsets": raw_safetensors({"a": {**F32_2, "data_offsets": [8, 0]}}, bytes(8)),
    "gap between tensors": raw_safetensors({"a": F32_2, "b": {**F32_2, "data_offsets": [12, 20]}}, bytes(20)),
    "overlapping tensors": raw_safetensors({"a": F32_2, "b": {**F32_2, "data_offsets": [4, 12]}}, bytes(12)),
    "trailing bytes": raw_safetensors({"a": F32_2}, bytes(12)),
    "data past the end": raw_safetensors({"a": F32_2}, bytes(4)),
    "bool other than 0 or 1": raw_safetensors({"a": {"dtype": "BOOL", "shape": [2], "data_offsets": [0, 2]}}, b"\x01\x02"),
    "metadata not strings": raw_safetensors({"__metadata__": {"k": 1}, "a": F32_2}, bytes(8)),
    "huge dimension of an empty tensor": raw_safetensors({"a": {"dtype": "F32", "shape": [0, 1 << 70], "data_offsets": [0, 0]}}),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_safetensors_is_refused_with_the_usual_message(name: str) -> None:
    with pytest.raises(WireError, match=r"^payload is not valid safetensors \("):
        decode_views(as_buffer(MALFORMED[name]))


def test_metadata_and_empty_payloads_decode() -> None:
    assert decode_views(as_buffer(raw_safetensors({"__metadata__": {"format": "pt"}}))) == {}
    assert decode_views(encode_to_buffer({})) == {}


# ---- chunk messages ------------------------------------------------------------------------------


@pytest.mark.parametrize("seq", [0, 1, 127, 128, 300, 2047])
@pytest.mark.parametrize("size", [0, 1, 127, 128, 16_384, CHUNK])
def test_hand_framed_chunk_messages_are_protobufs_own_bytes(seq: int, size: int) -> None:
    data = payload_of(size)
    framed = chunk_message(seq, memoryview(data))
    for wrapper in (pb.ServerMessage, pb.UpdateChunk, pb.SyntheticChunk, pb.MeanDataChunk):
        assert framed == wrapper(chunk=pb.Chunk(seq=seq, data=data)).SerializeToString(), wrapper.__name__
        parsed = wrapper.FromString(framed)
        assert parsed.WhichOneof("kind") == "chunk" and parsed.chunk.seq == seq and parsed.chunk.data == data
    by_hand = parse_chunk(framed)
    assert isinstance(by_hand, RawChunk) and by_hand.WhichOneof("kind") == "chunk"
    assert by_hand.chunk.seq == seq and bytes(by_hand.chunk.data) == data


@pytest.mark.parametrize("message", [
    pb.ServerMessage(heartbeat=pb.Heartbeat(unix_time=1.0)),
    pb.ServerMessage(task=pb.Task(round=1, task_id="t")),
    pb.UpdateChunk(header=pb.UpdateHeader(client_id=3)),
])
def test_messages_other_than_chunks_are_left_to_protobuf(message: object) -> None:
    framed = message.SerializeToString()  # type: ignore[attr-defined]
    assert parse_chunk(framed) is None
    assert parsing_chunks(type(message).FromString)(framed) == message


@pytest.mark.parametrize("framed", [
    b"\x12\x05\x08\x01\x12\x02ab",  # one byte short of what it announces
    b"\x12\x04\x08\x01\x12\x02abc",  # a byte more than it announces
    b"\x12\x80",  # a length that never ends
    b"\x12\x06\x12\x02ab\x08\x01",  # fields out of the usual order
])
def test_a_chunk_framed_otherwise_is_read_by_protobuf_or_refused(framed: bytes) -> None:
    assert parse_chunk(framed) is None

@pytest.mark.parametrize("size", [0, 1, 127, 128, 16_384, CHUNK])
@pytest.mark.parametrize("ticket", [b"", b"t" * 16])
def test_hand_framed_task_messages_are_protobufs_own_bytes(size: int, ticket: bytes) -> None:
    inline = payload_of(size)
    task = pb.Task(round=3, task_id="ab" * 8, deadline_s=60.0, generation_quota=[1, 0, 300], data_ticket=ticket,
                   payload=pb.Payload(total_bytes=size, sha256="f" * 64))
    framed = task_message(task.SerializeToString(), inline)
    whole = pb.Task()
    whole.CopyFrom(task)
    whole.inline_payload = inline
    assert framed == pb.ServerMessage(task=whole).SerializeToString()
    assert pb.ServerMessage.FromString(framed).task == whole


def test_passthrough_serializer_sends_bytes_as_they_are() -> None:
    serialize = passthrough(pb.UpdateChunk.SerializeToString)
    header = pb.UpdateChunk(header=pb.UpdateHeader(client_id=3))
    assert serialize(b"already serialized") == b"already serialized"
    assert serialize(header) == header.SerializeToString()


def test_prepared_payload_frames_every_chunk_once() -> None:
    data = payload_of(3 * CHUNK + 17)
    prepared = prepare(as_buffer(data))
    assert prepared.meta == codec.PayloadMeta(len(data), "", 4, xxhash.xxh3_128(data).digest())
    received = [pb.ServerMessage.FromString(m).chunk for m in prepared.messages]
    assert [c.seq for c in received] == [0, 1, 2, 3]
    assert b"".join(c.data for c in received) == data


def test_a_payload_that_fits_one_chunk_travels_inline_and_is_checked_as_a_chunk() -> None:
    data = payload_of(CHUNK - 5)
    prepared = prepare(as_buffer(data))
    assert prepared.ready and prepared.messages == () and prepared.inline == data
    meta = prepared.meta
    assert (meta.total_bytes, meta.num_chunks, meta.xxh3_128) == (len(data), 0, xxhash.xxh3_128(data).digest())
    assert bytes(receive_inline(meta, data).numpy()) == data
    with pytest.raises(WireError, match="checksum"):
        receive_inline(meta, data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(WireError, match="announces 0 chunks, not 1"):
        receive_inline(replace(meta, num_chunks=1), data)
    with pytest.raises(WireError, match=f"an inline payload holds 1 to {CHUNK} bytes; {CHUNK + 1} announced"):
        receive_inline(replace(meta, total_bytes=CHUNK + 1), data)
    with pytest.raises(WireError):  # fewer bytes than announced
        receive_inline(replace(meta, total_bytes=len(data) + 1), data)


# ---- receiving in place --------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK])
def test_receive_into_puts_every_byte_in_place_at_chunk_boundaries(size: int) -> None:
    data = payload_of(size)
    buffer = receive_into(codec.describe(data), pieces(data))
    assert buffer.dtype == torch.uint8 and buffer.numel() == size
    assert bytes(byte_view(buffer)) == data
    assert describe_buffer(buffer) == codec.PayloadMeta(size, "", codec.num_chunks(size), xxhash.xxh3_128(data).digest())
    assert [len(piece) for _, piece in chunk_views(buffer)] == [len(piece) for _, piece in pieces(data)]


def test_a_changed_byte_is_refused_by_whichever_checksum_is_announced() -> None:
    data = payload_of(2 * CHUNK + 5)
    bad = bytearray(data)
    bad[CHUNK + 3] ^= 1
    xxh3_only = describe_parts([memoryview(data)])
    sha256_only = codec.describe(data)  # an older sender's
    for meta in (xxh3_only, sha256_only, replace(sha256_only, xxh3_128=xxh3_only.xxh3_128)):
        assert bytes(byte_view(receive_into(meta, pieces(data)))) == data
        with pytest.raises(WireError, match="does not match the announced"):
            receive_into(meta, pieces(bytes(bad)))
    with pytest.raises(WireError, match="announces no checksum"):
        receive_into(replace(xxh3_only, xxh3_128=b""), pieces(data))


def test_chunk_messages_of_parts_frame_the_encoded_bytes_with_chunks_spanning_parts() -> None:
    tensors = {**mixed_tensors(), "model/big": torch.randn(300_000), "model/bigger": torch.randn(700_000)}
    parts = encode_parts(tensors)
    encoded = bytes(byte_view(encode_to_buffer(tensors)))
    assert describe_parts(parts) == describe_buffer(encode_to_buffer(tensors))
    chunks = [parse_chunk(message) for message in chunk_messages(parts)]
    assert [c.seq for c in chunks] == list(range(codec.num_chunks(len(encoded))))
    assert all(len(c.data) == CHUNK for c in chunks[:-1])
    assert b"".join(bytes(c.data) for c in chunks) == encoded


def test_small_chunks_are_accepted_too() -> None:
    data = payload_of(1000)
    assert bytes(byte_view(receive_into(codec.describe(data), pieces(data, 64)))) == data


def test_received_update_decodes_as_views_of_the_one_buffer() -> None:
    tensors = mixed_tensors()
    data = codec.encode(tensors)
    buffer = receive_into(codec.describe(data), pieces(data, 100))
    views = decode_views(buffer)
    assert all(shares_memory(v, buffer) for v in views.values())
    assert all(torch.equal(views[k], v) for k, v in tensors.items())


def drop_last(chunks: Chunks) -> Chunks:
    return chunks[:-1]


def swap_first(chunks: Chunks) -> Chunks:
    return [chunks[1], chunks[0], *chunks[2:]]


DATA = payload_of(2 * CHUNK + 10)
BAD: dict[str, tuple[codec.PayloadMeta, Callable[[Chunks], Chunks], int, str]] = {
    "short payload": (codec.describe(DATA), drop_last, codec.MAX_PAYLOAD_BYTES, "payload ended after"),
    "long payload": (codec.PayloadMeta(len(DATA) - 5, codec.sha256(DATA), 3), lambda c: c, codec.MAX_PAYLOAD_BYTES, "overruns the announced"),
    "oversized chunk": (codec.describe(DATA), lambda c: [(0, DATA[: CHUNK + 1])], codec.MAX_PAYLOAD_BYTES, "chunk 0 overruns"),
    "bad hash": (codec.PayloadMeta(len(DATA), "0" * 64, 3), lambda c: c, codec.MAX_PAYLOAD_BYTES, "does not match the announced 000000000000"),
    "wrong chunk order": (codec.describe(DATA), swap_first, codec.MAX_PAYLOAD_BYTES, "chunk 1 arrived where chunk 0 was expected"),
    "repeated chunk": (codec.describe(DATA), lambda c: [c[0], c[0], *c[1:]], codec.MAX_PAYLOAD_BYTES, "chunk 0 arrived where chunk 1"),
    "oversized announced total": (codec.PayloadMeta(10**12, "0" * 64, codec.num_chunks(10**12)), lambda c: c, codec.MAX_PAYLOAD_BYTES,
                                  "announced payload of 1000000000000 bytes exceeds the limit"),
    "over the caller's limit": (codec.describe(DATA), lambda c: c, len(DATA) - 1, "exceeds the limit of"),
    "wrong chunk count": (codec.PayloadMeta(len(DATA), codec.sha256(DATA), 9), lambda c: c, codec.MAX_PAYLOAD_BYTES, "announced 9 chunks"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_transfers_are_refused_exactly_as_assemble_refuses_them(name: str) -> None:
    meta, mangle, limit, text = BAD[name]
    with pytest.raises(WireError) as old:
        codec.assemble(meta, mangle(pieces(DATA)), max_bytes=limit)
    with pytest.raises(WireError) as new:
        receive_into(meta, mangle(pieces(DATA)), max_bytes=limit)
    assert str(new.value) == str(old.value)
    assert text in str(new.value)


def test_an_announced_size_allocates_nothing_before_the_chunks_come() -> None:
    meta = codec.PayloadMeta(1 << 30, hashlib.sha256(b"").hexdigest(), codec.num_chunks(1 << 30))
    with pytest.raises(WireError, match="payload ended after 0 of 1073741824 bytes"):
        receive_into(meta, [])


def test_fresh_buffers_outlive_their_mapping_through_their_views() -> None:
    buffer = fresh_buffer(HUGE_PAGE_BYTES + 3)
    buffer.fill_(9)
    tail = buffer[-3:]
    del buffer
    assert tail.tolist() == [9, 9, 9]
    assert fresh_buffer(0).numel() == 0 and fresh_buffer(5).numel() == 5


def test_receive_buffers_hand_a_buffer_out_again_only_once_nothing_of_it_is_alive() -> None:
    buffers = ReceiveBuffers(keep=2)
    size = HUGE_PAGE_BYTES + 5
    first = buffers.take(size)
    address = first.data_ptr()
    first.fill_(7)
    view, array = first[-3:], first.numpy()  # a view and an array of it: each keeps the memory busy
    del first
    held = buffers.take(size)
    assert held.data_ptr() != address and view.tolist() == [7, 7, 7] and buffers.reused == 0
    del view
    assert buffers.take(size).data_ptr() != address  # the array still holds it
    del array
    again = buffers.take(size)
    assert again.data_ptr() == address and buffers.reused == 1
    del again
    assert buffers.take(size + 1).data_ptr() != address  # another size: fresh memory, never a part of a kept buffer
    assert buffers.take(7).numel() == 7  # small payloads: plain memory, never kept


def test_receive_into_reuses_a_free_buffer_and_its_views_see_only_their_own_payload() -> None:
    buffers = ReceiveBuffers(keep=1)
    first, second = (torch.full((HUGE_PAGE_BYTES,), value, dtype=torch.uint8) for value in (1, 2))
    one = receive_into(describe_buffer(first), chunk_views(first), buffers=buffers)
    kept = one[:4]
    two = receive_into(describe_buffer(second), chunk_views(second), buffers=buffers)  # `one` is alive: fresh memory
    assert kept.tolist() == [1, 1, 1, 1] and torch.equal(two, second)
    address = one.data_ptr()
    del one, kept
    three = receive_into(describe_buffer(second), chunk_views(second), buffers=buffers)
    assert three.data_ptr() == address and torch.equal(three, second)


# ---- validation and folding ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_all_finite_agrees_with_isfinite(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    assert codec.all_finite(torch.zeros(0, dtype=dtype))
    for size in (1, 2, 17, 1000, 70_001):
        clean = torch.randn(size, generator=g).to(dtype)
        assert codec.all_finite(clean)
        for bad in (math.nan, math.inf, -math.inf):
            for where in {0, size // 2, size - 1}:
                dirty = clean.clone()
                dirty[where] = bad
                assert not codec.all_finite(dirty), (size, bad, where)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_all_finite_holds_for_large_finite_values_whose_sum_overflows(dtype: torch.dtype) -> None:
    """The fast path sums: a sum that overflows (or, with both signs, turns NaN) from finite values is no defect."""
    big = torch.finfo(dtype).max
    assert codec.all_finite(torch.full((1000,), big, dtype=dtype))
    assert codec.all_finite(torch.tensor([big, big, -big, -big] * 10, dtype=dtype))
    assert not codec.all_finite(torch.tensor([big, big, math.inf], dtype=dtype))
    assert not codec.all_finite(torch.tensor([math.inf, -math.inf], dtype=dtype))


def test_folding_a_checked_update_skips_only_the_repeated_check() -> None:
    g = torch.Generator().manual_seed(2)
    template = {"w": torch.randn(64, 9, generator=g), "n": torch.tensor(3)}
    updates = [{"w": torch.randn(64, 9, generator=g), "n": torch.tensor(i)} for i in range(3)]
    checked, trusted = Aggregator(template), Aggregator(template)
    for weight, update in zip((3.0, 1.0, 7.0), updates):
        checked.add(update, {}, weight)
        trusted.add(decode_views(encode_to_buffer(update)), {}, weight, layout_checked=True)
    for key, value in checked.finish()[0].items():
        assert torch.equal(trusted.finish()[0][key], value), key


def test_a_decoded_payload_is_checked_in_runs_and_every_bad_value_is_still_found() -> None:
    """all_finite_many joins a payload's back-to-back views into a few passes: a NaN or infinity anywhere, in any
    dtype run, at a tensor's edges, is found all the same; tensors that are not neighbours are checked on their own."""
    g = torch.Generator().manual_seed(5)
    tensors = {**mixed_tensors(), "model/conv.bias": torch.randn(4, generator=g), "model/fc.weight": torch.randn(10, 4, generator=g)}
    floats = [name for name, value in tensors.items() if value.is_floating_point() and value.numel()]
    views = decode_views(encode_to_buffer(tensors))
    assert codec.all_finite_many(views.values())
    runs = list(codec._contiguous_runs([views[name] for name in floats]))
    assert len(runs) < len(floats) and sum(run.numel() for run in runs) == sum(views[name].numel() for name in floats)
    for name in floats:
        for where in (0, -1):
            for bad in (math.nan, math.inf, -math.inf):
                dirty = decode_views(encode_to_buffer(tensors))
                dirty[name].view(-1)[where] = bad
                assert not codec.all_finite_many(dirty.values()), (name, where, bad)
    apart = {name: tensors[name].clone() for name in floats}  # separate storages: one run each
    assert codec.all_finite_many(apart.values())
    apart[floats[-1]].view(-1)[0] = math.nan
    assert not codec.all_finite_many(apart.values())


def test_check_like_names_the_first_defect_in_layout_order() -> None:
    """The whole-payload check passes or fails as the tensor-by-tensor one did, and a refusal names the same tensor."""
    g = torch.Generator().manual_seed(3)
    template = {"a": torch.randn(4, 3, generator=g), "b": torch.randn(5, generator=g), "c": torch.randn(2, 2, generator=g)}
    layout = codec.layout_of(template)
    nan_in_a = {**template, "a": template["a"].clone()}
    nan_in_a["a"][1, 1] = math.nan
    with pytest.raises(WireError, match="tensor 'a' contains NaN"):
        codec.check_like(decode_views(encode_to_buffer({**nan_in_a, "c": torch.randn(3, generator=g)})), layout, what="update")
    with pytest.raises(WireError, match="tensor 'c' has shape"):
        codec.check_like(decode_views(encode_to_buffer({**template, "c": torch.randn(3, generator=g)})), layout, what="update")
    with pytest.raises(WireError, match="tensor 'b' has dtype"):
        codec.check_like(decode_views(encode_to_buffer({**template, "b": template["b"].double()})), layout, what="update")
    codec.check_like(decode_views(encode_to_buffer(template)), layout, what="update")


def test_folding_through_a_small_scratch_gives_the_bits_of_folding_tensor_by_tensor() -> None:
    """`fold` upcasts through a scratch smaller than the tensors (split across groups, empty and integer ones among
    them): the sums are bit for bit those of an upcast-then-add per tensor."""
    g = torch.Generator().manual_seed(5)
    values = {"big": torch.randn(4, 9, generator=g), "empty": torch.empty(0), "half": torch.randn(6, generator=g).half(),
              "count": torch.tensor(7), "small": torch.randn(3, generator=g)}
    sums = {key: torch.randn(value.shape, generator=g, dtype=torch.float64) for key, value in values.items()}
    expected = {key: total.clone().add_(values[key].to(torch.float64), alpha=0.37) for key, total in sums.items()}
    for threads in (1, 2, 3):  # the groups shared out among threads: the same bits
        folded = {key: total.clone() for key, total in sums.items()}
        fold(folded, values, 0.37, [torch.empty(5, dtype=torch.float64) for _ in range(threads)])
        for key, total in expected.items():
            assert torch.equal(folded[key], total), (key, threads)


def test_folding_in_one_call_gives_the_bits_of_folding_tensor_by_tensor() -> None:
    """Aggregator.add folds all tensors with one torch call; the sum is the one an upcast-then-add per tensor gives."""
    g = torch.Generator().manual_seed(4)
    template = {"w": torch.randn(300, 7, generator=g), "b": torch.randn(7, generator=g).half(), "n": torch.tensor(3)}
    updates = [{"w": torch.randn(300, 7, generator=g), "b": torch.randn(7, generator=g).half(), "n": torch.tensor(i)} for i in range(4)]
    weights = (3.0, 1.0, 7.0, 0.3)
    aggregator = Aggregator(template)
    expected = {key: torch.zeros(value.shape, dtype=torch.float64) for key, value in template.items()}
    for weight, update in zip(weights, updates):
        aggregator.add(decode_views(encode_to_buffer(update)), {}, weight, layout_checked=True)
        for key, value in update.items():
            expected[key].add_(value.to(torch.float64), alpha=weight)
    for key, total in expected.items():
        assert torch.equal(aggregator._sums[key], total), key
