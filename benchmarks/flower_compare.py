"""ResNet-18's weights from a server to N clients and back, per round: our runtime beside Flower's two runtimes.

Our runtime two ways and Flower's two, same machine, same invocation, every end a separate OS process on localhost:

* ours: a real `fedsynth coordinator` (ResNet-18, a tiny CIFAR-shaped npz dataset, `train.max_steps=0`) and N real
  `fedsynth client` processes, one client each; the models travel as chunks on the gRPC streams (the default).
* ours-tcp: the same with `runtime.data_plane = "tcp"` (fedsynth/wire/data_plane.py: raw bytes beside gRPC).
* flower-legacy: `flwr.server.start_server` with FedAvg seeded with the same arrays (the numpy float32 state_dict of
  our `build_model("resnet18", ...)`) and N `flwr.client.start_client` processes whose NumPyClient.fit returns the
  received arrays unchanged; no Flower evaluation.
* flower-deployment: Flower's deployment runtime. A `flower-superlink --insecure` and N `flower-supernode --insecure`
  processes (each SuperNode with a FLWR_HOME of its own, as on separate machines), then `flwr run APP bench --stream`
  against a SuperLink connection "bench" written into the CLI's FLWR_HOME/config.toml. APP is a throw-away folder
  holding benchmarks/flower_deployment_app.py and a generated pyproject.toml ([tool.flwr.app.components] name its
  ServerApp and ClientApp, [tool.flwr.app.config] the arrays file, N, R and where to write timings). The SuperLink
  starts the ServerApp (FedAvg of flwr.serverapp.strategy, the Message API, seeded with the same arrays as an
  ArrayRecord, every node each round, no evaluation); each SuperNode starts a ClientApp per message, which replies
  with the received ArrayRecord unchanged. Runtime dependency installation is off, telemetry and update checks too.
  This runtime polls as shipped (a SuperNode with nothing to do sleeps 3 s before asking again, the ServerApp asks
  for replies every 3 s, SuperExec looks for a ClientApp to start every 1 s), so its rounds have a floor of a few
  seconds whatever the model; nothing here tunes it.

Flower pins protobuf < 7 and our runtime needs protobuf 7, so the Flower processes run under another interpreter
(`--flower-python`, a virtualenv holding only flwr and numpy); this script re-invokes itself there with `--role` for
the legacy server and clients, and runs the deployment runtime's own commands (flower-superlink, flower-supernode,
flwr) from that interpreter's bin folder. "Seconds per round" is the period between consecutive round ends seen by
each server (rounds 2..R), which covers everything a round costs; each framework's own round timer is shown too
(ours: the coordinator's round duration; Flower: configure_fit/configure_train start to aggregate_fit/aggregate_train
end). MB/s counts 2·N·(weights size) per round. Every process gets a deadline (--deadline-s per framework run) and
is stopped with all its descendants when its run ends, fails or is interrupted.

    python benchmarks/flower_compare.py --flower-python /tmp/flwr-venv/bin/python --clients 1 4 --rounds 5
    python benchmarks/flower_compare.py --flower-python /tmp/flwr-venv/bin/python --model cnn --clients 10 --rounds 10
    python benchmarks/flower_compare.py --flower-python /tmp/flwr-venv/bin/python --frameworks ours flower-deployment --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

MB = 1e6
HERE = Path(__file__).resolve()
APP_MODULE = HERE.with_name("flower_deployment_app.py")
FRAMEWORKS = ("ours", "ours-tcp", "flower-legacy", "flower-deployment")
LABELS = {"ours": "ours", "ours-tcp": "ours (data plane)", "flower-legacy": "Flower legacy", "flower-deployment": "Flower deployment"}
OURS = {"ours": "grpc", "ours-tcp": "tcp"}  # our frameworks: runtime.data_plane
FLOWER_ENV = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1", "PYTHONUNBUFFERED": "1"}


# ---- Flower roles: run under --flower-python, import nothing of ours -------------------------------------------

def flower_server(args: argparse.Namespace) -> None:
    import flwr as fl

    with np.load(args.arrays) as stored:
        arrays = [stored[f"a{i}"] for i in range(len(stored.files))]
    starts: dict[int, float] = {}
    ends: dict[int, float] = {}

    class TimedFedAvg(fl.server.strategy.FedAvg):
        def configure_fit(self, server_round, parameters, client_manager):  # type: ignore[no-untyped-def]
            starts[server_round] = time.monotonic()
            return super().configure_fit(server_round, parameters, client_manager)

        def aggregate_fit(self, server_round, results, failures):  # type: ignore[no-untyped-def]
            if failures or len(results) != args.clients:
                raise RuntimeError(f"round {server_round}: {len(results)} results, {len(failures)} failures")
            aggregated = super().aggregate_fit(server_round, results, failures)
            ends[server_round] = time.monotonic()
            return aggregated

    strategy = TimedFedAvg(
        fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=args.clients, min_evaluate_clients=0,
        min_available_clients=args.clients, initial_parameters=fl.common.ndarrays_to_parameters(arrays),
    )
    fl.server.start_server(server_address=f"127.0.0.1:{args.port}", config=fl.server.ServerConfig(num_rounds=args.rounds), strategy=strategy)
    Path(args.timings).write_text(json.dumps({"starts": starts, "ends": ends}))


def flower_client(args: argparse.Namespace) -> None:
    import flwr as fl

    class EchoClient(fl.client.NumPyClient):
        def get_parameters(self, config):  # type: ignore[no-untyped-def]
            return []

        def fit(self, parameters, config):  # type: ignore[no-untyped-def]
            return parameters, 1, {}

    fl.client.start_client(server_address=f"127.0.0.1:{args.port}", client=EchoClient().to_client(), insecure=True)


# ---- processes: start with a log, stop with every descendant -----------------------------------------------------

def free_ports(count: int) -> list[int]:
    """count distinct free ports on 127.0.0.1 (all held open together, so none repeats)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def start(command: list[str], log_path: Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as log:
        # a process group of its own: Ctrl-C reaches this script only, which then stops the whole tree (stop())
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=cwd, process_group=0)


