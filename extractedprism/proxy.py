"""Proxy: the listener, the acceptor thread and the bounded pool of pipe threads.

# design
The acceptor thread owns the listening socket. Before each ``accept`` it takes a slot
from a semaphore sized by ``--max-connections``; at the limit it stops accepting, so
new clients wait in the kernel backlog (HAProxy's maxconn) instead of piling up
threads. Accepted sockets go to a pool of pipe threads through one queue; the pool is
pre-started with a few threads and grows on demand up to the limit, and threads stay
parked for reuse (a thread start costs ~70 us, which would cap the new-connection
rate). Each pipe thread then does pick -> dial -> copy for its connection, so the
acceptor never waits on an upstream.

Dial failures never reach the client while another upstream is pickable: each failed
dial counts toward that upstream's failure streak and the connection moves on, trying
each upstream at most once. With nothing pickable (every upstream failed its checks)
the connection enters panic mode and tries every known upstream, most recently
successful first, within one --health-timeout, because health checks can be wrong
during a local blip and a refused kubelet is worse than a slow one.

EMFILE/ENFILE on accept back off (up to 1 s) instead of spinning, and recover as soon
as descriptors free up.
"""

from __future__ import annotations

import errno
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable

from extractedprism.endpoints import Endpoint, is_ip
from extractedprism.pipe import Pipe, prepare_thread, release_thread_resources
from extractedprism.registry import Registry
from extractedprism.sockopts import apply_sockopts, describe_error, dial

log = logging.getLogger(__name__)

PRESTART_THREADS = 16
PIPE_IDLE_EXIT_S = 60.0  # pipe threads beyond PRESTART_THREADS idle this long exit
PIPE_THREAD_STACK = 256 * 1024  # copy loops are shallow; the default 8 MiB is address space
_FD_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def _format_addr(addr: tuple) -> str:  # type: ignore[type-arg]
    host, port = addr[0], addr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def open_listener(host: str, port: int, backlog: int = 1024) -> socket.socket:
    """Bind and listen on host:port (IPv4, IPv6 or a name resolved once)."""
    if is_ip(host):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        addr: tuple = (host, port)  # type: ignore[type-arg]
    else:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        family, addr = info[0], info[4]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


