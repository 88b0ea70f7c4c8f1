"""Issue 37: a stateful property test of the registry (hypothesis' rule-based state
machine). Random sequences of endpoint changes, server behaviours the scheduled checks
see (pass, refused, black hole, unready, slow), client dials (connected, refused, stalled
past the hedge delay, completing late), stalls starting and ending, operator marks,
connections attached and detached, sampling, rebalance rounds and deadline ticks, under
each selection mode, with readyz on and off and the overload guard on and off.

After every step:

* no pick (first, retry or hedge) goes to an unready upstream while a ready one it may
  take exists, nor to a drained, excluded, removed or already tried one while one in
  service is left; a marked one only when no unmarked one of the same readiness is left;
* counts equal attached minus detached;
* every mark on an upstream in service ends within a bound the flags give;
* an upstream that answers no check for a bounded number of check periods is out of
  service whatever the overload guard says.

CI runs it with a fixed seed (``derandomize``); run it longer with
``EP_MACHINE_EXAMPLES=5000 .venv/bin/python -m pytest tests/unit/test_registry_machine.py``
(docs/HACKING.md).
"""

from __future__ import annotations

import logging
import os
import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from extractedprism.config.endpoints import Endpoint
from extractedprism.config.table import SELECTION_MODES
from extractedprism.upstreams import state as sm
from extractedprism.upstreams.activity import SECOND_LOOK
from extractedprism.upstreams.effects import Change
from extractedprism.upstreams.registry import Registry
from extractedprism.upstreams.reservation import Reservation
from extractedprism.upstreams.state import ProbeResult, Readiness
from extractedprism.upstreams.verdicts import GUARD_INTERVALS
from tests.unit.test_balance import Conn
from tests.unit.test_registry import Clock

EPS = [Endpoint(f"10.0.0.{i}", 6443) for i in range(1, 5)]
ADDRS = [str(e) for e in EPS]
INTERVAL, TIMEOUT, STALL = 2.0, 1.0, 2.0  # --health-interval, --health-timeout, --stall-timeout
PERIOD = INTERVAL + TIMEOUT
BEHAVIOURS = ("up", "refused", "black hole", "unready", "slow")
# A mark on an upstream in service ends within this: a suspect one once both looks of its
# stall passed (the first at once, the second SECOND_LOOK stall timeouts later, the rate
# limit adding at most one more), a dial stall at the next check; either way the guard's
# bound if those checks are held back, plus the periods a confirming check takes.
MARK_BOUND = (2 + SECOND_LOOK) * STALL + (GUARD_INTERVALS + 2) * PERIOD
OUT_OF_SERVICE_BOUND = (GUARD_INTERVALS + 2) * PERIOD


