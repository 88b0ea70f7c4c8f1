"""A faithful fake kube-apiserver for the EndpointSlice discovery tests.

Real HTTPS on loopback (a ``trustme`` CA made at run time, serving certificate for
``kubernetes.default.svc``, ``localhost``, 127.0.0.1 and ::1), bearer-token auth (401 with
a ``Status`` otherwise), and the two calls the watcher makes, in the wire format of the
Kubernetes API (https://kubernetes.io/docs/reference/using-api/api-concepts/):

* ``GET /apis/discovery.k8s.io/v1/namespaces/<ns>/endpointslices?labelSelector=...``
  -> ``EndpointSliceList`` with ``metadata.resourceVersion``; its items carry no
  ``kind``/``apiVersion`` (the real server leaves them out of list items). With
  ``limit=N`` at most N items and, when more remain, ``metadata.continue`` (an opaque
  token) and ``metadata.remainingItemCount``; ``continue=<token>`` returns the next page
  at the first page's resourceVersion, or 410 Expired once that was compacted. (Unlike
  the real server, later pages show the current objects, not a snapshot.)
* the same path with ``watch=true&resourceVersion=...&allowWatchBookmarks=true&
  timeoutSeconds=...`` -> ``Transfer-Encoding: chunked`` newline-delimited JSON events
  ``{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": {...}}`` with increasing
  resourceVersions. The stream ends cleanly (terminating chunk) after ``timeoutSeconds``.
  Events are computed per watch against its label selector, as the watch cache does: a
  slice that starts matching arrives as ADDED, one that stops matching as DELETED
  (carrying its last matching content at the new resourceVersion). A BOOKMARK's object
  is an empty EndpointSlice holding only ``metadata.resourceVersion`` (zero-valued
  ``addressType``, ``endpoints``, ``ports``). A resourceVersion older than the last
  compaction gets 410: by default a 200 stream holding one ERROR event whose ``Status``
  has code 410 and reason ``Expired`` (``too old resource version: 5 (101)``), as the
  watch cache answers; with ``too_old="http"`` an HTTP 410 with that ``Status`` body.
  Without a resourceVersion (or "0") the stream starts with synthetic ADDED events for
  the current objects, as the real server does; with ``sendInitialEvents=true`` (which
  needs ``resourceVersionMatch=NotOlderThan`` and ``allowWatchBookmarks=true``, else 422)
  those are followed by a BOOKMARK annotated ``k8s.io/initial-events-end: "true"``.

It also answers ``/readyz``, ``/livez``, ``/healthz`` and ``/version`` without a token, so
it can sit behind the proxy as an upstream. Tests drive it with :meth:`set_slice`,
:meth:`delete_slice`, :meth:`close_streams`, :meth:`drop_streams`, :meth:`expire`,
:meth:`inject_raw`, :meth:`inject_unframed`, :meth:`send_error_event`,
:meth:`send_bookmark`, :meth:`fail` and :meth:`serve_next_list`, and
read :attr:`requests` (every request with its monotonic time, path and query).

Threads: one ``fake-apiserver`` accept thread plus one handler thread per connection;
:meth:`stop` shuts every live connection down and joins them all.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import logging
import queue
import socket
import ssl
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import trustme

log = logging.getLogger(__name__)

SERVICE_LABEL = "kubernetes.io/service-name"
INITIAL_EVENTS_END = "k8s.io/initial-events-end"
SLICES_PREFIX = "/apis/discovery.k8s.io/v1/namespaces/"
SERVER_NAMES = ("kubernetes.default.svc", "kubernetes.default", "localhost", "127.0.0.1", "::1")

_END = object()  # end the stream cleanly (terminating chunk)
_DROP = object()  # drop the connection mid-stream (no terminating chunk)


class _Unframed(bytes):
    """Bytes written to a watch connection as they are, outside the chunked framing."""


_DEFAULT: Any = object()


def make_slice(
    name: str = "kubernetes",
    addresses: Iterable[str] = ("10.0.0.1",),
    *,
    port: int = 6443,
    port_name: str = "https",
    address_type: Any = "IPv4",
    not_ready: Iterable[str] = (),
    namespace: str = "default",
    service: str = "kubernetes",
    grouped: bool = False,
    ready: Any = _DEFAULT,
    ports: Any = _DEFAULT,
    endpoints: Any = _DEFAULT,
) -> dict[str, Any]:
    """An EndpointSlice in wire form; each address is its own endpoint, as kube does it.

    For the parser's unit tests: ``grouped`` puts every address in one endpoint entry,
    with ``conditions.ready`` only when ``ready`` is given; ``ports`` and ``endpoints``
    replace those fields as they are (any value, also a malformed one).
    """
    nr = set(not_ready)
    addrs = list(addresses)
    if endpoints is not _DEFAULT:
        entries = endpoints
    elif grouped:
        entry: dict[str, Any] = {"addresses": addrs}
        if ready is not _DEFAULT:
            entry["conditions"] = {"ready": ready}
        entries = [entry]
    else:
        entries = [
            {"addresses": [a], "conditions": {"ready": a not in nr}} for a in addrs
        ] + [{"addresses": [a], "conditions": {"ready": False}} for a in nr if a not in addrs]
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": namespace,
            # The API server's endpoint reconciler writes the kubernetes service's slice
            # with this one label.
            "labels": {SERVICE_LABEL: service},
        },
        "addressType": address_type,
        "endpoints": entries,
        "ports": ([{"name": port_name, "port": port, "protocol": "TCP"}]
                  if ports is _DEFAULT else ports),
    }


def status_object(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


_REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound",
            410: "Expired", 422: "Invalid", 429: "TooManyRequests", 500: "InternalError",
            503: "ServiceUnavailable", 504: "Timeout"}


@dataclass(frozen=True)
class RecordedRequest:
    time: float  # time.monotonic() when the request line was read
    method: str
    path: str
    query: dict[str, str]
    authorized: bool

    @property
    def is_watch(self) -> bool:
        return self.query.get("watch") in ("true", "1")

    @property
    def is_slice_call(self) -> bool:
        return self.path.startswith(SLICES_PREFIX) and self.path.endswith("/endpointslices")


@dataclass(eq=False)
class _Stream:
    namespace: str
    selector: dict[str, str]
    bookmarks: bool
    q: queue.Queue[Any] = field(default_factory=queue.Queue)


@dataclass
class _Failure:
    kind: str  # "list" | "watch" | "any"
    status: int
    remaining: int | None  # None: forever
    retry_after: str | None = None  # a Retry-After header's value


def _parse_selector(text: str) -> dict[str, str] | None:
    """Equality-based label selector (``k=v,k2==v2``); None if unsupported."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "!=" in part:
            return None
        key, sep, value = part.replace("==", "=").partition("=")
        if not sep:
            return None
        out[key.strip()] = value.strip()
    return out


