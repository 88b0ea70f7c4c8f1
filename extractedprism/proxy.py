"""Proxy: the listener, the acceptor thread and the bounded pool of pipe threads.

# design
The acceptor thread owns the listening socket. It counts live connections against
``--max-connections`` (one counter under the pool lock); at the limit it stops accepting, so
new clients wait in the kernel backlog (HAProxy's maxconn) instead of piling up
threads. Each accepted socket is handed straight to one parked pipe thread: the most recently
parked one (LIFO), so hot threads with warm stacks and kernel pipes do the work, and
threads beyond the pre-started ones stay cold and retire after a minute idle. The
pool is pre-started with 64 threads (a node's usual clients need no thread start:
one costs ~70 us and, under load, stalls the acceptor while the new thread waits
for the GIL) and grows on demand up to the limit. Each pipe thread then does
pick -> dial -> copy for its connection, so the acceptor never waits on an upstream.

Dial failures never reach the client while another upstream is pickable: each failed
dial counts toward that upstream's failure streak and the connection moves on, trying
each upstream at most once. With nothing pickable (every upstream failed its checks)
the connection enters panic mode and tries every known upstream, most recently
successful first, within one --health-timeout, because health checks can be wrong
during a local blip and a refused kubelet is worse than a slow one.

A connect proves only that the upstream's kernel is alive: a stopped (SIGSTOP) or
wedged API server still completes handshakes from its backlog. So the client's first
bytes (its TLS ClientHello) are read before the pipe starts and the upstream gets one
dial timeout to answer them; a silent one counts as a failed dial and the same bytes
go to the next upstream (nothing went back to the client yet, so the client cannot
tell). Found against a real control plane (tests/controlplane, the SIGSTOP scenario).

EMFILE/ENFILE on accept back off (up to 1 s) instead of spinning, and recover as soon
as descriptors free up.

The listener may be shared with another instance (handover.py: a successor takes it
over): accept() wakes every ``ACCEPT_WAKE_S`` (SO_RCVTIMEO on the listener, which Linux
applies to accept) so the acceptor can stop accepting without ``shutdown()``, which
would stop the socket for the successor too. Nothing is lost while both accept: the
connections queued on the socket belong to it, not to either process.
"""

from __future__ import annotations

import errno
import logging
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from extractedprism import connlog, sched
from extractedprism.dialer import FD_ERRNOS, Dialer
from extractedprism.endpoints import is_ip
from extractedprism.pipe import (
    Pipe,
    native_first_answer,
    release_thread_resources,
    resolve_relay,
)
from extractedprism.registry import Registry
from extractedprism.sockopts import CONNECTION_SOCKOPTS, apply_sockopts

log = logging.getLogger(__name__)

PRESTART_THREADS = 64  # a node's usual clients (kubelet, proxies, CNI, daemons) without a spawn
PIPE_IDLE_EXIT_S = 10.0  # pipe threads beyond PRESTART_THREADS idle this long exit
PIPE_IDLE_RELEASE_S = 3.0  # a parked thread idle this long closes its kernel pipes
PIPE_THREAD_STACK = 256 * 1024  # copy loops are shallow; the default 8 MiB is address space
# The client's first bytes held for a possible re-dial: a TLS ClientHello is one record
# (at most 16 KiB); anything past it stays in the socket for the pipe.
FIRST_BYTES_MAX = 16 * 1024
_FD_ERRNOS = FD_ERRNOS
# How often a blocked accept() returns to look at the stop flags. Idle cost: one
# wake-up per interval; no cost per connection.
ACCEPT_WAKE_S = 0.25
_RCVTIMEO = struct.pack("ll", 0, int(ACCEPT_WAKE_S * 1_000_000))
# Failures that repeat once per client during an outage: first line, then summaries.
_no_upstream = connlog.RateLimited(log, logging.INFO, "no upstream available; closing client")


def _has_opts(sock: socket.socket) -> bool | None:
    """Whether ``sock`` carries every connection option (None: could not tell)."""
    try:
        return all(sock.getsockopt(level, name) == value
                   for level, name, value in CONNECTION_SOCKOPTS)
    except OSError:
        return None  # reset already; ask the next socket


