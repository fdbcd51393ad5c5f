"""The run's durable state (global model, server state, sampling RNG, history, budget), resumed from and saved to
the checkpoint after every round."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from coordinator import checkpoint
from coordinator.sdafl_server import SdaflServer
from fedsynth.wire import codec
from fedsynth.algorithms.base import Algorithm, snapshot_state
from fedsynth.errors import ConfigError

log = logging.getLogger(__name__)


class RunState:
    def __init__(self, model: nn.Module, algorithm: Algorithm, *, run_id: str, seed: int) -> None:
        self.model = model
        self.run_id = run_id
        self.layout = codec.layout_of(model.state_dict())  # the global model's keys, shapes and dtypes
        self.server_state = algorithm.initial_server_state(snapshot_state(model))
        self.rng = np.random.default_rng([seed, 1])
        self.completed = 0
        self.history: list[dict[str, Any]] = []
        self.initial: dict[str, float] = {}
        self.quota: np.ndarray | None = None

    def resume(self, out_dir: Path, sdafl: SdaflServer | None) -> bool:
        """Load the checkpoint in out_dir if there is one (it must belong to this run); True when it was loaded."""
        ckpt = checkpoint.load(out_dir)
        if ckpt is None:
            return False
        if ckpt.record.get("fingerprint") != self.run_id:
            raise ConfigError(
                f"{out_dir / checkpoint.FILE_NAME} belongs to run {ckpt.record.get('fingerprint')!r}, "
                f"not this config's {self.run_id!r}; use another out_dir or delete the checkpoint"
            )
        codec.check_like(ckpt.global_state, self.layout, what="checkpoint")
        self.model.load_state_dict(ckpt.global_state)
        self.server_state = ckpt.server_state
        self.rng.bit_generator.state = ckpt.record["rng"]
        self.completed = ckpt.completed_rounds
        self.history = ckpt.record["history"]
        self.initial = ckpt.record["initial"]
        if ckpt.record.get("quota") is not None:
            self.quota = np.asarray(ckpt.record["quota"], dtype=np.int64)
        if sdafl is not None:
            sdafl.restore(ckpt.synthetic, ckpt.record.get("sdafl", {}))
        log.info("resumed from checkpoint after round %d", self.completed)
        return True

    def snapshot(self, sdafl: SdaflServer | None) -> checkpoint.Checkpoint:
        """Everything a checkpoint after this round holds, copied now, so that it can be written later while the
        next round already runs (its history is filled in when the round's evaluation is done)."""
        record = {
            "fingerprint": self.run_id,
            "rng": self.rng.bit_generator.state,
            "history": [],
            "initial": self.initial,
            "quota": None if self.quota is None else self.quota.tolist(),
        }
        synthetic: dict[str, torch.Tensor] = {}
        if sdafl is not None:
            synthetic, record["sdafl"] = sdafl.state()
        return checkpoint.Checkpoint(self.completed, snapshot_state(self.model), self.server_state, record, synthetic)
