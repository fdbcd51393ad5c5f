"""Robust aggregation (train.aggregation): the coordinate-wise median, the trimmed mean, Krum and Multi-Krum.

`RobustAggregator` has the interface the coordinator uses of `fedsynth.algorithms.base.Aggregator` (`add`, `count`,
`total_weight`, `finish`), but where the mean folds each update into a running sum, every robust rule needs the
round's updates side by side. It holds each update as ONE flat float32 vector of its floating-point tensors, as
absolute weights (global + delta for a delta update; global + scale * (x - global) for a clipped one), copied out of
the receive buffer the coordinator reuses. Memory: n x d x 4 bytes for a round of n updates of a model with d
floating-point elements (ResNet-18, d = 11.2M: 45 MiB an update, 0.9 GiB for 20), plus d x 4 for the result and
O(n x 2^20) float64 scratch while finishing; Krum's distances add O(n^2). Integer tensors (BatchNorm's
num_batches_tracked) are kept apart, tiny, and get the N_k-weighted mean rounded to the nearest integer, as in the
base class.

The rules, n the round's updates:
- "median": the coordinate-wise median, UNWEIGHTED (N_k is self-reported; a weight would let one client move the
  median); the mean of the two middle values when n is even.
- "trimmed_mean": per coordinate, drop the k = floor(beta * n) largest and k smallest values and average the rest,
  UNWEIGHTED (same reason). beta = aggregation_params.beta, default 0.1; with k = 0 (n < 1 / beta) it is the plain
  unweighted mean, and a warning says so.
- "krum" (Blanchard et al., NeurIPS 2017): the update with the smallest sum of squared L2 distances to its n - f - 2
  nearest others; the new global model is that update.
- "multi_krum": the m updates with the smallest Krum scores, averaged N_k-weighted; m = aggregation_params.m, 0
  (default) = n - f.
f = aggregation_params.f, the attackers assumed; 0 (default) = the most the round allows, floor((n - 3) / 2). Krum
needs n > 2f + 2: a round with too few updates for the configured f (clients dropped out, updates refused) does not
end the run; it uses f = floor((n - 3) / 2) and logs a warning naming both (and, for n <= 2, that Krum cannot tell
updates apart). Likewise m > n - f becomes n - f, with a warning.

Distances are computed in float64 by the Gram trick over column chunks, centred on one of the updates (distances do
not depend on the centre; centring keeps the cancellation at the size of the updates, not of the weights).

Order: the result does not depend on the order the updates arrived in. At `finish` the updates are put in a
canonical order (by weight, then the float64 sum of the vector, then its bytes where those tie),
and every rule runs in that order; Krum's and Multi-Krum's score ties break by the lower canonical position.

Only algorithms whose server side is the plain weighted mean of the models, with no extra tensors and no server
state, may use a robust rule (PLAIN_MEAN_ALGORITHMS; the config check refuses the others): an update with a non-empty
extra is refused (WireError).
"""

from __future__ import annotations

import logging
import math
import numbers
from typing import TYPE_CHECKING, Any

import torch

from fedsynth.algorithms.base import StateDict, check_same_layout
from fedsynth.algorithms.user_dp import UserDpAggregator, UserLevelDp
from fedsynth.config_schema import AGGREGATION_DEFAULTS, AGGREGATION_PARAMS, AGGREGATIONS
from fedsynth.errors import ConfigError, WireError

if TYPE_CHECKING:
    from fedsynth.algorithms.base import Algorithm
    from fedsynth.config import TrainConfig

log = logging.getLogger(__name__)

ROBUST_RULES = tuple(rule for rule in AGGREGATIONS if rule != "mean")
# The algorithms whose server side is the plain N_k-weighted mean of the models (fedsynth.config's check holds the same
# names): a robust rule replaces that mean and nothing else.
PLAIN_MEAN_ALGORITHMS = ("fedavg", "fedprox", "moon")
CHUNK_ELEMENTS = 1 << 20  # float64 scratch while finishing: n updates x (CHUNK_ELEMENTS / n) columns at a time


