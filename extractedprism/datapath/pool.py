"""The bounded pool of pipe threads: hand-off from the acceptor, parking, retirement.

Owns the pool's bookkeeping (live connections, parked and all workers, peaks, under one
pool lock). ``_dispatch`` runs on the acceptor thread: it takes a connection slot and
hands the accepted socket to the most recently parked pipe thread (LIFO), or starts a
new one. ``_worker_loop`` and ``_park`` run on each pipe thread (``pipe-idle-N`` while
parked, ``pipe-<client>-><upstream>`` while serving), which calls ``Proxy._serve`` for
each connection it is handed.

Mixed into :class:`extractedprism.datapath.proxy.Proxy`, which sets the state in ``__init__``.
"""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass

from extractedprism.datapath import sched
from extractedprism.datapath.listener import _has_opts
from extractedprism.datapath.pipe import release_thread_resources

# The proxy's logger: these lines have always come from extractedprism.datapath.proxy.
log = logging.getLogger("extractedprism.datapath.proxy")

PRESTART_THREADS = 64  # a node's usual clients (kubelet, proxies, CNI, daemons) without a spawn
PIPE_IDLE_EXIT_S = 10.0  # pipe threads beyond PRESTART_THREADS idle this long exit
PIPE_IDLE_RELEASE_S = 3.0  # a parked thread idle this long closes its kernel pipes
PIPE_THREAD_STACK = 256 * 1024  # copy loops are shallow; the default 8 MiB is address space


@dataclass(frozen=True)
class PoolView:
    """The pipe-thread pool at one moment, and its high-water marks since start."""

    threads: int
    idle: int
    live: int  # connections accepted and not yet finished
    peak_threads: int
    peak_live: int


class _Worker:
    """A pipe thread's parking spot: the acceptor sets ``item`` and releases ``wake``."""

    __slots__ = ("item", "thread", "wake")

    def __init__(self) -> None:
        self.wake = threading.Lock()
        self.wake.acquire()
        self.item: tuple[socket.socket, str] | None = None
        self.thread: threading.Thread | None = None


class PipePool:
    """The pipe-thread pool half of :class:`~extractedprism.datapath.proxy.Proxy`."""

    # Set by Proxy.__init__.
    _pool_lock: threading.Lock
    _live: int
    _peak_live: int
    _peak_threads: int
    _saturated: bool
    _slot_freed: threading.Event
    _client_opts: bool | None
    _workers: list[_Worker]
    _parked: list[_Worker]
    _stopping: threading.Event
    _seq: int
    _sched: str
    gil_cpu: int | None
    _prestart: int
    idle_exit_s: float

    def _serve(self, client_sock: socket.socket, client: str, me: threading.Thread) -> None:
        raise NotImplementedError  # Proxy._serve

    def pool(self) -> PoolView:
        with self._pool_lock:
            return PoolView(len(self._workers), len(self._parked), self._live,
                            self._peak_threads, self._peak_live)

    # -- acceptor thread: hand-off --------------------------------------------------

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
        if self.gil_cpu is not None:
            sched.pin_current_thread(self.gil_cpu)
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

