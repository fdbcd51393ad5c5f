"""`fedsynth run`: the coordinator, the generator (when the policy needs one) and K client nodes as local processes."""

from __future__ import annotations

import argparse
import logging
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from tqdm import tqdm

from deploy.generator_setup import check_generator_shape
from deploy.processes import Child, ChildFailed, ProcessGroup, fedsynth_command, log_tail, wait_for_file
from deploy.report import LAST_N, build_report, load_coordinator_record
from deploy.scrape import scrape, total
from fedsynth.wire import grpcutil, tls
from fedsynth.config import RunConfig, load_config
from fedsynth.errors import ConfigError
from fedsynth.generation.generator_names import (
    DEVICE_SECONDS_TOTAL,
    FILTER_ACCEPTED_TOTAL,
    FILTER_CANDIDATES_TOTAL,
    FILTER_JUDGE_SECONDS_TOTAL,
    FILTER_MIN_CONFIDENCE,
    FILTER_UNSERVED_DEVICE_SECONDS_TOTAL,
    FILTER_REJECTED_TOTAL,
    IMAGES_TOTAL,
    INFO,
    REQUESTS_TOTAL,
    SERVICE_NAME,
)
from fedsynth.learning.label_schema import SCHEMA_FILE, read_schema_file, schema_of
from fedsynth.learning.partition import check_partition
from fedsynth.process.provenance import provenance
from fedsynth.process.runtime import (EXIT_ERROR, EXIT_INCOMPLETE, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OK, setup_logging,
                                     write_json)
from fedsynth.v1 import coordinator_pb2 as pb
from fedsynth.v1 import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger("launcher")
START_TIMEOUT_S = 120.0
CLIENTS_GONE_GRACE_S = 15.0  # every client node exited, one with an error: the coordinator gets this long to end the run
JUDGE_START_TIMEOUT_S = 3600.0  # a generator with the quality filter may first train its judge (CIFAR-10 on a CPU)
SERVING_POLL_S = 5.0  # while waiting for the generator's SERVING, how often to check that it is still running
EXIT_TIMEOUT_S = 60.0  # for the coordinator after its last message; clients get less once it is gone


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="run config (TOML); without it the embedded default (digits, 10 clients, FedEAS)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value, e.g. train.rounds=5")
    parser.add_argument("--out-dir", help="run folder (default: the config's out_dir); an unfinished run there resumes")
    parser.add_argument("--no-progress", action="store_true", help="log one line per round instead of a progress bar")
    parser.add_argument("--log-level", default="INFO")


def _client_groups(cfg: RunConfig) -> list[str]:
    per = cfg.runtime.clients_per_process
    k = cfg.data.clients
    return [f"{lo}-{min(lo + per, k) - 1}" for lo in range(0, k, per)]