def aggregator_for(train_cfg: TrainConfig, algorithm: Algorithm, global_state: StateDict, server_state: StateDict, *,
                   user_dp: UserLevelDp | None = None, round_number: int = 0) -> Any:
    """The round's aggregator: DP-FedAvg's noisy mean under train.dp = "user" (`user_dp`), the algorithm's own for
    train.aggregation = "mean", else a RobustAggregator (typed Any: coordinator.rounds.RoundInProgress declares an
    Aggregator, whose interface both have; RobustAggregator is no subclass, which would allocate the running float64
    sum it never uses)."""
    if user_dp is not None:  # RunConfig.check allows it with the plain-mean algorithms and train.aggregation = "mean" only
        if algorithm.name not in PLAIN_MEAN_ALGORITHMS or train_cfg.aggregation != "mean":
            raise ConfigError(f"train.dp = \"user\" needs train.algorithm in {', '.join(PLAIN_MEAN_ALGORITHMS)} and "
                              f"train.aggregation = \"mean\", got {algorithm.name!r} and {train_cfg.aggregation!r}")
        return UserDpAggregator(global_state, server_state, dp=user_dp, round_number=round_number)
    if train_cfg.aggregation == "mean":
        return algorithm.new_aggregator(global_state, server_state)
    if algorithm.name not in PLAIN_MEAN_ALGORITHMS:
        raise ConfigError(f"train.aggregation = {train_cfg.aggregation!r} needs train.algorithm in "
                          f"{', '.join(PLAIN_MEAN_ALGORITHMS)}, got {algorithm.name!r}")
    return RobustAggregator(global_state, server_state, rule=train_cfg.aggregation, params=train_cfg.aggregation_params)


