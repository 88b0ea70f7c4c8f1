"""Health server: /healthz, /readyz, /metrics and /upstreams on port 7446.

The routes and the request parsing live here; the connections, their deadlines and size
limits, and the threads that answer (``health-http``, ``health-http-request``) are
:class:`~extractedprism.health.conn.ConnectionLoop`'s. Parsing is ``http.server``'s, with
these changes: any method other than GET, HEAD and OPTIONS gets 405 with an Allow header
(the stdlib answers 501), OPTIONS gets 204, a request line without an HTTP version
(HTTP/0.9) or one that is not HTTP at all (a TLS ClientHello) gets 400 at once, an
absolute-form or percent-encoded target reaches its route, request bodies are never read
(the connection closes after the answer, so a body cannot pose as the next request), the
status line never quotes the client, and request logging goes to ``logging`` at debug
instead of stderr. Handlers only read snapshots; they never touch upstream state.
"""

from __future__ import annotations

import io
import json
import logging
import re
import socket
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import unquote, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from extractedprism.health.conn import ConnectionLoop
from extractedprism.health.head import MAX_HEAD_BYTES, REQUEST_TIMEOUT_S, Conn, is_token
from extractedprism.health.metrics import Metrics
from extractedprism.upstreams.registry import Registry

log = logging.getLogger(__name__)

ALLOWED = "GET, HEAD, OPTIONS"
_DIGITS = re.compile(r"[0-9]+")


class _Handler(BaseHTTPRequestHandler):
    """Parses one request head from memory and renders the answer into memory; the
    caller does the socket I/O."""

    server_version = "extractedprism"
    protocol_version = "HTTP/1.1"
    # Errors for malformed request lines get a real status line, not an HTTP/0.9 body.
    default_request_version = "HTTP/1.1"
    error_content_type = "text/plain; charset=utf-8"

    def __init__(self, app: HealthServer, conn: Conn) -> None:
        # BaseRequestHandler.__init__ would run the blocking handle() on a socket; the
        # request is already in memory, so set up only what the parser and writers use.
        self.app = app
        self.client_address = (conn.client, 0)
        self.rfile = io.BytesIO(conn.head)
        self.wfile = io.BytesIO()
        self.close_connection = True
        self.command = None  # type: ignore[assignment]
        self.requestline = ""
        self.request_version = self.default_request_version
        self._conn = conn

    def answer(self) -> tuple[bytes, bool]:
        """(the bytes to send, whether the connection may carry another request)."""
        self.handle_one_request()
        return self.wfile.getvalue(), not self.close_connection

    def version_string(self) -> str:
        return self.server_version

    def handle_one_request(self) -> None:
        self.raw_requestline = self.rfile.readline(MAX_HEAD_BYTES + 1)
        if self._conn.oversized:
            if self.raw_requestline.endswith(b"\n"):
                self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                                f"request head longer than {MAX_HEAD_BYTES} bytes")
            else:
                self.send_error(HTTPStatus.REQUEST_URI_TOO_LONG,
                                f"request line longer than {MAX_HEAD_BYTES} bytes")
            return
        if not self.parse_request():
            return
        if not self._check_body():
            return
        if self._conn.eof:
            self.close_connection = True
        # The stdlib's dispatch answers unknown methods with 501; the contract says 405.
        method = {"GET": self._get, "HEAD": self._head, "OPTIONS": self._options}.get(
            self.command)
        if method is None:
            self._send(HTTPStatus.METHOD_NOT_ALLOWED, b"method not allowed\n",
                       extra={"Allow": ALLOWED})
        else:
            method()

    def parse_request(self) -> bool:
        line = self.raw_requestline
        self.requestline = str(line, "iso-8859-1").rstrip("\r\n")
        words = line.split()
        problem = ""
        if line[:1] == b"\x16":
            problem = "this looks like a TLS handshake; the health port speaks plain HTTP"
        elif words and not is_token(words[0]):
            problem = "the request line does not start with an HTTP method"
        elif len(words) == 2:
            problem = "the request line has no HTTP version (HTTP/0.9 is not supported)"
        if problem:
            self.send_error(HTTPStatus.BAD_REQUEST, problem)
            return False
        return super().parse_request()

    def handle_expect_100(self) -> bool:
        # No route reads a body, so never invite one: the final answer comes at once.
        return True

    def _check_body(self) -> bool:
        # A body is never read; closing after the answer keeps it from being parsed as
        # the next request. A length that cannot be parsed is refused outright, since
        # where the next request starts is then unknown.
        lengths = self.headers.get_all("Content-Length") or []
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
        for value in lengths:
            if not _DIGITS.fullmatch(value.strip()) or value.strip() != lengths[0].strip():
                self.send_error(HTTPStatus.BAD_REQUEST,
                                f"invalid Content-Length {value.strip()[:40]!r}")
                return False
            if int(value) > 0:
                self.close_connection = True
        return True

    def send_error(self, code: int, message: str | None = None,
                   explain: str | None = None) -> None:
        # The stdlib puts the message, which quotes the client's bytes, into the status
        # line; here the status line keeps its standard phrase and the body says what is
        # wrong, quoting at most a little of the request.
        phrase, long = self.responses.get(code, ("Error", ""))
        detail = f"{message}: {explain}" if message and explain else message or long
        if len(detail) > 200:
            detail = detail[:200] + "..."
        self.log_error("code %d, message %s", code, detail)
        self.close_connection = True
        body = f"{code} {phrase}: {detail}\n".encode("utf-8", "replace")
        self._send(code, body, ctype=self.error_content_type,
                   head=self.command == "HEAD")

    def log_message(self, format: str, *args: Any) -> None:
        # %r: the request line is the client's, and may hold control characters.
        log.debug("health request client=%s %r", self.client_address[0], format % args)

    # -- routes ----------------------------------------------------------------------

    def _route_path(self) -> str:
        target = self.path
        if target[:1] != "/" and "://" in target:
            # Absolute form (RFC 9112 3.2.2), which a server must accept.
            target = urlsplit(target).path or "/"
        path = unquote(target.split("?", 1)[0])
        if path.startswith("//"):
            path = "/" + path.lstrip("/")
        return path

    def _route(self) -> tuple[int, bytes, str]:
        app = self.app
        path = self._route_path()
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
            body = app.document()
            return 200, (json.dumps(body, indent=2) + "\n").encode(), "application/json"
        return 404, b"not found\n", "text/plain"

    def _get(self, head: bool = False) -> None:
        try:
            status, body, ctype = self._route()
        except Exception:
            log.exception("health handler failed path=%r", self.path)
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
        if self.close_connection:
            self.send_header("Connection", "close")
        elif self.request_version == "HTTP/1.0":
            # An HTTP/1.0 client that asked for keep-alive reads to EOF unless told.
            self.send_header("Connection", "keep-alive")
        self.end_headers()
        if not head and body:
            self.wfile.write(body)


