"""What travels down a client's dispatch stream: a round's task, or the end of the run."""

from __future__ import annotations

from dataclasses import dataclass

from fedsynth import codec


@dataclass(frozen=True)
class TaskDelivery:
    task_id: str
    round: int
    deadline_s: float
    quota: list[int]
    payload: bytes
    meta: codec.PayloadMeta


@dataclass(frozen=True)
class Finished:
    reason: str
    success: bool
    exit_code: int  # the coordinator's (fedsynth.runtime EXIT_*); clients exit with it too