def _format_addr(addr: tuple) -> str:  # type: ignore[type-arg]
    host, port = addr[0], addr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def open_listener(host: str, port: int, backlog: int = 1024) -> socket.socket:
    """Bind and listen on host:port (IPv4, IPv6 or a name resolved once).

    The connection options go on the listener: Linux copies them to every accepted
    socket, which saves six setsockopt calls per client connection (the acceptor
    checks the first accepted socket and falls back to setting them per socket).
    """
    if is_ip(host):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        addr: tuple = (host, port)  # type: ignore[type-arg]
    else:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        family, addr = info[0], info[4]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        apply_sockopts(sock)
        sock.bind(addr)
        sock.listen(backlog)
        set_accept_wake(sock)
    except OSError:
        sock.close()
        raise
    return sock


@dataclass(frozen=True)
class PoolView:
    """The pipe-thread pool at one moment, and its high-water marks since start."""

    threads: int
    idle: int
    live: int  # connections accepted and not yet finished
    peak_threads: int
    peak_live: int


def set_accept_wake(sock: socket.socket) -> None:
    """Make a blocking accept() on ``sock`` return EAGAIN every ``ACCEPT_WAKE_S``.

    Accepted sockets inherit the option; pipe threads use them non-blocking, where it
    has no effect."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _RCVTIMEO)


class _Worker:
    """A pipe thread's parking spot: the acceptor sets ``item`` and releases ``wake``."""

    __slots__ = ("item", "thread", "wake")

    def __init__(self) -> None:
        self.wake = threading.Lock()
        self.wake.acquire()
        self.item: tuple[socket.socket, str] | None = None
        self.thread: threading.Thread | None = None