def process_tree(roots: list[int]) -> set[int]:
    """roots and every live descendant, from /proc. Flower's SuperLink starts its SuperExec in a session of its own
    (so no process group holds them all), and each SuperExec starts the ServerApp or the ClientApps."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue  # gone meanwhile
        if state != "Z":
            children.setdefault(int(ppid), []).append(int(stat.parent.name))
    found: set[int] = set()
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def signal_all(pids: set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop(processes: list[subprocess.Popen[bytes]], grace_s: float = 15.0) -> None:
    """SIGTERM every process still running and all its descendants, wait up to grace_s, then SIGKILL what is left."""
    pids = process_tree([p.pid for p in processes if p.poll() is None])
    signal_all(pids, signal.SIGTERM)
    stop_at = time.monotonic() + grace_s
    while time.monotonic() < stop_at:
        for p in processes:
            p.poll()  # reap our own children, or they would count as running
        if not any(running(pid) for pid in pids):
            break
        time.sleep(0.2)
    left = {pid for pid in pids if running(pid)}
    signal_all(left | process_tree(list(left)), signal.SIGKILL)
    for p in processes:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def log_tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace").strip().splitlines() if path.is_file() else ["(no log)"]
    return "\n    ".join(text[-lines:])


def wait_for_port(port: int, process: subprocess.Popen[bytes], stop_at: float, log_path: Path) -> None:
    while time.monotonic() < stop_at:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return
        except OSError:
            pass
        if process.poll() is not None:
            raise RuntimeError(f"exited with code {process.returncode} before listening on {port}:\n    {log_tail(log_path)}")
        time.sleep(0.2)
    raise RuntimeError(f"nothing listened on {port} before the deadline:\n    {log_tail(log_path)}")


def periods_and_own(record: dict[str, dict[str, float]], rounds: int) -> dict[str, list[float]]:
    """A server's {"starts": {round: t}, "ends": {round: t}} as round-end periods and own round durations."""
    ends = [record["ends"][str(r)] for r in range(1, rounds + 1)]
    own = [record["ends"][str(r)] - record["starts"][str(r)] for r in range(1, rounds + 1)]
    return {"periods": [b - a for a, b in zip(ends, ends[1:])], "own": own}


# ---- Flower, legacy: start_server + start_client, each a `--role` re-invocation of this file ---------------------

