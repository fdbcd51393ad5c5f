"""Every config key typed and range-checked when read, data feasibility before start, one split per node process."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import re
import string
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fedsynth.assembly as assembly
from fedsynth.config import SECTIONS, RunConfig, from_dict, from_json, load_config, to_json
from fedsynth.config_schema import ALGORITHM_PARAMS, GENERATOR_BACKENDS, GENERATOR_SIZES, require_names
from fedsynth.config_schema import DATASETS
from fedsynth.learning.data import load_labels
from fedsynth.errors import ConfigError
from fedsynth.learning.partition import check_partition, partition

# Every key: its kind (a trailing ? means it may be left out / null) and values of the right type that are out of
# range or not a valid choice. Written out by hand, apart from the code under test, so that it can disagree with it.
KEYS: dict[str, tuple[str, list[Any]]] = {
    "name": ("str", ["", "   "]),
    "seed": ("int", [-1, 2**32, -(2**40)]),
    "out_dir": ("str", [""]),
    "data.dataset": ("str", ["mnist", "DIGITS", ""]),
    "data.data_dir": ("str?", [""]),
    "data.download": ("bool", []),
    "data.clients": ("int", [0, -3]),
    "data.partition": ("str", ["pathological", ""]),
    "data.alpha": ("float", [0, -0.1, 0.0]),
    "data.min_size": ("int", [-1]),
    "data.holdout_fraction": ("float", [-0.1, 1, 1.5]),
    "data.local_test_fraction": ("float", [-0.1, 1, 1.5]),
    "data.max_samples_per_client": ("int", [-1]),
    "data.source": ("str", ["Local", "folder", ""]),
    "data.local_dir": ("str?", [""]),
    "data.test_dir": ("str?", [""]),
    "data.classes": ("strlist?", [[], ["one"], ["a", "a"], ["a/b", "c"], [" a", "b"], ["", "b"]]),
    "data.image_size": ("int?", [0, -8]),
    "data.channels": ("int?", [0, 2, 4]),
    "data.max_image_pixels": ("int", [0, -1]),
    "data.follow_symlinks": ("bool", []),
    "train.model": ("str", ["resnet50", ""]),
    "train.algorithm": ("str", ["sgd", "FedAvg", ""]),
    "train.rounds": ("int", [0, -1]),
    "train.fraction": ("float", [0, -0.5, 1.01]),
    "train.lr": ("float", [0, -0.01]),
    "train.momentum": ("float", [-0.1, 1, 2.5]),
    "train.weight_decay": ("float", [-1e-4]),
    "train.batch_size": ("int", [0, -64]),
    "train.local_epochs": ("int", [0]),
    "train.max_steps": ("int?", [-1]),
    "train.augment": ("bool", []),
    "train.eval_batch_size": ("int", [0]),
    "train.evaluation": ("str", ["clients", "Server", ""]),
    "train.eval_every": ("int", [0, -2]),
    "train.fraction_evaluate": ("float", [0, -0.5, 1.01]),
    "train.algorithm_params": ("table", [{"mu": 0.1}, {"lr": 1}]),  # the default fedavg takes no parameter
    "train.aggregation": ("str", ["Median", "bulyan", ""]),
    "train.device": ("str", ["gpu", "cuda:", "cuda:x", "CPU", ""]),
    "train.precision": ("str", ["fp64", "half", ""]),
    "train.optimizer": ("str", ["lbfgs", "SGD", ""]),
    "train.lr_schedule": ("str", ["linear", ""]),
    "train.init_weights": ("str?", [""]),
    "train.aggregation_params": ("table", [{"beta": 0.1}, {"f": 1}]),  # the default mean takes no parameter
    "runtime.secure_aggregation": ("bool", []),
    "runtime.secagg_neighbours": ("int", [-2, 3]),
    "runtime.secagg_threshold": ("int", [-1]),
    "runtime.secagg_clip": ("float", [0, -1.0]),
    "runtime.secagg_stage_timeout_s": ("float", [0, -5.0]),
    "train.dp": ("str", ["central", "User", "sample", ""]),
    "train.dp_clip": ("float", [0, -1.0]),
    "train.noise_multiplier": ("float?", [-0.5]),
    "train.target_epsilon": ("float?", [0, -3.0]),
    "train.dp_delta": ("float", [0, 1, 1.5, -1e-5]),
    "train.dp_accountant": ("str", ["gdp", "RDP", ""]),
    "generation.policy": ("str", ["balanced", ""]),
    "generation.beta": ("float", [0, -12]),
    "generation.budget": ("int?", [-1]),
    "generation.backend": ("str", ["gan", ""]),
    "generation.model_dir": ("str?", [""]),
    "generation.prompt_template": ("str", ["a photo", "{name} of {kind}", "{name", ""]),
    "generation.class_names_file": ("str?", [""]),
    "generation.generator": ("str?", ["localhost", "host:0", "host:70000", ":50051", "host:port", "", "a:1,a:1",
                                      "a:1,", "dns:///a:1,b:2", "a :1"]),
    "generation.ddim_steps": ("int", [0, 1001]),
    "generation.guidance": ("float", [-3, -0.001, 101]),
    "generation.train_steps": ("int", [0]),
    "generation.size": ("str", ["huge", "Tiny", ""]),
    "generation.exponent": ("float", [-0.5, 2.5]),
    "generation.entropy_factor": ("bool", []),
    "generation.min_confidence": ("float", [-0.1, 1, 1.5]),
    "generation.evaluate_per_class": ("int", [-1, 1]),
    "runtime.host": ("str", [""]),
    "runtime.coordinator_port": ("int", [-1, 65536]),
    "runtime.round_timeout_s": ("float", [0, -1]),
    "runtime.quorum": ("float", [0, 1.5]),
    "runtime.registration_timeout_s": ("float", [0]),
    "runtime.rejoin_grace_s": ("float", [-1, -0.5]),
    "runtime.clients_per_process": ("int", [0]),
    "runtime.torch_threads": ("int", [0]),
    "runtime.heartbeat_s": ("float", [0]),
    "runtime.heartbeat_timeout_s": ("float", [0, -1, 2.0, 3.9]),  # below twice the default heartbeat_s
    "runtime.overlap_evaluation": ("bool", []),
    "runtime.tls_dir": ("str?", [""]),
    "runtime.wire_dtype": ("str", ["float64", "fp16", "FLOAT16", "int8", ""]),
    "runtime.data_plane": ("str", ["TCP", "udp", "http", ""]),
    "runtime.data_plane_min_bytes": ("int", [-1]),
    "runtime.max_update_norm": ("float|str", [-1, -0.5, "AUTO", "off", "", "median"]),
    "runtime.max_update_norm_factor": ("float", [1, 0.5, 0, -3, 1e7]),
    "runtime.update_norm_action": ("str", ["drop", "CLIP", ""]),
    "runtime.max_refusals": ("int", [-1]),
    "sdafl.samples_per_client": ("int", [0]),
    "sdafl.tau": ("float", [-0.1, 1]),
    "sdafl.lambda2": ("float", [-1]),
    "sdafl.mixup_alpha": ("float", [0]),
    "sdafl.gan_steps": ("int", [0]),
    "sdafl.gan_batch_size": ("int", [0]),
    "sdafl.gan_latent_dim": ("int", [0]),
    "sdafl.gan_width": ("int", [0]),
    "sdafl.gan_lr": ("float", [0]),
    "sdafl.secure_noise": ("bool", []),
    "sdafl.target_epsilon": ("float", [-1]),
    "sdafl.noise_multiplier": ("float", [-0.5]),
    "sdafl.delta": ("float", [-0.1, 1]),
    "sdafl.max_grad_norm": ("float", [0]),
    "sdafl.accountant": ("str", ["gdp", ""]),
    "sdafl.server_steps": ("int", [-1]),
    "sdafl.server_lr": ("float", [0]),
    "sdafl.server_batch_size": ("int", [0]),
    "sdafl.track_agreement": ("bool", []),
    "federate.local_steps": ("int", [0, -1]),
    "federate.batch_size": ("int", [0]),
    "federate.lr": ("float?", [0, -1e-3]),
    "federate.label_dropout": ("float", [-0.1, 1]),
    "federate.ema_decay": ("float", [-0.1, 1]),
    "federate.dp": ("str", ["users", "", "DP"]),
    "federate.clip": ("float", [0, -1]),
    "federate.noise_multiplier": ("float", [-0.5]),
    "federate.target_epsilon": ("float?", [0, -1]),
    "federate.delta": ("float", [0, 1, -0.1, 2]),
    "federate.accountant": ("str", ["gdp", ""]),
    "federate.noise_multiplicity": ("int", [0]),
    "federate.max_physical_batch": ("int", [0]),
    "federate.init": ("str?", [""]),
    "federate.secure_noise": ("bool", []),
    "federate.device": ("str", ["gpu", "CUDA", ""]),
    "evolve.candidates_per_class": ("int", [0, -1]),
    "evolve.dp": ("str", ["users", ""]),
    "evolve.noise_multiplier": ("float", [-0.5]),
    "evolve.target_epsilon": ("float?", [0, -1]),
    "evolve.delta": ("float", [0, 1, -0.1]),
    "evolve.accountant": ("str", ["gdp"]),
    "evolve.threshold": ("float", [-1]),
    "evolve.strength_start": ("float", [0, 1.5, -0.2]),
    "evolve.strength_end": ("float", [0, 1.01]),
    "evolve.embedder": ("str", ["inception", ""]),
    "evolve.embedder_model": ("str?", [""]),
    "evolve.embedder_sha256": ("str?", ["abc", "G" * 64]),
    "evolve.secure_noise": ("bool", []),
}


def raw_with(key: str, value: Any) -> dict[str, Any]:
    section, _, leaf = key.rpartition(".")
    return {section: {leaf: value}} if section else {key: value}


def assert_names(key: str, exc: ConfigError) -> None:
    message = str(exc)
    assert "\n" not in message, f"{key}: a one-line message, got {message!r}"
    assert re.search(rf"(^|[^\w.]){re.escape(key)}([^\w]|$)", message), f"{key!r} is not named in {message!r}"


def wrong_type_values(kind: str, rng: random.Random, count: int = 12) -> list[Any]:
    """Random values none of which has the kind's type (an int is a float, not the reverse; bool is never a number)."""
    def word() -> str:
        return "".join(rng.choice(string.ascii_letters + string.digits + " .-") for _ in range(rng.randint(0, 10)))

    makers = {
        "str": word,
        "int": lambda: rng.randint(-(10**9), 10**9),
        "fraction": lambda: rng.randint(-(10**6), 10**6) + rng.choice([0.5, 0.25, 0.001]),
        "special": lambda: rng.choice([math.nan, math.inf, -math.inf]),
        "bool": lambda: rng.choice([True, False]),
        "list": lambda: [rng.randint(0, 9) for _ in range(rng.randint(0, 3))],
        "table": lambda: {word(): rng.randint(0, 9)},
        "none": lambda: None,
    }
    wrong = {
        "int": ("str", "fraction", "special", "bool", "list", "table", "none"),
        "float": ("str", "special", "bool", "list", "table", "none"),
        "bool": ("str", "int", "fraction", "special", "list", "table", "none"),
        "str": ("int", "fraction", "special", "bool", "list", "table", "none"),
        "table": ("str", "int", "fraction", "special", "bool", "list", "none"),
        "float|str": ("special", "bool", "list", "table", "none"),
        "strlist": ("str", "int", "fraction", "special", "bool", "list", "table", "none"),  # "list": of integers
    }[kind.rstrip("?")]
    if kind.endswith("?"):
        wrong = tuple(name for name in wrong if name != "none")
    return [makers[rng.choice(wrong)]() for _ in range(count)]


