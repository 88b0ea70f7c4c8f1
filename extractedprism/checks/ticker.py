"""Ticker: the health-check schedule and the registry's deadlines, on the ``ticker`` thread.

Each known, non-draining upstream is probed every --health-interval; a new upstream is
probed at once. After a check that leaves an upstream one failure short of exclusion (the
registry says so), the confirming check starts --health-recheck after the failed one
started instead (HAProxy's ``fastinter``; the default, equal to the interval, is the
spec's timing), or as soon as the failed one ends if that took longer. A stall
(``--stall-timeout``; the registry decides, at most once per upstream per stall timeout)
makes the upstream's next check run now, tagged so the registry counts its result as a
stall check (:meth:`stall_check`); otherwise it is an ordinary check. Probes run on
their own short-lived ``probe-<upstream>`` threads, so a
slow or silent upstream delays nobody else's check by more than its own timeout, and
the ticker itself never blocks on a socket. Drain and readiness deadlines are expired
by :meth:`Membership.tick`, so the ticker wakes at whichever comes first: the next due
probe, the next deadline, an explicit :meth:`wake`, or the liveness interval (so the
heartbeat can see that this loop still turns).

The schedule is spread so that the nodes of a DaemonSet, started together or aligned by
one event (an API server coming back makes every node check it at once), do not probe
in step: an upstream's first check runs at once (the spec's readiness gate), the second
one a random phase of up to one interval later, and every later round is shortened by a
random fraction of up to ``jitter`` (5 %) of the interval, so the gaps stay within the
configured interval and drift apart from node to node. The confirming check after a
failure (--health-recheck) and a check asked for now are not jittered.

With readyz, the ticker owns the probes' kept-alive connections
(:class:`~extractedprism.checks.probes.ProbeConnections`): those of upstreams it no
longer checks are closed each turn, all of them when the loop stops.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

from extractedprism.checks.probes import ProbeConnections, Prober, ReadyzSettings, probe
from extractedprism.config.endpoints import Endpoint
from extractedprism.threads import join_until
from extractedprism.upstreams.effects import Change
from extractedprism.upstreams.registry import Registry

log = logging.getLogger(__name__)


# The share of the interval by which each round is shortened at most (see above).
JITTER = 0.05


def next_gap(interval: float, rng: random.Random, *, first: bool,
             jitter: float = JITTER) -> float:
    """Seconds from one check of an upstream to its next: a random phase in
    [0, interval) after its first check, interval shortened by up to ``jitter`` of it,
    in (interval * (1 - jitter), interval], after every other."""
    if first:
        return interval * rng.random()
    return interval * (1.0 - jitter * rng.random())


class Ticker:
    def __init__(self, registry: Registry, *, interval: float, timeout: float,
                 readyz: ReadyzSettings | None, stop: threading.Event,
                 recheck: float | None = None,
                 max_wait: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 prober: Prober = probe, connections: ProbeConnections | None = None,
                 rng: random.Random | None = None, jitter: float = JITTER) -> None:
        self._registry = registry
        self._interval = interval
        self._recheck = interval if recheck is None else min(recheck, interval)
        self._timeout = timeout
        self._readyz = readyz
        self._stop = stop
        self._max_wait = max_wait
        self._clock = clock
        self._prober = prober
        self._connections = connections
        self._rng = rng or random.Random()
        self._jitter = jitter
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._next: dict[str, float] = {}
        self._phased: set[str] = set()  # upstreams past their first check (guarded by _lock)
        self._in_flight: dict[str, threading.Thread] = {}
        self._stall_due: set[str] = set()  # the next check of these is a stall check
        self._thread: threading.Thread | None = None
        self.last_loop = clock()

    def start(self) -> None:
        self._thread = threading.Thread(name="ticker", target=self._loop, daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wake(self) -> None:
        self._wake.set()

    def registry_changed(self, change: Change) -> None:
        """The registry's change listener: new upstreams, a health flip, a probe due now
        or a failed dial to confirm after --health-recheck."""
        if change.what == "probe-now":
            self.probe_now(change.address)
        elif change.what == "stall-check":
            self.stall_check(change.address)
        elif change.what == "recheck":
            self._recheck_soon(change.address)
        else:
            self.wake()

    def probe_now(self, address: str) -> None:
        """Schedule an immediate probe of ``address`` (readiness reset after a dial)."""
        with self._lock:
            self._next[address] = 0.0
        self._wake.set()

    def stall_check(self, address: str) -> None:
        """A stall made ``address`` suspect: its next check starts now (after the one in
        flight, if any, ends: that one started before the stall was seen)."""
        with self._lock:
            self._next[address] = 0.0
            self._stall_due.add(address)
        self._wake.set()

    def _recheck_soon(self, address: str) -> None:
        """A failed dial left ``address`` one failure short of exclusion: its next check
        comes --health-recheck from now, unless one is due sooner (with the default
        recheck, equal to the interval, the scheduled one always is)."""
        with self._lock:
            if address in self._next:
                self._next[address] = min(self._next[address], self._clock() + self._recheck)
        self._wake.set()

    def join(self, timeout: float) -> bool:
        self._wake.set()
        deadline = time.monotonic() + timeout
        if self._thread is not None:
            self._thread.join(timeout)
        with self._lock:
            probes = list(self._in_flight.values())
        # A probe can sit in getaddrinfo far beyond any timeout of ours.
        return join_until([self._thread, *probes], deadline)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.last_loop = now = self._clock()
            next_deadline = self._registry.membership.tick()
            next_probe = self._schedule(now)
            wake_at = min(x for x in (next_deadline, next_probe, now + self._max_wait)
                          if x is not None)
            self._wake.wait(max(0.0, wake_at - self._clock()))
            self._wake.clear()
        if self._connections is not None:
            self._connections.close()
        log.debug("ticker stopped")

    def _schedule(self, now: float) -> float | None:
        targets = {str(ep): ep for ep in self._registry.probe_targets()}
        if self._connections is not None:
            self._connections.retain(targets)
        due: list[Endpoint] = []
        with self._lock:
            for addr in list(self._next):
                if addr not in targets:
                    del self._next[addr]
            self._phased &= targets.keys()
            for addr, ep in targets.items():
                at = self._next.setdefault(addr, now)
                if at <= now and addr not in self._in_flight:
                    due.append(ep)
                    self._next[addr] = now + self._gap(addr)
            for ep in due:
                stall = str(ep) in self._stall_due
                self._stall_due.discard(str(ep))
                t = threading.Thread(name=f"probe-{ep}", target=self._probe_one,
                                     args=(ep, now, stall), daemon=True)
                self._in_flight[str(ep)] = t
            self._stall_due &= self._next.keys()  # gone from the targets: nothing to tag
            pending = [at for a, at in self._next.items() if a not in self._in_flight]
        for ep in due:
            self._in_flight[str(ep)].start()
        return min(pending) if pending else None

    def _gap(self, addr: str) -> float:
        first = addr not in self._phased
        self._phased.add(addr)
        return next_gap(self._interval, self._rng, first=first, jitter=self._jitter)

    def _probe_one(self, ep: Endpoint, started: float, stall: bool = False) -> None:
        addr = str(ep)
        confirm = False
        try:
            result = self._prober(ep, self._timeout, self._readyz)
            if not self._stop.is_set():
                confirm = self._registry.verdicts.record_probe(addr, result, stall=stall)
        except Exception:
            log.exception("probe crashed upstream=%s", addr)
        finally:
            with self._lock:
                self._in_flight.pop(addr, None)
                if confirm and addr in self._next:
                    # min(): a probe_now() meanwhile stays sooner.
                    self._next[addr] = min(self._next[addr], started + self._recheck)
            self._wake.set()