class Proxy:
    """Accepts clients on the listener and pipes each to an upstream from the registry."""

    def __init__(self, registry: Registry, *, bind_address: str, bind_port: int,
                 dial_timeout: float, max_connections: int, pipe_sched: str = "batch",
                 relay: str = "auto", dial_hedge_delay: float = 0.0,
                 on_accept_loop: Callable[[], None] | None = None) -> None:
        self._registry = registry
        self._bind = (bind_address, bind_port)
        self._dial_timeout = dial_timeout
        self._max = max_connections
        self._sched = pipe_sched
        # The byte copy every connection uses, "native" or "python", fixed at start (raises
        # RelayUnavailable for relay="native" without the extension).
        self.relay = resolve_relay(relay)
        self._native_first = native_first_answer() if self.relay == "native" else None
        self._pool_lock = threading.Lock()
        # Live connections (slots taken), under _pool_lock; the acceptor waits on
        # _slot_freed only while saturated, so the common path is one C-level lock.
        self._live = 0
        self._peak_live = 0
        self._peak_threads = 0
        self._saturated = False
        self._slot_freed = threading.Event()
        # Whether accepted sockets still need the connection options set one by one
        # (decided on the first accepted socket; see open_listener).
        self._client_opts: bool | None = None
        self._workers: list[_Worker] = []  # every pipe thread, under _pool_lock
        self._parked: list[_Worker] = []  # idle ones, most recently parked last
        self._stopping = threading.Event()
        self._dialer = Dialer(registry, dial_timeout=dial_timeout,
                              hedge_delay=dial_hedge_delay, stopping=self._stopping,
                              native=self.relay == "native")
        # The acceptor stops when _accept_stop is set: at shutdown, at the start of a
        # shutdown drain (live connections keep being served), or when a successor
        # accepts on the listener instead (_handed_over: the shared socket is then
        # never shut down from here).
        self._accept_stop = threading.Event()
        self._handed_over = threading.Event()
        self._shared = False
        self._listener: socket.socket | None = None
        self._address: tuple[str, int] | None = None
        self._acceptor: threading.Thread | None = None
        self._seq = 0
        self._on_accept_loop = on_accept_loop
        self._prestart = min(PRESTART_THREADS, max_connections)
        self.idle_exit_s = PIPE_IDLE_EXIT_S

    # -- lifecycle ------------------------------------------------------------------

    def bind(self) -> None:
        self._listener = open_listener(*self._bind)
        self._address = self._listener.getsockname()[:2]

    def adopt(self, listener: socket.socket) -> None:
        """Accept on ``listener``, taken over from a predecessor, instead of binding."""
        listener.setblocking(True)
        set_accept_wake(listener)
        self._listener = listener
        self._address = listener.getsockname()[:2]

    @property
    def listener(self) -> socket.socket | None:
        """The listening socket (to offer to a successor; never to accept on)."""
        return self._listener

    @property
    def handed_over(self) -> bool:
        return self._handed_over.is_set()

    def share_listener(self) -> None:
        """Another process may accept on the listener: close it, never shut it down."""
        self._shared = True

    def stop_accepting(self, timeout: float = 1.0) -> bool:
        """A successor accepts on the shared listener now: stop accepting (within
        ``ACCEPT_WAKE_S``) and close this process's copy of the listener once the
        acceptor is out of accept(); live connections keep being served. True when the
        acceptor stopped within ``timeout``."""
        self._handed_over.set()
        self._accept_stop.set()
        if self._acceptor is not None:
            self._acceptor.join(timeout)
            if self._acceptor.is_alive():
                log.warning("acceptor still in accept() after the handover; its copy of "
                            "the listener stays open timeout=%gs", timeout)
                return False
        if self._listener is not None:
            self._listener.close()
        return True

    @property
    def address(self) -> tuple[str, int]:
        # Kept from the bind: the listener may be closed (handed over, shut down).
        assert self._address is not None
        return self._address

    def start(self) -> None:
        if self._listener is None:
            self.bind()
        old = threading.stack_size(PIPE_THREAD_STACK)
        try:
            for _ in range(self._prestart):
                self._spawn_worker()
        finally:
            threading.stack_size(old)
        self._acceptor = threading.Thread(name="acceptor", target=self._accept_loop,
                                          daemon=True)
        self._acceptor.start()

    def pool(self) -> PoolView:
        with self._pool_lock:
            return PoolView(len(self._workers), len(self._parked), self._live,
                            self._peak_threads, self._peak_live)

    def acceptor_alive(self) -> bool:
        return self._acceptor is not None and self._acceptor.is_alive()

    def backlog_waiting(self) -> bool:
        """A client waits in the listen backlog (for the heartbeat: an idle acceptor
        blocks in accept() with nothing waiting; a stuck one leaves clients there)."""
        listener = self._listener
        if listener is None:
            return False
        poller = select.poll()
        try:
            poller.register(listener, select.POLLIN)
            return bool(poller.poll(0))
        except (OSError, ValueError):  # closed meanwhile
            return False

    def close_listener(self) -> None:
        """Stop accepting: wakes the acceptor out of accept(). Once handed over, the
        socket is the successor's: left alone (the acceptor notices within
        ``ACCEPT_WAKE_S``). Live connections are not touched."""
        self._accept_stop.set()
        if (self._listener is not None and not self._handed_over.is_set()
                and not self._shared):
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def shutdown(self, timeout: float = 5.0) -> bool:
        """Close the listener, force-close live connections, wait for pipe threads."""
        deadline = time.monotonic() + timeout
        self._stopping.set()
        self.close_listener()
        if self._acceptor is not None:
            self._acceptor.join(max(0.0, deadline - time.monotonic()))
        if self._listener is not None:
            self._listener.close()
        closed = self._registry.close_all()
        if closed:
            log.info("shutdown: force-closed connections count=%d", closed)
        with self._pool_lock:
            workers = list(self._workers)
            parked, self._parked = self._parked, []
        for w in parked:  # busy ones see _stopping when their connection ends
            w.item = None
            w.wake.release()
        ok = True
        self._dialer.shutdown()
        for w in workers:
            t = w.thread
            assert t is not None
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                ok = False
                log.warning("thread outlived shutdown deadline thread=%s", t.name)
        return ok

    # -- acceptor thread --------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        sched.apply_to_current_thread(self._sched)
        listener = self._listener
        family = listener.family
        # socket.accept() converts family and type to enums on every call; the raw
        # accept plus a socket built from known ints does the same work without that.
        raw_accept = listener._accept  # type: ignore[attr-defined]
        saturated = False
        fd_backoff = 0.0
        while not self._accept_stop.is_set():
            if self._on_accept_loop is not None:
                self._on_accept_loop()
            if self._live >= self._max:
                if not saturated:
                    saturated = True
                    log.warning("max connections reached; new clients wait in the backlog "
                                "max_connections=%d", self._max)
                with self._pool_lock:
                    self._saturated = True
                    self._slot_freed.clear()
                    full = self._live >= self._max
                if full:
                    self._slot_freed.wait(0.5)
                continue
            if saturated:
                saturated = False
                with self._pool_lock:
                    self._saturated = False
                log.info("connection slots free again max_connections=%d", self._max)
            try:
                fd, addr = raw_accept()
                sock = socket.socket(family, socket.SOCK_STREAM, 0, fd)
            except OSError as exc:
                if self._accept_stop.is_set():
                    break
                if exc.errno == errno.EAGAIN:  # SO_RCVTIMEO: look at the flags again
                    continue
                if exc.errno in _FD_ERRNOS:
                    # Once per episode at warning ("accept recovered" ends it); the
                    # retries of one episode at debug.
                    log.log(logging.DEBUG if fd_backoff else logging.WARNING,
                            "accept failed; backing off until descriptors free up "
                            "error=%r backoff=%gs", exc.strerror, fd_backoff or 0.01)
                    fd_backoff = min(1.0, fd_backoff * 2 or 0.01)
                    self._accept_stop.wait(fd_backoff)
                elif exc.errno not in (errno.ECONNABORTED, errno.EINTR, errno.EPROTO):
                    log.exception("accept failed")
                    self._accept_stop.wait(0.05)
                continue
            if fd_backoff:
                fd_backoff = 0.0
                log.info("accept recovered")
            self._dispatch(sock, _format_addr(addr))
        log.debug("acceptor stopped")

    def _dispatch(self, sock: socket.socket, client: str) -> None:
        if self._client_opts is None:
            inherited = _has_opts(sock)
            self._client_opts = None if inherited is None else not inherited
            if self._client_opts:
                log.debug("accepted sockets do not inherit the listener's options; "
                          "setting them per connection")
        with self._pool_lock:
            self._live += 1
            if self._live > self._peak_live:
                self._peak_live = self._live
            w = self._parked.pop() if self._parked else None
        if w is not None:
            w.item = (sock, client)
            w.wake.release()
            return
        old = threading.stack_size(PIPE_THREAD_STACK)
        try:
            self._spawn_worker((sock, client))
        except RuntimeError:  # "can't start new thread": out of memory or tasks
            log.warning("could not start a pipe thread; closing client client=%s", client)
            sock.close()
            self._release_slot()
        finally:
            threading.stack_size(old)

    def _spawn_worker(self, item: tuple[socket.socket, str] | None = None) -> None:
        w = _Worker()
        w.item = item
        with self._pool_lock:
            self._seq += 1
            w.thread = threading.Thread(name=f"pipe-idle-{self._seq}",
                                        target=self._worker_loop, args=(w,), daemon=True)
            self._workers.append(w)
            if len(self._workers) > self._peak_threads:
                self._peak_threads = len(self._workers)
        try:
            w.thread.start()
        except RuntimeError:
            with self._pool_lock:
                self._workers.remove(w)
            raise

    def _release_slot(self) -> None:
        with self._pool_lock:
            self._live -= 1
            if self._saturated:
                self._slot_freed.set()

    # -- pipe threads -------------------------------------------------------------------

    def _worker_loop(self, w: _Worker) -> None:
        me = threading.current_thread()
        idle_name = me.name
        sched.apply_to_current_thread(self._sched)
        try:
            while True:
                item, w.item = w.item, None
                if item is not None:
                    sock, client = item
                    try:
                        self._serve(sock, client, me)
                    except Exception:
                        log.exception("pipe thread failed client=%s", client)
                        sock.close()
                    finally:
                        me.name = idle_name
                if not self._park(w, served=item is not None):
                    return
        finally:
            release_thread_resources()

    def _park(self, w: _Worker, served: bool) -> bool:
        """Free the connection's slot, wait for the next connection; False when this
        thread should exit.

        The slot is freed and the thread parked in one step: a thread never counts as
        neither busy nor idle, so the acceptor starts a thread only when every thread
        serves a live connection, and a burst never starts more threads than there are
        connections alive at once. After a burst, a parked thread gives its kernel pipes
        back after PIPE_IDLE_RELEASE_S, and threads beyond the pre-started ones leave the
        pool after idle_exit_s (the LIFO hand-off keeps them the coldest), so threads
        and descriptors return to the idle baseline.
        """
        with self._pool_lock:
            if served:
                self._live -= 1
                if self._saturated:
                    self._slot_freed.set()
            if self._stopping.is_set():
                self._workers.remove(w)
                return False
            self._parked.append(w)
        if not w.wake.acquire(timeout=min(PIPE_IDLE_RELEASE_S, self.idle_exit_s)):
            # Idle: the next connection makes fresh pipes (a few microseconds), so a
            # parked thread holds no descriptors.
            release_thread_resources()
            rest = max(0.05, self.idle_exit_s - PIPE_IDLE_RELEASE_S)
            while not w.wake.acquire(timeout=rest):
                with self._pool_lock:
                    if w in self._parked and len(self._workers) > self._prestart:
                        self._parked.remove(w)
                        self._workers.remove(w)
                        return False
                # Still parked (pre-started), or the acceptor just picked this thread
                # and is about to release wake: wait again.
        if w.item is None:  # shutdown
            with self._pool_lock:
                if w in self._workers:
                    self._workers.remove(w)
            return False
        return True

    def _serve(self, client_sock: socket.socket, client: str, me: threading.Thread) -> None:
        if self._stopping.is_set():
            client_sock.close()
            return
        if self._client_opts is not False:
            apply_sockopts(client_sock)
        tried: set[str] = set()
        drain_retry = True
        first: bytes | None = None  # the client's first bytes, once read (for a re-dial)
        reg = self._registry
        debug = log.isEnabledFor(logging.DEBUG)  # per connection, never per byte
        while True:
            t0 = time.monotonic() if debug else 0.0
            upstream, res = self._dialer.connect(tried)
            if upstream is None or res is None:
                _no_upstream(client=client)
                if not self._stopping.is_set():
                    reg.record_no_upstream()  # connection_errors_total{upstream="none"}
                client_sock.close()
                return
            addr = res.address
            with res:  # attach ends the reservation; anything raised before it too
                if res.panic:
                    if first:  # a silent upstream had them; nothing else left to judge by
                        self._first_answer(client_sock, upstream, first)
                else:
                    answered, first = self._first_answer(client_sock, upstream, first)
                    if not answered and reg.any_pickable(exclude=tried):
                        # Connected, but silent: a frozen process whose kernel still
                        # completes handshakes. Nothing went back to the client yet, so
                        # its first bytes can go to the next upstream instead.
                        upstream.close()
                        self._dialer.failed(addr, f"no answer within {self._dial_timeout:g}s "
                                            "of the client's first bytes")
                        continue
                pipe = Pipe(client_sock, upstream, client_addr=client, upstream_addr=addr,
                            relay=self.relay)
                attached = reg.attach(res, pipe)
            if not attached:
                upstream.close()
                if drain_retry and not reg.closing:
                    # The endpoint started draining while we dialed: one retry elsewhere.
                    drain_retry = False
                    if reg.any_pickable(exclude=tried):
                        continue
                if not reg.closing:  # its upstream drained away, and no other was left
                    reg.record_no_upstream()
                client_sock.close()
                return
            me.name = f"pipe-{client}->{addr}"
            if debug:
                connlog.opened(log, client, addr, time.monotonic() - t0)
                t0 = time.monotonic()
            try:
                pipe.run()
            finally:
                reg.detach(addr, pipe)
                if debug:
                    connlog.closed(log, pipe, t0)
            return

    def _first_answer(self, client: socket.socket, upstream: socket.socket,
                      first: bytes | None) -> tuple[bool, bytes]:
        """Hand the client's first bytes to a new upstream; did it answer within a dial timeout?

        A TCP connect proves only that the upstream's kernel is alive: a stopped
        (SIGSTOP) or wedged API server still completes handshakes from its backlog, and a
        client's TLS handshake would then wait for its own timeout. The client speaks
        first in TLS, so its first bytes (the ClientHello) are read here, sent on, and
        the upstream gets one dial timeout to send anything back (or to close).

        Returns (answered, first bytes). Not judged, so answered: the client sent
        nothing within a dial timeout, or closed, or the upstream spoke first or failed
        (the pipe passes the error on). ``first`` is what an earlier, silent upstream
        got; it goes to this one as it is.
        """
        timeout_ms = max(1, int(self._dial_timeout * 1000))
        cfd, ufd = client.fileno(), upstream.fileno()
        if self._native_first is not None:
            # The same steps in C with the GIL released once, instead of four releases
            # (poll, recv, send, poll) on every new connection.
            answered, first = self._native_first(cfd, ufd, timeout_ms, first)
            return bool(answered), first
        if first is None:
            poller = select.poll()
            poller.register(cfd, select.POLLIN)
            poller.register(ufd, select.POLLIN)
            events = dict(poller.poll(timeout_ms))
            if not events or ufd in events:
                return True, b""
            try:
                first = client.recv(FIRST_BYTES_MAX, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return True, b""
            except OSError:
                return True, b""  # reset: the pipe sees it too
            if not first:
                return True, b""
        deadline = time.monotonic() + self._dial_timeout
        view = memoryview(first)
        try:
            while view:
                try:
                    view = view[upstream.send(view):]
                except BlockingIOError:
                    poller = select.poll()
                    poller.register(ufd, select.POLLOUT)
                    left = deadline - time.monotonic()
                    if left <= 0 or not poller.poll(max(1, int(left * 1000))):
                        return False, first
        except OSError:
            return True, first  # the pipe reports the upstream's error
        poller = select.poll()
        poller.register(ufd, select.POLLIN)
        left = deadline - time.monotonic()
        return bool(left > 0 and poller.poll(max(1, int(left * 1000)))), first
