"""Tensors on the wire: safetensors bytes in chunks with a checksum (XXH3-128, or an older sender's SHA-256), and validation against a template.

Never pickle, never torch.load: safetensors parses only a JSON header and raw little-endian buffers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fedsynth.errors import WireError

CHUNK_BYTES = 1 << 20  # 1 MiB: well under gRPC's 4 MiB default message limit
MAX_PAYLOAD_BYTES = 2 << 30  # refuse transfers over 2 GiB outright


def encode(tensors: dict[str, torch.Tensor]) -> bytes:
    return st_save({k: v.detach().contiguous().cpu() for k, v in tensors.items()})


def decode(data: bytes) -> dict[str, torch.Tensor]:
    try:
        return st_load(data)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise WireError(f"payload is not valid safetensors ({str(exc)[:200]})") from exc


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def split(data: bytes, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[int, bytes]]:
    """(seq, bytes) pieces; zero-copy slices of one memoryview."""
    view = memoryview(data)
    for seq, start in enumerate(range(0, len(data), chunk_bytes)):
        yield seq, bytes(view[start : start + chunk_bytes])


def num_chunks(total_bytes: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    return (total_bytes + chunk_bytes - 1) // chunk_bytes


@dataclass(frozen=True)
class PayloadMeta:
    """A payload as its header announces it: size, chunk count and checksums (a receiver checks the XXH3-128 when
    announced, else the SHA-256; fedsynth.wire.transfer)."""

    total_bytes: int
    sha256: str
    num_chunks: int
    xxh3_128: bytes = b""


def meta_of(payload: Any) -> PayloadMeta:
    """The PayloadMeta of a `Payload` message (fedsynth.v1)."""
    return PayloadMeta(payload.total_bytes, payload.sha256, payload.num_chunks, payload.xxh3_128)


class Checksum:
    """The digest a receiver checks, fed as bytes arrive: the XXH3-128 when announced, else the SHA-256 (an older
    sender's); WireError when neither is (why XXH3 is enough: fedsynth.wire.transfer)."""

    def __init__(self, meta: PayloadMeta) -> None:
        if meta.xxh3_128:
            self.hasher: Any = xxhash.xxh3_128()
            self.announced = meta.xxh3_128.hex()
        elif meta.sha256:
            self.hasher, self.announced = hashlib.sha256(), meta.sha256
        else:
            raise WireError("the payload announces no checksum (neither xxh3_128 nor sha256)")

    def check(self) -> None:
        got = self.hasher.hexdigest()
        if got != self.announced:
            raise WireError(f"payload checksum {got[:12]}… does not match the announced {self.announced[:12]}…")


def describe(data: bytes) -> PayloadMeta:
    return PayloadMeta(len(data), sha256(data), num_chunks(len(data)))


def assemble(meta: PayloadMeta, chunks: Iterable[tuple[int, bytes]], *, max_bytes: int = MAX_PAYLOAD_BYTES) -> bytes:
    """Join chunks that must arrive in order (0, 1, ...), to the announced size and checksum."""
    if meta.total_bytes > max_bytes:
        raise WireError(f"announced payload of {meta.total_bytes} bytes exceeds the limit of {max_bytes}")
    if meta.num_chunks != num_chunks(meta.total_bytes):
        raise WireError(f"announced {meta.num_chunks} chunks for {meta.total_bytes} bytes; expected {num_chunks(meta.total_bytes)}")
    digest = Checksum(meta)
    pieces: list[bytes] = []
    received = expected = 0
    for seq, data in chunks:
        if seq != expected:
            raise WireError(f"chunk {seq} arrived where chunk {expected} was expected")
        if len(data) > CHUNK_BYTES or received + len(data) > meta.total_bytes:
            raise WireError(f"chunk {seq} overruns the announced {meta.total_bytes} bytes")
        digest.hasher.update(data)  # hash while the stream is still arriving, join once at the end
        pieces.append(data)
        received += len(data)
        expected += 1
    if received != meta.total_bytes:
        raise WireError(f"payload ended after {received} of {meta.total_bytes} bytes ({expected} chunks)")
    digest.check()
    return b"".join(pieces)


Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]  # name -> (shape, dtype): what a state dict must match


