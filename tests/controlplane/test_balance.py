"""Balanced apiservers (issue 23), proved on the real control plane.

Several proxy processes stand for several nodes. Each carries long-lived clients as a
node's do: ``kubectl`` watches (client-go over HTTP/2, resumed from their last
resourceVersion) and client-go-like request loops (keep-alive GETs every LOOP_PERIOD s).
Every apiserver's established connections are counted by ``ss`` in its own network
namespace and attributed to a fleet of proxies by the peer port
(:func:`harness.apiserver_connections`); the skew is max / mean over the three.

* rolling SIGTERM restart of all three apiservers, with two fleets side by side on the
  same roll: fleet "rebalance" (least-conn, readyz, --rebalance-interval, --slow-start)
  and fleet "plain" (least-conn, readyz, the spec's behaviour otherwise). The plain
  fleet's skew is reported; the rebalancing one's must be <= 1.25 within 4 rebalance
  intervals (+10% jitter) of the last server being ready again in its proxies, every
  watch resumes with no event lost, and no request fails.
* scale-out: two apiservers, clients opened, then the third starts and each proxy's
  discovery adds it: during the first part of the slow-start window a burst of new
  connections gives it at most its ramped share, and it reaches its share (skew <= 1.25)
  within the same bound.

Test-sized timings below; every bound is derived from them plus SLACK.
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
from pathlib import Path
from typing import Any

import pytest

from tests.controlplane import harness
from tests.controlplane.conftest import MARKS, SLACK, record, require_control_plane
from tests.controlplane.harness import Load, Writer, mono
from tests.controlplane.test_scenarios import r, stop_all
from tests.util import wait_until

require_control_plane()
pytestmark = MARKS

API = ("api1", "api2", "api3")
INTERVAL, TIMEOUT, RECHECK = 2.0, 1.0, 1.0  # --health-interval/-timeout/-recheck
UNREADY_DRAIN = 2.0  # --unready-drain-timeout: a terminating apiserver's watches leave
REBALANCE, QUIET, SLOW_START = 2.0, 1.0, 4.0  # --rebalance-interval/-quiet, --slow-start
JITTER = 0.1  # the rebalance interval's jitter
SKEW_MAX = 1.25
PROXIES = int(os.environ.get("EP_CP_FLEET_PROXIES", "4"))  # per fleet ("nodes")
WATCHES, LOOPS = 3, 3  # per proxy: 6 long-lived clients, a multiple of 3 apiservers
LOOP_PERIOD, WRITE_PERIOD = 2.0, 2.5  # both longer than QUIET: a client idles between
SS_PERIOD = 0.5
BOUND = 4 * REBALANCE * (1 + JITTER) + SLACK  # skew <= 1.25 within this

COMMON = ["--upstream-selection=least-conn", f"--health-recheck={RECHECK:g}s",
          f"--unready-drain-timeout={UNREADY_DRAIN:g}s"]
BALANCING = [f"--rebalance-interval={REBALANCE:g}s", f"--rebalance-quiet={QUIET:g}s",
             f"--slow-start={SLOW_START:g}s"]


def weight(t: float) -> float:
    """The slow-start weight ``t`` s after an upstream became pickable (issue 23: 0.1 to
    1, linearly over the window)."""
    return 0.1 + 0.9 * min(1.0, max(0.0, t) / SLOW_START)


class Fleet:
    """``n`` proxies with the same flags, each with WATCHES watches and LOOPS loops."""

    def __init__(self, cluster: Any, workdir: Path, name: str, n: int, extra: list[str],
                 discovery: bool = False, endpoints: list[str] | None = None) -> None:
        self.name = name
        self.cluster = cluster
        # With discovery, the proxy's own EndpointSlice watch (through its listener) is
        # one of its connections: one loop fewer keeps 6 per proxy, a multiple of 3.
        self.loops = LOOPS - 1 if discovery else LOOPS
        self.proxies = [harness.start_proxy(cluster, workdir, interval=INTERVAL,
                                            timeout=TIMEOUT, discovery=discovery,
                                            endpoints=endpoints, extra=COMMON + extra,
                                            name=f"{name}{i}")
                        for i in range(n)]
        self.watchers: list[harness.Watcher] = []
        self.loads: list[Load] = []

    def open_clients(self, namespace: str) -> None:
        for i, p in enumerate(self.proxies):
            for j in range(WATCHES):
                w = p.watcher(namespace, f"{self.name}{i}-w{j}").start()
                assert w.first_event.wait(60), f"watch {w.name}: no first event: {w.ends}"
                self.watchers.append(w)
            self.loads.append(Load(p.port, self.cluster.ca, self.cluster.token(),
                                   keepalive=self.loops, fresh=0, period=LOOP_PERIOD).start())
        wait_until(lambda: all(ld.stats.ok >= self.loops for ld in self.loads), 60,
                   message=f"{self.name}: every request loop answered")

    def pids(self) -> dict[int, str]:
        return {p.proc.pid: self.name for p in self.proxies}

    def all_see(self, pred: Any) -> bool:
        return all(pred(p.upstreams()) for p in self.proxies)

    def stop_clients(self) -> harness.LoadStats:
        total = harness.LoadStats()
        for ld in self.loads:
            s = ld.stop()
            total.ok += s.ok
            total.failed += s.failed
            total.errors += s.errors[:5]
        stop_all(*self.watchers)
        return total

    def stop(self) -> None:
        for p in self.proxies:
            p.stop()


@pytest.fixture
def fleets(cluster: Any, tmp_path: Path) -> Any:
    made: list[Fleet] = []

    def make(name: str, extra: list[str], n: int = PROXIES, **kw: Any) -> Fleet:
        made.append(Fleet(cluster, tmp_path, name, n, extra, **kw))
        return made[-1]

    yield make
    harness.stop_live()
    for f in made:
        f.stop()


def counts_of(conns: dict[str, dict[str, int]], group: str) -> list[int]:
    return [conns[a].get(group, 0) for a in API]


class Census:
    """Samples every apiserver's connections (its own ``ss``) every SS_PERIOD seconds."""

    def __init__(self, cluster: Any, owners: dict[int, str]) -> None:
        self.cluster, self.owners = cluster, owners
        self.samples: list[tuple[float, dict[str, dict[str, int]]]] = []

    def take(self) -> dict[str, dict[str, int]]:
        conns = harness.apiserver_connections(self.cluster, self.owners)
        self.samples.append((mono(), conns))
        return conns

    def until_even(self, group: str, since: float, bound: float) -> float | None:
        """Seconds from ``since`` to the first of two consecutive samples with the
        group's skew <= SKEW_MAX; None if not within ``bound``. Sampling goes on until
        ``since + bound`` either way, so the figures cover the whole window."""
        streak, found = 0, None
        while mono() < since + bound:
            t0 = mono()
            c = counts_of(self.take(), group)
            streak = streak + 1 if harness.skew(c) <= SKEW_MAX else 0
            if streak >= 2 and found is None:
                found = self.samples[-2][0] - since
            wait_until(lambda t0=t0: mono() >= t0 + SS_PERIOD, SS_PERIOD + 1)
        return found

    def skew_at(self, group: str, t: float) -> tuple[list[int], float]:
        at = min(self.samples, key=lambda s: abs(s[0] - t))[1]
        c = counts_of(at, group)
        return c, round(harness.skew(c), 2)


