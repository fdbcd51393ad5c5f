"""FedGen on the coordinator: keep each received client's head during the round, then train the feature generator
against those heads (weighted per class by the clients' registered label counts) and update the server state."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from fedsynth.algorithms.base import StateDict
from fedsynth.algorithms.fedgen import GEN, FedGen, generator_from, head_of
from fedsynth.learning.fedgen_generator import train_generator

log = logging.getLogger(__name__)


class FedGenServer:
    def __init__(self, algorithm: FedGen, *, seed: int) -> None:
        self.algorithm = algorithm
        self.seed = seed
        self._heads: dict[int, dict[int, StateDict]] = {}  # round -> client -> head weight and bias
        self._lock = threading.Lock()

    def keep_head(self, round_number: int, client_id: int, state: StateDict) -> None:
        """Called with an accepted (validated) update: only its head is kept, until the round is aggregated."""
        with self._lock:
            self._heads.setdefault(round_number, {})[client_id] = head_of(state)

    def after_aggregation(self, server_state: StateDict, label_counts: dict[int, tuple[int, ...]], round_number: int, *,
                          device: torch.device | str = "cpu") -> tuple[StateDict, dict[str, Any]]:
        """(the server state for the next round, a summary): the generator trained on this round's heads (on `device`,
        train.device; the state stays on the CPU), the global label distribution from every registered client's counts,
        and the regularizer scale decay^round."""
        with self._lock:
            heads = self._heads.pop(round_number, {})
            self._heads = {r: h for r, h in self._heads.items() if r > round_number}
        started = time.monotonic()
        clients = sorted(c for c in heads if label_counts.get(c))
        state = dict(server_state)
        loss_first = loss_last = None
        if clients and self.algorithm.gen_steps > 0:
            generator = generator_from(server_state).to(device)
            modules = []
            for c in clients:
                head = nn.Linear(heads[c]["weight"].shape[1], heads[c]["weight"].shape[0])
                head.load_state_dict(heads[c])
                modules.append(head.to(device))
            counts = np.array([label_counts[c] for c in clients], dtype=np.float64)
            losses = train_generator(generator, modules, counts, steps=self.algorithm.gen_steps, batch_size=self.algorithm.gen_batch_size,
                                     lr=self.algorithm.gen_lr, seed=self.seed * 100_003 + round_number)
            loss_first, loss_last = losses[0], losses[-1]
            state.update({f"{GEN}{k}": v.detach().to("cpu", copy=True) for k, v in generator.state_dict().items()})
        totals = np.sum([counts for counts in label_counts.values() if counts], axis=0) if any(label_counts.values()) else None
        if totals is not None and totals.sum() > 0:
            state["label_distribution"] = torch.as_tensor(totals / totals.sum(), dtype=torch.float32)
        trained = bool(clients) or float(server_state.get("reg_scale", torch.zeros(()))) > 0
        state["reg_scale"] = torch.tensor(self.algorithm.decay ** round_number if trained else 0.0, dtype=torch.float32)
        return state, {
            "generator_loss_first": loss_first,
            "generator_loss_last": loss_last,
            "generator_seconds": time.monotonic() - started,
        }
