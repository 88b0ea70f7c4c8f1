"""Measure what clients see while one extractedprism instance replaces another.

Run as ``scripts/bench handover``. Every
method runs two real proxy processes on one pair of loopback ports, in front of a local
identity upstream, while a client opens a new connection every 5 ms (connect, read the
upstream's greeting, close) and 20 long-lived connections sit on the old instance:

* ``fd``: the old one runs with ``--handover-socket``; the new one starts while it runs
  and takes the listeners over; then the old one gets SIGTERM with
  ``--shutdown-drain-timeout``.
* ``reuseport``: for comparison, not the product: two minimal servers (``_REUSEPORT_SERVER``
  below) on one port with SO_REUSEPORT, each with its own listening socket and accept
  queue; the old one closes its socket while the new one runs.
* ``bare``: SIGTERM to the old one (the spec's shutdown), the new one started as soon as
  it has exited (what a DaemonSet without surge does, at best).

Prints, per method: attempts, failures by kind, the gap (first to last failed attempt),
and when the long-lived connections were closed (relative to the old one's SIGTERM).
Traffic stays on 127.0.0.1; every loop is bounded.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

from tests.fakes.upstream import IdentityServer
from tests.process.lifecycle import (
    ClientLoop,
    HeldConnections,
    LoopResult,
    Proc,
    healthz_ok,
    max_in_any_window,
    proxy_args,
    start_first,
)
from tests.util import wait_until

GREETING = b"up\n"


def _spread(times: list[float], window: float) -> str:
    if not times:
        return "none"
    ts = sorted(times)
    return (f"first {ts[0]:.2f}s, last {ts[-1]:.2f}s, most in any tenth of the window "
            f"{max_in_any_window(ts, window / 10) if window else len(ts)}/{len(ts)}")


def _loops(port: int, clients: int, every: float) -> list[ClientLoop]:
    return [ClientLoop(port, GREETING, every=every, max_attempts=20000, max_s=120).start()
            for _ in range(clients)]


def _stop(loops: list[ClientLoop]) -> LoopResult:
    total = LoopResult()
    for loop in loops:
        r = loop.stop()
        total.attempts += r.attempts
        total.ok += r.ok
        total.failures.update(r.failures)
        total.failed_at.extend(r.failed_at)
    total.failed_at.sort()
    return total


def run_fd(up: IdentityServer, drain: float, held_n: int, clients: int, every: float
           ) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "handover.sock")
        extra = ("--handover-socket", path, "--shutdown-drain-timeout", f"{drain:g}s")
        old, bind, health = start_first(up.address, *extra)
        new = None
        held = HeldConnections(bind, held_n, GREETING)
        loops = _loops(bind, clients, every)
        try:
            wait_until(lambda: loops[0].result.ok >= 100, 30)
            t_start = time.monotonic()
            new = Proc(proxy_args(bind, health, up.address, *extra))
            wait_until(lambda: old.saw("a successor accepts now"), 30)
            switch = time.monotonic() - t_start
            time.sleep(1.0)
            t_term = time.monotonic()
            old.signal(signal.SIGTERM)
            old.wait(drain + 15)
            exited = time.monotonic() - t_term
            wait_until(held.all_closed, 10)
            time.sleep(0.5)
            r = _stop(loops)
            times = [t - t_term for t in held.closed_at.values()]
            print(f"fd handover: attempts={r.attempts} ok={r.ok} failed={r.failed} "
                  f"{dict(r.failures)} gap={r.gap():.3f}s; successor start to old one "
                  f"stopped accepting {switch:.2f}s; old one exited {exited:.2f}s after "
                  f"SIGTERM (drain {drain:g}s); held closes: {_spread(times, drain)}")
        finally:
            _stop(loops)
            held.close()
            old.reap()
            if new is not None:
                new.reap()


def run_bare(up: IdentityServer, held_n: int, clients: int, every: float) -> None:
    old, bind, health = start_first(up.address)
    new = None
    held = HeldConnections(bind, held_n, GREETING)
    loops = _loops(bind, clients, every)
    try:
        wait_until(lambda: loops[0].result.ok >= 100, 30)
        t_term = time.monotonic()
        old.signal(signal.SIGTERM)
        old.wait(15)
        exited = time.monotonic() - t_term
        new = Proc(proxy_args(bind, health, up.address))
        wait_until(lambda: healthz_ok(health), 30)
        ready = time.monotonic() - t_term
        time.sleep(1.0)
        r = _stop(loops)
        wait_until(held.all_closed, 10)
        times = [t - t_term for t in held.closed_at.values()]
        print(f"bare restart: attempts={r.attempts} ok={r.ok} failed={r.failed} "
              f"{dict(r.failures)} gap={r.gap():.3f}s; old one exited {exited:.2f}s after "
              f"SIGTERM, new one healthy {ready:.2f}s after it; held closes: "
              f"{_spread(times, 0)}")
    finally:
        _stop(loops)
        held.close()
        old.reap()
        if new is not None:
            new.reap()


_REUSEPORT_SERVER = r"""
import signal, socket, sys, threading, os
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen(1024)
print("listening", flush=True)
def stop(*_):
    s.close()  # the connections queued on this socket are reset here
    os._exit(0)
signal.signal(signal.SIGTERM, stop)
while True:
    c, _ = s.accept()
    c.sendall(b"up\n")
    c.close()
"""


def run_reuseport(clients: int, every: float) -> None:
    import subprocess

    from tests.util import PYTHON, free_port

    port = free_port()
    procs = []
    try:
        old = subprocess.Popen([PYTHON, "-c", _REUSEPORT_SERVER, str(port)],
                               stdout=subprocess.PIPE, text=True)
        procs.append(old)
        assert old.stdout is not None and old.stdout.readline().startswith("listening")
        loops = _loops(port, clients, every)
        wait_until(lambda: loops[0].result.ok >= 100, 30)
        new = subprocess.Popen([PYTHON, "-c", _REUSEPORT_SERVER, str(port)],
                               stdout=subprocess.PIPE, text=True)
        procs.append(new)
        assert new.stdout is not None and new.stdout.readline().startswith("listening")
        time.sleep(1.0)
        old.send_signal(signal.SIGTERM)
        old.wait(10)
        time.sleep(1.0)
        r = _stop(loops)
        print(f"SO_REUSEPORT restart (minimal servers): attempts={r.attempts} ok={r.ok} "
              f"failed={r.failed} {dict(r.failures)} gap={r.gap():.3f}s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            if p.stdout is not None:
                p.stdout.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench handover",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="fd,bare")
    ap.add_argument("--drain", type=float, default=5.0)
    ap.add_argument("--held", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--clients", type=int, default=1,
                    help="client loops in parallel (each a new connection every --every s)")
    ap.add_argument("--every", type=float, default=0.005)
    args = ap.parse_args(argv)
    up = IdentityServer(name="up").start()
    try:
        for _ in range(args.rounds):
            for m in args.methods.split(","):
                if m == "fd":
                    run_fd(up, args.drain, args.held, args.clients, args.every)
                elif m == "reuseport":
                    run_reuseport(args.clients, args.every)
                elif m == "bare":
                    run_bare(up, args.held, args.clients, args.every)
                else:
                    print(f"unknown method {m!r}", file=sys.stderr)
                    return 2
    finally:
        up.stop()
    return 0
