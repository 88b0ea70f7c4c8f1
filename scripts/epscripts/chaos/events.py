"""The five events of the local schedule and their PASS/FAIL criteria."""

from __future__ import annotations

import re
import signal
from collections.abc import Callable

from epscripts.chaos.bounds import (
    DRAIN,
    EXCLUDE_BOUND,
    INTERVAL,
    SLACK,
    TIMEOUT,
    UNREADY_CLOSE,
    check_excluded,
    fmt,
)
from epscripts.chaos.harness import Harness, Outcome, last_close_after, picked_after, run_event
from epscripts.chaos.load import Attempt, mono
from epscripts.chaos.procs import UpstreamProc
from tests.fakes.fake_apiserver import make_slice


def ev_kill(h: Harness, hold: float) -> Outcome:
    up = h.ups["a"]

    reaped = [0.0]

    def inject() -> float:
        t_sig, reaped[0] = up.kill9()
        return t_sig

    def recover() -> None:
        up.start()
        up.wait_listening(30)

    def held(out: Outcome) -> bool:
        assert h.proxy is not None
        return h.proxy.first_event(out.t0, rf"healthy->unhealthy upstream={re.escape(up.address)}"
                                   ) is not None

    def analyse(h: Harness, out: Outcome, window: list[Attempt], base: float) -> None:
        # New connections: begun once the process was reaped (its sockets gone); the
        # few begun while the kernel was still tearing it down count as in-flight.
        dead = [a for a in window if reaped[0] <= a.start < out.t_recover]
        failed = [a for a in dead if not a.ok]
        out.check(not failed, f"kill-9: zero failed new connections while it was dead "
                  f"({len(failed)} of {len(dead)} failed)")
        out.lines.append(f"process reaped {reaped[0] - out.t0:.3f} s after SIGKILL")
        assert h.proxy is not None
        t = h.proxy.first_event(out.t0, rf"healthy->unhealthy upstream={re.escape(up.address)}")
        out.lines.append(f"excluded (proxy log healthy->unhealthy): "
                         f"{fmt(None if t is None else t - out.t0)}")

    return run_event(h, f"kill -9 {up.name} ({up.address}), then restart", "a", inject,
                     recover, held, max_hold=EXCLUDE_BOUND + SLACK + hold,
                     min_hold=EXCLUDE_BOUND + hold, analyse=analyse)


def _excluded_at(h: Harness, addr: str, t0: float) -> float | None:
    assert h.proxy is not None
    a = re.escape(addr)
    times = [t for t in (h.proxy.first_event(t0, rf"->unready upstream={a}"),
                         h.proxy.first_event(t0, rf"healthy->unhealthy upstream={a}"))
             if t is not None]
    return min(times) if times else None


def _check_excluded(h: Harness, up: UpstreamProc, out: Outcome, tag: str) -> None:
    t = _excluded_at(h, up.address, out.t0)
    took = None if t is None else t - out.t0
    out.lines.append(f"excluded (proxy log): {fmt(took)}")
    check_excluded(out, tag, took, SLACK)


def _left_after(h: Harness, out: Outcome, window: list[Attempt], up: UpstreamProc, t: float,
                tag: str, since: str) -> tuple[int, int, float]:
    """Checks that no new connection went to ``up`` after ``t`` (when the proxy marked it);
    returns its long-lived connections then, how many of them never moved, and when the
    last one closed, for the caller's own bound."""
    late = picked_after(window, up.name, t, out.t_recover)
    out.check(not late, f"{tag}: no new connection went to it {since} ({len(late)} did)")
    _moved, n, not_moved = h.moved_after(up.name, t, out.t_recover)
    return n, not_moved, last_close_after(h, up.name, t)


