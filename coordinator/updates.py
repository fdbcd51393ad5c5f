"""One client's update off the wire: received in place and hashed as it arrives, decoded as views of that one buffer,
validated against the global model's layout in the run's wire dtype."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from fedsynth.wire import codec, wire_dtype
from fedsynth.errors import WireError
from fedsynth.wire.tensor_buffer import decode_views
from fedsynth.wire.transfer import receive_into


@dataclass(frozen=True)
class ReceivedUpdate:
    """Tensors that are views of the received buffer: it lives exactly as long as they do. With `deltas`, the
    floating-point tensors of `state` are differences from the round's global model (see fedsynth.wire.wire_dtype)."""

    state: dict[str, torch.Tensor]
    extra: dict[str, torch.Tensor]
    num_bytes: int
    deltas: bool = False


@dataclass(frozen=True)
class UpdateLayout:
    """Everything an update may hold: the model's tensors and the algorithm's extras (fedsynth.algorithms.base
    .extra_layout), both in the wire dtype, and the longest safetensors header that describes them."""

    model: codec.Layout
    extra: codec.Layout
    max_header_bytes: int


def update_layout(model: codec.Layout, extra: codec.Layout) -> UpdateLayout:
    """The layout, with room for twice the header an encoder of it writes (names, dtypes, shapes, 20-digit offsets):
    a longer header is refused before it is parsed, whatever it holds (150,000 empty entries, or JSON nested 100,000
    deep, are ~1 MB and would cost seconds and hundreds of MB to expand)."""
    entry = '"{}/{}":{{"dtype":"BF16","shape":{},"data_offsets":[{},{}]}},'
    size = sum(len(entry.format(group, name, list(shape), 10**19, 10**19))
               for group, layout in (("model", model), ("extra", extra)) for name, (shape, _) in layout.items())
    return UpdateLayout(model, extra, max_header_bytes=2 * size + 4096)


def receive_update(
    meta: codec.PayloadMeta,
    chunks: Iterable[tuple[int, bytes]],
    *,
    max_bytes: int,
    layout: UpdateLayout,
    client_id: int,
    wire: str = "float32",
) -> ReceivedUpdate:
    """A verified update, or a WireError naming what is wrong; nothing is aggregated here.

    `layout` holds the global model's and the algorithm's extras in the wire dtype (`wire_dtype.expected_layout`):
    every floating-point tensor must arrive in the `wire` dtype exactly (a float32 update where float16 is configured is
    refused, and the reverse) and finite (a float16 overflow is inf); every integer tensor in its own dtype."""
    return decode_update(receive_into(meta, chunks, max_bytes=max_bytes), layout=layout, client_id=client_id, wire=wire)


def decode_update(buffer: torch.Tensor, *, layout: UpdateLayout, client_id: int, wire: str = "float32") -> ReceivedUpdate:
    """`receive_update` for a buffer already received and verified (the data plane's, or the gRPC chunks'): the
    whole update against the model's and the extras' layouts, before anyone is told it was taken."""
    groups = codec.split_prefixed(decode_views(buffer, max_header_bytes=layout.max_header_bytes))
    unknown = sorted(set(groups) - {"model", "extra"})
    if unknown:
        raise WireError(f"update carries unknown tensor groups {unknown}")
    state, extra = groups.get("model", {}), groups.get("extra", {})
    codec.check_like(state, layout.model, what=f"update from client {client_id}")
    codec.check_like(extra, layout.extra, what=f"update from client {client_id}: extra tensors")
    return ReceivedUpdate(state, extra, buffer.numel(), deltas=wire_dtype.sends_deltas(wire))


def check_integer_moves(update: ReceivedUpdate, global_state: dict[str, torch.Tensor], *, max_steps: int, client_id: int) -> None:
    """Integer tensors are counters a round of local training moves forward a bounded amount: BatchNorm's
    num_batches_tracked by at most `max_steps` (one per training forward pass), any other integer tensor not at all.
    WireError naming the tensor otherwise (SCAFFOLD once folded an int64 of 2^62 into its control variate)."""
    for name, value in update.state.items():
        if value.is_floating_point():
            continue
        moved = value.to(torch.int64) - global_state[name].to(torch.int64)
        low, high = (int(moved.min()), int(moved.max())) if moved.numel() else (0, 0)
        limit = max_steps if name.endswith("num_batches_tracked") else 0
        if low < 0 or high > limit:
            raise WireError(f"update from client {client_id}: integer tensor {name!r} moved by {low if low < 0 else high} "
                            f"in one round; at most {limit} (a round's training steps) is possible")


def local_state(update: ReceivedUpdate, global_state: dict[str, torch.Tensor], keys: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The client's new weights themselves (only `keys` when given): the update's own tensors, or, for an update of
    deltas, float32 weights rebuilt from the global state (a copy: only SDA-FL's pseudo-labels and FedGen's heads
    need one)."""
    if update.deltas:
        return wire_dtype.absolute(update.state, global_state, keys)
    return update.state if keys is None else {key: update.state[key] for key in keys}


def check_reports(header: dict[str, Any], *, client_id: int) -> None:
    """The numbers a client reports beside its update, which go into report.json: times finite and >= 0, its training
    loss finite (NaN: no step taken). WireError naming the field otherwise."""
    times = {"train_seconds": header["train_seconds"]}
    if header["generation"]:
        times["generation.wall_seconds"] = header["generation"]["wall_seconds"]
    for name, value in times.items():
        if not math.isfinite(value) or value < 0:
            raise WireError(f"update from client {client_id}: {name} = {value!r}; must be a finite number >= 0")
    if math.isinf(header["train_loss"]):
        raise WireError(f"update from client {client_id}: train_loss = {header['train_loss']!r}; must be finite (or NaN: no step)")


def header_fields(h: Any) -> dict[str, Any]:
    """An UpdateHeader as the plain dict Federation.accept_update reads (from the gRPC stream or the data plane)."""
    return {
        "client_id": h.client_id,
        "session": h.session,
        "round": h.round,
        "task_id": h.task_id,
        "total_bytes": h.payload.total_bytes,
        "sha256": h.payload.sha256,
        "xxh3_128": h.payload.xxh3_128,
        "num_chunks": h.payload.num_chunks,
        "train_seconds": h.train_seconds,
        "train_loss": h.train_loss,
        "generation": (
            {"images": h.generation.images, "wall_seconds": h.generation.wall_seconds, "cache_hit": h.generation.cache_hit}
            if h.HasField("generation") else None
        ),
    }
