"""``scripts/chaos-local --control-plane real``: the chaos schedule against real apiservers.

The control plane of scripts/controlplane (etcd and three kube-apiservers v1.34, each in
a network namespace of its own on a bridge without uplink), extractedprism in front
(``--endpoints`` api1,api2; api3 known only from the ``kubernetes`` EndpointSlice,
discovered through the proxy's own listener), and real clients through the proxy with
TLS verified as kubernetes.default.svc: Python ``kubernetes`` client GETs (keep-alive
and a fresh connection per request, retrying as client-go does), one writer patching a
ConfigMap every 0.25 s, and six ``kubectl`` watches (client-go, HTTP/2) of it that
resume from their last resourceVersion when a stream ends.

Events, in order: kill -9 of api1 and restart; SIGSTOP/SIGCONT of api2; api3 cut off
from etcd (permanent neighbour entries to a MAC nobody has) and healed; SIGTERM of api1
(one step of a rolling upgrade) and restart; etcd down for 10 s. Each prints a report
and PASS/FAIL lines (bounds from the flags plus one stated slack); the run exits 0 only
if every line passed. Everything it made is removed on exit, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epscripts.chaos.bounds import DRAIN, INTERVAL, TIMEOUT, check_excluded
from epscripts.controlplane import host as cphost
from epscripts.controlplane.plane import ControlPlane, down_stale
from tests.controlplane import harness
from tests.controlplane.harness import Load, Sampler, Watcher, Writer, mono

# The proxy's timing flags are the local run's (bounds.py); the slack is larger here.
SLACK = 1.5  # once per bound: sampling period, process start, a shared 2-core machine
ETCD_OUTAGE = 10.0


@dataclass
class Outcome:
    name: str
    lines: list[str] = field(default_factory=list)
    checks: list[tuple[bool, str]] = field(default_factory=list)

    def check(self, ok: bool, text: str) -> None:
        self.checks.append((bool(ok), text))


def excluded(s: harness.Sample, addr: str) -> bool:
    u = s.ups.get(addr)
    return u is None or not u["healthy"] or u["draining"] or u["readiness"] != "ready"


def ready(s: harness.Sample, addr: str) -> bool:
    return not excluded(s, addr)


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cp: Any = None
        self.work = Path(tempfile.mkdtemp(prefix="ep-chaos-real-"))
        self.proxy: harness.Proxy | None = None
        self.sampler: Sampler | None = None
        self.load: Load | None = None
        self.writer: Writer | None = None
        self.watchers: list[Watcher] = []
        self.outcomes: list[Outcome] = []
        self.namespace = f"ep-chaos-{secrets.token_hex(3)}"

    # -- set-up ---------------------------------------------------------------------

    def setup(self) -> None:
        t0 = mono()
        cphost.cpbuild.build()
        self.cp = ControlPlane.create(owner_pid=os.getpid())
        took = self.cp.up()
        cp = self.cp
        print(f"control plane: kube-apiserver {cphost.cpbuild.KUBERNETES_VERSION}, etcd "
              f"{cphost.cpbuild.ETCD_VERSION}, up in {took:.1f} s; "
              + ", ".join(f"{a}={cp.endpoint(a)}" for a in cphost.APISERVERS)
              + f"; etcd {cp.ip('etcd')} (run {cp.id}, subnet {cp.state['subnet']})", flush=True)
        self.proxy = harness.start_proxy(
            cp, self.work, interval=INTERVAL, timeout=TIMEOUT, drain=f"{DRAIN:g}s",
            endpoints=[cp.endpoint("api1"), cp.endpoint("api2")], name="proxy")
        self.wait_all_ready(30)
        print(f"proxy 127.0.0.1:{self.proxy.port} (pid {self.proxy.proc.pid}), health "
              f":{self.proxy.health_port}; api3 known only from the EndpointSlice", flush=True)
        status, body = cp.request("api1", "/api/v1/namespaces", method="POST", body={
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": self.namespace}})
        if status != 201:
            raise RuntimeError(f"creating namespace {self.namespace}: {status} {body}")
        token = cp.token()
        self.writer = Writer(self.proxy.port, cp.ca, token, self.namespace)
        self.writer.create()
        for i in range(6):
            w = self.proxy.watcher(self.namespace, f"w{i}").start()
            if not w.first_event.wait(30):
                raise RuntimeError(f"kubectl watch {w.name} got no first event: {w.ends}")
            self.watchers.append(w)
        self.sampler = Sampler(self.proxy.health_port, direct=self._direct).start()
        self.load = Load(self.proxy.port, cp.ca, token, keepalive=2, fresh=2).start()
        self.writer.start()
        print(f"load: 2 keep-alive + 2 fresh-connection GET clients, 1 writer (every "
              f"{self.writer.period:g} s), 6 kubectl watches; set-up {mono() - t0:.1f} s",
              flush=True)

    def _direct(self) -> dict[str, Any]:
        target = getattr(self, "direct_target", None)
        return {"readyz": self.cp.readyz(target, timeout=TIMEOUT)} if target else {}

    def wait_all_ready(self, timeout: float) -> float:
        assert self.proxy is not None
        t0 = mono()
        while mono() - t0 < timeout:
            try:
                ups = self.proxy.upstreams()
            except OSError:
                ups = {}
            if all(a in ups and ups[a]["healthy"] and not ups[a]["draining"]
                   and ups[a]["readiness"] == "ready" for a in self.cp.endpoints):
                return mono() - t0
            time.sleep(0.1)
        raise RuntimeError(f"upstreams not all ready within {timeout:g}s")

    def stats(self) -> tuple[int, int, int]:
        assert self.load is not None and self.writer is not None
        return self.load.stats.ok, self.load.stats.failed, self.writer.failed

    def gaps(self, t0: float, t1: float) -> float:
        return max(w.max_gap(t0, t1) for w in self.watchers)

    def ends_between(self, t0: float, t1: float) -> int:
        return sum(1 for w in self.watchers for e in w.ends if t0 <= e.at <= t1)

    # -- teardown -------------------------------------------------------------------

    def cleanup(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for thing in (self.writer, self.load, *self.watchers, self.sampler, self.proxy):
            if thing is not None:
                with contextlib.suppress(Exception):
                    thing.stop()
        if self.cp is not None:
            with contextlib.suppress(Exception):
                self.cp.down()
            with contextlib.suppress(Exception):
                shutil.rmtree(self.cp.dir, ignore_errors=True)
        if not self.args.keep:
            shutil.rmtree(self.work, ignore_errors=True)
        else:
            print(f"kept {self.work} (proxy log)")


def event(run: Run, name: str, inject: Callable[[Outcome, float], None]) -> Outcome:
    out = Outcome(name)
    ok0, failed0, wfailed0 = run.stats()
    t0 = mono()
    inject(out, t0)
    t1 = mono()
    ok1, failed1, wfailed1 = run.stats()
    out.lines.append(f"client requests: {ok1 - ok0 + failed1 - failed0} ({failed1 - failed0} "
                     f"failed); writes failed: {wfailed1 - wfailed0}; watch streams ended: "
                     f"{run.ends_between(t0, t1)}; longest watch gap: {run.gaps(t0, t1):.2f} s")
    return out


def check_watch_gap(run: Run, out: Outcome, t0: float, tag: str) -> None:
    """Every watch kept receiving events since t0: a watch on the lost apiserver may wait
    one dial timeout for its successor, plus the writer's period between events."""
    gap = run.gaps(t0, mono())
    bound = TIMEOUT + run.writer.period + SLACK  # type: ignore[union-attr]
    out.check(gap <= bound, f"{tag}: every watch kept receiving events (longest gap "
              f"{gap:.2f} s <= {bound:g} s)")


