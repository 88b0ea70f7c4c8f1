"""The bounded client load through the proxy and the record of every attempt it made."""

from __future__ import annotations

import contextlib
import json
import random
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from epscripts.chaos.bounds import CLIENT_TIMEOUT, MAX_ATTEMPTS_PER_CLIENT, SERVER_NAME, WATCH_STALL


def mono() -> float:
    return time.monotonic()


class Stopped(Exception):
    """The harness is shutting the load down."""


# --------------------------------------------------------------------------------------
# Recording


@dataclass
class Attempt:
    """One new client connection through the proxy."""

    kind: str  # short | watch | stream
    client: str
    start: float
    connected: float | None = None  # TCP connect to the proxy done
    first_byte: float | None = None  # TLS handshake done: an upstream answered
    established: bool = False  # an upstream identified itself
    upstream: str | None = None
    ok: bool = False  # short: request verified; long-lived: established
    end: float | None = None
    error: str = ""  # why it failed before being established / verified
    end_reason: str = ""  # long-lived: how an established connection ended
    nbytes: int = 0


@dataclass
class Recorder:
    lock: threading.Lock = field(default_factory=threading.Lock)
    attempts: list[Attempt] = field(default_factory=list)
    corrupt: list[tuple[float, str]] = field(default_factory=list)
    bytes_checked: int = 0

    def add(self, a: Attempt) -> None:
        with self.lock:
            self.attempts.append(a)

    def add_bytes(self, n: int) -> None:
        with self.lock:
            self.bytes_checked += n

    def corruption(self, what: str) -> None:
        with self.lock:
            self.corrupt.append((mono(), what))

    def snapshot(self) -> list[Attempt]:
        """Attempts recorded so far (open ones have ``end`` None), without those the
        harness itself cut short by stopping the load."""
        with self.lock:
            return [a for a in self.attempts if a.error != "stopped"]


# --------------------------------------------------------------------------------------
# Client load


class Reader:
    """Byte reader over a socket with a short poll timeout, so a stop is noticed."""

    def __init__(self, sock: socket.socket, stop: threading.Event) -> None:
        self.sock = sock
        self.stop = stop
        self.buf = bytearray()

    def _fill(self, deadline: float) -> None:
        while True:
            if self.stop.is_set():
                raise Stopped
            if mono() > deadline:
                raise TimeoutError("client deadline")
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            if not data:
                raise EOFError("connection closed")
            self.buf += data
            return

    def line(self, deadline: float) -> bytes:
        while True:
            i = self.buf.find(b"\r\n")
            if i >= 0:
                out = bytes(self.buf[:i])
                del self.buf[:i + 2]
                return out
            if len(self.buf) > 65536:
                raise ValueError("line too long")
            self._fill(deadline)

    def exact(self, n: int, deadline: float) -> bytes:
        while len(self.buf) < n:
            self._fill(deadline)
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def head(self, deadline: float) -> tuple[int, dict[str, str]]:
        status = self.line(deadline).decode("latin-1").split()
        if len(status) < 2 or not status[0].startswith("HTTP/"):
            raise ValueError(f"bad status line {status!r}")
        headers: dict[str, str] = {}
        while True:
            h = self.line(deadline)
            if not h:
                return int(status[1]), headers
            k, _, v = h.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()


def describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, EOFError):
        return "closed"
    if isinstance(exc, ConnectionResetError):
        return "reset"
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if isinstance(exc, ssl.SSLError):
        return f"tls: {exc.reason or exc}"
    return f"{type(exc).__name__}: {exc}"


