"""Private Evolution (Lin et al., ICLR 2024; microsoft/DPSDA) as a federated algorithm: each round is one iteration.
The coordinator holds a population of candidate images from a PUBLIC generator and sends it to the sampled clients;
each client embeds its own images and the candidates with a public extractor and every private image votes for its
nearest candidate of its own class; only the vote vector leaves the client. The coordinator sums the votes, adds
Gaussian noise (sensitivity 1: one image, or one L2-normalised client), keeps what passes the threshold, draws the
next population from the noisy histogram and asks the generator for variations of it."""

from __future__ import annotations

import math
import secrets
import zlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from fedsynth.algorithms.base import Aggregator, ClientUpdate, StateDict, check_same_layout, snapshot_state
from fedsynth.algorithms.privacy import epsilon_spent, noise_multiplier_for
from fedsynth.algorithms.votes import bounded_votes, draw_population, embed, nearest_votes, noisy_histogram, strength_at, user_normalised
from fedsynth.config import EvolveConfig
from fedsynth.errors import WireError
from fedsynth.learning.public_embedder import load_public_embedder
from fedsynth.learning.training import LocalTrainConfig, TrainData, images_to_tensor

FROM_CONFIG = {"from_config": True}  # fields the run config fills in (fedsynth.assembly), not train.algorithm_params
VOTES = "votes"  # the "model": one vote per candidate (the clients send it; the coordinator keeps the noisy histogram)
CANDIDATES = "candidates"  # server state and server extra: the population, uint8 (C*M) x H x W x channels, class-major
SELECTED = "selected"  # server state: the population drawn from the last histogram, before its variations
ITERATION = "iteration"  # server state: iterations completed


class CandidateSource(Protocol):
    """The public generator as the coordinator reaches it (coordinator/evolution_source.py: the generator service)."""

    def random(self, per_class: int, num_classes: int, seed: int) -> np.ndarray:
        """per_class fresh images of every class, class-major, uint8 N x H x W x C."""
        ...

    def vary(self, images: np.ndarray, labels: np.ndarray, strength: float, seed: int) -> np.ndarray:
        """One variation of each image (its class guiding), in order, uint8 N x H x W x C."""
        ...