def ev_kill(run: Run) -> Outcome:
    cp, sampler = run.cp, run.sampler
    assert sampler is not None
    api, addr = "api1", run.cp.endpoint("api1")

    def inject(out: Outcome, t0: float) -> None:
        failed0 = run.stats()[1]
        cp.kill(api)
        s = sampler.wait_for(lambda x: not x.ups.get(addr, {}).get("healthy", False), t0, 30,
                             f"{addr} excluded")
        hold_until = mono() + INTERVAL
        while mono() < hold_until:
            time.sleep(0.1)
        cp.start(api)
        cp.wait_ready([api], timeout=90)
        back = run.wait_all_ready(60)
        excl = s.t - t0
        out.lines.append(f"excluded (healthy=false in /upstreams): +{excl:.2f} s; restarted "
                         f"and ready in the proxy {back:.2f} s after its own /readyz passed")
        out.check(excl <= 2 * INTERVAL + SLACK,
                  f"kill-9: excluded within two intervals (+{excl:.2f} s <= "
                  f"{2 * INTERVAL:g} s + {SLACK:g} s slack)")
        failed = run.stats()[1] - failed0
        out.check(failed == 0, f"kill-9: zero failed client requests ({failed} failed)")
        check_watch_gap(run, out, t0, "kill-9")

    return event(run, f"kill -9 {api} ({addr}), then restart", inject)


