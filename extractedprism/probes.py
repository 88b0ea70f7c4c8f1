"""Upstream health probes: TCP connect, then optionally HTTPS ``GET /readyz`` (socket I/O).

Owns the I/O of one health check and nothing else: no threads, no state, no logging at
info level (the registry logs transitions, once per change). The ticker calls
:func:`probe` from its probe threads, one call per upstream and interval.

One deadline, ``timeout`` seconds from the call, covers everything: name resolution,
connect, and with readyz the TLS handshake, the request and the response status line.
Each blocking step gets a socket timeout equal to the budget left, so a probe returns
within ``timeout`` (plus scheduling noise) whatever the peer does, with one exception:
``getaddrinfo`` cannot be interrupted, so a hung resolver for a *hostname* endpoint can
overrun; the probe then reports "timeout" as soon as the resolver returns. IP literal
endpoints never touch the resolver.

``rtt`` is the TCP connect time including name resolution, which is what the latency
tiers are defined on; the readyz exchange is not part of it.

Readyz credentials (client certificate/key, bearer token) and the CA bundle are read
from disk on every probe, so rotation needs no restart and a file that does not exist
yet fails the probe (``ready=False`` with a reason) instead of raising. The token is
never logged or put in a reason string.
"""

from __future__ import annotations

import errno
import logging
import re
import socket
import ssl
import time
from dataclasses import dataclass

from extractedprism.endpoints import Endpoint, is_ip

log = logging.getLogger(__name__)

_MAX_STATUS_LINE = 8192
_SSL_SOURCE = re.compile(r"\s*\(_ssl\.c:\d+\)")


@dataclass(frozen=True)
class ProbeResult:
    ok: bool  # TCP connect succeeded
    rtt: float | None  # connect time in seconds incl. name resolution (set when ok)
    reason: str  # "" when ok, else short: "connection refused", "timeout", ...
    ready: bool | None = None  # /readyz outcome; None when not probed
    ready_reason: str = ""  # "" when ready, else "HTTP 500", "TLS verify failed: ..."


@dataclass(frozen=True)
class ReadyzSettings:
    ca_file: str
    server_name: str
    cert_file: str = ""
    key_file: str = ""  # may be empty or the same file as cert_file
    token_file: str = ""


class _ProbeFailed(Exception):
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

def _no_password() -> bytes:
    # An encrypted key must fail the probe, not make OpenSSL prompt on a terminal.
    raise ValueError("client key is encrypted; a passphrase is not supported")


def _ssl_context(settings: ReadyzSettings) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verify_mode=CERT_REQUIRED, check_hostname
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_verify_locations(cafile=settings.ca_file)
    except FileNotFoundError:
        raise _ProbeFailed(f"CA file missing: {settings.ca_file}") from None
    except (OSError, ssl.SSLError) as exc:
        raise _ProbeFailed(f"CA file unusable: {settings.ca_file}: {_short(exc)}") from None
    if settings.cert_file:
        key = settings.key_file or None
        try:
            ctx.load_cert_chain(settings.cert_file, key, password=_no_password)
        except FileNotFoundError as exc:
            missing = exc.filename or settings.cert_file
            raise _ProbeFailed(f"client certificate missing: {missing}") from None
        except (OSError, ssl.SSLError, ValueError) as exc:
            raise _ProbeFailed(
                f"client certificate unusable: {settings.cert_file}: {_short(exc)}") from None
    return ctx


def _read_token(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            token = fh.read(65536).strip()
    except FileNotFoundError:
        raise _ProbeFailed(f"token file missing: {path}") from None
    except (OSError, UnicodeError) as exc:
        raise _ProbeFailed(f"token file unreadable: {path}: {type(exc).__name__}") from None
    if not token:
        raise _ProbeFailed(f"token file empty: {path}")
    if any(ch in token for ch in "\r\n\0"):
        raise _ProbeFailed(f"token file invalid: {path}: more than one line")
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
    request = (f"GET /readyz HTTP/1.1\r\nHost: {settings.server_name}\r\n"
               "User-Agent: extractedprism-probe\r\nAccept: */*\r\nConnection: close\r\n")
    if token:
        request += f"Authorization: Bearer {token}\r\n"
    payload = (request + "\r\n").encode("latin-1", "replace")
    del token, request
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
    buf = b""
    while b"\r\n" not in buf and b"\n" not in buf:
        if len(buf) > _MAX_STATUS_LINE:
            raise _ProbeFailed("malformed response: status line too long")
        tls.settimeout(deadline.remaining())
        chunk = tls.recv(4096)
        if not chunk:
            raise _ProbeFailed("connection closed before response" if not buf
                               else "malformed response: truncated status line")
        buf += chunk
    line = buf.split(b"\n", 1)[0].rstrip(b"\r")
    parts = line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        raise _ProbeFailed(f"malformed response: {line[:60]!r}")
    return int(parts[1])