def upstream_ready(addr: str) -> Any:
    return lambda ups: bool(ups.get(addr) and ups[addr]["healthy"] and not ups[addr]["draining"]
                            and ups[addr]["readiness"] == "ready")


# --- rolling restart --------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_rolling_restart_rebalanced_vs_plain(cluster, fleets, namespace, tmp_path):
    aux = harness.start_proxy(cluster, tmp_path, interval=INTERVAL, timeout=TIMEOUT,
                              discovery=False, extra=COMMON, name="aux")  # the writer's
    try:
        _rolling(cluster, fleets, namespace, aux)
    finally:
        aux.stop()


def _rolling(cluster: Any, fleets: Any, namespace: str, aux: harness.Proxy) -> None:
    bal = fleets("rebalance", BALANCING)
    plain = fleets("plain", [])
    everyone = [*bal.proxies, *plain.proxies, aux]
    wait_until(lambda: all(all(upstream_ready(a)(p.upstreams()) for a in cluster.endpoints)
                           for p in everyone), 60, message="every proxy sees 3 ready")
    writer = Writer(aux.port, cluster.ca, cluster.token(), namespace, period=WRITE_PERIOD)
    writer.create()
    bal.open_clients(namespace)
    plain.open_clients(namespace)
    writer.start()
    census = Census(cluster, {**bal.pids(), **plain.pids()})
    before = census.take()
    per_api: dict[str, Any] = {}
    try:
        t_roll = mono()
        for api in API:
            t, addr = mono(), cluster.endpoint(api)
            exit_s = harness.sigterm_and_wait(cluster, api)
            cluster.start(api)
            cluster.wait_ready([api], timeout=90)
            ready_s = mono() - t
            wait_until(lambda a=addr: bal.all_see(upstream_ready(a))
                       and plain.all_see(upstream_ready(a)), 2 * INTERVAL + TIMEOUT + SLACK + 5,
                       interval=0.1, message=f"every proxy sees {addr} ready")
            per_api[api] = {"exit_s": r(exit_s), "ready_s": r(ready_s),
                            "proxies_see_ready_s": r(mono() - t)}
        t_last = mono()  # the last server is ready again in every proxy
        census.take()
        even_after = census.until_even("rebalance", t_last, BOUND)  # plain: same samples
        last = writer.seq
        wait_until(lambda: writer.seq >= last + 2, 30, message="writes after the roll")
    finally:
        writer.stop()
    lost = harness.events_lost(writer, [*bal.watchers, *plain.watchers])
    bal_stats = bal.stop_clients()
    plain_stats = plain.stop_clients()
    c_bal_end, skew_bal_end = census.skew_at("rebalance", t_last + BOUND)
    c_plain_end, skew_plain_end = census.skew_at("plain", t_last + BOUND)
    c_bal_0, skew_bal_0 = census.skew_at("rebalance", t_last)
    c_plain_0, skew_plain_0 = census.skew_at("plain", t_last)
    record("rolling restart: rebalance vs plain", proxies_per_fleet=PROXIES,
           clients_per_proxy=WATCHES + LOOPS, per_api=per_api, roll_s=r(t_last - t_roll),
           before={"rebalance": counts_of(before, "rebalance"),
                   "plain": counts_of(before, "plain")},
           at_last_ready={"rebalance": (c_bal_0, skew_bal_0), "plain": (c_plain_0, skew_plain_0)},
           after_bound={"rebalance": (c_bal_end, skew_bal_end),
                        "plain": (c_plain_end, skew_plain_end)},
           rebalance_even_after_s=r(even_after) if even_after is not None else None,
           bound_s=r(BOUND),
           closes=[_closes(p) for p in bal.proxies],
           requests_ok={"rebalance": bal_stats.ok, "plain": plain_stats.ok},
           requests_failed={"rebalance": bal_stats.failed, "plain": plain_stats.failed},
           writes_ok=writer.ok, writes_failed=writer.failed,
           watch_streams_ended={"rebalance": sum(len(w.ends) for w in bal.watchers),
                                "plain": sum(len(w.ends) for w in plain.watchers)},
           events_lost=lost)
    assert not lost, f"watches lost events: {lost}"
    assert bal_stats.failed == 0 and plain_stats.failed == 0, (bal_stats.errors,
                                                               plain_stats.errors)
    assert even_after is not None, (
        f"rebalancing fleet skew {skew_bal_end} ({c_bal_end}) > {SKEW_MAX} for {BOUND:.1f}s "
        f"after the roll")


