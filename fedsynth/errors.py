"""The small exception hierarchy that commands and servicers map to exit codes and gRPC status codes."""


class FedsynthError(Exception):
    """Base class of every error fedsynth raises on purpose."""


class ConfigError(FedsynthError, ValueError):
    """A configuration value or command-line argument is invalid; the message names it."""


class DataError(FedsynthError, ValueError):
    """A dataset, data folder or label-count input is missing or malformed."""


class WireError(FedsynthError, ValueError):
    """Bytes received from a peer are malformed (bad checksum, shape, dtype, order, or values)."""


class StateError(FedsynthError):
    """A well-formed request that does not fit the current state (a closed round, a stale session)."""


# Register's refusal (FAILED_PRECONDITION) when another node was heard from under the claimed client id within
# runtime.heartbeat_timeout_s: a client node that finds it in the message waits that long for the old session to time
# out (it may be this node's own previous process, killed) before it takes the refusal as final.
ID_CLAIMED = "two nodes claim client id"


class QuorumError(FedsynthError):
    """Too few clients answered or stayed reachable for a round to close."""


class StopRequested(FedsynthError):
    """A stop (SIGTERM, SIGINT) arrived while work was under way; the work was dropped, nothing half-done was sent."""
