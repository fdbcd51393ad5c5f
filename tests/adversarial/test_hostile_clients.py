"""Hostile clients against a real coordinator process: every attack is a real client process (a client node with one
function changed, tests/adversarial/attack_node.py, or a wire-level client, tests/adversarial/wire_attacker.py). For
each: the coordinator completes every round with the honest clients and exits 0, the attacker is named in its record,
and (for an attacker that holds data) the final accuracy stays where the run with that client honest ends."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from deploy.processes import Child
from runtime_harness import Runtime, read_record, wait_exit

HERE = Path(__file__).resolve().parent
ATTACK_NODE, WIRE_ATTACKER = HERE / "attack_node.py", HERE / "wire_attacker.py"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def attack_node(rt: Runtime, address: str, ids: str, attacks: dict[int, str]) -> Child:
    """A real `fedsynth client` hosting the logical clients `ids`, those in `attacks` hostile."""
    spec = ",".join(f"{k}={name}" for k, name in attacks.items())
    command = [sys.executable, str(ATTACK_NODE), "--attacks", spec, "--coordinator", address, "--clients", ids,
               "--torch-threads", "1", "--cache-dir", str(rt.root / "cache"), "--reconnect-timeout", "60", "--insecure"]
    return rt.group.start(f"attack-node-{ids}", command)


def wire_attackers(rt: Runtime, address: str, attacks: dict[int, str], out: Path) -> Child:
    spec = ",".join(f"{k}={name}" for k, name in attacks.items())
    return rt.group.start("wire-attackers", [sys.executable, str(WIRE_ATTACKER), "--coordinator", address, "--attacks", spec,
                                             "--out", str(out)])


def refused_clients(record: dict[str, Any]) -> dict[int, set[str]]:
    named: dict[int, set[str]] = {}
    for entry in record["refused_updates"]:
        named.setdefault(entry["client"], set()).add(entry["reason"])
    return named


def final_accuracy(record: dict[str, Any]) -> float:
    return float(record["rounds"][-1]["accuracy"])


# ---- a client node of another release: one extra tensor in every update ----------------------------------------

# Four clients on an IID split of digits, every one sampled; client 3 holds a quarter of the data.
EXTRA = {"seed": 2, "data.clients": 4, "data.partition": "iid", "train.rounds": 8, "train.local_epochs": 2}
HOSTILE = 3
NOISE = 0.02  # the bar: the attacked run ends within 2 points of the run with that client honest


def play_extra(root: Path, settings: dict[str, Any], *, hostile: bool) -> dict[str, Any]:
    """One node process hosts the four clients (one process start fewer a run), client 3 hostile when `hostile`."""
    with Runtime(root) as rt:
        coordinator = rt.coordinator({**EXTRA, **settings}, root / "run")
        node = (attack_node(rt, coordinator.address, "0-3", {HOSTILE: "extra-tensor"}) if hostile
                else rt.clients(coordinator.address, "0-3"))
        assert coordinator.wait(300) == 0, coordinator.log()[-3000:]
        code = wait_exit(node, 60)
        return {**read_record(root / "run"), "last_exit": code, "last_log": node.log_path.read_text(errors="replace")}


@pytest.mark.parametrize("aggregation", ["mean", "median", "trimmed_mean", "krum", "multi_krum"])
def test_an_update_with_an_extra_tensor_costs_its_sender_not_the_run(aggregation: str, tmp_path: Path) -> None:
    record = play_extra(tmp_path, {"train.aggregation": aggregation}, hostile=True)
    assert record["success"] and len(record["rounds"]) == EXTRA["train.rounds"]
    # refused in rounds 1-3 (runtime.max_refusals = 3 in a row), then excluded: round 4 went on without it
    refused = [(e["round"], e["client"], e["reason"]) for e in record["refused_updates"]]
    assert refused == [(1, HOSTILE, "layout"), (2, HOSTILE, "layout"), (3, HOSTILE, "layout")], refused
    assert "unexpected tensors ['junk']" in record["refused_updates"][0]["message"]
    assert [(e["client"], e["round"]) for e in record["excluded_clients"]] == [(HOSTILE, 3)]
    assert HOSTILE not in record["rounds"][3]["sampled"] and HOSTILE not in record["rounds"][0]["participants"]
    assert all(HOSTILE not in r["sampled"] for r in record["rounds"][3:])
    assert record["last_exit"] != 0 and "excluded from the run" in record["last_log"]  # it heard why, in one line
    print(f"{aggregation}: final accuracy {final_accuracy(record):.4f} with the client refused")
    if aggregation == "mean":  # the default config: the run with that client honest ends within 2 points
        honest = play_extra(tmp_path / "honest", {}, hostile=False)
        print(f"mean: final accuracy {final_accuracy(honest):.4f} with every client honest")
        assert abs(final_accuracy(record) - final_accuracy(honest)) <= NOISE, (final_accuracy(record), final_accuracy(honest))


def test_scaffold_control_variates_of_int64_giants_are_refused_and_the_model_survives(tmp_path: Path) -> None:
    """Before: every delta c_i an int64 of 2^62 passed every check and SCAFFOLD's run "completed" at 0.078 on digits."""
    with Runtime(tmp_path) as rt:
        coordinator = rt.coordinator({**EXTRA, "train.algorithm": "scaffold"}, tmp_path / "run")
        attack_node(rt, coordinator.address, "0-3", {HOSTILE: "giant-delta-c"})
        assert coordinator.wait(300) == 0, coordinator.log()[-3000:]
        record = read_record(tmp_path / "run")
    assert [(e["round"], e["reason"]) for e in record["refused_updates"]] == [(1, "dtype"), (2, "dtype"), (3, "dtype")]
    assert "extra tensors: tensor" in record["refused_updates"][0]["message"] and "torch.int64" in record["refused_updates"][0]["message"]
    print(f"scaffold with the int64 client refused: final accuracy {final_accuracy(record):.4f}")
    assert final_accuracy(record) > 0.6  # SCAFFOLD without client 3's data (measured ~0.8), not destroyed


