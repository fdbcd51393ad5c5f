"""report.md and PNG plots of one run folder, from its report.json (and coordinator.json for per-client detail)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deploy.report import LAST_N
from deploy.report_federated import federated_section
from fedsynth.errors import ConfigError
from fedsynth.process.runtime import write_atomic

DPI = 130
PLOTS = "plots"
STACKED_PHASES = ("generation", "training", "communication", "aggregation", "evaluation")
PHASE_COLORS = {
    "generation": "#dd8452",
    "training": "#4c72b0",
    "communication": "#55a868",
    "aggregation": "#8172b3",
    "evaluation": "#937860",
    "other": "#c7c7c7",
}


def pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def integer_rounds(ax) -> None:  # type: ignore[no-untyped-def]
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def save_figure(fig, path: Path) -> Path:  # type: ignore[no-untyped-def]
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    pyplot().close(fig)
    return path


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: not a {what}")
    try:
        content = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc})") from exc
    if not isinstance(content, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(content).__name__}")
    return content


def load_run(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(report, coordinator record); the record is {} when coordinator.json is absent or unreadable."""
    report = read_json_object(run_dir / "report.json", "run folder (no report.json)")
    if not isinstance(report.get("rounds"), list):
        raise ConfigError(f"{run_dir / 'report.json'} has no 'rounds' list: not a fedsynth run report")
    try:
        record = read_json_object(run_dir / "coordinator.json", "run folder")
    except ConfigError:
        record = {}
    return report, record


# ---- plots ------------------------------------------------------------------------------------------


def plot_accuracy(report: dict[str, Any], record: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    tested = [r for r in report["rounds"] if r["accuracy"] is not None]  # "federated" evaluation skips rounds
    rounds = [r["round"] for r in tested]
    accuracy = [r["accuracy"] for r in tested]
    loss = [r["loss"] for r in tested]
    if report.get("initial_accuracy") is not None:
        rounds, accuracy = [0, *rounds], [report["initial_accuracy"], *accuracy]
        initial_loss = (record.get("initial") or {}).get("loss")
        loss = loss if initial_loss is None else [initial_loss, *loss]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot(rounds, accuracy, marker="o" if len(rounds) <= 30 else None, color="#4c72b0", label="test accuracy")
    if report.get("last20_mean_accuracy") is not None:
        tail = min(LAST_N, len(report["rounds"]))
        ax.axhline(report["last20_mean_accuracy"], ls="--", color="#4c72b0", alpha=0.5, label=f"mean of the last {tail} rounds")
    ax.set_xlabel("round (0: initial model)")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1)
    integer_rounds(ax)
    loss_ax = ax.twinx()
    loss_ax.plot(rounds[-len(loss):], loss, color="#c44e52", alpha=0.7, label="test loss")
    loss_ax.set_ylabel("test loss", color="#c44e52")
    lines = ax.get_legend_handles_labels()[0] + loss_ax.get_legend_handles_labels()[0]
    ax.legend(lines, [h.get_label() for h in lines], fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncols=3)
    ax.set_title("Global model per round")
    return save_figure(fig, path)


def plot_federated(evaluations: list[dict[str, Any]], path: Path) -> Path:
    """The weighted accuracy, the unweighted mean client, the 10th percentile and the worst client over rounds."""
    plt = pyplot()
    rounds = [e["round"] for e in evaluations]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    marker = "o" if len(rounds) <= 30 else None
    for key, label, color in (("weighted_accuracy", "weighted by test examples", "#4c72b0"),
                              ("mean_accuracy", "mean client", "#55a868"),
                              ("p10_accuracy", "10th percentile", "#dd8452"),
                              ("worst_accuracy", "worst client", "#c44e52")):
        values = [e.get(key) for e in evaluations]
        ax.plot(rounds, [float("nan") if v is None else v for v in values], marker=marker, color=color, label=label)
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy on the clients' local test sets")
    ax.set_ylim(0, 1)
    integer_rounds(ax)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncols=4)
    ax.set_title("Federated evaluation per round")
    return save_figure(fig, path)


