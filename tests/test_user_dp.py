"""The classifier's user-level DP (train.dp = "user", DP-FedAvg): the server clips whatever a client sends, adds noise of
standard deviation sigma*S/m, keeps integer buffers; sigma meets train.target_epsilon by Opacus's accountant; every
setting it cannot cover is refused by name; and a run stops cleanly once its budget would be passed."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from opacus.accountants import RDPAccountant
from prometheus_client import CollectorRegistry

from client_node.secure_update import SecureRoundClient, masked_update
from coordinator.metrics import CoordinatorMetrics
from fedsynth.algorithms.base import snapshot_state
from fedsynth.algorithms.privacy import update_norm
from fedsynth.algorithms.robust import aggregator_for
from fedsynth.algorithms.user_dp import UserDpAggregator, UserLevelDp, clip_to_move
from fedsynth.assembly import algorithm_for, model_for, user_dp_for
from fedsynth.config import load_config
from fedsynth.errors import ConfigError
from fedsynth.secagg.protocol import ServerRound, advertise, share_keys, unmask_shares
from fedsynth.secagg.quantize import QuantRange, decode_sum

PRIVATE = ['train.dp="user"', 'generation.policy="none"']


def _model_state(*sets: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    cfg = load_config(None, [*PRIVATE, "train.noise_multiplier=1.0", *sets])
    return snapshot_state(model_for(cfg, num_classes=10, in_channels=1, image_size=8))


def _dp(sigma: float, clip: float, m: int = 4, secret: bytes = bytes(32)) -> UserLevelDp:
    return UserLevelDp(clip=clip, noise_multiplier=sigma, clients=10, clients_per_round=m, delta=1e-5, accountant="rdp",
                       noise_secret=secret)


def _moved(state: dict[str, torch.Tensor], by: float) -> dict[str, torch.Tensor]:
    return {key: value + by if value.is_floating_point() else value + 7 for key, value in state.items()}


def test_the_server_clips_each_update_whatever_its_weight_and_keeps_integer_buffers() -> None:
    start = _model_state('train.model="resnet18"')  # BatchNorm: num_batches_tracked is an integer buffer
    integer_keys = [key for key, value in start.items() if not value.is_floating_point()]
    assert integer_keys
    aggregator = UserDpAggregator(start, {}, dp=_dp(sigma=0.0, clip=0.5, m=2), round_number=1)
    aggregator.add(_moved(start, 1000.0), {}, weight=5000.0)  # a huge update from a client claiming a huge N_k
    aggregator.add(start, {}, weight=1.0)
    new_global, _ = aggregator.finish()
    move = {key: new_global[key].double() - start[key].double() for key in start if start[key].is_floating_point()}
    assert aggregator.norms[0] > 1000 and aggregator.norms[1] == 0
    assert update_norm(move) == pytest.approx(0.5 / 2, rel=1e-5)  # its clipped share of m = 2, not 5000/5001 of it
    assert all(torch.equal(new_global[key], start[key]) for key in integer_keys)  # the clients' +7 is not published


def test_the_noise_has_standard_deviation_sigma_s_over_m_and_is_fixed_by_seed_round_and_secret() -> None:
    start = _model_state()
    sigma, clip, m = 2.0, 0.5, 4

    def noise(secret: bytes, round_number: int) -> torch.Tensor:
        aggregator = UserDpAggregator(start, {}, dp=_dp(sigma, clip, m, secret), round_number=round_number)
        for _ in range(m):
            aggregator.add(start, {}, 1.0)  # zero updates: what moves the model is the noise alone
        new_global = aggregator.finish()[0]
        return torch.cat([(new_global[key].double() - start[key].double()).flatten() for key in start])

    first = noise(bytes(32), 1)
    n, expected = first.numel(), sigma * clip / m
    assert first.std().item() == pytest.approx(expected, rel=5 / math.sqrt(2 * n))
    assert torch.equal(first, noise(bytes(32), 1))  # a resumed coordinator adds the same noise
    assert not torch.equal(first, noise(bytes(32), 2))
    assert not torch.equal(first, noise(bytes(range(32)), 1))  # the seed alone, which clients know, does not fix it


def test_an_honest_client_clips_its_own_move_to_s() -> None:
    start = _model_state()
    clipped = clip_to_move(_moved(start, 0.3), start, 0.25)
    move = {key: clipped[key] - start[key] for key in start if start[key].is_floating_point()}
    assert update_norm(move) == pytest.approx(0.25, rel=1e-5)
    small = _moved(start, 1e-6)
    assert all(torch.equal(clip_to_move(small, start, 0.25)[key], small[key]) for key in start)  # within S: untouched
    diverged = _moved(start, float("nan"))
    assert all(torch.equal(clip_to_move(diverged, start, 0.25)[key], start[key]) for key in start if start[key].is_floating_point())


@pytest.mark.parametrize("target", [10.0, 3.0, 1.0])
def test_sigma_for_the_target_spends_it_over_the_configured_rounds_by_opacus(target: float) -> None:
    cfg = load_config(None, [*PRIVATE, f"train.target_epsilon={target}", "data.clients=100", "train.fraction=0.1", "train.rounds=30"])
    dp = user_dp_for(cfg)
    assert dp is not None and dp.sample_rate == 0.1
    accountant = RDPAccountant()
    accountant.history = [(dp.noise_multiplier, 0.1, 30)]
    assert dp.epsilon(30) == pytest.approx(accountant.get_epsilon(delta=1e-5)) and target * 0.97 < dp.epsilon(30) <= target
    assert dp.affords(30) and not dp.affords(31)
    report = dp.report(30)
    assert report["budget_spent"] and report["target_epsilon"] == target and report["clip"] == 1.0


@pytest.mark.parametrize(("sets", "names"), [
    (['train.algorithm="scaffold"', "train.noise_multiplier=1.0"], ["scaffold", "control variates"]),
    (['train.algorithm="fedmix"', "train.noise_multiplier=1.0"], ["fedmix", "mean images"]),
    (['train.algorithm="sdafl"', "train.noise_multiplier=1.0"], ["sdafl"]),
    (['train.algorithm="fedgen"', "train.noise_multiplier=1.0"], ["fedgen"]),
    (['train.algorithm="ddpm"', 'train.model="unet-tiny"', "train.noise_multiplier=1.0"], ["federate.dp"]),
    (['train.aggregation="median"', "train.noise_multiplier=1.0"], ["median", "sensitivity"]),
    ([], ["train.target_epsilon", "train.noise_multiplier"]),
])
def test_a_setting_user_dp_cannot_cover_is_refused_naming_it(sets: list[str], names: list[str]) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(None, [*PRIVATE, *sets])
    assert all(name in str(refused.value) for name in names), refused.value


def test_fedeas_under_user_dp_needs_a_generator_that_never_saw_the_clients_images() -> None:
    private = ['train.dp="user"', "train.noise_multiplier=1.0", 'generation.policy="fedeas"']
    with pytest.raises(ConfigError, match="first use"):
        load_config(None, private)
    assert load_config(None, [*private, 'generation.backend="holdout"', "data.holdout_fraction=0.1"]).train.dp == "user"
    assert load_config(None, [*private, 'generation.model_dir="/public/generator"']).train.dp == "user"


def test_an_unreachable_target_names_train_target_epsilon() -> None:
    cfg = load_config(None, [*PRIVATE, "train.target_epsilon=0.001", "train.rounds=500", "train.dp_delta=1e-12"])
    with pytest.raises(ConfigError, match=r"train\.target_epsilon=0\.001"):
        user_dp_for(cfg)


def test_the_round_aggregator_is_dp_fedavgs_under_user_dp() -> None:
    cfg = load_config(None, [*PRIVATE, "train.noise_multiplier=1.0"])
    start = _model_state()
    aggregator = aggregator_for(cfg.train, algorithm_for(cfg), start, {}, user_dp=user_dp_for(cfg), round_number=3)
    assert isinstance(aggregator, UserDpAggregator) and aggregator.dp is not None and aggregator.round_number == 3


@pytest.mark.slow
def test_a_secure_run_with_distributed_noise_stops_cleanly_before_passing_its_budget(tmp_path: Path) -> None:
    """Secure aggregation too: each client adds its share of the noise before masking (weights 1, the sum over m)."""
    out = tmp_path / "run"
    sets = ["data.clients=6", "train.rounds=10", "train.local_epochs=1", "runtime.clients_per_process=6", "train.fraction=0.5",
            *PRIVATE, "train.noise_multiplier=1.0", "train.target_epsilon=8.0", "train.dp_clip=0.5",
            "runtime.secure_aggregation=true"]
    command = [sys.executable, "-m", "fedsynth.cli", "run", "--out-dir", str(out), "--no-progress"]
    for item in sets:
        command += ["--set", item]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    epsilons = [r["epsilon"] for r in report["rounds"]]
    accountant = RDPAccountant()
    accountant.history = [(1.0, 0.5, len(epsilons))]
    assert report["success"] and 1 < len(epsilons) < 10  # sigma = 1 spends 8 in 4 rounds at q = 0.5
    assert epsilons == sorted(epsilons) and epsilons[-1] <= 8.0
    assert report["privacy"]["epsilon"] == pytest.approx(accountant.get_epsilon(delta=1e-5)) == epsilons[-1]
    assert report["privacy"]["budget_spent"] and report["privacy"]["clip"] == 0.5
    logs = "".join(path.read_text() for path in (out / "logs").glob("*.log"))
    assert f"privacy budget spent: {len(epsilons)} of 10 rounds" in logs
    assert all(len(r["secure_aggregation"]["survivors"]) == 3 for r in report["rounds"])  # m = 3, each round unmasked


def test_distributed_noise_of_m_clients_sums_to_sigma_s_and_the_masks_cancel() -> None:
    """Each of m secure clients adds N(0, (sigma S)^2 / m) to a zero move before masking: the unmasked sum over m has
    standard deviation sigma S / m per element, as the central noise (the accountant's sigma holds when all m survive)."""
    start = _model_state()
    m, sigma, clip, context = 8, 2.0, 0.5, b"noise test"
    dp = UserLevelDp(clip=clip, noise_multiplier=sigma, clients=m, clients_per_round=m, delta=1e-5, accountant="rdp")
    length = sum(v.numel() for v in start.values() if v.is_floating_point()) + 1
    server = ServerRound(list(range(m)), degree=m, threshold=m // 2 + 1, graph_seed=b"g", context=context, length=length)
    keys = {c: advertise() for c in range(m)}
    for c in range(m):
        server.add_public_keys(c, keys[c].public())
    states = {}
    for c in range(m):
        states[c], boxes = share_keys(c, keys[c], server.keys_for(c), threshold=m // 2 + 1, context=context)
        server.add_sealed(c, boxes)
    quant = QuantRange(4.0, total_weight=m)
    for c in range(m):
        secure = SecureRoundClient(None, {}, states[c], server.sealed_for(c), 1, quant, m)  # type: ignore[arg-type]
        masked = masked_update(secure, start, start, dp)["masked"]
        server.add_masked_input(c, masked.numpy().view(np.uint32))
    survivors, dropped = server.unmask_request()
    replies = {c: unmask_shares(states[c], server.sealed_for(c), survivors=survivors, dropped=dropped) for c in range(m)}
    total = server.unmask(replies)
    mean = decode_sum(total[:-1], quant) / m
    assert int(total[-1]) == m
    assert mean.std() == pytest.approx(sigma * clip / m, rel=5 / math.sqrt(2 * len(mean)))


def test_the_coordinator_exports_epsilon_and_secure_aggregations_costs() -> None:
    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(registry)
    dp = _dp(sigma=1.5, clip=0.5, m=5)
    metrics.observe_round({"round": 3, "duration_s": 1.0, "phases_s": {}, "participants": [0, 1, 2], "accuracy": 0.5, "loss": 1.0,
                           "privacy": dp.report(3), "secure_aggregation": {"survivors": [0, 1, 2], "dropped": [3, 4],
                                                                          "threshold": 3, "unmask_s": 0.25}})
    value = registry.get_sample_value
    assert value("fedsynth_coordinator_dp_epsilon") == dp.epsilon(3) > 0 and value("fedsynth_coordinator_dp_sample_rate") == 0.5
    assert value("fedsynth_coordinator_secagg_dropped_total") == 2
    assert value("fedsynth_coordinator_secagg_unmask_seconds_sum") == 0.25
