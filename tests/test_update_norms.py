"""Bounded updates: the norm an update is judged by, the verdicts, a clipped fold, and the N_k limit at registration."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
from prometheus_client import CollectorRegistry

from coordinator.metrics import CoordinatorMetrics
from coordinator.registry import ClientRegistry
from coordinator.update_norms import MAX_INTEGER_STEP, NormBound, update_norm
from fedsynth.algorithms.base import Aggregator
from fedsynth.algorithms.scaffold import ScaffoldAggregator
from fedsynth.config import load_config
from fedsynth.errors import StateError, WireError
from fedsynth.learning.models import build_model
from fedsynth.wire import wire_dtype

StateDict = dict[str, torch.Tensor]


def states(seed: int = 0) -> tuple[StateDict, StateDict]:
    """(global, local): two float tensors and BatchNorm's integer counter."""
    g = torch.Generator().manual_seed(seed)
    global_state = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g), "n": torch.tensor(5)}
    local = {"w": global_state["w"] + 0.1 * torch.randn(4, 3, generator=g), "b": global_state["b"] + 0.1 * torch.randn(3, generator=g),
             "n": torch.tensor(9)}
    return global_state, local


def bound(**runtime: object) -> NormBound:
    return NormBound(load_config(None, [f"runtime.{k}={v!r}".replace("'", '"') for k, v in runtime.items()]).runtime)


def test_the_norm_is_the_distance_of_every_float_tensor_from_the_global_model() -> None:
    global_state, local = states()
    expected = math.sqrt(sum(float(((local[k] - global_state[k]).double() ** 2).sum()) for k in ("w", "b")))  # not "n"
    assert update_norm(local, {}, global_state, deltas=False) == pytest.approx(expected, rel=1e-12)
    # the same update as float16 deltas: the same distance, up to float16's rounding of the differences
    model, _ = wire_dtype.outgoing(local, {}, global_state, "float16")
    assert update_norm(model, {}, global_state, deltas=True) == pytest.approx(expected, rel=1e-3)
    # extra tensors (SCAFFOLD's delta c_i) are differences already: they count as they are
    extra = {"w": torch.full((4, 3), 2.0)}
    assert update_norm(local, extra, global_state, deltas=False) == pytest.approx(math.sqrt(expected**2 + 12 * 4.0), rel=1e-12)


def test_a_number_clips_onto_the_bound_or_refuses() -> None:
    clip = bound(max_update_norm=2.0, update_norm_action="clip")
    assert clip.enabled and not clip.auto and clip.bound() == 2.0
    assert clip.verdict(1.5, 2.0).action == "accepted" and clip.verdict(2.0, 2.0).scale == 1.0
    clipped = clip.verdict(2000.0, 2.0)
    assert clipped.action == "clipped" and clipped.scale == pytest.approx(1e-3)
    assert "client 3" in clipped.describe(3, 7) and "round 7" in clipped.describe(3, 7) and "2000" in clipped.describe(3, 7)
    refuse = bound(max_update_norm=2.0)  # the default action
    assert refuse.verdict(2.5, 2.0).action == "refused" and refuse.verdict(2.5, 2.0).scale == 0.0
    assert not bound().enabled  # off by default


def test_auto_is_the_factor_times_the_median_of_the_rounds_norms() -> None:
    auto = bound(max_update_norm="auto", max_update_norm_factor=5.0, update_norm_action="clip")
    norms = [1.0, 1.2, 0.8, 1.1, 1000.0]  # one client sends 1,000 times the others' norm
    assert auto.bound(norms) == pytest.approx(5.0 * 1.1)
    verdicts = [auto.verdict(n, auto.bound(norms)) for n in norms]
    assert [v.action for v in verdicts] == ["accepted"] * 4 + ["clipped"]
    assert verdicts[-1].scale * 1000.0 == pytest.approx(5.5)
    with pytest.raises(ValueError):
        auto.bound([])


def test_auto_bounds_a_round_of_one_or_two_updates_by_the_rounds_before_it() -> None:
    auto = bound(max_update_norm="auto", max_update_norm_factor=10.0)
    assert auto.bound([1000.0]) == pytest.approx(10_000.0)  # the first round has only itself: nothing is refused
    auto.remember({0: 1.0, 1: 1.2, 2: 0.9, 3: 1000.0}, [3])  # a round whose 1000x update was refused
    auto.remember({0: 1.1, 3: 900.0}, [])  # a round of two whose large update was (too loosely) accepted
    # alone, or beside one honest update, the 1000x update is now judged against the rounds before it
    assert auto.verdict(1000.0, auto.bound([1000.0])).action == "refused"
    assert auto.verdict(1000.0, auto.bound([1.0, 1000.0])).action == "refused"
    assert auto.verdict(1.3, auto.bound([1.0, 1000.0])).action == "accepted"
    for _ in range(3):  # only the last three rounds count
        auto.remember({0: 5.0, 1: 5.0}, [])
    assert auto.bound([5.0]) == pytest.approx(50.0)
    # a resumed run rebuilds the same reference from its history's records
    history = [{"round": r, "update_norms": {"norms": {"0": 1.0, "1": 2.0, "3": 50.0}, "refused": [3], "clipped": [1]}}
               for r in range(1, 6)] + [{"round": 6}]
    resumed = bound(max_update_norm="auto")
    resumed.restore(history)
    assert [list(r) for r in resumed.recent] == [[1.0], [1.0], []]


