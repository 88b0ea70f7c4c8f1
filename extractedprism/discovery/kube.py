"""Kubernetes API access for EndpointSlice discovery: the only module importing ``kubernetes``
(and that only for a kubeconfig plugin).

Owns the two calls the watcher makes (list, watch), and turns the client's many failure
shapes into three outcomes the watcher cares about: a result, :class:`Gone` (410:
re-list) or any other exception (a counted error). Runs on the watcher thread;
:meth:`WatchStream.close` and :meth:`KubeClient.interrupt` are the methods called from
another thread (shutdown), and they only shut sockets down to wake a blocked call.

Where the client connects (spec, "Endpoint discovery"; the credentials module reads
the configuration and re-reads its files when they change):

* ``--kubeconfig``: that file's current context, used as given.
* in a cluster (service-account ``token`` and ``ca.crt`` present): this proxy's *own*
  listener, ``https://<bind-address>:<bind-port>`` (127.0.0.1 when the bind address is a
  wildcard), verifying the API server certificate as ``kubernetes.default.svc`` (sent as
  SNI too). Discovery then survives the loss of any API server and needs no CNI or
  ClusterIP. Environment proxies are ignored: the target is loopback.
* neither: :func:`build_client` returns None and the caller runs static-only.

:class:`HttpApi` makes the calls for both with ``http.client`` (which the health server
has loaded anyway), without the ``kubernetes`` package, whose ``__init__`` imports every
API model (18 MB and half a second; with it a static pod idled at 54 MiB instead of
the chart's 32). It behaves as that package's urllib3 transport does: the same URL,
query order and headers byte for byte, one kept-alive connection reused while the
server keeps it open (and while the credentials it was made with are current), a
request that fails before its answer (connect, TLS, send, or the wait for the status
line) tried again up to three times at once, and a 413/429/503 carrying
``Retry-After`` tried again after that delay (urllib3's default ``Retry(3)``); the
server never redirects its own clients, so no redirect is followed. Unlike urllib3,
the delay is capped at the watcher's own backoff maximum (30 s, not urllib3's 6 h: a
server asking for hours would otherwise stop discovery for hours), and it is waited on
the stop Event, so shutdown ends it at once; shutdown also shuts the socket of a
request in flight down (:meth:`HttpApi.interrupt`), so no connect, list read or
Retry-After wait outlasts the shutdown bound. Only a kubeconfig whose user runs an
``exec`` or ``auth-provider`` plugin goes through the ``kubernetes`` package
(:class:`PluginApi`): running those plugins is that package's job, and only their users
pay its memory.

Why not ``kubernetes.watch.Watch.stream``: it re-opens a watch by itself after a 410
ERROR event and after every clean end unless ``timeout_seconds`` is passed, and it
crashes on a line that is not JSON or an event without ``object`` (kubernetes 37.0.2,
``watch/watch.py``). The watcher must see every end, every 410 and survive garbage, so
this module reads the raw response itself, split into lines like the client's
``iter_resp_lines`` (which drops an unterminated last line without a word; here it is
logged), and always passes ``timeout_seconds``.
"""

from __future__ import annotations

import contextlib
import email.utils
import http.client
import ipaddress
import json
import logging
import os
import select
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, Protocol
from urllib.parse import quote

from extractedprism import __version__
from extractedprism.config.table import Config
from extractedprism.discovery.backoff import MAX_DELAY
from extractedprism.discovery.credentials import (
    TLS_SERVER_NAME,
    ClientConfigError,
    KubeconfigError,
    Target,
    kubeconfig,
    plugin_kubeconfig,
    read_kubeconfig,
    service_account,
    uses_plugin,
)
from extractedprism.errors import Error
from extractedprism.files import FileProblem, Reloaded

log = logging.getLogger(__name__)

NAMESPACE = "default"
SLICES_PATH = f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"
LABEL_SELECTOR = "kubernetes.io/service-name=kubernetes"
USER_AGENT = f"extractedprism/{__version__}"
# The list/watch parameters by their Python name (the kubernetes client's keyword) and
# wire name, in the order that client writes them into the query string.
QUERY_NAMES = (("allow_watch_bookmarks", "allowWatchBookmarks"),
               ("label_selector", "labelSelector"),
               ("resource_version", "resourceVersion"),
               ("timeout_seconds", "timeoutSeconds"),
               ("watch", "watch"))
