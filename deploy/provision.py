"""`fedsynth deploy provision`: a CA and one key/certificate pair per node (coordinator, generator, operator, clients)."""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedsynth.errors import ConfigError
from fedsynth.wire.tls import TRUST_DOMAIN, node_uri

SERVER_ROLES = ("coordinator", "generator")
DEFAULT_HOSTS = ("localhost", "127.0.0.1")
CLOCK_SKEW = dt.timedelta(minutes=5)  # certificates are valid from a little before now: peers' clocks differ
HOSTNAME = re.compile(r"^(\*\.)?[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")


@dataclass(frozen=True)
class Node:
    role: str  # coordinator | generator | operator | client
    index: int | None = None  # the client id, for role "client"

    @property
    def node_id(self) -> str:
        return self.role if self.index is None else f"{self.role}-{self.index}"


def parse_hosts(flag: str, text: str | None) -> list[x509.GeneralName]:
    """'host1,10.0.0.5' -> DNS and IP subject alternative names (after localhost and 127.0.0.1)."""
    names: list[x509.GeneralName] = []
    extra = [h.strip() for h in text.split(",")] if text else []
    if text is not None and not all(extra):
        raise ConfigError(f"{flag} expects a comma-separated list of host names or IP addresses, got {text!r}")
    for host in dict.fromkeys([*DEFAULT_HOSTS, *extra]):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            if not HOSTNAME.match(host):
                raise ConfigError(f"{flag}: {host!r} is neither an IP address nor a host name") from None
            names.append(x509.DNSName(host))
    return names


def _name(common_name: str, unit: str) -> x509.Name:
    return x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, TRUST_DOMAIN),
        x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, unit),
        x509.NameAttribute(NameOID.COMMON_NAME, common_name),
    ])


def make_ca(days: int, now: dt.datetime) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(f"{TRUST_DOMAIN} CA", "ca")
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def make_leaf(node: Node, ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, hosts: list[x509.GeneralName],
              days: int, now: dt.datetime) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """The node id is the CN and a spiffe:// URI SAN; the role is the OU and the URI's first path segment."""
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(node_uri(node.role, node.index))]
    usage = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if node.role in SERVER_ROLES:
        names += hosts
        usage = [ExtendedKeyUsageOID.SERVER_AUTH]
        if node.role == "coordinator":  # Private Evolution's coordinator also dials the generator, as a client
            usage.append(ExtendedKeyUsageOID.CLIENT_AUTH)
    elif hosts:  # a client certificate given --client-hosts also serves its node's /metrics over HTTPS
        names += hosts
        usage.append(ExtendedKeyUsageOID.SERVER_AUTH)
    not_after = min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(node.node_id, node.role)).issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW).not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=False, crl_sign=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    """PKCS#8 PEM, unencrypted (gRPC cannot read an encrypted key), created 0600 so no other user ever reads it."""
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        os.fchmod(handle.fileno(), 0o600)  # an existing file (--force) keeps its old mode otherwise
        handle.write(data)


def write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.chmod(0o644)


def _entry(node_id: str, role: str, cert: x509.Certificate) -> dict[str, object]:
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value if role != "ca" else []
    return {
        "node_id": node_id,
        "role": role,
        "cert": f"{node_id}.pem",
        "key": f"{node_id}-key.pem",
        "serial": f"0x{cert.serial_number:x}",
        "sha256": cert.fingerprint(hashes.SHA256()).hex(),
        "not_after": cert.not_valid_after_utc.isoformat(),
        "subject_alt_names": [str(n.value) for n in sans],
    }


def provision(out: Path, clients: int, *, coordinator_hosts: str | None = None, generator_hosts: str | None = None,
              client_hosts: str | None = None, days: int = 365, force: bool = False) -> dict[str, object]:
    """Write the CA and every node's pair into `out`; returns the index (also written as out/index.json)."""
    if clients < 1:
        raise ConfigError(f"--clients must be >= 1, got {clients}")
    if days < 1:
        raise ConfigError(f"--days must be >= 1, got {days}")
    hosts = {"coordinator": parse_hosts("--coordinator-hosts", coordinator_hosts),
             "generator": parse_hosts("--generator-hosts", generator_hosts),
             "client": [] if client_hosts is None else parse_hosts("--client-hosts", client_hosts)}
    if (out / "ca.pem").exists() and not force:
        raise ConfigError(f"{out / 'ca.pem'} exists: refusing to replace the CA (every certificate it signed would stop "
                          "working); pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    _remove_previous(out)
    now = dt.datetime.now(dt.timezone.utc)
    ca_key, ca_cert = make_ca(days, now)
    write_key(out / "ca-key.pem", ca_key)
    write_cert(out / "ca.pem", ca_cert)
    nodes = [Node("coordinator"), Node("generator"), Node("operator"), *(Node("client", k) for k in range(clients))]
    entries = []
    for node in nodes:
        key, cert = make_leaf(node, ca_key, ca_cert, hosts.get(node.role, []), days, now)
        write_key(out / f"{node.node_id}-key.pem", key)
        write_cert(out / f"{node.node_id}.pem", cert)
        entries.append(_entry(node.node_id, node.role, cert))
    index = {"trust_domain": TRUST_DOMAIN, "created": now.isoformat(), "days": days, "clients": clients,
             "ca": _entry("ca", "ca", ca_cert), "nodes": entries}
    (out / "index.json").write_text(json.dumps(index, indent=2) + "\n")
    return index


def _remove_previous(out: Path) -> None:
    """With --force: delete the pairs the previous index listed, so no certificate of the old CA lingers."""
    index = out / "index.json"
    if not index.is_file():
        return
    for entry in json.loads(index.read_text()).get("nodes", []):
        for name in (entry.get("cert"), entry.get("key")):
            if isinstance(name, str) and "/" not in name:
                (out / name).unlink(missing_ok=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=Path, help="folder to write into (created 0700)")
    parser.add_argument("--clients", required=True, type=int, help="K: one certificate per client id 0..K-1")
    parser.add_argument("--coordinator-hosts", metavar="HOST,IP", help="extra DNS/IP names of the coordinator's certificate "
                        "(localhost and 127.0.0.1 are always in it)")
    parser.add_argument("--generator-hosts", metavar="HOST,IP", help="extra DNS/IP names of the generator's certificate")
    parser.add_argument("--client-hosts", metavar="HOST,IP", help="make client certificates server certificates too, "
                        "for HTTPS /metrics: these names plus localhost and 127.0.0.1 (default: clientAuth only, no names)")
    parser.add_argument("--days", type=int, default=365, help="validity of the CA and every certificate (default %(default)s)")
    parser.add_argument("--force", action="store_true", help="replace an existing CA (and every pair it signed)")


def run(args: argparse.Namespace) -> int:
    index = provision(args.out, args.clients, coordinator_hosts=args.coordinator_hosts,
                      generator_hosts=args.generator_hosts, client_hosts=args.client_hosts, days=args.days, force=args.force)
    nodes = index["nodes"]
    assert isinstance(nodes, list)
    print(f"wrote a CA and {len(nodes)} certificates ({', '.join(n['node_id'] for n in nodes[:4])}"
          f"{', ...' if len(nodes) > 4 else ''}) to {args.out}, valid {args.days} days; index: {args.out / 'index.json'}")
    print(f"keep {args.out / 'ca-key.pem'} off the nodes: each machine needs only ca.pem and its own pair")
    return 0
