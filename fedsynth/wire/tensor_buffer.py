"""Safetensors written into, and read as views out of, one uint8 buffer: one copy to encode, none to decode.

The format is safetensors' own (8-byte little-endian header length, JSON header, raw little-endian data), so
`safetensors.torch.load` reads what `encode_to_buffer` writes and the reverse. Decoding parses only the JSON
header, checks it as strictly as safetensors does, and returns tensors that share the buffer's memory.
"""

from __future__ import annotations

import json
import mmap
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from fedsynth.errors import WireError

MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}
HUGE_PAGE_BYTES = 2 << 20


def fresh_buffer(size: int) -> torch.Tensor:
    """An uninitialized 1-D uint8 tensor for a payload.

    A large one is private anonymous memory aligned to and advised for 2 MiB pages: the first write into fresh 4 KiB
    pages (one fault each) cost as much as the copy itself (measured: filling 45 MB took 20-35 ms in torch.empty,
    7-10 ms here). The tensor holds the mapping; it is unmapped when the last view of it is gone.
    """
    region = _huge_page_region(size)
    if region is None:
        return torch.empty(size, dtype=torch.uint8)
    return _over(region, size)


def _huge_page_region(size: int) -> mmap.mmap | None:
    """Anonymous memory for `size` bytes advised for 2 MiB pages, with room to align; None where small or unsupported."""
    if size < HUGE_PAGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        region = mmap.mmap(-1, size + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE)
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # no mapping or no advice here: plain memory works too, only slower to fill
        return None
    return region


def _over(region: mmap.mmap, size: int) -> torch.Tensor:
    """A uint8 tensor of `size` bytes over `region`, starting at its first 2 MiB boundary (the tensor holds the region)."""
    start = -torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE_BYTES
    return torch.frombuffer(region, dtype=torch.uint8, count=size, offset=start)


