"""A client on a real node: a new TLS connection every ``--every`` seconds through the
node's 127.0.0.1:PORT to the API servers, ``GET /readyz`` on each; run inside the node's
network namespace (``nsenter --net``) until ``--stop-file`` appears or ``--max-s`` pass.

Prints one JSON line at the end: attempts, ok, failures by kind ("refused", "reset",
"timeout", "tls", "http <status>", ...), the time from the first failure to the last, and
the wall time and kind of the first 50 failures. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import ssl
import time
from collections import Counter


def one(port: int, ctx: ssl.SSLContext, server_name: str, timeout: float) -> str:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as raw:
            raw.settimeout(timeout)
            with ctx.wrap_socket(raw, server_hostname=server_name) as s:
                s.sendall(b"GET /readyz HTTP/1.1\r\nHost: " + server_name.encode()
                          + b"\r\nConnection: close\r\n\r\n")
                head = b""
                while b"\r\n" not in head:
                    chunk = s.recv(4096)
                    if not chunk:
                        return "closed before an answer"
                    head += chunk
                status = head.split(b"\r\n", 1)[0].split()
                return "ok" if len(status) > 1 and status[1] == b"200" else (
                    f"http {status[1].decode(errors='replace') if len(status) > 1 else '?'}")
    except ConnectionRefusedError:
        return "refused"
    except ConnectionResetError:
        return "reset"
    except TimeoutError:
        return "timeout"
    except ssl.SSLError as exc:
        return f"tls {exc.reason}"
    except OSError as exc:
        return f"error {exc.errno}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ca", required=True)
    p.add_argument("--server-name", default="kubernetes.default.svc")
    p.add_argument("--every", type=float, default=0.05)
    p.add_argument("--max-s", type=float, default=300.0)
    p.add_argument("--max-attempts", type=int, default=20000)
    p.add_argument("--stop-file", required=True)
    p.add_argument("--timeout", type=float, default=5.0)
    args = p.parse_args()
    ctx = ssl.create_default_context(cafile=args.ca)
    failures: Counter[str] = Counter()
    attempts = ok = 0
    first = last = None
    failed_at: list[tuple[float, str]] = []  # wall time and kind, the first 50
    t_end = time.monotonic() + args.max_s
    while (time.monotonic() < t_end and attempts < args.max_attempts
           and not os.path.exists(args.stop_file)):
        t = time.monotonic()
        outcome = one(args.port, ctx, args.server_name, args.timeout)
        attempts += 1
        if outcome == "ok":
            ok += 1
        else:
            failures[outcome] += 1
            if len(failed_at) < 50:
                failed_at.append((round(time.time(), 2), outcome))
            first = t if first is None else first
            last = t
        time.sleep(max(0.0, args.every - (time.monotonic() - t)))
    print(json.dumps({"attempts": attempts, "ok": ok, "failures": dict(failures),
                      "gap_s": round(last - first, 2) if first is not None else 0.0,
                      "failed_at": failed_at}),
          flush=True)


if __name__ == "__main__":
    main()
