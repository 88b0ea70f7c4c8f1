"""Operator actions: drain, undrain and close from the admin socket.

:class:`AdminActions` holds the registry and is what the admin socket
(:mod:`extractedprism.ops.admin`) is handed. Each action is one call of the registry's
operator interface (:meth:`~extractedprism.upstreams.membership.Membership.set_admin`,
:meth:`~extractedprism.upstreams.table.Table.known_addresses`): the registry changes
the state under its lock, atomically with the checks it is asked for, runs the side
effects after releasing it and reports an
:class:`~extractedprism.upstreams.snapshot.AdminOutcome`; this module decides which checks
an action asks for and turns the outcome into the operator's (code, message). Called
from the admin socket's thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from extractedprism.upstreams.balance import ACTED

if TYPE_CHECKING:
    from extractedprism.upstreams.rebalancer import Rebalancer
    from extractedprism.upstreams.registry import Registry


def _unknown(addr: str) -> tuple[int, str]:
    return 2, f"unknown upstream {addr}"


class AdminActions:
    """The operator's drain, undrain and close of one upstream: (code, message)."""

    def __init__(self, registry: Registry, rebalancer: Rebalancer | None = None) -> None:
        self._registry = registry
        self._rebalancer = rebalancer  # None: --rebalance-interval 0

    def known_addresses(self) -> list[str]:
        return self._registry.known_addresses()

    def drain(self, addr: str, uid: int) -> tuple[int, str]:
        """No new connections to ``addr``; existing ones stay."""
        # An operator's close is not weakened to a drain: it has to be undrained first.
        out = self._registry.membership.set_admin(addr, "drain", uid, unless_closed=True)
        if out is None:
            return _unknown(addr)
        if not out.done:
            return 0, f"{addr} is already closed by an operator (undrain it first)"
        if out.before == "drain":
            return 0, f"{addr} was already drained"
        return 0, (f"drained {addr}: no new connections; its {out.connections} existing "
                   "connection(s) stay")

    def undrain(self, addr: str, uid: int) -> tuple[int, str]:
        """Back in service: it takes new connections whenever it is healthy."""
        out = self._registry.membership.set_admin(addr, "", uid)
        if out is None:
            return _unknown(addr)
        state = out.state
        if not out.before:
            return 0, f"{addr} was not drained"
        if state.draining:
            return 0, f"undrained {addr}; it stays draining: it was removed from the endpoints"
        if not state.healthy:
            return 0, (f"undrained {addr}; it is unhealthy and takes new connections once "
                       "its health checks pass")
        if self._registry.readyz and not state.ready:
            return 0, f"undrained {addr}; readyz says not ready: new connections prefer others"
        return 0, f"undrained {addr}: back in service"

    def close(self, addr: str, uid: int, *, force: bool = False) -> tuple[int, str]:
        """No new connections to ``addr``, and its connections closed spread over
        --drain-timeout; refused (code 1) when no other ready (readyz) / healthy (tcp)
        upstream would be left, unless ``force``."""
        out = self._registry.membership.set_admin(addr, "close", uid, unless_alone=not force)
        if out is None:
            return _unknown(addr)
        kind = "ready" if self._registry.readyz else "healthy"
        if not out.done:
            return 1, (f"refused: closing {addr} would leave no other {kind} upstream; "
                       "pass --force to close it anyway")
        left = "" if out.others else f"; no other {kind} upstream is left (--force)"
        over = max(0.0, self._registry.drain_timeout)
        return 0, (f"closing {addr}: no new connections; its {out.connections} connection(s) "
                   f"close spread over {over:g}s{left}")

    def rebalance(self, uid: int) -> tuple[int, str]:
        """One rebalance round now, by the same rules as the timed ones (at most one
        quiet connection closed); refused (code 1) when rebalancing is off."""
        if self._rebalancer is None:
            return 1, ("refused: rebalancing is off (--rebalance-interval 0); the activity "
                       "a round needs is only tracked while it is on")
        view = self._rebalancer.run_round(f"admin uid={uid}")
        if view.last_reason == ACTED:
            return 0, f"rebalanced: {view.last_detail}"
        why = view.last_reason + (f" ({view.last_detail})" if view.last_detail else "")
        return 0, f"no connection closed: {why}"