def ev_freeze(run: Run) -> Outcome:
    cp, sampler, load = run.cp, run.sampler, run.load
    assert sampler is not None and load is not None
    api, addr = "api2", cp.endpoint("api2")

    def inject(out: Outcome, t0: float) -> None:
        base = sorted(d for t, d in load.stats.fresh_latencies if t0 - 10 <= t < t0)
        p50 = base[len(base) // 2] if base else 0.0
        cp.stop(api)
        try:
            s = sampler.wait_for(lambda x: excluded(x, addr), t0, 30, f"{addr} excluded")
            n = len(load.stats.fresh_latencies)
            deadline = mono() + 30
            while len(load.stats.fresh_latencies) < n + 20 and mono() < deadline:
                time.sleep(0.1)
        finally:
            cp.cont(api)
        run.wait_all_ready(60)
        excl = s.t - t0
        waits = [d for t, d in load.stats.fresh_latencies if t >= t0]
        longest = max(waits, default=0.0)
        out.lines.append(f"excluded: +{excl:.2f} s; {len(waits)} fresh connections while "
                         f"frozen, longest {longest:.2f} s (baseline median {p50:.3f} s)")
        check_excluded(out, "freeze", excl, SLACK)
        bound = TIMEOUT + p50 + SLACK
        out.check(longest <= bound, f"freeze: new connections waited at most one dial "
                  f"timeout (longest {longest:.2f} s <= {TIMEOUT:g} s + {p50:.3f} s + "
                  f"{SLACK:g} s slack)")

    return event(run, f"SIGSTOP {api} ({addr}), then SIGCONT", inject)


def ev_partition(run: Run) -> Outcome:
    cp, sampler = run.cp, run.sampler
    assert sampler is not None
    api, addr = "api3", cp.endpoint("api3")

    def inject(out: Outcome, t0: float) -> None:
        run.direct_target = api  # type: ignore[attr-defined]
        try:
            cp.partition_etcd(api)
            # Failing as a probe sees it: not 200 within one --health-timeout.
            s_fail = sampler.wait_for(lambda x: "readyz" in x.direct
                                      and x.direct["readyz"] != 200, t0, 60,
                                      f"{api}'s /readyz failing")
            s_un = sampler.wait_for(lambda x: excluded(x, addr), t0, 60, f"{addr} unready")
            marked = s_un.ups.get(addr, {})
            s_cl = sampler.wait_for(
                lambda x: x.ups.get(addr, {}).get("active_connections", 1) == 0, s_un.t,
                DRAIN + INTERVAL + SLACK + 10, f"{addr}'s connections closed")
            hold = mono() + INTERVAL
            while mono() < hold:
                time.sleep(0.1)
            later = sampler.samples[-1].ups.get(addr, {})
            cp.heal(api)
        finally:
            run.direct_target = None  # type: ignore[attr-defined]
        run.wait_all_ready(60)
        un = s_un.t - s_fail.t
        closed = s_cl.t - s_un.t
        new = later.get("total_connections", 0) - marked.get("total_connections", 0)
        out.lines.append(f"its own /readyz failed +{s_fail.t - t0:.2f} s; unready in the "
                         f"proxy {un:.2f} s later with {marked.get('active_connections')} "
                         f"connections, closed {closed:.2f} s after that")
        out.check(un <= 2 * INTERVAL + TIMEOUT + SLACK,
                  f"partition: unready within two intervals plus one timeout of its /readyz "
                  f"failing ({un:.2f} s <= {2 * INTERVAL + TIMEOUT:g} s + {SLACK:g} s)")
        out.check(closed <= DRAIN + INTERVAL + SLACK,
                  f"partition: its connections closed within drain-timeout plus one interval "
                  f"({closed:.2f} s <= {DRAIN + INTERVAL:g} s + {SLACK:g} s)")
        out.check(new == 0, f"partition: no new connection went to it once marked ({new} did)")

    return event(run, f"{api} ({addr}) cut off from etcd, then healed", inject)


def ev_term(run: Run) -> Outcome:
    cp, sampler = run.cp, run.sampler
    assert sampler is not None
    api, addr = "api1", cp.endpoint("api1")

    def inject(out: Outcome, t0: float) -> None:
        failed0, wfailed0 = run.stats()[1], run.stats()[2]
        cp.term(api)
        if not cp.wait_exit(api, 90):
            raise RuntimeError(f"{api} did not exit within 90 s of SIGTERM")
        t_exit = mono()
        cp.start(api)
        cp.wait_ready([api], timeout=90)
        run.wait_all_ready(60)
        s = sampler.first(lambda x: excluded(x, addr), t0)
        out.lines.append(f"excluded +{(s.t - t0) if s else float('nan'):.2f} s; exited after "
                         f"{t_exit - t0:.2f} s (it waits for its watches, which the proxy "
                         f"closes --drain-timeout after marking it unready)")
        failed = run.stats()[1] - failed0
        wfailed = run.stats()[2] - wfailed0
        out.check(failed == 0 and wfailed == 0, f"sigterm: zero failed client requests "
                  f"({failed} reads, {wfailed} writes failed)")
        check_watch_gap(run, out, t0, "sigterm")

    return event(run, f"SIGTERM {api} ({addr}) (a rolling-upgrade step), then start", inject)


def ev_etcd(run: Run) -> Outcome:
    cp, sampler = run.cp, run.sampler
    assert sampler is not None

    def inject(out: Outcome, t0: float) -> None:
        cp.etcd_down()
        s_all = sampler.wait_for(lambda x: all(excluded(x, a) for a in cp.endpoints), t0,
                                 ETCD_OUTAGE, "every upstream unready")
        while mono() < t0 + ETCD_OUTAGE:
            time.sleep(0.1)
        t_up = mono()
        cp.etcd_up()
        run.wait_all_ready(90)
        t_end = mono()
        first = sampler.first(lambda x: any(ready(x, a) for a in cp.endpoints), t_up)
        t_first = first.t if first else t_end
        window = list(sampler.window(t0, t_end))
        rz = sorted({str(x.readyz) for x in window})
        drained = sorted({a for x in sampler.window(t0, t_first) for a, u in x.ups.items()
                          if u["draining"]})
        during = run.ends_between(t0, t_first)
        after = run.ends_between(t_first, t_end)
        out.lines.append(f"all unready +{s_all.t - t0:.2f} s; etcd back after "
                         f"{t_up - t0:.1f} s; the first upstream ready {t_first - t_up:.2f} s "
                         f"after that, all {t_end - t_up:.2f} s (stagger "
                         f"{t_end - t_first:.2f} s)")
        out.lines.append(f"watch streams cut by the recovery: {after} (with --drain-timeout "
                         f"{DRAIN:g}s an upstream still unready {DRAIN:g} s after another "
                         f"turned ready loses its connections, by design; the default 30 s "
                         f"covers the stagger: tests/controlplane test_etcd_down_for_10s)")
        out.check(rz == ["200"], f"etcd-down: the proxy's own /readyz stayed 200 (saw {rz})")
        out.check(not drained, f"etcd-down: nothing drained while no upstream was ready "
                  f"({drained or 'none'})")
        out.check(during == 0, f"etcd-down: no watch was cut while no upstream was ready "
                  f"({during} ended)")

    return event(run, f"etcd down for {ETCD_OUTAGE:g} s", inject)


SCHEDULE = (ev_kill, ev_freeze, ev_partition, ev_term, ev_etcd)


def main(args: argparse.Namespace) -> int:
    why = cphost.missing_prerequisites()
    if why:
        print(f"SKIP --control-plane real: {why}", flush=True)
        return 2
    for line in down_stale():
        print(line)
    run = Run(args)

    def on_term(_s: int, _f: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    budget = 0.0 if args.short else args.duration
    print(f"extractedprism chaos against a real control plane ("
          f"{'short' if args.short else f'{budget:g} s'}): --health-interval {INTERVAL:g}s "
          f"--health-timeout {TIMEOUT:g}s --drain-timeout {DRAIN:g}s --health-check readyz",
          flush=True)
    rc = 1
    try:
        run.setup()
        t_begin = mono()
        n = 0
        for _cycle in range(1000):
            for fn in SCHEDULE:
                n += 1
                out = fn(run)
                run.outcomes.append(out)
                print(f"\n== event {n}: {out.name}")
                for line in out.lines:
                    print(f"  {line}")
                for ok, text in out.checks:
                    print(f"  {'PASS' if ok else 'FAIL'} {text}")
                sys.stdout.flush()
            if args.short or mono() - t_begin >= budget:
                break
        assert run.writer is not None and run.load is not None
        run.writer.stop()
        final = max((s for _, s, _ in run.writer.written), default=0)
        deadline = mono() + 30
        while mono() < deadline and not all(final in w.seqs() for w in run.watchers):
            time.sleep(0.1)
        written = {s for _, s, _ in run.writer.written}
        lost = sum(len(written - w.seqs()) for w in run.watchers)
        stats = run.load.stop()
        checks = [c for o in run.outcomes for c in o.checks]
        checks.append((lost == 0, f"watches: every write reached every watch ({len(written)} "
                       f"writes x {len(run.watchers)} watches, {lost} missing)"))
        print(f"\nload: {stats.ok + stats.failed} client requests ({stats.failed} failed), "
              f"{run.writer.ok} writes ({run.writer.failed} failed), "
              f"{sum(len(w.ends) for w in run.watchers)} watch streams resumed, "
              f"{mono() - t_begin:.1f} s")
        print("\n== summary")
        for ok, text in checks:
            print(f"{'PASS' if ok else 'FAIL'} {text}")
        failed = sum(not ok for ok, _ in checks)
        print(f"RESULT: {'PASS' if not failed else 'FAIL'} ({len(checks) - failed} passed, "
              f"{failed} failed)", flush=True)
        rc = 0 if not failed else 1
    except KeyboardInterrupt:
        print("\ninterrupted: cleaning up", flush=True)
        rc = 130
    finally:
        run.cleanup()
    return rc