class Proxy:
    """Accepts clients on the listener and pipes each to an upstream from the registry."""

    def __init__(self, registry: Registry, *, bind_address: str, bind_port: int,
                 dial_timeout: float, max_connections: int,
                 on_accept_loop: Callable[[], None] | None = None) -> None:
        self._registry = registry
        self._bind = (bind_address, bind_port)
        self._dial_timeout = dial_timeout
        self._max = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self._queue: queue.SimpleQueue[tuple[socket.socket, str] | None] = queue.SimpleQueue()
        self._pool_lock = threading.Lock()
        self._workers: list[threading.Thread] = []
        self._idle = 0
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._seq = 0
        self._on_accept_loop = on_accept_loop
        self._prestart = min(PRESTART_THREADS, max_connections)
        self.idle_exit_s = PIPE_IDLE_EXIT_S

    # -- lifecycle ------------------------------------------------------------------

    def bind(self) -> None:
        self._listener = open_listener(*self._bind)

    @property
    def address(self) -> tuple[str, int]:
        assert self._listener is not None
        host, port = self._listener.getsockname()[:2]
        return host, port

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

    def acceptor_alive(self) -> bool:
        return self._acceptor is not None and self._acceptor.is_alive()

    def close_listener(self) -> None:
        """Stop accepting: wakes the acceptor out of accept()."""
        self._stopping.set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def shutdown(self, timeout: float = 5.0) -> bool:
        """Close the listener, force-close live connections, wait for pipe threads."""
        deadline = time.monotonic() + timeout
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
        for _ in workers:
            self._queue.put(None)
        ok = True
        for t in workers:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                ok = False
                log.warning("thread outlived shutdown deadline thread=%s", t.name)
        # Sockets accepted but never picked up by a pipe thread.
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].close()
        return ok

    # -- acceptor thread --------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        saturated = False
        fd_backoff = 0.0
        while not self._stopping.is_set():
            if self._on_accept_loop is not None:
                self._on_accept_loop()
            if not self._slots.acquire(blocking=False):
                if not saturated:
                    saturated = True
                    log.warning("max connections reached; new clients wait in the backlog "
                                "max_connections=%d", self._max)
                if not self._slots.acquire(timeout=0.5):
                    continue
            elif saturated:
                saturated = False
                log.info("connection slots free again max_connections=%d", self._max)
            try:
                sock, addr = self._listener.accept()
            except OSError as exc:
                self._slots.release()
                if self._stopping.is_set():
                    break
                if exc.errno in _FD_ERRNOS:
                    fd_backoff = min(1.0, fd_backoff * 2 or 0.01)
                    log.warning("accept failed; backing off error=%r backoff=%gs",
                                exc.strerror, fd_backoff)
                    self._stopping.wait(fd_backoff)
                elif exc.errno not in (errno.ECONNABORTED, errno.EINTR, errno.EPROTO):
                    log.exception("accept failed")
                    self._stopping.wait(0.05)
                continue
            if fd_backoff:
                fd_backoff = 0.0
                log.info("accept recovered")
            self._dispatch(sock, _format_addr(addr))
        log.debug("acceptor stopped")

    def _dispatch(self, sock: socket.socket, client: str) -> None:
        with self._pool_lock:
            grow = self._idle == 0 and len(self._workers) < self._max
            self._idle -= 1
        if grow:
            old = threading.stack_size(PIPE_THREAD_STACK)
            try:
                self._spawn_worker()
            finally:
                threading.stack_size(old)
        self._queue.put((sock, client))

    def _spawn_worker(self) -> None:
        with self._pool_lock:
            self._seq += 1
            t = threading.Thread(name=f"pipe-idle-{self._seq}", target=self._worker_loop,
                                 daemon=True)
            self._workers.append(t)
            self._idle += 1
        t.start()

    # -- pipe threads -------------------------------------------------------------------

    def _worker_loop(self) -> None:
        me = threading.current_thread()
        idle_name = me.name
        prepare_thread()
        while True:
            try:
                item = self._queue.get(timeout=self.idle_exit_s)
            except queue.Empty:
                if self._retire(me):
                    release_thread_resources()
                    return
                continue
            if item is None:
                release_thread_resources()
                return
            sock, client = item
            try:
                self._serve(sock, client, me)
            except Exception:
                log.exception("pipe thread failed client=%s", client)
                sock.close()
            finally:
                me.name = idle_name
                self._slots.release()
                with self._pool_lock:
                    self._idle += 1

    def _retire(self, me: threading.Thread) -> bool:
        """After a burst, idle threads beyond the pre-started ones leave the pool, so the
        threads and fds a burst created are given back.

        ``_idle`` counts parked threads minus sockets queued for them; a thread may leave
        only while that is at least one, so a queued socket always has a thread left.
        """
        with self._pool_lock:
            if self._idle < 1 or len(self._workers) <= self._prestart:
                return False
            self._idle -= 1
            self._workers.remove(me)
        return True

    def _serve(self, client_sock: socket.socket, client: str, me: threading.Thread) -> None:
        if self._stopping.is_set():
            client_sock.close()
            return
        apply_sockopts(client_sock)
        tried: set[str] = set()
        drain_retry = True
        reg = self._registry
        while True:
            ep = reg.pick(exclude=tried)
            if ep is None:
                upstream, addr = self._panic_dial(tried)
                if upstream is None:
                    log.info("no upstream available; closing client client=%s", client)
                    client_sock.close()
                    return
            else:
                addr = str(ep)
                tried.add(addr)
                upstream = self._dial(ep, self._dial_timeout)
                if upstream is None:
                    reg.abandon(addr)
                    continue
            assert addr is not None
            pipe = Pipe(client_sock, upstream, client_addr=client, upstream_addr=addr)
            if not reg.attach(addr, pipe):
                upstream.close()
                if drain_retry and not reg.closing:
                    # The endpoint started draining while we dialed: one retry elsewhere.
                    drain_retry = False
                    tried.add(addr)
                    if reg.any_pickable(exclude=tried):
                        continue
                client_sock.close()
                return
            me.name = f"pipe-{client}->{addr}"
            try:
                pipe.run()
            finally:
                reg.detach(addr, pipe)
            return

    def _dial(self, ep: Endpoint, timeout: float, *, panic: bool = False
              ) -> socket.socket | None:
        addr = str(ep)
        try:
            sock = dial(ep, timeout)
        except OSError as exc:
            reason = describe_error(exc)
            if exc.errno in _FD_ERRNOS:
                # Out of descriptors here is not the upstream's fault: no streak, no count.
                log.warning("dial failed locally upstream=%s reason=%r", addr, reason)
                return None
            shutting_down = self._stopping.is_set()
            # The spec counts no errors "when no upstream was available": panic-mode
            # attempts are exactly that case, and shutdown failures are not counted.
            self._registry.record_dial(addr, False, reason,
                                       count_error=not (shutting_down or panic))
            log.info("dial failed upstream=%s reason=%r", addr, reason)
            return None
        self._registry.record_dial(addr, True)
        return sock

    def _panic_dial(self, tried: set[str]) -> tuple[socket.socket | None, str | None]:
        """Nothing pickable: try every known upstream within one dial timeout overall."""
        deadline = time.monotonic() + self._dial_timeout
        for ep in self._registry.panic_order(exclude=tried):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._stopping.is_set():
                break
            addr = str(ep)
            tried.add(addr)
            sock = self._dial(ep, remaining, panic=True)
            if sock is not None:
                return sock, addr
        return None, None
