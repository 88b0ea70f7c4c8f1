"""One demo API server in a process of its own, so the demo can show a real failover:
``kill`` this process and watch extractedprism move the traffic.

Prints ``listening <host:port>`` once it accepts connections, then serves until SIGTERM
or SIGINT, or until the demo that started it is gone. The serving certificate is signed by
the CA given as two PEM files, so the proxy's one --health-check-ca-file verifies every
demo upstream. ``--port`` starts it again on the address it had.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from pathlib import Path

import trustme

from epscripts.demo import die_with_parent
from tests.fakes.upstream import FakeUpstream


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--name", required=True)
    ap.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: any free)")
    ap.add_argument("--ca-cert", required=True, help="CA certificate (PEM)")
    ap.add_argument("--ca-key", required=True, help="CA private key (PEM)")
    args = ap.parse_args()
    parent = os.getppid()
    die_with_parent()
    stop = threading.Event()
    if os.getppid() != parent:  # the demo died before prctl took effect
        return 0
    ca = trustme.CA.from_pem(Path(args.ca_cert).read_bytes(), Path(args.ca_key).read_bytes())

    def on_signal(_s: int, _f: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    up = FakeUpstream(name=args.name, port=args.port, ca=ca).start()
    print(f"listening {up.address}", flush=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        up.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