class Load:
    """The client threads. Every loop ends at ``stop`` or ``deadline`` or the attempt cap."""

    def __init__(self, proxy_port: int, ca_file: Path, rec: Recorder, *, watches: int,
                 streams: int, shorts: int, deadline: float) -> None:
        self.addr = ("127.0.0.1", proxy_port)
        self.ctx = ssl.create_default_context(cafile=str(ca_file))
        self.rec = rec
        self.stop = threading.Event()
        self.deadline = deadline
        # Bumped by the harness to make every long-lived client reconnect (a fresh spread
        # over the upstreams before an event); such ends are "recycled", not failures.
        self.generation = 0
        self.threads: list[threading.Thread] = []
        for i in range(watches):
            self.threads.append(threading.Thread(target=self._watch_loop, args=(f"watch-{i}",),
                                                 name=f"load-watch-{i}", daemon=True))
        for i in range(streams):
            self.threads.append(threading.Thread(target=self._stream_loop,
                                                 args=(f"stream-{i}",),
                                                 name=f"load-stream-{i}", daemon=True))
        for i in range(shorts):
            self.threads.append(threading.Thread(target=self._short_loop, args=(f"short-{i}",),
                                                 name=f"load-short-{i}", daemon=True))

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(CLIENT_TIMEOUT + 5)

    def running(self) -> bool:
        return not self.stop.is_set() and mono() < self.deadline

    def _open(self, a: Attempt) -> tuple[ssl.SSLSocket, Reader]:
        raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        raw.settimeout(CLIENT_TIMEOUT)
        try:
            raw.connect(self.addr)
            a.connected = mono()
            tls = self.ctx.wrap_socket(raw, server_hostname=SERVER_NAME)
        except BaseException:
            raw.close()
            raise
        a.first_byte = mono()
        tls.settimeout(0.25)
        return tls, Reader(tls, self.stop)

    def _pause(self, seconds: float) -> None:
        self.stop.wait(seconds)

    # -- short requests on new connections ------------------------------------------

    def _short_loop(self, cid: str) -> None:
        rng = random.Random(cid)
        for _ in range(MAX_ATTEMPTS_PER_CLIENT):
            if not self.running():
                return
            a = Attempt("short", cid, mono())
            self.rec.add(a)
            payload = rng.randbytes(rng.randint(1, 16384))
            tls = None
            try:
                tls, rd = self._open(a)
                tls.sendall(b"POST /echo HTTP/1.1\r\nHost: " + SERVER_NAME.encode()
                            + b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                            % len(payload) + payload)
                dl = mono() + CLIENT_TIMEOUT
                status, headers = rd.head(dl)
                a.upstream = headers.get("x-upstream")
                a.established = a.upstream is not None
                body = rd.exact(int(headers.get("content-length", "0")), dl)
                if status != 200:
                    a.error = f"HTTP {status}"
                elif body != payload:
                    a.error = "corrupted echo"
                    self.rec.corruption(f"{cid}: echo of {len(payload)} bytes differs "
                                        f"(upstream {a.upstream})")
                else:
                    a.ok = True
                    a.nbytes = len(payload)
                    self.rec.add_bytes(len(payload))
            except Stopped:
                a.error = "stopped"
            except (OSError, EOFError, ValueError) as exc:
                a.error = describe(exc)
            finally:
                a.end = mono()
                if tls is not None:
                    tls.close()
            self._pause(0.02)

    @contextlib.contextmanager
    def _long_lived(self, a: Attempt) -> Iterator[list[ssl.SSLSocket]]:
        """End-of-attempt bookkeeping shared by the watch and echo-stream clients: an
        error before the stream was established is a failed connection, after it a
        reason the stream ended; the sockets appended to the list are closed."""
        opened: list[ssl.SSLSocket] = []
        try:
            yield opened
        except Stopped:
            a.end_reason = a.end_reason or "stopped"
            if not a.established:
                a.error = "stopped"
        except (OSError, EOFError, ValueError) as exc:
            if a.established:
                a.end_reason = describe(exc)
            else:
                a.error = describe(exc)
        finally:
            a.end = mono()
            for tls in opened:
                tls.close()

    # -- long-lived: watch streams ----------------------------------------------------

    def _watch_loop(self, cid: str) -> None:
        for _ in range(MAX_ATTEMPTS_PER_CLIENT):
            if not self.running():
                return
            a = Attempt("watch", cid, mono())
            self.rec.add(a)
            with self._long_lived(a) as opened:
                tls, rd = self._open(a)
                opened.append(tls)
                tls.sendall(b"GET /watch HTTP/1.1\r\nHost: " + SERVER_NAME.encode()
                            + b"\r\n\r\n")
                status, headers = rd.head(mono() + CLIENT_TIMEOUT)
                a.upstream = headers.get("x-upstream")
                if status != 200 or a.upstream is None:
                    raise ValueError(f"watch answered HTTP {status}")
                a.established = a.ok = True
                gen = self.generation
                expected = 0
                while self.running():
                    if gen != self.generation:
                        a.end_reason = "recycled"
                        break
                    dl = mono() + WATCH_STALL
                    size = int(rd.line(dl), 16)
                    chunk = rd.exact(size + 2, dl)
                    good = chunk.endswith(b"\r\n")
                    try:
                        ev = json.loads(chunk[:-2])
                        good = good and ev.get("n") == expected and ev.get("from") == a.upstream
                    except ValueError:
                        good = False
                    if not good:
                        self.rec.corruption(f"{cid}: watch chunk {expected} from {a.upstream} "
                                            f"is wrong: {chunk[:80]!r}")
                        a.end_reason = "corrupted"
                        break
                    expected += 1
                    a.nbytes += size
                    self.rec.add_bytes(size)
                else:
                    a.end_reason = a.end_reason or "stopped"
            self._pause(0.05)  # a client's reconnect delay

    # -- long-lived: keep-alive echo connections --------------------------------------

    def _stream_loop(self, cid: str) -> None:
        rng = random.Random(cid)
        for _ in range(MAX_ATTEMPTS_PER_CLIENT):
            if not self.running():
                return
            a = Attempt("stream", cid, mono())
            self.rec.add(a)
            with self._long_lived(a) as opened:
                tls, rd = self._open(a)
                opened.append(tls)
                gen = self.generation
                for _ in range(MAX_ATTEMPTS_PER_CLIENT):
                    if not self.running():
                        a.end_reason = "stopped"
                        break
                    if gen != self.generation:
                        a.end_reason = "recycled"
                        break
                    payload = rng.randbytes(rng.randint(1, 65536))
                    tls.sendall(b"POST /echo HTTP/1.1\r\nHost: " + SERVER_NAME.encode()
                                + b"\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
                    dl = mono() + CLIENT_TIMEOUT
                    status, headers = rd.head(dl)
                    up = headers.get("x-upstream")
                    body = rd.exact(int(headers.get("content-length", "0")), dl)
                    if status != 200 or up is None:
                        raise ValueError(f"echo answered HTTP {status}")
                    if not a.established:
                        a.upstream, a.established, a.ok = up, True, True
                    if up != a.upstream or body != payload:
                        self.rec.corruption(f"{cid}: echo of {len(payload)} bytes on "
                                            f"{a.upstream} came back wrong (from {up})")
                        a.end_reason = "corrupted"
                        break
                    a.nbytes += len(payload)
                    self.rec.add_bytes(len(payload))
                    self._pause(0.1)
            self._pause(0.05)