def run_flower_legacy(flower_python: str, folder: Path, arrays_file: Path, clients: int, rounds: int, deadline_s: float) -> dict[str, list[float]]:
    [port] = free_ports(1)
    timings, log_path = folder / f"flower-legacy-{clients}.json", folder / f"flower-legacy-{clients}.log"
    common = ["--arrays", str(arrays_file), "--clients", str(clients), "--rounds", str(rounds), "--port", str(port), "--timings", str(timings)]
    env = {**os.environ, **FLOWER_ENV}
    processes: list[subprocess.Popen[bytes]] = []
    try:
        processes.append(start([flower_python, str(HERE), "--role", "flower-server", *common], log_path, env))
        time.sleep(3.0)  # start_client retries until the server listens; this only keeps its log short
        processes += [start([flower_python, str(HERE), "--role", "flower-client", *common], log_path, env) for _ in range(clients)]
        try:
            code = processes[0].wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"Flower legacy server did not finish within {deadline_s:.0f}s:\n    {log_tail(log_path)}") from None
        if code != 0:
            raise RuntimeError(f"Flower legacy server exited {code}:\n    {log_tail(log_path)}")
        stop_at = time.monotonic() + 30  # clients leave once the server says so; stop() ends any that do not
        for w in processes[1:]:
            try:
                w.wait(timeout=max(0.1, stop_at - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        stop(processes)
    return periods_and_own(json.loads(timings.read_text()), rounds)


# ---- Flower, deployment: SuperLink + N SuperNodes + `flwr run` of flower_deployment_app.py -----------------------

def app_pyproject(arrays_file: Path, clients: int, rounds: int, timings: Path, round_timeout_s: float) -> str:
    module = APP_MODULE.stem
    return "\n".join([
        "[project]", 'name = "fedsynth-flower-echo"', 'version = "1.0.0"', 'license = "Apache-2.0"',
        'description = "flower_compare.py: a ServerApp sending arrays, ClientApps echoing them"', "dependencies = []", "",
        "[tool.flwr.app]", 'publisher = "fedsynth"', "",
        "[tool.flwr.app.components]", f'serverapp = "{module}:server_app"', f'clientapp = "{module}:client_app"', "",
        "[tool.flwr.app.config]", f"arrays = {json.dumps(str(arrays_file))}", f"clients = {clients}", f"rounds = {rounds}",
        f"timings = {json.dumps(str(timings))}", f"round-timeout-s = {float(round_timeout_s)}", "",
    ])


def run_flower_deployment(flower_python: str, folder: Path, arrays_file: Path, clients: int, rounds: int, deadline_s: float) -> dict[str, list[float]]:
    bin_dir = Path(flower_python).parent  # the virtualenv's bin, not resolved: its python is a link out of it
    for tool in ("flower-superlink", "flower-supernode", "flower-superexec", "flwr"):
        if not (bin_dir / tool).is_file():
            raise RuntimeError(f"{bin_dir / tool} not found: --flower-python must be the python of a virtualenv holding flwr")
    work = folder / f"flower-deployment-{clients}"
    app, home = work / "app", work / "flwr-home"
    app.mkdir(parents=True)
    home.mkdir()
    timings = work / "timings.json"
    shutil.copy(APP_MODULE, app / APP_MODULE.name)
    (app / "pyproject.toml").write_text(app_pyproject(arrays_file, clients, rounds, timings, deadline_s))
    link_port, *node_ports = free_ports(1 + clients)
    (home / "config.toml").write_text(f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\naddress = "127.0.0.1:{link_port}"\ninsecure = true\n')
    # SuperLink and SuperNodes start `flower-superexec` by name, so the virtualenv's bin goes first on PATH
    env = {**os.environ, **FLOWER_ENV, "FLWR_HOME": str(home), "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    stop_at = time.monotonic() + deadline_s
    processes: list[subprocess.Popen[bytes]] = []
    try:
        link_log = work / "superlink.log"
        processes.append(start([str(bin_dir / "flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port", str(link_port),
                                "--disable-runtime-dependency-installation"], link_log, env))
        wait_for_port(link_port, processes[0], stop_at, link_log)
        for i, node_port in enumerate(node_ports):
            node_home = work / f"supernode-{i}"
            node_home.mkdir()
            processes.append(start([str(bin_dir / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{link_port}",
                                    "--host", "127.0.0.1", "--port", str(node_port)], work / f"supernode-{i}.log", {**env, "FLWR_HOME": str(node_home)}))
        run_log = work / "flwr-run.log"  # --stream: the ServerApp's log, until the run ends
        cli = start([str(bin_dir / "flwr"), "run", str(app), "bench", "--stream"], run_log, env, cwd=app)
        processes.append(cli)
        try:
            code = cli.wait(timeout=max(1.0, stop_at - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"Flower deployment run did not finish within {deadline_s:.0f}s:\n    {log_tail(run_log)}") from None
        if code != 0 or not timings.is_file():
            raise RuntimeError(f"Flower deployment run exited {code}{'' if timings.is_file() else ' without timings'}:\n    {log_tail(run_log)}")
    finally:
        stop(processes)
    return periods_and_own(json.loads(timings.read_text()), rounds)


# ---- our runtime --------------------------------------------------------------------------------------------------

def run_ours(folder: Path, clients: int, rounds: int, model: str, deadline_s: float, plane: str) -> dict[str, list[float]]:
    from local_federation import run_local_federation  # ours only: this file also runs under Flower's venv

    run_dir = folder / f"ours-{plane}-{clients}"
    settings = {
        "data.dataset": "cifar10", "data.data_dir": str(folder), "data.clients": clients, "data.partition": "iid",
        "data.min_size": 0, "train.model": model, "train.rounds": rounds, "train.max_steps": 0,
        "generation.policy": "none", "runtime.heartbeat_s": 5.0, "runtime.heartbeat_timeout_s": 15.0, "runtime.data_plane": plane,
    }
    ends: list[float] = []
    record = run_local_federation(run_dir, settings, clients=clients, clients_per_process=1,
                                  on_round=lambda _coordinator: ends.append(time.monotonic()), watch_timeout_s=deadline_s, exit_timeout_s=120)
    return {"periods": [b - a for a, b in zip(ends, ends[1:])], "own": [r["duration_s"] for r in record["rounds"]]}


def model_arrays(name: str) -> list[np.ndarray]:
    from fedsynth.learning.models import build_model

    model = build_model(name, num_classes=10, in_channels=3, image_size=32)
    return [t.detach().cpu().numpy().astype(np.float32) for t in model.state_dict().values()]


def summary(result: dict[str, Any], clients: int, size: int) -> dict[str, Any]:
    """Medians over rounds 2..R (the first round also carries the start)."""
    period = statistics.median(result["periods"])
    return {"s_per_round": period, "mb_per_s": 2 * clients * size / MB / period, "own_round_timer_s": statistics.median(result["own"][1:]),
            "periods_s": result["periods"], "own_round_timers_s": result["own"], "wall_s": result["wall_s"]}


def table(frameworks: list[str], rows: list[dict[str, Any]]) -> list[str]:
    ours = [f for f in frameworks if f in OURS]
    flowers = [f for f in frameworks if f not in OURS]
    pairs = [(o, f) for o in ours for f in flowers]
    header = ["clients"] + [f"{LABELS[f]} {unit}" for f in frameworks for unit in ("s/round", "MB/s")]
    header += [f"{LABELS[f]} ÷ {LABELS[o]} time" for o, f in pairs] + [f"{LABELS[f]} own round timer s" for f in frameworks]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for row in rows:
        got = row["frameworks"]

        def cell(f: str, key: str, fmt: str) -> str:
            return format(got[f][key], fmt) if key in got.get(f, {}) else "failed"

        cells = [str(row["clients"])] + [c for f in frameworks for c in (cell(f, "s_per_round", ".3f"), cell(f, "mb_per_s", ",.0f"))]
        cells += [f"{got[f]['s_per_round'] / got[o]['s_per_round']:.1f}x" if "s_per_round" in got.get(o, {}) and "s_per_round" in got.get(f, {}) else "failed"
                  for o, f in pairs]
        cells += [cell(f, "own_round_timer_s", ".3f") for f in frameworks]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flower-python", help="an interpreter with flwr installed (its own virtualenv); needed for the Flower frameworks")
    parser.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS), help="which to run (default: all four)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=5, help="rounds per run; periods are taken over rounds 2..R")
    parser.add_argument("--model", default="resnet18", choices=["resnet18", "cnn"], help="cnn: round overhead rather than transfer")
    parser.add_argument("--deadline-s", type=float, default=1800.0, help="each framework's run at one client count must end by then")
    parser.add_argument("--json", help="write the results here (rewritten after each framework's run)")
    parser.add_argument("--role", choices=["flower-server", "flower-client"], help=argparse.SUPPRESS)
    parser.add_argument("--arrays", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--timings", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "flower-server":
        args.clients = args.clients[0]
        return flower_server(args)
    if args.role == "flower-client":
        return flower_client(args)
    frameworks = [f for f in FRAMEWORKS if f in args.frameworks]
    if not args.flower_python and not set(frameworks) <= set(OURS):
        parser.error("--flower-python is required for the Flower frameworks (flwr pins protobuf < 7; install it in its own virtualenv)")
    if args.rounds < 2:
        parser.error(f"--rounds must be >= 2 to measure a period between rounds, got {args.rounds}")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through stop(): no SuperLink or SuperNode outlives us
    began = time.monotonic()
    version = None
    if args.flower_python:
        version = subprocess.run([args.flower_python, "-c", "import flwr; print(flwr.__version__)"], capture_output=True, text=True, check=True, timeout=120).stdout.strip()
    arrays = model_arrays(args.model)
    size = sum(a.nbytes for a in arrays)
    report: dict[str, Any] = {
        "model": args.model, "arrays": len(arrays), "weights_mb": size / MB, "flwr": version, "rounds": args.rounds,
        "frameworks": frameworks, "host": platform.node(), "cpus": os.cpu_count(), "load_average_at_start": list(os.getloadavg()), "runs": [],
    }

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")

    failed = False
    with tempfile.TemporaryDirectory(prefix="fedsynth-flower-") as tmp:
        folder = Path(tmp)
        rng = np.random.default_rng(0)
        for split, n in (("train", 40 * max(args.clients)), ("test", 20)):
            np.savez(folder / f"{split}.npz", x=rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8), y=np.arange(n) % 10)
        arrays_file = folder / f"{args.model}.npz"
        np.savez(arrays_file, **{f"a{i}": a for i, a in enumerate(arrays)})
        for n in args.clients:
            row: dict[str, Any] = {"clients": n, "frameworks": {}}
            report["runs"].append(row)
            for framework in frameworks:
                t0 = time.monotonic()
                try:
                    if framework in OURS:
                        result = run_ours(folder, n, args.rounds, args.model, args.deadline_s, OURS[framework])
                    elif framework == "flower-legacy":
                        result = run_flower_legacy(args.flower_python, folder, arrays_file, n, args.rounds, args.deadline_s)
                    else:
                        result = run_flower_deployment(args.flower_python, folder, arrays_file, n, args.rounds, args.deadline_s)
                    row["frameworks"][framework] = summary({**result, "wall_s": time.monotonic() - t0}, n, size)
                except Exception as error:  # noqa: BLE001 - one framework failing leaves the others' figures standing
                    failed = True
                    row["frameworks"][framework] = {"error": str(error), "wall_s": time.monotonic() - t0}
                    print(f"{framework}, {n} clients: failed: {error}", file=sys.stderr)
                save()
    report["load_average_at_end"] = list(os.getloadavg())
    report["wall_s"] = time.monotonic() - began
    save()

    print(f"{args.model}: {len(arrays)} float32 arrays, {size / MB:.1f} MB; {f'flwr {version}' if version else 'no Flower'}; {args.rounds} rounds, medians over "
          f"rounds 2..{args.rounds}; {platform.node()}, {os.cpu_count()} CPUs, load average (1/5/15 min) "
          f"{'/'.join(f'{x:.1f}' for x in report['load_average_at_start'])} at start, "
          f"{'/'.join(f'{x:.1f}' for x in report['load_average_at_end'])} at end\n")
    print("\n".join(table(frameworks, report["runs"])))
    walls = "; ".join(f"{row['clients']} clients: " + ", ".join(f"{LABELS[f]} {row['frameworks'][f]['wall_s']:.0f}" for f in frameworks) for row in report["runs"])
    print(f"\nwall-clock s per framework run ({walls}); the whole invocation {report['wall_s']:.0f} s")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
