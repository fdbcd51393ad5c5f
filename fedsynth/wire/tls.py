"""Mutual TLS for every role: certificate files, gRPC credentials, the peer's node identity, revocation, per-RPC checks."""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import ipaddress
import itertools
import logging
import os
import re
import ssl
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from google.protobuf.message import Message

from fedsynth.errors import ConfigError, FedsynthError

log = logging.getLogger(__name__)
TRUST_DOMAIN = "fedsynth"
ROLES = ("coordinator", "generator", "operator", "client")
LOOPBACK = "127.0.0.1"
NODE_ID = re.compile(r"^(coordinator|generator|operator|client-(\d+))$")


class AuthenticationError(FedsynthError):
    """The peer presented no certificate, or one that carries no fedsynth node identity."""


def node_uri(role: str, index: int | None = None) -> str:
    """The URI SAN that names a node: spiffe://fedsynth/client/3, spiffe://fedsynth/coordinator."""
    if role not in ROLES or (role == "client") != (index is not None):
        raise ConfigError(f"no node identity for role {role!r} with index {index!r}")
    return f"spiffe://{TRUST_DOMAIN}/{role}" + ("" if index is None else f"/{index}")


@dataclass(frozen=True)
class PeerIdentity:
    role: str  # coordinator | generator | operator | client
    node_id: str  # "client-3", "coordinator", ...: the certificate's CN
    serial: int

    @property
    def client_id(self) -> int | None:
        return int(self.node_id.removeprefix("client-")) if self.role == "client" else None

    def __str__(self) -> str:
        return f"{self.node_id} (serial 0x{self.serial:x})"


def identity_of(cert: x509.Certificate) -> PeerIdentity:
    """Read the node identity from the spiffe://fedsynth/ URI SAN; the CN must agree with it."""
    try:
        uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    cns = [str(a.value) for a in cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)]
    ours = [u for u in uris if u.startswith(f"spiffe://{TRUST_DOMAIN}/")]
    if len(ours) != 1:
        raise AuthenticationError(f"certificate {cert.subject.rfc4514_string()!r} carries no single spiffe://{TRUST_DOMAIN}/ "
                                  "node URI (was it made by `fedsynth deploy provision`?)")
    parts = ours[0].removeprefix(f"spiffe://{TRUST_DOMAIN}/").split("/")
    role = parts[0]
    node_id = role if len(parts) == 1 else f"{role}-{parts[1]}"
    match = NODE_ID.match(node_id)
    if match is None or (role == "client") != (len(parts) == 2) or cns != [node_id]:
        raise AuthenticationError(f"certificate {cert.subject.rfc4514_string()!r} has a malformed node identity {ours[0]!r}")
    return PeerIdentity(role, node_id if role != "client" else f"client-{int(parts[1])}", cert.serial_number)


@functools.lru_cache(maxsize=4096)
def _identity_of_pem(pem: bytes) -> PeerIdentity:
    return identity_of(x509.load_pem_x509_certificate(pem))


def peer_identity(context: grpc.ServicerContext) -> PeerIdentity:
    """The calling node's identity, from the certificate it presented in the (already verified) TLS handshake."""
    pems = context.auth_context().get("x509_pem_cert") or []
    if not pems:
        raise AuthenticationError("the peer presented no client certificate")
    return _identity_of_pem(pems[0])


@dataclass(frozen=True)
class TLSFiles:
    ca: Path
    cert: Path
    key: Path

    def __post_init__(self) -> None:
        for what, path in (("CA certificate", self.ca), ("certificate", self.cert), ("private key", self.key)):
            if not Path(path).is_file():
                raise ConfigError(f"TLS {what} {str(path)!r} does not exist or is not a file")
            if not os.access(path, os.R_OK):
                raise ConfigError(f"TLS {what} {str(path)!r} is not readable by this user")

    @classmethod
    def from_dir(cls, folder: Path, node_id: str) -> TLSFiles:
        """The provision folder's ca.pem, <node_id>.pem and <node_id>-key.pem."""
        folder = Path(folder)
        if not folder.is_dir():
            raise ConfigError(f"--tls-dir {str(folder)!r} is not a folder (create one with `fedsynth deploy provision`)")
        return cls(folder / "ca.pem", folder / f"{node_id}.pem", folder / f"{node_id}-key.pem")

    def load(self) -> tuple[bytes, bytes, bytes]:
        """(ca, cert, key) PEM bytes, after checking that they parse, belong together and the CA signed the cert."""
        ca_pem, cert_pem, key_pem = (Path(p).read_bytes() for p in (self.ca, self.cert, self.key))
        ca, cert = (_load_certificate(path, pem) for path, pem in ((self.ca, ca_pem), (self.cert, cert_pem)))
        try:
            key = serialization.load_pem_private_key(key_pem, password=None)
        except (ValueError, TypeError):  # the message could quote key material: never pass it on
            raise ConfigError(f"{self.key} is not an unencrypted PEM private key") from None
        if key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo) != \
                cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo):
            raise ConfigError(f"private key {self.key} does not belong to certificate {self.cert}")
        try:
            cert.verify_directly_issued_by(ca)
        except (InvalidSignature, ValueError, TypeError) as exc:  # InvalidSignature has no message
            raise ConfigError(f"certificate {self.cert} was not issued by the CA in {self.ca} ({type(exc).__name__})") from None
        if os.stat(self.key).st_mode & 0o077:
            log.warning("private key %s is readable by other users; chmod 600 it", self.key)
        return ca_pem, cert_pem, key_pem

    def identity(self) -> PeerIdentity:
        """The node identity in this node's own certificate."""
        return identity_of(x509.load_pem_x509_certificate(Path(self.cert).read_bytes()))


