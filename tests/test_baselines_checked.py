"""The FL baselines do what their papers say, not just run (issue 15.4): FedProx's pull towards the global model grows
with mu; MOON's contrastive term acts from round 2 on a previous local model the client keeps (and a restarted client,
which has none, falls back to the round-1 rule); SCAFFOLD's option-II control variates are right under momentum and
zero local steps do not divide by zero."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from prometheus_client import CollectorRegistry
from torch import nn

from client_node.metrics import ClientMetrics
from client_node.node import ClientState, LogicalClient, NodeOptions
from fedsynth.wire import codec
from fedsynth.algorithms import ClientUpdate, get_algorithm
from fedsynth.algorithms.moon import contrastive_loss
from fedsynth.algorithms.scaffold import effective_steps
from fedsynth.assembly import algorithm_for, local_train_config, model_for, round_generator
from fedsynth.config import load_config
from fedsynth.learning.data import load_dataset
from fedsynth.learning.models import ProjectedModel, build_model
from fedsynth.learning.training import LocalTrainConfig, TrainData, images_to_tensor
from fedsynth.wire.transfer import receive_inline
from fedsynth.v1 import coordinator_pb2 as pb

StateDict = dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def digits() -> TrainData:
    train = load_dataset("digits", "train")
    return TrainData(images_to_tensor(train.x[:256]), torch.from_numpy(train.y[:256]))


def cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_model("cnn", num_classes=10, in_channels=1, image_size=8)


def one_round(name: str, data: TrainData, cfg: LocalTrainConfig, *, start: StateDict, client_state: StateDict | None = None,
              server_extra: StateDict | None = None, **params: object) -> ClientUpdate:
    algorithm = get_algorithm(name, **params)
    model = cnn()
    model.load_state_dict(start)
    if server_extra is None:
        server_extra = algorithm.server_extra(algorithm.initial_server_state(start))
    return algorithm.client_update(model=model, data=data, cfg=cfg, server_extra=server_extra,
                                   client_state=client_state or {}, generator=torch.Generator().manual_seed(0))


def distance(a: StateDict, b: StateDict) -> float:
    return math.sqrt(sum(((a[k].double() - b[k].double()) ** 2).sum().item() for k in a if a[k].is_floating_point()))


# ---- FedProx -------------------------------------------------------------------------------------------------------


def test_fedprox_distance_from_the_global_model_shrinks_as_mu_grows(digits: TrainData) -> None:
    start = cnn().state_dict()
    cfg = LocalTrainConfig(lr=0.05, batch_size=32, max_steps=12)
    distances = [distance(one_round("fedprox", digits, cfg, start=start, mu=mu).state, start) for mu in (0.0, 0.1, 1.0, 10.0)]
    assert all(far > near for far, near in zip(distances, distances[1:])), distances
    assert distances[-1] < 0.5 * distances[0], distances  # mu = 10 holds the client well inside FedAvg's reach
    fedavg = one_round("fedavg", digits, cfg, start=start).state
    assert distance(fedavg, start) == pytest.approx(distances[0], rel=1e-6)  # mu = 0 is FedAvg


# ---- MOON ----------------------------------------------------------------------------------------------------------


def contrastive_gradient(start: StateDict, previous: StateDict, x: torch.Tensor) -> float:
    """Norm of d(contrastive term)/d(parameters) at the round's start, the global model `start`, against `previous`."""
    model, global_model, previous_model = cnn(), cnn(), cnn()
    model.load_state_dict(start)
    global_model.load_state_dict(start)
    previous_model.load_state_dict(previous)
    global_model.eval()
    previous_model.eval()
    model.train()
    with torch.no_grad():
        z_global, z_previous = global_model.features(x), previous_model.features(x)
    contrastive_loss(model.features(x), z_global, z_previous, 0.5).backward()
    return math.sqrt(sum((p.grad**2).sum().item() for p in model.parameters() if p.grad is not None))


