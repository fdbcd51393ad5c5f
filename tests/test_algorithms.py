"""Local training helpers, the streaming aggregator and FedAvg / FedProx / SCAFFOLD / MOON on real digits data."""

from __future__ import annotations

import gc
import math
import weakref
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedsynth.algorithms import ALGORITHMS, Aggregator, ClientUpdate, get_algorithm
from fedsynth.learning.data import load_dataset
from fedsynth.errors import ConfigError, DataError, StopRequested, WireError
from fedsynth.learning.models import build_model
from fedsynth.learning.training import LocalTrainConfig, TrainData, augment_batch, batches, evaluate, images_to_tensor

# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def digits() -> tuple[TrainData, TrainData]:
    train, test = load_dataset("digits", "train"), load_dataset("digits", "test")
    as_data = lambda ds: TrainData(images_to_tensor(ds.x), torch.from_numpy(ds.y))  # noqa: E731
    return as_data(train), as_data(test)


def digits_cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_model("cnn", num_classes=10, in_channels=1, image_size=8)


def run_update(algorithm_name: str, data: TrainData, cfg: LocalTrainConfig, *, seed: int = 0, model_seed: int = 0,
               client_state: dict[str, torch.Tensor] | None = None, server_state: dict[str, torch.Tensor] | None = None,
               **params: object) -> tuple[ClientUpdate, dict[str, torch.Tensor]]:
    """One client round from a seeded global model; returns the update and the global state it started from."""
    algorithm = get_algorithm(algorithm_name, **params)
    model = digits_cnn(model_seed)
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    if server_state is None:
        server_state = algorithm.initial_server_state(global_state)
    update = algorithm.client_update(
        model=model, data=data, cfg=cfg, server_extra=algorithm.server_extra(server_state),
        client_state=client_state or {}, generator=torch.Generator().manual_seed(seed),
    )
    return update, global_state


def assert_states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# ---------------------------------------------------------------- training helpers


def test_images_to_tensor_scales_to_minus_one_one_in_nchw() -> None:
    x = np.zeros((2, 4, 5, 3), dtype=np.uint8)
    x[0, 1, 2, :] = [0, 255, 51]
    tensor = images_to_tensor(x)
    assert tensor.dtype == torch.float32 and tensor.shape == (2, 3, 4, 5)
    assert tensor[0, :, 1, 2].tolist() == pytest.approx([-1.0, 1.0, 51 / 127.5 - 1])
    with pytest.raises(DataError, match="float64"):
        images_to_tensor(x.astype(np.float64))


@pytest.mark.parametrize(
    ("field", "value"),
    [("lr", 0.0), ("lr", float("nan")), ("momentum", 1.0), ("momentum", -0.1), ("weight_decay", -1e-4),
     ("batch_size", 0), ("batch_size", 2.5), ("local_epochs", 0), ("augment", "yes"), ("max_steps", -1)],
)
def test_bad_local_train_config_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        LocalTrainConfig(**{field: value})  # type: ignore[arg-type]


def test_batches_cover_every_sample_once_in_a_seeded_order() -> None:
    data = TrainData(torch.arange(10.0).reshape(10, 1, 1, 1), torch.arange(10))
    epoch = list(batches(data, 4, torch.Generator().manual_seed(3)))
    assert [len(y) for _, y in epoch] == [4, 4, 2]
    seen = torch.cat([y for _, y in epoch])
    assert sorted(seen.tolist()) == list(range(10))
    assert all(torch.equal(x.flatten(), y.float()) for x, y in epoch)  # images stay with their labels
    again = torch.cat([y for _, y in batches(data, 4, torch.Generator().manual_seed(3))])
    other = torch.cat([y for _, y in batches(data, 4, torch.Generator().manual_seed(4))])
    assert torch.equal(seen, again) and not torch.equal(seen, other)


def test_augment_batch_returns_a_crop_or_flipped_crop_of_each_image() -> None:
    x = torch.rand(6, 3, 32, 32) * 2 - 1
    out = augment_batch(x, torch.Generator().manual_seed(0))
    assert out.shape == x.shape
    padded = F.pad(x, (4, 4, 4, 4), value=-1.0)
    for i in range(len(x)):
        candidates = [padded[i, :, r : r + 32, c : c + 32] for r in range(9) for c in range(9)]
        candidates += [crop.flip(2) for crop in candidates]
        assert any(torch.equal(out[i], crop) for crop in candidates)
    assert not torch.equal(out, x)
    assert torch.equal(out, augment_batch(x, torch.Generator().manual_seed(0)))
    small = torch.rand(3, 1, 8, 8)
    assert torch.equal(augment_batch(small, torch.Generator().manual_seed(0)), small)