class VoteTally(nn.Module):
    """Private Evolution's model: a buffer of one vote per candidate; it computes nothing."""

    def __init__(self, candidates: int) -> None:
        super().__init__()
        self.register_buffer(VOTES, torch.zeros(candidates, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise TypeError("a vote tally classifies nothing")


@dataclass(frozen=True)
class PrivateEvolution:
    name = "pe"
    settings: EvolveConfig = field(default_factory=EvolveConfig, metadata=FROM_CONFIG)
    num_classes: int = field(default=10, metadata=FROM_CONFIG)
    clients: int = field(default=1, metadata=FROM_CONFIG)
    clients_per_round: int = field(default=1, metadata=FROM_CONFIG)
    rounds: int = field(default=1, metadata=FROM_CONFIG)
    seed: int = field(default=0, metadata=FROM_CONFIG)
    noise_secret: bytes = field(default=b"", metadata=FROM_CONFIG)  # coordinator/dp_secret.py: clients know the seed
    source: CandidateSource | None = field(default=None, compare=False, metadata=FROM_CONFIG)  # the coordinator's only

    @property
    def per_class(self) -> int:
        return self.settings.candidates_per_class

    # ---- the client ---------------------------------------------------------------------------

    def client_update(self, *, model: nn.Module, data: TrainData, cfg: LocalTrainConfig, server_extra: StateDict,
                      client_state: StateDict, generator: torch.Generator) -> ClientUpdate:
        candidates = server_extra.get(CANDIDATES)
        expected = (self.num_classes * self.per_class, *data.x.shape[2:], data.x.shape[1])
        if candidates is None or candidates.dtype != torch.uint8 or tuple(candidates.shape) != expected:
            got = "none" if candidates is None else f"{candidates.dtype} {tuple(candidates.shape)}"
            raise WireError(f"the coordinator's candidates must be uint8 {expected}, got {got}")
        extractor = self.extractor()
        pool = embed(images_to_tensor(candidates.numpy()), extractor)
        votes = nearest_votes(embed(data.x, extractor), data.y, pool, self.per_class)
        if self.settings.dp == "user":
            votes = user_normalised(votes)
        model.get_buffer(VOTES).copy_(votes.to(torch.float32))
        return ClientUpdate(state=snapshot_state(model), num_steps=0, train_loss=math.nan)

    def extractor(self) -> nn.Module | None:
        """The public feature extractor (None: pixels), the node's copy checked against the run's pinned hash."""
        s = self.settings
        if s.embedder == "pixels":
            return None
        assert s.embedder_model is not None and s.embedder_sha256 is not None  # EvolveConfig.check
        return load_public_embedder(s.embedder_model, s.embedder_sha256)

    # ---- the server ---------------------------------------------------------------------------

    def initial_server_state(self, global_state: StateDict) -> StateDict:
        """No population yet: server_extra asks for it when iteration 1 is dispatched (the coordinator serving by then,
        so that minutes of generation never hold its start-up; a resumed run has its population in the checkpoint)."""
        return {ITERATION: torch.zeros((), dtype=torch.int64)}

    def server_extra(self, server_state: StateDict) -> StateDict:
        """The population the sampled clients vote on. The first time (iteration 1): per_class random images of every
        class from the public generator, kept in `server_state` (the round's aggregator and checkpoint take it there)."""
        if CANDIDATES not in server_state:
            assert self.source is not None, "the coordinator's algorithm has a candidate source"
            first = self.source.random(self.per_class, self.num_classes, self.seed)
            server_state.update({CANDIDATES: torch.from_numpy(first), SELECTED: torch.from_numpy(first.copy())})
        return {CANDIDATES: server_state[CANDIDATES]}

    def new_aggregator(self, global_state: StateDict, server_state: StateDict) -> Aggregator:
        return VoteAggregator(global_state, server_state, algorithm=self)

    @property
    def sample_rate(self) -> float:
        """q: the share of the clients sampled each iteration (a fixed number, m of K; 1 with every client)."""
        return self.clients_per_round / self.clients

    def noise_multiplier(self) -> float:
        """sigma of the histogram's noise, per unit of sensitivity (0 without DP)."""
        s = self.settings
        if s.dp == "none":
            return 0.0
        if s.target_epsilon is None:
            return s.noise_multiplier
        return noise_multiplier_for(target_epsilon=s.target_epsilon, delta=s.delta, sample_rate=self.sample_rate,
                                    steps=self.rounds, accountant=s.accountant, section="evolve")

    def check_privacy(self, shard_sizes: list[int]) -> None:
        self.noise_multiplier()  # an unreachable target raises ConfigError naming evolve.target_epsilon

    def privacy_report(self, completed_rounds: int, participation: dict[int, int] | None = None,
                       shard_sizes: dict[int, int] | None = None) -> dict[str, Any]:
        """epsilon after `completed_rounds` Gaussian mechanisms on the histogram (Opacus's accountant, q = m / K)."""
        s = self.settings
        sigma = self.noise_multiplier()
        private = s.dp != "none"
        return {"dp": s.dp, "epsilon": epsilon_spent(noise_multiplier=sigma, sample_rate=self.sample_rate, steps=completed_rounds,
                                                     delta=s.delta, accountant=s.accountant) if private else None,
                "delta": s.delta if private else None, "noise_multiplier": sigma if private else None,
                "sample_rate": self.sample_rate if private else None, "steps": completed_rounds,
                "accountant": s.accountant if private else None, "target_epsilon": s.target_epsilon,
                "threshold": s.threshold * sigma, "clip": 1.0 if private else None}  # one unit's votes: L2 at most 1

    def noise_generator(self, iteration: int) -> torch.Generator:
        """Seeded by (run seed, iteration, the coordinator's secret), as DP-FedAvg's noise (fedsynth.algorithms.user_dp)."""
        if self.settings.secure_noise:
            return torch.Generator().manual_seed(secrets.randbits(63))
        secret = [int(word) for word in np.frombuffer(self.noise_secret, dtype=np.uint32)]
        state = np.random.SeedSequence([self.seed, iteration, zlib.crc32(b"pe-histogram"), *secret]).generate_state(2, np.uint32)
        return torch.Generator().manual_seed((int(state[0]) << 31) ^ int(state[1]))

    def next_population(self, histogram: torch.Tensor, server_state: StateDict, iteration: int) -> tuple[StateDict, dict[str, Any]]:
        """The server state after iteration `iteration`: the draw from the thresholded noisy histogram and, from the
        public generator, one variation of each drawn image. Draws and variations are seeded by (seed, iteration)."""
        assert self.source is not None, "the coordinator's algorithm has a candidate source"
        sigma = self.noise_multiplier()
        candidates = server_state[CANDIDATES].numpy()
        rng = np.random.default_rng([self.seed, iteration, 0x9E])
        chosen, kept = draw_population(histogram, self.per_class, self.settings.threshold * sigma, rng)
        selected = candidates[chosen]
        labels = np.repeat(np.arange(self.num_classes), self.per_class)
        strength = strength_at(iteration, self.rounds, self.settings.strength_start, self.settings.strength_end)
        varied = self.source.vary(selected, labels, strength, int(np.random.SeedSequence([self.seed, iteration]).generate_state(1)[0]))
        state = {ITERATION: torch.tensor(iteration, dtype=torch.int64), CANDIDATES: torch.from_numpy(np.ascontiguousarray(varied)),
                 SELECTED: torch.from_numpy(np.ascontiguousarray(selected))}
        distinct = [len(np.unique(chosen[c * self.per_class : (c + 1) * self.per_class])) for c in range(self.num_classes)]
        return state, {"strength": strength, "classes_kept": kept, "distinct_drawn": distinct}

    def evaluate(self, model: nn.Module, data: TrainData, batch_size: int = 512) -> tuple[float, float]:
        """Nothing to test on the server: the population is scored afterwards (`generator evaluate`)."""
        return math.nan, math.nan


class VoteAggregator(Aggregator):
    """Sums the clients' vote vectors, each bounded by evolve.dp's rule (a peer's vector is checked, never trusted),
    then adds the noise and draws the next population. N_k does not weight a vote: one image (or client) is one unit."""

    def __init__(self, global_state: StateDict, server_state: StateDict, *, algorithm: PrivateEvolution) -> None:
        super().__init__(global_state, server_state)
        self._algorithm = algorithm
        self._iteration = int(server_state[ITERATION]) + 1
        self._votes = torch.zeros_like(global_state[VOTES], dtype=torch.float64)
        self.cut: list[int] = []  # updates that had to be bounded (their count): a client over its share
        self.evolution_figures: dict[str, Any] = {}  # the round's summary: strength, classes kept, distinct draws

    def add(self, state: StateDict, extra: StateDict, weight: float, *, layout_checked: bool = False, deltas: bool = False,
            scale: float = 1.0) -> None:
        if not layout_checked:
            check_same_layout(state, self._template, what="client votes")
        self.add_extra(extra)
        if deltas or scale != 1:
            raise WireError("Private Evolution's votes arrive whole: no deltas (runtime.wire_dtype) or scaling")
        votes = state[VOTES].to(torch.float64)
        if not bool(torch.isfinite(votes).all()) or bool((votes < 0).any()):
            raise WireError(f"client votes must be finite and >= 0, got min {float(votes.min())!r}")
        bounded, cut = bounded_votes(votes, dp=self._algorithm.settings.dp, num_samples=max(1, int(weight)))
        if cut:
            self.cut.append(self._count)
        self._votes += bounded
        self._total_weight += float(weight)
        self._count += 1

    def finish(self) -> tuple[StateDict, StateDict]:
        if self._count == 0:
            raise ValueError("cannot aggregate a round with zero client updates")
        sigma = self._algorithm.noise_multiplier()
        histogram = noisy_histogram(self._votes, sigma, self._algorithm.noise_generator(self._iteration))
        state, figures = self._algorithm.next_population(histogram, self._server_state, self._iteration)
        self.evolution_figures = {**figures, "bounded_updates": len(self.cut)}
        return {VOTES: histogram.to(torch.float32)}, state