# ---- one federation, many attackers ----------------------------------------------------------------------------

# Clients 0-2 honest; 3-7 a client node whose updates are malformed in one way each; 8-17 wire-level attackers.
NODE_ATTACKS = {3: "extra-int64", 4: "missing-tensor", 5: "wrong-dtype", 6: "nan", 7: "extra-tensor"}
WIRE_ATTACKS = {8: "old-protocol", 9: "lying-n", 10: "huge-header", 11: "nested-header", 12: "concurrent",
                13: "never-finishes", 14: "replay", 15: "stale-task", 16: "inf-report", 17: "lying-eval"}
MANY = {"seed": 4, "data.clients": 18, "data.partition": "iid", "train.rounds": 3, "train.local_epochs": 1,
        "train.evaluation": "both", "data.max_samples_per_client": 1000, "runtime.quorum": 0.15,
        "runtime.max_refusals": 2, "runtime.round_timeout_s": 10.0}  # round 1 waits it out (the upload that never ends)


def play_many(root: Path) -> dict[str, Any]:
    moves = root / "moves.jsonl"
    with Runtime(root) as rt:
        coordinator = rt.coordinator(MANY, root / "run")
        honest = rt.clients(coordinator.address, "0-2")
        node = attack_node(rt, coordinator.address, "3-7", NODE_ATTACKS)
        wire = wire_attackers(rt, coordinator.address, WIRE_ATTACKS, moves)
        assert coordinator.wait(400) == 0, coordinator.log()[-4000:]
        assert wait_exit(honest, 60) == 0
        wait_exit(node, 60)
        wait_exit(wire, 60)
        lines = [json.loads(line) for line in moves.read_text().splitlines()]
        return {"record": read_record(root / "run"), "moves": lines, "log": coordinator.log()}