def test_evaluate_matches_a_direct_computation_and_keeps_the_mode(digits: tuple[TrainData, TrainData]) -> None:
    _, test = digits
    model = digits_cnn().train()
    loss, accuracy = evaluate(model, test, batch_size=100)
    assert model.training
    with torch.no_grad():
        logits = model(test.x)
    assert loss == pytest.approx(F.cross_entropy(logits, test.y).item(), rel=1e-5)
    assert accuracy == pytest.approx((logits.argmax(1) == test.y).float().mean().item())


# ---------------------------------------------------------------- the streaming aggregator


def small_bn_state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    state = {k: v.clone() for k, v in module.state_dict().items()}
    state["1.running_mean"].normal_()
    state["1.num_batches_tracked"].fill_(10 * seed)
    return state


def test_aggregator_equals_the_dataset_size_weighted_mean() -> None:
    states = [small_bn_state(seed) for seed in range(1, 6)]
    sizes = [120, np.int64(7), 33, 400, 51]  # label-count sums arrive as numpy integers
    aggregator = Aggregator(states[0], {})
    for state, size in zip(states, sizes):
        aggregator.add(state, {}, size)
    new_global, server_state = aggregator.finish()
    assert aggregator.count == 5 and server_state == {}
    total = sum(sizes)
    for key, template in states[0].items():
        expected = sum(s[key].double() * n for s, n in zip(states, sizes)) / total
        assert new_global[key].dtype == template.dtype and new_global[key].shape == template.shape
        if template.is_floating_point():
            assert torch.allclose(new_global[key].double(), expected, atol=1e-6), key
        else:  # num_batches_tracked: weighted mean rounded to the nearest integer
            assert new_global[key].item() == round(expected.item())


def test_aggregator_streams_without_keeping_client_states() -> None:
    template = small_bn_state(0)
    aggregator = Aggregator(template, {})
    kept_alive = []

    def updates() -> Iterator[dict[str, torch.Tensor]]:
        for seed in range(50):
            state = {k: v + seed for k, v in template.items()}
            kept_alive.append(weakref.ref(state["0.weight"]))
            yield state

    for state in updates():
        aggregator.add(state, {}, 1.0)
    del state
    gc.collect()
    assert aggregator.count == 50
    assert all(ref() is None for ref in kept_alive)  # no added tensor is referenced by the aggregator
    new_global, _ = aggregator.finish()
    assert torch.allclose(new_global["0.weight"], template["0.weight"] + 24.5, atol=1e-5)


def test_aggregator_rejects_bad_rounds_and_updates() -> None:
    template = small_bn_state(0)
    with pytest.raises(ValueError, match="zero client updates"):
        Aggregator(template, {}).finish()
    aggregator = Aggregator(template, {})
    with pytest.raises(WireError, match="missing keys.*1.running_var"):
        aggregator.add({k: v for k, v in template.items() if k != "1.running_var"}, {}, 1.0)
    with pytest.raises(WireError, match="'0.weight' has shape"):
        aggregator.add({**template, "0.weight": torch.zeros(3)}, {}, 1.0)
    with pytest.raises(WireError, match="'0.bias' holds NaN"):
        aggregator.add({**template, "0.bias": torch.full((2,), float("nan"))}, {}, 1.0)
    with pytest.raises(ValueError, match="weight"):
        aggregator.add(template, {}, 0.0)
    with pytest.raises(WireError, match="no extra tensors"):
        aggregator.add(template, {"c": torch.zeros(1)}, 1.0)
    assert aggregator.count == 0


# ---------------------------------------------------------------- the algorithms


def test_registry_names_bad_algorithms_and_parameters() -> None:
    assert {"fedavg", "fedprox", "scaffold", "moon"} <= set(ALGORITHMS)
    with pytest.raises(ConfigError, match="'fedsgd'"):
        get_algorithm("fedsgd")
    with pytest.raises(ConfigError, match="'mu'"):
        get_algorithm("fedavg", mu=0.1)
    with pytest.raises(ConfigError, match="num_clients"):
        get_algorithm("scaffold")
    with pytest.raises(ConfigError, match="mu"):
        get_algorithm("fedprox", mu=-1.0)
    with pytest.raises(ConfigError, match="temperature"):
        get_algorithm("moon", temperature=0.0)


def test_fedavg_training_on_digits_beats_chance_by_far(digits: tuple[TrainData, TrainData]) -> None:
    train, test = digits
    update, _ = run_update("fedavg", train, LocalTrainConfig(lr=0.05, momentum=0.9, batch_size=32, local_epochs=5))
    model = digits_cnn()
    model.load_state_dict(update.state)
    _, accuracy = evaluate(model, test)
    assert accuracy > 0.85  # chance is 0.10
    assert update.num_steps == 5 * math.ceil(len(train) / 32)