class RegistryMachine(RuleBasedStateMachine):
    @initialize(mode=st.sampled_from(SELECTION_MODES), readyz=st.booleans(),
                guard=st.booleans(), rebalance=st.booleans(), seed=st.integers(0, 2**16))
    def setup(self, mode: str, readyz: bool, guard: bool, rebalance: bool, seed: int) -> None:
        self.clock = Clock()
        self.changes: list[Change] = []
        self.readyz = readyz
        self.reg = Registry(clock=self.clock, rng=random.Random(seed), selection=mode,
                            readyz=readyz, overload_guard=guard, stall_timeout=STALL,
                            rebalance_interval=10.0 if rebalance else 0.0,
                            rebalance_quiet=1.0, drain_timeout=5.0,
                            unready_drain_timeout=5.0, health_interval=INTERVAL,
                            health_timeout=TIMEOUT, on_change=self.changes.append)
        self.reg.membership.set_endpoints(EPS)
        # The registry's log lines are not what this test reads (and capturing thousands
        # of them would make it slow): quiet for the run, restored in teardown.
        self._log = logging.getLogger("extractedprism.upstreams.registry")
        self._level = self._log.level
        self._log.setLevel(logging.ERROR)
        self.behaviour = dict.fromkeys(ADDRS, "up")
        self.bad_since: dict[str, float] = {}
        self.conns: list[tuple[str, Conn]] = []
        self.held: list[Reservation] = []
        self.attached = self.detached = 0
        self.marked_since: dict[str, float] = {}
        self.n = 0

    def teardown(self) -> None:
        if hasattr(self, "_log"):
            self._log.setLevel(self._level)

    # -- the world ----------------------------------------------------------------------

    def _result(self, addr: str) -> ProbeResult:
        b = self.behaviour[addr]
        rtt = 0.001 * (1 + ADDRS.index(addr))
        if b == "refused":
            return ProbeResult(False, None, "connection refused")
        if b == "black hole":
            return ProbeResult(False, None, "timeout")
        if self.readyz and b == "unready":
            return ProbeResult(True, rtt, "", ready=False, ready_reason="HTTP 500")
        if self.readyz and b == "slow":
            return ProbeResult(True, rtt, "", ready=False, ready_reason="timeout")
        return ProbeResult(True, rtt, "", ready=True if self.readyz else None)

    def _probe(self, addr: str, *, stall: bool = False) -> None:
        self.reg.verdicts.record_probe(addr, self._result(addr), stall=stall)

    def _after(self) -> None:
        """What the pipes and the ticker do after a registry change: closed connections
        detach; a stall-check, probe-now or recheck notice runs that check at once."""
        for _ in range(4):
            changes, self.changes[:] = list(self.changes), []
            for ch in changes:
                if ch.what in ("stall-check", "probe-now", "recheck") and ch.address in \
                        self.reg.known_addresses():
                    self._probe(ch.address, stall=ch.what == "stall-check")
            for addr, c in list(self.conns):
                if c.closed:
                    self.conns.remove((addr, c))
                    self.reg.conns.detach(addr, c)
                    self.detached += 1
            if not self.changes:
                return

    # -- rules ------------------------------------------------------------------------

    @rule(addr=st.sampled_from(ADDRS), b=st.sampled_from(BEHAVIOURS))
    def behave(self, addr: str, b: str) -> None:
        if b != self.behaviour[addr]:
            self.behaviour[addr] = b
            self.bad_since.pop(addr, None)
            if b in ("refused", "black hole", "slow"):
                self.bad_since[addr] = self.clock.now

    @rule(keep=st.sets(st.sampled_from(ADDRS), min_size=1))
    def endpoints(self, keep: set[str]) -> None:
        known = set(self.reg.known_addresses())
        self.reg.membership.set_endpoints([e for e in EPS if str(e) in keep])
        for addr in keep - known:  # added anew: its bad time counts from now
            if addr in self.bad_since:
                self.bad_since[addr] = self.clock.now
        self._after()

    @rule(periods=st.integers(1, 3))
    def time_passes(self, periods: int) -> None:
        """The ticker's scheduled checks, one round per period, with sampling, deadline
        ticks and (when on) a rebalance round in each."""
        for _ in range(periods):
            self.clock.now += PERIOD
            for ep in self.reg.probe_targets():
                self._probe(str(ep))
            self._after()
            self.reg.stalls.sample_activity()
            self._after()
            self.reg.membership.tick()
            if self.reg.rebalancing:
                self.reg.rounds.rebalance()
            self._after()

    @rule(dt=st.floats(0.05, 1.5))
    def a_moment(self, dt: float) -> None:
        self.clock.now += dt
        self.reg.stalls.sample_activity()
        self._after()

    @rule(tried=st.sets(st.sampled_from(ADDRS), max_size=2),
          outcome=st.sampled_from(("connected", "refused", "stalled", "slow answer")))
    def new_connection(self, tried: set[str], outcome: str) -> None:
        res = self.reg.picks.reserve(tried)
        if res is None:
            return
        self._check_pick(res.address, frozenset(tried))
        addr = res.address
        if outcome == "stalled":
            self.reg.picks.stall_dial(res)
            self.held.append(res)
        elif outcome == "refused" or self.behaviour[addr] in ("refused", "black hole"):
            res.release()
            self.reg.verdicts.record_dial(addr, False, "connection refused")
        else:
            self.n += 1
            c = Conn(f"c{self.n}")
            if self.reg.conns.attach(res, c):
                self.conns.append((addr, c))
                self.attached += 1
            if outcome == "slow answer" or self.behaviour[addr] == "slow":
                self.reg.verdicts.record_dial(addr, False, "no answer within 1s", slow=True)
        self._after()

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 7), connected=st.booleans())
    def stalled_dial_ends(self, i: int, connected: bool) -> None:
        res = self.held.pop(i % len(self.held))
        addr = res.address
        if connected and self.behaviour[addr] not in ("refused", "black hole"):
            self.n += 1
            c = Conn(f"c{self.n}")
            if self.reg.conns.attach(res, c):
                self.conns.append((addr, c))
                self.attached += 1
        else:
            res.release()
            self.reg.verdicts.record_dial(addr, False, "timed out")
        self._after()

    @precondition(lambda self: self.conns)
    @rule(i=st.integers(0, 63), what=st.sampled_from(("ask", "answer", "close")))
    def traffic(self, i: int, what: str) -> None:
        addr, c = self.conns[i % len(self.conns)]
        if what == "ask":
            c.bytes_up += 10
        elif what == "answer":
            c.bytes_down += 10
            c.up_answered = c.bytes_up
        else:
            self.conns.remove((addr, c))
            self.reg.conns.detach(addr, c)
            self.detached += 1

    @rule(addr=st.sampled_from(ADDRS), action=st.sampled_from(("drain", "close", "")))
    def operator(self, addr: str, action: str) -> None:
        self.reg.membership.set_admin(addr, action, 0)
        self._after()

    @rule(tried=st.sets(st.sampled_from(ADDRS), min_size=1, max_size=3))
    def dial_hedge(self, tried: set[str]) -> None:
        res = self.reg.picks.reserve_hedge(tried)
        if res is None:
            return
        assert res.address not in tried
        if not res.panic:
            self._check_pick(res.address, frozenset(tried))
        res.release()

    # -- what must hold --------------------------------------------------------------

    def _check_pick(self, addr: str, tried: frozenset[str]) -> None:
        ups = self.reg.ups
        assert addr not in tried, "an upstream tried twice by one client"
        marked = self.reg.marked_locked()
        cands = [a for a, r in ups.items() if r.state.pickable and a not in tried]
        if not cands:
            return
        assert addr in cands, f"{addr} picked, not in service ({ups[addr].state})"
        ready = [a for a in cands if ups[a].state.readiness is Readiness.READY]
        if self.readyz and ready:
            assert addr in ready, f"{addr} picked unready while {ready} are ready"
            cands = ready
        if any(a not in marked for a in cands):
            assert addr not in marked, f"{addr} picked marked while {cands} were there"

    @invariant()
    def picks_follow_the_rule(self) -> None:
        if not hasattr(self, "reg"):
            return
        for tried in (frozenset(), *(frozenset({a}) for a in ADDRS)):
            for _ in range(2):
                res = self.reg.picks.reserve(tried)
                if res is None:
                    assert not any(r.state.pickable and a not in tried
                                   for a, r in self.reg.ups.items())
                    break
                self._check_pick(res.address, tried)
                res.release()
        for ep in self.reg.picks.panic_order():
            st_ = self.reg.ups[str(ep)].state
            assert not st_.draining and not st_.admin_drained

    @invariant()
    def counts_add_up(self) -> None:
        if not hasattr(self, "reg"):
            return
        snap = self.reg.snapshot()
        assert snap.connections_active == self.attached - self.detached == len(self.conns)
        assert sum(u.active_connections for u in snap.upstreams) == len(self.conns)
        # A reservation counts on the record it was made on (gone once that is removed).
        assert sum(u.dials_in_flight for u in snap.upstreams) == sum(
            1 for r in self.held if r._rec is self.reg.ups.get(r.address))

    @invariant()
    def marks_end(self) -> None:
        if not hasattr(self, "reg"):
            return
        now = self.clock.now
        marked = self.reg.marked_locked()
        for addr in list(self.marked_since):
            if addr not in marked:
                del self.marked_since[addr]
        for addr in marked:
            rec = self.reg.ups.get(addr)
            if rec is None or not sm.serving(rec.state, readyz=self.readyz):
                self.marked_since.pop(addr, None)
                continue
            since = self.marked_since.setdefault(addr, now)
            assert now - since <= MARK_BOUND, f"{addr} marked for {now - since:.1f}s"

    @invariant()
    def no_check_answered_means_out_of_service(self) -> None:
        if not hasattr(self, "reg"):
            return
        now = self.clock.now
        for addr, since in self.bad_since.items():
            rec = self.reg.ups.get(addr)
            if rec is None or now - since <= OUT_OF_SERVICE_BOUND:
                continue
            if self.behaviour[addr] == "slow" and not self.readyz:
                continue  # a TCP check cannot see a slow answer
            assert not sm.serving(rec.state, readyz=self.readyz), \
                f"{addr} {self.behaviour[addr]} for {now - since:.0f}s and still serving"


RegistryMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("EP_MACHINE_EXAMPLES", "400")),
    stateful_step_count=50, deadline=None,
    derandomize="EP_MACHINE_EXAMPLES" not in os.environ,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestRegistryMachine = pytest.mark.timeout(600)(RegistryMachine.TestCase)
