"""Bounded updates over real processes: a client whose updates are 1,000 times its honest norm (at least 500 times the
round's median) is refused every round, and the run ends where the run with that client honest ends; without the bound
the same client wrecks the model.

The bad client is the real client node run through tests/scaled_update_client.py, a test-only script that scales the
update on its way to the wire (nothing in fedsynth can turn that on)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

import pytest

from deploy.processes import Child
from runtime_harness import Runtime, read_record, wait_exit

SCALED_CLIENT = Path(__file__).resolve().parent / "scaled_update_client.py"
# runtime.max_refusals 0: the refused client stays in the run every round (exclusion: tests/adversarial)
RUN: dict[str, Any] = {"seed": 5, "data.clients": 4, "train.rounds": 10, "train.local_epochs": 1, "runtime.max_refusals": 0}
BAD = 3  # the client whose updates are scaled
AUTO = {"runtime.max_update_norm": "auto"}  # the defaults: 10 x the round's median norm, refused past it
# Digits' 360 test images, runs that differ in one client's updates (measured: 0.03 apart at 6 rounds)
NOISE = 0.05
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def scaled_client(rt: Runtime, address: str, ids: str) -> Child:
    command = [sys.executable, str(SCALED_CLIENT), "--coordinator", address, "--clients", ids, "--torch-threads", "1",
               "--cache-dir", str(rt.root / "cache"), "--reconnect-timeout", "60", "--insecure"]
    return rt.group.start(f"scaled-client-{ids}", command)


def play(root: Path, settings: dict[str, Any], *, bad: bool) -> dict[str, Any]:
    """One run, clients 0-2 honest in one process and client 3 in another (scaled when `bad`): coordinator.json, with
    the coordinator's log and the last client's under "log" and "bad_log"."""
    with Runtime(root) as rt:
        coordinator = rt.coordinator({**RUN, **settings}, root / "run")
        honest = rt.clients(coordinator.address, "0-2")
        last = scaled_client(rt, coordinator.address, str(BAD)) if bad else rt.clients(coordinator.address, str(BAD))
        assert coordinator.wait(300) == 0, coordinator.log()[-3000:]
        assert wait_exit(honest, 60) == 0 and wait_exit(last, 60) == 0
        return {**read_record(root / "run"), "log": coordinator.log(), "bad_log": last.log_path.read_text(errors="replace")}


def final_accuracy(record: dict[str, Any]) -> float:
    return float(record["rounds"][-1]["accuracy"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every client honest, under the same bound."""
    return play(tmp_path_factory.mktemp("reference"), AUTO, bad=False)


@pytest.fixture(scope="module")
def attacked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return play(tmp_path_factory.mktemp("attacked"), AUTO, bad=True)


def test_an_update_1000_times_the_median_norm_is_refused_and_the_run_ends_as_with_the_client_honest(
        reference: dict[str, Any], attacked: dict[str, Any], tmp_path: Path) -> None:
    for i, entry in enumerate(attacked["rounds"]):
        norms = entry["update_norms"]
        assert norms["norms"][str(BAD)] >= 500 * norms["median"], entry  # finite (measured: 592-4,148 x the median)
        assert norms["refused"] == [BAD] and norms["clipped"] == [], entry
        # 10 x the median of this round's norms and of those folded as sent in the 3 rounds before it
        earlier = [n for e in attacked["rounds"][max(0, i - 3):i] for c, n in e["update_norms"]["norms"].items()
                   if int(c) not in e["update_norms"]["refused"] + e["update_norms"]["clipped"]]
        assert norms["bound"] == pytest.approx(10 * statistics.median([*norms["norms"].values(), *earlier])), entry
        assert entry["participants"] == [0, 1, 2], entry
    bad_ratios = [e["update_norms"]["norms"][str(BAD)] / e["update_norms"]["median"] for e in attacked["rounds"]]
    print(f"bad norm / median: {min(bad_ratios):.0f} to {max(bad_ratios):.0f}")
    assert attacked["log"].count(f"client {BAD}'s update has L2 norm") == RUN["train.rounds"]
    for entry in reference["rounds"]:  # honest updates stay within 10 x the median
        assert entry["update_norms"]["refused"] == [] and entry["participants"] == [0, 1, 2, 3], entry
    ratios = [max(e["update_norms"]["norms"].values()) / e["update_norms"]["median"] for e in reference["rounds"]]
    print(f"honest max/median norm per round: {[round(r, 2) for r in ratios]}")
    expected = final_accuracy(reference)
    print(f"final accuracy: {final_accuracy(attacked):.4f} attacked (refused), {expected:.4f} all honest")
    assert expected > 0.8, expected
    assert abs(final_accuracy(attacked) - expected) <= NOISE, (final_accuracy(attacked), expected)
    # The same client with no bound: the model does not survive it (so the bound is what kept the run above)
    unbounded = play(tmp_path / "unbounded", {}, bad=True)
    print(f"final accuracy without a bound: {final_accuracy(unbounded):.4f}")
    assert final_accuracy(unbounded) < expected - 0.3, final_accuracy(unbounded)


def test_a_fixed_bound_refuses_on_arrival_and_the_client_goes_on_to_the_next_round(attacked: dict[str, Any], tmp_path: Path) -> None:
    """A number is checked as each update arrives: its client hears FAILED_PRECONDITION at once and goes on with the
    next round's task on the same stream, and hears the run's end; the rounds aggregate the same three clients as under
    "auto"."""
    honest_norms = [n for e in attacked["rounds"] for c, n in e["update_norms"]["norms"].items() if c != str(BAD)]
    bad_norms = [e["update_norms"]["norms"][str(BAD)] for e in attacked["rounds"]]
    limit = statistics.geometric_mean([max(honest_norms), min(bad_norms)])  # well between the two
    fixed = play(tmp_path, {"runtime.max_update_norm": limit}, bad=True)
    for entry in fixed["rounds"]:
        assert entry["update_norms"]["refused"] == [BAD] and entry["participants"] == [0, 1, 2], entry
        assert entry["update_norms"]["bound"] == limit
    assert fixed["bad_log"].count("the coordinator refused the update") == RUN["train.rounds"], fixed["bad_log"][-3000:]
    assert "reconnecting" not in fixed["bad_log"], fixed["bad_log"][-3000:]
    assert abs(final_accuracy(fixed) - final_accuracy(attacked)) <= 0.01  # the same updates, summed in another order