class ReceiveBuffers:
    """Payload buffers handed out again once no tensor over them is alive.

    A payload is received into fresh memory every round otherwise, and fresh memory costs its page faults on first
    write (measured, ResNet-18's 44.7 MB in 1 MiB chunks, copied and hashed: 5.1 ms into fresh 2 MiB pages, 3.3 ms into
    a reused buffer, on a quiet machine; with 4 KiB pages or under load the faults cost more). A buffer is reused only for a payload of exactly its size, and only when no tensor, view or
    array of it is left (its region's reference count says so: every tensor over it holds the region), so a holder
    that keeps views (a held update, a kept global state) makes the next payload take fresh memory, never its bytes.
    At most `keep` regions are kept; a new one replaces a free one of another size, and is not kept while all are busy.
    """

    def __init__(self, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self._lock = threading.Lock()
        self._regions: list[tuple[int, mmap.mmap]] = []
        self.reused = 0  # payloads received into a kept buffer since start

    def take(self, size: int) -> torch.Tensor:
        """An uninitialized uint8 tensor of `size` bytes: a free kept buffer of that size, or fresh memory."""
        with self._lock:
            # a kept region is referenced by its tuple here (and by getrefcount's argument); a tensor's storage adds one
            free = [i for i in range(len(self._regions)) if sys.getrefcount(self._regions[i][1]) == 2]
            for i in free:
                kept, region = self._regions[i]
                if kept == size:
                    self.reused += 1
                    return _over(region, size)
            region = _huge_page_region(size)
            if region is None:
                return torch.empty(size, dtype=torch.uint8)
            if len(self._regions) < self.keep:
                self._regions.append((size, region))
            elif free:
                self._regions[free[0]] = (size, region)
            return _over(region, size)


def _layout(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> tuple[bytes, list[tuple[torch.Tensor, int]]]:
    """safetensors' framing of `tensors`: the 8-byte length and JSON header, and each tensor (CPU, contiguous) with its
    offset in the data section."""
    flat = {name: value.detach().to("cpu").contiguous() for name, value in tensors.items()}
    # Widest dtypes first (as safetensors orders them), so every tensor starts at a multiple of its item size.
    order = sorted(flat, key=lambda name: (-flat[name].element_size(), name))
    header: dict[str, Any] = {} if metadata is None else {"__metadata__": metadata}
    placed: list[tuple[torch.Tensor, int]] = []
    offset = 0
    for name in order:
        value = flat[name]
        if value.dtype not in _NAMES:
            raise ValueError(f"tensor {name!r} has dtype {value.dtype}, which the wire format does not carry")
        size = value.numel() * value.element_size()
        header[name] = {"dtype": _NAMES[value.dtype], "shape": list(value.shape), "data_offsets": [offset, offset + size]}
        placed.append((value, offset))
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned, as in safetensors' own files
    return len(text).to_bytes(8, "little") + text, placed


def _bytes_of(value: torch.Tensor) -> memoryview:
    return memoryview(value.reshape(-1).view(torch.uint8).numpy())


def encode_to_buffer(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The tensors as safetensors bytes in one new uint8 tensor (each tensor copied once, straight into place)."""
    head, placed = _layout(tensors)
    data_bytes = sum(value.numel() * value.element_size() for value, _ in placed)
    buffer = fresh_buffer(len(head) + data_bytes)
    raw = memoryview(buffer.numpy())
    raw[: len(head)] = head
    for value, offset in placed:
        start = len(head) + offset
        # A plain memcpy: torch's copy_ splits large copies over its intra-op threads, which on a busy machine
        # wait for cores (measured several times slower with 2 threads than this).
        raw[start : start + value.numel() * value.element_size()] = _bytes_of(value)
    return buffer


def encode_parts(tensors: dict[str, torch.Tensor]) -> list[memoryview]:
    """The bytes `encode_to_buffer` would write, in order, without copying them: safetensors' head, then each tensor's
    own memory (a sender sends and hashes them piece by piece; the tensors must not change until it is done)."""
    head, placed = _layout(tensors)
    return [memoryview(head)] + [_bytes_of(value) for value, _ in placed]


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """A safetensors file (what `safetensors.torch.load_file` reads) written tensor by tensor from the tensors' own
    memory: safetensors' `save_file` first turns every tensor into a bytes copy, a second model held for the write."""
    head, placed = _layout(tensors, metadata)
    with open(path, "wb") as handle:
        handle.write(head)
        for value, _ in placed:
            handle.write(_bytes_of(value))


def decode_views(buffer: torch.Tensor, *, max_header_bytes: int = MAX_HEADER_BYTES) -> dict[str, torch.Tensor]:
    """The tensors a safetensors buffer (uint8, 1-D) holds, as views of it; WireError naming what is malformed.
    `max_header_bytes`: a longer JSON header is refused before it is parsed (a peer's update: its layout's size)."""
    if sys.byteorder != "little":  # views would read little-endian data as native: let safetensors convert
        from fedsynth.wire.codec import decode

        return decode(bytes(buffer.numpy()))
    entries, start = _entries(buffer, max_header_bytes)
    tensors = {}
    for name, dtype, shape, begin, end in entries:
        raw = buffer[start + begin : start + end]
        if raw.storage_offset() % dtype.itemsize:
            raw = raw.clone()  # an unaligned tensor from another encoder: the one case that copies
        if dtype == torch.bool and raw.numel() and int(raw.max()) > 1:
            raise _malformed(f"tensor {name!r} is BOOL but holds bytes other than 0 and 1")
        try:
            tensors[name] = raw.view(dtype).view(shape)
        except (RuntimeError, ValueError) as exc:
            raise _malformed(f"tensor {name!r}: {exc}") from exc
    return tensors


def _entries(buffer: torch.Tensor, max_header_bytes: int) -> tuple[list[tuple[str, torch.dtype, list[int], int, int]], int]:
    """(name, dtype, shape, begin, end) per tensor, sorted by offset, and where the data starts; checked like safetensors."""
    total = buffer.numel()
    if total < 8:
        raise _malformed(f"{total} bytes hold no header length")
    raw = memoryview(buffer.numpy())
    header_len = int.from_bytes(raw[:8], "little")
    if header_len > max_header_bytes:
        raise _malformed(f"header of {header_len} bytes exceeds the limit of {max_header_bytes}")
    if 8 + header_len > total:
        raise _malformed(f"header length {header_len} does not fit in {total} bytes")
    try:
        header = json.loads(str(raw[8 : 8 + header_len], "utf-8"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, ValueError) as exc:
        raise _malformed(f"header is not JSON: {exc}") from exc
    except RecursionError:
        raise _malformed("header nests deeper than a JSON parser follows") from None
    if not isinstance(header, dict):
        raise _malformed("header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _malformed("__metadata__ is not a map of strings")
    entries = sorted((_entry(name, info) for name, info in header.items()), key=lambda e: (e[3], e[4]))
    expected = 0
    for name, _dtype, _shape, begin, end in entries:
        if begin != expected:
            raise _malformed(f"tensor {name!r} starts at {begin}, expected {expected} (offsets must tile the data)")
        expected = end
    if 8 + header_len + expected != total:
        raise _malformed(f"the tensors cover {expected} bytes of data but {total - 8 - header_len} follow the header")
    return entries, 8 + header_len


def _entry(name: str, info: Any) -> tuple[str, torch.dtype, list[int], int, int]:
    if not isinstance(info, dict) or set(info) != _ENTRY_KEYS:
        raise _malformed(f"tensor {name!r} is not described by exactly {sorted(_ENTRY_KEYS)}")
    dtype = _DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    if dtype is None:
        raise _malformed(f"tensor {name!r} has unsupported dtype {info['dtype']!r}")
    shape, offsets = info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or not all(_is_count(d) and d < 1 << 62 for d in shape):
        raise _malformed(f"tensor {name!r} has shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets)) and offsets[0] <= offsets[1]):
        raise _malformed(f"tensor {name!r} has data_offsets {offsets!r}")
    numel = 1
    for d in shape:
        numel *= d
    if numel * dtype.itemsize != offsets[1] - offsets[0]:
        raise _malformed(f"tensor {name!r} of shape {shape} and dtype {info['dtype']} spans {offsets[1] - offsets[0]} bytes")
    return name, dtype, shape, offsets[0], offsets[1]


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("duplicate key in the header")
    return result


def _malformed(reason: str) -> WireError:
    return WireError(f"payload is not valid safetensors ({reason[:200]})")