def _wait_checks(out: Outcome, window: list[Attempt], base: float, tag: str) -> None:
    served = [a for a in window if a.ok and a.first_byte is not None
              and a.connected is not None and a.start < out.t_recover]
    worst = max((a.first_byte - a.connected for a in served  # type: ignore[operator]
                 ), default=0.0)
    limit = TIMEOUT + base + SLACK
    out.check(worst <= limit, f"{tag}: new connections waited at most one dial timeout "
              f"(longest wait {worst:.2f} s <= {TIMEOUT:g} s dial timeout + {base:.2f} s "
              f"baseline handshake + {SLACK:g} s slack)")


def _signals(up: UpstreamProc, on: int, off: int
             ) -> tuple[Callable[[], float], Callable[[], None]]:
    """An event's inject (send ``on``, say when) and recover (send ``off``)."""

    def inject() -> float:
        up.signal(on)
        return mono()

    def recover() -> None:
        up.signal(off)

    return inject, recover


def ev_freeze(h: Harness, hold: float) -> Outcome:
    up = h.ups["b"]

    inject, recover = _signals(up, signal.SIGSTOP, signal.SIGCONT)

    def held(out: Outcome) -> bool:
        t = _excluded_at(h, up.address, out.t0)
        return t is not None and h.moved_after(up.name, out.t0, mono())[2] == 0 and \
            all(a.end is not None for a in h.attempts() if a.start >= out.t0 and not a.ok)

    def analyse(h: Harness, out: Outcome, window: list[Attempt], base: float) -> None:
        _check_excluded(h, up, out, "freeze")
        _wait_checks(out, window, base, "freeze")
        stuck = [a for a in window if not a.ok and a.start < out.t_recover]
        released = max((a.end - out.t0 for a in stuck if a.end is not None), default=0.0)
        out.lines.append(f"new connections that reached it before the exclusion (the kernel "
                         f"still accepts for a frozen process): {len(stuck)}, released by "
                         f"{fmt(released)}")
        bound = EXCLUDE_BOUND + UNREADY_CLOSE + SLACK
        out.check(released <= bound, f"freeze: connections stuck on it were closed within "
                  f"exclusion + drain-timeout + one interval ({fmt(released)} <= "
                  f"{bound:g} s)")

    return run_event(h, f"SIGSTOP {up.name} ({up.address}), then SIGCONT", "b", inject,
                     recover, held,
                     max_hold=EXCLUDE_BOUND + UNREADY_CLOSE + SLACK + hold, min_hold=hold,
                     analyse=analyse)


def ev_readyz(h: Harness, hold: float) -> Outcome:
    up = h.ups["a"]

    # chaos/upstream.py: SIGUSR1 turns its /readyz to 500, SIGUSR2 back to 200.
    inject, recover = _signals(up, signal.SIGUSR1, signal.SIGUSR2)

    def held(out: Outcome) -> bool:
        assert h.proxy is not None
        t = h.proxy.first_event(out.t0, rf"->unready upstream={re.escape(up.address)}")
        return t is not None and h.moved_after(up.name, t, mono())[2] == 0

    def analyse(h: Harness, out: Outcome, window: list[Attempt], base: float) -> None:
        assert h.proxy is not None
        probes = up.readyz_after(out.t0, 500)
        t2 = probes[1] if len(probes) >= 2 else None
        tu = h.proxy.first_event(out.t0, rf"->unready upstream={re.escape(up.address)}")
        out.lines.append(f"second failed /readyz answered "
                         f"{fmt(None if t2 is None else t2 - out.t0)}; proxy marked it "
                         f"unready {fmt(None if tu is None else tu - out.t0)}")
        if tu is None:
            out.check(False, "readyz-500: the proxy marked it unready (after its second "
                      "failed probe)")
            return
        n, not_moved, closed = _left_after(h, out, window, up, tu, "readyz-500",
                                           "after its second failed probe")
        bound = UNREADY_CLOSE + SLACK
        ok = not_moved == 0 and closed <= bound
        out.check(ok, f"readyz-500: its {n} long-lived connections were closed within "
                  f"drain-timeout plus one interval (last closed {fmt(closed)} after unready"
                  f"{'' if not not_moved else f', {not_moved} never'}; bound "
                  f"{DRAIN:g}+{INTERVAL:g}+{SLACK:g} s)")

    return run_event(h, f"/readyz of {up.name} ({up.address}) -> 500, then 200", "a", inject,
                     recover, held, max_hold=EXCLUDE_BOUND + UNREADY_CLOSE + SLACK + hold,
                     min_hold=hold, analyse=analyse)


