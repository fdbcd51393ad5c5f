"""A model update as the one vector secure aggregation masks: every floating-point element of the move from the
round's global model, by tensor name, then the algorithm's extra tensors (SCAFFOLD's delta c), then the client's
weight; and the round context both sides bind it to."""

from __future__ import annotations

import numpy as np

MASKED_KEY = "masked"  # the one tensor of a secure round's update: the masked uint32 vector, sent as int32


def round_context(run_id: str, round_number: int, task_id: str) -> bytes:
    """Binds every key, box and mask to this run, round and task (both sides derive it)."""
    return f"fedsynth-secagg/v1/{run_id}/{round_number}/{task_id}".encode()


def float_keys(template: dict) -> list[str]:
    """The tensors a secure round sums, by name: the order both sides flatten them in (a received state_dict's order is
    its encoding's, not the model's); integer buffers keep the global value."""
    return sorted(key for key, value in template.items() if value.is_floating_point())


def vector_length(template: dict, extra_sizes: dict[str, int] | None = None) -> int:
    """The masked vector's length: every floating-point element, every extra element (name -> numel), the weight."""
    return sum(template[key].numel() for key in float_keys(template)) + sum((extra_sizes or {}).values()) + 1


def flat_extra(extra: dict) -> np.ndarray:
    """The extra tensors (SCAFFOLD's delta c), flattened by name, as float64; empty for algorithms that send none."""
    if not extra:
        return np.zeros(0)
    return np.concatenate([extra[key].double().reshape(-1).numpy() for key in sorted(extra)])


def flat_move(state: dict, global_state: dict) -> np.ndarray:
    """The move state - global_state of every floating-point tensor, flattened in order, as float64."""
    keys = float_keys(global_state)
    if not keys:
        return np.zeros(0)
    return np.concatenate([(state[key].double() - global_state[key].double()).reshape(-1).numpy() for key in keys])
