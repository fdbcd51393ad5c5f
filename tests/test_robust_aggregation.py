"""Robust aggregation rules (fedsynth.algorithms.robust) against numpy on small random updates, and their config
refusals. Pure tensors, no processes."""

from __future__ import annotations

import itertools
import logging
import random

import numpy as np
import pytest
import torch

from fedsynth.algorithms import get_algorithm
from fedsynth.algorithms.base import Aggregator
from fedsynth.algorithms.robust import PLAIN_MEAN_ALGORITHMS, RobustAggregator, aggregator_for
from fedsynth.config import load_config
from fedsynth.config_schema import ALGORITHMS
from fedsynth.errors import ConfigError, WireError

SHAPES = {"conv.weight": (3, 2, 2), "conv.bias": (3,), "bn.num_batches_tracked": ()}


def global_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"conv.weight": torch.randn(3, 2, 2, generator=g), "conv.bias": torch.randn(3, generator=g),
            "bn.num_batches_tracked": torch.tensor(10)}


def updates(n: int, seed: int = 1, spread: float = 0.1) -> list[dict[str, torch.Tensor]]:
    base = global_state()
    g = torch.Generator().manual_seed(seed)
    return [{"conv.weight": base["conv.weight"] + spread * torch.randn(3, 2, 2, generator=g),
             "conv.bias": base["conv.bias"] + spread * torch.randn(3, generator=g),
             "bn.num_batches_tracked": torch.tensor(10 + 5 * (i + 1))} for i in range(n)]


def flat(state: dict[str, torch.Tensor]) -> np.ndarray:
    return np.concatenate([state["conv.weight"].numpy().ravel(), state["conv.bias"].numpy().ravel()]).astype(np.float64)


def aggregate(rule: str, states: list[dict[str, torch.Tensor]], weights: list[float] | None = None,
              params: dict[str, float] | None = None) -> tuple[dict[str, torch.Tensor], RobustAggregator]:
    agg = RobustAggregator(global_state(), {}, rule=rule, params=params)
    for state, weight in zip(states, weights or [1.0] * len(states)):
        agg.add(state, {}, weight)
    new, server = agg.finish()
    assert server == {}
    assert agg.count == len(states)
    return new, agg


