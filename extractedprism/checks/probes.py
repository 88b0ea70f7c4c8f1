"""Upstream health probes: TCP connect, then optionally HTTPS ``GET /readyz`` (socket I/O).

Owns the I/O of one health check and nothing else: no threads, no logging at info level
(the registry logs transitions, once per change), and no state but the readyz probes'
kept-alive connections (:class:`ProbeConnections`, one per upstream). The ticker calls
``ProbeConnections.probe`` from its probe threads, one call per upstream and interval.

One deadline, ``timeout`` seconds from the call, covers everything: name resolution,
connect, and with readyz the TLS handshake, the request and the response head (status
line and headers). :func:`probe` opens a new TLS connection for every readyz request
(``Connection: close``; the body is never read). :class:`ProbeConnections`, what the
ticker runs, keeps one TLS connection per upstream alive between probes instead (see
there): the TCP check stays a connect of its own, and the ``GET /readyz`` goes over the
kept connection, which costs the API server a fraction of a handshake. A probe must judge
what a new client connection would get, so a kept connection is used only while it goes
to the address the TCP check just connected to (a host name resolved afresh, every probe)
and is younger than ``max_age`` (:func:`kept_max_age`: :data:`KEPT_MAX_INTERVALS` probe
intervals); otherwise the probe makes a new one, with a full TLS handshake that verifies
the server's certificate as it is now.
Each blocking step gets a socket timeout equal to the budget left, so a probe returns
within ``timeout`` (plus scheduling noise) whatever the peer does, with one exception:
``getaddrinfo`` cannot be interrupted, so a hung resolver for a *hostname* endpoint can
overrun; the probe then reports "timeout" as soon as the resolver returns. IP literal
endpoints never touch the resolver.

``rtt`` is the TCP connect time including name resolution, which is what the latency
tiers are defined on; the readyz exchange is not part of it.

Readyz credentials (client certificate/key, bearer token) and the CA bundle are read
from disk on every probe (a kept connection is replaced when any of them changed), so
rotation needs no restart and a file that does not exist
yet fails the probe (``ready=False`` with a reason naming the file) instead of raising.
Only regular files are opened, so a FIFO or device path cannot block a probe thread
past its deadline. The token is never logged or put in a reason string.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import re
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

from extractedprism import files
from extractedprism.config.endpoints import Endpoint, is_ip
from extractedprism.errors import Error
from extractedprism.upstreams.state import ProbeResult

log = logging.getLogger(__name__)

_SSL_SOURCE = re.compile(r"\s*\(_ssl\.c:\d+\)")


@dataclass(frozen=True)
class ReadyzSettings:
    ca_file: str
    server_name: str
    cert_file: str = ""
    key_file: str = ""  # may be empty or the same file as cert_file
    token_file: str = ""


# What runs one health check: :func:`probe`, or a stand-in that tests give the ticker.
Prober = Callable[[Endpoint, float, ReadyzSettings | None], ProbeResult]


class _ProbeFailed(Error):
    """Internal: carries the short reason of a failed step."""


class _Deadline:
    __slots__ = ("end",)

    def __init__(self, timeout: float) -> None:
        self.end = time.monotonic() + timeout

    def remaining(self) -> float:
        """Seconds left; raises _ProbeFailed("timeout") when none is."""
        left = self.end - time.monotonic()
        if left <= 0:
            raise _ProbeFailed("timeout")
        return left


def probe(endpoint: Endpoint, timeout: float, readyz: ReadyzSettings | None = None
          ) -> ProbeResult:
    """Run one health check against ``endpoint`` (readyz on a new TLS connection that is
    closed afterwards); never raises."""
    return _probe(endpoint, timeout, readyz, None)


def _probe(endpoint: Endpoint, timeout: float, readyz: ReadyzSettings | None,
           kept: _Kept | None) -> ProbeResult:
    deadline = _Deadline(timeout)
    start = time.monotonic()
    try:
        sock = _connect(endpoint, deadline)
    except _ProbeFailed as exc:
        if kept is not None:
            kept.discard()  # the server is gone or unreachable: so is its connection
        return ProbeResult(False, None, str(exc))
    except Exception as exc:  # never raise out of a probe; this is a bug, say so
        log.exception("probe unexpected error upstream=%s", endpoint)
        return ProbeResult(False, None, f"unexpected error: {type(exc).__name__}: {exc}")
    rtt = time.monotonic() - start
    try:
        if readyz is None:
            return ProbeResult(True, rtt, "")
        try:
            if kept is None:
                _readyz(sock, readyz, deadline)
            else:
                _readyz_kept(endpoint, sock, readyz, deadline, kept)
        except _ProbeFailed as exc:
            return ProbeResult(True, rtt, "", ready=False, ready_reason=str(exc))
        except Exception as exc:
            log.exception("readyz probe unexpected error upstream=%s", endpoint)
            return ProbeResult(True, rtt, "", ready=False,
                               ready_reason=f"unexpected error: {type(exc).__name__}: {exc}")
        return ProbeResult(True, rtt, "", ready=True)
    finally:
        sock.close()  # a no-op once a TLS connection took the socket over


# A kept readyz connection carries the probes of at most this many intervals, then a new
# one is made: a full handshake verifies the serving certificate the server presents now
# (a kept connection verified the one it had at its handshake). A multiple of the interval
# and not a number of seconds, so the handshakes stay the same share of the probes (one in
# twelve; measured 0.15-0.43 ms more API-server CPU per probe than a connection kept for
# ever, still half or less of a new connection's, docs/deploy.md) whatever the interval an
# operator sets for the fleet's size; 12 makes it a minute at the profile's 5 s, and 4
# minutes at the spec's 20 s.
KEPT_MAX_INTERVALS = 12


def kept_max_age(interval: float) -> float:
    """Seconds a kept readyz connection is used for, with probes every ``interval``."""
    return KEPT_MAX_INTERVALS * interval


class ProbeConnections:
    """The readyz probe's kept-alive TLS connections, one per upstream, and the prober
    that uses them (:meth:`probe`, a :data:`Prober`).

    Owned by the ticker: it calls :meth:`retain` with the upstreams it checks, so the
    connection of an upstream that is removed (or drained) is closed, and :meth:`close`
    at shutdown. Each upstream's connection sits in a small holder that one probe checks
    out at a time; a second probe of the same upstream meanwhile (the ticker never starts
    one, this is a guard) gets a connection of its own that is closed afterwards. The
    registry and its lock are not involved; nothing but ``GET /readyz`` ever goes over a
    kept connection.

    ``max_age``: seconds from a connection's handshake after which no probe uses it (the
    ticker's is :func:`kept_max_age` of its interval); ``clock`` measures that age.
    """

    def __init__(self, *, max_age: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, _Kept] = {}
        self._closed = False
        self._max_age = max_age
        self._clock = clock

    def _holder(self, *, keep: bool = True) -> _Kept:
        return _Kept(self._max_age, self._clock, keep=keep)

    def probe(self, endpoint: Endpoint, timeout: float,
              readyz: ReadyzSettings | None = None) -> ProbeResult:
        """Like :func:`probe`, with the readyz request on the upstream's kept connection."""
        if readyz is None:
            return _probe(endpoint, timeout, None, None)
        addr = str(endpoint)
        with self._lock:
            kept = None if self._closed else self._held.get(addr)
            if kept is None and not self._closed:
                kept = self._held[addr] = self._holder()
        if kept is not None and kept.checkout():
            try:
                return _probe(endpoint, timeout, readyz, kept)
            finally:
                kept.checkin()
        once = self._holder(keep=False)  # busy or shut down: a connection of its own
        try:
            return _probe(endpoint, timeout, readyz, once)
        finally:
            if kept is not None:
                kept.add_opened(once.opened)

    def retain(self, addresses: Collection[str]) -> None:
        """Close the kept connections of every upstream not in ``addresses``."""
        with self._lock:
            gone = [self._held.pop(a) for a in list(self._held) if a not in addresses]
        for kept in gone:
            kept.retire()

    def close(self) -> None:
        """Close every kept connection; later probes keep none (shutdown)."""
        with self._lock:
            self._closed = True
            gone = list(self._held.values())
            self._held.clear()
        for kept in gone:
            kept.retire()

    def opened(self) -> dict[str, int]:
        """New TLS connections the readyz probes opened, per upstream probed (the
        difference to the number of probes is what keeping them saved)."""
        with self._lock:
            return {addr: kept.opened for addr, kept in self._held.items()}


