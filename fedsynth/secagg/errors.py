"""The one error every secure-aggregation refusal raises."""

from __future__ import annotations

from fedsynth.errors import WireError


class SecAggError(WireError):
    """A secure-aggregation input was refused; the message names the bad value (client id, count, field)."""