def _timeout_answer() -> bytes:
    body = f"408 Request Timeout: request not complete within {REQUEST_TIMEOUT_S:g}s\n"
    return (f"HTTP/1.1 408 Request Timeout\r\nServer: {_Handler.server_version}\r\n"
            f"Content-Type: text/plain; charset=utf-8\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n{body}").encode()


class HealthServer:
    """The health HTTP server: routes over a :class:`ConnectionLoop`."""

    def __init__(self, registry: Registry, metrics: Metrics, alive: Callable[[], bool], *,
                 host: str, port: int, liveness_reason: Callable[[], str] = str,
                 listener: socket.socket | None = None,
                 document: Callable[[], dict[str, Any]] | None = None) -> None:
        self.registry = registry
        self.metrics = metrics
        self.alive = alive
        self.liveness_reason = liveness_reason
        # The /upstreams body (App.upstreams_document); without one, the bare snapshot.
        self.document = document or self._bare_document
        # ``listener``: one taken over from a predecessor (handover.py) instead of a
        # new bind.
        self._loop = ConnectionLoop(host, port, self._respond,
                                    timeout_answer=_timeout_answer(), listener=listener)

    @property
    def address(self) -> tuple[str, int]:
        return self._loop.address

    def start(self) -> None:
        self._loop.start()

    def shutdown(self, timeout: float = 5.0) -> bool:
        """Stop accepting, close idle connections, give answers in progress until
        ``timeout``; True when every thread is gone."""
        return self._loop.shutdown(timeout)

    @property
    def listener(self) -> socket.socket:
        return self._loop.listener

    def stop_accepting(self) -> None:
        """A successor took the listener over: serve what is open, accept no more."""
        self._loop.stop_accepting()

    def begin_shutdown(self, deadline: float) -> None:
        self._loop.begin_shutdown(deadline)

    def wait_stopped(self, deadline: float) -> bool:
        return self._loop.wait_stopped(deadline)

    def _bare_document(self) -> dict[str, Any]:
        snap = self.registry.snapshot()
        return {
            "upstreams": [u.as_json() for u in snap.upstreams],
            "connections_active": snap.connections_active,
            "max_connections": snap.max_connections,
            "panic": snap.panic,
        }

    def _respond(self, conn: Conn) -> tuple[bytes, bool]:
        return _Handler(self, conn).answer()