class _Kept:
    """One upstream's kept connection: checked out by one probe at a time. ``_mu`` guards
    the fields for a moment and never a socket call; the socket is out of the holder
    while a probe uses it, so :meth:`retire` never closes it under that probe, and the
    probe closes it when it hands it back to a retired holder."""

    def __init__(self, max_age: float, clock: Callable[[], float], *,
                 keep: bool = True) -> None:
        self._mu = threading.Lock()
        self._busy = False
        self._retired = not keep
        self._tls: ssl.SSLSocket | None = None
        self._key = b""
        self._born = 0.0  # the clock at the kept connection's handshake
        self.max_age = max_age
        self.clock = clock
        self.opened = 0  # written by the probe holding it, read by the metrics

    def checkout(self) -> bool:
        with self._mu:
            if self._busy:
                return False
            self._busy = True
            return True

    def checkin(self) -> None:
        with self._mu:
            self._busy = False

    def add_opened(self, n: int) -> None:
        with self._mu:
            self.opened += n

    def take(self, key: bytes, peer: tuple[str, int]) -> tuple[ssl.SSLSocket, float] | None:
        """The kept connection and the clock at its handshake, if it was opened with the
        credential files whose digest is ``key``, goes to ``peer`` (where the TCP check
        just connected: the name's address now), is younger than ``max_age`` and looks
        alive; otherwise None (a stale one is closed)."""
        with self._mu:
            tls, self._tls = self._tls, None
            same, born = self._key == key, self._born
        if tls is None:
            return None
        if not same:
            why = "credentials changed"
        elif self.clock() - born >= self.max_age:
            why = "max age"
        elif _peer(tls) != peer:
            why = "address changed"
        elif not _idle_and_open(tls):
            why = "closed by the server"
        else:
            return tls, born
        log.debug("readyz probe: a new connection replaces the kept one reason=%r", why)
        tls.close()
        return None

    def put(self, tls: ssl.SSLSocket, key: bytes, born: float) -> None:
        with self._mu:
            if not self._retired:
                self._tls, self._key, self._born = tls, key, born
                return
        tls.close()

    def discard(self) -> None:
        with self._mu:
            tls, self._tls = self._tls, None
        if tls is not None:
            tls.close()

    def retire(self) -> None:
        with self._mu:
            self._retired = True
            tls, self._tls = self._tls, None
        if tls is not None:
            tls.close()