def assert_result(new: dict[str, torch.Tensor], expected: np.ndarray) -> None:
    assert new["conv.weight"].dtype == torch.float32 and new["conv.weight"].shape == (3, 2, 2)
    np.testing.assert_allclose(flat(new), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n", [1, 4, 5])
def test_median_is_numpys_coordinatewise_median(n: int) -> None:
    states = updates(n)
    new, _ = aggregate("median", states, weights=[float(i + 1) for i in range(n)])  # weights ignored
    assert_result(new, np.median(np.stack([flat(s) for s in states]), axis=0))


@pytest.mark.parametrize(("n", "beta"), [(5, 0.1), (5, 0.2), (10, 0.25), (7, 0.49)])
def test_trimmed_mean_drops_floor_beta_n_at_each_end(n: int, beta: float) -> None:
    states = updates(n)
    new, agg = aggregate("trimmed_mean", states, params={"beta": beta})
    k = int(np.floor(beta * n))
    assert agg.effective == {"k": k}
    values = np.sort(np.stack([flat(s) for s in states]), axis=0)
    assert_result(new, values[k : n - k].mean(axis=0))


def test_trimmed_mean_default_beta_on_a_small_round_is_the_plain_mean_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    states = updates(4)
    with caplog.at_level(logging.WARNING):
        new, _ = aggregate("trimmed_mean", states)
    assert "n=4" in caplog.text and "beta=0.1" in caplog.text
    assert_result(new, np.stack([flat(s) for s in states]).mean(axis=0))


def numpy_krum_scores(vectors: np.ndarray, f: int) -> np.ndarray:
    n = len(vectors)
    distances = ((vectors[:, None, :] - vectors[None, :, :]) ** 2).sum(axis=2)
    return np.array([np.sort(np.delete(distances[i], i))[: n - f - 2].sum() for i in range(n)])


@pytest.mark.parametrize(("n", "f"), [(7, 2), (7, 1), (10, 3), (5, 0)])
def test_krum_picks_numpys_lowest_score(n: int, f: int) -> None:
    states = updates(n, spread=1.0)
    new, agg = aggregate("krum", states, params={"f": f})
    f_used = f or (n - 3) // 2
    vectors = np.stack([flat(s) for s in states])
    best = int(np.argmin(numpy_krum_scores(vectors, f_used)))
    assert agg.effective == {"f": f_used}
    assert_result(new, vectors[best])


@pytest.mark.parametrize(("n", "f", "m"), [(7, 2, 0), (7, 1, 3), (9, 0, 4)])
def test_multi_krum_averages_the_m_best_weighted(n: int, f: int, m: int) -> None:
    states = updates(n, spread=1.0)
    weights = [float(10 + 7 * i) for i in range(n)]
    new, agg = aggregate("multi_krum", states, weights=weights, params={"f": f, "m": m})
    f_used = f or (n - 3) // 2
    m_used = m or n - f_used
    vectors = np.stack([flat(s) for s in states])
    chosen = np.argsort(numpy_krum_scores(vectors, f_used), kind="stable")[:m_used]
    w = np.array(weights)[chosen]
    assert agg.effective == {"f": f_used, "m": m_used}
    assert_result(new, (vectors[chosen] * w[:, None]).sum(axis=0) / w.sum())


def attacked(n: int = 7, bad: int = 4) -> list[dict[str, torch.Tensor]]:
    """n updates, update `bad` moved 1,000 times as far from the global state as it trained."""
    g = global_state()
    states = updates(n)
    states[bad] = {key: g[key] + 1000 * (value - g[key]) if value.is_floating_point() else value
                   for key, value in states[bad].items()}
    return states


def test_krum_picks_an_honest_update_when_one_of_7_is_scaled_1000_times() -> None:
    states = attacked()
    new, _ = aggregate("krum", states)
    honest = [flat(s) for i, s in enumerate(states) if i != 4]
    assert any(np.allclose(flat(new), h, atol=1e-6) for h in honest)


def test_multi_krum_leaves_the_scaled_update_out() -> None:
    states = attacked()
    weights = [float(i + 1) for i in range(7)]
    new, agg = aggregate("multi_krum", states, weights=weights, params={"m": 4})
    assert agg.effective == {"f": 2, "m": 4}
    assert np.abs(flat(new) - flat(global_state())).max() < 1.0  # the scaled one moves coordinates by ~100
    mean = aggregate("multi_krum", states, weights=weights, params={"f": 0, "m": 0})[0]  # m = n - f = 5 of the 6 honest
    assert np.abs(flat(mean) - flat(global_state())).max() < 1.0


@pytest.mark.parametrize("rule", ["median", "trimmed_mean"])
def test_median_and_trimmed_mean_survive_the_scaled_update(rule: str) -> None:
    new, _ = aggregate(rule, attacked(), params={"beta": 0.2} if rule == "trimmed_mean" else None)
    assert np.abs(flat(new) - flat(global_state())).max() < 1.0


@pytest.mark.parametrize("rule", ["median", "trimmed_mean", "krum", "multi_krum"])
def test_the_result_does_not_depend_on_arrival_order(rule: str) -> None:
    states = updates(6, spread=0.5)
    states.append({key: value.clone() for key, value in states[2].items()})  # an exact duplicate: a Krum tie
    weights = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 4.0]
    params = {"beta": 0.2} if rule == "trimmed_mean" else None
    reference, _ = aggregate(rule, states, weights, params)
    orders = list(itertools.permutations(range(7)))
    for order in random.Random(0).sample(orders, 12):
        new, _ = aggregate(rule, [states[i] for i in order], [weights[i] for i in order], params)
        for key in reference:
            assert torch.equal(new[key], reference[key]), (order, key)


@pytest.mark.parametrize("rule", ["median", "trimmed_mean", "krum", "multi_krum"])
def test_a_delta_update_and_the_same_update_absolute_give_the_same_result(rule: str) -> None:
    g = global_state()
    states = updates(5)
    absolute, _ = aggregate(rule, states)
    agg = RobustAggregator(g, {}, rule=rule)
    for state in states:
        agg.add({key: value - g[key] if value.is_floating_point() else value for key, value in state.items()}, {}, 1.0, deltas=True)
    from_deltas, _ = agg.finish()
    for key in absolute:
        torch.testing.assert_close(from_deltas[key], absolute[key], rtol=0, atol=1e-6)


def test_a_clipped_update_is_held_scaled_toward_the_global_state() -> None:
    g = global_state()
    state = updates(1)[0]
    for deltas in (False, True):
        agg = RobustAggregator(g, {}, rule="median")
        sent = {key: value - g[key] if deltas and value.is_floating_point() else value for key, value in state.items()}
        agg.add(sent, {}, 2.0, deltas=deltas, scale=0.25)
        new, _ = agg.finish()
        expected = flat(g) + 0.25 * (flat(state) - flat(g))
        assert_result(new, expected)
        assert int(new["bn.num_batches_tracked"]) == int(state["bn.num_batches_tracked"])  # integers count in full