@pytest.mark.parametrize(("max_steps", "expected"), [(None, 6), (5, 5), (1, 1), (50, 6)])
def test_max_steps_caps_the_round_across_epochs(max_steps: int | None, expected: int) -> None:
    data = TrainData(torch.rand(20, 1, 8, 8), torch.randint(0, 10, (20,)))
    cfg = LocalTrainConfig(lr=0.01, batch_size=10, local_epochs=3, max_steps=max_steps)
    update, _ = run_update("fedavg", data, cfg)
    assert update.num_steps == expected and math.isfinite(update.train_loss)


# ddpm trains a UNet (tests/test_federated_generator.py); pe votes in milliseconds, training nothing (tests/test_private_evolution.py)
@pytest.mark.parametrize("name", sorted(set(ALGORITHMS) - {"ddpm", "pe"}))
def test_a_stop_request_ends_local_training_between_steps(name: str) -> None:
    data = TrainData(torch.rand(20, 1, 8, 8), torch.randint(0, 10, (20,)))
    asked: list[int] = []
    cfg = LocalTrainConfig(lr=0.01, batch_size=10, local_epochs=100, should_stop=lambda: asked.append(1) or len(asked) > 3)
    params = {"num_clients": 4} if name == "scaffold" else {}
    with pytest.raises(StopRequested, match="after 3 optimizer steps"):
        run_update(name, data, cfg, **params)
    assert len(asked) == 4  # asked before every step: three steps ran, the fourth never started


@pytest.mark.parametrize("name", ["fedavg", "scaffold", "moon"])
def test_same_generator_seed_gives_identical_weights(name: str) -> None:
    torch.manual_seed(1)
    data = TrainData(torch.rand(40, 3, 32, 32) * 2 - 1, torch.randint(0, 10, (40,)))
    params = {"num_clients": 4} if name == "scaffold" else {}
    cfg = LocalTrainConfig(lr=0.05, batch_size=16, local_epochs=2, augment=True)

    def update(seed: int) -> ClientUpdate:
        algorithm = get_algorithm(name, **params)
        torch.manual_seed(0)
        model = build_model("cnn", num_classes=10, in_channels=3, image_size=32)
        server_state = algorithm.initial_server_state(model.state_dict())
        return algorithm.client_update(model=model, data=data, cfg=cfg, server_extra=algorithm.server_extra(server_state),
                                       client_state={}, generator=torch.Generator().manual_seed(seed))

    first, again, other = update(5), update(5), update(6)
    assert_states_equal(first.state, again.state)
    assert_states_equal(first.extra, again.extra)
    assert not torch.equal(first.state["classifier.weight"], other.state["classifier.weight"])


def test_fedprox_with_mu_zero_equals_fedavg_and_mu_pulls_towards_the_global(digits: tuple[TrainData, TrainData]) -> None:
    train, _ = digits
    cfg = LocalTrainConfig(lr=0.05, max_steps=15)
    fedavg, global_state = run_update("fedavg", train, cfg)
    prox_zero, _ = run_update("fedprox", train, cfg, mu=0.0)
    assert_states_equal(prox_zero.state, fedavg.state)
    prox_strong, _ = run_update("fedprox", train, cfg, mu=5.0)

    def distance(state: dict[str, torch.Tensor]) -> float:
        return sum(((state[k] - global_state[k]) ** 2).sum().item() for k in state) ** 0.5

    assert distance(prox_strong.state) < 0.8 * distance(fedavg.state)


def test_scaffold_with_zero_control_variates_takes_fedavgs_first_step(digits: tuple[TrainData, TrainData]) -> None:
    train, _ = digits
    cfg = LocalTrainConfig(lr=0.05, max_steps=1)
    fedavg, global_state = run_update("fedavg", train, cfg)
    scaffold, _ = run_update("scaffold", train, cfg, num_clients=10)
    assert_states_equal(scaffold.state, fedavg.state)
    # option II with c = c_i = 0: c_i+ = (x - y_i) / (K lr); the upload is c_i+ - c_i
    for key, delta in scaffold.extra.items():
        expected = (global_state[key] - scaffold.state[key]) / (1 * cfg.lr)
        assert torch.allclose(delta, expected, atol=1e-5), key
        assert torch.equal(scaffold.client_state[key], delta)


