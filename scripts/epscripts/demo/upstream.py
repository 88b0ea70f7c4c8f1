"""One demo API server in a process of its own, so the demo can show a real failover:
``kill`` this process and watch extractedprism move the traffic.

Prints ``listening <host:port>`` once it accepts connections, then serves until SIGTERM
or SIGINT. The serving certificate is signed by the CA given as two PEM files, so the
proxy's one --health-check-ca-file verifies every demo upstream.
"""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path

import trustme

from tests.fakes.upstream import FakeUpstream


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--name", required=True)
    ap.add_argument("--ca-cert", required=True, help="CA certificate (PEM)")
    ap.add_argument("--ca-key", required=True, help="CA private key (PEM)")
    args = ap.parse_args()
    ca = trustme.CA.from_pem(Path(args.ca_cert).read_bytes(), Path(args.ca_key).read_bytes())
    stop = threading.Event()

    def on_signal(_s: int, _f: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    up = FakeUpstream(name=args.name, ca=ca).start()
    print(f"listening {up.address}", flush=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        up.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
