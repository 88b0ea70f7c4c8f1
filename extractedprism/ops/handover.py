"""Handover: a starting instance takes the listening sockets over from the running one.

HAProxy's ``expose-fd listeners`` / ``-x``, for upgrades without a gap. The running
instance offers its listening sockets (the proxy's and the health server's) on a unix
socket, ``--handover-socket`` (mode 0600). An instance that starts and finds it there
connects, receives the listener file descriptors (SCM_RIGHTS), starts accepting on them,
and only then says which ones it took; the old instance then stops accepting on those
(within ``proxy.ACCEPT_WAKE_S``), keeps serving the connections it has, and waits for
SIGTERM. The new instance becomes the one that offers, for the next upgrade.

Why the socket itself and not SO_REUSEPORT: with SO_REUSEPORT each process has its own
listening socket and its own accept queue, and the connections queued on the socket of
the process that stops are reset when it closes. Here both processes hold the *same*
socket for a moment, so there is one queue: whatever is in it when the old instance
stops accepting is accepted by the new one, and the socket is never closed by the old
instance before the new one has it (a listener the successor did not take is never
closed by the handover at all).

Protocol (one connection, both sides bounded in time): the offerer sends one line of
JSON ``{"version": 1, "pid": N, "pidns": I, "host": H, "app": V, "listeners": ["proxy",
"health"]}`` carrying the descriptors in that order; the taker answers ``{"taken": [...],
"pid": N, "pidns": I, "host": H}`` once it accepts on those. ``pidns`` (the inode of the
sender's PID namespace) and ``host`` are there because in a container the pid is the one
in the pod's own PID namespace, usually 1, which names nobody on the node: ``lsns -t
pid`` there finds the process by the inode. Every field but ``version`` and
``listeners`` is optional (an older peer leaves them out). A connection that ends
without an answer takes nothing: the offerer goes on as before and keeps offering. A
socket file nobody answers on (an instance that died) is removed and the start is an
ordinary one.

Threads: ``handover-offer`` (offerer side) accepts one successor at a time. The taking
side runs on the main thread during start-up.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from extractedprism import __version__
from extractedprism.ops.unixsock import UnixSocketError, listen_private, unlink_if_same
from extractedprism.threads import join_until, start_daemon

log = logging.getLogger(__name__)

VERSION = 1
MAX_MESSAGE = 4096
MAX_FDS = 8
OFFER_ACCEPT_WAKE_S = 0.2  # how often the offer thread looks at its stop flag
# How long each side waits for the other. The taker's start (bind nothing, start
# threads, import the kubernetes client) takes about a second; ten leave room on a
# loaded node while bounding a successor that hangs.
REPLY_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 5.0


def identity() -> dict[str, object]:
    """Who this process is, for the other side's log: pid, the inode of its PID
    namespace (0 when unreadable), host name."""
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pidns = 0
    return {"pid": os.getpid(), "pidns": pidns, "host": socket.gethostname()}


def describe_peer(msg: dict[str, object]) -> str:
    """``pid=N pidns=I host=H`` of a peer's message, for a log line; absent fields left
    out (an older peer sends only its pid)."""
    parts = []
    for key in ("pid", "pidns", "host", "app"):
        value = msg.get(key)
        if isinstance(value, bool) or not isinstance(value, int | str) or value == "":
            continue
        text = str(value)[:64]
        parts.append(f"{key}={text}" if text.isprintable() and " " not in text
                     else f"{key}={text!r}")
    return " ".join(parts) or "pid=?"


@dataclass
class Received:
    """What a predecessor handed over: listening sockets by name, to use or give back."""

    sockets: dict[str, socket.socket] = field(default_factory=dict)
    conn: socket.socket | None = None
    pid: int = 0
    # The predecessor as its offer describes itself (describe_peer), for the log.
    peer: str = "pid=?"

    def take(self, name: str) -> socket.socket | None:
        return self.sockets.pop(name, None)

    def finish(self, taken: Sequence[str]) -> None:
        """Tell the predecessor which listeners are accepted on here now; sockets not
        taken are closed here only (the predecessor keeps its own)."""
        for sock in self.sockets.values():
            sock.close()
        self.sockets.clear()
        conn, self.conn = self.conn, None
        if conn is None:
            return
        try:
            conn.settimeout(REPLY_TIMEOUT_S)
            conn.sendall(json.dumps({"taken": list(taken), **identity()}).encode()
                         + b"\n")
            # In a container the pid is the one in the predecessor's own PID namespace
            # (usually 1): pidns and host say which process it is (lsns -t pid).
            log.info("handover: took over listeners from %s listeners=%s",
                     self.peer, ",".join(taken) or "-")
        except OSError as exc:
            log.warning("handover: could not tell the predecessor pid=%d error=%r; it "
                        "keeps accepting on the shared listeners too", self.pid, str(exc))
        finally:
            conn.close()

    def abort(self) -> None:
        """Start-up failed: take nothing; the predecessor goes on as before."""
        for sock in self.sockets.values():
            sock.close()
        self.sockets.clear()
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def receive(path: str, timeout: float = CONNECT_TIMEOUT_S) -> Received | None:
    """Ask the instance offering on ``path`` for its listeners; None when there is none.

    No file: None, silently (no predecessor). A file nobody answers on: removed, None.
    Anything else that goes wrong: one warning, None (an ordinary start follows; if the
    ports are still held, that start fails with "in use").
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("handover: cannot use the handover socket path=%s reason=%r",
                    path, exc.strerror)
        return None
    if not stat.S_ISSOCK(st.st_mode):
        log.warning("handover: not a unix socket; ignored path=%s", path)
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(timeout)
    try:
        conn.connect(path)
    except OSError as exc:
        conn.close()
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            # A socket file left by an instance that is gone.
            _unlink_quietly(path)
            log.info("handover: nobody answers on the handover socket; removed it "
                     "path=%s", path)
        else:
            log.warning("handover: cannot connect to the handover socket path=%s "
                        "reason=%r", path, exc.strerror or str(exc))
        return None
    try:
        msg, fds, _flags, _addr = socket.recv_fds(conn, MAX_MESSAGE, MAX_FDS)
    except OSError as exc:
        conn.close()
        log.warning("handover: no offer received path=%s reason=%r", path,
                    exc.strerror or str(exc))
        return None
    # From here every descriptor received is either in ``received`` (closed by finish()
    # or abort()) or closed here, on every path: a start never fails, nor leaks, because
    # of what a predecessor sent.
    pending = list(fds)
    try:
        pid, names, offer = _parse_offer(msg, len(fds))
    except ValueError as exc:
        _close_fds(pending)
        conn.close()
        log.warning("handover: the offer is not one this version understands; ignored "
                    "path=%s reason=%r", path, str(exc))
        return None
    received = Received(conn=conn, pid=pid, peer=describe_peer(offer))
    try:
        for name, fd in zip(names, fds, strict=True):
            pending.remove(fd)
            sock, problem = _listener(fd)
            if sock is not None and name in received.sockets:
                sock.close()
                sock, problem = None, "offered twice"
            if sock is None:
                log.warning("handover: the predecessor's %s listener is unusable; this "
                            "instance opens its own pid=%d reason=%r", name, pid, problem)
                continue
            received.sockets[name] = sock
    except BaseException:
        _close_fds(pending)
        received.abort()
        raise
    log.info("handover: offered listeners %s listeners=%s", received.peer,
             ",".join(received.sockets) or "-")
    return received