class Launcher:
    def __init__(self, cfg: RunConfig, args: argparse.Namespace, out_dir: Path) -> None:
        self.cfg = cfg
        self.args = args
        self.out_dir = out_dir
        self.group = ProcessGroup(out_dir / "logs")
        self.generation_setup_s = 0.0
        self.generator_metrics_file: Path | None = None
        self.scoring_s = 0.0  # scoring the generator after the run: not part of the run's wall-clock
        self.interrupted = False  # a stop signal arrived while scoring: the run's report is still written
        self._following = False
        self._coordinator_stub: pb_grpc.CoordinatorStub | None = None  # while following: to release failed clients
        self.abandoned: Child | None = None  # every client node exited, this one first with an error
        self.failures: list[dict[str, object]] = []  # children that exited non-zero on their own, in that order
        # runtime.tls_dir: every role over mutual TLS, the launcher itself as `operator`; else plaintext on this machine.
        tls_dir = cfg.runtime.tls_dir
        self.tls_flags = ["--tls-dir", tls_dir] if tls_dir else ["--insecure"]
        self.operator = tls.TLSFiles.from_dir(Path(tls_dir), "operator") if tls_dir else None  # also for HTTPS /metrics
        self.credentials = tls.channel_credentials(self.operator) if self.operator is not None else None

    def _config_args(self) -> list[str]:
        config = ["--config", self.args.config] if self.args.config else []
        return config + [item for override in self.args.set for item in ("--set", override)]

    def start_generator(self) -> str | None:
        gen = self.cfg.generation
        if gen.policy == "none" and self.cfg.train.algorithm != "pe":  # Private Evolution's coordinator asks the generator
            return gen.generator
        from deploy.generator_setup import check_backend, serve_arguments

        check_backend(self.cfg)
        if gen.generator is not None:
            return gen.generator
        started = time.monotonic()
        backend_flags = serve_arguments(self.cfg, self.group)
        port_file = self.out_dir / "generator.port"
        self.generator_metrics_file = self.out_dir / "generator.metrics-port"
        for stale in (port_file, self.generator_metrics_file):
            stale.unlink(missing_ok=True)
        child = self.group.start(
            "generator",
            fedsynth_command(
                "generator", "serve", *backend_flags, "--host", self.cfg.runtime.host, "--port", "0",
                "--port-file", str(port_file), "--metrics-port", "0", "--metrics-port-file", str(self.generator_metrics_file),
                "--threads", str(self.cfg.runtime.torch_threads), *self.tls_flags,
            ),
        )
        port = wait_for_file(port_file, child, timeout_s=START_TIMEOUT_S)
        address = f"{self.cfg.runtime.host}:{port}"
        channel = grpcutil.make_channel(address, self.credentials)
        self._wait_for_serving(channel, child)
        channel.close()
        self.generation_setup_s = time.monotonic() - started
        return address

    def _wait_for_serving(self, channel: grpc.Channel, child: Child) -> None:
        """Until the generator says SERVING; longer when it may train a judge first. Health is asked in windows of
        SERVING_POLL_S with the child polled after each, so a generator that exits while loading fails the start at
        once (within SERVING_POLL_S), not after the whole limit."""
        limit = JUDGE_START_TIMEOUT_S if self.cfg.generation.min_confidence > 0 else START_TIMEOUT_S
        stop_at = time.monotonic() + limit
        while True:
            try:
                grpcutil.wait_for_serving(channel, SERVICE_NAME,
                                          timeout_s=min(SERVING_POLL_S, max(0.0, stop_at - time.monotonic())))
                return
            except TimeoutError:
                if child.process.poll() is not None:
                    raise ChildFailed(child, child.process.returncode, "exited before serving") from None
                if time.monotonic() >= stop_at:
                    raise TimeoutError(f"the generator was not SERVING within {limit:.0f}s") from None

    def start_coordinator(self, generator: str | None = None) -> str:
        port_file = self.out_dir / "coordinator.port"
        port_file.unlink(missing_ok=True)
        child = self.group.start(
            "coordinator",
            fedsynth_command(
                "coordinator", *self._config_args(), "--out-dir", str(self.out_dir), "--host", self.cfg.runtime.host,
                "--port", str(self.cfg.runtime.coordinator_port), "--port-file", str(port_file), "--metrics-port", "0", *self.tls_flags,
                *(["--generator", generator] if generator and self.cfg.train.algorithm == "pe" else []),
            ),
        )
        self.coordinator = child
        port = wait_for_file(port_file, child, timeout_s=START_TIMEOUT_S)
        return f"{self.cfg.runtime.host}:{port}"

    def start_clients(self, coordinator: str, generator: str | None) -> None:
        for ids in _client_groups(self.cfg):
            command = fedsynth_command(
                "client", "--coordinator", coordinator, "--clients", ids, "--cache-dir", str(self.out_dir / "cache"),
                "--torch-threads", str(self.cfg.runtime.torch_threads), "--metrics-port", "0", *self.tls_flags,
            )
            if self.cfg.data.source == "local":  # each client its own folder, nothing else
                lo, _, hi = ids.partition("-")
                local_dir = Path(str(self.cfg.data.local_dir))
                command += [item for cid in range(int(lo), int(hi) + 1) for item in ("--data", f"{cid}={local_dir / f'client-{cid}'}")]
            if generator and self.cfg.generation.policy != "none":
                command += ["--generator", generator]
            self.group.start(f"client-{ids}", command)

    def follow(self, coordinator: str) -> bool:
        """Show progress from the coordinator's pushed round summaries; True when the run succeeded."""
        channel = grpcutil.make_channel(coordinator, self.credentials)
        stub = pb_grpc.CoordinatorStub(channel)
        total = self.cfg.train.rounds
        bar = tqdm(total=total, desc="rounds", unit="round", disable=self.args.no_progress, file=sys.stderr)
        limit = self.cfg.runtime.registration_timeout_s + total * (self.cfg.runtime.round_timeout_s + 60)
        call = stub.WatchRounds(pb.WatchRequest(), timeout=limit, wait_for_ready=True)
        self._coordinator_stub = stub
        self._following = True
        watchdog = threading.Thread(target=self._watch_children, args=(call,), name="watchdog", daemon=True)
        watchdog.start()
        try:
            for summary in call:
                if summary.finished:
                    if not summary.success:
                        log.error("run failed: %s", summary.message)
                    return summary.success
                bar.n = summary.round
                bar.set_postfix(acc=f"{summary.accuracy:.4f}", loss=f"{summary.loss:.3f}")  # nan: no server test set
                bar.refresh()
                if self.args.no_progress:
                    log.info("round %d/%d accuracy %.4f loss %.4f (%.1fs)", summary.round, total, summary.accuracy, summary.loss, summary.duration_s)
        except grpc.RpcError as exc:
            if self.abandoned is not None:
                child = self.abandoned
                raise ChildFailed(child, child.process.returncode, "exited, and so did every other client node: the run "
                                  f"cannot go on:\n  {log_tail(child)}") from None
            log.error("lost the coordinator's progress stream: %s", exc.details() if isinstance(exc, grpc.Call) else exc)
            return False
        finally:
            self._following = False
            self._coordinator_stub = None
            bar.close()
            channel.close()
        return False

    def note_failures(self) -> None:
        """Record (once each) the children that have exited non-zero, with the tail of their log."""
        reported = {f["pid"] for f in self.failures}
        for child in self.group.children:
            code = child.process.poll()
            if code not in (None, 0) and child.pid not in reported:
                failure = ChildFailed(child, code, f"exited with code {code}:\n  {log_tail(child)}").describe()
                self.failures.append(failure)
                last = log_tail(child, lines=1)
                log.error("%s (pid %d) exited with code %s: %s (see %s)", child.role, child.pid, code, last, child.log_path)
                if child.role.startswith("client-"):
                    self._release(child, f"{child.role} exited with code {code}: {last}")

    def _release(self, child: Child, reason: str) -> None:
        """Tell the coordinator that the clients of a failed client node are gone: it stops waiting for them (at
        registration, in the open round) instead of waiting out its deadlines. Best effort: the run's own deadlines
        remain the bound."""
        stub = self._coordinator_stub
        if stub is None:
            return
        lo, _, hi = child.role.removeprefix("client-").partition("-")
        ids = list(range(int(lo), int(hi or lo) + 1))
        try:
            stub.ReleaseClients(pb.ReleaseRequest(client_ids=ids, reason=reason), timeout=10.0)
        except grpc.RpcError as exc:
            log.warning("could not tell the coordinator that clients %s are gone: %s", ids,
                        exc.details() if isinstance(exc, grpc.Call) else exc)

    def wait_for_exits(self, timeout_s: float) -> int:
        """The coordinator's exit code once it has exited; then the clients (told by RunFinished) get a few
        seconds to exit on their own, so that their codes are recorded before the rest are stopped."""
        try:
            code = self.coordinator.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise ChildFailed(self.coordinator, None, f"did not exit within {timeout_s:.0f}s after the run ended") from None
        clients = [c for c in self.group.children if c.role.startswith("client")]
        stop_at = time.monotonic() + 10.0
        while any(c.process.poll() is None for c in clients) and time.monotonic() < stop_at:
            time.sleep(0.1)
        self.note_failures()
        return code

    def _watch_children(self, call: grpc.Future) -> None:
        """Stop following when the coordinator process is gone, or when every client node has exited and one failed
        (the coordinator would wait out its deadlines for clients that will never come); say so when a child fails."""
        gone_since = None
        while self._following:
            self.note_failures()
            if self.coordinator.process.poll() is not None:
                call.cancel()
                return
            clients = [c for c in self.group.children if c.role.startswith("client")]
            codes = [c.process.poll() for c in clients]
            if clients and None not in codes and any(codes):
                gone_since = gone_since or time.monotonic()
                if time.monotonic() - gone_since > CLIENTS_GONE_GRACE_S:  # the coordinator's own verdict had its chance
                    self.abandoned = next(c for c, code in zip(clients, codes) if code)
                    call.cancel()
                    return
            time.sleep(0.5)

    def score_generator(self, address: str | None, counters: dict[str, Any] | None) -> dict[str, Any] | None:
        """The judge's figures for the generator this run started, once its counters are read (scoring draws images).
        Whatever goes wrong here, even a stop signal, is the scoring's failure, not the finished run's: it is recorded
        as {"error": ...} and the report is written."""
        if address is None or counters is None or self.cfg.generation.evaluate_per_class == 0:
            return None
        from deploy.generator_quality import generator_quality

        started = time.monotonic()
        try:
            return generator_quality(self.cfg, address, counters, out_dir=self.out_dir, tls_flags=self.tls_flags)
        except KeyboardInterrupt:
            self.interrupted = True
            return {"error": "interrupted while scoring the generator"}
        except Exception as exc:  # a read-only cache, a corrupt cache entry, a full disk
            log.warning("could not score the generator: %s", exc)
            return {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            self.scoring_s = time.monotonic() - started

    def generator_counters(self) -> dict[str, Any] | None:
        """The generator's backend, model id and totals, read from its /metrics before it stops (None without one)."""
        if self.generator_metrics_file is None or not self.generator_metrics_file.is_file():
            return None
        port = self.generator_metrics_file.read_text().strip()
        try:
            # Under TLS the generator serves /metrics over HTTPS only, and wants a client certificate of the CA.
            scheme = "http" if self.operator is None else "https"
            values = scrape(f"{scheme}://127.0.0.1:{port}/metrics", tls=self.operator)
        except OSError as exc:
            log.warning("could not read the generator's metrics: %s", exc)
            return None
        served = next((dict(re.findall(r'(\w+)="([^"]*)"', key)) for key in values
                       if key.startswith(INFO + "{")), {})
        return {
            "backend": served.get("backend", self.cfg.generation.backend),
            "model_id": served.get("model_id", ""),
            "device": served.get("device", ""),
            "dtype": served.get("dtype", ""),
            "images_total": int(total(values, IMAGES_TOTAL)),
            "device_seconds": total(values, DEVICE_SECONDS_TOTAL),
            "requests_total": int(total(values, REQUESTS_TOTAL)),
            "quality_filter": filter_counters(values),
        }


def filter_counters(values: dict[str, float]) -> dict[str, Any] | None:
    """The quality filter's threshold and cost (None when it was off): candidates drawn, accepted, rejected and
    spare, rejected per class, the acceptance rate (accepted / judged), the sampling time of the candidates not served
    and the judge's time (both inside device_seconds)."""
    min_confidence = total(values, FILTER_MIN_CONFIDENCE)
    if not min_confidence:
        return None
    candidates = int(total(values, FILTER_CANDIDATES_TOTAL))
    accepted = int(total(values, FILTER_ACCEPTED_TOTAL))
    rejected = int(total(values, FILTER_REJECTED_TOTAL))
    per_class = {dict(re.findall(r'(\w+)="([^"]*)"', key)).get("class_id", ""): int(value) for key, value in values.items()
                 if key.startswith(FILTER_REJECTED_TOTAL + "{")}
    return {
        "min_confidence": min_confidence,
        "candidates_total": candidates,
        "accepted_total": accepted,
        "rejected_total": rejected,
        "spare_total": candidates - accepted - rejected,
        "rejected_per_class": dict(sorted(per_class.items(), key=lambda item: int(item[0] or 0))),
        "acceptance_rate": accepted / (accepted + rejected) if accepted + rejected else None,
        "unserved_device_seconds": total(values, FILTER_UNSERVED_DEVICE_SECONDS_TOTAL),
        "judge_seconds": total(values, FILTER_JUDGE_SECONDS_TOTAL),
    }


def check_local_dir(cfg: RunConfig) -> None:
    """Local mode: data.local_dir holds client-0 .. client-(K-1), and its schema.toml (if any) is the run's schema."""
    d = cfg.data
    if d.local_dir is None:
        raise ConfigError('data.local_dir must name the folder of client-<k>/ folders when data.source = "local"')
    root = Path(d.local_dir).expanduser()
    missing = [f"client-{k}" for k in range(d.clients) if not (root / f"client-{k}").exists()]
    if missing:
        raise ConfigError(f"data.local_dir={d.local_dir!r}: no {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} "
                          f"(data.clients={d.clients})")
    schema = schema_of(d)
    if (root / SCHEMA_FILE).is_file() and schema is not None and read_schema_file(root / SCHEMA_FILE) != schema:
        found = read_schema_file(root / SCHEMA_FILE)
        raise ConfigError(f"data.local_dir={d.local_dir!r}: its {SCHEMA_FILE} names {len(found.classes)} classes of "
                          f"{found.channels}x{found.image_size}x{found.image_size} images, the run's data.classes/"
                          f"image_size/channels {len(schema.classes)} of {schema.channels}x{schema.image_size}x{schema.image_size}"
                          + (" (other class names or order)" if found.classes != schema.classes
                             and len(found.classes) == len(schema.classes) else ""))


def run(args: argparse.Namespace) -> int:
    setup_logging("launcher", args.log_level)
    cfg = load_config(args.config, args.set)
    if cfg.data.source == "local":
        check_local_dir(cfg)  # a missing folder or another schema fails here, not in a client node
    else:
        check_partition(cfg)  # an impossible split fails here, in seconds, not in every client node
    check_generator_shape(cfg)  # a generator of another image size fails here, not in every FedEAS client
    if (cfg.train.device, cfg.train.precision) != ("cpu", "fp32"):  # every process runs here: "cuda" without a GPU fails now
        from fedsynth.learning.hardware import resolve_hardware  # torch loads only where a GPU may be asked for

        resolve_hardware(cfg.train.device, cfg.train.precision)
    out_dir = Path(args.out_dir or cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "config.json", cfg.to_dict())
    launcher = Launcher(cfg, args, out_dir)
    started = time.monotonic()
    def _on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _on_signal)
    counters = quality = None
    success = False
    try:
        generator = launcher.start_generator()
        coordinator = launcher.start_coordinator(generator)
        launcher.start_clients(coordinator, generator)
        log.info("run folder %s; logs in %s", out_dir, launcher.group.log_dir)
        success = launcher.follow(coordinator)
        code = launcher.wait_for_exits(EXIT_TIMEOUT_S)
        counters = launcher.generator_counters()
        quality = launcher.score_generator(generator, counters) if success else None
    except KeyboardInterrupt:
        log.warning("interrupted: stopping every process (the checkpoint keeps completed rounds)")
        launcher.group.stop_all()
        return EXIT_INTERRUPTED
    except ChildFailed as exc:  # a child died or hung where it should have run on: name it, keep its log
        log.error("%s", exc)
        launcher.failures.insert(0, exc.describe())
        # A child that refused its arguments exits 1 (bad input); anything else is a failure of the run itself.
        code = EXIT_ERROR if exc.exit_code == EXIT_ERROR else EXIT_INTERNAL
    finally:
        launcher.group.stop_all()
    record = load_coordinator_record(out_dir)
    report = build_report(
        record,
        wall_clock_s=time.monotonic() - started - launcher.scoring_s,
        processes=launcher.group.pids(),
        generation_wall_s=launcher.generation_setup_s,
        generator_counters=counters,
        generator_quality=quality,
        version=provenance(),
    )
    report["failures"] = launcher.failures
    report["exit_code"] = code if code else (0 if success else EXIT_ERROR)
    if report["exit_code"] == EXIT_OK and (launcher.failures or report["excluded_clients"]):
        report["exit_code"], report["success"] = EXIT_INCOMPLETE, False  # completed, but not with all its clients
    write_json(out_dir / "report.json", report)
    from deploy.report_render import render_report  # matplotlib loads only here
    render_report(out_dir)  # report.md and plots/ beside report.json
    if report["final_accuracy"] is not None:
        log.info(
            "final accuracy %.4f (last-%d mean %.4f), %d synthetic images, %.1fs wall-clock; report: %s",
            report["final_accuracy"], min(LAST_N, len(report["rounds"])), report["last20_mean_accuracy"],
            report["generation"]["total_images"], report["wall_clock_s"], out_dir / "report.json",
        )
    if report["exit_code"] == EXIT_INCOMPLETE:
        left = sorted({e["client"] for e in report["excluded_clients"]})
        failed = ", ".join(f"{f['process']} (exit {f['exit_code']})" for f in launcher.failures)
        log.error("run completed without some clients: %s%s%s; exit %d, see report.json", f"excluded {left}" if left else "",
                  "; " if left and failed else "", f"failed {failed}" if failed else "", EXIT_INCOMPLETE)
    elif launcher.failures:
        first = launcher.failures[0]
        log.error("run failed: %s (pid %s) exited with code %s; see %s and report.json", first["process"], first["pid"],
                  first["exit_code"], first["log"])
    return EXIT_INTERRUPTED if launcher.interrupted else int(report["exit_code"])
