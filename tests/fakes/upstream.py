"""API-server-like test upstreams on loopback, for the probe, data-path, e2e and chaos tests.

* :class:`FakeUpstream` speaks HTTP/1.1 over TLS (a ``trustme`` CA made at run time) or
  plain TCP: ``/readyz`` with a status the test switches (or a hang), ``/livez``,
  ``/version`` (JSON with its name), ``/whoami`` (its name), ``/watch`` (a chunked stream
  with one line every ``watch_interval`` s until closed, like a watch), ``/echo`` (POST
  body back). With ``mode="echo"`` it is a raw byte echo behind (optional) TLS. It records
  every request with its ``Authorization`` header and the client certificate it saw, and
  counts completed TLS handshakes (``handshakes``). ``set_readyz_framing`` picks how
  ``/readyz`` answers are framed (Content-Length, chunked, or to the close);
  ``set_drop_after`` closes a connection, unanswered, when the next request after N
  comes on it (an idle-timeout close racing the client's request).
* :class:`EchoServer` (plain TCP echo) and :class:`IdentityServer` (writes ``name\\n`` on
  accept, then echoes) for byte-integrity and "which upstream served me" checks.

All of them share :class:`_Server`: one accept thread (``fake-<name>-accept``) waiting
on a selector with a wake-up socket pair, one thread per connection
(``fake-<name>-conn-<n>``). ``stop()`` closes the listener and every live connection and
joins the threads; ``close_listener()`` stops accepting but keeps live connections;
``pause_accept()`` leaves the listener open but stops calling ``accept()`` so its
backlog fills (a slow-to-connect upstream); ``start()`` after either restarts on the
same port. Everything is bounded: handshakes and request reads time out, joins have
deadlines.
"""

from __future__ import annotations

import contextlib
import json
import logging
import selectors
import socket
import ssl
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import trustme

from extractedprism.config.endpoints import Endpoint

log = logging.getLogger(__name__)

DEFAULT_SERVER_NAME = "kubernetes.default.svc"
_JOIN_TIMEOUT = 5.0
_HANDSHAKE_TIMEOUT = 5.0
_REASONS = {200: "OK", 204: "No Content", 302: "Found", 400: "Bad Request",
            401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 500: "Internal Server Error",
            503: "Service Unavailable"}


