"""The federated-algorithm interface, the client's update record and the streaming weighted-mean aggregator."""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from fedsynth.wire.codec import all_finite
from fedsynth.config_schema import check_parameter
from fedsynth.errors import WireError
from fedsynth.wire.tensor_buffer import fresh_buffer
from fedsynth.learning.training import LocalTrainConfig, TrainData

StateDict = dict[str, torch.Tensor]
FOLD_SCRATCH_ELEMENTS = 1 << 20  # 8 MiB of float64: an update is upcast this much at a time, by each folding thread
FOLD_THREADS = 2


@dataclass
class ClientUpdate:
    """What one client's round produces.

    state: the new local weights, the full state_dict (buffers included), detached CPU copies.
    extra: algorithm tensors that travel to the server with the model (SCAFFOLD's delta c_i).
    client_state: what the client keeps for its next round (SCAFFOLD's c_i, MOON's previous model).
    """

    state: StateDict
    extra: StateDict = field(default_factory=dict)
    client_state: StateDict = field(default_factory=dict)
    num_steps: int = 0
    train_loss: float = float("nan")


class Algorithm(Protocol):
    """One federated algorithm: the client's local update and the server's aggregation rule."""

    name: str

    def client_update(
        self,
        *,
        model: nn.Module,
        data: TrainData,
        cfg: LocalTrainConfig,
        server_extra: StateDict,
        client_state: StateDict,
        generator: torch.Generator,
    ) -> ClientUpdate:
        """Train `model` (already loaded with the global weights) in place and report the result."""
        ...

    def new_aggregator(self, global_state: StateDict, server_state: StateDict) -> Aggregator:
        """A fresh streaming aggregator for one round, given the round's global weights and server state."""
        ...

    def initial_server_state(self, global_state: StateDict) -> StateDict:
        """The server state before round 1 (empty for algorithms that keep none)."""
        ...

    def server_extra(self, server_state: StateDict) -> StateDict:
        """The tensors sent to every sampled client along with the global model."""
        ...


