"""The extra clients of one hollow node, run inside the node's namespace (scripts/compare).

Two clients, both through the node's balancer on 127.0.0.1:7445 and both bounded by
``--duration``:

* **a kubectl watch** of the ConfigMaps in one namespace (``kubectl get --raw`` of the
  watch URL, which streams the events as they arrive), resumed from the last
  resourceVersion it received whenever kubectl exits (its connection broke, or the
  server ended the watch); a ``410 Gone`` makes it list again and say so;
* **a request loop**: every ``--period`` seconds a GET of one ConfigMap over a new TLS
  connection (so every request is a new connection the balancer places), each with a
  ``--request-timeout``.

Every event, reconnect and request is one JSON line in ``--out``, with the receive time
(``time.time()``), for scripts/compare to read afterwards. Standard library only (it runs
with the system python3, like the rest of scripts/).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, TextIO

SERVER_NAME = "kubernetes.default.svc"
LB = ("127.0.0.1", 7445)
WATCH_TIMEOUT_S = 300  # the server ends a watch after this; it is resumed like a break
RESTART_PAUSE_S = 0.5  # between two kubectl watch attempts


class Out:
    """JSON lines to one file, from several threads."""

    def __init__(self, f: TextIO) -> None:
        self._f = f
        self._lock = threading.Lock()

    def write(self, **rec: Any) -> None:
        line = json.dumps({"t": time.time(), **rec}) + "\n"
        with self._lock:
            self._f.write(line)
            self._f.flush()


def _get(ctx: ssl.SSLContext, token: str, path: str, timeout: float) -> tuple[int, bytes]:
    """One GET over a new connection through the balancer: (status, body)."""
    with socket.create_connection(LB, timeout=timeout) as raw, \
            ctx.wrap_socket(raw, server_hostname=SERVER_NAME) as tls:
        tls.sendall((f"GET {path} HTTP/1.1\r\nHost: {SERVER_NAME}\r\n"
                     f"Authorization: Bearer {token}\r\nAccept: application/json\r\n"
                     "Connection: close\r\n\r\n").encode())
        chunks = []
        deadline = time.monotonic() + timeout
        for _ in range(10_000):  # bounded: a ConfigMap is a few hundred bytes
            if time.monotonic() > deadline:
                raise TimeoutError(f"GET {path}: no complete answer in {timeout:g}s")
            chunk = tls.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    data = b"".join(chunks)
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0
    return status, body


def request_loop(out: Out, ctx: ssl.SSLContext, token: str, path: str, period: float,
                 timeout: float, stop: threading.Event, until: float) -> None:
    for _ in range(int((until - time.monotonic()) / period) + 2):
        if stop.is_set() or time.monotonic() > until:
            return
        t0 = time.monotonic()
        try:
            status, _ = _get(ctx, token, path, timeout)
            out.write(kind="req", ok=status == 200, status=status,
                      dt=round(time.monotonic() - t0, 4))
        except (OSError, ssl.SSLError, ValueError, TimeoutError) as exc:
            out.write(kind="req", ok=False, status=0, dt=round(time.monotonic() - t0, 4),
                      err=f"{type(exc).__name__}: {exc}"[:200])
        stop.wait(max(0.0, period - (time.monotonic() - t0)))


def list_rv(ctx: ssl.SSLContext, token: str, namespace: str, timeout: float) -> str:
    status, body = _get(ctx, token, f"/api/v1/namespaces/{namespace}/configmaps?limit=1",
                        timeout)
    if status != 200:
        raise ValueError(f"list answered {status}")
    return str(json.loads(body)["metadata"]["resourceVersion"])


def watch_loop(out: Out, kubectl: str, kubeconfig: str, namespace: str, rv: str,
               ctx: ssl.SSLContext, token: str, timeout: float, stop: threading.Event,
               until: float, procs: list[subprocess.Popen[bytes]]) -> None:
    """kubectl watches, each resumed from the last resourceVersion received."""
    for attempt in range(100_000):  # bounded by `until` long before this
        if stop.is_set() or time.monotonic() > until:
            return
        url = (f"/api/v1/namespaces/{namespace}/configmaps?watch=1&allowWatchBookmarks=true"
               f"&resourceVersion={rv}&timeoutSeconds={WATCH_TIMEOUT_S}")
        out.write(kind="watch-start", attempt=attempt, rv=rv)
        proc = subprocess.Popen([kubectl, f"--kubeconfig={kubeconfig}", "get", "--raw", url],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL)
        procs.append(proc)
        gone = False
        assert proc.stdout is not None
        for line in proc.stdout:  # ends when kubectl exits (or is killed at the end)
            try:
                ev = json.loads(line)
            except ValueError:
                out.write(kind="watch-junk", line=line[:200].decode(errors="replace"))
                continue
            obj = ev.get("object") or {}
            if ev.get("type") == "ERROR":
                out.write(kind="watch-error", code=obj.get("code"),
                          msg=str(obj.get("message"))[:200])
                gone = gone or obj.get("code") == 410
                continue
            new_rv = (obj.get("metadata") or {}).get("resourceVersion")
            if new_rv:
                rv = new_rv
            if ev.get("type") == "BOOKMARK":
                out.write(kind="bookmark", rv=rv)
                continue
            data = obj.get("data") or {}
            out.write(kind="event", type=ev.get("type"),
                      name=(obj.get("metadata") or {}).get("name"),
                      seq=int(data["seq"]) if str(data.get("seq", "")).isdigit() else None,
                      rv=rv)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
        err = proc.stderr.read().decode(errors="replace")[-300:] if proc.stderr else ""
        out.write(kind="watch-end", rc=proc.returncode, stderr=err.strip())
        if gone:
            # Too old to resume: list again (events in between can be lost; the writer's
            # sequence numbers show it).
            for _ in range(20):
                if stop.is_set() or time.monotonic() > until:
                    return
                try:
                    rv = list_rv(ctx, token, namespace, timeout)
                    out.write(kind="relist", rv=rv)
                    break
                except (OSError, ssl.SSLError, ValueError, TimeoutError) as exc:
                    out.write(kind="relist-failed", err=str(exc)[:200])
                    stop.wait(1.0)
        stop.wait(RESTART_PAUSE_S)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kubectl", required=True)
    p.add_argument("--kubeconfig", required=True, help="through the node's balancer")
    p.add_argument("--ca", required=True)
    p.add_argument("--token-file", required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--configmap", required=True, help="the one the request loop GETs")
    p.add_argument("--rv", required=True, help="resourceVersion the first watch starts at")
    p.add_argument("--out", required=True)
    p.add_argument("--duration", type=float, required=True, help="seconds, at most")
    p.add_argument("--period", type=float, default=1.0)
    p.add_argument("--request-timeout", type=float, default=5.0)
    args = p.parse_args(argv)
    token = Path(args.token_file).read_text().strip()
    ctx = ssl.create_default_context(cafile=args.ca)
    stop = threading.Event()
    until = time.monotonic() + args.duration
    procs: list[subprocess.Popen[bytes]] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with open(args.out, "a") as f:
        out = Out(f)
        out.write(kind="start", pid=os.getpid())
        threads = [
            threading.Thread(target=watch_loop, name="kubectl-watch", daemon=True, args=(
                out, args.kubectl, args.kubeconfig, args.namespace, args.rv, ctx, token,
                args.request_timeout, stop, until, procs)),
            threading.Thread(target=request_loop, name="request-loop", daemon=True, args=(
                out, ctx, token, f"/api/v1/namespaces/{args.namespace}/configmaps/"
                f"{args.configmap}", args.period, args.request_timeout, stop, until)),
        ]
        for t in threads:
            t.start()
        while not stop.is_set() and time.monotonic() < until:
            stop.wait(0.5)
        stop.set()
        for proc in procs:  # our own kubectl children, by pid
            if proc.poll() is None:
                proc.kill()
        for t in threads:
            t.join(10)
        out.write(kind="stop")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
