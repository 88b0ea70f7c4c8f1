"""The failures operators fear, against a real control plane (etcd + three kube-apiservers).

Each test starts extractedprism as a subprocess with real flags in front of the
session's control plane (tests/controlplane/conftest.py), drives real clients through
its listener with TLS verified as kubernetes.default.svc (the Python ``kubernetes``
client; ``kubectl`` for long-lived HTTP/2 watches), injects one fault with
scripts/controlplane and checks figures against bounds computed from the flags it
passed (INTERVAL, TIMEOUT, the drain timeout) plus SLACK once. Figures are recorded and
printed at the end of the session (docs/controlplane.md has the latest run).
"""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from tests.controlplane import harness
from tests.controlplane.conftest import (
    INTERVAL,
    MARKS,
    SLACK,
    TIMEOUT,
    record,
    require_control_plane,
    wait_all_ready,
)
from tests.controlplane.harness import Load, Sampler, Watcher, Writer, mono
from tests.util import wait_until

require_control_plane()
pytestmark = MARKS

API = ("api1", "api2", "api3")


def r(x: float) -> float:
    return round(x, 2)


def healthy(s: harness.Sample, addr: str) -> bool:
    u = s.ups.get(addr)
    return bool(u and u["healthy"] and not u["draining"])


def ready(s: harness.Sample, addr: str) -> bool:
    u = s.ups.get(addr)
    return bool(u and u["healthy"] and not u["draining"] and u["readiness"] == "ready")


def excluded(s: harness.Sample, addr: str) -> bool:
    """Not pickable for new connections while another upstream is ready."""
    u = s.ups.get(addr)
    return u is None or not u["healthy"] or u["draining"] or u["readiness"] != "ready"


def start_watchers(proxy: harness.Proxy, namespace: str, n: int, *, spread: int = 1,
                   max_n: int = 12) -> list[tuple[Watcher, str | None]]:
    """Start ``n`` (up to ``max_n`` until ``spread`` upstreams carry one) kubectl watches,
    one at a time, each mapped to the upstream whose connection count it raised."""
    out: list[tuple[Watcher, str | None]] = []
    while len(out) < n or (len({a for _, a in out if a}) < spread and len(out) < max_n):
        before = {a: u["total_connections"] for a, u in proxy.upstreams().items()}
        w = proxy.watcher(namespace, f"w{len(out)}").start()
        out.append((w, None))
        assert w.first_event.wait(30), f"watch {w.name} got no first event: {w.ends}"
        after = {a: u["total_connections"] for a, u in proxy.upstreams().items()}
        grew = [a for a in after if after[a] - before.get(a, 0) == 1]
        if len(grew) == 1 and sum(after.values()) - sum(before.values()) == 1:
            out[-1] = (w, grew[0])
    return out


def stop_all(*things: Any) -> None:
    for t in things:
        if t is not None:
            t.stop()


# --- discovery ------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_discovery_learns_the_other_apiservers_from_the_real_endpointslice(cluster,
                                                                           extractedprism):
    """One static endpoint; the other two come from the `kubernetes` EndpointSlice, listed
    and watched through the proxy's own listener."""
    static = cluster.endpoint("api1")
    t0 = mono()
    proxy = extractedprism(endpoints=[static], name="discovery")
    t_up = mono()
    wait_all_ready(proxy, cluster.endpoints, timeout=2 * INTERVAL + TIMEOUT + SLACK + 10)
    took = mono() - t_up
    # The first list goes through the listener as soon as api1 is pickable (a new upstream
    # counts as pickable before its first check); each learned upstream is then checked
    # at the next tick (<= one interval) and probed right after its connect (one timeout).
    bound = 2 * INTERVAL + TIMEOUT + SLACK
    ups = proxy.upstreams()
    record("discovery", proxy_start_s=r(t_up - t0), all_three_ready_after_s=r(took),
           bound_s=bound, sources={a: ups[a].get("source") for a in ups})
    assert took <= bound, f"learned and ready after {took:.2f}s > {bound}s"
    assert set(ups) == set(cluster.endpoints)
    # Where each came from: api1 is both static and in the slice, the others only in it.
    assert sorted(ups[static]["source"]) == ["kubernetes", "static"], ups[static]
    for api in ("api2", "api3"):
        assert ups[cluster.endpoint(api)]["source"] == ["kubernetes"], ups
    # Discovery really went through the proxy's own listener, verified by name.
    log = proxy.log()
    assert f"server=https://127.0.0.1:{proxy.port}" in log, log[-2000:]
    assert "endpointslices listed" in log
    # A real client through the listener sees the same slice.
    api = proxy.client()
    try:
        from kubernetes import client as k8s
        sl = k8s.DiscoveryV1Api(api).list_namespaced_endpoint_slice(
            "default", label_selector="kubernetes.io/service-name=kubernetes")
        addrs = {f"{a}:6443" for s in sl.items for e in s.endpoints for a in e.addresses}
        assert addrs == set(cluster.endpoints)
    finally:
        api.close()


