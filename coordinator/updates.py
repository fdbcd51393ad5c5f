"""One client's update off the wire: received in place and hashed as it arrives, decoded as views of that one buffer,
validated against the global model."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from fedsynth import codec
from fedsynth.errors import WireError
from fedsynth.tensor_buffer import decode_views
from fedsynth.transfer import receive_into


@dataclass(frozen=True)
class ReceivedUpdate:
    """Tensors that are views of the received buffer: it lives exactly as long as they do."""

    state: dict[str, torch.Tensor]
    extra: dict[str, torch.Tensor]
    num_bytes: int


def receive_update(
    meta: codec.PayloadMeta,
    chunks: Iterable[tuple[int, bytes]],
    *,
    max_bytes: int,
    template: dict[str, torch.Tensor],
    client_id: int,
) -> ReceivedUpdate:
    """A verified update, or a WireError naming what is wrong; nothing is aggregated here."""
    buffer = receive_into(meta, chunks, max_bytes=max_bytes)
    groups = codec.split_prefixed(decode_views(buffer))
    unknown = sorted(set(groups) - {"model", "extra"})
    if unknown:
        raise WireError(f"update carries unknown tensor groups {unknown}")
    state, extra = groups.get("model", {}), groups.get("extra", {})
    codec.check_like(state, template, what=f"update from client {client_id}")
    for name, tensor in extra.items():
        if tensor.is_floating_point() and not codec.all_finite(tensor):
            raise WireError(f"update: extra tensor {name!r} contains NaN or Inf")
    return ReceivedUpdate(state, extra, buffer.numel())