class RobustAggregator:
    """One round's updates held whole, aggregated at `finish` by `rule` (see the module docstring)."""

    def __init__(self, global_state: StateDict, server_state: StateDict | None = None, *, rule: str,
                 params: dict[str, int | float] | None = None) -> None:
        if rule not in ROBUST_RULES:
            raise ConfigError(f"train.aggregation must be one of {', '.join(ROBUST_RULES)} here, got {rule!r}")
        params = dict(params or {})
        for name, value in params.items():
            bound = AGGREGATION_PARAMS[rule].get(name)
            if bound is None:
                raise ConfigError(f"train.aggregation_params.{name}: {rule!r} has no such parameter "
                                  f"(accepted: {', '.join(AGGREGATION_PARAMS[rule]) or 'none'})")
            if not bound.accepts(value):
                raise ConfigError(f"train.aggregation_params.{name} must be {bound} for {rule}, got {value!r}")
        self.rule = rule
        params = {**AGGREGATION_DEFAULTS[rule], **params}
        self.beta = float(params.get("beta", 0.0))
        self.f = int(params.get("f", 0))
        self.m = int(params.get("m", 0))
        self._template = {key: (value.dtype, tuple(value.shape)) for key, value in global_state.items()}
        self._floats = [key for key, value in global_state.items() if value.is_floating_point()]
        self._integers = [key for key in global_state if key not in self._floats]
        self._numel = sum(global_state[key].numel() for key in self._floats)
        self._global = global_state  # read only, for delta and clipped updates
        self._server_state = dict(server_state or {})
        self._vectors: list[torch.Tensor] = []
        self._integer_values: list[StateDict] = []
        self._weights: list[float] = []
        self._sums: list[float] = []  # each vector's float64 sum: with the weight, its place in the canonical order
        self.selected: list[int] = []  # Krum / Multi-Krum: the chosen updates' canonical positions (after finish)
        self.effective: dict[str, int] = {}  # the f (and m) the last finish used

    @property
    def count(self) -> int:
        return len(self._vectors)

    @property
    def total_weight(self) -> float:
        return float(sum(self._weights))

    def add(self, state: StateDict, extra: StateDict, weight: float, *, layout_checked: bool = False, deltas: bool = False,
            scale: float = 1.0) -> None:
        """Copy one client's update, as absolute float32 weights, out of `state` (which the caller may reuse after).

        deltas: the floating-point tensors are differences from the global state (integer ones stay absolute).
        scale: in (0, 1]; below 1 the update is held as global + scale * (x - global) (clipped); integers in full."""
        if isinstance(weight, bool) or not (isinstance(weight, numbers.Real) and math.isfinite(weight) and weight > 0):
            raise ValueError(f"aggregation weight must be a finite number > 0, got {weight!r}")
        if not 0 < scale <= 1:
            raise ValueError(f"an update's scale must be in (0, 1], got {scale!r}")
        if extra:
            raise WireError(f"train.aggregation = {self.rule!r} aggregates models only; this update carries extra "
                            f"tensors {sorted(extra)[:5]}")
        if not layout_checked:
            check_same_layout(state, self._template, what="client state")
        vector = torch.empty(self._numel, dtype=torch.float32)
        start = 0
        with torch.no_grad():
            for key in self._floats:
                value = state[key].reshape(-1)
                size = value.numel()
                out = vector[start : start + size]
                if not deltas and scale == 1:
                    out.copy_(value)
                else:
                    base = self._global[key].reshape(-1)
                    for lo in range(0, size, CHUNK_ELEMENTS):  # float64 a piece at a time: global + scale * difference
                        hi = min(size, lo + CHUNK_ELEMENTS)
                        g = base[lo:hi].to("cpu", torch.float64)
                        x = value[lo:hi].to("cpu", torch.float64)
                        diff = x if deltas else x - g
                        out[lo:hi].copy_(g + diff * scale if scale != 1 else g + diff)
                start += size
        self._vectors.append(vector)
        self._integer_values.append({key: state[key].to("cpu", copy=True) for key in self._integers})
        self._weights.append(float(weight))
        self._sums.append(float(vector.sum(dtype=torch.float64)))

    def finish(self) -> tuple[StateDict, StateDict]:
        """(new global state with the template's dtypes and shapes, the server state unchanged)."""
        n = self.count
        if n == 0:
            raise ValueError("cannot aggregate a round with zero client updates")
        order = sorted(range(n), key=lambda i: (self._weights[i], self._sums[i],
                                                 self._vectors[i].numpy().tobytes() if self._ties(i) else b""))
        vectors = [self._vectors[i] for i in order]
        weights = [self._weights[i] for i in order]
        if self.rule == "median":
            flat = _coordinatewise(vectors, _median)
        elif self.rule == "trimmed_mean":
            k = math.floor(self.beta * n)
            if k == 0:
                log.warning("trimmed_mean: a round of n=%d updates with beta=%g trims floor(beta * n) = 0 values per "
                            "end: the plain unweighted mean", n, self.beta)
            self.effective = {"k": k}
            flat = _coordinatewise(vectors, lambda s: s[k : n - k].to(torch.float64).mean(dim=0))
        else:
            flat = self._krum(vectors, weights)
        return self._unflatten(flat), self._server_state

    def _ties(self, i: int) -> bool:
        """Whether update i shares its weight and sum with another (then its bytes decide the order)."""
        key = (self._weights[i], self._sums[i])
        return sum((w, total) == key for w, total in zip(self._weights, self._sums)) > 1

    def _krum(self, vectors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
        n = len(vectors)
        most = max(0, (n - 3) // 2)
        f = most if self.f == 0 else min(self.f, most)
        if self.f > most:
            log.warning("%s: train.aggregation_params.f=%d needs n > 2f + 2 updates, the round has n=%d: using f=%d",
                        self.rule, self.f, n, f)
        if n <= 2:
            log.warning("%s: a round of n=%d updates: Krum cannot tell them apart (it needs n >= 3); the tie rule "
                        "(canonical order) picks", self.rule, n)
        neighbours = max(1, n - f - 2) if n > 1 else 0
        scores = krum_scores(vectors, neighbours)
        ranked = sorted(range(n), key=lambda i: (scores[i], i))
        if self.rule == "krum":
            self.selected = ranked[:1]
            self.effective = {"f": f}
            return vectors[ranked[0]].clone()
        m = n - f if self.m == 0 else min(self.m, n - f)
        if self.m > n - f:
            log.warning("multi_krum: train.aggregation_params.m=%d is more than n - f = %d - %d: using m=%d", self.m, n, f, m)
        self.selected = sorted(ranked[:m])
        self.effective = {"f": f, "m": m}
        chosen = [vectors[i] for i in self.selected]
        w = torch.tensor([weights[i] for i in self.selected], dtype=torch.float64)
        return _coordinatewise(chosen, lambda s: (s * w[:, None]).sum(dim=0) / w.sum(), sort=False)

    def _unflatten(self, flat: torch.Tensor) -> StateDict:
        result: StateDict = {}
        start = 0
        for key in self._floats:
            dtype, shape = self._template[key]
            size = math.prod(shape)
            result[key] = flat[start : start + size].view(shape).to(dtype)
            start += size
        total = sum(self._weights)
        for key in self._integers:
            dtype, shape = self._template[key]
            summed = torch.zeros(shape, dtype=torch.float64)
            for values, weight in sorted(zip(self._integer_values, self._weights), key=lambda vw: (vw[1], vw[0][key].tolist())):
                summed += weight * values[key].to(torch.float64)
            result[key] = torch.round(summed / total).to(dtype)
        return {key: result[key] for key in self._template}


def krum_scores(vectors: list[torch.Tensor], neighbours: int) -> list[float]:
    """Each vector's sum of squared L2 distances to its `neighbours` nearest others (float64, Gram trick by chunks)."""
    n = len(vectors)
    gram = torch.zeros(n, n, dtype=torch.float64)
    d = vectors[0].numel()
    step = max(1, CHUNK_ELEMENTS // n)
    for lo in range(0, d, step):
        hi = min(d, lo + step)
        block = torch.stack([v[lo:hi] for v in vectors]).to(torch.float64)
        block -= block[0].clone()  # centred on the first (canonical) update: distances unchanged
        gram += block @ block.T
    gram = (gram + gram.T) / 2  # exactly symmetric: d(i, j) == d(j, i) to the bit
    norms = gram.diagonal()
    distances = (norms[:, None] + norms[None, :] - 2 * gram).clamp_(min=0)
    distances.fill_diagonal_(math.inf)
    nearest = torch.sort(distances, dim=1).values[:, :neighbours]
    return [float(s) for s in nearest.sum(dim=1)] if neighbours else [0.0] * n


def _median(sorted_block: torch.Tensor) -> torch.Tensor:
    n = sorted_block.shape[0]
    if n % 2:
        return sorted_block[n // 2]
    return (sorted_block[n // 2 - 1].to(torch.float64) + sorted_block[n // 2].to(torch.float64)) / 2


def _coordinatewise(vectors: list[torch.Tensor], reduce: Any, *, sort: bool = True) -> torch.Tensor:
    """float32 vector: reduce(block) column chunk by column chunk, block = the n vectors' chunk (n x c): sorted along
    the updates, in float32 (exact), when `sort`; else as float64."""
    n, d = len(vectors), vectors[0].numel()
    out = torch.empty(d, dtype=torch.float32)
    step = max(1, CHUNK_ELEMENTS // n)
    for lo in range(0, d, step):
        hi = min(d, lo + step)
        block = torch.stack([v[lo:hi] for v in vectors])
        block = torch.sort(block, dim=0).values if sort else block.to(torch.float64)
        out[lo:hi] = reduce(block)
    return out


__all__ = ["PLAIN_MEAN_ALGORITHMS", "ROBUST_RULES", "RobustAggregator", "aggregator_for", "krum_scores"]