def extra_layout(algorithm: Any, model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors a client of `algorithm` sends beside its model (name -> (shape, dtype), before the wire dtype): its
    `client_extra_layout(model)` where it declares one (SCAFFOLD's delta c), else none. The coordinator checks every
    update against it before it acknowledges the update."""
    own = getattr(algorithm, "client_extra_layout", None)
    return {} if own is None else dict(own(model))


def check_parameters(algorithm: Any) -> None:
    """Each parameter (dataclass field) of `algorithm` within its bound in fedsynth.config_schema.ALGORITHM_PARAMS,
    the bounds the config check applies too; else ConfigError naming the parameter."""
    for f in dataclasses.fields(algorithm):
        check_parameter(algorithm.name, f.name, getattr(algorithm, f.name), key=f.name)


class WeightedMeanServer:
    """The server side of algorithms that aggregate by the plain N_k-weighted mean and keep no server state."""

    def new_aggregator(self, global_state: StateDict, server_state: StateDict) -> Aggregator:
        return Aggregator(global_state, server_state)

    def initial_server_state(self, global_state: StateDict) -> StateDict:
        return {}

    def server_extra(self, server_state: StateDict) -> StateDict:
        return {}


def snapshot_state(model: nn.Module) -> StateDict:
    """Detached CPU copies of the full state_dict, safe to keep after the model trains on."""
    return {key: value.detach().to("cpu", copy=True) for key, value in model.state_dict().items()}


class Aggregator:
    """Running N_k-weighted mean of client states: one float64 accumulator per state key, never K models.

    `add` checks that every update has exactly the template's keys and shapes and finite values
    (WireError naming the key otherwise), since the states arrive from peers; an update's dtypes may
    differ from the template's (everything is summed in float64). `finish` divides by the total
    weight and casts back to the template's dtypes. Integer buffers (BatchNorm's
    num_batches_tracked) get the weighted mean rounded to the nearest integer.

    An update sent as deltas (runtime.wire_dtype float16 / bfloat16) has its floating-point tensors
    summed as they are; the global state is added back once, times those updates' total weight, in
    the mean. An update added with `scale` < 1 (clipped: coordinator.update_norms) moves the global
    state `scale` times as far as it would: its floating-point differences from the global state,
    and its extra tensors, are scaled.

    Subclasses extend `add_extra` / `finish_server_state` for algorithm tensors (SCAFFOLD); the base
    class rejects any non-empty `extra` and returns the server state unchanged.
    """

    def __init__(self, global_state: StateDict, server_state: StateDict | None = None) -> None:
        self._template = {key: (value.dtype, tuple(value.shape)) for key, value in global_state.items()}
        self._sums = float64_zeros({key: shape for key, (_, shape) in self._template.items()})
        self._scratches: list[torch.Tensor] = []  # where `fold` upcasts an update, a group of tensors at a time
        self._global = global_state  # a reference (the round holds it anyway), read only for delta and clipped updates
        self._server_state = dict(server_state or {})
        self._total_weight = 0.0
        self._global_weight = 0.0  # how many times the global state is added back into the floats' sum (delta and clipped updates)
        self._count = 0

    @property
    def count(self) -> int:
        """Number of updates added so far."""
        return self._count

    @property
    def total_weight(self) -> float:
        return self._total_weight

    def add(self, state: StateDict, extra: StateDict, weight: float, *, layout_checked: bool = False, deltas: bool = False,
            scale: float = 1.0) -> None:
        """Fold one client's state (weighted by its original dataset size N_k) into the running sum.

        layout_checked: the caller has already run `codec.check_like` against this round's global state (same keys,
        shapes and dtypes, all finite), a superset of this layout check, which is then not repeated.
        deltas: the floating-point tensors are differences from the global state (integer ones stay absolute).
        scale: in (0, 1]; below 1 the update's floating-point differences from the global state (and its extra
        tensors) count `scale` times (a clipped update); integer tensors count in full."""
        if isinstance(weight, bool) or not (isinstance(weight, numbers.Real) and math.isfinite(weight) and weight > 0):
            raise ValueError(f"aggregation weight must be a finite number > 0, got {weight!r}")
        if not 0 < scale <= 1:
            raise ValueError(f"an update's scale must be in (0, 1], got {scale!r}")
        if not layout_checked:
            check_same_layout(state, self._template, what="client state")
        self.add_extra(extra if scale == 1 else {key: value * scale if value.is_floating_point() else value for key, value in extra.items()})
        values = {key: _on_cpu(value) for key, value in state.items()}
        if not self._scratches:
            self._scratches = fold_scratches(sum(total.numel() for total in self._sums.values()))
        with torch.no_grad():
            if scale == 1:
                fold(self._sums, values, float(weight), self._scratches)
            else:  # sum += w * (global + scale * (x - global)): the global part joins the one added back in the mean
                integers = {key: value for key, value in values.items() if not value.is_floating_point()}
                fold(self._sums, {key: value for key, value in values.items() if key not in integers}, weight * scale, self._scratches)
                if integers:
                    fold(self._sums, integers, float(weight), self._scratches)
        self._total_weight += float(weight)
        if deltas:
            self._global_weight += float(weight)
        elif scale != 1:
            self._global_weight += float(weight) * (1 - scale)
        self._count += 1

    def add_extra(self, extra: StateDict) -> None:
        """Check, then fold, the algorithm's extra tensors; raises before it changes anything (add relies on it)."""
        if extra:
            raise WireError(f"this algorithm expects no extra tensors, got {sorted(extra)[:5]}")

    def finish(self) -> tuple[StateDict, StateDict]:
        """(new global state with the template's dtypes and shapes, new server state)."""
        if self._count == 0:
            raise ValueError("cannot aggregate a round with zero client updates")
        return self.weighted_mean(), self.finish_server_state()

    def weighted_mean(self) -> StateDict:
        mean = {}
        for key in self._sums:
            dtype = self._template[key][0]
            value = self.mean64(key)
            if not (dtype.is_floating_point or dtype.is_complex):
                value = torch.round(value)
            mean[key] = value.to(dtype)
        return mean

    def mean64(self, key: str) -> torch.Tensor:
        """The float64 weighted mean of one key, delta updates moved back onto the global state."""
        total = self._sums[key]
        if self._global_weight and self._template[key][0].is_floating_point:
            total = total + self._global_weight * self._global[key].to("cpu", torch.float64)
        return total / self._total_weight

    def finish_server_state(self) -> StateDict:
        return self._server_state


def float64_zeros(shapes: dict[str, tuple[int, ...]]) -> StateDict:
    """float64 zeros of these shapes, views of one `fresh_buffer`: a model's worth of them in 2 MiB pages, whose faults
    cost a fraction of 4 KiB pages' (zeroing ResNet-18's sum at a round's start: ~25 ms in torch.zeros, tensor by tensor)."""
    sizes = [math.prod(shape) for shape in shapes.values()]
    flat = fresh_buffer(8 * sum(sizes)).view(torch.float64).zero_()
    starts = itertools.accumulate(sizes, initial=0)
    return {key: flat[start : start + size].view(shape) for (key, shape), start, size in zip(shapes.items(), starts, sizes)}