def _closes(p: harness.Proxy) -> float | None:
    """extractedprism_rebalance_closes_total summed over upstreams (None: no metric)."""
    total, seen = 0.0, False
    with contextlib.suppress(OSError):
        for line in p.metrics().splitlines():
            if line.startswith("extractedprism_rebalance_closes_total{"):
                total += float(line.rpartition(" ")[2])
                seen = True
    return total if seen else None


# --- scale-out ----------------------------------------------------------------------------


def tls_hold(port: int, ca: str) -> ssl.SSLSocket:
    """One new client connection through a proxy: TCP, then the TLS handshake with the
    apiserver (so the proxy has attached it to an upstream), held open."""
    ctx = ssl.create_default_context(cafile=ca)
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        return ctx.wrap_socket(raw, server_hostname=harness.SERVER_NAME)
    except BaseException:
        raw.close()
        raise


@pytest.mark.timeout(600)
def test_scale_out_third_apiserver_ramps_up_and_reaches_its_share(cluster, fleets, namespace,
                                                                  tmp_path):
    # As in a real scale-out, the new apiserver is *added*: it enters the kubernetes
    # EndpointSlice when it starts, and each proxy's discovery adds it (a graceful stop
    # takes it out of the slice at once).
    new, new_addr = "api3", cluster.endpoint("api3")
    harness.sigterm_and_wait(cluster, new)
    cluster.wait_slice({cluster.ip("api1"), cluster.ip("api2")}, 60)
    old = [cluster.endpoint(a) for a in ("api1", "api2")]
    fleet = fleets("scale", BALANCING, discovery=True, endpoints=old)
    wait_until(lambda: all(fleet.all_see(upstream_ready(a)) for a in old)
               and fleet.all_see(lambda u: new_addr not in u),
               2 * INTERVAL + 2 * TIMEOUT + SLACK + 10, message="two ready, api3 unknown")
    aux = harness.start_proxy(cluster, tmp_path, interval=INTERVAL, timeout=TIMEOUT,
                              discovery=False, extra=COMMON, name="aux")
    writer = Writer(aux.port, cluster.ca, cluster.token(), namespace, period=WRITE_PERIOD)
    held: list[ssl.SSLSocket] = []
    try:
        writer.create()
        fleet.open_clients(namespace)
        writer.start()
        census = Census(cluster, fleet.pids())
        before = counts_of(census.take(), "scale")
        cluster.start(new)
        # Poll every proxy from the start: the ramp began after the last answer that did
        # not show it ready was asked for (``not_before``), a sound bound on its weight
        # whatever the polling's own delay on a loaded machine.
        seen: dict[int, float] = {}
        not_before: dict[int, float] = {}

        def all_pickable() -> bool:
            for i, p in enumerate(fleet.proxies):
                if i in seen:
                    continue
                t_ask = mono()
                if upstream_ready(new_addr)(p.upstreams()):
                    seen[i] = mono()
                else:
                    not_before[i] = t_ask
            return len(seen) == len(fleet.proxies)

        wait_until(all_pickable, 90 + 2 * INTERVAL + TIMEOUT + SLACK, interval=0.05,
                   message=f"every proxy sees {new_addr} ready")
        t_ready = max(seen.values())
        # A burst of new connections, early in the slow-start window, on each proxy.
        burst = 9
        bursts: list[dict[str, Any]] = []
        for i, p in enumerate(fleet.proxies):
            act0 = {a: u["active_connections"] for a, u in p.upstreams().items()}
            for _ in range(burst):
                held.append(tls_hold(p.port, cluster.ca))
            t_end = mono()
            ups1 = p.upstreams()
            act1 = {a: u["active_connections"] for a, u in ups1.items()}
            w = weight(t_end - not_before[i])  # at least its weight at any pick
            total = sum(act1.values())
            # Least-conn by weight picks it only while its connections / weight are the
            # fewest, so after its last pick c3 - 1 <= w * c_other: c3 <= w * max + 1
            # (w and the others' counts only grow during the burst). Without slow start
            # it would take the first picks until level: a third of everything.
            others = max(n for a, n in act1.items() if a != new_addr)
            share_bound = w * others + 1
            bursts.append({"proxy": i, "t_into_window_s": r(t_end - seen[i]),
                           "weight_bound": round(w, 2),
                           "weight_reported": ups1[new_addr].get("weight"),
                           "new_on_api3": act1.get(new_addr, 0) - act0.get(new_addr, 0),
                           "api3_after": act1.get(new_addr, 0), "total_after": total,
                           "api3_bound": round(share_bound, 2)})
        for s in held:
            with contextlib.suppress(OSError):
                s.close()
        held.clear()
        even_after = census.until_even("scale", t_ready, BOUND)
        last = writer.seq
        wait_until(lambda: writer.seq >= last + 2, 30, message="writes after the scale-out")
    finally:
        for s in held:
            with contextlib.suppress(OSError):
                s.close()
        writer.stop()
    lost = harness.events_lost(writer, fleet.watchers)
    stats = fleet.stop_clients()
    aux.stop()
    c_end, skew_end = census.skew_at("scale", t_ready + BOUND)
    record("scale-out: third apiserver", proxies=PROXIES, clients_per_proxy=WATCHES + LOOPS,
           before=before, bursts=bursts, even_after_s=r(even_after) if even_after else None,
           bound_s=r(BOUND), final=(c_end, skew_end),
           burst_share_of_api3=r(sum(b["new_on_api3"] for b in bursts) / (burst * PROXIES)),
           closes=[_closes(p) for p in fleet.proxies], requests_ok=stats.ok,
           requests_failed=stats.failed, writes_failed=writer.failed, events_lost=lost)
    assert not lost, lost
    assert stats.failed == 0, stats.errors
    for b in bursts:
        assert b["api3_after"] <= b["api3_bound"], (
            f"api3 got more than its ramped share of the burst: {b}")
        # The proxy's own weight agrees with the ramp the flag sets.
        assert b["weight_reported"] is not None and b["weight_reported"] <= (
            b["weight_bound"] + 0.01), b
    assert even_after is not None, f"skew {skew_end} ({c_end}) > {SKEW_MAX} after {BOUND:.1f}s"
