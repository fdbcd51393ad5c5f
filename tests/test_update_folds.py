"""coordinator.update_folds: updates folded off their RPC, in the order accepted; a round waits for its last fold; a
failed fold stops the round instead of publishing a sum that may hold part of it; the backlog is bounded."""

from __future__ import annotations

import os
import threading

import pytest

from coordinator import update_folds
from coordinator.rounds import RoundInProgress
from coordinator.update_folds import UpdateFolds
from fedsynth.algorithms.base import Aggregator
from fedsynth.errors import StateError, WireError
from fedsynth.process.runtime import lower_thread_priority
from fedsynth.wire.transfer import prepare

WAIT_S = 10.0


def _round() -> RoundInProgress:
    return RoundInProgress(number=1, task_id="t", sampled=[0, 1, 2], payload=prepare([]), aggregator=Aggregator({}),
                           deadline_s=60.0, need=1)


def test_a_round_waits_for_its_folds_which_run_in_the_order_accepted() -> None:
    lock = threading.Condition()
    folds, rnd = UpdateFolds(lock, backlog=3), _round()
    gate, order = threading.Event(), []
    for client in (2, 0, 1):
        folds.reserve(f"client {client}")
    with lock:  # all three accepted before the fold thread may start (a fold runs under the lock)
        for client in (2, 0, 1):
            folds.submit(rnd, client, lambda c=client: (gate.wait(WAIT_S), order.append(c)))
    waiter = threading.Thread(target=folds.wait_for, args=(rnd,))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and order == []  # three accepted updates not folded yet: the round may not close
    gate.set()
    waiter.join(WAIT_S)
    assert not waiter.is_alive() and order == [2, 0, 1] and rnd.folding == 0
    folds.shutdown()


def test_a_fold_refused_by_the_aggregators_checks_costs_its_client_not_the_round() -> None:
    lock = threading.Condition()
    refused: list[tuple[int, int, str]] = []
    folds = UpdateFolds(lock, refuse=lambda rnd, client, why: refused.append((rnd.number, client, why)))
    rnd = _round()

    def unfit() -> None:  # the aggregator's layout check, which raises before its sums change
        raise WireError("this algorithm expects no extra tensors, got ['junk']")

    folds.reserve("client 1")
    with lock:
        folds.submit(rnd, 1, unfit)
    folds.wait_for(rnd)  # the round goes on
    assert refused == [(1, 1, "round 1: client 1's update could not be folded: this algorithm expects no extra tensors, got ['junk']")]
    folds.reserve("client 2")  # the refused fold gave its place back
    folds.cancel()
    folds.shutdown()


def test_a_fold_that_fails_past_the_checks_stops_the_round_and_names_the_client() -> None:
    lock = threading.Condition()
    folds, rnd = UpdateFolds(lock, refuse=lambda *_: None), _round()

    def broken() -> None:  # a bug, not a defect of the update: the sum may hold part of it
        raise RuntimeError("out of memory in the middle of the sum")

    folds.reserve("client 1")
    with lock:
        folds.submit(rnd, 1, broken)
    with pytest.raises(RuntimeError, match=r"round 1: updates could not be folded: client 1: RuntimeError: out of memory"):
        folds.wait_for(rnd)
    folds.reserve("client 2")  # the failed fold gave its place back
    folds.cancel()
    folds.shutdown()


def test_an_update_waits_boundedly_for_a_place_in_the_backlog(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(update_folds, "PLACE_WAIT_S", 0.2)
    lock = threading.Condition()
    folds, rnd, gate = UpdateFolds(lock, backlog=1), _round(), threading.Event()
    folds.reserve("client 0")
    with lock:
        folds.submit(rnd, 0, lambda: gate.wait(WAIT_S))
    with pytest.raises(StateError, match="client 1's update for round 1 waited 0s for the updates before it"):
        folds.reserve("client 1's update for round 1")
    gate.set()
    folds.wait_for(rnd)
    folds.reserve("client 1's update for round 1")  # free again once folded
    folds.cancel()
    folds.shutdown()


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="per-thread nice values are Linux's")
def test_a_lower_priority_thread_leaves_the_rest_of_the_process_alone() -> None:
    seen: list[int] = []

    def lowered() -> None:
        lower_thread_priority(5)
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    before = os.getpriority(os.PRIO_PROCESS, 0)
    thread = threading.Thread(target=lowered)
    thread.start()
    thread.join(WAIT_S)
    assert seen == [min(19, before + 5)] and os.getpriority(os.PRIO_PROCESS, 0) == before