def fold(sums: StateDict, values: StateDict, weight: float, scratches: Sequence[torch.Tensor]) -> None:
    """sums[key] += weight * values[key] for every key of `values`, in float64: each value upcast (exactly) into a
    float64 scratch, then added, a group of flat pieces that fills the scratch at a time (two torch calls a group).
    The groups are shared out among len(scratches) threads, the caller and helpers (`_fold_helpers`); an element-wise
    sum, so the same bits whoever adds which group (ResNet-18 on two idle cores: 11 ms instead of 17).

    Why not one torch._foreach_add_ of the values as they are: torch upcasts each into a temporary the size of the
    tensor, and where large blocks are fresh mappings (fedsynth.process.allocator, the coordinator) every temporary faults its
    pages in: ResNet-18's fold took 34 ms that way (benchmarks/fold.py). Why not one call per tensor: see
    codec.all_finite_many. A float16 update is never held as float32 or float64 as a whole."""
    groups = _groups(sums, values, scratches[0].numel())
    shares = [groups[i :: len(scratches)] for i in range(len(scratches))]
    helpers = [_fold_helpers().submit(_fold_groups, share, weight, scratch) for share, scratch in zip(shares[1:], scratches[1:]) if share]
    try:
        _fold_groups(shares[0], weight, scratches[0])
    finally:
        for helper in helpers:
            helper.result()


def fold_scratches(numel: int) -> list[torch.Tensor]:
    """The float64 scratches `fold` needs for a model of `numel` elements: one per folding thread (one for a model that
    fits one)."""
    size = max(1, min(FOLD_SCRATCH_ELEMENTS, numel))
    return [fresh_buffer(8 * size).view(torch.float64) for _ in range(FOLD_THREADS if numel > size else 1)]


_helpers: tuple[int, ThreadPoolExecutor] | None = None


def _fold_helpers() -> ThreadPoolExecutor:
    """The process's fold helper threads (made again in a forked child, which has none of its parent's threads)."""
    global _helpers
    if _helpers is None or _helpers[0] != os.getpid():
        _helpers = (os.getpid(), ThreadPoolExecutor(FOLD_THREADS - 1, thread_name_prefix="fold"))
    return _helpers[1]


Group = list[tuple[torch.Tensor, torch.Tensor]]  # (a flat piece of a sum, the same piece of the update)


def _groups(sums: StateDict, values: StateDict, limit: int) -> list[Group]:
    groups: list[Group] = [[]]
    used = 0
    for key, value in values.items():
        total, flat = sums[key].view(-1), value.reshape(-1)
        for start in range(0, flat.numel(), limit):
            piece = flat[start : start + limit]
            if used + piece.numel() > limit:
                groups.append([])
                used = 0
            groups[-1].append((total[start : start + piece.numel()], piece))
            used += piece.numel()
    return [group for group in groups if group]


def _fold_groups(groups: list[Group], weight: float, scratch: torch.Tensor) -> None:
    for group in groups:
        upcast = list(torch.split(scratch[: sum(piece.numel() for _, piece in group)], [piece.numel() for _, piece in group]))
        torch._foreach_copy_(upcast, [piece for _, piece in group])
        torch._foreach_add_([total for total, _ in group], upcast, alpha=weight)


def _on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.device.type == "cpu" else tensor.cpu()  # .cpu() of a CPU tensor is itself, but one more call


def check_same_layout(tensors: StateDict, template: dict[str, tuple[torch.dtype, tuple[int, ...]]], *, what: str) -> None:
    """WireError naming the first key that is missing, unexpected, of the wrong shape or not finite."""
    missing = template.keys() - tensors.keys()
    unexpected = tensors.keys() - template.keys()
    if missing or unexpected:
        raise WireError(f"{what}: missing keys {sorted(missing)[:5]}, unexpected keys {sorted(unexpected)[:5]}")
    for key, value in tensors.items():
        if tuple(value.shape) != template[key][1]:
            raise WireError(f"{what}: {key!r} has shape {tuple(value.shape)}, expected {template[key][1]}")
        if value.is_floating_point() and not all_finite(value):
            raise WireError(f"{what}: {key!r} holds NaN or infinite values")