def test_moon_contrastive_term_has_a_gradient_from_round_2_on_the_kept_previous_model(digits: TrainData) -> None:
    cfg = LocalTrainConfig(lr=0.05, batch_size=32, max_steps=8)
    round1_global = cnn().state_dict()
    round1 = one_round("moon", digits, cfg, start=round1_global, mu=5.0)
    assert set(round1.client_state) == set(round1.state)
    assert all(torch.equal(round1.client_state[k], round1.state[k]) for k in round1.state)  # the local model is kept
    round2_global = cnn(seed=1).state_dict()  # what aggregation sent back: not this client's own model
    x = digits.x[:64]
    assert contrastive_gradient(round2_global, round1.client_state, x) > 1e-3
    assert contrastive_gradient(round2_global, round2_global, x) == 0.0  # previous = global: log 2, no gradient

    # the term changes training from round 2 (and only then): same start, same batches, with and without the kept model
    with_previous = one_round("moon", digits, cfg, start=round2_global, client_state=round1.client_state, mu=5.0)
    without = one_round("moon", digits, cfg, start=round2_global, mu=5.0)
    fedavg = one_round("fedavg", digits, cfg, start=round2_global)
    assert distance(with_previous.state, fedavg.state) > 1e-2
    assert distance(without.state, fedavg.state) < 1e-4
    # round 3 keeps round 2's local model, not round 1's
    assert all(torch.equal(with_previous.client_state[k], with_previous.state[k]) for k in with_previous.state)


def test_moon_after_a_client_restart_falls_back_to_the_round_one_rule(digits: TrainData) -> None:
    """A restarted client process has no client state (it lives in memory): previous = global, like round 1."""
    cfg = LocalTrainConfig(lr=0.05, batch_size=32, max_steps=8)
    global_state = cnn(seed=2).state_dict()
    restarted = one_round("moon", digits, cfg, start=global_state, client_state={}, mu=5.0)
    fedavg = one_round("fedavg", digits, cfg, start=global_state)
    assert distance(restarted.state, fedavg.state) < 1e-4
    assert restarted.train_loss - fedavg.train_loss == pytest.approx(5.0 * math.log(2), abs=1e-4)
    assert set(restarted.client_state) == set(restarted.state)  # from the next round on it has a previous model again


# ---- SCAFFOLD ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("steps", "momentum"), [(1, 0.0), (1, 0.9), (7, 0.0), (7, 0.5), (30, 0.9)])
def test_effective_steps_is_the_sum_of_the_heavy_ball_weights(steps: int, momentum: float) -> None:
    weights = [sum(momentum**i for i in range(steps - j + 1)) for j in range(1, steps + 1)]  # step j: 1 + m + ... + m^(K-j)
    assert effective_steps(steps, momentum) == pytest.approx(sum(weights), rel=1e-12)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_scaffold_option_two_under_momentum_is_the_weighted_mean_of_the_local_gradients(digits: TrainData, momentum: float) -> None:
    """Full batches, so the round's gradients can be replayed: c_i+ must be sum_j w_j g_j / sum_j w_j, with w_j the
    weight heavy-ball SGD gives step j's gradient (1 for plain SGD), i.e. what option II estimates."""
    data = TrainData(digits.x[:64], digits.y[:64])
    steps, lr, weight_decay = 6, 0.05, 1e-3
    cfg = LocalTrainConfig(lr=lr, momentum=momentum, weight_decay=weight_decay, batch_size=64, max_steps=steps)
    start = cnn().state_dict()
    names = [name for name, _ in cnn().named_parameters()]
    generator = torch.Generator().manual_seed(4)
    server_c = {name: 0.1 * torch.randn(start[name].shape, generator=generator) for name in names}
    client_c = {name: 0.1 * torch.randn(start[name].shape, generator=generator) for name in names}
    update = one_round("scaffold", data, cfg, start=start, client_state=client_c, server_extra=server_c, num_clients=4)

    # the replay: the same corrected heavy-ball steps, recording each step's own gradient (weight decay included)
    model = cnn()
    model.load_state_dict(start)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    gradients = []
    for _ in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(model(data.x), data.y).backward()
        params = dict(model.named_parameters())
        gradients.append({n: params[n].grad.detach().clone() + weight_decay * params[n].detach() for n in names})
        for n in names:
            params[n].grad.add_(server_c[n] - client_c[n])
        optimizer.step()
    weights = [sum(momentum**i for i in range(steps - j + 1)) for j in range(1, steps + 1)]
    for n in names:
        expected = sum(w * g[n] for w, g in zip(weights, gradients)) / sum(weights)
        assert torch.allclose(update.client_state[n], expected, rtol=1e-3, atol=1e-4), n
        assert torch.allclose(update.extra[n], update.client_state[n] - client_c[n])
    # the uncorrected 1/(K lr) estimate would be sum(weights)/K times too large under momentum
    overstated = effective_steps(steps, momentum) / steps
    assert overstated == 1.0 if momentum == 0 else overstated > 2.5


