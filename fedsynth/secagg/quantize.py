"""Fixed-point quantisation of weighted client updates into Z_{2^32}, sized so that a round's sum cannot wrap."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedsynth.secagg.errors import SecAggError

INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class QuantRange:
    """One round's fixed-point range: each client clips its values to [-clip, clip], multiplies them by its integer
    weight N_k and by `scale` = (2**31 - 1) / (clip * total_weight), where total_weight is the sum of the sampled
    clients' N_k, and rounds half to even.

    Why the sum never wraps: client k's element is further held within +-floor(N_k * (2**31 - 1) / total_weight)
    (rounding alone could add 1/2 per client), and these bounds of clients whose weights sum to at most total_weight
    add up to at most 2**31 - 1. So the signed sum of the survivors' elements fits int32, and the uint32 sum modulo
    2**32, read as two's complement, is that signed sum exactly."""

    clip: float
    total_weight: int

    def __post_init__(self) -> None:
        if not (isinstance(self.clip, (int, float)) and math.isfinite(self.clip) and self.clip > 0):
            raise SecAggError(f"clip must be a finite number > 0, not {self.clip!r}")
        if isinstance(self.total_weight, bool) or not isinstance(self.total_weight, int) or not 1 <= self.total_weight <= INT32_MAX:
            raise SecAggError(f"total_weight must be an integer in [1, 2**31 - 1], not {self.total_weight!r}")

    @property
    def scale(self) -> float:
        return INT32_MAX / (self.clip * self.total_weight)


def _check_weight(weight: int, quant: QuantRange) -> None:
    if isinstance(weight, bool) or not isinstance(weight, int) or not 1 <= weight <= quant.total_weight:
        raise SecAggError(f"weight {weight!r} is outside [1, total_weight={quant.total_weight}]")


def encode(values: np.ndarray, weight: int, quant: QuantRange) -> np.ndarray:
    """One client's `values` (1-D floats) clipped, times `weight` and the scale, rounded, as uint32 modulo 2**32."""
    _check_weight(weight, quant)
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 1:
        raise SecAggError(f"values must be one-dimensional, not of shape {values.shape}")
    finite = np.isfinite(values)
    if not finite.all():
        index = int(np.flatnonzero(~finite)[0])
        raise SecAggError(f"values[{index}] is {values[index]}, not finite")
    bound = weight * INT32_MAX // quant.total_weight
    scaled = np.rint(np.clip(values, -quant.clip, quant.clip) * (weight * quant.scale))
    return np.clip(scaled, -bound, bound).astype(np.int32).view(np.uint32)


def with_weight(encoded: np.ndarray, weight: int) -> np.ndarray:
    """`encoded` with the client's weight appended as one more uint32 element, masked with the rest, so that the
    secure sum also yields the survivors' total weight (the divisor of an exact weighted mean; see decode_mean)."""
    return np.append(encoded.astype(np.uint32, copy=False), np.uint32(weight))


def decode_sum(total: np.ndarray, quant: QuantRange) -> np.ndarray:
    """The weighted sum of the clients' clipped values, from the uint32 sum of their `encode` outputs."""
    if not isinstance(total, np.ndarray) or total.dtype != np.uint32 or total.ndim != 1:
        raise SecAggError(f"a quantised sum must be a 1-D uint32 array, not {getattr(total, 'dtype', type(total))}")
    return total.view(np.int32).astype(np.float64) / quant.scale


def decode_mean(total: np.ndarray, quant: QuantRange) -> tuple[np.ndarray, int]:
    """The survivors' weighted mean and their total weight, from the uint32 sum of their `with_weight` vectors."""
    if not isinstance(total, np.ndarray) or total.dtype != np.uint32 or total.ndim != 1 or len(total) < 1:
        raise SecAggError("a quantised sum with weight must be a non-empty 1-D uint32 array")
    weight = int(total[-1])
    if not 1 <= weight <= quant.total_weight:
        raise SecAggError(f"summed weight {weight} is outside [1, total_weight={quant.total_weight}]")
    return decode_sum(total[:-1], quant) / weight, weight