# --- kill -9 --------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_kill_9_under_load_excludes_drains_and_readds(cluster, extractedprism):
    drain = 3.0
    proxy = extractedprism(endpoints=[cluster.endpoint("api1")], drain=f"{drain:g}s", name="kill9")
    wait_all_ready(proxy, cluster.endpoints, timeout=30)
    victim = "api3"  # known only from discovery
    addr, ip = cluster.endpoint(victim), cluster.ip(victim)
    sampler = Sampler(proxy.health_port,
                      direct=lambda: {"slice": cluster.slice_addresses()}).start()
    load = Load(proxy.port, cluster.ca, cluster.token()).start()
    try:
        wait_until(lambda: load.stats.ok >= 20, 30, message="load warmed up")
        t_kill = mono()
        cluster.kill(victim)
        s_ex = sampler.wait_for(lambda s: not healthy(s, addr), t_kill, 30, f"{addr} excluded")
        s_drop = sampler.wait_for(lambda s: s.direct.get("slice") is not None
                                  and ip not in s.direct["slice"], t_kill, 90,
                                  f"{ip} dropped from the EndpointSlice")
        s_gone = sampler.wait_for(lambda s: bool(s.ups) and addr not in s.ups, t_kill, 120,
                                  f"{addr} removed from /upstreams")
        draining_seen = any(s.ups.get(addr, {}).get("draining") for s in sampler.window(t_kill))
        t_start = mono()
        cluster.start(victim)
        s_slice = sampler.wait_for(lambda s: ip in (s.direct.get("slice") or ()), t_start, 90,
                                   f"{ip} back in the EndpointSlice")
        s_back = sampler.wait_for(lambda s: ready(s, addr), t_start, 90, f"{addr} ready again")
        wait_until(lambda: load.stats.ok >= 20 + 50, 30, message="load continued")
    finally:
        stats = load.stop()
        sampler.stop()
    excl = s_ex.t - t_kill
    removal = s_gone.t - s_drop.t
    readd = s_back.t - s_slice.t
    record("kill -9", excluded_after_s=r(excl), excluded_bound_s=2 * INTERVAL + SLACK,
           lease_reconciler_drop_s=r(s_drop.t - t_kill),
           removed_after_slice_drop_s=r(removal),
           removal_bound_s=drain + INTERVAL + SLACK, draining_seen=draining_seen,
           restart_to_slice_s=r(s_slice.t - t_start),
           ready_after_slice_readd_s=r(readd), readd_bound_s=2 * INTERVAL + TIMEOUT + SLACK,
           requests_ok=stats.ok, requests_failed=stats.failed)
    assert stats.failed == 0, stats.errors
    # Refused dials and probes both count: two in a row exclude it, at the latest two
    # intervals after the kill.
    assert excl <= 2 * INTERVAL + SLACK, f"excluded after {excl:.2f}s"
    # Removed from the slice -> drained (no live connection: a dead peer reset them) and
    # removed; the watch event arrives at once, the drain ends by --drain-timeout.
    assert removal <= drain + INTERVAL + SLACK, f"removed {removal:.2f}s after the slice drop"
    # Back in the slice -> listed at once, checked within one interval, probed at once.
    assert readd <= 2 * INTERVAL + TIMEOUT + SLACK, f"ready {readd:.2f}s after re-add"


