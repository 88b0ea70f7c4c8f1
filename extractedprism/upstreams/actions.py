"""Operator actions on the registry: drain, undrain and close from the admin socket.

A mixin of :class:`~extractedprism.upstreams.registry.Registry`, apart only to keep each module
short: these methods run under the registry's one lock on its records like every other
registry method, change state through :mod:`extractedprism.upstream`'s pure
functions, and collect their side effects in an :class:`~extractedprism.upstreams.effects.Effects`
that runs after the lock is released. Called from the admin socket's threads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from extractedprism.upstreams import state as sm
from extractedprism.upstreams.effects import Change, Effects
from extractedprism.upstreams.snapshot import AdminMark

if TYPE_CHECKING:
    from extractedprism.upstreams.records import Record


def _unknown(addr: str) -> tuple[int, str]:
    return 2, f"unknown upstream {addr}"


def spread(ids: list[int], now: float, over: float) -> list[tuple[float, int]]:
    """When to close each connection: evenly over ``over`` seconds, the last one at the
    end, oldest first; all at once when ``over`` is 0."""
    if over <= 0:
        return [(now, i) for i in ids]
    step = over / max(1, len(ids))
    return [(now + step * (n + 1), i) for n, i in enumerate(ids)]


class AdminActions:
    # Provided by Registry.
    lock: threading.RLock
    _ups: dict[str, Record]
    _clock: Callable[[], float]
    _drain_timeout: float
    _readyz: bool
    _run: Callable[[Effects], None]
    _update_readiness_deadlines_locked: Callable[[float, Effects], None]
    _update_panic_locked: Callable[[Effects], None]
    _update_words_locked: Callable[[float], None]

    def known_addresses(self) -> list[str]:
        with self.lock:
            return list(self._ups)

    def _admin_locked(self, addr: str, action: str, uid: int, now: float) -> Record | None:
        rec = self._ups.get(addr)
        if rec is None:
            return None
        rec.state = sm.admin_set(rec.state, action)
        rec.admin_mark = AdminMark(action, uid, now) if action else None
        if action != "close":
            rec.close_plan = []
        return rec

    def _admin_settle_locked(self, now: float, fx: Effects, addr: str) -> None:
        # The set of pickable (and ready) upstreams changed: readiness closes elsewhere
        # may start or be called off, panic may begin or end.
        self._update_readiness_deadlines_locked(now, fx)
        self._update_panic_locked(fx)
        self._update_words_locked(now)
        fx.changes.append(Change("health", addr))  # wakes the ticker for new deadlines

    def admin_drain(self, addr: str, uid: int) -> tuple[int, str]:
        """No new connections to ``addr``; existing ones stay. (code, message)."""
        fx = Effects()
        with self.lock:
            now = self._clock()
            rec = self._ups.get(addr)
            if rec is None:
                return _unknown(addr)
            if rec.state.admin == "close":
                return 0, f"{addr} is already closed by an operator (undrain it first)"
            already = rec.state.admin == "drain"
            self._admin_locked(addr, "drain", uid, now)
            self._admin_settle_locked(now, fx, addr)
            conns = len(rec.conns)
        self._run(fx)
        if already:
            return 0, f"{addr} was already drained"
        return 0, (f"drained {addr}: no new connections; its {conns} existing connection(s) "
                   "stay")

    def admin_undrain(self, addr: str, uid: int) -> tuple[int, str]:
        """Back in service: it takes new connections whenever it is healthy."""
        fx = Effects()
        with self.lock:
            now = self._clock()
            was = self._ups[addr].state.admin if addr in self._ups else ""
            rec = self._admin_locked(addr, "", uid, now)
            if rec is None:
                return _unknown(addr)
            self._admin_settle_locked(now, fx, addr)
            state = rec.state
        self._run(fx)
        if not was:
            return 0, f"{addr} was not drained"
        if state.draining:
            return 0, f"undrained {addr}; it stays draining: it was removed from the endpoints"
        if not state.healthy:
            return 0, (f"undrained {addr}; it is unhealthy and takes new connections once "
                       "its health checks pass")
        if self._readyz and not state.ready:
            return 0, f"undrained {addr}; readyz says not ready: new connections prefer others"
        return 0, f"undrained {addr}: back in service"

    def admin_close(self, addr: str, uid: int, *, force: bool = False) -> tuple[int, str]:
        """No new connections to ``addr``, and its connections closed spread over
        --drain-timeout; refused (code 1) when no other ready (readyz) / healthy (tcp)
        upstream would be left, unless ``force``."""
        fx = Effects()
        with self.lock:
            if addr not in self._ups:
                return _unknown(addr)
            others = [a for a, r in self._ups.items() if a != addr and r.state.pickable
                      and (r.state.ready or not self._readyz)]
            kind = "ready" if self._readyz else "healthy"
            if not others and not force:
                return 1, (f"refused: closing {addr} would leave no other {kind} upstream; "
                           "pass --force to close it anyway")
            now = self._clock()
            rec = self._ups[addr]
            self._admin_locked(addr, "close", uid, now)
            ids = list(rec.conns)  # attach order: oldest first
            rec.close_plan = spread(ids, now, self._drain_timeout)
            if rec.close_plan:
                fx.log(logging.INFO, "closing connections upstream=%s connections=%d "
                       "reason=%r over=%gs", addr, len(ids), "admin close",
                       max(0.0, self._drain_timeout))
            self._run_close_plan_locked(addr, rec, now, fx)
            self._admin_settle_locked(now, fx, addr)
        self._run(fx)
        left = "" if others else f"; no other {kind} upstream is left (--force)"
        return 0, (f"closing {addr}: no new connections; its {len(ids)} connection(s) close "
                   f"spread over {max(0.0, self._drain_timeout):g}s{left}")

    @staticmethod
    def _run_close_plan_locked(addr: str, rec: Record, now: float, fx: Effects) -> None:
        while rec.close_plan and rec.close_plan[0][0] <= now:
            _, conn_id = rec.close_plan.pop(0)
            conn = rec.conns.get(conn_id)
            if conn is not None:  # it may have ended by itself meanwhile
                fx.close.append(conn)