def all_config_keys() -> set[str]:
    top = {f.name for f in dataclasses.fields(RunConfig) if f.name not in SECTIONS}
    return top | {f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


def test_the_table_names_every_key_of_every_section() -> None:
    assert set(KEYS) == all_config_keys()


@pytest.mark.parametrize("key", sorted(KEYS))
def test_wrong_types_are_a_config_error_naming_the_key(key: str) -> None:
    rng = random.Random(f"wrong-type {key}")  # fixed: the same random values on every run
    for value in wrong_type_values(KEYS[key][0], rng):
        with pytest.raises(ConfigError) as err:  # any other exception fails the test
            from_dict(raw_with(key, value))
        assert_names(key, err.value)


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_a_section_that_is_not_a_table_is_named(section: str) -> None:
    for value in wrong_type_values("table", random.Random(section)):
        with pytest.raises(ConfigError) as err:
            from_dict({section: value})
        assert_names(section, err.value)


@pytest.mark.parametrize("key", sorted(key for key, (_, bad) in KEYS.items() if bad))
def test_out_of_range_values_are_a_config_error_naming_the_key(key: str) -> None:
    for value in KEYS[key][1]:
        with pytest.raises(ConfigError) as err:
            from_dict(raw_with(key, value))
        assert_names(key, err.value)


@pytest.mark.parametrize(
    ("key", "value"),
    [("data.alpha", 1e-9), ("data.holdout_fraction", 0), ("runtime.quorum", 1), ("runtime.coordinator_port", 65535),
     ("runtime.rejoin_grace_s", 0), ("generation.guidance", 0), ("generation.generator", "[::1]:50051"),
     ("generation.budget", 0), ("train.max_steps", 0), ("seed", 2**32 - 1), ("sdafl.target_epsilon", 0),
     ("generation.size", "ddpm-cifar"), ("train.model", "resnet18"), ("data.dataset", "cifar100"),
     ("runtime.max_update_norm", "auto"), ("runtime.max_update_norm", 0.0), ("runtime.max_update_norm", 1e-9),
     ("runtime.max_update_norm_factor", 1e6), ("runtime.update_norm_action", "clip"), ("data.max_samples_per_client", 0)],
)
def test_values_at_the_edges_are_accepted(key: str, value: Any) -> None:
    cfg = from_dict(raw_with(key, value))
    section, _, leaf = key.rpartition(".")
    assert getattr(getattr(cfg, section) if section else cfg, leaf) == value


def test_an_integer_for_a_float_key_is_read_as_a_float_and_survives_json() -> None:
    cfg = from_dict({"data": {"alpha": 1}, "train": {"algorithm": "scaffold", "algorithm_params": {"num_clients": 4}}})
    assert isinstance(cfg.data.alpha, float)
    assert cfg.train.algorithm_params == {"num_clients": 4} and isinstance(cfg.train.algorithm_params["num_clients"], int)
    assert from_json(to_json(cfg)) == cfg


@pytest.mark.parametrize(
    ("overrides", "key"),
    [(["data=5"], "data"), (["data.clients=abc"], "data.clients"), (["train.rounds=1.5"], "train.rounds"),
     (["foo.bar=1"], "foo"), (["foo=1"], "foo"), (["data.foo=1"], "data.foo"), (["generation.size=huge"], "generation.size"),
     (['generation.size="huge"'], "generation.size"), (["generation.guidance=-3"], "generation.guidance"),
     (["runtime.rejoin_grace_s=-1"], "runtime.rejoin_grace_s"), (["train.algorithm_params=5"], "train.algorithm_params"),
     (["train.algorithm=fedprox", "train.algorithm_params.mu=nan"], "train.algorithm_params.mu"),
     (["train.algorithm=moon", "train.algorithm_params.temperature=0"], "train.algorithm_params.temperature"),
     (["train.algorithm=fedprox", "train.algorithm_params.temp=1"], "train.algorithm_params.temp"),
     (["train.algorithm=scaffold", "train.algorithm_params.num_clients=2.5"], "train.algorithm_params.num_clients"),
     (["data.alpha=inf"], "data.alpha"), (["data.clients=3", "data.clients.x=1"], "clients")],
)
def test_bad_overrides_name_the_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert_names(key, err.value)


def test_a_bad_key_in_a_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[generation]\nsize = "huge"\n')
    with pytest.raises(ConfigError, match=r"^generation.size must be one of tiny, small, half, ddpm-cifar, got 'huge'$"):
        load_config(path)
    path.write_text("data = 5\n")
    with pytest.raises(ConfigError, match=r"^data must be a table"):
        load_config(path)


def test_the_config_and_the_algorithms_refuse_the_same_parameter_values() -> None:
    """Both read the bounds in config_schema.ALGORITHM_PARAMS: values at each edge, through both doors."""
    from fedsynth.algorithms import get_algorithm

    for name, params in ALGORITHM_PARAMS.items():
        for param, bound in params.items():
            base = {"num_clients": 3} if name == "scaffold" and param != "num_clients" else {}
            bad = [bound.low - 1, math.nan, True] + [bound.low] * bound.strict + [2.5] * bound.integer
            good = [bound.low + 1] + ([] if bound.strict else [bound.low])
            for value in bad + good:
                raw = {"train": {"algorithm": name, "algorithm_params": {**base, param: value}}}
                if value in good and not isinstance(value, bool):
                    from_dict(raw)
                    get_algorithm(name, **{**base, param: value})
                    continue
                with pytest.raises(ConfigError) as err:
                    from_dict(raw)
                assert_names(f"train.algorithm_params.{param}", err.value)
                with pytest.raises(ConfigError, match=param):
                    get_algorithm(name, **{**base, param: value})


def test_the_sdafl_section_takes_the_sdafl_algorithm_bounds() -> None:
    for param, bound in ALGORITHM_PARAMS["sdafl"].items():
        edge = {"sdafl": {param: bound.low}}
        if bound.strict:
            with pytest.raises(ConfigError, match=rf"^sdafl.{param} must be {re.escape(str(bound))}, got "):
                from_dict(edge)
        else:
            assert getattr(from_dict(edge).sdafl, param) == bound.low


def test_reading_a_config_imports_neither_torch_nor_a_role_package() -> None:
    """Why the names live in config_schema: the launcher and the config check stay light."""
    code = ("import sys; import fedsynth.config, fedsynth.config_schema; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'torch', 'torchvision', 'diffusers', 'coordinator', 'client_node', 'generator_service', 'deploy'}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"


def test_a_table_keyed_by_other_names_fails_when_imported() -> None:
    require_names("t", iter(GENERATOR_SIZES), GENERATOR_SIZES)
    for keys in (GENERATOR_SIZES[:-1], tuple(reversed(GENERATOR_SIZES)), (*GENERATOR_SIZES, "huge")):
        with pytest.raises(AssertionError, match=r"^t is keyed by"):
            require_names("t", keys, GENERATOR_SIZES)


def test_every_backend_name_has_its_module() -> None:
    """generator_service.backends.BACKENDS is derived from the names and imports lazily: each must resolve."""
    from generator_service.backends import get_backend

    assert [get_backend(name).name for name in GENERATOR_BACKENDS] == list(GENERATOR_BACKENDS)
    assert set(DATASETS) >= {"digits", "cifar10"}


# ---- data feasibility before start ---------------------------------------------------------------------------------

def test_an_impossible_dirichlet_split_is_a_config_error_naming_the_keys() -> None:
    cfg = load_config(None, ["data.clients=100", "data.min_size=5"])
    started = time.monotonic()
    with pytest.raises(ConfigError) as err:
        check_partition(cfg)
    assert time.monotonic() - started < 30
    for named in ("data.clients=100", "data.alpha=0.1", "data.min_size=5", "digits", "1438 labels"):
        assert named in str(err.value)
    check_partition(load_config(None, ["data.clients=100", "data.min_size=5", "data.partition=iid"]))


@pytest.mark.parametrize(("clients", "min_size", "seed", "digest"),
                         [(10, 10, 0, "eaeb71e3d25881c0"), (30, 10, 2, "48912511e1da6f4b")])
def test_the_split_is_the_one_earlier_versions_drew(clients: int, min_size: int, seed: int, digest: str) -> None:
    """Pinned from the version before the redraw loop stopped cutting rejected draws into shards: same shards."""
    parts = partition(load_labels("digits"), clients, alpha=0.1, seed=seed, min_size=min_size)
    joined = b"".join(np.asarray(p, dtype=np.int64).tobytes() + b"|" for p in parts)
    assert hashlib.sha256(joined).hexdigest()[:16] == digest


# ---- one split per node process -------------------------------------------------------------------------------------

def _shards_from_threads(cfg: RunConfig, clients: list[int], monkeypatch: pytest.MonkeyPatch) -> tuple[int, list[Any]]:
    calls = []
    real = assembly.partition_for

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        time.sleep(0.2)  # long enough that every thread asks while the first split is still running
        return real(*args, **kwargs)

    monkeypatch.setattr(assembly, "partition_for", counting)
    assembly._load_and_split.cache_clear()
    barrier = threading.Barrier(len(clients))
    results: list[Any] = [None] * len(clients)

    def one(i: int) -> None:
        barrier.wait()
        try:
            results[i] = assembly.client_shard(cfg, clients[i])
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(clients))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assembly._load_and_split.cache_clear()
    return len(calls), results


def test_a_node_splits_once_for_all_its_logical_clients(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(None, ["data.clients=6"])
    calls, shards = _shards_from_threads(cfg, list(range(6)), monkeypatch)
    assert calls == 1
    sizes = [len(shard.y) for shard in shards]
    assert sum(sizes) == len(load_labels("digits")) and min(sizes) >= cfg.data.min_size


def test_a_failed_split_is_not_redone_for_each_client(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(None, ["data.clients=100", "data.min_size=5"])
    calls, errors = _shards_from_threads(cfg, [0, 1, 2, 3], monkeypatch)
    assert calls == 1
    assert all(isinstance(e, ConfigError) and "data.clients=100" in str(e) for e in errors)
    assert len({id(e) for e in errors}) == len(errors)


# ---- the CLI contract: exit 1 before any process starts, one line naming the key ------------------------------------

def fedsynth_script() -> str:
    return str(Path(sys.executable).parent / "fedsynth")


@pytest.mark.parametrize(
    ("override", "key"),
    [("data=5", "data"), ('generation.size="huge"', "generation.size"), ("data.clients=100", "data.clients=100")],
)
def test_run_refuses_a_bad_config_before_starting_anything(tmp_path: Path, override: str, key: str) -> None:
    out = tmp_path / "run"
    started = time.monotonic()
    result = subprocess.run([fedsynth_script(), "run", "--set", override, "--out-dir", str(out), "--no-progress"],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedsynth run: error: ") and key in lines[0], result.stderr
    assert not any(tmp_path.iterdir()), "nothing may be written (no logs/, no port files) before the config is accepted"
    assert elapsed < 60, f"took {elapsed:.1f}s"


@pytest.mark.parametrize("scheme", ["dirichlet", "iid"])
def test_more_clients_than_samples_is_refused_before_any_split(scheme: str) -> None:
    cfg = load_config(None, ["data.clients=1000000000", "data.min_size=0", f"data.partition={scheme}"])
    with pytest.raises(ConfigError, match=r"^data.clients=1000000000, data.min_size=0.*exceed the 1438 samples"):
        check_partition(cfg)


def test_the_coordinator_refuses_an_impossible_split_before_serving(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = subprocess.run([fedsynth_script(), "coordinator", "--insecure", "--set", "data.clients=100", "--set",
                             "data.min_size=5", "--out-dir", str(out), "--port-file", str(tmp_path / "port")],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedsynth coordinator: error: data.clients=100"), result.stderr
    assert not any(tmp_path.iterdir()), "no port file, no output folder"


def test_fedeas_ablation_keys_read_from_set_and_change_the_fingerprint_only_off_the_paper_rule() -> None:
    paper = load_config(None, ["generation.exponent=0.5", "generation.entropy_factor=true"])
    assert paper == load_config(None) and (paper.generation.exponent, paper.generation.entropy_factor) == (0.5, True)
    ablated = load_config(None, ["generation.exponent=1", "generation.entropy_factor=false"])
    assert ablated.generation.exponent == 1.0 and isinstance(ablated.generation.exponent, float)
    assert ablated.generation.entropy_factor is False
    assert from_json(to_json(ablated)) == ablated
    # a checkpoint written before the keys existed resumes: at the paper's rule they are not in the fingerprint
    content = paper.to_dict()
    for key in ("out_dir", "runtime"):
        content.pop(key)
    content["train"].pop("rounds")
    for key in ("exponent", "entropy_factor"):
        content["generation"].pop(key)
    later = {key: content["generation"].pop(key) for key in ("prompt_template", "class_names_file") if key in content["generation"]}
    assert later in ({}, {"prompt_template": "a photo of a {name}", "class_names_file": None})  # text2image's, at defaults
    assert content["generation"].pop("min_confidence") == 0.0  # the quality filter's, off
    content["generation"].pop("evaluate_per_class")  # scoring the generator after the run: never in the fingerprint
    content.pop("federate")  # the federated generator's section: in the fingerprint of a "ddpm" run only
    content.pop("evolve")  # Private Evolution's section: in the fingerprint of a "pe" run only
    assert content["data"].pop("local_test_fraction") == 0.0  # federated evaluation's keys, at their defaults
    assert [content["train"].pop(key) for key in ("evaluation", "eval_every", "fraction_evaluate")] == ["server", 1, 1.0]
    content["data"].pop("max_samples_per_client")  # who may register: never in the fingerprint
    content["train"].pop("device")  # where training runs: never in the fingerprint
    for section, defaults in {"data": {"max_image_pixels": 1 << 24, "follow_symlinks": False},
                              "train": {"aggregation": "mean", "aggregation_params": {}, "precision": "fp32",
                                        "optimizer": "sgd", "lr_schedule": "constant", "init_weights": None, "dp": "none",
                                        "dp_clip": 1.0, "noise_multiplier": None, "target_epsilon": None, "dp_delta": 1e-5,
                                        "dp_accountant": "rdp"}}.items():
        for key, default in defaults.items():  # the untrusted-members keys, at their defaults
            assert content[section].pop(key) == default
    content["data"].pop("local_dir")  # where the launcher finds client folders: never in the fingerprint
    content["data"].pop("test_dir")  # where the coordinator's own test data lies (local mode): never in it either
    for key, default in {"source": "split", "classes": None, "image_size": None, "channels": None}.items():
        assert content["data"].pop(key) == default  # local data's keys, at their defaults (split mode)
    assert paper.fingerprint() == hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]
    fingerprints = {paper.fingerprint(), ablated.fingerprint(),
                    load_config(None, ["generation.exponent=1.0"]).fingerprint(),
                    load_config(None, ["generation.entropy_factor=false"]).fingerprint()}
    assert len(fingerprints) == 4
    with pytest.raises(ConfigError, match=r"^generation\.entropy_factor must be true or false, got 'no'$"):
        load_config(None, ["generation.entropy_factor=no"])
    with pytest.raises(ConfigError, match=r"^generation\.exponent must be in \[0, 2.0\], got 3.0$"):
        load_config(None, ["generation.exponent=3"])


def test_the_bounded_update_keys_leave_the_default_fingerprint_as_it_was() -> None:
    assert load_config(None).fingerprint() == "a131c5ba3d48046d"  # the embedded default's, before the keys existed
    assert load_config(None, ["runtime.max_update_norm=0", "runtime.update_norm_action=\"clip\"",
                              "runtime.max_update_norm_factor=3", "data.max_samples_per_client=500"]).fingerprint() == "a131c5ba3d48046d"
    bounded = {load_config(None, sets).fingerprint() for sets in (
        ["runtime.max_update_norm=5"], ["runtime.max_update_norm=\"auto\""],
        ["runtime.max_update_norm=\"auto\"", "runtime.max_update_norm_factor=3"],
        ["runtime.max_update_norm=5", "runtime.update_norm_action=\"clip\""])}
    assert len(bounded) == 4 and "a131c5ba3d48046d" not in bounded  # a bound changes results: a checkpoint must match it
    cfg = load_config(None, ["runtime.max_update_norm=\"auto\""])
    assert cfg.runtime.max_update_norm == "auto" and from_json(to_json(cfg)) == cfg
    assert load_config(None, ["runtime.max_update_norm=7"]).runtime.max_update_norm == 7.0


def test_local_mode_evaluates_federated_unless_the_coordinator_has_test_data() -> None:
    local = ['data.source="local"', 'data.local_dir="clients"']
    assert load_config(None, local).train.evaluation == "federated"  # the default when the coordinator holds no data
    assert load_config(None, [*local, 'data.test_dir="test"']).train.evaluation == "server"
    assert load_config(None, [*local, 'data.test_dir="test"', 'train.evaluation="both"']).train.evaluation == "both"
    with pytest.raises(ConfigError, match=r'^train\.evaluation must be "federated" when data\.source = "local" without '
                                          r"data\.test_dir: the coordinator holds no test data, got 'server'$"):
        load_config(None, [*local, 'train.evaluation="server"'])
    with pytest.raises(ConfigError, match=r"^data\.test_dir is the coordinator's test data in local mode"):
        load_config(None, ['data.test_dir="test"'])
