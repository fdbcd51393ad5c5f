"""The coordinator's SecureRound in process: each stage message out of turn or malformed is refused naming it, the
stages close at their deadlines, and nothing waits without one."""

from __future__ import annotations

import threading

import pytest
import torch

from coordinator.secagg.secure_round import SecureRound
from fedsynth.secagg.errors import SecAggError
from fedsynth.secagg.protocol import AdvertisedKeys, advertise, share_keys

STATE = {"w": torch.zeros(4), "steps": torch.zeros((), dtype=torch.int64)}


def _round(missed: dict[int, str], timeout_s: float) -> SecureRound:
    return SecureRound(STATE, sampled=[0, 1, 2], weights={0: 5, 1: 5, 2: 5}, lock=threading.Condition(), context=b"test",
                       neighbours=0, threshold=0, clip=4.0, stage_timeout_s=timeout_s, round_timeout_s=timeout_s, dp=None,
                       missed=lambda client, why: missed.setdefault(client, why))


def test_stage_messages_out_of_turn_or_malformed_are_refused_by_name() -> None:
    missed: dict[int, str] = {}
    secure = _round(missed, timeout_s=60.0)  # a stage closes as soon as every client answered it, long before this
    keys = {c: advertise() for c in range(3)}
    with pytest.raises(SecAggError, match="client 0's masking public key is 31 bytes"):
        secure.advertise(0, AdvertisedKeys(keys[0].public().encryption, bytes(31)))
    with pytest.raises(SecAggError, match="belong to stage 2"):
        secure.share(1, {}, bytes(32))
    with pytest.raises(SecAggError, match="belong to stage 4"):
        secure.add_shares(1, {}, {})
    answers: dict[int, object] = {}
    threads = [threading.Thread(target=lambda c=c: answers.setdefault(c, secure.advertise(c, keys[c].public()))) for c in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(answers) == [0, 1, 2] and missed == {}  # every client advertised: the stage closed at once
    neighbours, weight, total = answers[0]  # type: ignore[misc]
    assert sorted(neighbours) == [1, 2] and (weight, total, secure.threshold) == (5, 15, 2)
    _, boxes = share_keys(0, keys[0], neighbours, threshold=2, context=b"test")
    with pytest.raises(SecAggError, match="client 0's seed commitment is 31 bytes"):
        secure.share(0, boxes, bytes(31))
    with pytest.raises(SecAggError, match=r"sealed shares for \[1\], not for its neighbours \[1, 2\]"):
        secure.share(0, {1: boxes[1]}, bytes(32))


def test_a_stage_closes_at_its_deadline_and_names_who_missed_it() -> None:
    missed: dict[int, str] = {}
    secure = _round(missed, timeout_s=0.5)
    keys = advertise()
    with pytest.raises(SecAggError, match="only 0 of its neighbours took part in secure aggregation's stage 1"):
        secure.advertise(0, keys.public())  # 1 and 2 never advertise: after 0.5 s client 0 has no share holders
    assert set(missed) == {0, 1, 2} and "missed secure aggregation's stage 1" in missed[1]
    with pytest.raises(SecAggError, match="has not closed for unmasking"):
        secure.unmask_request(0)  # bounded: the round's deadline and a stage's, not forever
