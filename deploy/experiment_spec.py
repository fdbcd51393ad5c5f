"""The experiment file: [experiment] settings, [base] run config, [[arms]] and [sweep]; each arm's exact run TOML."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedsynth.config import RunConfig, apply_overrides, from_dict
from fedsynth.errors import ConfigError
from fedsynth.process.runtime import write_atomic

ROLES = ("fedavg", "uniform", "missing", "full", "fedeas", "sdafl")
# What must agree across arms so they share one partition and one generator (seed and data are checked too).
GENERATOR_KEYS = ("backend", "model_dir", "generator", "size", "train_steps")
EXPERIMENT_KEYS = {"name", "out_dir", "last_n", "threshold", "arm_timeout_s", "confidence"}
ARM_KEYS = {"name", "role", "set", "timeout_s", "seeds", "compare", "own_generator"}
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def role_policy(role: str) -> str:
    """The generation.policy an arm of this role runs (FedAvg and SDA-FL allocate no images)."""
    return {"fedavg": "none", "sdafl": "none"}.get(role, role)


@dataclass(frozen=True)
class Settings:
    name: str = "experiment"
    out_dir: str | None = None
    last_n: int = 20  # accuracy = mean over the last N rounds (all rounds when fewer)
    threshold: float = 0.8  # rounds-to-threshold accuracy (Fig. 4)
    arm_timeout_s: float = 3600.0  # deadline of one (arm, seed) run
    confidence: float = 0.95

    def __post_init__(self) -> None:
        if self.last_n < 1:
            raise ConfigError(f"experiment.last_n must be >= 1, got {self.last_n}")
        if not 0 <= self.threshold <= 1:
            raise ConfigError(f"experiment.threshold must be an accuracy in [0, 1], got {self.threshold}")
        if not self.arm_timeout_s > 0:
            raise ConfigError(f"experiment.arm_timeout_s must be > 0, got {self.arm_timeout_s}")
        if not 0 < self.confidence < 1:
            raise ConfigError(f"experiment.confidence must be in (0, 1), got {self.confidence}")


@dataclass(frozen=True)
class Arm:
    name: str
    role: str | None
    overrides: tuple[str, ...]
    timeout_s: float
    beta: float | None = None  # set for the points of a [sweep]
    seeds: tuple[int, ...] | None = None  # run only on these of the experiment's seeds (None: on every seed)
    compare: tuple[str, ...] = ()  # arms this one is paired with, seed by seed, in the summary (this − that)
    # its generation.backend/model_dir/... may differ from the other arms' (an arm that compares generators, e.g. FedEAS
    # with a federated one beside FedEAS with a central one); the partition is still shared
    own_generator: bool = False

    def runs_on(self, seed: int) -> bool:
        return self.seeds is None or seed in self.seeds


@dataclass(frozen=True)
class Experiment:
    settings: Settings
    base: dict[str, Any]
    arms: tuple[Arm, ...]

    @property
    def base_seed(self) -> int:
        return from_dict(self.base).seed

    def plan(self, seeds: list[int]) -> list[tuple[Arm, int]]:
        """(arm, seed) pairs to run, arm by arm: every arm on every seed it runs on."""
        return [(arm, seed) for arm in self.arms for seed in seeds if arm.runs_on(seed)]

    def arm_config(self, arm: Arm, seed: int, arm_dir: Path) -> RunConfig:
        raw = apply_overrides(self.base, [*arm.overrides, f"seed={seed}", f"out_dir={json.dumps(str(arm_dir))}"])
        try:
            return from_dict(raw)
        except ConfigError as exc:
            raise ConfigError(f"arm {arm.name!r}: {exc}") from exc


def _settings(raw: Any, cli: list[str]) -> Settings:
    if not isinstance(raw, dict):
        raise ConfigError(f"[experiment] must be a table, got {raw!r}")
    merged = apply_overrides(raw, cli)
    unknown = sorted(set(merged) - EXPERIMENT_KEYS)
    if unknown:
        raise ConfigError(f"unknown key(s) in [experiment]: {', '.join(unknown)}; known: {', '.join(sorted(EXPERIMENT_KEYS))}")
    for key, value in merged.items():
        wanted = (str,) if key in ("name", "out_dir") else (int,) if key == "last_n" else (int, float)
        if isinstance(value, bool) or not isinstance(value, wanted):
            raise ConfigError(f"experiment.{key} must be {' or '.join(t.__name__ for t in wanted)}, got {value!r}")
    return Settings(**merged)


def _arm(raw: Any, settings: Settings) -> Arm:
    if not isinstance(raw, dict):
        raise ConfigError(f"each [[arms]] entry must be a table, got {raw!r}")
    name = raw.get("name")
    if not isinstance(name, str) or not SAFE_NAME.match(name):
        raise ConfigError(f"an arm needs a name of letters, digits, '.', '_' or '-' (it names a folder), got {name!r}")
    unknown = sorted(set(raw) - ARM_KEYS)
    if unknown:
        raise ConfigError(f"arm {name!r}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(ARM_KEYS))}")
    overrides = raw.get("set", [])
    if not isinstance(overrides, list) or not all(isinstance(item, str) for item in overrides):
        raise ConfigError(f"arm {name!r}: 'set' must be a list of \"section.key=value\" strings, got {overrides!r}")
    role = raw.get("role", name if name in ROLES else None)
    if role is not None and role not in ROLES:
        raise ConfigError(f"arm {name!r}: role must be one of {ROLES}, got {role!r}")
    timeout = raw.get("timeout_s", settings.arm_timeout_s)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
        raise ConfigError(f"arm {name!r}: timeout_s must be a number > 0, got {timeout!r}")
    seeds = raw.get("seeds")
    if seeds is not None and (
        not isinstance(seeds, list) or not seeds or not all(isinstance(x, int) and not isinstance(x, bool) for x in seeds)
        or len(set(seeds)) != len(seeds)
    ):
        raise ConfigError(f"arm {name!r}: seeds must be a non-empty list of distinct integers, got {seeds!r}")
    compare = raw.get("compare", [])
    if not isinstance(compare, list) or not all(isinstance(other, str) for other in compare) or name in compare:
        raise ConfigError(f"arm {name!r}: compare must be a list of other arms' names, got {compare!r}")
    own_generator = raw.get("own_generator", False)
    if not isinstance(own_generator, bool):
        raise ConfigError(f"arm {name!r}: own_generator must be true or false, got {own_generator!r}")
    return Arm(name, role, tuple(overrides), float(timeout), seeds=None if seeds is None else tuple(seeds), compare=tuple(compare),
               own_generator=own_generator)


def _sweep_arms(raw: Any, settings: Settings) -> list[Arm]:
    """[sweep] betas = [...], set = [...]: one FedEAS arm per beta (Fig. 5a)."""
    if not isinstance(raw, dict) or set(raw) - {"betas", "set", "timeout_s"}:
        raise ConfigError(f"[sweep] must be a table with 'betas' (and optionally 'set', 'timeout_s'), got {raw!r}")
    betas = raw.get("betas")
    if not isinstance(betas, list) or not betas or not all(isinstance(b, int | float) and not isinstance(b, bool) and b > 0 for b in betas):
        raise ConfigError(f"sweep.betas must be a non-empty list of numbers > 0, got {betas!r}")
    overrides = ["generation.policy=fedeas", *raw.get("set", [])]
    timeout = raw.get("timeout_s", settings.arm_timeout_s)
    arms = []
    for beta in betas:
        spec = {"name": f"beta-{beta:g}", "set": [*overrides, f"generation.beta={float(beta)!r}"], "timeout_s": timeout}
        arms.append(dataclasses.replace(_arm(spec, settings), beta=float(beta)))
    return arms


def _identity(cfg: RunConfig, *, with_generator: bool = True) -> dict[str, Any]:
    d = cfg.to_dict()
    generator = {f"generation.{k}": d["generation"][k] for k in GENERATOR_KEYS} if with_generator else {}
    return {"seed": d["seed"], **{f"data.{k}": v for k, v in d["data"].items()}, **generator}


def _check_role(arm: Arm, cfg: RunConfig) -> None:
    """A role says what the arm is (the table's comparisons rely on it): its policy and algorithm must agree."""
    if arm.role is None:
        return
    policy, algorithm = cfg.generation.policy, cfg.train.algorithm
    expected_policy = role_policy(arm.role)
    if policy != expected_policy or (arm.role == "sdafl") != (algorithm == "sdafl"):
        raise ConfigError(
            f"arm {arm.name!r} has role {arm.role!r} but runs generation.policy = {policy!r} with train.algorithm = {algorithm!r}; "
            f"role {arm.role!r} needs generation.policy = {expected_policy!r}" + (" and train.algorithm = 'sdafl'" if arm.role == "sdafl" else "")
        )


def _resolved(base: dict[str, Any], arm: Arm) -> dict[str, Any] | None:
    try:
        return from_dict(apply_overrides(base, list(arm.overrides))).to_dict()
    except ConfigError:
        return None  # reported with the arm's name below


def load_experiment(path: str | Path, overrides: list[str] | None = None) -> Experiment:
    """Read and validate an experiment TOML; `--set experiment.KEY=V` goes to [experiment], others to [base]."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"experiment file {str(path)!r} does not exist")
    try:
        raw = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML ({exc})") from exc
    unknown = sorted(set(raw) - {"experiment", "base", "arms", "sweep"})
    if unknown:
        raise ConfigError(f"{path}: unknown table(s) {', '.join(unknown)}; known: experiment, base, arms, sweep")
    overrides = overrides or []
    settings = _settings(raw.get("experiment", {}), [o.removeprefix("experiment.") for o in overrides if o.startswith("experiment.")])
    if not isinstance(raw.get("base", {}), dict):
        raise ConfigError(f"{path}: [base] must be a table (a run config)")
    base = apply_overrides(raw.get("base", {}), [o for o in overrides if not o.startswith("experiment.")])
    try:
        from_dict(base)
    except ConfigError as exc:
        raise ConfigError(f"{path} [base]: {exc}") from exc
    arms = [_arm(entry, settings) for entry in raw.get("arms", [])]
    for point in _sweep_arms(raw["sweep"], settings) if "sweep" in raw else []:
        # a sweep point that is exactly an [[arms]] entry (e.g. fedeas at the base beta) reuses that arm's runs
        twin = next((i for i, arm in enumerate(arms) if _resolved(base, arm) == _resolved(base, point)), None)
        if twin is None:
            arms.append(point)
        else:
            arms[twin] = dataclasses.replace(arms[twin], beta=point.beta)
    if not arms:
        raise ConfigError(f"{path}: no [[arms]] and no [sweep]: nothing to run")
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise ConfigError(f"{path}: arm names must be unique, got {names}")
    for arm in arms:
        missing = [other for other in arm.compare if other not in names]
        if missing:
            raise ConfigError(f"arm {arm.name!r}: compare names no arm of this experiment: {', '.join(missing)}; arms: {', '.join(names)}")
    roles = [a.role for a in arms if a.role]
    if len(set(roles)) != len(roles):
        raise ConfigError(f"{path}: each role may be given to one arm only, got {roles}")
    experiment = Experiment(settings, base, tuple(arms))
    for arm in arms:
        _check_role(arm, experiment.arm_config(arm, 0, Path(".")))
    shared = [arm for arm in arms if not arm.own_generator] or arms[:1]
    reference = _identity(experiment.arm_config(shared[0], 0, Path(".")))
    for arm in arms:
        identity = _identity(experiment.arm_config(arm, 0, Path(".")), with_generator=not arm.own_generator)
        for key, value in identity.items():
            if value != reference[key]:
                raise ConfigError(
                    f"arm {arm.name!r} sets {key} = {value!r} but arm {shared[0].name!r} has {reference[key]!r}: "
                    "every arm must share the partition (seed, data.*) and, unless it sets own_generator = true, the generator"
                )
    return experiment


# ---- the arm's run config as TOML -------------------------------------------------------------------


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("nan" if math.isnan(value) else ("inf" if value > 0 else "-inf"))
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise ConfigError(f"cannot write {value!r} ({type(value).__name__}) as a TOML value")


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def _toml_table(table: dict[str, Any], prefix: str) -> list[str]:
    """Scalars of the table first, then its sub-tables; None (a default) is left out."""
    lines = [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items() if v is not None and not isinstance(v, dict)]
    for key, sub in ((k, v) for k, v in table.items() if isinstance(v, dict)):
        name = f"{prefix}.{_toml_key(key)}" if prefix else _toml_key(key)
        lines += ["", f"[{name}]", *_toml_table(sub, name)]
    return lines


def write_run_toml(cfg: RunConfig, path: Path) -> None:
    """Write the whole resolved config, and check it reads back to the same config."""
    text = "# written by `fedsynth experiment`: the exact config of this run\n" + "\n".join(_toml_table(cfg.to_dict(), "")) + "\n"
    if from_dict(tomllib.loads(text)).to_dict() != cfg.to_dict():
        raise ConfigError(f"the config written to {path} does not read back the same; refusing to run it")
    write_atomic(path, text)