def _peer(sock: socket.socket) -> tuple[str, int] | None:
    """(address, port) at the other end (an IPv6 name's flow and scope left out)."""
    try:
        host, port = sock.getpeername()[:2]
    except (OSError, ValueError):
        return None
    return host, port


def _idle_and_open(tls: ssl.SSLSocket) -> bool:
    """An idle kept connection has nothing to read: anything readable is the server's
    close (close_notify, FIN, reset) or bytes nobody asked for, either way not reusable."""
    try:
        if tls.pending():
            return False
        poller = select.poll()  # not select(): a busy proxy's descriptors pass 1024
        poller.register(tls.fileno(), select.POLLIN | select.POLLPRI)
        return not poller.poll(0)
    except (OSError, ValueError):
        return False


# --- TCP ---------------------------------------------------------------------

_ERRNO_REASONS = {
    errno.ECONNREFUSED: "connection refused",
    errno.ETIMEDOUT: "timeout",
    errno.EHOSTUNREACH: "no route to host",
    errno.ENETUNREACH: "network unreachable",
    errno.ECONNRESET: "connection reset",
    errno.EADDRNOTAVAIL: "address not available",
}


def _os_reason(exc: OSError) -> str:
    if isinstance(exc, TimeoutError | socket.timeout):
        return "timeout"
    if exc.errno in _ERRNO_REASONS:
        return _ERRNO_REASONS[exc.errno]
    return exc.strerror or type(exc).__name__