# --- rolling restart ---------------------------------------------------------------


@pytest.mark.timeout(300)
def test_rolling_restart_with_sigterm(cluster, extractedprism, namespace):
    # A terminating apiserver finishes its open watches before it exits (HTTP/2 GOAWAY,
    # then it waits); the proxy closes them --drain-timeout after marking it unready, so
    # the drain timeout sets the pace of the roll.
    drain = 5.0
    proxy = extractedprism(name="rolling", drain=f"{drain:g}s")
    wait_all_ready(proxy, cluster.endpoints, timeout=30)
    writer = Writer(proxy.port, cluster.ca, cluster.token(), namespace)
    writer.create()
    watchers = start_watchers(proxy, namespace, 6)
    sampler = Sampler(proxy.health_port).start()
    load = Load(proxy.port, cluster.ca, cluster.token()).start()
    writer.start()
    retried0 = harness.ClientGoRetry.retried_after
    per_api: dict[str, Any] = {}
    try:
        wait_until(lambda: writer.ok >= 4 and load.stats.ok >= 20, 30, message="traffic")
        t_roll = mono()
        for api in API:
            addr = cluster.endpoint(api)
            t = mono()
            harness.sigterm_and_wait(cluster, api)
            t_exit = mono()
            s_ex = sampler.first(lambda s, a=addr: excluded(s, a), t)
            cluster.start(api)
            cluster.wait_ready([api], timeout=90)
            s_back = sampler.wait_for(lambda s, a=addr: ready(s, a), t_exit, 60,
                                      f"{addr} ready again")
            per_api[api] = {"exit_s": r(t_exit - t),
                            "excluded_s": r(s_ex.t - t) if s_ex else None,
                            "back_ready_s": r(s_back.t - t)}
        t_end = mono()
        last = writer.seq
        wait_until(lambda: writer.seq >= last + 4, 30, message="writes after the roll")
    finally:
        writer.stop()
        stats = load.stop()
        sampler.stop()
    final = max((s for _, s, _ in writer.written), default=0)
    wait_until(lambda: all(final in w.seqs() for w, _ in watchers), 30,
               message="every watch caught up with the last write")
    stop_all(*(w for w, _ in watchers))
    written = {s for _, s, _ in writer.written}
    gaps = {w.name: r(w.max_gap(t_roll, t_end)) for w, _ in watchers}
    lost = {w.name: sorted(written - w.seqs())[:10] for w, _ in watchers if written - w.seqs()}
    ends = {w.name: len(w.ends) for w, _ in watchers}
    gap_bound = writer.period + TIMEOUT + SLACK
    record("rolling restart (SIGTERM)", drain_timeout_s=drain, per_api=per_api,
           roll_s=r(t_end - t_roll),
           requests_ok=stats.ok, requests_failed=stats.failed, writes_ok=writer.ok,
           writes_failed=writer.failed, watch_streams_ended=ends, watch_max_gap_s=gaps,
           watch_gap_bound_s=gap_bound, events_lost=lost,
           watches_410=sum(w.gone for w, _ in watchers),
           retried_after_503=harness.ClientGoRetry.retried_after - retried0)
    assert stats.failed == 0, stats.errors
    assert writer.failed == 0, writer.errors
    assert not lost, f"watches lost events: {lost}"
    # A watch whose apiserver went away resumes from its resourceVersion through the
    # proxy at once: one dial timeout at most (a dial to the terminating apiserver), plus
    # one write period for the next event.
    assert max(gaps.values()) <= gap_bound, f"watch gaps {gaps} > {gap_bound}s"


# --- partition from etcd --------------------------------------------------------------