def test_integer_tensors_get_the_weighted_mean_rounded_like_the_base_class() -> None:
    states = updates(3)
    weights = [1.0, 2.0, 4.0]
    new, _ = aggregate("median", states, weights)
    base = Aggregator(global_state())
    for state, weight in zip(states, weights):
        base.add(state, {}, weight)
    assert new["bn.num_batches_tracked"].dtype == torch.int64
    assert torch.equal(new["bn.num_batches_tracked"], base.finish()[0]["bn.num_batches_tracked"])


def test_the_receive_buffer_may_be_reused_after_add() -> None:
    states = updates(3)
    agg = RobustAggregator(global_state(), {}, rule="median")
    for state in states:
        buffer = {key: value.clone() for key, value in state.items()}
        agg.add(buffer, {}, 1.0)
        for value in buffer.values():
            value.zero_()
    assert_result(agg.finish()[0], np.median(np.stack([flat(s) for s in states]), axis=0))


def test_a_non_empty_extra_and_a_bad_layout_are_refused() -> None:
    agg = RobustAggregator(global_state(), {}, rule="median")
    with pytest.raises(WireError, match="extra"):
        agg.add(updates(1)[0], {"c": torch.zeros(3)}, 1.0)
    with pytest.raises(WireError, match="conv.bias"):
        agg.add({**updates(1)[0], "conv.bias": torch.zeros(4)}, {}, 1.0)
    with pytest.raises(ValueError, match="weight"):
        agg.add(updates(1)[0], {}, 0.0)
    assert agg.count == 0
    with pytest.raises(ValueError, match="zero client updates"):
        agg.finish()


def test_too_few_updates_for_f_use_the_most_the_round_allows_and_say_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        _, agg = aggregate("krum", updates(5), params={"f": 3})
    assert agg.effective == {"f": 1}
    assert "f=3" in caplog.text and "n=5" in caplog.text and "using f=1" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _, agg = aggregate("multi_krum", updates(7), params={"f": 1, "m": 9})
    assert agg.effective == {"f": 1, "m": 6} and "m=9" in caplog.text
    for n in (1, 2):  # nothing to compare: one of them, by the canonical order
        new, agg = aggregate("krum", updates(n))
        assert len(agg.selected) == 1


def test_bad_parameters_are_a_config_error() -> None:
    with pytest.raises(ConfigError, match="beta"):
        RobustAggregator(global_state(), rule="trimmed_mean", params={"beta": 0.5})
    with pytest.raises(ConfigError, match="no such parameter"):
        RobustAggregator(global_state(), rule="median", params={"f": 1})
    with pytest.raises(ConfigError, match="mean"):
        RobustAggregator(global_state(), rule="mean")


def test_aggregator_for_picks_the_algorithms_own_for_the_mean() -> None:
    fedavg = get_algorithm("fedavg")
    g = global_state()
    assert type(aggregator_for(load_config(None, []).train, fedavg, g, {})) is Aggregator
    robust = aggregator_for(load_config(None, ["train.aggregation=\"krum\"", "train.aggregation_params={f=1}"]).train, fedavg, g, {})
    assert isinstance(robust, RobustAggregator) and robust.rule == "krum" and robust.f == 1
    scaffold = get_algorithm("scaffold", num_clients=4)
    with pytest.raises(ConfigError, match="train.aggregation"):
        aggregator_for(load_config(None, ["train.aggregation=\"median\""]).train, scaffold, g, scaffold.initial_server_state(g))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_config_refuses_a_robust_rule_for_algorithms_beyond_the_plain_mean(algorithm: str) -> None:
    settings = [f"train.algorithm=\"{algorithm}\""]
    if algorithm == "ddpm":
        settings += ["train.model=\"unet-tiny\"", "generation.policy=\"none\""]
    if algorithm == "pe":
        settings += ["train.model=\"pe-votes\"", "generation.policy=\"none\"", "generation.model_dir=\"/public/model\""]
    load_config(None, settings)  # the mean is fine for every algorithm
    robust = [*settings, "train.aggregation=\"median\""]
    if algorithm in PLAIN_MEAN_ALGORITHMS:
        assert load_config(None, robust).train.aggregation == "median"
        return
    with pytest.raises(ConfigError) as refused:
        load_config(None, robust)
    assert "train.aggregation" in str(refused.value) and "train.algorithm" in str(refused.value)
    assert repr(algorithm) in str(refused.value)