def _resolve(endpoint: Endpoint, deadline: _Deadline) -> list[tuple]:
    flags = socket.AI_NUMERICHOST if is_ip(endpoint.host) else 0
    try:
        infos = socket.getaddrinfo(endpoint.host, endpoint.port, type=socket.SOCK_STREAM,
                                   proto=socket.IPPROTO_TCP, flags=flags)
    except socket.gaierror as exc:
        raise _ProbeFailed(f"name resolution failed: {exc.strerror or exc}") from None
    except UnicodeError as exc:  # e.g. an over-long label
        raise _ProbeFailed(f"name resolution failed: {exc}") from None
    deadline.remaining()  # the resolver may have used the whole budget
    if not infos:
        raise _ProbeFailed("name resolution failed: no addresses")
    return infos


def _connect(endpoint: Endpoint, deadline: _Deadline) -> socket.socket:
    """Connect to the first address that answers, like ``socket.create_connection``,
    but every attempt bounded by the one deadline."""
    reason = "no addresses"
    for family, socktype, proto, _canon, addr in _resolve(endpoint, deadline):
        sock = socket.socket(family, socktype, proto)
        try:
            sock.settimeout(deadline.remaining())
            sock.connect(addr)
            return sock
        except _ProbeFailed:
            sock.close()
            raise
        except OSError as exc:
            sock.close()
            reason = _os_reason(exc)
            if reason == "timeout":
                raise _ProbeFailed(reason) from None
        except BaseException:
            sock.close()
            raise
    raise _ProbeFailed(reason)


# --- readyz ------------------------------------------------------------------

# A bearer token is a few KiB at most; a bigger file is the wrong file, and sending a
# truncated token would fail in a way the reason could not explain.
_MAX_TOKEN_BYTES = 64 * 1024
# Bounds the response head (status line and headers) read before deciding.
_MAX_HEAD = 64 * 1024
_HEAD_END = re.compile(rb"\r?\n\r?\n")
# Only read to explain a failure, never on the happy path.
_MAX_DIAGNOSE_BYTES = 1024 * 1024


class _EncryptedKey(Error):
    """Raised by the password callback: OpenSSL asks only for an encrypted key."""


def _no_password() -> bytes:
    # An encrypted key must fail the probe, not make OpenSSL prompt on a terminal.
    raise _EncryptedKey


def _check_file(path: str, what: str) -> None:
    """Fail with ``what`` and ``path`` unless ``path`` is a regular file.

    OpenSSL only says "No such file or directory" without naming the file, so the
    reason must come from here to name the right one of cert and key. It also keeps a
    FIFO or device (``/dev/zero``) from ever being opened: that open or read would
    block the probe thread forever, past any deadline. (The rule is files.identity's,
    shared with discovery.)
    """
    try:
        files.identity(path, what)
    except files.FileProblem as exc:
        raise _ProbeFailed(str(exc)) from None


def ca_file_problem(path: str) -> str:
    """Why ``path`` cannot serve as the probe CA bundle, or "" when it can (a start-up
    check; probes re-read the file anyway)."""
    try:
        _load_ca(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), path)
    except _ProbeFailed as exc:
        return str(exc)
    return ""


