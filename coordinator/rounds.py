"""Per-round bookkeeping: who was sampled, who answered, the streaming aggregate and the phase timings."""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fedsynth.algorithms.base import Aggregator
from fedsynth.wire.data_plane import TICKET_BYTES
from fedsynth.wire.transfer import PreparedPayload


@dataclass
class RoundInProgress:
    number: int
    task_id: str
    sampled: list[int]
    payload: PreparedPayload
    aggregator: Aggregator
    deadline_s: float
    need: int
    started: float = field(default_factory=time.monotonic)
    answered: dict[int, dict[str, float]] = field(default_factory=dict)
    delivered: dict[int, float] = field(default_factory=dict)  # client -> seconds until its payload was sent
    aggregation_s: float = 0.0
    bytes_received: int = 0
    bytes_sent: int = 0
    global_state: dict[str, torch.Tensor] = field(default_factory=dict)
    payload_with_images: PreparedPayload | None = None  # SDA-FL: the task for clients that lack the shared images
    tickets: dict[bytes, int] = field(default_factory=dict)  # the data plane's ticket -> the client it was issued to
    # runtime.max_update_norm: each received update's norm, the updates refused for it (client -> why), those clipped,
    # and (with "auto") the updates held, received but not yet folded, until the round's median is known
    norms: dict[int, float] = field(default_factory=dict)
    refused: dict[int, str] = field(default_factory=dict)
    clipped: list[int] = field(default_factory=list)
    held: dict[int, Callable[[float], None]] = field(default_factory=dict)  # client -> folds its update at a scale
    norm_bound: float | None = None  # the bound the round's updates were held to
    # updates accepted (answered) but still waiting for the fold thread (coordinator.update_folds), and its failures
    folding: int = 0
    fold_errors: list[str] = field(default_factory=list)
    receiving: set[int] = field(default_factory=set)  # clients whose upload for this round is under way (one each)
    gone: set[int] = field(default_factory=set)  # sampled clients whose process is gone (ReleaseClients): not waited for
    # Set once every sampled client has its task (or the round is over): the last round's test pass waits for it
    dispatched: threading.Event = field(default_factory=threading.Event)
    _sampled: frozenset[int] = field(init=False, repr=False)
    _ticket_of: dict[int, bytes] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._sampled = frozenset(self.sampled)

    def release(self) -> None:
        """Once aggregated: drop what is as large as the model (the chunk messages, the running sum, the global state);
        the bookkeeping stays for the round's summary. Only the round loop calls it, after the round stopped being
        current, so no update can reach the running sum any more."""
        self.payload = PreparedPayload(self.payload.meta, ())
        self.payload_with_images = None
        self.aggregator = Aggregator({})
        self.global_state = {}
        self.held = {}
        self.dispatched.set()

    @property
    def pending(self) -> set[int]:
        return set(self.sampled) - set(self.answered) - set(self.refused) - self.gone

    @property
    def complete(self) -> bool:
        """Every sampled client answered, had its update refused or is gone (answers come only from sampled clients)."""
        return not self.pending

    def ticket_for(self, client_id: int) -> bytes:
        """This client's data-plane ticket for the round (one per client, issued on its first delivery): a 128-bit
        secret that only its dispatch stream carries."""
        ticket = self._ticket_of.get(client_id)
        if ticket is None:
            ticket = self._ticket_of[client_id] = secrets.token_bytes(TICKET_BYTES)
            self.tickets[ticket] = client_id
        return ticket

    def awaits(self, client_id: int) -> bool:
        """This client was sampled and has not answered yet: O(1), called once per update at K = 100 and more."""
        return (client_id in self._sampled and client_id not in self.answered and client_id not in self.refused
                and client_id not in self.gone)

    @property
    def expired(self) -> bool:
        return time.monotonic() - self.started >= self.deadline_s


def quorum_size(sampled: int, quorum: float) -> int:
    """Answers needed to close a round: ceil(quorum * sampled), at least 1."""
    return max(1, math.ceil(quorum * sampled - 1e-9))


def round_phases(rnd: RoundInProgress, closed_at: float, evaluation_s: float) -> dict[str, float]:
    """Wall-clock split of one round. Communication is the waiting not explained by the slowest client's own work
    (generation + training of the same client: different clients can be slowest at each)."""
    waited = closed_at - rnd.started
    answers = rnd.answered.values()
    slowest_train = max((a["train_seconds"] for a in answers), default=0.0)
    slowest_generation = max((a["generation_seconds"] for a in answers), default=0.0)
    slowest_work = max((a["train_seconds"] + a["generation_seconds"] for a in answers), default=0.0)
    dispatch = max(rnd.delivered.values(), default=0.0)
    return {
        "dispatch": dispatch,
        "waiting": waited,
        "generation": slowest_generation,
        "training": slowest_train,
        "communication": max(0.0, waited - slowest_work),
        "aggregation": rnd.aggregation_s,
        "evaluation": evaluation_s,
    }