@pytest.mark.timeout(240)
def test_apiserver_partitioned_from_etcd(cluster, extractedprism, namespace):
    drain = 3.0
    proxy = extractedprism(drain=f"{drain:g}s", name="partition")
    wait_all_ready(proxy, cluster.endpoints, timeout=30)
    writer = Writer(proxy.port, cluster.ca, cluster.token(), namespace)
    writer.create()
    watchers = start_watchers(proxy, namespace, 6, spread=2)
    by_api: dict[str, list[Watcher]] = {}
    for w, a in watchers:
        by_api.setdefault(a or "?", []).append(w)
    target_addr = max((a for a in by_api if a != "?"), key=lambda a: len(by_api[a]))
    target = next(api for api in API if cluster.endpoint(api) == target_addr)
    others = [w for w, a in watchers if a and a != target_addr]
    ours = by_api[target_addr]
    sampler = Sampler(proxy.health_port,
                      # Asked as the proxy's probe asks: within one --health-timeout.
                      direct=lambda: {"readyz": cluster.readyz(target, timeout=TIMEOUT)}).start()
    load = Load(proxy.port, cluster.ca, cluster.token()).start()
    writer.start()
    try:
        wait_until(lambda: writer.ok >= 4, 30, message="writes")
        t_cut = mono()
        cluster.partition_etcd(target)
        s_fail = sampler.wait_for(lambda s: s.direct.get("readyz") != 200, t_cut, 60,
                                  f"{target}'s own /readyz failing (non-200 or no answer "
                                  f"within {TIMEOUT:g}s)")
        s_un = sampler.wait_for(lambda s: excluded(s, target_addr), t_cut, 60,
                                f"{target_addr} not ready")
        marked_total = s_un.ups[target_addr]["total_connections"]
        s_closed = sampler.wait_for(
            lambda s: s.ups.get(target_addr, {}).get("active_connections", 1) == 0, s_un.t,
            drain + INTERVAL + SLACK + 10, f"{target_addr}'s connections closed")
        wait_until(lambda: all(w.ends for w in ours), 10, message="its watches ended")
        # Hold the partition a little longer: nothing new may go to it.
        hold_until = mono() + INTERVAL
        wait_until(lambda: mono() >= hold_until, INTERVAL + 1)
        s_hold = sampler.samples[-1]
        t_heal = mono()
        cluster.heal(target)
        s_ok = sampler.wait_for(lambda s: ready(s, target_addr), t_heal, 60,
                                f"{target_addr} ready after heal")
    finally:
        writer.stop()
        stats = load.stop()
        sampler.stop()
    stop_all(*(w for w, _ in watchers))
    unready_after = s_un.t - s_fail.t
    closed_after = s_closed.t - s_un.t
    new_after_mark = s_hold.ups[target_addr]["total_connections"] - marked_total
    others_ended = {w.name: [e.at - t_cut for e in w.ends] for w in others if w.ends}
    seen = sorted({str(s.direct.get("readyz")) for s in sampler.window(t_cut, t_heal)})
    record("partition from etcd", target=target, own_readyz_failed_after_s=r(s_fail.t - t_cut),
           own_readyz_answers=seen,
           unready_after_readyz_failed_s=r(unready_after),
           unready_bound_s=2 * INTERVAL + TIMEOUT + SLACK,
           connections_closed_after_unready_s=r(closed_after),
           closed_bound_s=drain + INTERVAL + SLACK, watches_on_target=len(ours),
           watches_elsewhere=len(others), watches_elsewhere_ended=len(others_ended),
           new_connections_after_mark=new_after_mark,
           ready_after_heal_s=r(s_ok.t - t_heal), requests_ok=stats.ok,
           requests_failed=stats.failed, writes_failed=writer.failed)
    assert unready_after <= 2 * INTERVAL + TIMEOUT + SLACK, unready_after
    assert closed_after <= drain + INTERVAL + SLACK, closed_after
    assert not others_ended, f"watches on healthy apiservers were cut: {others_ended}"
    assert new_after_mark == 0, f"{new_after_mark} new connections to {target} after the mark"
    ends = [e.at for w in ours for e in w.ends[:1]]
    assert all(e >= s_un.t - harness.POLL for e in ends), "a watch was cut before the mark"