def _load_ca(ctx: ssl.SSLContext, path: str) -> None:
    _check_file(path, "CA file")
    try:
        ctx.load_verify_locations(cafile=path)
    except FileNotFoundError:  # removed since the check
        raise _ProbeFailed(f"CA file missing: {path}") from None
    except ssl.SSLError as exc:
        why = ("no PEM certificate found" if exc.reason == "NO_CERTIFICATE_OR_CRL_FOUND"
               else _short(exc))
        raise _ProbeFailed(f"CA file unusable: {path}: {why}") from None
    except OSError as exc:
        raise _ProbeFailed(f"CA file unusable: {path}: {_short(exc)}") from None


def _ssl_context(settings: ReadyzSettings) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verify_mode=CERT_REQUIRED, check_hostname
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_ca(ctx, settings.ca_file)
    if settings.cert_file:
        cert = settings.cert_file
        key = settings.key_file or cert
        _check_file(cert, "client certificate")
        if key != cert:
            _check_file(key, "client key")
        try:
            ctx.load_cert_chain(cert, key, password=_no_password)
        except _EncryptedKey:
            raise _ProbeFailed(f"client key unusable: {key}: encrypted; a passphrase is "
                               "not supported") from None
        except (OSError, ssl.SSLError) as exc:
            raise _ProbeFailed(_cert_chain_reason(cert, key, exc)) from None
    return ctx


def _cert_chain_reason(cert: str, key: str, exc: OSError) -> str:
    """Say which of cert and key is wrong: OpenSSL's own error ("PEM lib") names neither."""
    if isinstance(exc, ssl.SSLError) and exc.reason == "KEY_VALUES_MISMATCH":
        return f"client key unusable: {key}: does not match the client certificate {cert}"
    if isinstance(exc, ssl.SSLError):
        for path, what, marker in ((cert, "client certificate", b"-----BEGIN CERTIFICATE-----"),
                                   (key, "client key", b"PRIVATE KEY-----")):
            try:
                with open(path, "rb") as fh:
                    data = fh.read(_MAX_DIAGNOSE_BYTES)
            except OSError as read_exc:  # replaced meanwhile
                return f"{what} unreadable: {path}: {_short(read_exc)}"
            if marker not in data:
                kind = "certificate" if what == "client certificate" else "private key"
                return f"{what} unusable: {path}: no PEM {kind} found"
    name = cert if key == cert else f"{cert}, {key}"
    return f"client certificate unusable: {name}: {_short(exc)}"


def _read_token(path: str) -> str:
    _check_file(path, "token file")
    try:
        with open(path, "rb") as fh:
            raw = fh.read(_MAX_TOKEN_BYTES + 1)
    except FileNotFoundError:
        raise _ProbeFailed(f"token file missing: {path}") from None
    except OSError as exc:
        raise _ProbeFailed(f"token file unreadable: {path}: {_short(exc)}") from None
    if len(raw) > _MAX_TOKEN_BYTES:
        raise _ProbeFailed(f"token file invalid: {path}: larger than "
                           f"{_MAX_TOKEN_BYTES // 1024} KiB")
    try:
        return files.bearer_token(raw)
    except ValueError as exc:
        if str(exc) == "empty":
            raise _ProbeFailed(f"token file empty: {path}") from None
        raise _ProbeFailed(f"token file invalid: {path}: {exc}") from None


def _short(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLEOFError):
        return "connection closed by peer"  # e.g. the server wanted a client certificate
    if isinstance(exc, ssl.SSLError):
        reason = getattr(exc, "reason", None)
        if reason:
            return str(reason).lower().replace("_", " ")
        text = str(exc.args[1] if len(exc.args) > 1 else exc)
        return _SSL_SOURCE.sub("", text).strip() or type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def _request(settings: ReadyzSettings, token: str, *, keep_alive: bool) -> bytes:
    host = settings.server_name
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 literal, bracketed as RFC 9110 7.2 requires
    connection = "keep-alive" if keep_alive else "close"
    request = (f"GET /readyz HTTP/1.1\r\nHost: {host}\r\n"
               f"User-Agent: extractedprism-probe\r\nAccept: */*\r\nConnection: {connection}\r\n")
    if token:
        request += f"Authorization: Bearer {token}\r\n"
    return (request + "\r\n").encode("latin-1", "replace")  # token: ASCII, checked