def plot_phases(report: dict[str, Any], path: Path) -> Path:
    """Each round's wall-clock split into phases, in seconds and as shares; 'other' is the rest of the round
    (SDA-FL's server-side fine-tuning, the checkpoint)."""
    plt = pyplot()
    rounds = [r["round"] for r in report["rounds"]]
    durations = [max(float(r["duration_s"]), 1e-9) for r in report["rounds"]]
    fig, (seconds_ax, share_ax) = plt.subplots(2, 1, figsize=(max(6.4, 0.25 * len(rounds)), 5.6), sharex=True)
    bottom, share_bottom = [0.0] * len(rounds), [0.0] * len(rounds)
    for phase in (*STACKED_PHASES, "other"):
        if phase == "other":
            values = [max(0.0, d - b) for d, b in zip(durations, bottom)]
        else:
            values = [float(r["phases_s"].get(phase, 0.0)) for r in report["rounds"]]
        shares = [100 * v / max(d, b + v) for v, d, b in zip(values, durations, bottom)]
        seconds_ax.bar(rounds, values, bottom=bottom, color=PHASE_COLORS[phase], label=phase, width=0.8)
        share_ax.bar(rounds, shares, bottom=share_bottom, color=PHASE_COLORS[phase], width=0.8)
        bottom = [b + v for b, v in zip(bottom, values)]
        share_bottom = [b + v for b, v in zip(share_bottom, shares)]
    seconds_ax.set_ylabel("wall-clock (s)")
    seconds_ax.set_title("Round wall-clock by phase (slowest client per phase)")
    seconds_ax.legend(fontsize=8, ncols=3, loc="upper right")
    seconds_ax.set_ylim(top=max(bottom, default=1.0) * 1.4 or 1.0)  # headroom for the legend
    share_ax.set_ylabel("share of the round (%)")
    share_ax.set_ylim(0, 100)
    share_ax.set_xlabel("round")
    integer_rounds(share_ax)
    return save_figure(fig, path)


@dataclass(frozen=True)
class ClientGeneration:
    client: str
    images: int
    device_seconds: float  # this client's share (by images) of the generator's device-seconds
    wall_seconds: float  # the client's wait for its images, cache reads included
    cache_hit: bool


def per_client_generation(report: dict[str, Any], record: dict[str, Any]) -> list[ClientGeneration]:
    """One entry per client, sorted by client id; wall seconds and cache hits come from coordinator.json."""
    detail = record.get("generation") or {}
    images = report.get("generation", {}).get("per_client", {})
    device = report.get("generation", {}).get("per_client_device_seconds", {})
    return [
        ClientGeneration(
            cid, int(images.get(cid, detail.get(cid, {}).get("images", 0))), float(device.get(cid, 0.0)),
            float(detail.get(cid, {}).get("wall_seconds", 0.0)), bool(detail.get(cid, {}).get("cache_hit")),
        )
        for cid in sorted(set(images) | set(detail), key=int)
    ]


