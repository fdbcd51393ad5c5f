"""A throw-away lab network: one Linux network namespace per host on a private bridge, always removed afterwards.

Layout (every name starts with the lab's prefix, so a crashed run's leftovers are found and removed by name):

    PREFIX-switch       holds the bridge br0 and one veth end per host (h0, h1, ...); no address, no route out
    PREFIX-HOST         one per host: eth0 (the other veth end) with SUBNET.2, .3, ... and lo

Nothing is created in the caller's own namespace, and the hosts have no route beyond their /24, so lab traffic
can only reach lab addresses. Deleting the namespaces deletes the veths and the bridge with them. Needs root and
iproute2's `ip`; random loss needs nftables (`nft`) or `iptables` inside the namespaces.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

DEFAULT_PREFIX = "fsynth"
DEFAULT_SUBNET = "10.77.0.0/24"
SWITCH = "switch"
BRIDGE = "br0"
HOST_INTERFACE = "eth0"
NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")


class LabError(RuntimeError):
    """The lab cannot be built or used on this machine (not root, no `ip`, a command failed)."""


@dataclass(frozen=True)
class LabHost:
    name: str  # "coordinator", "client-0"
    namespace: str  # "fsynth-coordinator"
    address: str  # "10.77.0.2"


def missing_requirements(*, loss: bool = False) -> list[str]:
    """Why the lab cannot run here, one reason per entry; empty when it can."""
    problems = []
    if os.geteuid() != 0:
        problems.append(f"network namespaces need root (running as uid {os.geteuid()})")
    if shutil.which("ip") is None:
        problems.append("iproute2's `ip` is not on PATH (apt-get install -y iproute2)")
    if loss and loss_tool() is None:
        problems.append("random packet loss needs `nft` or `iptables` (apt-get install -y nftables)")
    return problems


def loss_tool() -> str | None:
    """The packet filter used for random loss: nftables first, iptables otherwise, None when neither exists."""
    for tool in ("nft", "iptables"):
        if shutil.which(tool):
            return tool
    return None


def _ip(*args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], input=stdin, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise LabError(f"`ip {' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


def list_namespaces(prefix: str = "") -> list[str]:
    """Names from `ip netns list` that start with `prefix-` (all of them for an empty prefix)."""
    names = [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]
    return [n for n in names if not prefix or n.startswith(f"{prefix}-")]


def destroy(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Remove every namespace named `prefix-*`, ending the processes still inside them; idempotent.

    A namespace lives on while a process is in it (and so do its veth and the bridge's port), so the processes
    a crashed run left in the lab's own namespaces are killed by pid first.
    """
    if not NAME.match(prefix):
        raise LabError(f"lab prefix must be lowercase letters, digits and '-', got {prefix!r}")
    removed = []
    for namespace in list_namespaces(prefix):
        for pid in _ip("netns", "pids", namespace, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _ip("netns", "delete", namespace, check=False)
        removed.append(namespace)
    leftover = list_namespaces(prefix)
    if leftover:
        raise LabError(f"could not remove namespaces {leftover}")
    return removed


class NetnsLab:
    """Hosts in their own namespaces on one bridge. `with NetnsLab([...]) as lab:` builds it and always removes it."""

    def __init__(self, hosts: Sequence[str], *, prefix: str = DEFAULT_PREFIX, subnet: str = DEFAULT_SUBNET) -> None:
        if not NAME.match(prefix):
            raise LabError(f"lab prefix must be lowercase letters, digits and '-', got {prefix!r}")
        if not hosts or len(set(hosts)) != len(hosts):
            raise LabError(f"hosts must be distinct and at least one, got {list(hosts)}")
        for host in hosts:
            if not NAME.match(host) or host == SWITCH:
                raise LabError(f"host name must be lowercase letters, digits and '-' (not {SWITCH!r}), got {host!r}")
        network = ipaddress.ip_network(subnet, strict=True)
        if not (network.version == 4 and network.is_private):
            raise LabError(f"the lab subnet must be a private IPv4 network, got {subnet!r}")
        usable = list(network.hosts())[1:]  # .1 stays free (a gateway's address by habit; the lab has none)
        if len(hosts) > len(usable):
            raise LabError(f"subnet {subnet} has {len(usable)} host addresses for {len(hosts)} hosts")
        self.prefix = prefix
        self.prefix_length = network.prefixlen
        self.switch = f"{prefix}-{SWITCH}"
        self.hosts = {h: LabHost(h, f"{prefix}-{h}", str(a)) for h, a in zip(hosts, usable)}

    def __enter__(self) -> NetnsLab:
        self.create()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        destroy(self.prefix)

    def create(self) -> None:
        """Remove any leftovers of this prefix, then build the lab; on failure nothing of it stays."""
        missing = missing_requirements()
        if missing:
            raise LabError("; ".join(missing))
        destroy(self.prefix)
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", BRIDGE, "type", "bridge")
            _ip("-n", self.switch, "link", "set", BRIDGE, "up")
            for index, host in enumerate(self.hosts.values()):
                port = f"h{index}"
                _ip("netns", "add", host.namespace)
                _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", HOST_INTERFACE, "netns", host.namespace)
                _ip("-n", self.switch, "link", "set", port, "master", BRIDGE, "up")
                _ip("-n", host.namespace, "addr", "add", f"{host.address}/{self.prefix_length}", "dev", HOST_INTERFACE)
                _ip("-n", host.namespace, "link", "set", HOST_INTERFACE, "up")
                _ip("-n", host.namespace, "link", "set", "lo", "up")
        except BaseException:
            destroy(self.prefix)
            raise

    def destroy(self) -> list[str]:
        return destroy(self.prefix)

    def host(self, name: str) -> LabHost:
        try:
            return self.hosts[name]
        except KeyError:
            raise LabError(f"no host {name!r} in this lab (hosts: {', '.join(self.hosts)})") from None

    def address(self, name: str) -> str:
        return self.host(name).address

    def command(self, name: str, argv: Sequence[str]) -> list[str]:
        """argv run inside the host's namespace (`ip netns exec` execs it: the pid is argv's own)."""
        return ["ip", "netns", "exec", self.host(name).namespace, *argv]

    def run(self, name: str, argv: Sequence[str], *, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run argv inside the host's namespace to completion; LabError with its stderr if it fails."""
        done = subprocess.run(self.command(name, argv), capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise LabError(f"{' '.join(argv)} in {name} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
        return done

    def add_loss(self, name: str, percent: float) -> str:
        """Drop `percent`% of the host's packets at random, each way on eth0 (lo untouched); returns the tool used."""
        if not 0 < percent < 100:
            raise LabError(f"loss percent must be in (0, 100), got {percent}")
        tool = loss_tool()
        if tool == "nft":
            per_10k = round(percent * 100)  # numgen draws integers: 2% -> 200 of 10000
            rule = f"numgen random mod 10000 < {per_10k} counter drop"
            ruleset = (
                "table inet fsynth_loss {\n"
                f"  chain output {{ type filter hook output priority 0; policy accept; oifname \"{HOST_INTERFACE}\" {rule}; }}\n"
                f"  chain input {{ type filter hook input priority 0; policy accept; iifname \"{HOST_INTERFACE}\" {rule}; }}\n"
                "}\n"
            )
            done = subprocess.run(self.command(name, ["nft", "-f", "-"]), input=ruleset, capture_output=True, text=True, timeout=30)
            if done.returncode != 0:
                raise LabError(f"nft in {name} failed: {done.stderr.strip()}")
        elif tool == "iptables":
            probability = f"{percent / 100:.6f}"
            for chain, flag in (("OUTPUT", "-o"), ("INPUT", "-i")):
                self.run(name, ["iptables", "-A", chain, flag, HOST_INTERFACE, "-m", "statistic", "--mode", "random",
                                "--probability", probability, "-j", "DROP"])
        else:
            raise LabError("random packet loss needs `nft` or `iptables` (apt-get install -y nftables)")
        return tool

    def dropped_packets(self, name: str) -> int:
        """Packets the loss rules of add_loss() have dropped on this host so far, both ways."""
        if loss_tool() == "nft":
            listing = self.run(name, ["nft", "list", "table", "inet", "fsynth_loss"]).stdout
            return sum(int(n) for n in re.findall(r"counter packets (\d+)", listing))
        dropped = 0
        for chain in ("OUTPUT", "INPUT"):  # iptables -nvxL: the first column is the rule's packet count
            for line in self.run(name, ["iptables", "-nvxL", chain]).stdout.splitlines()[2:]:
                fields = line.split()
                if len(fields) > 2 and fields[2] == "DROP" and "statistic" in line:
                    dropped += int(fields[0])
        return dropped


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="netns_lab", description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="namespace name prefix (default %(default)s)")
    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="build the lab (removing leftovers of the same prefix first) and print the hosts")
    up.add_argument("--clients", type=int, default=3, help="client-0 .. client-(K-1) besides coordinator and generator")
    up.add_argument("--subnet", default=DEFAULT_SUBNET)
    sub.add_parser("down", help="remove every PREFIX-* namespace and what runs in it")
    sub.add_parser("list", help="the lab's namespaces")
    loss = sub.add_parser("loss", help="random packet loss on one host's eth0, both ways")
    loss.add_argument("host")
    loss.add_argument("percent", type=float)
    args = parser.parse_args(argv)
    try:
        if args.action == "up":
            hosts = ["coordinator", "generator", *(f"client-{k}" for k in range(args.clients))]
            lab = NetnsLab(hosts, prefix=args.prefix, subnet=args.subnet)
            lab.create()
            for host in lab.hosts.values():
                print(f"{host.name:12s} {host.address:15s} ip netns exec {host.namespace} ...")
        elif args.action == "down":
            print("\n".join(f"removed {n}" for n in destroy(args.prefix)) or "nothing to remove")
        elif args.action == "list":
            print("\n".join(list_namespaces(args.prefix)))
        else:
            print(NetnsLab([args.host], prefix=args.prefix).add_loss(args.host, args.percent))
    except LabError as exc:
        print(f"netns_lab: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