def test_scaffold_with_zero_local_steps_keeps_c_i_and_sends_a_zero_delta(digits: TrainData) -> None:
    start = cnn().state_dict()
    algorithm = get_algorithm("scaffold", num_clients=2)
    server_c = algorithm.initial_server_state(start)
    server_c = {k: torch.full_like(v, 0.25) for k, v in server_c.items()}
    client_c = {name: torch.full_like(p, -0.5) for name, p in cnn().named_parameters()}
    cfg = LocalTrainConfig(lr=0.05, momentum=0.9, max_steps=0)
    update = one_round("scaffold", digits, cfg, start=start, client_state=client_c, server_extra=server_c, num_clients=2)
    assert update.num_steps == 0 and math.isnan(update.train_loss)
    assert all(torch.equal(update.state[k], start[k]) for k in start)  # no step: the model is the global one
    assert all(torch.equal(update.client_state[k], client_c[k]) for k in client_c)  # c_i unchanged
    assert set(update.extra) == set(client_c) and all(not v.any() for v in update.extra.values())  # delta c_i = 0
    aggregator = algorithm.new_aggregator(start, server_c)
    aggregator.add(update.state, update.extra, 10.0)
    new_global, new_c = aggregator.finish()
    assert all(torch.equal(new_global[k], start[k]) for k in start if start[k].is_floating_point())
    assert all(torch.equal(new_c[k], server_c[k]) for k in server_c)  # the server's c does not move either


# ---- MOON in a client node: the previous model lives in the node's memory ---------------------------------------------


class _Coordinator:
    """Stands in for the coordinator's stub: keeps each submitted model."""

    def __init__(self) -> None:
        self.models: list[StateDict] = []

    def SubmitUpdate(self, messages: list[pb.UpdateChunk | bytes], timeout: float) -> None:  # noqa: N802 - the gRPC name
        # the client frames its chunk messages by hand (fedsynth.wire.raw_messages): bytes, parsed here as the server would
        header, *chunks = [m if isinstance(m, pb.UpdateChunk) else pb.UpdateChunk.FromString(m) for m in messages]
        meta = codec.meta_of(header.header.payload)
        if header.header.inline_payload:  # an update that fits one chunk travels in its header
            assert not chunks
            data = bytes(receive_inline(meta, header.header.inline_payload).numpy())
        else:
            data = codec.assemble(meta, ((m.chunk.seq, m.chunk.data) for m in chunks))
        self.models.append(codec.split_prefixed(codec.decode(data))["model"])