def _check_server_name(settings: ReadyzSettings) -> None:
    try:
        # wrap_socket() takes over the socket before it encodes the name, and leaks it
        # when that fails: find out first.
        settings.server_name.encode("idna")
    except UnicodeError as exc:
        raise _ProbeFailed(f"invalid server name {settings.server_name!r}: "
                           f"{exc.__cause__ or exc}") from None


@contextlib.contextmanager
def _tls_failures() -> Iterator[None]:
    """Turn what a TLS exchange raises into the probe's short reason."""
    try:
        yield
    except ssl.SSLCertVerificationError as exc:
        raise _ProbeFailed(f"TLS verify failed: {exc.verify_message or _short(exc)}") from None
    except TimeoutError:
        raise _ProbeFailed("timeout") from None
    except ssl.SSLError as exc:
        raise _ProbeFailed(f"TLS error: {_short(exc)}") from None
    except OSError as exc:
        raise _ProbeFailed(_os_reason(exc)) from None


def _handshake(ctx: ssl.SSLContext, sock: socket.socket, settings: ReadyzSettings,
               deadline: _Deadline) -> ssl.SSLSocket:
    sock.settimeout(deadline.remaining())
    tls = ctx.wrap_socket(sock, server_hostname=settings.server_name,
                          do_handshake_on_connect=False)
    try:
        tls.settimeout(deadline.remaining())
        tls.do_handshake()
    except BaseException:
        tls.close()
        raise
    return tls


def _readyz(sock: socket.socket, settings: ReadyzSettings, deadline: _Deadline) -> None:
    """One-shot: raise _ProbeFailed with the reason unless GET /readyz, on a new TLS
    connection over ``sock`` that is closed afterwards, answers 200."""
    ctx = _ssl_context(settings)
    token = _read_token(settings.token_file) if settings.token_file else ""
    payload = _request(settings, token, keep_alive=False)
    del token
    _check_server_name(settings)
    tls: ssl.SSLSocket | None = None
    try:
        with _tls_failures():
            tls = _handshake(ctx, sock, settings, deadline)
            tls.settimeout(deadline.remaining())
            tls.sendall(payload)
            status = _read_head(_Reader(tls, deadline)).status
    finally:
        if tls is not None:
            tls.close()  # no close_notify round trip: the deadline may be spent
    if status != 200:
        raise _ProbeFailed(f"HTTP {status}")


def _readyz_kept(endpoint: Endpoint, sock: socket.socket, settings: ReadyzSettings,
                 deadline: _Deadline, kept: _Kept) -> None:
    """GET /readyz on the upstream's kept connection (or a new one, then kept).

    ``sock`` is the TCP check's connection: closed unused when a kept connection is
    there, the new TLS connection's socket otherwise. A kept connection is used only
    while it goes where ``sock`` went (a host name that resolves elsewhere now gets a new
    connection there) and is younger than the holder's max age. A kept connection that turns out
    closed by the server before any byte of the answer (an API server closing idle
    connections, which is no failure) is replaced by a new one once, within the same
    deadline; one that does not answer in time fails the probe and is closed, so the next
    probe opens a new one. Any answer not framed exactly (Content-Length or chunked, the
    body within a bound) leaves nothing kept.
    """
    try:
        files = _files_digest(settings)
        token = _read_token(settings.token_file) if settings.token_file else ""
    except _ProbeFailed:
        kept.discard()  # a credential gone or broken: what it opened goes too
        raise
    key = hashlib.sha256(files + b"\0" + token.encode()).digest()
    payload = _request(settings, token, keep_alive=True)
    del token
    _check_server_name(settings)
    peer = _peer(sock)
    taken = kept.take(key, peer) if peer is not None else None
    tls, born = taken if taken is not None else (None, 0.0)
    if tls is not None:
        sock.close()  # the TCP check was a connect of its own
    ctx: ssl.SSLContext | None = None
    try:
        with _tls_failures():
            while True:
                reused = tls is not None
                if tls is None:
                    if ctx is None:
                        ctx = _ssl_context(settings)  # re-reads the files checked above
                    if sock.fileno() < 0:  # closed for a kept one that turned out dead
                        sock = _connect(endpoint, deadline)
                    kept.add_opened(1)  # the server's cost: counted, handshake or not
                    born = kept.clock()
                    tls = _handshake(ctx, sock, settings, deadline)
                try:
                    response = _exchange(tls, payload, deadline, reused=reused)
                except _Stale:
                    tls.close()
                    tls = None
                    continue
                break
        if response.reusable:
            kept.put(tls, key, born)
            tls = None
    finally:
        if tls is not None:
            tls.close()
        sock.close()  # a no-op once the TLS connection took the socket over
    if response.status != 200:
        raise _ProbeFailed(f"HTTP {response.status}")


