"""`fedsynth generator federate` end to end, as real processes: a user-DP run of the tiny UNet on digits with two
client nodes gives a folder that `generator serve` serves and `generator evaluate` scores, with epsilon in report.json
and provenance.json; a coordinator killed after a round resumes to the same final weights (EMA included)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from coordinator import checkpoint
from coordinator.dp_secret import SECRET_FILE
from fedsynth import cli
from fedsynth.generation.generator_client import GeneratorInfo, fetch_images
from fedsynth.wire import grpcutil
from generator_service.serve_cmd import SERVICE_NAME
from runtime_harness import Runtime, completed_rounds, wait_exit, wait_until

ROUNDS = 2


def _fedsynth(*args: str) -> list[str]:
    return [sys.executable, "-m", "fedsynth.cli", *args]


@pytest.fixture(scope="module")
def federated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two client nodes, two rounds of three local steps, user-level DP at epsilon 10: the must-show run."""
    out = tmp_path_factory.mktemp("federated") / "generator"
    result = subprocess.run(
        _fedsynth("generator", "federate", "--size", "tiny", "--rounds", str(ROUNDS), "--local-steps", "3", "--dp", "user",
                  "--target-epsilon", "10", "--delta", "1e-5", "--set", "data.clients=2", "--set", "federate.batch_size=16",
                  "--set", "runtime.heartbeat_s=1.0", "--grid-per-class", "0", "--no-progress", "--out", str(out)),
        capture_output=True, text=True, timeout=400,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_a_user_dp_federated_run_gives_a_served_folder_with_epsilon_in_report_and_provenance(federated: Path,
                                                                                             tmp_path: Path) -> None:
    provenance = json.loads((federated / "provenance.json").read_text())
    report = json.loads((federated / "report.json").read_text())
    assert provenance["federated"] is True and provenance["dp"] == "user"
    assert provenance["rounds"] == ROUNDS and provenance["clients"] == 2 and provenance["delta"] == 1e-5
    assert 0 < provenance["epsilon"] <= 10
    assert report["privacy"]["epsilon"] == provenance["epsilon"]
    assert {"noise_multiplier", "clip", "sample_rate", "delta"} <= set(report["privacy"])
    assert [r["round"] for r in report["rounds"]] == [1, 2] and report["success"] is True
    assert [r["participants"] for r in report["rounds"]] == [[0, 1]] * ROUNDS

    port_file = tmp_path / "generator.port"
    proc = subprocess.Popen(_fedsynth("generator", "serve", "--model", str(federated), "--port", "0", "--port-file", str(port_file),
                                      "--threads", "1", "--insecure"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: port_file.exists() or proc.poll() is not None, timeout_s=120, what="generator port file")
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        channel = grpcutil.make_channel(f"127.0.0.1:{int(port_file.read_text())}")
        grpcutil.wait_for_serving(channel, SERVICE_NAME, timeout_s=60)
        info = GeneratorInfo.fetch(channel, timeout_s=10)
        received: list[Any] = []
        total = fetch_images(channel, [1] * 10, seed=3, timeout_s=60, on_batch=lambda *b: received.append(b))
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert total == 10 and info.model_id.startswith("ddpm-tiny-digits-")


@pytest.mark.slow
def test_generator_evaluate_scores_the_federated_folder_unchanged(federated: Path, tmp_path: Path) -> None:
    out = tmp_path / "scores.json"
    assert cli.main(["generator", "evaluate", "--backend", "ddpm", "--model", str(federated), "--dataset", "digits",
                     "--threads", "1", "--per-class", "20", "--judge-cache", str(tmp_path / "judges"), "--json", str(out)]) == 0
    scores = json.loads(out.read_text())
    assert {"recognizability", "per_class_recognizability", "cas", "frechet", "judge_test_accuracy"} <= set(scores)


RESUMED_RUN: dict[str, Any] = {
    "train.algorithm": "ddpm",
    "train.model": "unet-tiny",
    "train.rounds": 3,
    "data.clients": 3,
    "train.fraction": 0.67,  # two of three sampled each round: the sampling RNG is resumed too
    "federate.local_steps": 3,
    "federate.batch_size": 8,
    "federate.dp": "user",
    "federate.noise_multiplier": 0.3,
    "federate.clip": 0.5,
}


def _play(runtime: Runtime, out: Path, *, kill_after_round: int | None) -> checkpoint.Checkpoint:
    # The same coordinator secret in both run folders (the DP noise's seed beside the run seed): the same noise
    out.mkdir(parents=True, exist_ok=True)
    (out / SECRET_FILE).write_bytes(bytes(range(32)))
    coord = runtime.coordinator(RESUMED_RUN, out)
    clients = runtime.clients(coord.address, "0-2")
    if kill_after_round is not None:
        wait_until(lambda: completed_rounds(out) >= kill_after_round, timeout_s=240, what="round checkpointed", interval_s=0.01)
        runtime.kill(coord.child)
        done = completed_rounds(out)
        assert kill_after_round <= done < RESUMED_RUN["train.rounds"], f"killed too late: {done} rounds done"
        coord = runtime.coordinator(RESUMED_RUN, out, port=coord.port)
        assert f"resuming after round {done})" in wait_until(
            lambda: "resuming after round" in coord.log() and coord.log(), timeout_s=120, what="resumed")
    assert coord.wait(300) == 0, coord.log()[-3000:]
    assert wait_exit(clients, 30) == 0
    final = checkpoint.load(out)
    assert final is not None and final.completed_rounds == RESUMED_RUN["train.rounds"]
    return final


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_coordinator_killed_after_a_round_resumes_to_the_same_weights_and_ema(tmp_path: Path) -> None:
    with Runtime(tmp_path / "reference") as runtime:
        reference = _play(runtime, tmp_path / "reference" / "run", kill_after_round=None)
    with Runtime(tmp_path / "resumed") as runtime:
        resumed = _play(runtime, tmp_path / "resumed" / "run", kill_after_round=1)
    assert [r["sampled"] for r in resumed.record["history"]] == [r["sampled"] for r in reference.record["history"]]
    for group in ("global_state", "server_state"):
        want, got = getattr(reference, group), getattr(resumed, group)
        assert want.keys() == got.keys()
        for key, value in want.items():
            assert torch.equal(got[key], value), f"{group} {key} differs from the uninterrupted run"


@pytest.mark.slow
def test_a_sample_dp_run_reports_each_clients_epsilon_within_the_target(tmp_path: Path) -> None:
    out = tmp_path / "generator"
    result = subprocess.run(
        _fedsynth("generator", "federate", "--size", "tiny", "--rounds", "2", "--local-steps", "2", "--dp", "sample",
                  "--target-epsilon", "10", "--set", "data.clients=2", "--set", "federate.batch_size=16",
                  "--set", "federate.noise_multiplicity=2", "--set", "federate.max_physical_batch=16",
                  "--grid-per-class", "0", "--no-progress", "--out", str(out)),
        capture_output=True, text=True, timeout=400,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    provenance = json.loads((out / "provenance.json").read_text())
    clients = provenance["per_client"]
    assert sorted(clients) == ["0", "1"] and all(c["steps"] == 4 for c in clients.values())
    assert all(0 < c["epsilon"] <= 10 for c in clients.values())
    assert provenance["epsilon"] == max(c["epsilon"] for c in clients.values())
    logged = [line for line in (out / "run" / "logs").glob("client*.log") for line in line.read_text().splitlines() if "4 in all" in line]
    assert len(logged) == 2  # each client logs its own epsilon after its last round


@pytest.mark.slow
def test_a_federated_generator_trains_on_the_clients_own_folders_in_local_mode(tmp_path: Path) -> None:
    """Local mode (each client node only its own folder from `fedsynth data split`, here at 16x16, the coordinator no
    data): the same federate command trains at the folders' size, accounts epsilon and says in provenance.json that no
    partition was cut."""
    folders = tmp_path / "clients"
    split = subprocess.run(_fedsynth("data", "split", "--dataset", "digits", "--clients", "2", "--alpha", "0.5", "--seed", "0",
                                     "--image-size", "16", "--out", str(folders)), capture_output=True, text=True, timeout=300)
    assert split.returncode == 0, split.stderr[-2000:]
    out = tmp_path / "generator"
    result = subprocess.run(
        _fedsynth("generator", "federate", "--size", "tiny", "--rounds", "1", "--local-steps", "2", "--dp", "user",
                  "--target-epsilon", "10", "--set", "data.clients=2", "--set", 'data.source="local"',
                  "--set", f"data.local_dir={json.dumps(str(folders))}", "--set", "federate.batch_size=16",
                  "--set", "data.image_size=16",
                  "--grid-per-class", "0", "--no-progress", "--out", str(out)),
        capture_output=True, text=True, timeout=400,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["data_source"] == "local" and provenance["partition"] is None
    assert provenance["federated"] is True and 0 < provenance["epsilon"] <= 10 and provenance["clients"] == 2
    assert (out / "diffusion_pytorch_model.safetensors").is_file()
    assert json.loads((out / "fedsynth_generator.json").read_text())["image_shape"] == [1, 16, 16]  # it makes 16x16 images