def plot_generation(rows: list[ClientGeneration], path: Path) -> Path:
    plt = pyplot()
    x = list(range(len(rows)))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6.4, 0.3 * len(rows)), 5.0), sharex=True)
    top.bar(x, [r.images for r in rows], color="#4c72b0")
    top.set_ylabel("synthetic images")
    top.set_title(f"Generation per client (total {sum(r.images for r in rows):,} images)")
    width = 0.4
    bottom.bar([i - width / 2 for i in x], [r.device_seconds for r in rows], width=width, color="#dd8452",
               label=f"device (total {sum(r.device_seconds for r in rows):.1f} s)")
    bottom.bar([i + width / 2 for i in x], [r.wall_seconds for r in rows], width=width, color="#937860",
               label=f"client wall-clock (max {max((r.wall_seconds for r in rows), default=0.0):.1f} s)")
    bottom.set_ylabel("seconds")
    bottom.set_xlabel("client")
    bottom.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncols=2)
    step = max(1, len(rows) // 20)  # at most ~20 labels
    bottom.set_xticks(x[::step], [r.client for r in rows][::step])
    return save_figure(fig, path)


def plot_bytes(report: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    rounds = [r["round"] for r in report["rounds"]]
    sent = [r["bytes_sent"] / 2**20 for r in report["rounds"]]
    received = [r["bytes_received"] / 2**20 for r in report["rounds"]]
    fig, ax = plt.subplots(figsize=(max(6.4, 0.25 * len(rounds)), 3.6))
    width = 0.4
    ax.bar([r - width / 2 for r in rounds], sent, width=width, label="sent by the coordinator", color="#4c72b0")
    ax.bar([r + width / 2 for r in rounds], received, width=width, label="received by the coordinator", color="#55a868")
    ax.set_xlabel("round")
    ax.set_ylabel("MiB")
    integer_rounds(ax)
    ax.set_title("Model traffic per round")
    ax.set_ylim(top=max([*sent, *received, 0.01]) * 1.3)
    ax.legend(fontsize=8, loc="upper right")
    return save_figure(fig, path)


# ---- report.md --------------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "n/a" if value is None else format(value, spec)


def _markdown(report: dict[str, Any], record: dict[str, Any], gen_rows: list[ClientGeneration], plots: list[Path]) -> str:
    cfg = report.get("config") or {}
    data, train, gen = cfg.get("data", {}), cfg.get("train", {}), cfg.get("generation", {})
    rounds = report["rounds"]
    status = "succeeded" if report.get("success") else f"FAILED: {report.get('error') or 'see logs/'}"
    lines = [
        f"# Run {report.get('run_id') or '(no run id)'}: {status}",
        "",
        (
            f"{data.get('dataset')}, K = {data.get('clients')} clients ({data.get('partition')}, alpha {data.get('alpha')}), "
            f"{train.get('algorithm')} with policy {gen.get('policy')} (beta {gen.get('beta')}), model {train.get('model')}, "
            f"seed {cfg.get('seed')}, {len(rounds)}/{train.get('rounds')} rounds."
        ),
        "",
        "| quantity | value |",
        "|---|---|",
        f"| initial accuracy | {_fmt(report.get('initial_accuracy'))} |",
        f"| final accuracy | {_fmt(report.get('final_accuracy'))} |",
        f"| mean accuracy, last {min(LAST_N, len(rounds))} rounds | {_fmt(report.get('last20_mean_accuracy'))} |",
        f"| synthetic images | {report.get('generation', {}).get('total_images', 0):,} |",
        f"| generation device-seconds | {report.get('generation', {}).get('device_seconds', 0.0):.2f} |",
        *_quality_filter_rows(report.get("generation", {}).get("quality_filter")),
        f"| wall-clock | {report.get('wall_clock_s', 0.0):.1f} s |",
        f"| bytes sent / received | {report.get('bytes', {}).get('sent', 0):,} / {report.get('bytes', {}).get('received', 0):,} |",
        "",
        "## Wall-clock by phase (sum over rounds)",
        "",
        "| phase | seconds |",
        "|---|---|",
        *[f"| {phase} | {report.get('phases_s', {}).get(phase, 0.0):.2f} |" for phase in STACKED_PHASES],
        "",
        "## Rounds",
        "",
        "| round | accuracy | loss | duration (s) | participants | bytes sent | bytes received |",
        "|---|---|---|---|---|---|---|",
        *[
            f"| {r['round']} | {_fmt(r['accuracy'])} | {_fmt(r['loss'])} | {r['duration_s']:.2f} | {len(r['participants'])} "
            f"| {r['bytes_sent']:,} | {r['bytes_received']:,} |"
            for r in rounds
        ],
        "",
        "## Generation per client",
        "",
        "| client | images | device-seconds | wall-clock (s) | cache hit |",
        "|---|---|---|---|---|",
        *[f"| {g.client} | {g.images:,} | {g.device_seconds:.2f} | {g.wall_seconds:.2f} | {'yes' if g.cache_hit else 'no'} |" for g in gen_rows],
        "",
    ]
    generation = report.get("generation", {})
    lines += _quality_section(generation.get("quality"), generation.get("quality_filter"))
    lines += federated_section(report.get("federated_evaluation") or [])
    lines += _sdafl_section(record)
    lines += ["## Plots", "", *[f"![{p.stem}]({PLOTS}/{p.name})" for p in plots], ""]
    lines += ["Processes: " + ", ".join(f"{role} (pid {pid})" for role, pid in report.get("processes", {}).items()), ""]
    return "\n".join(lines)


def _quality_filter_rows(filtered: dict[str, Any] | None) -> list[str]:
    """The quality filter's rows of the summary table: nothing when it was off."""
    if not filtered:
        return []
    rate = filtered.get("acceptance_rate")
    return [
        f"| quality filter (min_confidence {filtered['min_confidence']:g}) | {filtered.get('accepted_total', 0):,} "
        f"accepted, {filtered.get('rejected_total', 0):,} rejected (acceptance {'n/a' if rate is None else f'{rate:.1%}'}), "
        f"{filtered.get('candidates_total', 0):,} candidates drawn |",
        f"| rejected images per class | {', '.join(f'{c}: {n}' for c, n in (filtered.get('rejected_per_class') or {}).items())} |",
        f"| device-seconds on unserved candidates / judging | {filtered.get('unserved_device_seconds', 0.0):.2f} / "
        f"{filtered.get('judge_seconds', 0.0):.2f} |",
    ]


def _quality_section(quality: dict[str, Any] | None, filtered: dict[str, Any] | None) -> list[str]:
    """The judge's figures for the generator (docs/generator.md, `fedsynth generator evaluate`)."""
    if not quality:
        return []
    if quality.get("error"):
        return ["## Generator quality", "", f"Not scored: {quality['error']}", ""]
    per_class = ", ".join(f"{c}: {r:.2f}" for c, r in enumerate(quality.get("per_class_recognizability") or []))
    return [
        "## Generator quality",
        "",
        f"`{quality.get('backend')}` generator `{quality.get('model_id')}`, {quality.get('n_images')} images scored by a judge "
        f"trained on the real training split{' (figures from the cache)' if quality.get('cached') else ''}.",
        "",
        "| quantity | value |",
        "|---|---|",
        f"| recognizability (judge's test accuracy; chance) | {_fmt(quality.get('recognizability'))} "
        f"({_fmt(quality.get('judge_test_accuracy'))}; {_fmt(quality.get('chance'))}) |",
        f"| classification accuracy score (CAS) | {_fmt(quality.get('cas'))} |",
        f"| Fréchet distance in the judge's features (real test images) | {_fmt(quality.get('frechet'))} "
        f"({_fmt(quality.get('real_test_frechet'))}) |",
        f"| recognizability per class | {per_class} |",
        "",
        *(["With the quality filter on, the judge that chose the images also scores them: recognizability is high by "
           "construction; CAS and the Fréchet distance are the figures to read.", ""] if filtered else []),
        *([f"![generator grid]({PLOTS}/{quality['grid']})", ""] if quality.get("grid") else []),
    ]


def _sdafl_section(record: dict[str, Any]) -> list[str]:
    privacy = record.get("sdafl")
    if not privacy:
        return []
    lines = ["## SDA-FL", "", "| client | samples | epsilon | delta | noise multiplier | GAN seconds |", "|---|---|---|---|---|---|"]
    for cid, p in sorted(privacy.items(), key=lambda item: int(item[0])):
        lines.append(
            f"| {cid} | {int(p.get('samples', 0))} | {_fmt(p.get('epsilon'), '.2f')} | {_fmt(p.get('delta'), '.1e')} "
            f"| {_fmt(p.get('noise_multiplier'), '.3f')} | {_fmt(p.get('gan_seconds'), '.1f')} |"
        )
    lines += ["", "| round | pseudo-label coverage | agreement with the reference |", "|---|---|---|"]
    for r in record.get("rounds", []):
        lines.append(f"| {r['round']} | {_fmt(r.get('pseudo_label_coverage'))} | {_fmt(r.get('pseudo_label_agreement'))} |")
    return [*lines, ""]


def render_report(run_dir: str | Path) -> list[Path]:
    """Write RUN_DIR/report.md and RUN_DIR/plots/*.png from RUN_DIR/report.json; return the paths written."""
    run_dir = Path(run_dir)
    report, record = load_run(run_dir)
    plot_dir = run_dir / PLOTS
    gen_rows = per_client_generation(report, record)
    plots: list[Path] = []
    if report["rounds"]:
        plots += [
            plot_accuracy(report, record, plot_dir / "accuracy.png"),
            plot_phases(report, plot_dir / "phases.png"),
            plot_bytes(report, plot_dir / "bytes.png"),
        ]
    if gen_rows:
        plots.append(plot_generation(gen_rows, plot_dir / "generation.png"))
    if report.get("federated_evaluation"):
        plots.append(plot_federated(report["federated_evaluation"], plot_dir / "federated.png"))
    markdown = run_dir / "report.md"
    write_atomic(markdown, _markdown(report, record, gen_rows, plots))
    return [markdown, *plots]


__all__ = ["load_run", "read_json_object", "render_report"]
