"""A client's check of the servers it dials: the certificate a coordinator or generator presents, against its revocation list."""

from __future__ import annotations

import socket

from fedsynth.errors import FedsynthError
from fedsynth.wire.tls import AuthenticationError, PeerIdentity, RevocationList, TLSFiles, identity_of_der, ssl_client_context


class RevokedServer(AuthenticationError):
    """A server this node dials presents a certificate its revocation list names."""


class ServerUnreachable(FedsynthError):
    """The handshake that reads a server's certificate failed (refused, reset, timed out): retry as for a lost link."""


def endpoints(target: str) -> list[tuple[str, int, str]]:
    """(host, port, the name its certificate must carry) for HOST:PORT, [V6]:PORT, or every address of dns:///NAME:PORT."""
    name, _, port = target.removeprefix("dns:///").rpartition(":")
    name = name.strip("[]")
    if not target.startswith("dns:///"):
        return [(name, int(port), name)]
    resolved = socket.getaddrinfo(name, int(port), type=socket.SOCK_STREAM)
    return [(str(address[4][0]), int(port), name) for address in dict.fromkeys(resolved)]


def presented_identity(host: str, port: int, server_name: str, files: TLSFiles, *, timeout_s: float) -> PeerIdentity:
    """The node identity in the certificate the server presents to this node, in a TLS handshake as gRPC's (this
    node's pair, the provisioned CA, the server's name checked, ALPN h2). OSError when it cannot be reached."""
    context = ssl_client_context(files)
    context.set_alpn_protocols(["h2"])
    with socket.create_connection((host, port), timeout=timeout_s) as raw:
        with context.wrap_socket(raw, server_hostname=server_name) as conn:
            return identity_of_der(conn.getpeercert(binary_form=True))


def check_servers(target: str, files: TLSFiles, revoked: RevocationList, *, what: str, timeout_s: float) -> list[PeerIdentity]:
    """The identities of every server behind `target` (each address of a dns:/// name), none of them revoked;
    RevokedServer naming the first that is; ServerUnreachable when one cannot be reached."""
    identities = []
    try:
        addresses = endpoints(target)
    except OSError as exc:
        raise ServerUnreachable(f"cannot resolve the {what} at {target}: {exc}") from exc
    for host, port, name in addresses:
        try:
            identity = presented_identity(host, port, name, files, timeout_s=timeout_s)
        except OSError as exc:  # ssl.SSLError included: a handshake gRPC's own would fail as well
            raise ServerUnreachable(f"cannot read the certificate of the {what} at {host}:{port}: {exc}") from exc
        refused(identity, revoked, what=f"{what} at {host}:{port}")
        identities.append(identity)
    return identities


def refused(identity: PeerIdentity, revoked: RevocationList, *, what: str) -> None:
    """RevokedServer when the revocation list (re-read if the file changed) names this server's certificate."""
    reason = revoked.reason(identity)
    if reason is not None:
        raise RevokedServer(f"refusing the {what}: {reason}")
