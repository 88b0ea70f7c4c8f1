"""Upstream health probes: TCP connect, then optionally HTTPS ``GET /readyz`` (socket I/O).

Owns the I/O of one health check and nothing else: no threads, no state, no logging at
info level (the registry logs transitions, once per change). The ticker calls
:func:`probe` from its probe threads, one call per upstream and interval.

One deadline, ``timeout`` seconds from the call, covers everything: name resolution,
connect, and with readyz the TLS handshake, the request and the response head (status
line and headers; the body is never read).
Each blocking step gets a socket timeout equal to the budget left, so a probe returns
within ``timeout`` (plus scheduling noise) whatever the peer does, with one exception:
``getaddrinfo`` cannot be interrupted, so a hung resolver for a *hostname* endpoint can
overrun; the probe then reports "timeout" as soon as the resolver returns. IP literal
endpoints never touch the resolver.

``rtt`` is the TCP connect time including name resolution, which is what the latency
tiers are defined on; the readyz exchange is not part of it.

Readyz credentials (client certificate/key, bearer token) and the CA bundle are read
from disk on every probe, so rotation needs no restart and a file that does not exist
yet fails the probe (``ready=False`` with a reason naming the file) instead of raising.
Only regular files are opened, so a FIFO or device path cannot block a probe thread
past its deadline. The token is never logged or put in a reason string.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import socket
import ssl
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass

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
    """Run one health check against ``endpoint``; never raises."""
    deadline = _Deadline(timeout)
    start = time.monotonic()
    try:
        sock = _connect(endpoint, deadline)
    except _ProbeFailed as exc:
        return ProbeResult(False, None, str(exc))
    except Exception as exc:  # never raise out of a probe; this is a bug, say so
        log.exception("probe unexpected error upstream=%s", endpoint)
        return ProbeResult(False, None, f"unexpected error: {type(exc).__name__}: {exc}")
    rtt = time.monotonic() - start
    try:
        if readyz is None:
            return ProbeResult(True, rtt, "")
        try:
            _readyz(sock, readyz, deadline)
        except _ProbeFailed as exc:
            return ProbeResult(True, rtt, "", ready=False, ready_reason=str(exc))
        except Exception as exc:
            log.exception("readyz probe unexpected error upstream=%s", endpoint)
            return ProbeResult(True, rtt, "", ready=False,
                               ready_reason=f"unexpected error: {type(exc).__name__}: {exc}")
        return ProbeResult(True, rtt, "", ready=True)
    finally:
        sock.close()


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
    block the probe thread forever, past any deadline.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise _ProbeFailed(f"{what} missing: {path}") from None
    except OSError as exc:
        raise _ProbeFailed(f"{what} unreadable: {path}: {_short(exc)}") from None
    if stat.S_ISDIR(st.st_mode):
        raise _ProbeFailed(f"{what} unusable: {path}: is a directory")
    if not stat.S_ISREG(st.st_mode):
        raise _ProbeFailed(f"{what} unusable: {path}: not a regular file")


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
        # Surrounding whitespace is trimmed like client-go does (strings.TrimSpace).
        token = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise _ProbeFailed(f"token file invalid: {path}: not UTF-8 text") from None
    if not token:
        raise _ProbeFailed(f"token file empty: {path}")
    # The token goes into a header: a line break would inject headers, and anything
    # else outside printable ASCII would be mangled on the wire or rejected by the
    # server, either way an authentication failure that the reason could not explain.
    if "\r" in token or "\n" in token:
        raise _ProbeFailed(f"token file invalid: {path}: more than one line")
    if any(not (" " <= ch <= "~" or ch == "\t") for ch in token):
        bad = ("a non-ASCII character" if any(ord(ch) > 0x7F for ch in token)
               else "a control character")
        raise _ProbeFailed(f"token file invalid: {path}: contains {bad}")
    return token


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


def _readyz(sock: socket.socket, settings: ReadyzSettings, deadline: _Deadline) -> None:
    """Raise _ProbeFailed with the reason unless GET /readyz answers 200."""
    ctx = _ssl_context(settings)
    token = _read_token(settings.token_file) if settings.token_file else ""
    host = settings.server_name
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 literal, bracketed as RFC 9110 7.2 requires
    request = (f"GET /readyz HTTP/1.1\r\nHost: {host}\r\n"
               "User-Agent: extractedprism-probe\r\nAccept: */*\r\nConnection: close\r\n")
    if token:
        request += f"Authorization: Bearer {token}\r\n"
    payload = (request + "\r\n").encode("latin-1", "replace")  # token: ASCII, checked
    del token, request
    try:
        # wrap_socket() takes over the socket before it encodes the name, and leaks it
        # when that fails: find out first.
        settings.server_name.encode("idna")
    except UnicodeError as exc:
        raise _ProbeFailed(f"invalid server name {settings.server_name!r}: "
                           f"{exc.__cause__ or exc}") from None
    tls: ssl.SSLSocket | None = None
    try:
        sock.settimeout(deadline.remaining())
        tls = ctx.wrap_socket(sock, server_hostname=settings.server_name,
                              do_handshake_on_connect=False)
        tls.settimeout(deadline.remaining())
        tls.do_handshake()
        tls.settimeout(deadline.remaining())
        tls.sendall(payload)
        status = _read_status(tls, deadline)
    except ssl.SSLCertVerificationError as exc:
        raise _ProbeFailed(f"TLS verify failed: {exc.verify_message or _short(exc)}") from None
    except TimeoutError:
        raise _ProbeFailed("timeout") from None
    except ssl.SSLError as exc:
        raise _ProbeFailed(f"TLS error: {_short(exc)}") from None
    except OSError as exc:
        raise _ProbeFailed(_os_reason(exc)) from None
    finally:
        if tls is not None:
            tls.close()  # no close_notify round trip: the deadline may be spent
    if status != 200:
        raise _ProbeFailed(f"HTTP {status}")


def _read_status(tls: ssl.SSLSocket, deadline: _Deadline) -> int:
    """The status of a complete response head; the body is never read, so a huge or
    dripping body costs nothing. A head cut off by a close or reset fails the probe,
    like an HTTP client would, instead of passing on a bare status line."""
    buf = b""
    status: int | None = None
    while True:
        if status is None and b"\n" in buf:
            status = _parse_status(buf.split(b"\n", 1)[0].rstrip(b"\r"))
        if status is not None and _HEAD_END.search(buf):
            return status
        if len(buf) > _MAX_HEAD:
            raise _ProbeFailed("malformed response: status line too long" if status is None
                               else "malformed response: headers too long")
        tls.settimeout(deadline.remaining())
        chunk = tls.recv(16384)
        if not chunk:
            raise _ProbeFailed("connection closed before response" if not buf
                               else "connection closed before end of response headers")
        buf += chunk


def _parse_status(line: bytes) -> int:
    parts = line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        raise _ProbeFailed(f"malformed response: {line[:60]!r}")
    return int(parts[1])