# What an error answer's body contributes to the error's message, at most.
ERROR_BODY_BYTES = 4096
# urllib3's default Retry(3), as the kubernetes client's transport uses it: a request
# that fails before its answer is tried this many more times, at once; an answer of
# these statuses with a Retry-After header is tried again after that many seconds,
# capped at the watcher's backoff maximum (urllib3 caps at 6 h: a discovery stopped for
# hours by one header, on a thread shutdown must be able to stop).
RETRIES = 3
RETRY_AFTER_STATUSES = (413, 429, 503)
RETRY_AFTER_MAX_S = MAX_DELAY
DEFAULT_SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
CONNECT_TIMEOUT = 10.0
LIST_READ_TIMEOUT = 30.0
# The list body: each read waits at most LIST_READ_TIMEOUT, and the whole body must come
# within LIST_DEADLINE_S and LIST_MAX_BYTES, so a server that drips bytes or sends
# without end cannot hold the watcher (and its memory) forever. A real list of the
# kubernetes service's slices is a few KiB and arrives in milliseconds.
LIST_DEADLINE_S = 60.0
LIST_MAX_BYTES = 64 * 1024 * 1024
# A watch read may legitimately wait until the server's timeoutSeconds; past that
# (plus slack) the connection is dead and the read deadline ends the stream.
WATCH_READ_SLACK = 30.0
# The reasons the API uses for an expired resourceVersion; client-go's IsResourceExpired
# and IsGone go by these as much as by the code.
GONE_REASONS = ("Expired", "Gone")
# The longest watch line (one event) kept in memory. The API server stores objects of at
# most ~1.5 MiB (etcd's request limit) and a slice of 1,000 endpoints is well under 1 MiB
# as JSON, so only a broken or hostile server gets near this; past it the stream is
# ended (as a drop: not counted) and the next watch resumes from the last applied
# resourceVersion.
MAX_LINE_BYTES = 16 * 1024 * 1024
# Each read takes at most this much, whatever size a chunk header announces, so memory
# stays within MAX_LINE_BYTES plus one read.
READ_BYTES = 64 * 1024


class Gone(Error):
    """410 Gone: the resourceVersion was compacted away; the caller must re-list."""


class LineTooLong(Error, ValueError):
    """A watch line grew past :data:`MAX_LINE_BYTES` without a newline."""


class WatchErrorEvent(Error):
    """A watch ERROR event other than 410 (the server ends the watch after it)."""

    def __init__(self, code: Any, reason: Any, message: Any) -> None:
        super().__init__(f"watch error event code={code} reason={reason} message={message}")
        self.code = code
        self.reason = reason


class ApiError(Error):
    """A list or watch call answered with a status other than 2xx."""

    def __init__(self, status: int, reason: str, body: str = "") -> None:
        super().__init__(f"HTTP {status} {reason}" + (f": {body}" if body else ""))
        self.status = status
        self.reason = reason


def proxy_url(bind_address: str, bind_port: int) -> str:
    """``https://host:port`` of this proxy's own listener, as the in-cluster client uses it."""
    host = bind_address.strip().strip("[]")
    try:
        if not host or ipaddress.ip_address(host).is_unspecified:
            host = "127.0.0.1"
    except ValueError:
        pass  # a hostname: connect to it as given
    if ":" in host:
        host = f"[{host}]"
    return f"https://{host}:{bind_port}"


def has_service_account(sa_dir: str) -> bool:
    return os.path.isfile(os.path.join(sa_dir, "token")) and os.path.isfile(
        os.path.join(sa_dir, "ca.crt")
    )


def _query(params: dict[str, Any]) -> str:
    # As the kubernetes client writes it: booleans lower case, values quoted with "/"
    # kept (labelSelector=kubernetes.io/service-name%3Dkubernetes).
    parts = []
    for name, wire in QUERY_NAMES:
        if name in params:
            value = params[name]
            text = str(value).lower() if isinstance(value, bool) else str(value)
            parts.append(f"{wire}={quote(text)}")
    return "&".join(parts)