def test_scaffold_step_is_corrected_by_c_minus_c_i(digits: tuple[TrainData, TrainData]) -> None:
    train, _ = digits
    cfg = LocalTrainConfig(lr=0.05, max_steps=1)
    fedavg, global_state = run_update("fedavg", train, cfg)
    generator = torch.Generator().manual_seed(9)
    server_c = {k: torch.randn(v.shape, generator=generator) for k, v in global_state.items()}
    client_c = {k: torch.randn(v.shape, generator=generator) for k, v in global_state.items()}
    scaffold, _ = run_update("scaffold", train, cfg, num_clients=10, server_state=server_c, client_state=client_c)
    for key in global_state:
        expected = fedavg.state[key] - cfg.lr * (server_c[key] - client_c[key])
        assert torch.allclose(scaffold.state[key], expected, atol=1e-5), key
        new_c = client_c[key] - server_c[key] + (global_state[key] - scaffold.state[key]) / cfg.lr
        assert torch.allclose(scaffold.client_state[key], new_c, atol=1e-4), key


def test_scaffold_server_averages_models_and_moves_c_by_sampled_fraction() -> None:
    algorithm = get_algorithm("scaffold", num_clients=8)
    global_state = small_bn_state(0)
    c = algorithm.initial_server_state(global_state)
    assert set(c) == {k for k, v in global_state.items() if v.is_floating_point()}
    assert all(not v.any() for v in c.values())
    states = [small_bn_state(seed) for seed in (1, 2)]
    deltas = [{"0.weight": torch.full((2, 1, 3, 3), value), "0.bias": torch.full((2,), value)} for value in (1.0, 3.0)]
    aggregator, reference = algorithm.new_aggregator(global_state, c), Aggregator(global_state, {})
    for state, delta, size in zip(states, deltas, (10, 30)):
        aggregator.add(state, delta, size)
        reference.add(state, {}, size)
    new_global, new_c = aggregator.finish()
    assert_states_equal(new_global, reference.finish()[0])  # global lr 1 is FedAvg's weighted mean
    assert torch.allclose(new_c["0.weight"], torch.full((2, 1, 3, 3), (1.0 + 3.0) / 8))  # (|S|/N) * mean
    assert not new_c["1.running_mean"].any()
    mixed = algorithm.new_aggregator(global_state, c)
    mixed.add(states[0], deltas[0], 1.0)
    with pytest.raises(WireError, match="differ between clients"):
        mixed.add(states[1], {"0.weight": deltas[1]["0.weight"]}, 1.0)
    with pytest.raises(WireError, match="no control variate for.*'0.extra'"):
        mixed.add(states[1], {**deltas[1], "0.extra": torch.zeros(1)}, 1.0)
    assert mixed.count == 1


def test_scaffold_global_lr_scales_the_server_step() -> None:
    global_state, client = small_bn_state(0), small_bn_state(1)
    aggregator = get_algorithm("scaffold", num_clients=2, global_lr=0.5).new_aggregator(global_state, {})
    aggregator.add(client, {}, 1.0)
    new_global, _ = aggregator.finish()
    assert torch.allclose(new_global["0.weight"], (global_state["0.weight"] + client["0.weight"]) / 2, atol=1e-6)


def test_moon_loss_includes_the_contrastive_term(digits: tuple[TrainData, TrainData]) -> None:
    train, _ = digits
    cfg = LocalTrainConfig(lr=0.05, batch_size=64, max_steps=1)
    fedavg, _ = run_update("fedavg", train, cfg)
    # first round: the global model doubles as the previous one, so the term is exactly log 2 and has no gradient
    first, _ = run_update("moon", train, cfg, mu=2.0)
    assert first.train_loss - fedavg.train_loss == pytest.approx(2.0 * math.log(2), abs=1e-5)
    for key in fedavg.state:
        assert torch.allclose(first.state[key], fedavg.state[key], atol=1e-6), key

    previous_state = digits_cnn(seed=3).state_dict()
    second, _ = run_update("moon", train, cfg, mu=2.0, client_state=previous_state)
    x, _ = next(batches(train, cfg.batch_size, torch.Generator().manual_seed(0)))
    previous = digits_cnn()
    previous.load_state_dict(previous_state)
    with torch.no_grad():
        z = digits_cnn().features(x)
        z_previous = previous.features(x)
    similarity_previous = F.cosine_similarity(z, z_previous, dim=1) / 0.5
    similarity_global = torch.full_like(similarity_previous, 1.0 / 0.5)  # the local model starts at the global
    expected_term = -torch.log(similarity_global.exp() / (similarity_global.exp() + similarity_previous.exp())).mean()
    assert abs(expected_term.item() - math.log(2)) > 0.05  # a distinct previous model changes the term
    assert second.train_loss - fedavg.train_loss == pytest.approx(2.0 * expected_term.item(), abs=1e-4)
    assert_states_equal(second.client_state, second.state)
    assert not torch.allclose(second.state["body.0.weight"], fedavg.state["body.0.weight"])
