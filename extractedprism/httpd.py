"""Health server: /healthz, /readyz, /metrics and /upstreams on the ``health-http`` thread.

Built on ``http.server`` with three deliberate changes: any method other than GET,
HEAD and OPTIONS gets 405 with an Allow header (the stdlib answers 501), OPTIONS gets
204, and request logging goes to ``logging`` at debug instead of stderr. Each request
runs on its own daemon thread with a read timeout, so a slow or silent client cannot
hold up anyone else. Handlers only read snapshots; they never touch upstream state.
"""

from __future__ import annotations

import errno
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from extractedprism.endpoints import is_ip
from extractedprism.metrics import Metrics
from extractedprism.registry import Registry

log = logging.getLogger(__name__)

ALLOWED = "GET, HEAD, OPTIONS"
REQUEST_TIMEOUT_S = 5.0
MAX_REQUEST_THREADS = 64


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a stuck scrape must not hold up process exit
    block_on_close = False
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 app: HealthServer) -> None:
        self.app = app
        self._slots = threading.BoundedSemaphore(MAX_REQUEST_THREADS)
        super().__init__(addr, handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            return super().get_request()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                # The connection stays in the backlog, so the selector reports it again
                # at once: without a pause this thread would spin a CPU until
                # descriptors free up. serve_forever drops the error and carries on.
                log.warning("health server accept failed; backing off error=%r",
                            exc.strerror)
                time.sleep(0.2)
            raise

    def process_request(self, request: Any, client_address: Any) -> None:
        # Bounded: a flood of idle connections cannot pile up threads without limit.
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        t = threading.Thread(name="health-http-request", target=self._process_thread,
                             args=(request, client_address), daemon=True)
        t.start()

    def _process_thread(self, request: Any, client_address: Any) -> None:
        try:
            self.process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = REQUEST_TIMEOUT_S
    server_version = "extractedprism"
    sys_version = ""
    protocol_version = "HTTP/1.1"
    # Errors for malformed request lines get a real status line, not an HTTP/0.9 body.
    default_request_version = "HTTP/1.1"
    error_content_type = "text/plain; charset=utf-8"
    error_message_format = "%(code)d %(message)s: %(explain)s\n"

    def handle_one_request(self) -> None:
        # The stdlib's version answers unknown methods with 501; the contract says 405.
        try:
            self.raw_requestline = self.rfile.readline(65537)
        except (TimeoutError, OSError):
            self.close_connection = True
            return
        if len(self.raw_requestline) > 65536:
            self.requestline = ""
            self.request_version = ""
            self.command = ""
            self.send_error(HTTPStatus.REQUEST_URI_TOO_LONG)
            return
        if not self.raw_requestline:
            self.close_connection = True
            return
        if not self.parse_request():
            return
        method = {"GET": self._get, "HEAD": self._head, "OPTIONS": self._options}.get(
            self.command)
        if method is None:
            self._send(HTTPStatus.METHOD_NOT_ALLOWED, b"method not allowed\n",
                       extra={"Allow": ALLOWED})
        else:
            method()
        try:
            self.wfile.flush()
        except OSError:
            self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("health request client=%s %s", self.client_address[0], format % args)

    # -- routes ----------------------------------------------------------------------

    def _route(self) -> tuple[int, bytes, str]:
        app = self.server.app
        path = self.path.split("?", 1)[0]
        if path == "/healthz":
            if app.alive():
                return 200, b"ok\n", "text/plain"
            return 503, f"not alive: {app.liveness_reason()}\n".encode(), "text/plain"
        if path == "/readyz":
            if app.registry.healthy():
                return 200, b"ok\n", "text/plain"
            return 503, b"not ready: no healthy upstream\n", "text/plain"
        if path == "/metrics":
            return 200, generate_latest(app.metrics.registry), CONTENT_TYPE_LATEST
        if path == "/upstreams":
            snap = app.registry.snapshot()
            body = {
                "upstreams": [u.as_json() for u in snap.upstreams],
                "connections_active": snap.connections_active,
                "max_connections": snap.max_connections,
                "panic": snap.panic,
            }
            return 200, (json.dumps(body, indent=2) + "\n").encode(), "application/json"
        return 404, b"not found\n", "text/plain"

    def _get(self, head: bool = False) -> None:
        try:
            status, body, ctype = self._route()
        except Exception:
            log.exception("health handler failed path=%s", self.path)
            status, body, ctype = 500, b"internal error\n", "text/plain"
        self._send(status, body, ctype=ctype, head=head)

    def _head(self) -> None:
        self._get(head=True)

    def _options(self) -> None:
        self._send(HTTPStatus.NO_CONTENT, b"", extra={"Allow": ALLOWED})

    def _send(self, status: int, body: bytes, *, ctype: str = "text/plain",
              extra: dict[str, str] | None = None, head: bool = False) -> None:
        self.send_response(status)
        if status != HTTPStatus.NO_CONTENT:
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if not head and body:
            self.wfile.write(body)


class HealthServer:
    """Owns the HTTP server and its ``health-http`` thread."""

    def __init__(self, registry: Registry, metrics: Metrics, alive: Callable[[], bool], *,
                 host: str, port: int, liveness_reason: Callable[[], str] = str) -> None:
        self.registry = registry
        self.metrics = metrics
        self.alive = alive
        self.liveness_reason = liveness_reason
        handler = _Handler
        if is_ip(host) and ":" in host:
            server_cls: type[_Server] = type("_Server6", (_Server,),
                                             {"address_family": socket.AF_INET6})
        else:
            server_cls = _Server
        self._server = server_cls((host, port), handler, self)
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        self._thread = threading.Thread(name="health-http", target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self._server.serve_forever(poll_interval=0.2)

    def shutdown(self, timeout: float = 5.0) -> bool:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout)
        self._server.server_close()
        return not (self._thread is not None and self._thread.is_alive())