class Api(Protocol):
    """One way to make the two calls: GET the slices with ``params`` (the kubernetes
    client's keywords), ``timeout`` = (connect, read) seconds. Returns the open response
    of a 2xx answer (``read1``, ``stream``, ``close``, ``release_conn`` and
    ``connection.sock``, as urllib3's); raises :class:`ApiError` on any other status."""

    host: str

    def get(self, params: dict[str, Any], timeout: tuple[float, float]) -> Any: ...

    def interrupt(self) -> None: ...

    def close(self) -> None: ...


class RequestFailed(Error):
    """A request failed before its answer, also after the retries."""


class Stopped(RequestFailed):
    """Shutdown interrupted the request (or the wait before its retry)."""


class _Connection(http.client.HTTPConnection):
    """HTTPS to ``host:port`` verified as, and with the SNI of, ``server_name`` (in a
    cluster ``kubernetes.default.svc``; http.client's HTTPSConnection verifies the
    host it dials), or the host itself when None."""

    default_port = 443  # the Host header names the port unless it is 443, as urllib3's

    def __init__(self, target: Target, timeout: float, on_socket: Any = None) -> None:
        super().__init__(target.host, target.port, timeout=timeout)
        self._tls = target.tls
        self._server_name = target.server_name or target.host
        self._on_socket = on_socket  # told each socket before its connect (interrupt)
        self._create_connection = self._dial

    def _dial(self, address: tuple[str, int], timeout: float,
              source_address: Any = None) -> socket.socket:
        # socket.create_connection, but each socket is handed out before it connects,
        # so shutdown can end a connect that hangs.
        host, port = address
        last: OSError = OSError(f"no address for {host}")
        for family, kind, proto, _name, addr in socket.getaddrinfo(
                host, port, 0, socket.SOCK_STREAM):
            sock = socket.socket(family, kind, proto)
            try:
                if self._on_socket is not None:
                    self._on_socket(sock)
                sock.settimeout(timeout)
                sock.connect(addr)
                return sock
            except OSError as exc:
                sock.close()
                last = exc
        raise last

    def connect(self) -> None:
        super().connect()
        self.sock = self._tls.wrap_socket(self.sock, server_hostname=self._server_name)


class _Response:
    """A 2xx answer being read (the part of urllib3's response the callers use); its
    connection goes back to :class:`HttpApi` when it was read to the end."""

    def __init__(self, api: HttpApi, conn: _Connection,
                 resp: http.client.HTTPResponse) -> None:
        self._api, self.connection, self._resp = api, conn, resp
        self.status = resp.status
        self._released = False

    def read1(self, n: int) -> bytes:
        return self._resp.read1(n)

    def stream(self, amt: int, decode_content: bool = False) -> Iterator[bytes]:
        # What has arrived, up to amt, as urllib3 yields a chunked body chunk by chunk.
        while data := self._resp.read1(amt):
            yield data

    def close(self) -> None:
        self._resp.close()
        self.connection.close()

    def release_conn(self) -> None:
        if self._released:
            return
        self._released = True
        # Read to the end: closed, or a Content-Length body with nothing left (read1
        # does not close the response at the end of a counted body).
        done = self._resp.isclosed() or self._resp.length == 0
        if done and not self._resp.will_close and self.connection.sock is not None:
            self._resp.close()
            self._api.keep(self.connection)
        else:
            self.connection.close()


