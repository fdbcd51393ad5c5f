"""What travels down a client's dispatch stream: a round's task, an evaluation task, or the end of the run."""

from __future__ import annotations

from dataclasses import dataclass

from fedsynth.wire import codec
from fedsynth.wire.transfer import PreparedPayload


@dataclass(frozen=True)
class TaskDelivery:
    task_id: str
    round: int
    deadline_s: float
    quota: list[int]
    payload: PreparedPayload  # chunk messages serialized once per round, shared by every client
    ticket: bytes = b""  # the data plane's: the client fetches the payload (and submits its update) with it
    evaluate: bool = False  # federated evaluation: test the payload's model locally and send counts, no training

    @property
    def meta(self) -> codec.PayloadMeta:
        return self.payload.meta


@dataclass(frozen=True)
class Finished:
    reason: str
    success: bool
    exit_code: int  # the coordinator's (fedsynth.process.runtime EXIT_*); clients exit with it too
