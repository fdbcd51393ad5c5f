"""report.md's federated-evaluation section: the figures per round, the per-client table of the last evaluated round and
per-class recall (report_render.plot_federated draws the worst and the mean client over rounds)."""

from __future__ import annotations

from typing import Any


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "n/a" if value is None else format(value, spec)


def federated_section(evaluations: list[dict[str, Any]]) -> list[str]:
    """Markdown lines; nothing when the clients did not evaluate."""
    if not evaluations:
        return []
    last = evaluations[-1]
    recall = last.get("per_class_recall") or []
    lines = [
        "## Federated evaluation",
        "",
        "Each sampled client tests the round's global model on its own local test set and sends counts only "
        "(docs/evaluation.md). Weighted: all correct / all examples; mean: unweighted over clients; spread: best - worst.",
        "",
        "| round | clients | examples | weighted | mean | worst (client) | p10 | spread |",
        "|---|---|---|---|---|---|---|---|",
        *[f"| {e['round']} | {e.get('clients', len(e['per_client']))} | {e.get('examples', 0):,} | {_fmt(e['weighted_accuracy'])} "
          f"| {_fmt(e['mean_accuracy'])} | {_fmt(e['worst_accuracy'])} ({e['worst_client']}) | {_fmt(e['p10_accuracy'])} "
          f"| {_fmt(e.get('spread'))} |" for e in evaluations],
        "",
        f"### Clients in round {last['round']}",
        "",
        "| client | test examples | correct | accuracy | mean loss |",
        "|---|---|---|---|---|",
    ]
    for cid, c in sorted(last["per_client"].items(), key=lambda item: int(item[0])):
        loss = c["loss_sum"] / c["examples"] if c.get("examples") and c.get("loss_sum") is not None else None
        worst = " (worst)" if str(last["worst_client"]) == cid else ""
        lines.append(f"| {cid}{worst} | {c['examples']:,} | {c.get('correct', 'n/a')} | {_fmt(c['accuracy'])} | {_fmt(loss)} |")
    lines += [
        "",
        f"Per-class recall in round {last['round']} (correct / examples of the class, summed over clients): "
        + ", ".join(f"{c}: {_fmt(r, '.3f')}" for c, r in enumerate(recall)),
        "",
    ]
    return lines