# --- etcd down ------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_etcd_down_for_10s(cluster, extractedprism, namespace):
    proxy = extractedprism(name="etcd-down")  # default --drain-timeout (30 s)
    wait_all_ready(proxy, cluster.endpoints, timeout=30)
    writer = Writer(proxy.port, cluster.ca, cluster.token(), namespace)
    writer.create()
    watchers = start_watchers(proxy, namespace, 6)
    sampler = Sampler(proxy.health_port).start()
    writer.start()
    outage = 10.0
    try:
        wait_until(lambda: writer.ok >= 4, 30, message="writes")
        t_down = mono()
        cluster.etcd_down()
        s_all = sampler.wait_for(lambda s: all(excluded(s, a) for a in cluster.endpoints),
                                 t_down, outage, "every upstream not ready")
        wait_until(lambda: mono() >= t_down + outage, outage + 1)
        t_up = mono()
        cluster.etcd_up()
        s_back = sampler.wait_for(lambda s: all(ready(s, a) for a in cluster.endpoints),
                                  t_up, 90, "every upstream ready again")
        last = writer.seq
        wait_until(lambda: writer.ok >= 1 and writer.seq >= last + 4, 30, message="writes")
        t_end = mono()
    finally:
        writer.stop()
        sampler.stop()
    final = max((s for _, s, _ in writer.written), default=0)
    wait_until(lambda: all(final in w.seqs() for w, _ in watchers), 30,
               message="every watch caught up with the last write")
    stop_all(*(w for w, _ in watchers))
    window = list(sampler.window(t_down, t_end))
    proxy_readyz = {s.readyz for s in window}
    drained = {a for s in window for a, u in s.ups.items() if u["draining"]}
    ends = {w.name: len(w.ends) for w, _ in watchers if w.ends}
    first_ready = sampler.first(lambda s: any(ready(s, a) for a in cluster.endpoints), t_up)
    record("etcd down 10 s", all_unready_after_s=r(s_all.t - t_down),
           all_ready_after_etcd_up_s=r(s_back.t - t_up),
           recovery_stagger_s=r(s_back.t - first_ready.t) if first_ready else None,
           proxy_readyz_seen=sorted(x for x in proxy_readyz if x is not None),
           drained=sorted(drained), watch_streams_ended=ends, writes_failed=writer.failed)
    assert proxy_readyz == {200}, f"the proxy's own /readyz was {proxy_readyz}"
    assert not drained, f"drained with no other upstream ready: {drained}"
    # The watches stayed where they were: none cut by the outage, none by the staggered
    # recovery (each later upstream turned ready within the 30 s drain timeout).
    assert not ends, f"watch streams ended: {ends}"


# --- SIGSTOP ----------------------------------------------------------------------------


def _freeze(cluster: Any, proxy: harness.Proxy, victim: str, exclude_within: float,
            read_timeout: float) -> tuple[float, harness.Sample, Any, float | None]:
    """SIGSTOP ``victim`` under load (fresh connections and one keep-alive), wait for its
    exclusion and 30 fresh connections after it, then SIGCONT it. (when stopped, the
    sample that saw it excluded, the load's stats, its silent answer hedges)."""
    addr = cluster.endpoint(victim)
    sampler = Sampler(proxy.health_port).start()
    load = Load(proxy.port, cluster.ca, cluster.token(), keepalive=1, fresh=3,
                read_timeout=read_timeout).start()
    try:
        wait_until(lambda: load.stats.ok >= 20, 30, message="load warmed up")
        t_stop = mono()
        cluster.stop(victim)
        s_ex = sampler.wait_for(lambda s: excluded(s, addr), t_stop, exclude_within,
                                f"{addr} excluded")
        n_before = len(load.stats.fresh_latencies)
        wait_until(lambda: len(load.stats.fresh_latencies) >= n_before + 30, 30,
                   message="fresh connections after the exclusion")
        silent = proxy.metric("extractedprism_answer_hedges_total", upstream=addr,
                              outcome="silent")
    finally:
        cluster.cont(victim)
        stats = load.stop()
        sampler.stop()
    return t_stop, s_ex, stats, silent