def _files_digest(settings: ReadyzSettings) -> bytes:
    """A fingerprint of the CA bundle, client certificate and key as they are now
    (files.fingerprint, the rule discovery's credentials follow too): a kept connection
    made with other contents is replaced. Read in full every probe (a few KiB), so a
    rewrite within one mtime tick is seen too."""
    names = [(settings.ca_file, "CA file")]
    if settings.cert_file:
        names.append((settings.cert_file, "client certificate"))
        if settings.key_file and settings.key_file != settings.cert_file:
            names.append((settings.key_file, "client key"))
    try:
        return files.fingerprint(names)
    except files.FileProblem as exc:
        raise _ProbeFailed(str(exc)) from None


class _Stale(Exception):
    """Internal: a reused kept connection was closed by the server before any byte of
    the answer; a new connection may take its place within the same deadline."""


# A readyz answer is a few bytes ("ok") up to a verbose list of checks: a bigger body is
# not kept around for, the connection is closed instead.
_MAX_BODY = 64 * 1024
_NO_BODY = frozenset({204, 304})
_HEX = b"0123456789abcdefABCDEF"


@dataclass(frozen=True)
class _Response:
    status: int
    reusable: bool  # framed exactly, read to its end, and the server keeps it open


@dataclass(frozen=True)
class _Head:
    version: bytes
    status: int
    headers: tuple[tuple[bytes, bytes], ...] | None  # None: not parseable as fields
    rest: bytes  # bytes read past the head


class _Reader:
    """Buffered reads from a TLS socket, each bounded by the deadline."""

    def __init__(self, tls: ssl.SSLSocket, deadline: _Deadline) -> None:
        self.tls = tls
        self.deadline = deadline
        self.buf = b""
        self.received = 0

    def fill(self) -> bool:
        """Read more; False at EOF."""
        self.tls.settimeout(self.deadline.remaining())
        chunk = self.tls.recv(16384)
        self.received += len(chunk)
        self.buf += chunk
        return bool(chunk)


def _exchange(tls: ssl.SSLSocket, payload: bytes, deadline: _Deadline, *, reused: bool
              ) -> _Response:
    reader = _Reader(tls, deadline)
    try:
        tls.settimeout(deadline.remaining())
        tls.sendall(payload)
        head = _read_head(reader)
    except (ConnectionResetError, BrokenPipeError, ssl.SSLEOFError, ssl.SSLZeroReturnError):
        if reused and reader.received == 0:
            raise _Stale from None
        raise
    except _ProbeFailed as exc:
        if reused and reader.received == 0 and str(exc) == _CLOSED_BEFORE_RESPONSE:
            raise _Stale from None
        raise
    try:
        reusable = _read_body(reader, head)
    except (_ProbeFailed, OSError):
        reusable = False  # the status stands; the connection is not kept
    return _Response(head.status, reusable)


_CLOSED_BEFORE_RESPONSE = "connection closed before response"


