"""The record of refused updates and of clients excluded after runtime.max_refusals refusals in a row.

Each refusal is noted once, named (round, client, reason), counted by a small set of reasons in Prometheus, and
written into its round's summary; exclusions follow from the rounds' summaries alone, so a resumed run excludes
exactly whom the run before it had."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)

# The `reason` label of fedsynth_coordinator_refused_updates_total: what kind of defect, never who or which tensor.
REASONS = ("header", "layout", "dtype", "non_finite", "range", "report", "transfer", "norm", "fold", "stale", "duplicate")


def reason_of(message: str) -> str:
    """The kind of defect a refusal's message names (the checks' messages in coordinator.updates and fedsynth.wire)."""
    text = message.lower()
    for needle, reason in (("safetensors", "header"), ("nan or inf", "non_finite"), ("dtype", "dtype"),
                           ("integer tensor", "range"), ("must be a finite number", "report"), ("train_loss", "report"),
                           ("checksum", "transfer"), ("sha-256", "transfer"), ("xxh3", "transfer"), ("bytes", "transfer")):
        if needle in text:
            return reason
    return "layout"


def run_record(history: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """coordinator.json's (and report.json's) `refused_updates` ({round, client, reason, message}) and
    `excluded_clients` ({client, round, reason}), from the rounds' summaries."""
    refused = [{key: entry[key] for key in ("round", "client", "reason", "message")}
               for summary in history for entry in summary.get("refused", [])]
    excluded = [entry for summary in history for entry in summary.get("excluded", [])]
    return {"refused_updates": refused, "excluded_clients": excluded}


class RefusalLedger:
    """Refusals noted since the last closed round, and each client's run of rounds with its update refused. The caller
    holds the federation's lock around every method."""

    def __init__(self, max_refusals: int, counter: Any) -> None:
        self.max_refusals = max_refusals  # 0: nobody is ever excluded
        self.counter = counter  # fedsynth_coordinator_refused_updates_total{reason}
        self.pending: list[dict[str, Any]] = []
        self.in_a_row: dict[int, int] = {}
        self.excluded: dict[int, dict[str, Any]] = {}  # client -> {client, round, reason}

    def refuse(self, round_number: int | None, client_id: int, message: str, *, reason: str | None = None,
               counts: bool = True) -> None:
        """Note one refused update. `counts`: it was this client's answer to its task of the open round (towards its
        exclusion); a stale or duplicate upload is named but costs the client nothing more."""
        reason = reason or reason_of(message)
        self.counter.labels(reason=reason).inc()
        self.pending.append({"round": round_number, "client": client_id, "reason": reason, "message": message[:500],
                             "counts": counts})
        log.info("round %s: client %d's refused update recorded (%s)", round_number, client_id, reason)  # its caller logs why

    def close_round(self, round_number: int, sampled: Iterable[int], answered: Iterable[int]) -> dict[str, Any]:
        """The round's entries for its summary: `refused` (its refusals) and `excluded` (clients excluded now)."""
        refused, self.pending = self.pending, []
        excluded = self._advance(round_number, sampled, answered, refused)
        return {"refused": refused, "excluded": excluded}

    def restore(self, history: list[dict[str, Any]]) -> None:
        """Replay the summaries of the rounds a resumed run already played."""
        for summary in history:
            self._advance(summary["round"], summary["sampled"], summary["participants"], summary.get("refused", []))

    def _advance(self, round_number: int, sampled: Iterable[int], answered: Iterable[int],
                 refused: list[dict[str, Any]]) -> list[dict[str, Any]]:
        counted = {entry["client"]: entry for entry in refused if entry.get("counts", True)}
        for client in set(answered) - counted.keys():
            self.in_a_row[client] = 0
        excluded = []
        for client, entry in sorted(counted.items()):
            if client not in set(sampled) or client in self.excluded:
                continue
            self.in_a_row[client] = self.in_a_row.get(client, 0) + 1
            if self.max_refusals and self.in_a_row[client] >= self.max_refusals:
                record = {"client": client, "round": round_number,
                          "reason": f"{self.in_a_row[client]} refused updates in a row; the last: {entry['message']}"}
                self.excluded[client] = record
                excluded.append(record)
                log.warning("client %d excluded from the run after round %d: %s", client, round_number, record["reason"])
        return excluded
