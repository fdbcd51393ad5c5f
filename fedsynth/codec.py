"""Tensors on the wire: safetensors bytes in chunks with a SHA-256, and validation against a template.

Never pickle, never torch.load: safetensors parses only a JSON header and raw little-endian buffers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
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
    total_bytes: int
    sha256: str
    num_chunks: int


def describe(data: bytes) -> PayloadMeta:
    return PayloadMeta(len(data), sha256(data), num_chunks(len(data)))


def assemble(meta: PayloadMeta, chunks: Iterable[tuple[int, bytes]], *, max_bytes: int = MAX_PAYLOAD_BYTES) -> bytes:
    """Join chunks that must arrive in order (0, 1, ...), to the announced size and checksum."""
    if meta.total_bytes > max_bytes:
        raise WireError(f"announced payload of {meta.total_bytes} bytes exceeds the limit of {max_bytes}")
    if meta.num_chunks != num_chunks(meta.total_bytes):
        raise WireError(f"announced {meta.num_chunks} chunks for {meta.total_bytes} bytes; expected {num_chunks(meta.total_bytes)}")
    digest = hashlib.sha256()
    pieces: list[bytes] = []
    received = expected = 0
    for seq, data in chunks:
        if seq != expected:
            raise WireError(f"chunk {seq} arrived where chunk {expected} was expected")
        if len(data) > CHUNK_BYTES or received + len(data) > meta.total_bytes:
            raise WireError(f"chunk {seq} overruns the announced {meta.total_bytes} bytes")
        digest.update(data)  # hash while the stream is still arriving, join once at the end
        pieces.append(data)
        received += len(data)
        expected += 1
    if received != meta.total_bytes:
        raise WireError(f"payload ended after {received} of {meta.total_bytes} bytes ({expected} chunks)")
    if digest.hexdigest() != meta.sha256:
        raise WireError(f"payload checksum {digest.hexdigest()[:12]}… does not match the announced {meta.sha256[:12]}…")
    return b"".join(pieces)


Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]  # name -> (shape, dtype): what a state dict must match


def layout_of(tensors: dict[str, torch.Tensor]) -> Layout:
    """The (shape, dtype) of each tensor: built once per model, so that checking a state dict allocates nothing."""
    return {name: (tuple(value.shape), value.dtype) for name, value in tensors.items()}


def check_like(received: dict[str, torch.Tensor], layout: Layout, *, what: str) -> None:
    """Same keys, shapes and dtypes as the layout, and every float finite."""
    if received.keys() != layout.keys():
        missing = sorted(set(layout) - set(received))
        extra = sorted(set(received) - set(layout))
        raise WireError(f"{what}: missing tensors {missing[:5]} / unexpected tensors {extra[:5]}")
    for name, (shape, dtype) in layout.items():
        got = received[name]
        if tuple(got.shape) != shape:
            raise WireError(f"{what}: tensor {name!r} has shape {tuple(got.shape)}, expected {shape}")
        if got.dtype != dtype:
            raise WireError(f"{what}: tensor {name!r} has dtype {got.dtype}, expected {dtype}")
        if got.is_floating_point() and not all_finite(got):
            raise WireError(f"{what}: tensor {name!r} contains NaN or Inf")


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or infinity: NaN propagates to both extremes and an infinity is one, so the extremes decide; one
    pass and no boolean copy (isfinite(...).all() allocates one byte per element)."""
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) & torch.isfinite(high))


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
