"""Shared fixtures: a process runtime that always cleans up, and one uninterrupted reference run per session."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from threadpoolctl import threadpool_limits

from coordinator import checkpoint
from runtime_harness import Runtime, read_record, wait_exit

# A run whose rounds sample 2 of 4 clients: the reference for determinism and for resume-after-crash.
SAMPLED_RUN: dict[str, Any] = {
    "seed": 7,
    "data.clients": 4,
    "train.fraction": 0.5,
    "train.rounds": 4,
    "train.local_epochs": 2,
}


@dataclass(frozen=True)
class FinishedRun:
    out_dir: Path
    record: dict[str, Any]
    final_state: dict[str, torch.Tensor]


@pytest.fixture(autouse=True)
def one_cpu_thread() -> Iterator[None]:
    """Torch and BLAS (scikit-learn's, numpy's) on one thread inside the test process: scripts/test.sh runs 2 pytest
    workers on 2 cores, where each worker's second thread only spins against the other worker, and the models trained
    and sampled in process are too small to gain from it (a generator's quality check: 78 s of CPU on the default
    threads, 3.5 s on one). Results do not change: every such computation is seeded and single-device. The processes a
    test starts choose their own threads (--torch-threads, --threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with threadpool_limits(1):
        yield
    torch.set_num_threads(threads)


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[Runtime]:
    with Runtime(tmp_path) as rt:
        yield rt


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> FinishedRun:
    """SAMPLED_RUN played once, uninterrupted: one coordinator and one client process hosting clients 0-3."""
    root = tmp_path_factory.mktemp("reference")
    with Runtime(root) as rt:
        coord = rt.coordinator(SAMPLED_RUN, root / "run")
        clients = rt.clients(coord.address, "0-3")
        assert coord.wait(120) == 0, coord.log()[-3000:]
        assert wait_exit(clients, 30) == 0
    ckpt = checkpoint.load(root / "run")
    assert ckpt is not None and ckpt.completed_rounds == SAMPLED_RUN["train.rounds"]
    return FinishedRun(root / "run", read_record(root / "run"), ckpt.global_state)


@pytest.fixture(scope="session")
def tiny_generator(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A diffusers generator trained for 4 steps on digits: enough for tests that count or compare images."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("generator") / "model"
    subprocess.run(
        [sys.executable, "-m", "fedsynth.cli", "generator", "train", "--dataset", "digits", "--size", "tiny", "--steps", "4",
         "--batch-size", "16", "--out", str(out), "--no-progress", "--grid-per-class", "0", "--threads", "1"],
        check=True, timeout=300, capture_output=True,
    )
    return out