class HttpApi:
    """The way in without the ``kubernetes`` package (module docstring), for the
    service account and a kubeconfig alike: where to connect, the TLS context and the
    ``Authorization`` header come from ``target``, made again before a request when
    one of its files changed (a rotated CA, client certificate, key, token or
    kubeconfig is used from the next request on; a kept connection made with the old
    ones is not reused). A file that is missing or unusable fails the request with its
    name and path (a counted discovery error), and the next request looks again."""

    def __init__(self, target: Reloaded[Target], host: str,
                 stop: threading.Event | None = None) -> None:
        self.host = host  # for logs
        self._target = target
        self._generation = -1  # of the target the kept connection was made with
        self._stop = stop if stop is not None else threading.Event()
        self._sock_lock = threading.Lock()
        self._sock: socket.socket | None = None  # of the request in flight (interrupt)
        self._idle: _Connection | None = None  # kept alive between requests

    def _current(self) -> Target:
        try:
            target = self._target.get()
        except FileProblem as exc:
            raise ClientConfigError(str(exc)) from None
        if self._target.generation != self._generation:
            self._generation = self._target.generation
            self.host = target.url
            self.close()  # made with the old CA / credentials: not reused
        return target

    def keep(self, conn: _Connection) -> None:
        """Keep a connection whose answer was read to the end, for the next request."""
        old, self._idle = self._idle, conn
        if old is not None:
            old.close()

    def _connection(self, target: Target, connect_timeout: float) -> _Connection:
        conn, self._idle = self._idle, None
        if conn is not None and conn.sock is not None:
            # Readable while idle: the server closed it (or sent garbage): not reusable.
            # poll, not select: select() refuses a descriptor >= 1024, and a busy node
            # has thousands open (two sockets and a pipe pair per relayed connection).
            poller = select.poll()
            poller.register(conn.sock, select.POLLIN | select.POLLPRI)
            if not poller.poll(0):
                return conn
            conn.close()
        return _Connection(target, connect_timeout, self._in_flight)

    def _in_flight(self, sock: socket.socket | None) -> None:
        with self._sock_lock:
            self._sock = sock
        if sock is not None and self._stop.is_set():
            _shut(sock)  # interrupt() ran before this socket existed

    def interrupt(self) -> None:
        """Shutdown (any thread, after the stop Event is set): end the request in
        flight, a connect, a read or a Retry-After wait, at once."""
        with self._sock_lock:
            sock = self._sock
        if sock is not None:
            _shut(sock)

    def get(self, params: dict[str, Any], timeout: tuple[float, float]) -> Any:
        query = f"{SLICES_PATH}?{_query(params)}"
        retries = RETRIES
        while True:
            if self._stop.is_set():
                raise Stopped(f"GET {self.host}{query}: shutting down")
            server = self._current()
            target = server.prefix + query
            headers = {"Accept": "application/json", "User-Agent": USER_AGENT}
            if server.authorization:
                headers["authorization"] = server.authorization
            conn = self._connection(server, timeout[0])
            try:
                if conn.sock is None:
                    conn.connect()
                assert conn.sock is not None
                self._in_flight(conn.sock)
                conn.sock.settimeout(timeout[1])
                conn.request("GET", target, headers=headers)
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException, ValueError) as exc:
                conn.close()
                if self._stop.is_set():
                    raise Stopped(f"GET {self.host}{query}: shutting down") from exc
                if retries <= 0:
                    raise RequestFailed(f"GET {self.host}{query} failed after "
                                        f"{RETRIES} retries: {_reason(exc)}") from exc
                retries -= 1
                log.debug("kube request failed; retrying error=%s", _reason(exc))
                continue
            if 200 <= resp.status <= 299:
                return _Response(self, conn, resp)
            delay = _retry_after(resp) if resp.status in RETRY_AFTER_STATUSES else None
            try:
                body = resp.read(ERROR_BODY_BYTES) if delay is None else b""
            except (OSError, http.client.HTTPException, ValueError):
                body = b""
            finally:
                conn.close()  # the rest of the body is unread: not reusable
            if delay is not None:
                if retries <= 0:
                    raise RequestFailed(f"GET {self.host}{query}: {resp.status} "
                                        f"{resp.reason} after {RETRIES} retries")
                retries -= 1
                log.info("kube request throttled; retrying status=%d retry_after=%s "
                         "delay=%.3fs", resp.status, resp.getheader("Retry-After"), delay)
                if self._stop.wait(delay):
                    raise Stopped(f"GET {self.host}{query}: shutting down")
                continue
            raise ApiError(resp.status, resp.reason or "",
                           body.decode("utf-8", errors="replace")[:200])

    def close(self) -> None:
        conn, self._idle = self._idle, None
        if conn is not None:
            conn.close()