def _load_certificate(path: Path, pem: bytes) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise ConfigError(f"{path} is not a PEM certificate: {exc}") from None


def server_credentials(files: TLSFiles, require_client_auth: bool = True) -> grpc.ServerCredentials:
    ca, cert, key = files.load()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=require_client_auth)


def channel_credentials(files: TLSFiles) -> grpc.ChannelCredentials:
    ca, cert, key = files.load()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def ssl_server_context(files: TLSFiles) -> ssl.SSLContext:
    """Python's side of our mutual TLS (HTTPS /metrics, the data plane): TLS >= 1.2, the node's own pair, and a client
    certificate signed by the provisioned CA required."""
    files.load()  # one-line errors naming a missing, unreadable or mismatched file
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cafile=str(files.ca))
    context.load_cert_chain(str(files.cert), str(files.key))
    return context


def ssl_client_context(files: TLSFiles) -> ssl.SSLContext:
    """What a client of those servers holds: TLS >= 1.2, only the provisioned CA trusted (the server's name checked
    against its certificate, as gRPC does), and the node's pair as its client certificate."""
    context = ssl.create_default_context(cafile=str(files.ca))
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(files.cert), str(files.key))
    return context


def identity_of_der(der: bytes | None) -> PeerIdentity:
    """The node identity of a peer certificate as Python's ssl hands it over (DER)."""
    if not der:
        raise AuthenticationError("the peer presented no certificate")
    return identity_of(x509.load_der_x509_certificate(der))


