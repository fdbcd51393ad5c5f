"""The judge's figures for the generator a run used: `fedsynth generator evaluate` once per generator, then cached."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from deploy.generator_setup import cache_root
from deploy.processes import fedsynth_command
from fedsynth.config import RunConfig
from fedsynth.process.runtime import write_atomic

log = logging.getLogger(__name__)

TIMEOUT_S = 1800.0  # a CPU judge for CIFAR-10 trains for minutes once; later runs read the cache
KEPT = ("recognizability", "per_class_recognizability", "cas", "frechet", "real_test_frechet", "judge_test_accuracy",
        "chance", "n_images", "backend", "model_id")
GRID = "generator-grid.png"
CACHE_FORMAT = 1  # bump when `fedsynth generator evaluate`'s recipe changes: older figures are then not reused


def cache_key(cfg: RunConfig, counters: dict[str, Any]) -> str:
    """Same generator (backend and model id, which fold in its weights or held-out split, on the same device and
    dtype: float16 on a GPU draws other images than float32 on a CPU), same data, same figures."""
    g = cfg.generation
    identity = {"format": CACHE_FORMAT, "backend": counters.get("backend"), "model_id": counters.get("model_id"),
                "device": counters.get("device"), "dtype": counters.get("dtype"),
                "dataset": cfg.data.dataset, "data_dir": str(Path(cfg.data.data_dir).resolve()) if cfg.data.data_dir else None,
                "per_class": g.evaluate_per_class, "min_confidence": g.min_confidence, "seed": 0}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]


def folders_as_npz(cfg: RunConfig) -> Path:
    """Local mode on one machine (the operator's test bench holds every client folder): the clients' training images
    pooled, and data.test_dir's images (else the clients' test images pooled), at the run's size, as the train.npz and
    test.npz the judge learns and is tested on; kept under $FEDSYNTH_CACHE/folders by the folders' file listing."""
    from fedsynth.learning.data import ArrayDataset
    from fedsynth.learning.federation_folders import pooled
    from fedsynth.learning.label_schema import schema_of
    from fedsynth.learning.local_data import load_test_dir

    schema = schema_of(cfg.data)
    assert schema is not None  # local mode needs the schema (DataConfig.check)
    sources = [Path(str(cfg.data.local_dir)).resolve()] + ([Path(cfg.data.test_dir).resolve()] if cfg.data.test_dir else [])
    listing = sorted((str(path), path.stat().st_size) for root in sources for path in root.rglob("*") if path.is_file())
    identity = json.dumps({"schema": schema.digest(), "sources": [str(s) for s in sources], "files": listing})
    folder = cache_root() / "folders" / hashlib.sha256(identity.encode()).hexdigest()[:20]
    if (folder / "test.npz").is_file():
        return folder
    test: ArrayDataset = (load_test_dir(cfg.data.test_dir, schema) if cfg.data.test_dir
                          else pooled(sources[0], schema, "test"))
    splits = {"train": pooled(sources[0], schema, "train"), "test": test}
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in splits.items():  # test.npz last: its presence says the folder is whole
        with tempfile.NamedTemporaryFile(dir=folder, suffix=".npz", delete=False) as handle:
            np.savez(handle, x=data.x, y=data.y)
        os.replace(handle.name, folder / f"{name}.npz")
    return folder


def generator_quality(cfg: RunConfig, address: str, counters: dict[str, Any], *, out_dir: Path, tls_flags: list[str]) -> dict[str, Any]:
    """The figures (cached under $FEDSYNTH_CACHE/quality), the sample grid copied to OUT_DIR/plots; an `error` instead
    when the judge could not score the generator: the run itself stands. In local mode the judge learns the client
    folders pooled (folders_as_npz)."""
    if cfg.data.source == "local":
        data = dataclasses.replace(cfg.data, source="split", dataset="npz", data_dir=str(folders_as_npz(cfg)),
                                   local_dir=None, test_dir=None)
        cfg = dataclasses.replace(cfg, data=data)
    folder = cache_root() / "quality"
    key = cache_key(cfg, counters)
    figures, grid = folder / f"{key}.json", folder / f"{key}.png"
    cached = figures.is_file()
    if not cached:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder, prefix=f".{key}.") as scratch:  # gone whatever happens
            command = fedsynth_command(
                "generator", "evaluate", "--generator", address, "--dataset", cfg.data.dataset,
                "--per-class", str(cfg.generation.evaluate_per_class), "--seed", "0", "--json", f"{scratch}/figures.json",
                "--grid", f"{scratch}/grid.png", "--threads", str(cfg.runtime.torch_threads),
                *(["--data-dir", str(cfg.data.data_dir)] if cfg.data.data_dir else []), *tls_flags,
            )
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
            except subprocess.TimeoutExpired:
                return {"error": f"`fedsynth generator evaluate` did not finish within {TIMEOUT_S:.0f} s"}
            if done.returncode != 0:
                tail = done.stderr.strip().splitlines()[-1:] or ["no message"]
                log.warning("could not score the generator: %s", tail[0])
                return {"error": f"`fedsynth generator evaluate` exited {done.returncode}: {tail[0]}"}
            os.replace(f"{scratch}/grid.png", grid)
            write_atomic(figures, Path(f"{scratch}/figures.json").read_text())  # last: a cache entry is whole or absent
    result = json.loads(figures.read_text())
    (out_dir / "plots").mkdir(parents=True, exist_ok=True)
    if grid.is_file():
        shutil.copyfile(grid, out_dir / "plots" / GRID)
    # seconds: what scoring took when it ran (0 here when read from the cache)
    seconds = 0.0 if cached else result.get("seconds", {}).get("total")
    return {**{name: result.get(name) for name in KEPT}, "seconds": seconds, "cached": cached,
            "grid": GRID if grid.is_file() else None}
