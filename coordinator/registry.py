"""Who takes part: registered clients, their sessions and the outboxes that feed their dispatch streams."""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from coordinator.dispatch import Finished
from coordinator.metrics import CoordinatorMetrics
from fedsynth.errors import ID_CLAIMED, StateError, WireError

log = logging.getLogger(__name__)


@dataclass
class ClientRecord:
    client_id: int
    num_samples: int
    fedeas_images: int
    missing_classes: tuple[int, ...]
    session: str
    outbox: queue.Queue[Any] | None = None
    generation: dict[str, Any] | None = None
    has_synthetic: bool = False  # SDA-FL: holds the current shared synthetic images
    label_counts: tuple[int, ...] = ()  # FedGen: n_k^c per class, reported once at registration
    last_heartbeat: float | None = None  # monotonic time of its last Heartbeat RPC; None: it has sent none yet
    node_token: str = ""  # the client-node process's random token (RegisterRequest.node_token)
    registered_at: float = 0.0  # monotonic time of this registration
    stream_closed_at: float | None = None  # monotonic time its last dispatch stream ended; None: none has yet
    test_samples: int = 0  # federated evaluation: its local test set's size, the most examples an evaluation may count


class ClientRegistry:
    """Every method takes the federation's lock itself (a reentrant Condition, so callers may already hold it)."""

    def __init__(self, lock: threading.Condition, metrics: CoordinatorMetrics, *, run_id: str, num_clients: int,
                 num_classes: int, max_samples: int = 0) -> None:
        self.lock = lock
        self.metrics = metrics
        self.run_id = run_id
        self.num_clients = num_clients
        self.num_classes = num_classes
        self.max_samples = max_samples  # data.max_samples_per_client: the largest N_k (aggregation weight) admitted; 0 = any
        self.clients: dict[int, ClientRecord] = {}
        self.refused: set[int] = set()  # clients whose data does not fit the run (schema check): not waited for
        self.released: dict[int, str] = {}  # clients whose process is gone (the launcher said so): why; not waited for
        self.finished: Finished | None = None

    def check_claim(self, client_id: int, run_id: str) -> None:
        """The id and run a registration claims: this run's, and one of its K clients."""
        if run_id != self.run_id:
            raise StateError(f"client {client_id} was configured for run {run_id!r}, this coordinator runs {self.run_id!r}")
        if not 0 <= client_id < self.num_clients:
            raise WireError(f"client_id {client_id} is out of range 0..{self.num_clients - 1}")

    def register(self, client_id: int, num_samples: int, fedeas_images: int, missing: Iterable[int], run_id: str, *,
                 data_fixed: bool, has_synthetic: Callable[[str], bool], synthetic_digest: str = "",
                 label_counts: Iterable[int] = (), need_label_counts: bool = False, node_token: str = "",
                 live_within_s: float = 0.0, test_samples: int = 0) -> str:
        """Admit (or re-admit) a client; once the budget is fixed (data_fixed) it must report the same data.
        With need_label_counts (FedGen) it must report C label counts summing to num_samples, and the same ones again."""
        self.check_claim(client_id, run_id)
        if num_samples < 1:
            raise WireError(f"client {client_id} reported num_samples={num_samples}; must be >= 1")
        if self.max_samples and num_samples > self.max_samples:
            self.metrics.rejected_registrations.labels(reason="max_samples_per_client").inc()
            with self.lock:
                self.refused.add(client_id)  # not waited for (it may come back with a count the run admits)
                self.lock.notify_all()
            log.warning("client %d refused: N_k=%d above data.max_samples_per_client=%d", client_id, num_samples, self.max_samples)
            raise StateError(f"client {client_id} registered N_k={num_samples} samples, above data.max_samples_per_client="
                             f"{self.max_samples}: refused")
        missing = tuple(sorted(set(missing)))
        if any(c >= self.num_classes for c in missing):
            raise WireError(f"client {client_id} reported missing class ids {missing} outside 0..{self.num_classes - 1}")
        counts = tuple(int(c) for c in label_counts)
        if need_label_counts and len(counts) != self.num_classes:
            raise WireError(f"client {client_id} reported {len(counts)} label counts; this run has {self.num_classes} classes")
        if counts and sum(counts) != num_samples:
            raise WireError(f"client {client_id}'s label counts sum to {sum(counts)}, but it reported num_samples={num_samples}")
        with self.lock:
            old = self.clients.get(client_id)
            if old and node_token and old.node_token and node_token != old.node_token:
                last_seen = max(old.registered_at, old.last_heartbeat or 0.0)
                if time.monotonic() - last_seen < live_within_s:
                    problem = (f"client {client_id}: {ID_CLAIMED} {client_id}: another node holds it and was "
                               f"heard from {time.monotonic() - last_seen:.1f}s ago (runtime.heartbeat_timeout_s = "
                               f"{live_within_s:g})")
                    log.warning("refused %s", problem)
                    raise StateError(problem)
            if old and old.label_counts and counts != old.label_counts:
                raise StateError(f"client {client_id} re-registered with label counts {list(counts)}, not {list(old.label_counts)}")
            if old and data_fixed and (old.num_samples, old.fedeas_images, old.missing_classes) != (num_samples, fedeas_images, missing):
                raise StateError(f"client {client_id} re-registered with different data than before")
            record = ClientRecord(client_id, num_samples, fedeas_images, missing, secrets.token_hex(16))
            record.has_synthetic = has_synthetic(synthetic_digest)
            record.label_counts = counts
            record.node_token, record.registered_at = node_token, time.monotonic()
            record.test_samples = test_samples
            if old is not None:
                record.generation = old.generation
                self._close_outbox(old)
            self.clients[client_id] = record
            self.released.pop(client_id, None)  # back: sampled again
            self.metrics.clients_registered.set(len(self.clients))
            self.lock.notify_all()
        log.info("client %d registered (N_k=%d, FedEAS images %d)", client_id, num_samples, fedeas_images)
        return record.session

    def release(self, client_ids: Iterable[int], reason: str) -> list[int]:
        """The processes of these clients are gone: not waited for at registration, their streams closed, not sampled
        until they register again. The ids, checked by the caller, are this run's."""
        with self.lock:
            for client_id in client_ids:
                self.released[client_id] = reason
                self.refused.add(client_id)  # the registration wait counts it as settled
                record = self.clients.get(client_id)
                if record is not None:
                    self._close_outbox(record)
            self._count_connected()
            return sorted(client_ids)

    def record(self, client_id: int, session: str) -> ClientRecord:
        record = self.clients.get(client_id)
        if record is None:
            raise StateError(f"client {client_id} is not registered")
        if record.session != session:
            raise StateError(f"client {client_id}: session is stale (the client registered again or the coordinator restarted)")
        return record

    # ---- dispatch streams ----------------------------------------------------------------------

    def open_stream(self, client_id: int, session: str) -> tuple[ClientRecord, queue.Queue[Any]]:
        """A fresh outbox for the client's new stream (the old one ends); the run's end is queued if it has come."""
        with self.lock:
            record = self.record(client_id, session)
            self._close_outbox(record)
            record.outbox = queue.Queue()
            if self.finished is not None:
                record.outbox.put(self.finished)
            self._count_connected()
            return record, record.outbox

    def close_stream(self, client_id: int, outbox: queue.Queue[Any]) -> None:
        with self.lock:
            record = self.clients.get(client_id)
            if record is not None and record.outbox is outbox:
                record.outbox = None
                record.stream_closed_at = time.monotonic()
                log.info("client %d disconnected", client_id)
            self._count_connected()

    def heartbeat(self, client_id: int, session: str) -> bool:
        """Note that the client is alive; True while its dispatch stream is open."""
        with self.lock:
            record = self.record(client_id, session)
            record.last_heartbeat = time.monotonic()
            return record.outbox is not None

    def drop_silent(self, timeout_s: float) -> list[int]:
        """End the dispatch stream of every client whose heartbeats stopped timeout_s ago (frozen, or its network
        gone without a reset); a client that never sent one is left to gRPC keepalive."""
        now = time.monotonic()
        with self.lock:
            silent = [r for r in self.clients.values()
                      if r.outbox is not None and r.last_heartbeat is not None and now - r.last_heartbeat > timeout_s]
            for record in silent:
                log.warning("client %d dropped: no heartbeat for %.1fs", record.client_id, now - record.last_heartbeat)
                self._close_outbox(record)
                self.metrics.clients_dropped.inc()
            if silent:
                self._count_connected()
        return [r.client_id for r in silent]

    def is_connected(self, client_id: int) -> bool:
        """It has an open dispatch stream: a task can be pushed to it."""
        record = self.clients.get(client_id)
        return record is not None and record.outbox is not None

    def is_reachable(self, client_id: int, heartbeat_timeout_s: float) -> bool:
        """Connected, or heartbeating still: a client whose stream was dropped while it was frozen, and that thawed
        mid-training, may yet answer its round (it subscribes again once it has)."""
        record = self.clients.get(client_id)
        if record is None:
            return False
        recent = record.last_heartbeat is not None and time.monotonic() - record.last_heartbeat <= heartbeat_timeout_s
        return record.outbox is not None or recent

    def unreachable_since(self, client_id: int, heartbeat_timeout_s: float) -> float | None:
        """Since when (monotonic) the client has been unreachable: the later of its stream's end and its last
        heartbeat's expiry. None while it is reachable, and when nothing says when it was lost: not registered, or
        registered but never subscribed nor heartbeating (it may be starting still)."""
        record = self.clients.get(client_id)
        if record is None or self.is_reachable(client_id, heartbeat_timeout_s):
            return None
        if record.stream_closed_at is None and record.last_heartbeat is None:
            return None
        since = record.stream_closed_at or 0.0
        if record.last_heartbeat is not None:
            since = max(since, record.last_heartbeat + heartbeat_timeout_s)
        return since

    def send(self, client_id: int, item: Any) -> None:
        """Queue an item on the client's open stream; nothing happens for a client without one."""
        with self.lock:
            record = self.clients.get(client_id)
            if record is not None and record.outbox is not None:
                record.outbox.put(item)

    def finish(self, finished: Finished) -> None:
        """Tell every connected client (and every later stream) that the run is over."""
        with self.lock:
            self.finished = finished
            for record in self.clients.values():
                if record.outbox is not None:
                    record.outbox.put(finished)

    def close_all(self) -> None:
        """End every open dispatch stream now (shutdown), so no RPC holds the server for its whole grace period."""
        with self.lock:
            for record in self.clients.values():
                self._close_outbox(record)
            self._count_connected()

    def drain(self, timeout_s: float) -> None:
        """Wait (bounded) until every client stream has closed after the final message."""
        stop_at = time.monotonic() + timeout_s
        with self.lock:
            while any(r.outbox is not None for r in self.clients.values()) and time.monotonic() < stop_at:
                self.lock.wait(timeout=0.1)

    def generation_reports(self) -> dict[int, dict[str, Any]]:
        with self.lock:
            return {c: dict(r.generation) for c, r in self.clients.items() if r.generation}

    def _close_outbox(self, record: ClientRecord) -> None:
        if record.outbox is not None:
            record.outbox.put(None)  # ends the superseded stream
            record.outbox = None
            record.stream_closed_at = time.monotonic()

    def _count_connected(self) -> None:
        self.metrics.clients_connected.set(sum(1 for c in self.clients.values() if c.outbox is not None))
        self.lock.notify_all()
