"""The proxy's timing flags in the local chaos run and every bound computed from them."""

from __future__ import annotations

from typing import Protocol

SERVER_NAME = "kubernetes.default.svc"
# The proxy's timing flags; every bound below is computed from these.
INTERVAL = 2.0  # --health-interval
TIMEOUT = 1.0  # --health-timeout, also the proxy's dial timeout
DRAIN = 2.0  # --drain-timeout
# Allowance for scheduling on a loaded machine and for the 1 ms resolution of the
# proxy's log timestamps; added once to every time bound and printed with it.
SLACK = 0.5
CLIENT_TIMEOUT = 10.0  # per client operation, like client-go's TLS handshake timeout
WATCH_STALL = 60.0  # a watch that got nothing for this long is given up by its client
POLL = 0.2  # /upstreams sampling period
MAX_ATTEMPTS_PER_CLIENT = 100_000  # hard cap on any client loop, on top of the deadline



TOTAL = "extractedprism_connections_total"
EXCLUDE_BOUND = 2 * INTERVAL + TIMEOUT  # two failed checks, the second one timing out
UNREADY_CLOSE = DRAIN + INTERVAL  # connections of an unready upstream closed by then


class Checks(Protocol):
    """An event's outcome, local (harness.Outcome) or real (real.Outcome)."""

    def check(self, ok: bool, text: str) -> None: ...


def fmt(t: float | None) -> str:
    return "never" if t is None else f"+{t:.2f} s"


def check_excluded(out: Checks, tag: str, took: float | None, slack: float) -> None:
    """``took`` (seconds from the fault to the exclusion, None: never) is within
    EXCLUDE_BOUND plus ``slack``: the same criterion on both control planes."""
    out.check(took is not None and took <= EXCLUDE_BOUND + slack,
              f"{tag}: excluded within two intervals plus one timeout "
              f"({fmt(took)} <= {EXCLUDE_BOUND:g} s + {slack:g} s slack)")
