"""coordinator.receive_slots: at most N uploads received at once; a stalled holder is bypassed, an ended RPC leaves the queue."""

from __future__ import annotations

import threading
import time

import pytest

from coordinator.receive_slots import ReceiveSlots, UploadCancelled

pytestmark = pytest.mark.serial  # asserts time bounds: runs alone, after the parallel tests

JOIN_S = 10.0


def _join(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(timeout=JOIN_S)
        assert not thread.is_alive(), f"{thread.name} still waiting after {JOIN_S}s"


def test_slots_bound_how_many_uploads_are_received_at_once() -> None:
    slots = ReceiveSlots(2, bypass_after_s=30.0)
    lock = threading.Lock()
    inside, most, held = 0, 0, []

    def upload() -> None:
        nonlocal inside, most
        with slots.hold() as got:
            with lock:
                inside += 1
                most = max(most, inside)
                held.append(got)
            time.sleep(0.05)
            with lock:
                inside -= 1

    threads = [threading.Thread(target=upload, name=f"upload-{i}") for i in range(8)]
    for thread in threads:
        thread.start()
    _join(threads)
    assert most == 2
    assert held == [True] * 8 and slots.bypassed == 0
    assert slots.held == 0 and slots.waiting == 0


def test_a_waiter_behind_a_stalled_holder_goes_ahead_without_a_slot_after_bypass_after_s() -> None:
    slots = ReceiveSlots(1, bypass_after_s=0.3)
    holding, stalled = threading.Event(), threading.Event()

    def stalled_sender() -> None:
        with slots.hold():
            holding.set()
            stalled.wait(timeout=JOIN_S)

    sender = threading.Thread(target=stalled_sender, name="stalled")
    sender.start()
    assert holding.wait(timeout=JOIN_S)
    started = time.monotonic()
    with slots.hold() as got:
        waited = time.monotonic() - started
        assert got is False
    assert 0.3 <= waited < 2.0
    assert slots.bypassed == 1 and slots.held == 1  # the bypass took no slot and gave none back
    stalled.set()
    _join([sender])
    assert slots.held == 0


def test_a_holder_that_fails_gives_its_slot_back() -> None:
    slots = ReceiveSlots(1, bypass_after_s=30.0)
    with pytest.raises(RuntimeError, match="stream broke off"):
        with slots.hold():
            raise RuntimeError("stream broke off")
    assert slots.held == 0
    started = time.monotonic()
    with slots.hold() as got:
        assert got is True
    assert time.monotonic() - started < 0.1


def test_a_waiter_whose_rpc_ended_leaves_the_queue_and_frees_its_turn() -> None:
    slots = ReceiveSlots(1, bypass_after_s=30.0)
    active = threading.Event()
    active.set()
    outcome: list[object] = []

    def waiter() -> None:
        try:
            with slots.hold(active.is_set, what="client 3's update for round 2"):
                outcome.append("received")
        except UploadCancelled as exc:
            outcome.append(exc)

    with slots.hold():
        thread = threading.Thread(target=waiter, name="waiter")
        thread.start()
        deadline = time.monotonic() + JOIN_S
        while slots.waiting == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert slots.waiting == 1
        started = time.monotonic()
        active.clear()  # its deadline passed, or the client cancelled
        _join([thread])
        assert time.monotonic() - started < 1.0
    assert len(outcome) == 1 and isinstance(outcome[0], UploadCancelled)
    assert "client 3's update for round 2 ended while it waited" in str(outcome[0])
    assert slots.waiting == 0 and slots.held == 0 and slots.bypassed == 0


def test_waiters_get_slots_in_arrival_order() -> None:
    slots = ReceiveSlots(1, bypass_after_s=30.0)
    order: list[int] = []

    def upload(i: int) -> None:
        with slots.hold():
            order.append(i)

    threads = []
    with slots.hold():
        for i in range(4):
            threads.append(threading.Thread(target=upload, args=(i,), name=f"upload-{i}"))
            threads[-1].start()
            deadline = time.monotonic() + JOIN_S
            while slots.waiting < i + 1 and time.monotonic() < deadline:
                time.sleep(0.005)
    _join(threads)
    assert order == [0, 1, 2, 3]


def test_fewer_than_one_slot_is_refused() -> None:
    with pytest.raises(ValueError, match="slots must be >= 1, got 0"):
        ReceiveSlots(0, bypass_after_s=1.0)
