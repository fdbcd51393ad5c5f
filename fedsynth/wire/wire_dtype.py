"""runtime.wire_dtype: the dtype of a client update's floating-point tensors on the wire (the broadcast stays float32)."""

from __future__ import annotations

import torch

from fedsynth.wire.codec import Layout
from fedsynth.config_schema import WIRE_DTYPES

StateDict = dict[str, torch.Tensor]
DTYPES: dict[str, torch.dtype] = dict(zip(WIRE_DTYPES, (torch.float32, torch.float16, torch.bfloat16)))


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name]


def sends_deltas(name: str) -> bool:
    """Whether floating-point model tensors travel as differences from the global model (any dtype but float32).

    float16 / bfloat16 keep ~3 / ~2 significant digits: of an absolute weight that loses most of one local step
    (measured on ResNet-18, benchmarks/wire_dtype_rounding.py); of a delta, which is orders of magnitude smaller
    than the weight it moves, only a rounding of the step itself."""
    return DTYPES[name] != torch.float32


def outgoing(state: StateDict, extra: StateDict, global_state: StateDict, name: str) -> tuple[StateDict, StateDict]:
    """The client's (model, extra) groups as they go on the wire; unchanged at float32. Otherwise floating-point model
    tensors become (local - global) rounded once to the wire dtype; float extras (SCAFFOLD's delta c_i, a
    difference already, as large as the model) are cast as they are; integer tensors (BatchNorm's
    num_batches_tracked) travel unchanged and absolute."""
    if not sends_deltas(name):
        return state, extra
    dtype = DTYPES[name]
    model = {key: (value - global_state[key]).to(dtype) if value.is_floating_point() else value for key, value in state.items()}
    return model, {key: value.to(dtype) if value.is_floating_point() else value for key, value in extra.items()}


def expected_layout(layout: Layout, name: str) -> Layout:
    """The model's layout with its floating-point tensors in the wire dtype: what an update must match."""
    dtype = DTYPES[name]
    return {key: (shape, dtype if kind.is_floating_point else kind) for key, (shape, kind) in layout.items()}


def absolute(state: StateDict, global_state: StateDict, keys: list[str] | None = None) -> StateDict:
    """Float32 local weights back from deltas (for the server parts that need a client's model itself: SDA-FL's
    pseudo-labels, FedGen's heads); only `keys` when given."""
    wanted = state if keys is None else {key: state[key] for key in keys}
    return {key: global_state[key] + value if value.is_floating_point() else value.clone() for key, value in wanted.items()}