def test_a_client_node_keeps_moons_previous_model_across_rounds_and_a_restarted_node_starts_without(
    digits: TrainData, tmp_path: Path
) -> None:
    cfg = load_config(None, ["train.algorithm=moon", "train.algorithm_params.mu=5.0", "train.max_steps=4",
                             "train.momentum=0.0", "generation.policy=none"])

    def node() -> LogicalClient:  # a client process as it is after start-up (no round yet)
        client = LogicalClient(0, NodeOptions("127.0.0.1:1", None, tmp_path), ClientMetrics(CollectorRegistry()), threading.Event())
        client.model, client.algorithm, client.num_classes = cnn(), algorithm_for(cfg), 10
        client.layout = codec.layout_of(client.model.state_dict())  # as _prepare sets it
        client.state = ClientState(cfg, np.zeros((1, 8, 8, 1), np.uint8), np.zeros(1, np.int64), data=digits)
        return client

    def send(client: LogicalClient, coordinator: _Coordinator, round_number: int, global_state: StateDict) -> StateDict:
        payload = codec.encode(codec.join_prefixed(model=global_state))
        meta = codec.describe(payload)
        task = pb.Task(round=round_number, task_id=f"t{round_number}", deadline_s=60.0,
                       payload=pb.Payload(total_bytes=meta.total_bytes, sha256=meta.sha256, num_chunks=meta.num_chunks))
        stream = iter([pb.ServerMessage(chunk=pb.Chunk(seq=seq, data=data)) for seq, data in codec.split(payload)])
        client._submit_update = coordinator.SubmitUpdate  # what run() sets up from the channel
        client._do_task(coordinator, "session", task, stream)
        return coordinator.models[-1]

    coordinator = _Coordinator()
    running = node()
    round1 = send(running, coordinator, 1, cnn().state_dict())
    kept = running.state.algorithm_state
    assert set(kept) == set(round1) and all(torch.equal(kept[k], round1[k]) for k in round1)  # the uploaded local model
    round2_global = cnn(seed=1).state_dict()
    kept_round2 = send(running, coordinator, 2, round2_global)
    assert all(torch.equal(running.state.algorithm_state[k], kept_round2[k]) for k in kept_round2)  # replaced each round

    restarted = node()  # a new process: the state above was in the old one's memory
    assert restarted.state.algorithm_state == {}
    fresh_round2 = send(restarted, _Coordinator(), 2, round2_global)
    assert distance(fresh_round2, kept_round2) > 1e-2  # the kept previous model changed round 2's training
    # the restarted node trained round 2 by the round-1 rule (previous = global): FedAvg's step, the same batches
    fedavg = get_algorithm("fedavg")
    model = cnn()
    model.load_state_dict(round2_global)
    reference = fedavg.client_update(model=model, data=digits, cfg=local_train_config(cfg), server_extra={}, client_state={},
                                     generator=round_generator(cfg, 0, 2)).state
    assert distance(fresh_round2, reference) < 1e-4


def test_moons_model_has_the_authors_projection_head_and_the_classifier_reads_its_output() -> None:
    cfg = load_config(None, ["train.algorithm=moon"])
    torch.manual_seed(0)
    model = model_for(cfg, num_classes=10, in_channels=1, image_size=8)
    assert isinstance(model, ProjectedModel)
    assert [tuple(p.shape) for p in model.projection.parameters()] == [(128, 128), (128,), (256, 128), (256,)]
    x = torch.randn(3, 1, 8, 8)
    z = model.features(x)
    assert z.shape == (3, 256) and torch.equal(model(x), model.classifier(z))
    # the contrastive term reaches the projection, the base and not the unused base classifier
    contrastive_loss(z, z.detach() + 1.0, z.detach() - 1.0, 0.5).backward()
    assert model.projection[0].weight.grad.abs().sum() > 0 and model.base.body[0].weight.grad.abs().sum() > 0
    assert model.base.classifier.weight.grad is None
    plain = model_for(load_config(None, ["train.algorithm=moon", "train.algorithm_params.projection_dim=0"]),
                      num_classes=10, in_channels=1, image_size=8)
    assert not isinstance(plain, ProjectedModel) and plain.features(x).shape == (3, 128)
    assert not isinstance(model_for(load_config(None, []), num_classes=10, in_channels=1, image_size=8), ProjectedModel)