def _read_head(reader: _Reader) -> _Head:
    """A complete response head. A head cut off by a close or reset fails the probe,
    like an HTTP client would, instead of passing on a bare status line."""
    status: int | None = None
    while True:
        buf = reader.buf
        if status is None and b"\n" in buf:
            status = _parse_status(buf.split(b"\n", 1)[0].rstrip(b"\r"))
        if status is not None:
            end = _HEAD_END.search(buf)
            if end is not None:
                return _parse_head(buf[:end.start()], status, buf[end.end():])
        if len(buf) > _MAX_HEAD:
            raise _ProbeFailed("malformed response: status line too long" if status is None
                               else "malformed response: headers too long")
        if not reader.fill():
            raise _ProbeFailed(_CLOSED_BEFORE_RESPONSE if not buf
                               else "connection closed before end of response headers")


def _parse_head(head: bytes, status: int, rest: bytes) -> _Head:
    lines = head.split(b"\n")
    version = lines[0].split(None, 1)[0]
    fields: list[tuple[bytes, bytes]] = []
    for raw in lines[1:]:
        line = raw.rstrip(b"\r")
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip() or line[:1] in (b" ", b"\t"):
            return _Head(version, status, None, rest)  # folded or broken: decide, not keep
        fields.append((name.lower(), value.strip()))
    return _Head(version, status, tuple(fields), rest)


def _read_body(reader: _Reader, head: _Head) -> bool:
    """Read the body to its exact end; True when the connection can carry the next probe."""
    if head.headers is None or head.version != b"HTTP/1.1" or head.status < 200:
        return False
    values: dict[bytes, list[bytes]] = {}
    for name, value in head.headers:
        values.setdefault(name, []).append(value)
    tokens = {t.strip().lower() for v in values.get(b"connection", ()) for t in v.split(b",")}
    if b"close" in tokens:
        return False
    reader.buf = head.rest
    if head.status in _NO_BODY:
        return not reader.buf
    if b"transfer-encoding" in values:
        codings = [t.strip().lower() for v in values[b"transfer-encoding"] for t in v.split(b",")]
        if codings != [b"chunked"] or b"content-length" in values:
            return False
        return _read_chunked(reader)
    lengths = {v for v in values.get(b"content-length", ())}
    if len(lengths) != 1:
        return False  # none: the body runs to the close; several: ambiguous
    text = lengths.pop()
    if not text.isdigit() or int(text) > _MAX_BODY:
        return False
    n = int(text)
    while len(reader.buf) < n:
        if not reader.fill():
            return False
    return len(reader.buf) == n  # more than the body: bytes nobody asked for


def _read_chunked(reader: _Reader) -> bool:
    total = 0
    while True:
        line = _read_line(reader)
        if line is None:
            return False
        size_text = line.split(b";", 1)[0].strip()
        if not size_text or len(size_text) > 8 or size_text.strip(_HEX):
            return False  # int(x, 16) would also take "0x", "+" and "_"
        size = int(size_text, 16)
        total += size
        if total > _MAX_BODY:
            return False
        if size == 0:
            break
        while len(reader.buf) < size + 2:
            if not reader.fill():
                return False
        if reader.buf[size:size + 2] != b"\r\n":
            return False
        reader.buf = reader.buf[size + 2:]
    while True:  # trailer fields, then the empty line
        line = _read_line(reader)
        if line is None:
            return False
        if not line:
            return not reader.buf


def _read_line(reader: _Reader) -> bytes | None:
    """One CRLF-terminated line (without it) off the buffer; None on EOF or an over-long
    line."""
    while b"\r\n" not in reader.buf:
        if len(reader.buf) > 4096 or not reader.fill():
            return None
    line, reader.buf = reader.buf.split(b"\r\n", 1)
    return line


def _parse_status(line: bytes) -> int:
    parts = line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        raise _ProbeFailed(f"malformed response: {line[:60]!r}")
    return int(parts[1])
