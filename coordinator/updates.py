"""One client's update off the wire: received in place and hashed as it arrives, decoded as views of that one buffer,
validated against the global model's layout in the run's wire dtype."""

from __future__ import annotations

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


def receive_update(
    meta: codec.PayloadMeta,
    chunks: Iterable[tuple[int, bytes]],
    *,
    max_bytes: int,
    layout: codec.Layout,
    client_id: int,
    wire: str = "float32",
) -> ReceivedUpdate:
    """A verified update, or a WireError naming what is wrong; nothing is aggregated here.

    `layout` is the global model's in the wire dtype (`wire_dtype.expected_layout`): every floating-point tensor must
    arrive in the `wire` dtype exactly (a float32 update where float16 is configured is refused, and the reverse) and
    finite (a float16 overflow is inf)."""
    return decode_update(receive_into(meta, chunks, max_bytes=max_bytes), layout=layout, client_id=client_id, wire=wire)


def decode_update(buffer: torch.Tensor, *, layout: codec.Layout, client_id: int, wire: str = "float32") -> ReceivedUpdate:
    """`receive_update` for a buffer already received and verified (the data plane's, or the gRPC chunks')."""
    groups = codec.split_prefixed(decode_views(buffer))
    unknown = sorted(set(groups) - {"model", "extra"})
    if unknown:
        raise WireError(f"update carries unknown tensor groups {unknown}")
    state, extra = groups.get("model", {}), groups.get("extra", {})
    codec.check_like(state, layout, what=f"update from client {client_id}")
    expected = wire_dtype.torch_dtype(wire)
    floats = [tensor for tensor in extra.values() if tensor.is_floating_point()]
    if any(tensor.dtype != expected for tensor in floats) or not codec.all_finite_many(floats):
        for name, tensor in extra.items():  # a refused update only: name its first defect
            if tensor.is_floating_point() and tensor.dtype != expected:
                raise WireError(f"update from client {client_id}: extra tensor {name!r} has dtype {tensor.dtype}, expected {expected}")
            if tensor.is_floating_point() and not codec.all_finite(tensor):
                raise WireError(f"update: extra tensor {name!r} contains NaN or Inf")
    return ReceivedUpdate(state, extra, buffer.numel(), deltas=wire_dtype.sends_deltas(wire))


def local_state(update: ReceivedUpdate, global_state: dict[str, torch.Tensor], keys: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The client's new weights themselves (only `keys` when given): the update's own tensors, or, for an update of
    deltas, float32 weights rebuilt from the global state (a copy: only SDA-FL's pseudo-labels and FedGen's heads
    need one)."""
    if update.deltas:
        return wire_dtype.absolute(update.state, global_state, keys)
    return update.state if keys is None else {key: update.state[key] for key in keys}


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