def _shutdown(sock: socket.socket) -> None:
    """Wake any thread blocked on ``sock``. For an SSLSocket this calls the plain socket
    shutdown on the fd, bypassing SSLSocket.shutdown (which drops the SSL object that a
    reading thread may be using)."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


class _Server:
    """Listener + accept thread + one thread per connection, with honest stop()."""

    def __init__(self, name: str, host: str = "127.0.0.1", port: int = 0,
                 backlog: int = 128) -> None:
        self.name = name
        self.host = host
        self.port = port
        self.backlog = backlog
        self._lock = threading.Lock()
        self._accept_lock = threading.Lock()  # held around each accept() call
        self._listener: socket.socket | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._accepting = False
        self._paused = False
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._conn_seq = 0
        self._fillers: list[socket.socket] = []
        self.accepted = 0
        self.closing = threading.Event()  # set by stop(): long-lived handlers end

    # --- lifecycle ----------------------------------------------------------

    def start(self) -> _Server:
        """Listen (again) on ``host:port``; after a stop the port stays the same."""
        if self._listener is not None:
            raise RuntimeError(f"{self.name} already listening")
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        lst = socket.socket(family, socket.SOCK_STREAM)
        try:
            lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            lst.bind((self.host, self.port))
            lst.listen(self.backlog)
            lst.setblocking(False)
        except BaseException:
            lst.close()
            raise
        self.port = lst.getsockname()[1]
        self.closing.clear()
        self._listener = lst
        self._wake_r, self._wake_w = socket.socketpair()
        self._paused = False
        self._accepting = True
        # Made here, not in the thread: a test that counts descriptors right after
        # start() must already see it (it lives until the listener closes).
        self._sel = selectors.DefaultSelector()
        self._accept_thread = threading.Thread(target=self._accept_loop,
                                               name=f"fake-{self.name}-accept", daemon=True)
        self._accept_thread.start()
        return self

    def close_listener(self) -> None:
        """Stop accepting and close the listening socket; live connections stay."""
        self._accepting = False
        if self._wake_w is not None:
            with contextlib.suppress(OSError):
                self._wake_w.send(b"x")
        if self._accept_thread is not None:
            self._accept_thread.join(_JOIN_TIMEOUT)
            if self._accept_thread.is_alive():
                log.error("fake accept thread outlived its deadline name=%s", self.name)
            self._accept_thread = None
        for s in (self._listener, self._wake_r, self._wake_w):
            if s is not None:
                s.close()
        self._listener = self._wake_r = self._wake_w = None

    def stop(self) -> None:
        """Close the listener and every live connection; join all threads."""
        for s in self._fillers:
            s.close()
        self._fillers = []
        self.close_listener()
        self.closing.set()
        self.close_connections()

    def close_connections(self) -> None:
        """Close every live connection (the listener keeps accepting)."""
        with self._lock:
            items = list(self._conns.items())
        for conn, _t in items:
            _shutdown(conn)
        for _conn, t in items:
            if t is not threading.current_thread():
                t.join(_JOIN_TIMEOUT)
                if t.is_alive():
                    log.error("fake connection thread outlived its deadline name=%s thread=%s",
                              self.name, t.name)

    def pause_accept(self) -> None:
        """Keep listening but stop accepting: new connects queue in the backlog and, once
        it is full, the kernel drops their SYNs (a slow-to-connect upstream)."""
        with self._accept_lock:
            self._paused = True

    def resume_accept(self) -> None:
        with self._accept_lock:
            self._paused = False
        if self._wake_w is not None:
            with contextlib.suppress(OSError):
                self._wake_w.send(b"x")

    def fill_backlog(self, attempt_timeout: float = 0.2) -> int:
        """Pause accepting and queue filler connections until the accept queue is full,
        so the kernel drops further SYNs on this port: a connect then takes a SYN
        retransmission (about 1 s) or times out. Use a small ``backlog`` (0 queues one
        connection on Linux). Returns the number of fillers; undo with release_backlog()."""
        self.pause_accept()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        for _ in range(self.backlog + 16):
            s = socket.socket(family, socket.SOCK_STREAM)
            self._fillers.append(s)
            s.settimeout(attempt_timeout)
            try:
                s.connect((self.host, self.port))
            except TimeoutError:
                return len(self._fillers) - 1
        raise RuntimeError(f"{self.name}: accept queue never filled (backlog={self.backlog})")

    def release_backlog(self) -> None:
        """Close the fillers and accept again."""
        fillers, self._fillers = self._fillers, []
        for s in fillers:
            s.close()
        self.resume_accept()

    def __enter__(self) -> Any:
        if self._listener is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- facts for tests ----------------------------------------------------

    @property
    def address(self) -> str:
        return str(self.endpoint)

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.host, self.port)

    @property
    def listening(self) -> bool:
        return self._listener is not None

    def active_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    # --- threads ------------------------------------------------------------

    def _accept_loop(self) -> None:
        lst, wake = self._listener, self._wake_r
        assert lst is not None and wake is not None
        with self._sel as sel:
            sel.register(wake, selectors.EVENT_READ)
            registered = False
            while self._accepting:
                want = not self._paused  # paused: leave connects in the backlog
                if want and not registered:
                    sel.register(lst, selectors.EVENT_READ)
                elif registered and not want:
                    sel.unregister(lst)
                registered = want
                for key, _ in sel.select(timeout=1.0):
                    if key.fileobj is wake:
                        with contextlib.suppress(OSError):
                            wake.recv(64)
                if self._accepting:
                    self._accept_some(lst)

    def _accept_some(self, lst: socket.socket) -> None:
        while True:
            with self._accept_lock:
                if self._paused:
                    return
                try:
                    conn, peer = lst.accept()
                except (BlockingIOError, InterruptedError):
                    return
                except OSError:
                    log.debug("fake accept failed name=%s", self.name, exc_info=True)
                    return
            conn.setblocking(True)
            with self._lock:
                self._conn_seq += 1
                self.accepted += 1
                t = threading.Thread(target=self._conn_main, args=(conn, peer),
                                     name=f"fake-{self.name}-conn-{self._conn_seq}",
                                     daemon=True)
                self._conns[conn] = t
            t.start()

    def _conn_main(self, conn: socket.socket, peer: Any) -> None:
        try:
            self.handle(conn, peer)
        except (ConnectionError, TimeoutError, ssl.SSLError, OSError) as exc:
            log.debug("fake connection ended name=%s peer=%s error=%r", self.name, peer, exc)
        except Exception:
            log.exception("fake connection handler failed name=%s peer=%s", self.name, peer)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _track_swap(self, old: socket.socket, new: socket.socket) -> None:
        """A TLS wrap replaces the tracked socket object (same fd)."""
        with self._lock:
            t = self._conns.pop(old, None)
            if t is not None:
                self._conns[new] = t

    def handle(self, conn: socket.socket, peer: Any) -> None:  # pragma: no cover
        raise NotImplementedError


def _echo(conn: socket.socket) -> None:
    while True:
        data = conn.recv(65536)
        if not data:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_WR)  # pass the half-close on
            return
        conn.sendall(data)


class EchoServer(_Server):
    """Plain TCP: echoes every byte; passes a half-close on."""

    def __init__(self, name: str = "echo", host: str = "127.0.0.1", port: int = 0,
                 backlog: int = 128) -> None:
        super().__init__(name, host, port, backlog)

    def handle(self, conn: socket.socket, peer: Any) -> None:
        _echo(conn)


class IdentityServer(EchoServer):
    """Plain TCP: writes ``<name>\\n`` on accept, then echoes."""

    def __init__(self, name: str = "ident", host: str = "127.0.0.1", port: int = 0,
                 backlog: int = 128) -> None:
        super().__init__(name, host, port, backlog)

    def handle(self, conn: socket.socket, peer: Any) -> None:
        conn.sendall(f"{self.name}\n".encode())
        _echo(conn)


@dataclass(frozen=True)
class RequestRecord:
    method: str
    path: str
    headers: dict[str, str]  # lower-cased names
    client_cert: dict[str, Any] | None = None  # getpeercert() of a verified client cert
    client_cert_der: bytes | None = None
    client_cn: str | None = None
    peer: Any = None
    when: float = field(default_factory=time.monotonic)

    @property
    def authorization(self) -> str | None:
        return self.headers.get("authorization")


class FakeUpstream(_Server):
    """An API-server-like HTTPS (or plain HTTP / echo) upstream on loopback.

    ``ca``: signs the serving certificate (a fresh CA when None and ``tls``).
    ``client_ca``: verifies client certificates (optional unless ``require_client_cert``).
    ``mode``: ``"http"`` or ``"echo"`` (raw bytes, after the TLS handshake when ``tls``).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, ca: trustme.CA | None = None,
                 tls: bool = True, name: str = "up1", *,
                 server_names: tuple[str, ...] = (DEFAULT_SERVER_NAME, "localhost",
                                                  "127.0.0.1", "::1"),
                 client_ca: trustme.CA | None = None, require_client_cert: bool = False,
                 mode: str = "http", watch_interval: float = 0.05, backlog: int = 128,
                 request_timeout: float = 30.0) -> None:
        super().__init__(name, host, port, backlog)
        if mode not in ("http", "echo"):
            raise ValueError(f"mode must be http or echo, got {mode!r}")
        self.tls = tls
        self.mode = mode
        self.watch_interval = watch_interval
        self.request_timeout = request_timeout
        self.ca = ca if ca is not None or not tls else trustme.CA()
        self.ready_status = 200
        self._ready_gate = threading.Event()  # cleared = /readyz hangs
        self._ready_gate.set()
        self._records: list[RequestRecord] = []
        self.hits: Counter[str] = Counter()
        self.handshakes = 0
        self.readyz_framing = "length"
        self.drop_after: int | None = None
        self._ctx: ssl.SSLContext | None = None
        self._server_names = server_names
        self._client_ca = client_ca
        self._require_client_cert = require_client_cert
        if require_client_cert and client_ca is None:
            raise ValueError("require_client_cert needs client_ca")
        if tls:
            assert self.ca is not None
            self._ctx = self._context(self.ca)

    def _context(self, ca: trustme.CA) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ca.issue_cert(*self._server_names, common_name=self.name).configure_cert(ctx)
        if self._client_ca is not None:
            self._client_ca.configure_trust(ctx)
            ctx.verify_mode = (ssl.CERT_REQUIRED if self._require_client_cert
                               else ssl.CERT_OPTIONAL)
        return ctx

    # --- controls -----------------------------------------------------------

    def set_ready_status(self, status: int) -> None:
        """Status ``/readyz`` answers from now on (302 carries a Location header)."""
        self.ready_status = status

    def set_readyz_framing(self, framing: str) -> None:
        """``length`` (Content-Length, the default), ``chunked``, ``close`` (no length,
        the body ends with the connection) or ``close-header`` (Content-Length and
        ``Connection: close``)."""
        if framing not in ("length", "chunked", "close", "close-header"):
            raise ValueError(f"unknown framing {framing!r}")
        self.readyz_framing = framing

    def set_drop_after(self, n: int | None) -> None:
        """Close each connection without an answer when request ``n + 1`` arrives on it."""
        self.drop_after = n

    def set_serving_ca(self, ca: trustme.CA) -> None:
        """Serve a certificate ``ca`` signs (same names) on the connections accepted from
        now on; those already open keep the one they were made with."""
        if self._ctx is None:
            raise ValueError("not a TLS upstream")
        self._ctx = self._context(ca)

    def set_ready_hang(self, hang: bool) -> None:
        """While True, ``/readyz`` reads the request and never answers; stop() ends such
        a request by closing its connection, without answering it."""
        if hang:
            self._ready_gate.clear()
        else:
            self._ready_gate.set()

    # --- records ------------------------------------------------------------

    @property
    def requests(self) -> list[RequestRecord]:
        with self._lock:
            return list(self._records)

    def requests_for(self, path: str) -> list[RequestRecord]:
        return [r for r in self.requests if r.path.split("?", 1)[0] == path]

    def authorizations(self, path: str = "/readyz") -> list[str | None]:
        return [r.authorization for r in self.requests_for(path)]

    def client_cns(self, path: str = "/readyz") -> list[str | None]:
        return [r.client_cn for r in self.requests_for(path)]

    def hit_count(self, path: str) -> int:
        with self._lock:
            return self.hits[path]

    # --- connection handling ------------------------------------------------

    def handle(self, conn: socket.socket, peer: Any) -> None:
        cert: dict[str, Any] | None = None
        der: bytes | None = None
        tls: ssl.SSLSocket | None = None
        if self._ctx is not None:
            conn.settimeout(_HANDSHAKE_TIMEOUT)
            # The wrap moves the fd to the SSLSocket: track that object from now on.
            tls = self._ctx.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
            self._track_swap(conn, tls)
            conn = tls
        try:
            if tls is not None:
                tls.do_handshake()
                with self._lock:
                    self.handshakes += 1
                cert = tls.getpeercert() or None
                der = tls.getpeercert(binary_form=True)
            conn.settimeout(None)
            if self.mode == "echo":
                _echo(conn)
            else:
                self._serve_http(conn, peer, cert, der)
        finally:
            if tls is not None:
                with self._lock:
                    self._conns.pop(tls, None)
                tls.close()

    def _serve_http(self, conn: socket.socket, peer: Any, cert: dict[str, Any] | None,
                    der: bytes | None) -> None:
        cn = _common_name(cert)
        if not isinstance(conn, ssl.SSLSocket):
            conn.settimeout(self.request_timeout)
            first = conn.recv(1, socket.MSG_PEEK)
            if first == b"\x16":  # a TLS ClientHello: it may hold no newline, answer now
                self._respond(conn, 400, b"TLS handshake to a plain HTTP server\n",
                              keep_alive=False)
                return
        rfile = conn.makefile("rb")
        served = 0
        try:
            while not self.closing.is_set():
                conn.settimeout(self.request_timeout)
                line = rfile.readline(65537)
                if not line:
                    return
                conn.settimeout(None)
                parts = line.decode("latin-1").split()
                if len(parts) != 3:
                    self._respond(conn, 400, b"bad request line\n", keep_alive=False)
                    return
                method, path, version = parts
                headers: dict[str, str] = {}
                while True:
                    h = rfile.readline(65537)
                    if not h or h in (b"\r\n", b"\n"):
                        break
                    k, _, v = h.decode("latin-1").partition(":")
                    headers[k.strip().lower()] = v.strip()
                body = b""
                length = int(headers.get("content-length", "0") or 0)
                if length:
                    body = rfile.read(length)
                if self.drop_after is not None and served >= self.drop_after:
                    return  # closed unanswered
                served += 1
                record = RequestRecord(method, path, headers, cert, der, cn, peer)
                route = path.split("?", 1)[0]
                with self._lock:
                    self._records.append(record)
                    self.hits[route] += 1
                keep_alive = (version == "HTTP/1.1"
                              and headers.get("connection", "").lower() != "close")
                if not self._route(conn, method, route, body, keep_alive):
                    return
                if not keep_alive:
                    return
        finally:
            rfile.close()

    def _route(self, conn: socket.socket, method: str, route: str, body: bytes,
               keep_alive: bool) -> bool:
        """Answer one request; False when the connection must end."""
        if route == "/readyz":
            while not self._ready_gate.wait(0.05):
                if self.closing.is_set():
                    return False
            status = self.ready_status
            extra = {"Location": "/readyz/elsewhere"} if 300 <= status < 400 else {}
            text = b"ok" if status == 200 else b"[-]etcd failed: reason withheld\nreadyz failed"
            return self._respond_readyz(conn, status, text, extra, keep_alive)
        elif route in ("/livez", "/healthz"):
            self._respond(conn, 200, b"ok", keep_alive=keep_alive)
        elif route == "/version":
            doc = {"major": "1", "minor": "30", "gitVersion": "v1.30.0-fake",
                   "platform": "linux/amd64", "name": self.name}
            self._respond(conn, 200, json.dumps(doc).encode(), "application/json",
                          keep_alive=keep_alive)
        elif route == "/whoami":
            self._respond(conn, 200, self.name.encode(), keep_alive=keep_alive)
        elif route == "/echo":
            self._respond(conn, 200, body, "application/octet-stream", keep_alive=keep_alive)
        elif route == "/watch":
            self._watch(conn)
            return False
        else:
            self._respond(conn, 404, b"not found", keep_alive=keep_alive)
        return True

    def _respond(self, conn: socket.socket, status: int, body: bytes,
                 content_type: str = "text/plain", *, extra: dict[str, str] | None = None,
                 keep_alive: bool = True) -> None:
        head = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}",
                f"Content-Type: {content_type}", f"Content-Length: {len(body)}",
                f"X-Upstream: {self.name}",
                "Connection: keep-alive" if keep_alive else "Connection: close"]
        head += [f"{k}: {v}" for k, v in (extra or {}).items()]
        conn.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)

    def _respond_readyz(self, conn: socket.socket, status: int, text: bytes,
                        extra: dict[str, str], keep_alive: bool) -> bool:
        framing = self.readyz_framing
        if framing == "length":
            self._respond(conn, status, text, extra=extra, keep_alive=keep_alive)
            return True
        if framing == "close-header":
            self._respond(conn, status, text, extra=extra, keep_alive=False)
            return False
        head = f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\nContent-Type: text/plain\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in extra.items())
        if framing == "close":
            conn.sendall(head.encode() + b"\r\n" + text)
            return False
        half = len(text) // 2
        body = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(part), part)
                        for part in (text[:half], text[half:]) if part)
        conn.sendall(head.encode() + b"Transfer-Encoding: chunked\r\n\r\n" + body
                     + b"0\r\nX-Trailer: t\r\n\r\n")
        return True

    def _watch(self, conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n"
                     + f"X-Upstream: {self.name}\r\n\r\n".encode())
        n = 0
        while True:
            line = json.dumps({"type": "TICK", "n": n, "from": self.name}).encode() + b"\n"
            conn.sendall(b"%x\r\n%s\r\n" % (len(line), line))
            n += 1
            if self.closing.wait(self.watch_interval):
                return


def _common_name(cert: dict[str, Any] | None) -> str | None:
    if not cert:
        return None
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None