class RevocationList:
    """Revoked node ids (client-3) and certificate serials (hex, as in index.json or `openssl x509 -serial`), one a
    line, `#` comments. Re-read whenever the file changes; a file that turns unreadable or malformed keeps the last
    good list (and logs why), so a bad edit never un-revokes anyone."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._stamp = self._stat()
        if self._stamp is None:
            raise ConfigError(f"--revoked {str(self.path)!r} does not exist")
        self._entries = self._parse()  # (node ids, serials), swapped as one tuple so readers never see half an update

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _parse(self) -> tuple[frozenset[str], frozenset[int]]:
        node_ids: set[str] = set()
        serials: set[int] = set()
        for number, raw in enumerate(self.path.read_text().splitlines(), start=1):
            entry = raw.split("#", 1)[0].strip()
            if not entry:
                continue
            match = NODE_ID.match(entry)
            if match is not None:
                node_ids.add(entry if match.group(2) is None else f"client-{int(match.group(2))}")
                continue
            digits = entry.removeprefix("serial=").removeprefix("0x").removeprefix("0X").replace(":", "")
            try:
                serials.add(int(digits, 16))
            except ValueError:
                raise ConfigError(f"{self.path}:{number}: {entry!r} is neither a node id (client-3, generator, ...) "
                                  "nor a hexadecimal certificate serial") from None
        return frozenset(node_ids), frozenset(serials)

    def _refresh(self) -> None:
        stamp = self._stat()
        if stamp == self._stamp:
            return
        with self._lock:
            if stamp == self._stamp:
                return
            self._stamp = stamp
            try:
                self._entries = self._parse()
                log.info("revocation list %s: %d node ids, %d serials", self.path, *map(len, self._entries))
            except (OSError, ValueError) as exc:
                log.error("revocation list %s unusable (%s); keeping the previous list", self.path, exc)

    def reason(self, peer: PeerIdentity) -> str | None:
        """Why this peer is refused, or None when it is not revoked."""
        self._refresh()
        node_ids, serials = self._entries
        if peer.serial in serials:
            return f"certificate serial 0x{peer.serial:x} of {peer.node_id} is revoked ({self.path})"
        if peer.node_id in node_ids:
            return f"node {peer.node_id} is revoked ({self.path})"
        return None


# A method name -> the client id its request claims (None when the message does not say; the servicer then refuses
# the malformed request itself). For streaming requests the function gets the first message.
ClaimedClientId = Callable[[Any], "int | None"]
# Request streams (uploads) one certificate may hold open at once: its one upload of the round (a second of the same
# round is refused by the servicer once its header arrives) and one more; each holds a server worker thread.
STREAMS_PER_IDENTITY = 2


class _Guarded:
    """The servicer, with every RPC method checked first: a certificate of ours, not revoked, and for the methods in
    `claims` a client certificate whose node id is the claimed client id. A response stream is checked again before
    each message, so revoking a node also ends the streams it already holds open."""

    def __init__(self, servicer: object, revoked: RevocationList | None, claims: Mapping[str, ClaimedClientId],
                 operator_only: frozenset[str] = frozenset()) -> None:
        self._servicer = servicer
        self._revoked = revoked
        self._claims = dict(claims)
        self._operator_only = operator_only
        self._open: collections.Counter[str] = collections.Counter()  # request streams open, by certificate node id
        self._open_lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._servicer, name)
        if not (name[:1].isupper() and callable(method)):
            return method
        claim = self._claims.get(name)

        def guarded(request: Any, context: grpc.ServicerContext) -> Any:
            peer = self._admit(name, context)
            if name in self._operator_only and peer.role != "operator":
                message = f"{name} is the operator's (the launcher's); the caller's certificate is {peer.node_id}'s"
                log.warning("%s refused: %s", name, message)
                context.abort(grpc.StatusCode.PERMISSION_DENIED, message)
            if isinstance(request, Message):
                if claim is not None:
                    self._check_claim(name, peer, claim(request), context)
                reply = method(request, context)
            else:  # a request stream (an upload): it holds a worker thread until it ends, so each identity has few
                with self._stream_slot(name, peer, context):
                    if claim is not None:
                        first = next(request, None)
                        self._check_claim(name, peer, None if first is None else claim(first), context)
                        request = itertools.chain([] if first is None else [first], request)
                    reply = method(request, context)
            return self._recheck(name, peer, reply, context) if isinstance(reply, Iterator) else reply

        return functools.wraps(method)(guarded)

    @contextlib.contextmanager
    def _stream_slot(self, method: str, peer: PeerIdentity, context: grpc.ServicerContext) -> Iterator[None]:
        """One of the STREAMS_PER_IDENTITY request streams this certificate may hold open at once, or RESOURCE_EXHAUSTED."""
        with self._open_lock:
            held = self._open[peer.node_id]
            if held < STREAMS_PER_IDENTITY:
                self._open[peer.node_id] = held + 1
        if held >= STREAMS_PER_IDENTITY:
            message = (f"{peer.node_id} holds {held} upload streams open already (at most {STREAMS_PER_IDENTITY} per "
                       f"certificate; {method})")
            log.warning("%s refused: %s", method, message)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        try:
            yield
        finally:
            with self._open_lock:
                self._open[peer.node_id] -= 1
                if not self._open[peer.node_id]:
                    del self._open[peer.node_id]

    def _recheck(self, method: str, peer: PeerIdentity, replies: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            for reply in replies:
                reason = self._revoked.reason(peer) if self._revoked is not None else None
                if reason is not None:
                    log.warning("%s stream ended: %s", method, reason)
                    context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
                yield reply
        finally:
            close = getattr(replies, "close", None)
            if close is not None:
                close()

    def _admit(self, method: str, context: grpc.ServicerContext) -> PeerIdentity:
        try:
            peer = peer_identity(context)
        except AuthenticationError as exc:
            log.warning("%s refused: %s", method, exc)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
            raise  # unreachable: abort raises
        reason = self._revoked.reason(peer) if self._revoked is not None else None
        if reason is not None:
            log.warning("%s refused: %s", method, reason)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
        return peer

    @staticmethod
    def _check_claim(method: str, peer: PeerIdentity, claimed: int | None, context: grpc.ServicerContext) -> None:
        if peer.role != "client":
            message = f"{method} is for clients; the caller's certificate is {peer.node_id}'s"
        elif claimed is not None and claimed != peer.client_id:
            message = f"the certificate of {peer.node_id} may not act as client {claimed} ({method})"
        else:
            return
        log.warning("%s refused: %s", method, message)
        context.abort(grpc.StatusCode.PERMISSION_DENIED, message)


@dataclass(frozen=True)
class ServerSecurity:
    """What a server process was told: mutual TLS (files, optional revocation list) or plaintext (files None)."""

    files: TLSFiles | None
    revoked: RevocationList | None = None

    def credentials(self) -> grpc.ServerCredentials | None:
        return None if self.files is None else server_credentials(self.files, require_client_auth=True)

    def guard(self, servicer: object, claims: Mapping[str, ClaimedClientId] | None = None,
              operator_only: frozenset[str] = frozenset()) -> Any:
        """The servicer itself in plaintext mode; with TLS, a view that checks each RPC's caller first (`operator_only`:
        methods only an operator certificate may call)."""
        return servicer if self.files is None else _Guarded(servicer, self.revoked, claims or {}, operator_only)

    def bind_host(self, explicit: str | None, configured: str | None = None) -> str:
        """With TLS: the --host flag, else the configured host. Plaintext binds 127.0.0.1 unless --host says otherwise."""
        if self.files is not None:
            return explicit or configured or LOOPBACK
        host = explicit or LOOPBACK
        if not is_loopback(host):
            log.warning("plaintext gRPC on %s (--insecure): anyone who reaches it can join and read the model; "
                        "use --tls-dir", host)
        return host

    @classmethod
    def from_args(cls, args: argparse.Namespace, node_id: str) -> ServerSecurity:
        files = tls_files_from_args(args, node_id)
        return cls(files, revocation_from_args(args, files))


def revocation_from_args(args: argparse.Namespace, files: TLSFiles | None) -> RevocationList | None:
    """The --revoked list; a ConfigError with --insecure, where no peer has a certificate to revoke."""
    if args.revoked is None:
        return None
    if files is None:
        raise ConfigError("--revoked needs mutual TLS (--tls-dir); with --insecure no peer has a certificate")
    return RevocationList(args.revoked)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def add_tls_arguments(parser: argparse.ArgumentParser, *, server: bool) -> None:
    group = parser.add_argument_group("transport security (one of --tls-dir, --tls-ca/--tls-cert/--tls-key, --insecure)")
    group.add_argument("--tls-dir", type=Path, help="folder made by `fedsynth deploy provision`: ca.pem and this node's "
                       "NODE.pem / NODE-key.pem (NODE: coordinator, generator, client-K)")
    group.add_argument("--tls-ca", type=Path, help="CA certificate (PEM) that signed every peer's certificate")
    group.add_argument("--tls-cert", type=Path, help="this node's certificate (PEM)")
    group.add_argument("--tls-key", type=Path, help="this node's private key (PEM)")
    group.add_argument("--insecure", action="store_true", help="plaintext, nobody authenticated: for one machine only"
                       + (" (binds 127.0.0.1 unless --host is given)" if server else ""))
    if server:
        group.add_argument("--revoked", type=Path, metavar="FILE", help="revoked node ids (client-3) or certificate "
                           "serials (hex), one a line; checked on every RPC, re-read when the file changes")
    else:
        group.add_argument("--revoked", type=Path, metavar="FILE", help="revoked node ids (coordinator, generator, "
                           "operator) or certificate serials (hex), one a line: the coordinator and generators this "
                           "client dials are refused when their certificate is listed (checked on every connection "
                           "and every task), and so are scrapers of its /metrics; re-read when the file changes")


def tls_files_from_args(args: argparse.Namespace, node_id: str) -> TLSFiles | None:
    """The files this node's flags name; None for an explicit --insecure. Neither, or both, is an error."""
    explicit = {"--tls-ca": args.tls_ca, "--tls-cert": args.tls_cert, "--tls-key": args.tls_key}
    chosen = args.tls_dir is not None or any(v is not None for v in explicit.values())
    if args.insecure:
        if chosen:
            raise ConfigError("--insecure contradicts --tls-dir/--tls-ca/--tls-cert/--tls-key: choose one")
        return None
    if not chosen:
        raise ConfigError("no transport security chosen: pass --tls-dir DIR (mutual TLS; make one with "
                          "`fedsynth deploy provision`) or --insecure (plaintext, for this machine only)")
    if args.tls_dir is not None:
        if any(v is not None for v in explicit.values()):
            raise ConfigError("give --tls-dir or --tls-ca/--tls-cert/--tls-key, not both")
        return TLSFiles.from_dir(args.tls_dir, node_id)
    missing = [flag for flag, value in explicit.items() if value is None]
    if missing:
        raise ConfigError(f"{', '.join(missing)} missing: --tls-ca, --tls-cert and --tls-key go together")
    return TLSFiles(args.tls_ca, args.tls_cert, args.tls_key)

