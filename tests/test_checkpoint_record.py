"""The checkpoint's record with its history encoded once per round reads back as the record itself."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from coordinator import checkpoint

HISTORY = [
    {"round": 1, "accuracy": 0.5, "loss": math.inf, "participants": [0, 2], "phases_s": {"dispatch": 0.01}},
    {"round": 2, "accuracy": 0.75, "loss": 1.25, "participants": [], "train_loss": None, "note": "é \"quoted\""},
]


@pytest.mark.parametrize("others", [{}, {"fingerprint": "abc", "rng": {"state": [1, 2]}, "quota": None, "initial": {}}])
@pytest.mark.parametrize("rounds", [0, 1, 2])
def test_the_record_reads_back_the_same_whether_its_history_was_encoded_before(tmp_path: Path, others: dict, rounds: int) -> None:
    history = HISTORY[:rounds]
    record = {**others, "history": history}
    state = {"w": torch.arange(4, dtype=torch.float32)}
    ckpt = checkpoint.Checkpoint(rounds, state, {}, record, encoded_history=tuple(json.dumps(h) for h in history))
    assert json.loads(checkpoint.record_json(ckpt)) == json.loads(json.dumps(record))
    checkpoint.save(tmp_path, ckpt)
    loaded = checkpoint.load(tmp_path)
    assert loaded is not None and loaded.completed_rounds == rounds
    assert json.dumps(loaded.record, sort_keys=True) == json.dumps(record, sort_keys=True)  # inf kept as Infinity
    assert torch.equal(loaded.global_state["w"], state["w"])