@pytest.mark.parametrize("deltas", [False, True])
def test_a_clipped_update_moves_the_global_model_scale_times_as_far(deltas: bool) -> None:
    global_state, local = states()
    _, other = states(seed=1)  # another client's new weights
    scale = 0.25
    aggregator = Aggregator(global_state)
    sent = wire_dtype.outgoing(local, {}, global_state, "float16")[0] if deltas else local
    aggregator.add(sent, {}, 3.0, deltas=deltas, scale=scale)
    aggregator.add(other, {}, 1.0)
    mean, _ = aggregator.finish()
    for key in ("w", "b"):
        clipped = global_state[key].double() + scale * (local[key].double() - global_state[key].double())
        expected = (3.0 * clipped + 1.0 * other[key].double()) / 4.0
        torch.testing.assert_close(mean[key].double(), expected, rtol=0, atol=1e-3 if deltas else 1e-6)
    assert int(mean["n"]) == round((3 * 9 + 1 * 9) / 4)  # integer buffers are not scaled
    with pytest.raises(ValueError, match="scale"):
        aggregator.add(local, {}, 1.0, scale=0.0)


def test_a_clipped_scaffold_update_scales_its_delta_c_too() -> None:
    global_state, local = states()
    server_state = {k: torch.zeros_like(v) for k, v in global_state.items() if v.is_floating_point()}
    aggregator = ScaffoldAggregator(global_state, server_state, num_clients=2, global_lr=1.0)
    aggregator.add(local, {"w": torch.full((4, 3), 8.0), "b": torch.full((3,), 8.0)}, 1.0, scale=0.5)
    _, new_c = aggregator.finish()
    torch.testing.assert_close(new_c["w"], torch.full((4, 3), 2.0))  # 0.5 * 8 / num_clients


def registry(max_samples: int) -> tuple[ClientRegistry, CoordinatorMetrics]:
    metrics = CoordinatorMetrics(CollectorRegistry())
    return ClientRegistry(threading.Condition(threading.RLock()), metrics, run_id="r", num_clients=4, num_classes=10,
                          max_samples=max_samples), metrics


def register(reg: ClientRegistry, client_id: int, num_samples: int) -> str:
    return reg.register(client_id, num_samples, 0, (), "r", data_fixed=False, has_synthetic=lambda _: False)


def test_a_registration_above_max_samples_per_client_is_refused_naming_client_value_and_limit() -> None:
    reg, metrics = registry(max_samples=500)
    assert register(reg, 0, 500)  # at the limit: admitted
    with pytest.raises(StateError, match=r"client 1 registered N_k=501 samples, above data\.max_samples_per_client=500"):
        register(reg, 1, 501)
    assert sorted(reg.clients) == [0]
    refused = metrics.rejected_registrations.labels(reason="max_samples_per_client")._value.get()
    assert refused == 1
    unlimited, _ = registry(max_samples=0)
    assert register(unlimited, 1, 10**9)


def test_a_client_is_lost_from_when_its_stream_ended_or_its_heartbeats_expired_and_not_before_it_subscribed() -> None:
    """What the rejoin grace runs from: a client registered but not yet subscribed (it may still be starting) has
    no time of loss; one whose stream ended has, the later of that and its last heartbeat's expiry."""
    reg, _ = registry(max_samples=0)
    session = register(reg, 0, 10)
    assert reg.unreachable_since(0, heartbeat_timeout_s=5.0) is None
    assert reg.unreachable_since(3, heartbeat_timeout_s=5.0) is None  # never registered
    _, outbox = reg.open_stream(0, session)
    assert reg.unreachable_since(0, heartbeat_timeout_s=5.0) is None  # connected
    before = time.monotonic()
    reg.close_stream(0, outbox)
    closed = reg.unreachable_since(0, heartbeat_timeout_s=5.0)
    assert closed is not None and before <= closed <= time.monotonic()
    reg.clients[0].last_heartbeat = closed - 1.0  # its heartbeats stop a second before its stream ends
    assert reg.unreachable_since(0, heartbeat_timeout_s=0.5) == closed
    assert reg.unreachable_since(0, heartbeat_timeout_s=5.0) is None  # heartbeating still: it may come back


def test_an_integer_buffer_may_only_advance_and_by_at_most_the_stated_step() -> None:
    global_state, local = states()
    for deltas in (False, True):  # integer buffers stay absolute in a delta update too
        assert update_norm({**local, "n": torch.tensor(5 + MAX_INTEGER_STEP)}, {}, global_state, deltas=deltas) > 0
    with pytest.raises(WireError, match=r"integer buffer 'n' moves backwards, from 5 to 4: refused \(runtime.max_update_norm\)"):
        update_norm({**local, "n": torch.tensor(4)}, {}, global_state, deltas=False)
    with pytest.raises(WireError, match=f"integer buffer 'n' advances by {MAX_INTEGER_STEP + 1} in one round, more than"):
        update_norm({**local, "n": torch.tensor(6 + MAX_INTEGER_STEP)}, {}, global_state, deltas=True)
    with pytest.raises(WireError, match="advances by"):  # int64's extremes, which wrap in the difference, too
        update_norm({**local, "n": torch.tensor(torch.iinfo(torch.int64).max)}, {}, global_state, deltas=False)
    with pytest.raises(WireError):
        update_norm({**local, "n": torch.tensor(torch.iinfo(torch.int64).min)}, {}, global_state, deltas=False)


@pytest.mark.parametrize("name", ["cnn", "resnet18", "unet-tiny"])
def test_the_only_integer_buffer_of_a_model_is_a_counter_no_forward_pass_reads(name: str) -> None:
    """Why an integer buffer folded unbounded (max_update_norm off) is harmless: BatchNorm reads num_batches_tracked
    only when its momentum is None, and no fedsynth model sets that (docs/security.md)."""
    model = build_model(name, num_classes=10, in_channels=3, image_size=32)
    integers = [key for key, value in model.state_dict().items() if not value.is_floating_point()]
    assert all(key.endswith("num_batches_tracked") for key in integers), integers
    assert all(m.momentum is not None for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm))