def _parse_offer(msg: bytes, nfds: int) -> tuple[int, list[str], dict[str, object]]:
    """(pid, listener names, the whole offer) of an offer message; ValueError saying
    what is wrong."""
    try:
        offer = json.loads(msg.decode())
    except (UnicodeDecodeError, ValueError):
        raise ValueError("not JSON") from None
    if not isinstance(offer, dict):
        raise ValueError("not a JSON object")
    if offer.get("version") != VERSION:
        raise ValueError(f"version {offer.get('version')!r}, expected {VERSION}")
    names = offer.get("listeners")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError("'listeners' is not a list of names")
    if len(names) != nfds:
        raise ValueError(f"{len(names)} listeners named, {nfds} descriptors received")
    pid = offer.get("pid")
    return (pid if isinstance(pid, int) and not isinstance(pid, bool) else 0), names, offer


def _listener(fd: int) -> tuple[socket.socket | None, str]:
    """``fd`` as a listening TCP socket, or (None, what it is instead) with ``fd``
    closed. Never raises."""
    sock: socket.socket | None = None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISSOCK(mode):
            kind = ("a pipe" if stat.S_ISFIFO(mode) else "a regular file"
                    if stat.S_ISREG(mode) else "a directory" if stat.S_ISDIR(mode)
                    else "a character device" if stat.S_ISCHR(mode) else "a file")
            problem = f"{kind}, not a socket"
        else:
            sock = socket.socket(fileno=fd)
            fd = -1  # the socket object owns it now
            problem = _socket_problem(sock)
    except OSError as exc:
        problem = f"cannot inspect it: {exc.strerror or exc}"
    if not problem and sock is not None:
        return sock, ""
    if sock is not None:
        sock.close()
    elif fd >= 0:
        _close_fds([fd])
    return None, problem