def layout_of(tensors: dict[str, torch.Tensor]) -> Layout:
    """The (shape, dtype) of each tensor: built once per model, so that checking a state dict allocates nothing."""
    return {name: (tuple(value.shape), value.dtype) for name, value in tensors.items()}


def check_like(received: dict[str, torch.Tensor], layout: Layout, *, what: str) -> None:
    """Same keys, shapes and dtypes as the layout, and every float finite.

    The whole payload is checked in a few passes (`all_finite_many`); only a payload that fails is walked tensor by
    tensor, in the layout's order, so the error names the same first defect as a tensor-by-tensor check would."""
    if received.keys() != layout.keys():
        missing = sorted(set(layout) - set(received))
        extra = sorted(set(received) - set(layout))
        raise WireError(f"{what}: missing tensors {missing[:5]} / unexpected tensors {extra[:5]}")
    fits = all(tuple(received[name].shape) == shape and received[name].dtype == dtype for name, (shape, dtype) in layout.items())
    if fits and all_finite_many(received.values()):
        return
    for name, (shape, dtype) in layout.items():
        got = received[name]
        if tuple(got.shape) != shape:
            raise WireError(f"{what}: tensor {name!r} has shape {tuple(got.shape)}, expected {shape}")
        if got.dtype != dtype:
            raise WireError(f"{what}: tensor {name!r} has dtype {got.dtype}, expected {dtype}")
        if got.is_floating_point() and not all_finite(got):
            raise WireError(f"{what}: tensor {name!r} contains NaN or Inf")
    raise WireError(f"{what}: a tensor contains NaN or Inf")  # not reached: the walk names the defect


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or infinity. A finite sum proves it: a NaN or an infinity among the terms leaves every partial sum NaN or
    infinite (nothing cancels an infinity into a finite number). A sum that is not finite is settled exactly by the
    extremes (NaN propagates to both and an infinity is one), since large finite values can overflow it. The sum is
    one fast pass (ResNet-18's 11 M floats: 1.6 ms, the extremes 5.6 ms); neither allocates a boolean per element as
    isfinite(...).all() does (53 ms)."""
    if tensor.numel() == 0:
        return True
    if bool(torch.isfinite(tensor.sum())):
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def all_finite_many(tensors: Iterable[torch.Tensor]) -> bool:
    """`all_finite` of every floating-point tensor, one pass per run of same-dtype tensors that lie back to back in
    one storage (the views of a received payload do: one or two runs for a whole model).

    Why not tensor by tensor: each torch call lets go of the GIL, and while other threads run Python (the coordinator
    receiving other uploads, a node's other clients) each call waits up to the interpreter's switch interval (5 ms)
    to get it back. For ResNet-18's 122 tensors beside three threads running Python: 0.33 s tensor by tensor, 0.02 s
    in runs (benchmarks/gil_convoy.py)."""
    return all(all_finite(run) for run in _contiguous_runs([t for t in tensors if t.is_floating_point() and t.numel()]))


def _contiguous_runs(tensors: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The tensors as flat tensors covering the same elements, neighbours in memory joined into one."""
    tensors = sorted(tensors, key=lambda t: t.data_ptr())
    start = 0
    for i, tensor in enumerate(tensors):
        last = i + 1 == len(tensors)
        if last or not _adjacent(tensor, tensors[i + 1]):
            head = tensors[start]
            if i == start:
                yield tensor
            else:
                end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
                yield head.as_strided(((end - head.data_ptr()) // head.element_size(),), (1,))
            start = i + 1


def _adjacent(first: torch.Tensor, second: torch.Tensor) -> bool:
    return (first.dtype == second.dtype and first.is_contiguous() and second.is_contiguous()
            and first.device == second.device
            and first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
            and first.data_ptr() + first.numel() * first.element_size() == second.data_ptr())


def join_prefixed(**groups: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{"model": {...}, "extra": {...}} -> {"model/k": v, "extra/k": v}: several dicts in one transfer."""
    return {f"{group}/{key}": value for group, tensors in groups.items() for key, value in tensors.items()}


def split_prefixed(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        group, sep, key = name.partition("/")
        if not sep:
            raise WireError(f"tensor name {name!r} has no group prefix")
        groups.setdefault(group, {})[key] = value
    return groups