def _matches(obj: dict[str, Any], selector: dict[str, str]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


@dataclass(frozen=True)
class _Change:
    """One stored change: ``obj`` at ``rv`` (None: deleted), ``prev`` the object before."""

    rv: int
    namespace: str
    obj: dict[str, Any] | None
    prev: dict[str, Any] | None

    def event(self, namespace: str, selector: dict[str, str]) -> bytes | None:
        """The watch line a watcher of (namespace, selector) gets, or None (the watch
        cache's rule: ADDED on entering the selector, DELETED on leaving it)."""
        if self.namespace != namespace:
            return None
        now = self.obj is not None and _matches(self.obj, selector)
        before = self.prev is not None and _matches(self.prev, selector)
        if now and not before:
            kind, obj = "ADDED", self.obj
        elif now:
            kind, obj = "MODIFIED", self.obj
        elif before:
            assert self.prev is not None
            kind, obj = "DELETED", copy.deepcopy(self.prev)
            obj["metadata"]["resourceVersion"] = str(self.rv)
        else:
            return None
        return _line(kind, obj)


def _line(kind: str, obj: dict[str, Any]) -> bytes:
    return json.dumps({"type": kind, "object": obj}).encode() + b"\n"


def _continue_token(rv: int, start: str) -> str:
    # Shaped like the real token (base64 JSON with the list's resourceVersion and the
    # key to start after); clients must treat it as opaque.
    raw = json.dumps({"v": "meta.k8s.io/v1", "rv": rv, "start": start + "\x00"})
    return base64.urlsafe_b64encode(raw.encode()).decode()


def _parse_continue(token: str) -> tuple[int, str] | None:
    try:
        data = json.loads(base64.urlsafe_b64decode(token.encode()))
        return int(data["rv"]), str(data["start"]).rstrip("\x00")
    except (ValueError, TypeError, KeyError):
        return None


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # stop() joins handler threads itself, after waking them

    def __init__(self, fake: FakeApiServer, addr: tuple[str, int], family: int) -> None:
        self.address_family = family
        self.fake = fake
        super().__init__(addr, _Handler)

    def get_request(self) -> tuple[Any, Any]:
        sock, addr = self.socket.accept()
        # The handshake runs on the handler thread (see _Handler.setup) so a client that
        # connects and says nothing (a TCP health check) cannot stall the accept loop.
        tls = self.fake.ssl_context.wrap_socket(sock, server_side=True,
                                                do_handshake_on_connect=False)
        return tls, addr

    def process_request(self, request: Any, client_address: Any) -> None:
        t = threading.Thread(target=self.process_request_thread, args=(request, client_address),
                             name="fake-apiserver-conn", daemon=True)
        self.fake._track_thread(t, request)
        t.start()

    def shutdown_request(self, request: Any) -> None:
        self.fake._untrack(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("fake apiserver connection error peer=%s", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    timeout = 30  # idle keep-alive read deadline

    def setup(self) -> None:
        self.request.settimeout(10)
        self.request.do_handshake()
        self.request.settimeout(self.timeout)
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("fake apiserver " + format, *args)

    def do_GET(self) -> None:
        self.server.fake._handle(self)

    def do_HEAD(self) -> None:
        self.server.fake._handle(self)

    # --- response helpers used by FakeApiServer ---

    def send_json(self, code: int, body: Any, headers: dict[str, str] | None = None) -> None:
        data = (json.dumps(body) + "\n").encode()
        self.send_response(code)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-cache, private")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def send_text(self, code: int, text: str) -> None:
        data = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def send_status(self, code: int, message: str,
                    headers: dict[str, str] | None = None) -> None:
        self.send_json(code, status_object(code, _REASONS.get(code, "Unknown"), message),
                       headers)

    def write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()


class FakeApiServer:
    """See the module docstring. Use as a context manager or call start()/stop()."""

    def __init__(self, token: str = "fake-sa-token", *, host: str = "127.0.0.1",
                 too_old: str = "event", names: Iterable[str] = SERVER_NAMES,
                 port: int = 0) -> None:
        self.host = host
        self._bind_port = port  # 0: any free port
        self.too_old = too_old
        self.tokens = {token}
        self._names = tuple(names)
        self.ca = trustme.CA()
        # With a client CA, a client certificate it signed is required and
        # authenticates the request (as the API server's --client-ca-file).
        self.client_ca: trustme.CA | None = None
        self.sni_names: list[str | None] = []  # the TLS server name of every handshake
        self.ssl_context = self._context()
        self._lock = threading.Lock()
        self._rv = 100
        self._min_rv = 0  # watches from a resourceVersion below this get 410
        self._slices: dict[tuple[str, str], dict[str, Any]] = {}
        self._history: list[_Change] = []
        self._streams: list[_Stream] = []
        self._failures: list[_Failure] = []
        self._list_bodies: list[Any] = []
        self._list_drips: list[float] = []
        self.requests: list[RecordedRequest] = []
        self._threads: list[threading.Thread] = []
        self._conns: set[Any] = set()
        self._server: _Server | None = None
        self._acceptor: threading.Thread | None = None

    # --- lifecycle ---

    def start(self) -> FakeApiServer:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self._server = _Server(self, (self.host, self._bind_port), family)
        self._acceptor = threading.Thread(target=self._server.serve_forever,
                                          kwargs={"poll_interval": 0.05},
                                          name="fake-apiserver", daemon=True)
        self._acceptor.start()
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._acceptor is not None:
            self._acceptor.join(5)
        with self._lock:
            for s in self._streams:
                s.q.put(_DROP)
            conns = list(self._conns)
            threads = list(self._threads)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        for t in threads:
            t.join(5)
        self._server = None

    def __enter__(self) -> FakeApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"https://{host}:{self.port}"

    def ca_pem(self) -> bytes:
        return self.ca.cert_pem.bytes()

    def _context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ca.issue_cert(*self._names).configure_cert(ctx)
        if self.client_ca is not None:
            ctx.verify_mode = ssl.CERT_REQUIRED
            self.client_ca.configure_trust(ctx)
        ctx.sni_callback = self._record_sni
        return ctx

    def _cut_connections(self) -> None:
        """Every live connection ends (watches as dropped): clients must connect again,
        under whatever the server now presents and requires."""
        with self._lock:
            for st in self._streams:
                st.q.put(_DROP)
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                socket.socket.shutdown(c, socket.SHUT_RDWR)

    def rotate_ca(self, ca: trustme.CA | None = None) -> trustme.CA:
        """A new serving CA (``ca``, or one made now) and certificate: the old CA no
        longer verifies it; every live connection is cut. Returns the new CA."""
        self.ca = ca if ca is not None else trustme.CA()
        self.ssl_context = self._context()
        self._cut_connections()
        return self.ca

    def require_client_ca(self, ca: trustme.CA | None) -> None:
        """Require client certificates signed by ``ca`` (None: none asked for) from the
        next handshake on; every live connection is cut."""
        self.client_ca = ca
        self.ssl_context = self._context()
        self._cut_connections()

    def write_service_account(self, directory: Path | str) -> Path:
        """Write ``token`` and ``ca.crt`` as the kubelet mounts them; returns the dir."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / "ca.crt").write_bytes(self.ca_pem())
        (d / "token").write_text(next(iter(self.tokens)))
        (d / "namespace").write_text("kube-system")
        return d

    def write_kubeconfig(self, path: Path | str, *, server: str | None = None,
                         tls_server_name: str | None = None) -> Path:
        p = Path(path)
        ca = p.with_suffix(".ca.crt")
        ca.write_bytes(self.ca_pem())
        cluster: dict[str, Any] = {"server": server or self.url, "certificate-authority": str(ca)}
        if tls_server_name:
            cluster["tls-server-name"] = tls_server_name
        cfg = {
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": cluster}],
            "users": [{"name": "fake", "user": {"token": next(iter(self.tokens))}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
        }
        p.write_text(json.dumps(cfg))  # JSON is YAML
        return p

    def _record_sni(self, sock: Any, name: str | None, ctx: Any) -> None:
        with self._lock:
            self.sni_names.append(name)

    def _track_thread(self, t: threading.Thread, conn: Any) -> None:
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()]
            self._threads.append(t)
            self._conns.add(conn)

    def _untrack(self, conn: Any) -> None:
        with self._lock:
            self._conns.discard(conn)

    # --- test controls: objects ---

    @property
    def resource_version(self) -> int:
        with self._lock:
            return self._rv

    def set_slice(self, obj: dict[str, Any]) -> int:
        """Create or replace a slice; returns its new resourceVersion.

        Each watch sees ADDED, MODIFIED or DELETED depending on whether the old and new
        objects match its label selector (see the module docstring).
        """
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        key = (meta["namespace"], meta["name"])
        with self._lock:
            self._rv += 1
            meta["resourceVersion"] = str(self._rv)
            prev = self._slices.get(key)
            self._slices[key] = obj
            self._publish(_Change(self._rv, key[0], obj, prev))
            return self._rv

    def delete_slice(self, name: str, namespace: str = "default") -> int:
        with self._lock:
            obj = self._slices.pop((namespace, name))
            self._rv += 1
            self._publish(_Change(self._rv, namespace, None, obj))
            return self._rv

    def slices(self) -> list[dict[str, Any]]:
        with self._lock:
            return [copy.deepcopy(o) for o in self._slices.values()]

    def _publish(self, change: _Change) -> None:
        self._history.append(change)
        for s in self._streams:
            line = change.event(s.namespace, s.selector)
            if line is not None:
                s.q.put(line)

    # --- test controls: streams ---

    def open_streams(self) -> int:
        with self._lock:
            return len(self._streams)

    def close_streams(self) -> None:
        """End every open watch cleanly, as the server does at timeoutSeconds."""
        with self._lock:
            for s in self._streams:
                s.q.put(_END)

    def drop_streams(self) -> None:
        """Cut every open watch connection mid-stream (no terminating chunk)."""
        with self._lock:
            for s in self._streams:
                s.q.put(_DROP)

    def inject_raw(self, line: bytes, *, newline: bool = True) -> None:
        """Send raw bytes (a line of garbage, say) to every open watch; with
        ``newline=False`` exactly those bytes (the start of a line the stream then cuts)."""
        if newline and not line.endswith(b"\n"):
            line += b"\n"
        with self._lock:
            for s in self._streams:
                s.q.put(line)

    def inject_unframed(self, data: bytes) -> None:
        """Write ``data`` to every open watch connection without chunk framing (say, a
        chunk-size line promising more bytes than will ever come, then some of them)."""
        with self._lock:
            for s in self._streams:
                s.q.put(_Unframed(data))

    def send_error_event(self, code: int = 500, reason: str | None = None,
                         message: str = "injected error", *, end: bool = True) -> None:
        """An ERROR event carrying a Status; the real server ends the watch after one."""
        ev = {"type": "ERROR",
              "object": status_object(code, reason or _REASONS.get(code, "Unknown"), message)}
        with self._lock:
            for s in self._streams:
                s.q.put(json.dumps(ev).encode() + b"\n")
                if end:
                    s.q.put(_END)

    def send_bookmark(self) -> None:
        with self._lock:
            line = json.dumps(self._bookmark(self._rv)).encode() + b"\n"
            for s in self._streams:
                if s.bookmarks:
                    s.q.put(line)

    @staticmethod
    def _bookmark(rv: int, *, initial_events_end: bool = False) -> dict[str, Any]:
        # An empty object of the watched type with only the resourceVersion set; Go
        # serialises the fields without omitempty as zero values.
        meta: dict[str, Any] = {"resourceVersion": str(rv), "creationTimestamp": None}
        if initial_events_end:
            meta["annotations"] = {INITIAL_EVENTS_END: "true"}
        return {"type": "BOOKMARK", "object": {
            "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1", "metadata": meta,
            "addressType": "", "endpoints": None, "ports": None}}

    def expire(self, *, notify_open: bool = True) -> None:
        """Compact: every resourceVersion seen so far is too old to watch from.

        Open watches get an ERROR event (Status code 410, reason Expired) and end, unless
        ``notify_open`` is False, in which case they stay open and only new watches from
        an old resourceVersion see the 410.
        """
        with self._lock:
            self._rv += 1
            self._min_rv = self._rv
            self._history.clear()
            if notify_open:
                ev = {"type": "ERROR", "object": status_object(
                    410, "Expired", f"too old resource version: {self._rv - 1} ({self._rv})")}
                for s in self._streams:
                    s.q.put(json.dumps(ev).encode() + b"\n")
                    s.q.put(_END)

    # --- test controls: failures and tokens ---

    def fail(self, kind: str, status: int, count: int | None = 1, *,
             retry_after: str | None = None) -> None:
        """Answer the next ``count`` (None: every) list/watch/any call with ``status``
        (and a ``Retry-After`` header when given)."""
        assert kind in ("list", "watch", "any")
        with self._lock:
            self._failures.append(_Failure(kind, status, count, retry_after))

    def drip_next_list(self, interval: float) -> None:
        """Answer the next list call with the real list, one byte every ``interval`` s
        (a broken or hostile server, or a link that barely moves)."""
        with self._lock:
            self._list_drips.append(interval)

    def serve_next_list(self, body: Any) -> None:
        """Answer the next list call with 200 and ``body`` (any JSON) instead of the list."""
        with self._lock:
            self._list_bodies.append(body)

    def clear_failures(self) -> None:
        with self._lock:
            self._failures.clear()

    def set_tokens(self, *tokens: str) -> None:
        with self._lock:
            self.tokens = set(tokens)

    # --- recorded requests ---

    def slice_requests(self) -> list[RecordedRequest]:
        with self._lock:
            return [r for r in self.requests if r.is_slice_call]

    def watch_requests(self) -> list[RecordedRequest]:
        return [r for r in self.slice_requests() if r.is_watch]

    def list_requests(self) -> list[RecordedRequest]:
        return [r for r in self.slice_requests() if not r.is_watch]

    # --- request handling (handler threads) ---

    def _handle(self, h: _Handler) -> None:
        parts = urlsplit(h.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        auth = h.headers.get("Authorization", "")
        scheme, _, token = auth.partition(" ")
        # A verified client certificate authenticates as the API server's
        # --client-ca-file does (the handshake already refused any other).
        by_cert = self.client_ca is not None and bool(h.request.getpeercert())
        with self._lock:
            authorized = by_cert or (scheme.lower() == "bearer"
                                     and token.strip() in self.tokens)
            req = RecordedRequest(time.monotonic(), h.command, parts.path, query, authorized)
            self.requests.append(req)
        path = parts.path
        if path in ("/readyz", "/livez", "/healthz"):
            h.send_text(200, "ok")
            return
        if path == "/version":
            h.send_json(200, {"major": "1", "minor": "31", "gitVersion": "v1.31.0-fake",
                              "platform": "linux/amd64"})
            return
        if not authorized:
            h.send_status(401, "Unauthorized")
            return
        if not req.is_slice_call:
            h.send_status(404, f"the server could not find the requested resource {path}")
            return
        namespace = path[len(SLICES_PREFIX):].split("/")[0]
        failure = self._take_failure("watch" if req.is_watch else "list")
        if failure is not None:
            h.send_status(failure.status, "injected failure",
                          {"Retry-After": failure.retry_after} if failure.retry_after else None)
            return
        selector = _parse_selector(query.get("labelSelector", ""))
        if selector is None:
            h.send_status(400, "unable to parse requirement")
            return
        if req.is_watch:
            self._serve_watch(h, namespace, selector, query)
        else:
            self._serve_list(h, namespace, selector, query)

    def _serve_list(self, h: _Handler, namespace: str, selector: dict[str, str],
                    query: dict[str, str]) -> None:
        try:
            limit = int(query.get("limit") or 0)
        except ValueError:
            h.send_status(400, f"invalid limit {query.get('limit')!r}")
            return
        start = ""
        with self._lock:
            body = self._list_bodies.pop(0) if self._list_bodies else None
        if body is not None:
            h.send_json(200, body)
            return
        with self._lock:
            rv = self._rv
            if query.get("continue"):
                parsed = _parse_continue(query["continue"])
                if parsed is None:
                    h.send_status(400, "continue key is not valid")
                    return
                rv, start = parsed
                if rv < self._min_rv:
                    h.send_status(410, "The provided continue parameter is too old to "
                                       "display a consistent list result. You can start a "
                                       "new list without the continue parameter.")
                    return
            items = [copy.deepcopy(o) for (ns, name), o in sorted(self._slices.items())
                     if ns == namespace and name > start and _matches(o, selector)]
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        if limit > 0 and len(items) > limit:
            meta["continue"] = _continue_token(rv, items[limit - 1]["metadata"]["name"])
            meta["remainingItemCount"] = len(items) - limit
            items = items[:limit]
        for o in items:  # list items carry no kind/apiVersion on the wire
            o.pop("kind", None)
            o.pop("apiVersion", None)
        listing = {"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                   "metadata": meta, "items": items}
        with self._lock:
            drip = self._list_drips.pop(0) if self._list_drips else None
        if drip is None:
            h.send_json(200, listing)
            return
        data = (json.dumps(listing) + "\n").encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.flush()
        for i in range(len(data)):  # ends early when the client gives up (broken pipe)
            h.wfile.write(data[i:i + 1])
            h.wfile.flush()
            time.sleep(drip)

    def _take_failure(self, kind: str) -> _Failure | None:
        with self._lock:
            for f in self._failures:
                if f.kind in (kind, "any"):
                    if f.remaining is not None:
                        f.remaining -= 1
                        if f.remaining <= 0:
                            self._failures.remove(f)
                    return f
        return None

    def _serve_watch(self, h: _Handler, namespace: str, selector: dict[str, str],
                     query: dict[str, str]) -> None:
        try:
            timeout = float(query.get("timeoutSeconds", "1800"))
        except ValueError:
            h.send_status(400, "invalid timeoutSeconds")
            return
        rv_text = query.get("resourceVersion", "")
        stream = _Stream(namespace, selector, query.get("allowWatchBookmarks") in ("true", "1"))
        initial = query.get("sendInitialEvents") in ("true", "1")
        if initial and (query.get("resourceVersionMatch") != "NotOlderThan"
                        or not stream.bookmarks):
            h.send_status(422, "sendInitialEvents requires resourceVersionMatch=NotOlderThan "
                               "and allowWatchBookmarks=true")
            return
        too_old = False
        with self._lock:
            if rv_text in ("", "0") or initial:
                for (ns, _), o in sorted(self._slices.items()):
                    if ns == namespace and _matches(o, selector):
                        stream.q.put(_line("ADDED", o))
                if initial:
                    stream.q.put(json.dumps(self._bookmark(
                        self._rv, initial_events_end=True)).encode() + b"\n")
            else:
                try:
                    rv = int(rv_text)
                except ValueError:
                    rv = -1
                if rv < self._min_rv:
                    too_old = True
                else:
                    for change in self._history:
                        line = change.event(namespace, selector) if change.rv > rv else None
                        if line is not None:
                            stream.q.put(line)
            if not too_old:
                self._streams.append(stream)
            current = self._rv
        if too_old and self.too_old == "http":
            h.send_json(410, status_object(
                410, "Expired", f"too old resource version: {rv_text} ({current})"))
            return
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.send_header("Cache-Control", "no-cache, private")
        h.end_headers()
        h.wfile.flush()
        if too_old:
            ev = {"type": "ERROR", "object": status_object(
                410, "Expired", f"too old resource version: {rv_text} ({current})")}
            with contextlib.suppress(OSError):
                h.write_chunk(json.dumps(ev).encode() + b"\n")
                h.write_chunk(b"")
            return
        deadline = time.monotonic() + timeout
        try:
            while True:
                remaining = deadline - time.monotonic()
                try:
                    item = stream.q.get(timeout=max(remaining, 0)) if remaining > 0 else _END
                except queue.Empty:
                    item = _END
                if item is _END:
                    h.write_chunk(b"")  # terminating chunk: a clean end of the watch
                    return
                if item is _DROP:
                    h.close_connection = True
                    with contextlib.suppress(OSError):
                        h.request.shutdown(socket.SHUT_RDWR)
                    return
                if isinstance(item, _Unframed):
                    h.wfile.write(item)
                    h.wfile.flush()
                else:
                    h.write_chunk(item)
        except OSError:
            h.close_connection = True
        finally:
            with self._lock:
                if stream in self._streams:
                    self._streams.remove(stream)
