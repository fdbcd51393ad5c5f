"""`fedsynth experiment`: statistics by hand, spec validation, exact arm configs, real arms, deadlines, resume."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.experiment import parse_seeds, previous_run
from deploy.experiment_spec import load_experiment, write_run_toml
from deploy.experiment_summary import POLICY_COLOURS, arm_policy, build_summary, run_metrics
from deploy.stats import paired_difference, summarize, t_critical
from fedsynth.config import from_dict, load_config
from fedsynth.errors import ConfigError

TINY_BASE = """
[base]
[base.data]
clients = 3
[base.train]
rounds = 2
local_epochs = 1
[base.generation]
policy = "none"
[base.runtime]
clients_per_process = 3
"""


def fedsynth(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fedsynth.cli", *args], capture_output=True, text=True, timeout=timeout, check=False)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# ---- statistics -------------------------------------------------------------------------------------


def test_t_interval_for_three_values_matches_the_hand_computation() -> None:
    assert t_critical(3) == pytest.approx(4.302652729911275, rel=1e-9)  # t_{0.975, 2}
    s = summarize([0.80, 0.82, 0.87])
    # mean 0.83; deviations -0.03, -0.01, 0.04; sum of squares 0.0026; std = sqrt(0.0026 / 2) = 0.036056
    assert s.n == 3 and s.mean == pytest.approx(0.83) and s.std == pytest.approx(math.sqrt(0.0013))
    half = 4.302652729911275 * math.sqrt(0.0013) / math.sqrt(3)  # = 0.089567
    assert (s.ci_low, s.ci_high) == (pytest.approx(0.83 - half), pytest.approx(0.83 + half))
    assert half == pytest.approx(0.0895668, abs=1e-6)


def test_summaries_of_one_or_no_value_have_no_interval() -> None:
    one = summarize([0.5])
    assert (one.n, one.mean, one.std, one.ci_low, one.ci_high) == (1, 0.5, None, None, None)
    assert summarize([]).mean is None
    with pytest.raises(ConfigError, match="nan"):
        summarize([0.5, float("nan")])


def test_paired_difference_pairs_by_seed() -> None:
    fedeas = {0: 0.85, 1: 0.80, 2: 0.90, 7: 0.5}
    uniform = {0: 0.83, 1: 0.79, 2: 0.86}
    diff = paired_difference(fedeas, uniform)
    assert diff.seeds == [0, 1, 2]
    assert diff.differences == pytest.approx([0.02, 0.01, 0.04])
    # mean 0.07/3; deviations -1/300, -4/300, 5/300: std = sqrt((1 + 16 + 25) / 90000 / 2) = 0.0152753
    assert diff.summary.mean == pytest.approx(0.07 / 3)
    assert diff.summary.std == pytest.approx(math.sqrt(42 / 180000))
    assert diff.summary.ci_low == pytest.approx(0.07 / 3 - 4.302652729911275 * math.sqrt(42 / 180000) / math.sqrt(3))


# ---- the experiment file ----------------------------------------------------------------------------


def test_arm_configs_are_written_exactly(tmp_path: Path) -> None:
    cfg = from_dict({"name": 'quote "and" backslash \\', "seed": 3, "train": {"algorithm": "fedprox", "algorithm_params": {"mu": 1e-05}, "lr": 0.1},
                     "generation": {"policy": "fedeas", "beta": 7.5}, "data": {"alpha": 0.05}})
    write_run_toml(cfg, tmp_path / "config.toml")
    assert load_config(tmp_path / "config.toml").to_dict() == cfg.to_dict()


def test_every_arm_must_share_the_partition(tmp_path: Path) -> None:
    spec = write(tmp_path / "e.toml", TINY_BASE + '[[arms]]\nname = "a"\n[[arms]]\nname = "b"\nset = ["data.alpha=0.5"]\n')
    with pytest.raises(ConfigError, match=r"arm 'b' sets data.alpha = 0.5 but arm 'a' has 0.1"):
        load_experiment(spec)


def test_an_arm_with_its_own_generator_still_shares_the_partition(tmp_path: Path) -> None:
    other = '[[arms]]\nname = "b"\nset = ["generation.policy=fedeas", "generation.model_dir=\\"runs/gen-fed\\""]\n'
    spec = write(tmp_path / "e.toml", TINY_BASE + '[[arms]]\nname = "a"\nset = ["generation.policy=fedeas"]\n' + other)
    with pytest.raises(ConfigError, match=r"arm 'b' sets generation.model_dir = 'runs/gen-fed'.*unless it sets own_generator"):
        load_experiment(spec)
    spec.write_text(TINY_BASE + '[[arms]]\nname = "a"\nset = ["generation.policy=fedeas"]\n' + other + "own_generator = true\n")
    assert [arm.own_generator for arm in load_experiment(spec).arms] == [False, True]
    spec.write_text(TINY_BASE + '[[arms]]\nname = "a"\n' + other + 'own_generator = true\nset = ["data.alpha=0.5"]\n')
    with pytest.raises(ConfigError):  # its own generator, but never its own partition (nor a repeated key)
        load_experiment(spec)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('[[arms]]\nname = "a"\nsets = []\n', "arm 'a': unknown key(s) sets"),
        ('[[arms]]\nname = "a"\nown_generator = "yes"\n', "own_generator must be true or false"),
        ('[[arms]]\nname = "a b"\n', "got 'a b'"),
        ('[[arms]]\nname = "a"\n[[arms]]\nname = "a"\n', "arm names must be unique"),
        ('[[arms]]\nname = "a"\nrole = "best"\n', "role must be one of"),
        ('[[arms]]\nname = "fedeas"\n', "arm 'fedeas' has role 'fedeas' but runs generation.policy = 'none'"),
        ('[[arms]]\nname = "a"\nset = ["train.algorithm=sgd"]\n', "arm 'a': train.algorithm must be one of"),
        ('[experiment]\nthreshold = "high"\n[[arms]]\nname = "a"\n', "experiment.threshold must be int or float, got 'high'"),
        ("[sweep]\nbetas = [0]\n", "sweep.betas must be a non-empty list of numbers > 0"),
        ('[[arms]]\nname = "a"\nseeds = [0, 0]\n', "arm 'a': seeds must be a non-empty list of distinct integers, got [0, 0]"),
        ('[[arms]]\nname = "a"\nseeds = "0"\n', "arm 'a': seeds must be a non-empty list of distinct integers, got '0'"),
        ('[[arms]]\nname = "a"\ncompare = "b"\n', "arm 'a': compare must be a list of other arms' names, got 'b'"),
        ('[[arms]]\nname = "a"\ncompare = ["a"]\n', "arm 'a': compare must be a list of other arms' names, got ['a']"),
        ('[[arms]]\nname = "a"\ncompare = ["fedavg"]\n', "arm 'a': compare names no arm of this experiment: fedavg; arms: a"),
        ("", "nothing to run"),
    ],
)
def test_bad_experiment_files_are_named(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_experiment(write(tmp_path / "e.toml", TINY_BASE + body))
    assert message in str(err.value)


def test_command_line_overrides_reach_base_or_experiment(tmp_path: Path) -> None:
    spec = write(tmp_path / "e.toml", TINY_BASE + '[[arms]]\nname = "a"\nset = ["train.rounds=3"]\n')
    experiment = load_experiment(spec, ["train.rounds=5", "train.lr=0.2", "seed=4", "experiment.threshold=0.9"])
    cfg = experiment.arm_config(experiment.arms[0], 7, tmp_path)
    assert (cfg.train.rounds, cfg.train.lr, cfg.seed, experiment.base_seed) == (3, 0.2, 7, 4)  # the arm's set wins over --set
    assert experiment.settings.threshold == 0.9
    with pytest.raises(ConfigError, match=r"\[base\]: seed must be an integer, got 'x'"):
        load_experiment(spec, ["seed=x"])


def test_a_sweep_point_equal_to_an_arm_is_not_run_twice(tmp_path: Path) -> None:
    spec = write(tmp_path / "e.toml", TINY_BASE + '[[arms]]\nname = "fedeas"\nset = ["generation.policy=fedeas"]\n[sweep]\nbetas = [4, 12]\n')
    arms = load_experiment(spec).arms
    assert [(a.name, a.role, a.beta) for a in arms] == [("fedeas", "fedeas", 12.0), ("beta-4", None, 4.0)]


def test_ablation_arms_set_the_fedeas_rule_and_write_it_exactly(tmp_path: Path) -> None:
    spec = write(tmp_path / "e.toml", TINY_BASE + '[[arms]]\nname = "fedeas"\nset = ["generation.policy=fedeas"]\n'
                 '[[arms]]\nname = "fedeas-linear-b8"\nset = ["generation.policy=fedeas", "generation.exponent=1.0", '
                 '"generation.beta=8.0"]\n[[arms]]\nname = "fedeas-no-entropy"\n'
                 'set = ["generation.policy=fedeas", "generation.entropy_factor=false"]\n')
    experiment = load_experiment(spec)
    rules = [(a.name, a.role, c.generation.exponent, c.generation.beta, c.generation.entropy_factor)
             for a in experiment.arms for c in [experiment.arm_config(a, 0, tmp_path / a.name)]]
    assert rules == [("fedeas", "fedeas", 0.5, 12.0, True), ("fedeas-linear-b8", None, 1.0, 8.0, True),
                     ("fedeas-no-entropy", None, 0.5, 12.0, False)]
    cfg = experiment.arm_config(experiment.arms[2], 0, tmp_path)
    write_run_toml(cfg, tmp_path / "config.toml")
    assert "entropy_factor = false" in (tmp_path / "config.toml").read_text()
    assert load_config(tmp_path / "config.toml") == cfg


def test_the_summary_records_each_arms_policy_and_draws_the_bars_by_it(tmp_path: Path) -> None:
    # an arm without a role (here a filtered FedEAS arm) is still drawn as the policy it runs, not as a baseline
    spec = write(tmp_path / "e.toml", TINY_BASE + '[[arms]]\nname = "fedavg"\n[[arms]]\nname = "fedeas"\nset = ["generation.policy=fedeas"]\n'
                 '[[arms]]\nname = "fedeas-filter"\nset = ["generation.policy=fedeas", "generation.min_confidence=0.3"]\n')
    experiment = load_experiment(spec)
    outcomes = {(arm.name, 0): {"status": "failed", "error": "not run"} for arm in experiment.arms}
    summary = build_summary(experiment, [0], tmp_path, outcomes)
    assert [(a["name"], a["role"], a["policy"]) for a in summary["arms"]] == [
        ("fedavg", "fedavg", "none"), ("fedeas", "fedeas", "fedeas"), ("fedeas-filter", None, "fedeas")]
    bars = {a["name"]: POLICY_COLOURS[arm_policy(a)] for a in summary["arms"]}
    assert bars["fedeas-filter"] == bars["fedeas"] != bars["fedavg"]
    # a summary.json written before the policy was recorded falls back to the role's policy
    assert [arm_policy({"role": role}) for role in ("sdafl", "uniform", None)] == ["none", "uniform", "unknown"]


def test_a_run_from_before_the_ablation_keys_is_reused_at_the_paper_rule(tmp_path: Path) -> None:
    cfg = from_dict({"generation": {"policy": "fedeas"}})
    old = cfg.to_dict()
    for key in ("exponent", "entropy_factor"):  # a report.json written before the keys existed
        old["generation"].pop(key)
    (tmp_path / "checkpoint.safetensors").write_bytes(b"")
    (tmp_path / "report.json").write_text(json.dumps({"success": True, "config": old}))
    assert previous_run(tmp_path, cfg) == ("done", None)
    state, why = previous_run(tmp_path, from_dict({"generation": {"policy": "fedeas", "exponent": 1.0}}))
    assert state == "stale" and "generation.exponent: None -> 1.0" in str(why)


def test_an_arm_runs_only_on_its_own_seeds(tmp_path: Path) -> None:
    spec = write(tmp_path / "e.toml", TINY_BASE + '[[arms]]\nname = "fedavg"\n[[arms]]\nname = "b"\nseeds = [0, 5]\n')
    experiment = load_experiment(spec)
    assert [(arm.name, seed) for arm, seed in experiment.plan([0, 1, 2])] == [("fedavg", 0), ("fedavg", 1), ("fedavg", 2), ("b", 0)]
    only_b = dataclasses.replace(experiment, arms=experiment.arms[1:])
    assert only_b.plan([1, 2]) == []


def test_seeds_are_parsed_or_named() -> None:
    assert parse_seeds("0, 1,2", 9) == [0, 1, 2] and parse_seeds(None, 9) == [9]
    with pytest.raises(ConfigError, match="'0,x'"):
        parse_seeds("0,x", 0)
    with pytest.raises(ConfigError, match="distinct"):
        parse_seeds("1,1", 0)


def test_a_folder_of_another_config_is_named_not_rerun(tmp_path: Path) -> None:
    cfg = from_dict({"train": {"rounds": 4}})
    assert previous_run(tmp_path, cfg) == ("todo", None)
    old = from_dict({"train": {"rounds": 2}, "generation": {"guidance": 3.0}}).to_dict()
    (tmp_path / "report.json").write_text(json.dumps({"success": True, "config": old}))
    assert previous_run(tmp_path, cfg) == ("todo", None)  # no checkpoint: nothing would refuse a fresh run
    (tmp_path / "checkpoint.safetensors").write_bytes(b"")
    state, why = previous_run(tmp_path, cfg)
    assert state == "stale" and f"generation.guidance: 3.0 -> {cfg.generation.guidance!r}; train.rounds: 2 -> 4" in str(why)
    (tmp_path / "report.json").write_text(json.dumps({"success": True, "config": {**old, "generation": cfg.to_dict()["generation"]}}))
    assert previous_run(tmp_path, cfg) == ("todo", None)  # only more rounds: the checkpoint resumes and extends the run
    (tmp_path / "report.json").write_text(json.dumps({"success": True, "config": {**cfg.to_dict(), "runtime": {}, "out_dir": "x"}}))
    assert previous_run(tmp_path, cfg) == ("done", None)


def test_a_run_that_generates_nothing_is_the_same_run_under_any_backend(tmp_path: Path) -> None:
    def config(policy: str, **generation: object) -> dict:
        return from_dict({"data": {"holdout_fraction": 0.5}, "generation": {"policy": policy, **generation}}).to_dict()

    (tmp_path / "checkpoint.safetensors").write_bytes(b"")
    (tmp_path / "report.json").write_text(json.dumps({"success": True, "config": config("none", backend="holdout")}))
    assert previous_run(tmp_path, from_dict(config("none", backend="ddpm", model_dir="/gen", ddim_steps=5))) == ("done", None)
    state, why = previous_run(tmp_path, from_dict(config("fedeas", backend="ddpm")))
    assert state == "stale" and "generation.backend: 'holdout' -> 'ddpm'; generation.policy: 'none' -> 'fedeas'" in str(why)
    # an unfinished run resumes only under the exact config its checkpoint was made with
    (tmp_path / "report.json").write_text(json.dumps({"success": False, "config": config("none", backend="holdout")}))
    state, why = previous_run(tmp_path, from_dict(config("none", backend="ddpm")))
    assert state == "stale" and "generation.backend: 'holdout' -> 'ddpm'" in str(why)
    (tmp_path / "report.json").write_text(json.dumps({"success": True, "config": config("fedeas", backend="holdout")}))
    state, why = previous_run(tmp_path, from_dict(config("fedeas", backend="ddpm")))
    assert state == "stale" and "generation.backend: 'holdout' -> 'ddpm'" in str(why)


# ---- real runs --------------------------------------------------------------------------------------


def processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # exited meanwhile
        if text in args:
            found.append(args)
    return found


@pytest.mark.slow
def test_an_arm_past_its_deadline_is_recorded_as_failed_and_leaves_no_process(tmp_path: Path) -> None:
    spec = write(tmp_path / "e.toml", TINY_BASE + '[[arms]]\nname = "fedavg"\ntimeout_s = 6\n[[arms]]\nname = "quick"\ntimeout_s = 0.5\n')
    result = fedsynth("experiment", "--config", str(spec), "--out-dir", str(tmp_path / "exp"), timeout=120)
    assert result.returncode == 1, result.stderr
    summary = json.loads((tmp_path / "exp" / "summary.json").read_text())
    assert [(r["arm"], r["status"], r["error"].split(" (see")[0]) for r in summary["runs"]] == [
        ("fedavg", "failed", "timed out after 6 s"), ("quick", "failed", "timed out after 0.5 s")
    ]
    assert [a["runs_ok"] for a in summary["arms"]] == [0, 0]
    assert "- fedavg seed 0: timed out after 6 s" in (tmp_path / "exp" / "summary.md").read_text()
    # the launcher's session was stopped whole: no coordinator or client of the arm is left
    assert processes_mentioning(str(tmp_path / "exp")) == []


@pytest.mark.slow
def test_two_arms_two_seeds_summarise_and_resume_without_rerunning(tmp_path: Path) -> None:
    fedprox = '[[arms]]\nname = "fedprox"\nset = ["train.algorithm=fedprox", "train.algorithm_params.mu=0.01"]\n'
    settings = '[experiment]\nname = "tiny"\nthreshold = 0.3\narm_timeout_s = 300\n'
    spec = write(tmp_path / "e.toml", settings + TINY_BASE + '[[arms]]\nname = "fedavg"\n' + fedprox)
    exp = tmp_path / "exp"
    first = fedsynth("experiment", "--config", str(spec), "--seeds", "0,1", "--out-dir", str(exp))
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads((exp / "summary.json").read_text())
    reports = {(r["arm"], r["seed"]): json.loads((exp / r["run_dir"] / "report.json").read_text()) for r in summary["runs"]}
    assert sorted(reports) == [("fedavg", 0), ("fedavg", 1), ("fedprox", 0), ("fedprox", 1)]
    assert reports[("fedprox", 1)]["config"]["train"]["algorithm"] == "fedprox" and reports[("fedprox", 1)]["config"]["seed"] == 1
    # the same partition and seed for both arms: identical initial models, so identical initial accuracy
    assert reports[("fedavg", 1)]["initial_accuracy"] == reports[("fedprox", 1)]["initial_accuracy"]
    accuracy = {key: r["last20_mean_accuracy"] for key, r in reports.items()}
    fedavg = summary["arms"][0]
    assert fedavg["accuracy"]["n"] == 2
    assert fedavg["accuracy"]["mean"] == pytest.approx((accuracy[("fedavg", 0)] + accuracy[("fedavg", 1)]) / 2)
    assert summary["arms"][1]["delta_accuracy_pp"] == pytest.approx(100 * (summary["arms"][1]["accuracy"]["mean"] - fedavg["accuracy"]["mean"]))
    assert summary["paired"] == []  # no FedEAS arm
    table = (exp / "summary.md").read_text()
    assert f"| fedavg | fedavg | {100 * fedavg['accuracy']['mean']:.2f} ± {100 * fedavg['accuracy']['std']:.2f} |" in table
    training = [reports[("fedavg", seed)]["phases_s"]["training"] for seed in (0, 1)]
    assert training[0] > 0 and fedavg["phases_s"]["training"] == pytest.approx(sum(training) / 2)
    assert f"| fedavg | {fedavg['phases_s']['generation']:.1f} | {fedavg['phases_s']['training']:.1f} |" in table
    for name in ("accuracy_bars.png", "accuracy_curves.png"):
        assert (exp / "plots" / name).stat().st_size > 10_000
    stamps = {p: p.stat().st_mtime_ns for pattern in ("*/report.json", "*/logs/launcher.log") for p in exp.glob(pattern)}
    assert len(stamps) == 8

    second = fedsynth("experiment", "--config", str(spec), "--seeds", "0,1", "--out-dir", str(exp), timeout=120)
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stderr.count("reused") == 4 and "running" not in second.stderr
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert json.loads((exp / "summary.json").read_text())["arms"][0]["accuracy"] == fedavg["accuracy"]

    # Pairing over the same real run folders: read fedprox as if it were the FedEAS arm (no generator needed).
    experiment = load_experiment(spec)
    as_fedeas = (experiment.arms[0], dataclasses.replace(experiment.arms[1], role="fedeas"))
    outcomes = {(arm.name, seed): {"status": "ok", "error": None} for arm in as_fedeas for seed in (0, 1)}
    [paired] = build_summary(dataclasses.replace(experiment, arms=as_fedeas), [0, 1], exp, outcomes)["paired"]
    assert (paired["a"], paired["b"], paired["seeds"]) == ("fedprox", "fedavg", [0, 1])
    assert paired["differences"] == pytest.approx([accuracy[("fedprox", s)] - accuracy[("fedavg", s)] for s in (0, 1)])

    # `compare` pairs any two arms, seed by seed (X + FedEAS against X, each baseline against FedAvg).
    compared = (experiment.arms[0], dataclasses.replace(experiment.arms[1], compare=("fedavg",)))
    [paired] = build_summary(dataclasses.replace(experiment, arms=compared), [0, 1], exp, outcomes)["paired"]
    assert (paired["a"], paired["b"], paired["seeds"]) == ("fedprox", "fedavg", [0, 1])
    assert paired["differences"] == pytest.approx([accuracy[("fedprox", s)] - accuracy[("fedavg", s)] for s in (0, 1)])

    # An arm run on one seed is summarised over that seed, and its gain is paired with FedAvg's same seed.
    seed_1_only = (experiment.arms[0], dataclasses.replace(experiment.arms[1], seeds=(1,)))
    summary = build_summary(dataclasses.replace(experiment, arms=seed_1_only), [0, 1], exp, outcomes)
    assert [(r["arm"], r["seed"]) for r in summary["runs"]] == [("fedavg", 0), ("fedavg", 1), ("fedprox", 1)]
    fedprox = summary["arms"][1]
    assert (fedprox["runs"], fedprox["accuracy"]["n"]) == (1, 1)
    assert fedprox["delta_accuracy_pp"] == pytest.approx(100 * (accuracy[("fedprox", 1)] - accuracy[("fedavg", 1)]))


def test_an_sdafl_run_reports_its_weakest_clients_epsilon(tmp_path: Path) -> None:
    rounds = [{"round": r, "accuracy": 0.1 * r} for r in (1, 2)]
    report = {"rounds": rounds, "generation": {"total_images": 0, "device_seconds": 0.0}, "wall_clock_s": 5.0,
              "phases_s": {"training": 1.0}}
    privacy = {"0": {"epsilon": 3.5, "delta": 1e-4, "samples": 200}, "1": {"epsilon": 9.75, "delta": 2e-4, "samples": 200}}
    (tmp_path / "report.json").write_text(json.dumps(report))
    (tmp_path / "coordinator.json").write_text(json.dumps({"sdafl": privacy}))
    metrics = run_metrics(tmp_path, last_n=1, threshold=0.15)
    assert (metrics["epsilon"], metrics["delta"], metrics["budget"], metrics["rounds_to_threshold"]) == (9.75, 2e-4, 400, 2)
    (tmp_path / "coordinator.json").write_text(json.dumps({"sdafl": None}))
    assert run_metrics(tmp_path, last_n=1, threshold=0.15)["epsilon"] is None


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[1] / "deploy" / "configs").glob("experiment-*.toml")),
                         ids=lambda p: p.name)
def test_every_shipped_experiment_config_loads(path: Path) -> None:
    experiment = load_experiment(path)
    assert experiment.arms and len({arm.name for arm in experiment.arms}) == len(experiment.arms)