def moves_of(many: dict[str, Any], client: int) -> list[tuple[int, str, str]]:
    return [(m["round"], m["move"], m["code"]) for m in many["moves"] if m["client"] == client]


def test_many_attackers_in_one_federation(tmp_path: Path) -> None:
    """One federation (one test, so that it is played once): the checks below, each on the same record."""
    many = play_many(tmp_path)
    every_round_completes_with_the_honest_clients(many)
    malformed_updates_are_refused_by_name_and_their_senders_excluded(many)
    wire_attacks_get_the_status_that_names_them(many)
    stale_and_replayed_uploads_are_named_but_cost_nothing_more(many)
    lying_evaluation_counts_are_left_out_of_the_federated_figures(many)


def every_round_completes_with_the_honest_clients(many: dict[str, Any]) -> None:
    record = many["record"]
    assert record["success"] and record["exit_code"] == 0
    assert [r["round"] for r in record["rounds"]] == [1, 2, 3]
    for summary in record["rounds"]:
        assert {0, 1, 2} <= set(summary["participants"]), summary["participants"]
    assert "Traceback" not in many["log"]


def malformed_updates_are_refused_by_name_and_their_senders_excluded(many: dict[str, Any]) -> None:
    record = many["record"]
    named = refused_clients(record)
    expected = {3: "layout", 4: "layout", 5: "dtype", 6: "non_finite", 7: "layout", 10: "header", 11: "header", 16: "report"}
    for client, reason in expected.items():
        assert reason in named.get(client, set()), (client, named.get(client))
    excluded = {e["client"] for e in record["excluded_clients"]}
    assert excluded == set(expected), excluded  # two refusals in a row each (runtime.max_refusals = 2)


def wire_attacks_get_the_status_that_names_them(many: dict[str, Any]) -> None:
    assert moves_of(many, 8)[0][1:] == ("register", "FAILED_PRECONDITION")  # an older release: refused by name
    old = next(m["details"] for m in many["moves"] if m["client"] == 8)
    assert "release before fedsynth 0.2.0" in old and "this coordinator runs fedsynth 0.2.0, protocol 2" in old, old
    assert moves_of(many, 9)[0][1:] == ("register", "FAILED_PRECONDITION")  # N_k above data.max_samples_per_client
    assert (1, "huge-header", "INVALID_ARGUMENT") in moves_of(many, 10)
    assert (1, "nested-header", "INVALID_ARGUMENT") in moves_of(many, 11)
    assert (1, "second-upload", "FAILED_PRECONDITION") in moves_of(many, 12)  # one upload at a time
    assert (1, "first-upload", "OK") in moves_of(many, 12)
    assert (1, "never-finishes", "CANCELLED") in moves_of(many, 13)  # the server's own deadline ended it
    assert (2, "replay", "FAILED_PRECONDITION") in moves_of(many, 14) and (2, "valid", "OK") in moves_of(many, 14)
    assert (1, "stale-task", "FAILED_PRECONDITION") in moves_of(many, 15) and (1, "valid", "OK") in moves_of(many, 15)
    assert (1, "inf-report", "INVALID_ARGUMENT") in moves_of(many, 16)
    assert (1, "evaluation", "INVALID_ARGUMENT") in moves_of(many, 17)  # more examples than its test set


def stale_and_replayed_uploads_are_named_but_cost_nothing_more(many: dict[str, Any]) -> None:
    record = many["record"]
    named = refused_clients(record)
    assert "stale" in named[14] and "stale" in named[15] and "duplicate" in named[12]
    excluded = {e["client"] for e in record["excluded_clients"]}
    assert not excluded & {12, 14, 15}
    assert {12, 14, 15} <= set(record["rounds"][-1]["participants"])


def lying_evaluation_counts_are_left_out_of_the_federated_figures(many: dict[str, Any]) -> None:
    for summary in many["record"]["rounds"]:
        per_client = summary["federated_evaluation"]["per_client"]
        assert "17" not in per_client
        assert all(entry["examples"] <= 1000 for entry in per_client.values())
