"""Dialer: pick -> dial for one client connection, run by its pipe thread; hedged dials.

# design
A connection tries pickable upstreams one at a time, each at most once, until one
answers; each failed dial counts toward that upstream's streak (spec). With nothing
pickable it enters panic mode: every known upstream, most recently successful first,
within one dial timeout overall, uncounted.

Hedged dials (``--dial-hedge-delay``, beyond the spec; 0 turns them off): when a dial has
not completed within the hedge delay, a second one starts to another pickable upstream
and the first to connect carries the connection, so a black-holed API server (SYNs
unanswered) costs a client the hedge delay instead of the dial timeout. Never more than
two dials are in flight per client connection. A dial in flight past the hedge delay
marks its upstream stalled until something succeeds there (Picks.stall_dial): new
connections skip marked upstreams while another pickable one is left, and the hedge
avoids them too, then takes a static fallback (Picks.reserve_hedge; docs/lifecycle.md,
"When every address a node knows is gone"), so a fault that black-holes every
discovered server sends new connections to the live static endpoint once the dead ones
are marked. The losing dial is not abandoned: the reaper thread (``dial-reaper``) lets
it run on within its dial timeout and records its outcome like any dial (connected:
closed at once, a success; failed: toward the streak); a marked black hole then takes
few dials, and its failed checks exclude it.

Both dials of one connection are non-blocking connects the pipe thread waits on in one
``poll``; the reaper waits on every losing dial in one ``poll`` too, so hedging costs no
thread per dial.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import threading
import time

from extractedprism.datapath.offpath import Reaper
from extractedprism.datapath.relay import PYTHON, Relay
from extractedprism.datapath.sockopts import (
    addresses,
    begin_connect,
    describe_error,
    dial,
    native_connect,
    native_target,
    wait_connected,
)
from extractedprism.errors import FD_ERRNOS
from extractedprism.logs import connlog
from extractedprism.upstreams.registry import Registry
from extractedprism.upstreams.reservation import Reservation

log = logging.getLogger(__name__)

# Failures that repeat once per client during an outage: first line, then summaries.
_dial_failed = connlog.RateLimited(log, logging.INFO, "dial failed")
_POLLOUT = select.POLLOUT | select.POLLERR | select.POLLHUP


class Dial:
    """One dial in flight: its reservation, its socket, the addresses still to try.
    Parked on the reaper (offpath.Parked) when it loses a hedge."""

    __slots__ = ("addrs", "deadline", "dialer", "res", "sock", "timeout")
    events = _POLLOUT

    def __init__(self, dialer: Dialer, res: Reservation, deadline: float,
                 timeout: float) -> None:
        self.dialer = dialer
        self.res = res
        self.deadline = deadline
        self.timeout = timeout
        self.sock: socket.socket | None = None
        self.addrs: list[tuple[int, tuple]] = []  # type: ignore[type-arg]

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def drop(self) -> None:
        self.close()
        self.res.release()

    def elapsed(self) -> float:
        return time.monotonic() - (self.deadline - self.timeout)

    def finish(self, ready: bool) -> None:
        # Connected: closed at once, and a success like any dial; failed: toward the
        # streak. (A losing hostname dial tries no further addresses.)
        exc: OSError | None = TimeoutError(errno.ETIMEDOUT, "timed out")
        if ready:
            err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) if self.sock else 0
            exc = OSError(err, os.strerror(err)) if err else None
        self.drop()
        self.dialer.record(self.res.address, exc, panic=self.res.panic,
                           duration=self.elapsed())


class Dialer:
    """Connects a client connection to an upstream (see the module docstring)."""

    def __init__(self, registry: Registry, *, dial_timeout: float, hedge_delay: float,
                 stopping: threading.Event, relay: Relay = PYTHON) -> None:
        self._registry = registry
        self._native = relay.native  # the native relay's GIL-holding connect
        self._timeout = dial_timeout
        # A hedge that could only start after the dial gave up would never run.
        self._hedge = hedge_delay if 0 < hedge_delay < dial_timeout else 0.0
        self._stopping = stopping
        self._reaper = Reaper("dial-reaper")

    def shutdown(self, deadline: float) -> bool:
        """Stop the reaper (its losing dials are closed, not counted) and wait for it
        until ``deadline`` (``time.monotonic()``, the shutdown's one deadline)."""
        return self._reaper.stop(deadline)

    # -- outcomes (the one place a dial's result is recorded) --------------------------

    def record(self, addr: str, exc: OSError | None, *, panic: bool = False,
               carries: Reservation | None = None, duration: float | None = None) -> None:
        """``carries``: the reservation of the dial that carries the connection; its
        success is recorded by Connections.attach, in the same lock round trip."""
        if exc is None:
            if carries is not None:
                carries.dial_seconds = duration
            else:
                self._registry.verdicts.record_dial(addr, True, duration=duration)
            return
        reason = describe_error(exc)
        if exc.errno in FD_ERRNOS:
            # Out of descriptors here is not the upstream's fault: no streak, no count.
            log.warning("dial failed locally upstream=%s reason=%r", addr, reason)
            return
        # The spec counts no errors "when no upstream was available": panic-mode
        # attempts are exactly that case, and shutdown failures are not counted.
        self._registry.verdicts.record_dial(addr, False, reason,
                                   count_error=not (self._stopping.is_set() or panic),
                                   duration=duration)
        _dial_failed(addr, upstream=addr, reason=reason)

    def failed(self, addr: str, reason: str) -> None:
        """A dial that connected but failed a later check (a silent upstream)."""
        self._registry.verdicts.record_dial(addr, False, reason,
                                            count_error=not self._stopping.is_set())
        _dial_failed(addr, upstream=addr, reason=reason)

    # -- the pipe thread ------------------------------------------------------------------

    def connect(self, tried: set[str], take_first_from: int = -1
                ) -> tuple[socket.socket | None, Reservation | None]:
        """Pick and dial until one upstream answers; ``tried`` collects every upstream
        tried. The reservation returned with the socket is still held: the caller
        attaches or releases it. (None, None): nothing answered, panic mode included.
        ``take_first_from``: the client's fd, whose first bytes a first dial that connects
        at once sends on itself (Reservation.first)."""
        dials: list[Dial] = []
        if self._native:
            won = self._fast(tried, dials, take_first_from)
            if won is not None:
                return won
        if not self._hedge:
            assert not dials
            return self._connect_serial(tried)
        try:
            return self._connect_hedged(tried, dials)
        finally:
            for d in dials:  # an exception: nothing left counted or open
                d.close()
                d.res.release()

    def _fast(self, tried: set[str], dials: list[Dial], take_first_from: int
              ) -> tuple[socket.socket, Reservation] | None:
        """The common case in the least Python, since it is on every new connection's
        way to its upstream: a numeric endpoint whose connect completes at once
        (loopback, a near host), one extension call. Else None: a connect in progress
        is left in ``dials`` (hedging on) or finished here (hedging off), a failure is
        recorded, and the general path goes on from there."""
        res = self._registry.picks.reserve(exclude=tried)
        if res is None:
            return None  # the general path finds nothing either: panic mode
        try:
            target = native_target(res.endpoint)
            if target is None:
                res.release()  # a hostname: the general path resolves it
                return None
            tried.add(res.address)
            started = time.monotonic()
            fd, err, first, sent = native_connect(target, take_first_from)
            if err == 0:
                res.dial_seconds = time.monotonic() - started
                res.first, res.sent = first, sent
                return socket.socket(target[0], socket.SOCK_STREAM, 0, fd), res
            if fd < 0:  # refused at once, say: counted, and the general path tries the next
                self.record(res.address, OSError(err, os.strerror(err)),
                            duration=time.monotonic() - started)
                res.release()
                return None
            sock = socket.socket(target[0], socket.SOCK_STREAM, 0, fd)
            if self._hedge:
                d = Dial(self, res, started + self._timeout, self._timeout)
                d.sock = sock
                dials.append(d)
                return None
            try:  # hedging off: wait for it here, within the dial timeout
                wait_connected(sock, started + self._timeout - time.monotonic())
            except OSError as exc:
                sock.close()
                self.record(res.address, exc, duration=time.monotonic() - started)
                res.release()
                return None
            except BaseException:
                sock.close()
                res.release()
                raise
            self.record(res.address, None, carries=res, duration=time.monotonic() - started)
            return sock, res
        except BaseException:
            res.release()  # whatever raised, at whichever step: no reservation leaks
            raise

    # -- the first answer's hedge (first_answer.py): one more dial, never panic mode ----

    def start(self, tried: set[str], poller: select.poll) -> tuple[Dial, bool] | None:
        """Reserve a pickable upstream not in ``tried`` and start a non-blocking dial to
        it: (dial, True) connected at once (its success recorded at attach), (dial,
        False) in progress (registered in ``poller`` for POLLOUT; see progress()).
        Failures at once are recorded and the next upstream is tried; None when nothing
        pickable is left (no panic mode: the caller has an upstream already)."""
        while True:
            res = self._registry.picks.reserve(exclude=tried)
            if res is None:
                return None
            tried.add(res.address)
            d = Dial(self, res, time.monotonic() + self._timeout, self._timeout)
            try:
                if self._begin(d, poller):
                    self.record(res.address, None, carries=res, duration=d.elapsed())
                    return d, True
                if d.sock is not None:
                    return d, False
            except BaseException:
                d.drop()
                raise
            res.release()  # failed at once (refused, say): counted in _begin

    def progress(self, d: Dial, poller: select.poll, ready: bool) -> bool | None:
        """A dial from start(): ``ready`` (poll said so) or its deadline may have passed.
        True connected (unregistered; its success recorded at attach), False failed
        (recorded, released), None still in progress."""
        assert d.sock is not None
        if ready:
            err = d.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if not err:
                poller.unregister(d.sock.fileno())
                self.record(d.res.address, None, carries=d.res, duration=d.elapsed())
                return True
            self._failed_address(d, poller, OSError(err, os.strerror(err)))
        elif time.monotonic() >= d.deadline:
            self._give_up(d, poller, TimeoutError(errno.ETIMEDOUT, "timed out"))
        else:
            return None
        if d.sock is None:
            d.res.release()
            return False
        return None

    def cancel_rivals(self, res: Reservation) -> None:
        """Drop the dials ``res`` won against that are still in flight (uncounted): the
        client is about to start another attempt, and never has more than two out."""
        for rival in res.rivals:
            self._reaper.cancel(rival)  # type: ignore[arg-type]
        res.rivals = ()

    def abandon(self, d: Dial, poller: select.poll) -> None:
        """A dial from start() no longer needed: it runs on off the client's path (the
        reaper records its outcome)."""
        assert d.sock is not None
        poller.unregister(d.sock.fileno())
        self._reaper.adopt(d)

    def _connect_serial(self, tried: set[str]
                        ) -> tuple[socket.socket | None, Reservation | None]:
        while True:
            res = self._registry.picks.reserve(exclude=tried)
            if res is None:
                return self._panic_dial(tried)
            tried.add(res.address)
            sock = None
            try:
                sock = self._dial_blocking(res, self._timeout)
            finally:
                if sock is None:
                    res.release()
            if sock is not None:
                return sock, res

    def _dial_blocking(self, res: Reservation, timeout: float, *, panic: bool = False
                       ) -> socket.socket | None:
        started = time.monotonic()
        try:
            sock = dial(res.endpoint, timeout, self._native)
        except OSError as exc:
            self.record(res.address, exc, panic=panic, duration=time.monotonic() - started)
            return None
        self.record(res.address, None, carries=res, duration=time.monotonic() - started)
        return sock

    def _connect_hedged(self, tried: set[str], dials: list[Dial]
                        ) -> tuple[socket.socket | None, Reservation | None]:
        hedge_at: float | None = None  # when the second dial may start
        poller = select.poll()
        for d in dials:  # one left in progress by _fast: it may get a hedge
            assert d.sock is not None
            poller.register(d.sock.fileno(), _POLLOUT)
            hedge_at = d.deadline - self._timeout + self._hedge
        while True:
            now = time.monotonic()
            if not dials or (hedge_at is not None and now >= hedge_at and len(dials) < 2):
                if dials:
                    # A hedge: it avoids upstreams with stalled dials, or falls back to a
                    # static fallback (Picks.reserve_hedge).
                    self._stalls(dials, now)
                    res = self._registry.picks.reserve_hedge(exclude=tried)
                else:
                    res = self._registry.picks.reserve(exclude=tried)
                if res is None:
                    if not dials:
                        return self._panic_dial(tried)
                    hedge_at = None  # nothing to hedge to: wait for the dial in flight
                    continue
                tried.add(res.address)
                d = Dial(self, res, now + self._timeout, self._timeout)
                try:
                    won = self._begin(d, poller)
                except BaseException:
                    d.drop()  # not in ``dials`` yet: connect()'s cleanup cannot see it
                    raise
                if won:
                    return self._won(d, dials, poller)
                if d.sock is not None:
                    dials.append(d)
                else:
                    res.release()  # failed at once (refused, say): counted in _begin
                # A dial running alone past the delay gets a hedge (again, after a
                # failure of the other one: still at most two in flight).
                hedge_at = dials[0].deadline - self._timeout + self._hedge \
                    if len(dials) == 1 else None
                continue
            wake = min(d.deadline for d in dials)
            if hedge_at is not None:
                wake = min(wake, hedge_at)
            for d in dials:  # and when a dial in flight stalls (the hedge's as well)
                if not d.res.stalled:
                    wake = min(wake, d.deadline - self._timeout + self._hedge)
            events = poller.poll(max(0, (wake - now) * 1000 + 1))
            ready = {fd for fd, _ in events}
            now = time.monotonic()
            self._stalls(dials, now)
            for d in list(dials):
                assert d.sock is not None
                if d.sock.fileno() in ready:
                    err = d.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if not err:
                        dials.remove(d)
                        return self._won(d, dials, poller)
                    self._failed_address(d, poller, OSError(err, os.strerror(err)))
                elif now >= d.deadline:
                    self._give_up(d, poller, TimeoutError(errno.ETIMEDOUT, "timed out"))
                if d.sock is None:
                    dials.remove(d)
                    d.res.release()
                    if len(dials) == 1:
                        hedge_at = now  # the other one is slow already: hedge at once

    def _stalls(self, dials: list[Dial], now: float) -> None:
        """Mark every dial in flight for the hedge delay or longer as stalled: its
        upstream counts it until the dial ends, and hedges avoid it meanwhile (a black
        hole's dials all stall, a live upstream's connect in a millisecond)."""
        for d in dials:
            if not d.res.stalled and now - (d.deadline - self._timeout) >= self._hedge:
                self._registry.picks.stall_dial(d.res)

    def _begin(self, d: Dial, poller: select.poll) -> bool:
        """Start connecting ``d`` (resolving a hostname first); True if it connected at
        once. On a failure of every address, d.sock stays None and the failure is
        recorded."""
        try:
            d.addrs = addresses(d.res.endpoint)
        except OSError as exc:
            self.record(d.res.address, exc, panic=d.res.panic, duration=d.elapsed())
            return False
        return self._next_address(d, poller, None)

    def _next_address(self, d: Dial, poller: select.poll, last: OSError | None) -> bool:
        while d.addrs:
            family, sockaddr = d.addrs.pop(0)
            try:
                sock, err = begin_connect(family, sockaddr, self._native)
            except OSError as exc:
                last = exc
                continue
            if sock is None:
                last = OSError(err, os.strerror(err))
                continue
            if err == 0:
                d.sock = sock
                return True
            if err in (errno.EINPROGRESS, errno.EAGAIN):
                d.sock = sock
                poller.register(sock.fileno(), _POLLOUT)
                return False
            sock.close()
            last = OSError(err, os.strerror(err))
        self.record(d.res.address, last or OSError(f"no address for {d.res.endpoint}"),
                    panic=d.res.panic, duration=d.elapsed())
        return False

    def _failed_address(self, d: Dial, poller: select.poll, exc: OSError) -> None:
        """This address refused or failed: the next one of the same upstream, if any."""
        assert d.sock is not None
        poller.unregister(d.sock.fileno())
        d.close()
        if self._next_address(d, poller, exc):
            # Connected at once on the next address: let the poll report it.
            assert d.sock is not None
            poller.register(d.sock.fileno(), _POLLOUT)

    def _give_up(self, d: Dial, poller: select.poll, exc: OSError) -> None:
        assert d.sock is not None
        poller.unregister(d.sock.fileno())
        d.close()
        self.record(d.res.address, exc, panic=d.res.panic, duration=d.elapsed())

    def _won(self, d: Dial, losers: list[Dial], poller: select.poll
             ) -> tuple[socket.socket, Reservation]:
        assert d.sock is not None
        self.record(d.res.address, None, carries=d.res, duration=d.elapsed())
        for other in losers:
            assert other.sock is not None
            poller.unregister(other.sock.fileno())
            self._reaper.adopt(other)
        d.res.rivals = tuple(losers)
        losers.clear()
        return d.sock, d.res

    def _panic_dial(self, tried: set[str]) -> tuple[socket.socket | None, Reservation | None]:
        """Nothing pickable: try every known upstream within one dial timeout overall."""
        deadline = time.monotonic() + self._timeout
        for ep in self._registry.picks.panic_order(exclude=tried):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._stopping.is_set():
                break
            res = self._registry.picks.reserve_endpoint(ep)
            if res is None:
                continue  # removed meanwhile
            tried.add(res.address)
            sock = None
            try:
                sock = self._dial_blocking(res, remaining, panic=True)
            finally:
                if sock is None:
                    res.release()
            if sock is not None:
                return sock, res
        return None, None