def ev_slice(h: Harness, hold: float) -> Outcome:
    up = h.ups["c"]
    assert h.api is not None
    others = [a for a in h.slice_addrs if a != up.host]

    def inject() -> float:
        assert h.api is not None
        h.api.set_slice(make_slice("kubernetes", others, port=h.port))
        return mono()

    def recover() -> None:
        assert h.api is not None
        h.api.set_slice(make_slice("kubernetes", h.slice_addrs, port=h.port))

    def removed_at(t0: float) -> float | None:
        assert h.proxy is not None
        a = re.escape(up.address)
        ts = [t for t in (h.proxy.first_event(t0, rf"upstream draining upstream={a}"),
                          h.proxy.first_event(t0, rf"upstream removed upstream={a}"))
              if t is not None]
        return min(ts) if ts else None

    def held(out: Outcome) -> bool:
        t = removed_at(out.t0)
        return t is not None and h.moved_after(up.name, t, mono())[2] == 0

    def analyse(h: Harness, out: Outcome, window: list[Attempt], base: float) -> None:
        t = removed_at(out.t0)
        out.lines.append(f"proxy started draining it: {fmt(None if t is None else t - out.t0)}"
                         " after the EndpointSlice update")
        if t is None:
            out.check(False, "slice-removal: the proxy drained the removed endpoint")
            return
        n, not_moved, closed = _left_after(h, out, window, up, t, "slice-removal",
                                           "once it drained")
        bound = DRAIN + INTERVAL + SLACK
        out.check(not_moved == 0 and closed <= bound,
                  f"slice-removal: its {n} long-lived connections were closed within "
                  f"drain-timeout (+ one interval) (last {fmt(closed)}; bound {bound:g} s)")

    return run_event(h, f"{up.name} ({up.address}) removed from the EndpointSlice, then "
                     "re-added", "c", inject, recover, held,
                     max_hold=DRAIN + INTERVAL + SLACK + hold, min_hold=hold, analyse=analyse)


def ev_partition(h: Harness, hold: float) -> Outcome:
    up = h.ups["c"]
    ns = h.netns
    assert ns is not None

    def inject() -> float:
        ns.partition()
        return mono()

    def recover() -> None:
        ns.heal()

    def held(out: Outcome) -> bool:
        return _excluded_at(h, up.address, out.t0) is not None

    def analyse(h: Harness, out: Outcome, window: list[Attempt], base: float) -> None:
        _check_excluded(h, up, out, "partition")
        failed = [a for a in window if not a.ok and a.start < out.t_recover]
        out.check(not failed, f"partition: zero failed new connections (dial timeout, then "
                  f"retry; {len(failed)} failed)")
        _m, _n, not_moved = h.moved_after(up.name, out.t0, out.t_recover)
        if not_moved:
            out.lines.append(f"note: the proxy kept its {not_moved} long-lived connections "
                             "to the partitioned upstream (TCP-unhealthy but still marked "
                             "ready, so no readiness close); they resumed after the heal")
        _wait_checks(out, window, base, "partition")

    return run_event(h, f"network partition of {up.name} ({up.address}, link down in "
                     f"namespace {ns.name})", "c", inject, recover, held,
                     max_hold=EXCLUDE_BOUND + SLACK + hold, min_hold=EXCLUDE_BOUND + hold,
                     analyse=analyse)