def _baseline_p50(stats: Any, t_stop: float) -> float:
    baseline = sorted(d for t0, d in stats.fresh_latencies if t0 < t_stop)
    return baseline[len(baseline) // 2] if baseline else 0.0


@pytest.mark.timeout(180)
def test_frozen_apiserver(cluster, extractedprism):
    proxy = extractedprism(name="frozen")
    wait_all_ready(proxy, cluster.endpoints, timeout=30)
    t_stop, s_ex, stats, _ = _freeze(cluster, proxy, "api2", 30,
                                     read_timeout=2 * INTERVAL + TIMEOUT + 5)
    excl = s_ex.t - t_stop
    # Fresh connections opened while it was frozen, before and after its exclusion.
    during = [d for t0, d in stats.fresh_latencies if t0 >= t_stop]
    before_mark = [d for t0, d in stats.fresh_latencies if t_stop <= t0 < s_ex.t]
    after_mark = [d for t0, d in stats.fresh_latencies if t0 >= s_ex.t]
    p50 = _baseline_p50(stats, t_stop)
    record("frozen (SIGSTOP)", excluded_after_s=r(excl),
           excluded_bound_s=2 * INTERVAL + TIMEOUT + SLACK,
           max_wait_before_mark_s=r(max(before_mark, default=0)),
           max_wait_after_mark_s=r(max(after_mark, default=0)),
           wait_bound_s=r(TIMEOUT + p50 + SLACK), baseline_p50_s=r(p50),
           requests_ok=stats.ok, requests_failed=stats.failed,
           fresh_requests_while_frozen=len(during))
    assert excl <= 2 * INTERVAL + TIMEOUT + SLACK, f"excluded after {excl:.2f}s"
    assert max(after_mark, default=0) <= TIMEOUT + p50 + SLACK
    assert max(during, default=0) <= TIMEOUT + p50 + SLACK, (
        f"a new connection waited {max(during):.2f}s on the frozen apiserver")


# The defaults a user gets (spec: --health-interval 20s, --health-timeout 15s;
# --answer-hedge-delay 1s).
DEFAULT_INTERVAL, DEFAULT_TIMEOUT, DEFAULT_HEDGE = 20.0, 15.0, 1.0


@pytest.mark.timeout(240)
def test_frozen_apiserver_with_the_default_intervals(cluster, extractedprism):
    """Issue 22: with the default flags a SIGSTOPped API server costs a fresh connection
    about the hedge delay (client-go's TLS handshake gives up after 10 s: the old check
    waited --health-timeout, 15 s), and the second connection it swallows excludes it,
    --health-timeout after that connection's ClientHello, long before the probes would
    (2 x 20 s + 15 s)."""
    proxy = extractedprism(name="frozen-defaults", interval=DEFAULT_INTERVAL,
                           timeout=DEFAULT_TIMEOUT)
    assert "--answer-hedge-delay" not in " ".join(proxy.args)  # its default, 1 s
    wait_all_ready(proxy, cluster.endpoints, timeout=60)
    victim = "api3"
    addr = cluster.endpoint(victim)
    # Two fresh connections land on it within a few seconds (3 threads, 1 in 3 picks);
    # each parked attempt is judged --health-timeout after its ClientHello.
    t_stop, s_ex, stats, silent = _freeze(cluster, proxy, victim, DEFAULT_TIMEOUT + 10,
                                          read_timeout=DEFAULT_TIMEOUT + 5)
    excl = s_ex.t - t_stop
    during = [d for t0, d in stats.fresh_latencies if t0 >= t_stop]
    p50 = _baseline_p50(stats, t_stop)
    wait_bound = DEFAULT_HEDGE + p50 + 0.5  # "about 1.5 s"
    record("frozen (SIGSTOP), default intervals", excluded_after_s=r(excl),
           excluded_bound_s=DEFAULT_TIMEOUT + 10, max_fresh_wait_s=r(max(during, default=0)),
           wait_bound_s=r(wait_bound), baseline_p50_s=r(p50), silent_hedges=silent,
           requests_ok=stats.ok, requests_failed=stats.failed,
           fresh_requests_while_frozen=len(during))
    assert max(during, default=0) <= wait_bound, (
        f"a new connection waited {max(during):.2f}s on the frozen apiserver")
    # Excluded by the silent connections (the reason says so), not by the probes.
    lines = [ln for ln in proxy.log().splitlines() if "->unhealthy" in ln and addr in ln]
    assert lines and "ClientHello" in lines[0], lines
    assert silent is not None and silent >= 2
    assert excl <= DEFAULT_TIMEOUT + 10, f"excluded after {excl:.2f}s"


# --- compaction ------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_compaction_410_relist(cluster, extractedprism, namespace):
    proxy = extractedprism(endpoints=[cluster.endpoint("api1")], name="compact")
    wait_all_ready(proxy, cluster.endpoints, timeout=30)
    from kubernetes import client as k8s
    from kubernetes.client.exceptions import ApiException

    # With no client of ours yet, the one live connection is the proxy's own watch.
    ups = proxy.upstreams()
    carrier = [a for a, u in ups.items() if u["active_connections"] == 1]
    assert len(carrier) == 1, ups
    carrier_api = next(api for api in API if cluster.endpoint(api) == carrier[0])
    api = proxy.client()
    try:
        core = k8s.CoreV1Api(api)
        old_rv = core.list_namespaced_config_map(namespace).metadata.resource_version
        # Two writes: a watch from R starts at R+1, and etcd refuses only starts below
        # the compaction revision (which itself stays readable).
        for name in ("bump1", "bump2"):
            core.create_namespaced_config_map(
                namespace, k8s.V1ConfigMap(metadata=k8s.V1ObjectMeta(name=name)))
        log_mark = len(proxy.log())
        rev = cluster.compact()
        # A real watch from before the compaction: 410 through the proxy.
        got_410 = False
        try:
            resp = core.list_namespaced_config_map(namespace, watch=True, resource_version=old_rv,
                                                   timeout_seconds=5, _preload_content=False)
            body = resp.read().decode()
            resp.release_conn()
            got_410 = '"code":410' in body
        except ApiException as exc:
            got_410 = exc.status == 410
        assert got_410, "an old resourceVersion did not answer 410 after compaction"
        # Cut the proxy's own watch: kill and restart the apiserver carrying it.
        t_cut = mono()
        cluster.kill(carrier_api)
        cluster.start(carrier_api)

        def relisted() -> bool:
            tail = proxy.log()[log_mark:]
            return "410 Gone" in tail and "endpointslices listed" in tail.split("410 Gone", 1)[1]

        wait_until(relisted, 60, interval=0.2, message="the proxy re-listed after 410")
        t_relist = mono()
        cluster.wait_ready([carrier_api], timeout=90)
        wait_all_ready(proxy, cluster.endpoints, timeout=2 * INTERVAL + TIMEOUT + SLACK + 10)
        ups = proxy.upstreams()
    finally:
        api.close()
    errors = proxy.metric("extractedprism_discovery_errors_total", provider="kubernetes")
    record("compaction", compacted_revision=rev, old_rv=old_rv, relisted_after_cut_s=r(
        t_relist - t_cut), upstreams_after=sorted(ups), discovery_errors=errors or 0)
    assert set(ups) == set(cluster.endpoints)


# --- credentials for the readyz probe -------------------------------------------------------


@pytest.mark.timeout(300)
def test_readyz_probe_credentials_with_anonymous_auth_disabled(cluster, extractedprism):
    """--anonymous-auth=false on every apiserver: a probe without credentials is refused
    (401: not ready, the TCP fallback keeps traffic flowing), a bearer token or a client
    certificate (the node's) makes them ready."""
    pki = cluster.pki
    try:
        for api in API:
            cluster.term(api)
        for api in API:
            assert cluster.wait_exit(api, 90)
            cluster.start(api, ["--anonymous-auth=false"])
        cluster.wait_ready(timeout=90)
        none = extractedprism(name="no-credential", discovery=False)
        token = extractedprism(name="token", discovery=False, extra=[
            f"--health-check-token-file={cluster.token_file('extractedprism')}"])
        cert = extractedprism(name="cert", discovery=False, extra=[
            f"--health-check-cert-file={pki / 'node.crt'}",
            f"--health-check-key-file={pki / 'node.key'}"])
        bound = 2 * INTERVAL + TIMEOUT + SLACK
        t0 = mono()
        wait_all_ready(token, cluster.endpoints, timeout=bound + 5)
        wait_all_ready(cert, cluster.endpoints, timeout=bound + 5)
        t_ready = mono() - t0

        def none_unready() -> bool:
            ups = none.upstreams()
            return all(u["readiness"] == "unready" for u in ups.values()) and len(ups) == 3

        wait_until(none_unready, bound + 5, interval=0.1, message="all unready without credential")
        reasons = {u["last_check_error"] for u in none.upstreams().values()}
        # Every proxy still carries requests (the uncredentialed one by the TCP fallback).
        from kubernetes import client as k8s
        for p in (none, token, cert):
            api = p.client()
            try:
                k8s.CoreV1Api(api).read_namespace("default")
            finally:
                api.close()
        record("readyz credentials (anonymous-auth=false)", token_and_cert_ready_s=r(t_ready),
               bound_s=bound, no_credential_reason=sorted(str(x) for x in reasons))
        assert any("401" in str(x) for x in reasons), reasons
    finally:
        for api in API:
            if cluster.running(api):
                cluster.term(api)
        for api in API:
            cluster.wait_exit(api, 90)
            cluster.start(api)
        cluster.wait_ready(timeout=90)


# --- node credentials and EndpointSlices ----------------------------------------------------


@pytest.mark.timeout(60)
def test_node_credentials_and_endpointslices(cluster):
    """What a node's own credentials (CN=system:node:<name>, O=system:nodes) may do with
    EndpointSlices under --authorization-mode=Node,RBAC: nothing by default (the Node
    authorizer has no opinion on them and no default RBAC role grants them to nodes), so
    a deployment that discovers with the kubelet's credentials (a static pod) needs the
    chart's ClusterRole bound to the group system:nodes."""
    path = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"
    rbac = "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings"
    verbs = {"list": path, "watch": f"{path}?watch=1&timeoutSeconds=1"}
    before = {v: cluster.request("api1", p, token=None, cert="node")[0] for v, p in verbs.items()}
    kc = str(cluster.dir / "node.kubeconfig")
    can_i = subprocess.run([cluster.binary("kubectl"), "--kubeconfig", kc, "auth", "can-i",
                            "list", "endpointslices.discovery.k8s.io", "-n", "default"],
                           capture_output=True, text=True, timeout=30).stdout.strip()
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": "extractedprism-nodes"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                           "name": "extractedprism"},
               "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group",
                             "name": "system:nodes"}]}
    assert cluster.request("api1", rbac, method="POST", body=binding)[0] == 201
    try:
        # RBAC changes reach every apiserver through its informer: poll.
        wait_until(lambda: cluster.request("api1", path, token=None, cert="node")[0] == 200, 10)
        after = {v: cluster.request("api1", p, token=None, cert="node")[0]
                 for v, p in verbs.items()}
    finally:
        cluster.request("api1", f"{rbac}/extractedprism-nodes", method="DELETE")
    record("node credentials", default=before, kubectl_can_i_list=can_i,
           with_binding_to_system_nodes=after)
    assert before == {"list": 403, "watch": 403}, before
    assert can_i == "no"
    assert after == {"list": 200, "watch": 200}, after
