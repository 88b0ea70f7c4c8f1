"""Measure what clients see while one extractedprism instance replaces another.

Run from the repository root: ``.venv/bin/python scripts/measure_handover.py``. Every
method runs two real proxy processes on one pair of loopback ports, in front of a local
identity upstream, while a client opens a new connection every 5 ms (connect, read the
upstream's greeting, close) and 20 long-lived connections sit on the old instance:

* ``fd``: the old one runs with ``--handover-socket``; the new one starts while it runs
  and takes the listeners over; then the old one gets SIGTERM with
  ``--shutdown-drain-timeout``.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fakes.upstream import IdentityServer
from tests.process.lifecycle import (
    ClientLoop,
    HeldConnections,
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


def run_fd(up: IdentityServer, drain: float, held_n: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "handover.sock")
        extra = ("--handover-socket", path, "--shutdown-drain-timeout", f"{drain:g}s")
        old, bind, health = start_first(up.address, *extra)
        new = None
        held = HeldConnections(bind, held_n, GREETING)
        loop = ClientLoop(bind, GREETING, max_attempts=20000, max_s=120).start()
        try:
            wait_until(lambda: loop.result.ok >= 100, 30)
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
            r = loop.stop()
            times = [t - t_term for t in held.closed_at.values()]
            print(f"fd handover: attempts={r.attempts} ok={r.ok} failed={r.failed} "
                  f"{dict(r.failures)} gap={r.gap():.3f}s; successor start to old one "
                  f"stopped accepting {switch:.2f}s; old one exited {exited:.2f}s after "
                  f"SIGTERM (drain {drain:g}s); held closes: {_spread(times, drain)}")
        finally:
            loop.stop()
            held.close()
            old.reap()
            if new is not None:
                new.reap()


def run_bare(up: IdentityServer, held_n: int) -> None:
    old, bind, health = start_first(up.address)
    new = None
    held = HeldConnections(bind, held_n, GREETING)
    loop = ClientLoop(bind, GREETING, max_attempts=20000, max_s=120).start()
    try:
        wait_until(lambda: loop.result.ok >= 100, 30)
        t_term = time.monotonic()
        old.signal(signal.SIGTERM)
        old.wait(15)
        exited = time.monotonic() - t_term
        new = Proc(proxy_args(bind, health, up.address))
        wait_until(lambda: healthz_ok(health), 30)
        ready = time.monotonic() - t_term
        time.sleep(1.0)
        r = loop.stop()
        wait_until(held.all_closed, 10)
        times = [t - t_term for t in held.closed_at.values()]
        print(f"bare restart: attempts={r.attempts} ok={r.ok} failed={r.failed} "
              f"{dict(r.failures)} gap={r.gap():.3f}s; old one exited {exited:.2f}s after "
              f"SIGTERM, new one healthy {ready:.2f}s after it; held closes: "
              f"{_spread(times, 0)}")
    finally:
        loop.stop()
        held.close()
        old.reap()
        if new is not None:
            new.reap()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="fd,bare")
    ap.add_argument("--drain", type=float, default=5.0)
    ap.add_argument("--held", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    up = IdentityServer(name="up").start()
    try:
        for _ in range(args.rounds):
            for m in args.methods.split(","):
                if m == "fd":
                    run_fd(up, args.drain, args.held)
                elif m == "bare":
                    run_bare(up, args.held)
                else:
                    print(f"unknown method {m!r}", file=sys.stderr)
                    return 2
    finally:
        up.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