def _shut(sock: socket.socket) -> None:
    # The plain-socket shutdown, not SSLSocket.shutdown (which drops the TLS object
    # under the reading thread's feet); on a connecting socket it ends the connect.
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _retry_after(resp: http.client.HTTPResponse) -> float | None:
    """Seconds of a Retry-After header (a number or an HTTP date), or None."""
    value = resp.getheader("Retry-After")
    if not value:
        return None
    if value.strip().isdigit():
        seconds = float(int(value.strip()))
    else:
        parsed = email.utils.parsedate_tz(value)
        if parsed is None:
            return None
        seconds = email.utils.mktime_tz(parsed) - time.time()
    return min(max(seconds, 0.0), RETRY_AFTER_MAX_S)


class PluginApi:
    """A kubeconfig whose user runs an ``exec`` or ``auth-provider`` plugin: the
    ``kubernetes`` package reads the file, runs the plugin and makes the call; imported
    here, only then (it costs ~25 MiB of RSS, which only these users pay). The package
    reads the kubeconfig and its files once per client, so the client is made again
    before a request when one of them changed (a rotated CA, client certificate, key or
    token file, or the kubeconfig itself), as :class:`HttpApi` does."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._made = plugin_kubeconfig(path, self._build)
        self._generation = 0
        self._client: Any = None
        self._slices: Any = None
        self.host = ""
        self._current()  # a kubeconfig the package cannot use fails the start

    def _build(self) -> tuple[Any, Any]:
        from kubernetes import client as k8s_client
        from kubernetes import config as k8s_config

        try:
            api_client = k8s_config.new_client_from_config(config_file=self._path,
                                                           persist_config=False)
        except Exception as exc:  # the loader raises many types (ConfigException, yaml, OSError)
            raise ClientConfigError(f"kubeconfig {self._path}: {exc}") from exc
        api_client.user_agent = USER_AGENT
        return api_client, k8s_client.DiscoveryV1Api(api_client)

    def _current(self) -> Any:
        try:
            api_client, slices = self._made.get()
        except FileProblem as exc:
            raise ClientConfigError(str(exc)) from None
        if self._made.generation != self._generation:
            old, self._client, self._slices = self._client, api_client, slices
            self._generation = self._made.generation
            self.host = str(api_client.configuration.host)
            if old is not None:
                old.close()  # its connections were made with the old files
        return self._slices

    def get(self, params: dict[str, Any], timeout: tuple[float, float]) -> Any:
        from kubernetes.client.exceptions import ApiException

        slices = self._current()
        try:
            return slices.list_namespaced_endpoint_slice(
                NAMESPACE, **params, _preload_content=False, _request_timeout=timeout)
        except ApiException as exc:
            raise ApiError(int(exc.status or 0), str(exc.reason or "")) from exc

    def interrupt(self) -> None:
        # urllib3 keeps its sockets to itself: a request in flight ends at its own
        # timeouts (the watch stream is still woken by WatchStream.close).
        pass

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def build_client(config: Config, sa_dir: str | None = None,
                 stop: threading.Event | None = None) -> KubeClient | None:
    """The discovery client, or None when neither a kubeconfig nor a service account exists.

    ``stop`` (the watcher's stop Event) ends its waits. Raises
    :class:`ClientConfigError` when one is configured but unusable (a
    :class:`~extractedprism.discovery.credentials.KubeconfigError` for a kubeconfig
    that is missing or malformed). A file the configuration refers to that is missing
    or unusable only logs a warning here: every request fails naming it until it is
    fixed, and the next one after that succeeds.
    """
    sa_dir = sa_dir if sa_dir is not None else DEFAULT_SA_DIR
    api: Api
    if config.kubeconfig:
        path = config.kubeconfig
        if uses_plugin(read_kubeconfig(path), path):
            api = PluginApi(path)
            log.info("discovery client source=kubeconfig path=%s server=%s "
                     "reader=kubernetes-package reason=%r", path, api.host,
                     "the user runs an exec or auth-provider plugin")
            return KubeClient(api)
        target = kubeconfig(path)
        api = HttpApi(target, f"kubeconfig {path}", stop)
        _first(target, api, "kubeconfig")
        log.info("discovery client source=kubeconfig path=%s server=%s", path, api.host)
        return KubeClient(api)
    if has_service_account(sa_dir):
        url = proxy_url(config.bind_address, config.bind_port)
        target = service_account(url, os.path.join(sa_dir, "ca.crt"),
                                 os.path.join(sa_dir, "token"))
        try:
            target.get()
        except (FileProblem, ClientConfigError) as exc:
            raise ClientConfigError(f"service account unusable: {exc}") from None
        api = HttpApi(target, url, stop)
        log.info("discovery client source=in-cluster server=%s tls_server_name=%s",
                 api.host, TLS_SERVER_NAME)
        return KubeClient(api)
    return None


def _first(target: Reloaded[Target], api: HttpApi, source: str) -> None:
    """Make the target once now, for the log; a referenced file's problem is a warning
    (it may appear later), the kubeconfig's own problems raise."""
    try:
        api.host = target.get().url
    except KubeconfigError:
        raise
    except (FileProblem, ClientConfigError) as exc:
        log.warning("discovery credentials not usable yet source=%s error=%s; every "
                    "request fails until fixed", source, exc)


def _dropped(exc: BaseException) -> bool:
    """True for the ways a stream read fails when the connection goes away."""
    if isinstance(exc, http.client.HTTPException | OSError | ValueError):
        return True
    # urllib3 is loaded only by the kubernetes client (--kubeconfig), its transport.
    urllib3 = sys.modules.get("urllib3")
    return urllib3 is not None and isinstance(exc, urllib3.exceptions.HTTPError)


class WatchStream:
    """One open watch response. Iterate for events; :meth:`close` from any thread.

    Iteration yields ``{"type": ..., "object": {...}}`` dicts for ADDED, MODIFIED,
    DELETED and BOOKMARK; skips (with a log line) lines that are not JSON or not an event;
    raises :class:`Gone` on an ERROR event with code 410 and :class:`WatchErrorEvent`
    on any other ERROR event; and simply ends when the stream ends (a clean end, a
    dropped connection, a read deadline, or a line longer than :data:`MAX_LINE_BYTES`,
    which it stops reading: the metrics do not count those).
    """

    def __init__(self, resp: Any) -> None:
        self._resp = resp
        self._partial = bytearray()  # bytes after the last newline
        self.ended_by = ""  # "end" or "dropped: <error>", for logging

    def __iter__(self) -> Iterator[dict[str, Any]]:
        try:
            for line in self._lines():
                event = self._parse(line)
                if event is not None:
                    yield event
            self.ended_by = "end"
        except (Gone, WatchErrorEvent):
            raise
        except Exception as exc:
            if not _dropped(exc):
                raise
            self.ended_by = f"dropped: {type(exc).__name__}: {exc}"
        if self._partial.strip():
            # The event it began is not applied; the next watch starts from the last
            # applied resourceVersion, so the server sends it again.
            log.warning("watch line skipped reason=%r line=%.120r",
                        "truncated: the stream ended inside it",
                        self._partial.decode("utf-8", errors="replace"))

    def _lines(self) -> Iterator[str]:
        buf = self._partial
        # amt=None would read a whole chunk at once, as large as its header claims.
        for segment in self._resp.stream(amt=READ_BYTES, decode_content=False):
            # Only the new bytes can hold a newline: no rescan of a long partial line.
            start = len(buf)
            buf.extend(segment if isinstance(segment, bytes) else str(segment).encode())
            while (nl := buf.find(b"\n", start)) != -1:
                # Invalid UTF-8 becomes U+FFFD, and the line then fails JSON parsing.
                line = buf[:nl].decode("utf-8", errors="replace")
                del buf[: nl + 1]
                start = 0
                yield line
            if len(buf) > MAX_LINE_BYTES:
                size = len(buf)
                head = bytes(buf[:120]).decode("utf-8", errors="replace")
                buf.clear()
                log.warning("watch line too long; ending the stream size>=%d limit=%d "
                            "line=%.120r", size, MAX_LINE_BYTES, head)
                raise LineTooLong(f"watch line over {MAX_LINE_BYTES} bytes")

    @staticmethod
    def _parse(line: str) -> dict[str, Any] | None:
        if not line.strip():
            return None
        try:
            event = json.loads(line)
        except ValueError:
            log.warning("watch line skipped reason=%r line=%.120r", "not JSON", line)
            return None
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            log.warning("watch line skipped reason=%r line=%.120r", "not an event", line)
            return None
        obj = event.get("object")
        if event["type"] == "ERROR":
            status = obj if isinstance(obj, dict) else {}
            code = status.get("code")
            if code == 410 or status.get("reason") in GONE_REASONS:
                raise Gone(f"watch error event code={code} reason={status.get('reason')} "
                           f"message={status.get('message')}")
            raise WatchErrorEvent(code, status.get("reason"), status.get("message"))
        if not isinstance(obj, dict):
            log.warning("watch event skipped type=%s reason=%r", event["type"], "no object")
            return None
        return event

    def close(self) -> None:
        """Wake a read blocked on this stream (thread-safe), then let the reader clean up."""
        conn = getattr(self._resp, "connection", None)
        sock = getattr(conn, "sock", None)
        if sock is not None:
            # The plain-socket shutdown, not SSLSocket.shutdown: the latter drops the
            # TLS object under the reading thread's feet.
            with contextlib.suppress(OSError):
                socket.socket.shutdown(sock, socket.SHUT_RDWR)

    def release(self) -> None:
        """Close the response and return its connection (watcher thread only)."""
        try:
            self._resp.close()
            self._resp.release_conn()
        except Exception:  # already closed / pool gone: nothing to release
            log.debug("watch response release failed", exc_info=True)


def _read_list_body(resp: Any) -> bytes:
    """The whole list body, within LIST_DEADLINE_S and LIST_MAX_BYTES."""
    deadline = time.monotonic() + LIST_DEADLINE_S
    body = bytearray()
    # read1: whatever has arrived (up to READ_BYTES), so the deadline is checked as bytes
    # trickle in; read(n) would wait for all n of them.
    while chunk := resp.read1(READ_BYTES):
        body += chunk
        if len(body) > LIST_MAX_BYTES:
            raise ValueError(f"EndpointSlice list larger than {LIST_MAX_BYTES} bytes")
        if time.monotonic() > deadline:
            raise TimeoutError(f"EndpointSlice list not received within {LIST_DEADLINE_S:g} s")
    return bytes(body)


class KubeClient:
    """List and watch the ``kubernetes`` service's EndpointSlices in ``default``."""

    def __init__(self, api: Api) -> None:
        self.api = api

    @property
    def host(self) -> str:
        return self.api.host

    def list_slices(self) -> tuple[list[Any], str]:
        """(items in wire form, list resourceVersion). Raises on any failure."""
        resp = self.api.get({"label_selector": LABEL_SELECTOR},
                            (CONNECT_TIMEOUT, LIST_READ_TIMEOUT))
        try:
            body = json.loads(_read_list_body(resp))
        except BaseException:
            resp.close()  # partly read: the connection must not go back to the pool
            raise
        finally:
            resp.release_conn()
        if not isinstance(body, dict):
            raise ValueError("EndpointSlice list is not a JSON object")
        meta = body.get("metadata")
        rv = meta.get("resourceVersion") if isinstance(meta, dict) else None
        if not isinstance(rv, str) or not rv:
            raise ValueError("EndpointSlice list has no metadata.resourceVersion")
        items = body.get("items")
        if items is None:
            items = []
        if not isinstance(items, list):
            raise ValueError("EndpointSlice list items is not a list")
        return items, rv

    def watch(self, resource_version: str, timeout_seconds: int) -> WatchStream:
        """Open a watch from ``resource_version``; raises Gone on HTTP 410, else on failure."""
        try:
            resp = self.api.get(
                {"allow_watch_bookmarks": True, "label_selector": LABEL_SELECTOR,
                 "resource_version": resource_version, "timeout_seconds": timeout_seconds,
                 "watch": True},
                (CONNECT_TIMEOUT, timeout_seconds + WATCH_READ_SLACK))
        except ApiError as exc:
            if exc.status == 410:
                raise Gone(f"watch HTTP 410: {exc.reason}") from exc
            raise
        return WatchStream(resp)

    def interrupt(self) -> None:
        """End the request in flight (any thread; shutdown, after the stop Event)."""
        self.api.interrupt()

    def close(self) -> None:
        try:
            self.api.close()
        except Exception:
            log.debug("kubernetes client close failed", exc_info=True)
