"""Local chaos harness: kill, freeze, unready, remove and partition API servers on one machine.

Three API-server-like TLS upstreams (chaos/upstream.py, each its own process),
a fake kube-apiserver serving the ``kubernetes`` EndpointSlice (in this process), and
extractedprism in front with ``--health-check=readyz`` and discovery through that fake
API server. A bounded client load runs through the proxy the whole time, on loopback:

* watch clients: long-lived ``GET /watch`` streams (one chunk per tick, sequence-checked);
* stream clients: long-lived keep-alive connections doing ``POST /echo`` (bytes checked);
* short clients: one ``POST /echo`` per new TCP+TLS connection (bytes checked).

Upstreams (one port P for all, as one EndpointSlice port requires):
  a = 127.0.0.2:P (static + slice)   b = 127.0.0.3:P (static + slice)
  c = slice only: 10.x.y.2:P inside a network namespace this script creates (a veth
      pair with a /30 of its own), or 127.0.0.4:P when namespaces are not available.

Events, in order: kill -9 of a and its restart; SIGSTOP/SIGCONT of b; /readyz of a
switched to 500 and back; c removed from and re-added to the EndpointSlice; c's link
taken down inside its namespace (SYNs go unanswered) and back up. Each event prints a
report and PASS/FAIL lines for the criteria of issue 7 (see docs/chaos.md); the run
exits 0 only when every line passed.

--short runs the schedule once with the shortest holds that still cover every bound
(about a minute); --duration (default 10 minutes) repeats it with longer holds.
Only loopback and addresses inside this script's own namespace are ever contacted;
every loop is bounded in count and time; processes, the namespace, the veth pair and
the route this script adds are removed on exit, also on Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import sys
import time
from collections.abc import Callable

from epscripts.chaos.bounds import CLIENT_TIMEOUT, DRAIN, INTERVAL, TIMEOUT
from epscripts.chaos.events import ev_freeze, ev_kill, ev_partition, ev_readyz, ev_slice
from epscripts.chaos.harness import Check, Harness, Outcome
from epscripts.chaos.load import mono


def main() -> int:
    ap = argparse.ArgumentParser(prog="scripts/chaos-local", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--short", action="store_true",
                    help="one pass of the schedule, about a minute (CI)")
    ap.add_argument("--duration", type=float, default=600.0,
                    help="seconds to keep repeating the schedule (default 600)")
    ap.add_argument("--no-netns", action="store_true",
                    help="skip the network-partition event (no namespace is created)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir with the proxy log")
    ap.add_argument("--control-plane", choices=("standin", "real"), default="standin",
                    help="standin: the upstreams above (default); real: etcd and three "
                    "kube-apiservers of scripts/controlplane, with its own schedule "
                    "(chaos/real.py; needs root, ip netns and the built binaries)")
    args = ap.parse_args()
    if args.duration <= 0 or args.duration > 24 * 3600:
        ap.error("--duration must be in (0, 86400] seconds")
    if args.control_plane == "real":
        # Imported only here: it needs the kubernetes client and tests.controlplane.
        from epscripts.chaos import real

        return real.main(args)

    def on_term(_s: int, _f: object) -> None:
        raise KeyboardInterrupt

    # Explicit for SIGINT too: a shell that starts us in the background ignores SIGINT,
    # and Python then installs no KeyboardInterrupt handler of its own.
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    h = Harness(args)
    rc = 1
    try:
        rc = run(h)
    except KeyboardInterrupt:
        print("\ninterrupted: cleaning up", flush=True)
        rc = 130
    finally:
        cleanup(h, keep=args.keep or rc != 0)
    return rc


def run(h: Harness) -> int:
    args = h.args
    hold = 0.0 if args.short else 10.0
    budget = 60.0 if args.short else args.duration
    print(f"extractedprism local chaos ({'short' if args.short else f'{budget:g} s'}): "
          f"--health-interval {INTERVAL:g}s --health-timeout {TIMEOUT:g}s "
          f"--drain-timeout {DRAIN:g}s --health-check readyz", flush=True)
    h.setup()
    assert h.proxy is not None
    print(f"upstreams: {', '.join(f'{u.name}={u.address}' for u in h.ups.values())}; "
          f"proxy 127.0.0.1:{h.bind_port} (pid {h.proxy.pid}), health :{h.health_port}",
          flush=True)
    if h.netns_skip:
        print(f"SKIP partition: {h.netns_skip}; apiserver-c runs on loopback instead",
              flush=True)
    else:
        assert h.netns is not None
        print(f"partition: apiserver-c in namespace {h.netns.name} ({h.netns.net}), "
              f"veth {h.netns.host_if}", flush=True)
    # Warm-up: the same load for a moment, so the pipe pool and its kernel pipes exist
    # before the starting level is taken.
    warm = h.run_load(3.0)
    for t in warm.threads:
        t.join(3.0 + CLIENT_TIMEOUT + 5)
    warm.finish()
    h.wait_no_connections(10)
    start = h.stats_min()
    print(f"proxy at rest: threads {start['threads']}, fds {start['fds']} (sockets "
          f"{start['sockets']}, pipes {start['pipes']}), RSS {start['rss_kib'] / 1024:.1f} MiB",
          flush=True)
    t_begin = mono()
    # The load outlives the schedule by at most one event's length; finish() stops it.
    h.load = h.run_load(budget + 120.0)
    schedule: list[tuple[str, Callable[[Harness, float], Outcome]]] = [
        ("kill", ev_kill), ("freeze", ev_freeze), ("readyz", ev_readyz),
        ("slice", ev_slice)]
    if h.netns is not None:
        schedule.append(("partition", ev_partition))
    n = 0
    for _cycle in range(1000):
        for _key, fn in schedule:
            n += 1
            out = fn(h, hold)
            h.outcomes.append(out)
            print_outcome(n, out)
            if args.short:
                continue
            if mono() - t_begin >= budget:
                break
        if args.short or mono() - t_begin >= budget:
            break
    h.load.finish()
    drained = h.wait_no_connections(15)
    # Pipe threads start on demand and those beyond the pool's warm ones retire after
    # 10 s idle (datapath/pool.py): give them that long, and a margin, to leave.
    settle_until = mono() + 20.0
    end = h.stats_min()
    while end["threads"] > start["threads"] and mono() < settle_until:
        time.sleep(0.5)
        end = h.stats_min()
    ok_threads = end["threads"] <= start["threads"]
    sock_start, sock_end = start["sockets"], end["sockets"]
    other_start = start["fds"] - start["sockets"] - start["pipes"]
    other_end = end["fds"] - end["sockets"] - end["pipes"]
    print(f"\nproxy at rest after the load: threads {end['threads']}, fds {end['fds']} "
          f"(sockets {end['sockets']}, pipes {end['pipes']}), RSS "
          f"{end['rss_kib'] / 1024:.1f} MiB; connections drained: {drained}", flush=True)
    h.global_checks.append(Check(ok_threads, f"resources: proxy threads back to the starting "
                                 f"level ({start['threads']} -> {end['threads']})"))
    h.global_checks.append(Check(sock_end <= sock_start and other_end <= other_start,
                                 f"resources: proxy fds back to the starting level (sockets "
                                 f"{sock_start} -> {sock_end}, other {other_start} -> "
                                 f"{other_end}; kernel pipes {start['pipes']} -> "
                                 f"{end['pipes']} are the pool threads' splice pipes)"))
    total_bytes = h.rec.bytes_checked
    h.global_checks.append(Check(not h.rec.corrupt and total_bytes > 0,
                                 f"integrity: every byte sent was received intact "
                                 f"({total_bytes} bytes checked, {len(h.rec.corrupt)} "
                                 f"corruptions)"))
    for when, what in h.rec.corrupt[:10]:
        print(f"  corruption at +{when - t_begin:.2f} s: {what}")
    atts = h.attempts()
    print(f"load: {len(atts)} connections ({sum(a.kind == 'short' for a in atts)} short), "
          f"{sum(not a.ok for a in atts)} failed, {total_bytes} bytes checked, "
          f"{mono() - t_begin:.1f} s", flush=True)
    return summary(h)


def print_outcome(n: int, out: Outcome) -> None:
    print(f"\n== event {n}: {out.name}", flush=True)
    for line in out.lines:
        print(f"  {line}")
    for c in out.checks:
        print(f"  {'PASS' if c.ok else 'FAIL'} {c.text}")
    sys.stdout.flush()


def summary(h: Harness) -> int:
    checks = [c for o in h.outcomes for c in o.checks] + h.global_checks
    print("\n== summary")
    if h.netns_skip:
        print(f"SKIP partition: {h.netns_skip}")
    for c in checks:
        print(f"{'PASS' if c.ok else 'FAIL'} {c.text}")
    failed = sum(not c.ok for c in checks)
    print(f"RESULT: {'PASS' if not failed else 'FAIL'} ({len(checks) - failed} passed, "
          f"{failed} failed)", flush=True)
    return 0 if checks and not failed else 1


def cleanup(h: Harness, keep: bool) -> None:
    # A second Ctrl-C must not cut the clean-up short.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # In this order (the load stops before its upstreams go, the partition heals before
    # its upstream is signalled), and each step on its own: a failure in one must not
    # leave the others behind.
    steps: list[Callable[[], object]] = []
    if h.load is not None:
        steps.append(h.load.stop.set)
    if h.monitor is not None:
        steps.append(h.monitor.halt.set)
    if h.netns is not None:
        steps.append(h.netns.heal)
    steps += [up.terminate for up in h.ups.values()]
    steps += [x.stop for x in (h.proxy, h.api) if x is not None]
    if h.netns is not None:
        steps.append(h.netns.cleanup)
    if h.load is not None:
        steps.append(h.load.finish)
    for step in steps:
        with contextlib.suppress(Exception):
            step()
    if keep:
        print(f"logs kept in {h.tmp}", flush=True)
    else:
        shutil.rmtree(h.tmp, ignore_errors=True)
