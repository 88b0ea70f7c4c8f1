"""One API-server-like TLS upstream in its own process, for the local chaos harness.

scripts/chaos-local needs upstreams it can ``kill -9``, freeze with SIGSTOP and run
inside a network namespace, so each one is a process of its own (the FakeUpstream of
tests/fakes/upstream.py, which otherwise runs as threads of the test process).

Control channel (signals, so it works across ``ip netns exec`` too):
  SIGUSR1  /readyz answers 500 from now on (an API server that lost etcd quorum)
  SIGUSR2  /readyz answers 200 again
  SIGTERM / SIGINT  stop cleanly

stdout, one line each, flushed (the harness reads it):
  LISTENING <host:port> <pid>
  READYZ <time.monotonic()> <status>     after every /readyz answer
CLOCK_MONOTONIC is system-wide on Linux, so the harness can compare these times with
its own.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import trustme

from tests.fakes.upstream import FakeUpstream

_out_lock = threading.Lock()


def emit(line: str) -> None:
    with _out_lock:
        try:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
        except (BrokenPipeError, ValueError):
            pass  # the harness went away; keep serving until we are told to stop


class ChaosUpstream(FakeUpstream):
    """A FakeUpstream that reports the time and status of every /readyz answer."""

    def _route(self, conn: socket.socket, method: str, route: str, body: bytes,
               keep_alive: bool) -> bool:
        status = self.ready_status
        more = super()._route(conn, method, route, body, keep_alive)
        if route == "/readyz":
            emit(f"READYZ {time.monotonic():.6f} {status}")
        return more


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--ca-cert", required=True, help="PEM of the CA that signs the server cert")
    ap.add_argument("--ca-key", required=True, help="PEM private key of that CA")
    ap.add_argument("--watch-interval", type=float, default=0.1)
    ap.add_argument("--max-seconds", type=float, default=3 * 3600,
                    help="exit by itself after this long, should the harness vanish")
    args = ap.parse_args()

    ca = trustme.CA.from_pem(Path(args.ca_cert).read_bytes(), Path(args.ca_key).read_bytes())
    up = ChaosUpstream(host=args.host, port=args.port, ca=ca, name=args.name,
                       watch_interval=args.watch_interval)
    stop = threading.Event()

    def on_ready_fail(_s: int, _f: object) -> None:
        up.set_ready_status(500)

    def on_ready_ok(_s: int, _f: object) -> None:
        up.set_ready_status(200)

    def on_stop(_s: int, _f: object) -> None:
        stop.set()

    signal.signal(signal.SIGUSR1, on_ready_fail)
    signal.signal(signal.SIGUSR2, on_ready_ok)
    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    up.start()
    emit(f"LISTENING {up.address} {os.getpid()}")
    # The harness always sends SIGTERM (or SIGKILL) when done; --max-seconds is the
    # backstop should it die without cleaning up.
    deadline = time.monotonic() + args.max_seconds
    while not stop.wait(0.5) and time.monotonic() < deadline:
        pass
    up.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
