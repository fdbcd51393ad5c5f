"""Prometheus metrics of the coordinator: rounds, phases, bytes, clients, global accuracy and loss, federated accuracy."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from fedsynth.process.metrics import DURATION_BUCKETS


class CoordinatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        kw: dict[str, Any] = {"registry": registry} if registry is not None else {}
        self.rounds_completed = Counter("fedsynth_coordinator_rounds_completed_total", "Rounds aggregated and evaluated", **kw)
        self.round_duration = Histogram(
            "fedsynth_coordinator_round_duration_seconds", "Wall-clock of a whole round", buckets=DURATION_BUCKETS, **kw
        )
        self.phase_duration = Histogram(
            "fedsynth_coordinator_round_phase_seconds",
            "Wall-clock of one phase of a round (dispatch, waiting, aggregation, evaluation, ...)",
            ["phase"],
            buckets=DURATION_BUCKETS,
            **kw,
        )
        self.bytes_sent = Counter("fedsynth_coordinator_sent_bytes_total", "Payload bytes pushed to clients", **kw)
        self.bytes_received = Counter("fedsynth_coordinator_received_bytes_total", "Payload bytes of accepted updates", **kw)
        self.rejected_updates = Counter(
            "fedsynth_coordinator_rejected_updates_total", "Updates refused, by gRPC status code", ["code"], **kw
        )
        self.refused_updates = Counter(
            "fedsynth_coordinator_refused_updates_total",
            "Client updates refused for their content or timing, by reason (coordinator.members.refusals.REASONS)", ["reason"], **kw
        )
        self.update_norm_exceeded = Counter(
            "fedsynth_coordinator_update_norm_exceeded_total",
            "Updates whose L2 norm exceeded runtime.max_update_norm, by what became of them (clipped, refused)", ["action"], **kw
        )
        self.update_norm_bound = Gauge(
            "fedsynth_coordinator_update_norm_bound", "The bound on an update's L2 norm in the last round (runtime.max_update_norm)", **kw
        )
        self.rejected_registrations = Counter(
            "fedsynth_coordinator_rejected_registrations_total", "Registrations refused, by reason (max_samples_per_client)",
            ["reason"], **kw
        )
        self.data_plane_closed = Counter(
            "fedsynth_coordinator_data_plane_closed_connections_total",
            "Data-plane connections closed before their request was whole: 'deadline' (no TLS handshake and request header "
            "within a second), 'over_cap' (too many from one address, or in all, at once), 'error' (an unexpected error in "
            "admission: logged), 'queue_full' and 'queue_deadline' (admitted, then refused by the transfer queue)", ["reason"], **kw
        )
        self.clients_registered = Gauge("fedsynth_coordinator_clients_registered", "Clients registered", **kw)
        self.clients_connected = Gauge("fedsynth_coordinator_clients_connected", "Clients with an open dispatch stream", **kw)
        self.clients_dropped = Counter(
            "fedsynth_coordinator_clients_dropped_total", "Dispatch streams ended because the client's heartbeats stopped", **kw
        )
        self.clients_participating = Gauge(
            "fedsynth_coordinator_clients_participating", "Clients whose update entered the last round", **kw
        )
        self.accuracy = Gauge("fedsynth_coordinator_global_accuracy", "Test accuracy of the global model", **kw)
        self.loss = Gauge("fedsynth_coordinator_global_loss", "Test loss of the global model", **kw)
        self.current_round = Gauge("fedsynth_coordinator_round", "Last completed round", **kw)
        # Secure aggregation (runtime.secure_aggregation): stage 4's time and the clients dropped after sharing keys
        self.secagg_unmask = Histogram("fedsynth_coordinator_secagg_unmask_seconds",
                                       "Secure aggregation's stage 4: waiting for the survivors' shares, rebuilding and removing "
                                       "the masks", **kw)
        self.secagg_dropped = Counter("fedsynth_coordinator_secagg_dropped_total",
                                      "Clients that shared their keys but sent no masked update (their masks rebuilt)", **kw)
        # User-level DP (train.dp = "user", or the federated generator's federate.dp user or sample)
        self.dp_epsilon = Gauge("fedsynth_coordinator_dp_epsilon", "Epsilon spent so far (dp sample: the largest client's)", **kw)
        self.dp_delta = Gauge("fedsynth_coordinator_dp_delta", "The delta epsilon is accounted at", **kw)
        self.dp_noise_multiplier = Gauge("fedsynth_coordinator_dp_noise_multiplier", "sigma: noise std / clipping bound", **kw)
        self.dp_clip = Gauge("fedsynth_coordinator_dp_clip_norm", "S: the L2 bound of an update (user) or a gradient (sample)", **kw)
        self.dp_sample_rate = Gauge("fedsynth_coordinator_dp_sample_rate", "q: clients per round / K (user) or batch / N_k (sample)", **kw)
        self.federated_accuracy = Gauge(
            "fedsynth_coordinator_federated_accuracy",
            "Federated evaluation of the last evaluated round, over the sampled clients' local test sets: weighted "
            "(by test examples), mean (unweighted over clients), worst (lowest client), p10 (10th percentile of clients)",
            ["statistic"],
            **kw,
        )
        self.federated_clients = Gauge(
            "fedsynth_coordinator_federated_clients_evaluated", "Clients whose counts entered the last federated evaluation", **kw
        )

    def observe_round(self, summary: dict[str, Any]) -> None:
        self.rounds_completed.inc()
        self.round_duration.observe(summary["duration_s"])
        for phase, seconds in summary["phases_s"].items():
            self.phase_duration.labels(phase=phase).observe(seconds)
        self.clients_participating.set(len(summary["participants"]))
        if summary["accuracy"] is not None:  # None: no test this round (federated evaluation off its eval_every, or local mode)
            self.accuracy.set(summary["accuracy"])
            self.loss.set(summary["loss"])
        self.current_round.set(summary["round"])
        privacy = summary.get("privacy") or {}
        if privacy.get("epsilon") is not None:
            for gauge, key in ((self.dp_epsilon, "epsilon"), (self.dp_delta, "delta"), (self.dp_noise_multiplier, "noise_multiplier"),
                               (self.dp_clip, "clip"), (self.dp_sample_rate, "sample_rate")):
                gauge.set(privacy[key])
        secure = summary.get("secure_aggregation")
        if secure is not None:
            self.secagg_unmask.observe(secure["unmask_s"])
            self.secagg_dropped.inc(len(secure["dropped"]))
        figures = summary.get("federated_evaluation")
        if figures is not None:
            self.federated_clients.set(figures["clients"])
            for statistic in ("weighted", "mean", "worst", "p10"):
                if figures[f"{statistic}_accuracy"] is not None:
                    self.federated_accuracy.labels(statistic=statistic).set(figures[f"{statistic}_accuracy"])