def _socket_problem(sock: socket.socket) -> str:
    """What keeps ``sock`` from being a listener to accept TCP connections on; ""."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return f"a socket of family {sock.family!s}, not TCP over IPv4 or IPv6"
    proto = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PROTOCOL)
    if sock.type != socket.SOCK_STREAM or proto != socket.IPPROTO_TCP:
        kind = "a UDP socket" if proto == socket.IPPROTO_UDP else (
            f"a socket of type {sock.type!s} and protocol {proto}")
        return f"{kind}, not a TCP one"
    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        return "a TCP socket that is not listening"
    return ""


def _close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def listener_matches(sock: socket.socket, host: str, port: int) -> bool:
    """Whether ``sock`` listens where this configuration binds (port 0: any port)."""
    try:
        name = sock.getsockname()
        if port and name[1] != port:
            return False
        try:
            want = [ipaddress.ip_address(host)]
        except ValueError:  # a hostname, resolved as the listener's own bind resolves it
            want = [ipaddress.ip_address(info[4][0]) for info in
                    socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
        return ipaddress.ip_address(name[0].split("%", 1)[0]) in want
    except (OSError, ValueError, IndexError):
        return False


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class Offer:
    """Offers this instance's listeners on the handover socket until stopped.

    ``listeners()`` returns the sockets to offer by name at the time a successor asks;
    ``on_taken(names)`` runs on the ``handover-offer`` thread when the successor
    accepts on them (the app stops accepting there). After a handover this instance
    stops offering: the successor now owns the path.
    """

    def __init__(self, path: str, listeners: Callable[[], dict[str, socket.socket]],
                 on_taken: Callable[[list[str]], None]) -> None:
        self._path = path
        self._listeners = listeners
        self._on_taken = on_taken
        self._stop = threading.Event()
        # Guards the stop flag against the start of a handover, so begin_stop() knows
        # for certain whether the listeners went out (and _release() runs once).
        self._lock = threading.Lock()
        self._server: socket.socket | None = None
        self._ident: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None
        self.handed_over = False
        # The listeners were sent and no answer came yet: a successor may be accepting
        # on them already, so they count as shared (never shut down) until it answers.
        self._in_flight = False

    def start(self) -> None:
        """Bind the path (replacing whatever socket file is there, atomically: a
        predecessor's is renamed over) and start offering. Raises OSError
        (UnixSocketError), also for a path that holds something else than a socket
        (never replaced)."""
        try:
            if not stat.S_ISSOCK(os.lstat(self._path).st_mode):
                raise UnixSocketError(errno.EEXIST, "exists and is not a unix socket")
        except FileNotFoundError:
            pass
        server, self._ident = listen_private(self._path, "--handover-socket", 4)
        server.settimeout(OFFER_ACCEPT_WAKE_S)
        self._server = server
        self._thread = start_daemon("handover-offer", self._serve)
        log.info("handover: offering listeners path=%s", self._path)

    def begin_stop(self) -> bool:
        """Stop offering, at once: no handover starts after this. True when a successor
        may accept on the listeners already (sent and not answered yet, or taken): they
        must then be closed, never shut down."""
        with self._lock:
            self._stop.set()
            return self._in_flight or self.handed_over

    def stop(self, deadline: float | None = None) -> bool:
        """begin_stop(), then wait for the offer thread until ``deadline``
        (``time.monotonic()``; by default 1 s from now; one waiting for a successor's
        answer is abandoned then) and remove the path if it is still this instance's.
        True when the thread ended in time."""
        self.begin_stop()
        if deadline is None:
            deadline = time.monotonic() + OFFER_ACCEPT_WAKE_S * 5
        ok = join_until([self._thread], deadline)
        self._release()
        return ok

    def _release(self) -> None:
        with self._lock:
            server, self._server = self._server, None
            handed_over = self.handed_over
        if server is None:
            return
        server.close()
        if not handed_over:  # else the path is the successor's (renamed over ours)
            unlink_if_same(self._path, self._ident)

    def _serve(self) -> None:
        assert self._server is not None
        server = self._server
        while not self._stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stop.is_set():
                    break
                log.warning("handover: accept failed error=%r", exc.strerror or str(exc))
                self._stop.wait(OFFER_ACCEPT_WAKE_S)
                continue
            try:
                taken = self._hand_over(conn)
            except Exception:
                log.exception("handover failed; still serving and offering")
                taken = []
            finally:
                conn.close()
            with self._lock:
                if taken:
                    self.handed_over = True
                self._in_flight = False
            if taken:
                try:
                    self._on_taken(taken)
                except Exception:
                    log.exception("handover: stopping to accept failed")
                # The successor offers on the path now (it renamed its socket over
                # ours, or is about to): this instance's part is done.
                self._stop.set()
        self._release()

    def _hand_over(self, conn: socket.socket) -> list[str]:
        conn.settimeout(REPLY_TIMEOUT_S)
        offered = {n: s for n, s in self._listeners().items() if s.fileno() >= 0}
        with self._lock:
            if self._stop.is_set():
                return []
            self._in_flight = True
        names = list(offered)
        msg = json.dumps({"version": VERSION, **identity(), "app": __version__,
                          "listeners": names})
        socket.send_fds(conn, [msg.encode() + b"\n"], [s.fileno() for s in offered.values()])
        log.info("handover: offered listeners to a successor listeners=%s",
                 ",".join(names))
        reply = b""
        while not reply.endswith(b"\n") and len(reply) < MAX_MESSAGE:
            try:
                chunk = conn.recv(MAX_MESSAGE)
            except OSError as exc:
                log.warning("handover: the successor did not answer error=%r; still "
                            "accepting", exc.strerror or str(exc))
                return []
            if not chunk:
                break
            reply += chunk
        try:
            answer = json.loads(reply.decode())
            taken = answer["taken"]
            if not isinstance(taken, list):
                raise TypeError
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            log.warning("handover: the successor took nothing; still accepting and "
                        "offering")
            return []
        log.info("handover: the successor took listeners %s listeners=%s",
                 describe_peer(answer), ",".join(str(n) for n in taken) or "-")
        # Only names this instance offered: anything else is not ours to stop.
        return [n for n in taken if n in offered]
