"""PipePool: the bounded pool of pipe threads, hand-off from the acceptor, parking,
retirement.

# policy
Everything that decides how many threads there are lives here (a change of policy is a
change to this module only). Threads are started on demand and kept only while they
earn their keep, so an idle proxy costs a handful of sleeping threads, not a pool:

* nothing is pre-started: ``dispatch`` hands each accepted socket to the most recently
  parked thread (LIFO), so hot threads with warm stacks and kernel pipes do the work;
  with none parked it starts one (~70 us), up to the connection limit. A burst of N
  concurrent clients starts N threads once; the next burst within ``idle_exit_s`` finds
  them parked.
* ``_park``: a parked thread gives its kernel pipes back after ``PIPE_IDLE_RELEASE_S``;
  parked threads beyond ``WARM_THREADS`` leave the pool after ``idle_exit_s`` (the LIFO
  hand-off keeps them the coldest; threads busy with long-lived connections are not
  counted: they cannot take the next client); the last of them to leave gives the heap
  the burst freed back to the kernel (``heap.trim``). The warm ones then sleep
  ``WARM_RECHECK_S`` at a time: an idle proxy's pipe threads wake at most once a minute.
* ``wait_for_slot``: at ``--max-connections`` live connections the acceptor stops
  accepting, so new clients wait in the kernel backlog (HAProxy's maxconn).

# threads
``wait_for_slot`` and ``dispatch`` run on the acceptor thread (proxy.py);
``_worker_loop`` and ``_park`` on each pipe thread (``pipe-idle-N`` while parked; the
``serve`` callable, Proxy._serve, renames it ``pipe-<client>-><upstream>`` while
serving). The pool's bookkeeping (live connections, parked and all workers, peaks) is
under one pool lock; the acceptor waits on a slot event only while saturated, so the
common path is one C-level lock.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

from extractedprism import heap
from extractedprism.datapath import sched
from extractedprism.datapath.pipe import release_thread_resources

log = logging.getLogger(__name__)

WARM_THREADS = 2  # parked threads an idle proxy keeps: a reconnect or two needs no spawn
PIPE_IDLE_EXIT_S = 10.0  # pipe threads beyond WARM_THREADS idle this long exit
WARM_RECHECK_S = 60.0  # a warm parked thread's longest sleep: an idle thread's wake-up rate
PIPE_IDLE_RELEASE_S = 3.0  # a parked thread idle this long closes its kernel pipes
PIPE_THREAD_STACK = 256 * 1024  # copy loops are shallow; the default 8 MiB is address space
SATURATED_WAIT_S = 0.5  # the acceptor's longest wait for a free slot between flag checks

# What a pipe thread runs for each connection it is handed: (client socket, client
# address, the pipe thread itself, to name it after the connection).
Serve = Callable[[socket.socket, str, threading.Thread], None]


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
    """Pipe threads, each serving one accepted connection at a time (see the module
    docstring). ``stopping``: set at shutdown; parked threads then exit, busy ones when
    their connection ends."""

    def __init__(self, serve: Serve, *, max_connections: int, pipe_sched: str,
                 gil_cpu: int | None, stopping: threading.Event) -> None:
        self._serve = serve
        self._max = max_connections
        self._sched = pipe_sched  # --pipe-sched, applied by each pipe thread to itself
        self._gil_cpu = gil_cpu  # --gil-cpu's CPU each pipe thread pins itself to, or None
        self._stopping = stopping
        self.warm = min(WARM_THREADS, max_connections)
        self.idle_exit_s = PIPE_IDLE_EXIT_S
        self._lock = threading.Lock()
        # Live connections (slots taken), under _lock.
        self._live = 0
        self._peak_live = 0
        self._peak_threads = 0
        # At the limit (written by the acceptor only; read by releasers under _lock):
        # a freed slot then sets _slot_freed, which the acceptor waits on.
        self._saturated = False
        self._slot_freed = threading.Event()
        self._workers: list[_Worker] = []  # every pipe thread, under _lock
        self._parked: list[_Worker] = []  # idle ones, most recently parked last
        self._seq = 0

    def view(self) -> PoolView:
        with self._lock:
            return PoolView(len(self._workers), len(self._parked), self._live,
                            self._peak_threads, self._peak_live)

    def stop(self) -> list[threading.Thread]:
        """Wake every parked thread to exit (``stopping`` must be set); returns every pipe
        thread, for the caller to join (busy ones exit when their connection ends)."""
        with self._lock:
            workers = list(self._workers)
            parked, self._parked = self._parked, []
        for w in parked:
            w.item = None
            w.wake.release()
        threads = []
        for w in workers:
            assert w.thread is not None
            threads.append(w.thread)
        return threads

    # -- acceptor thread: the connection limit and the hand-off ------------------------

    def wait_for_slot(self) -> bool:
        """True when a connection slot is free: accept now. At ``--max-connections``,
        wait up to SATURATED_WAIT_S for one to free and return False (the acceptor looks
        at its stop flags and asks again); new clients wait in the kernel backlog."""
        if self._live < self._max:
            if self._saturated:  # only the acceptor writes it: no lock to read it
                with self._lock:
                    self._saturated = False
                log.info("connection slots free again max_connections=%d", self._max)
            return True
        if not self._saturated:
            log.warning("max connections reached; new clients wait in the backlog "
                        "max_connections=%d", self._max)
        with self._lock:
            self._saturated = True
            self._slot_freed.clear()
            full = self._live >= self._max
        if full:
            self._slot_freed.wait(SATURATED_WAIT_S)
        return False

    def dispatch(self, sock: socket.socket, client: str) -> None:
        """Take a slot for ``sock`` and hand it to the most recently parked thread, or
        to a new one; a thread that cannot start closes the client."""
        with self._lock:
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

    def _spawn_worker(self, item: tuple[socket.socket, str]) -> None:
        w = _Worker()
        w.item = item
        with self._lock:
            self._seq += 1
            w.thread = threading.Thread(name=f"pipe-idle-{self._seq}",
                                        target=self._worker_loop, args=(w,), daemon=True)
            self._workers.append(w)
            if len(self._workers) > self._peak_threads:
                self._peak_threads = len(self._workers)
        try:
            w.thread.start()
        except RuntimeError:
            with self._lock:
                self._workers.remove(w)
            raise

    def _release_slot(self) -> None:
        with self._lock:
            self._live -= 1
            if self._saturated:
                self._slot_freed.set()

    # -- pipe threads -------------------------------------------------------------------

    def _worker_loop(self, w: _Worker) -> None:
        me = threading.current_thread()
        idle_name = me.name
        sched.apply_to_current_thread(self._sched)
        if self._gil_cpu is not None:
            sched.pin_current_thread(self._gil_cpu)
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
        back after PIPE_IDLE_RELEASE_S, and threads beyond ``warm`` leave the pool after
        idle_exit_s, so threads and descriptors return to the idle baseline. Each timed
        wait ends at most once per park, then once per WARM_RECHECK_S.
        """
        with self._lock:
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
            wait = max(0.05, self.idle_exit_s - PIPE_IDLE_RELEASE_S)
            while not w.wake.acquire(timeout=wait):
                with self._lock:
                    # Parked threads only: one busy with a long-lived connection is no
                    # warm thread (it cannot take the next client).
                    if w in self._parked and len(self._parked) > self.warm:
                        self._parked.remove(w)
                        self._workers.remove(w)
                        last = len(self._parked) == self.warm
                    else:
                        last = None
                if last is not None:
                    if last:
                        # The burst is over (the pool is back to its warm threads): give
                        # the heap it freed back to the kernel, once (heap.py).
                        heap.trim()
                    return False
                # One of the warm threads, or the acceptor just picked this thread and
                # is about to release wake: sleep long (an idle proxy stays asleep).
                wait = WARM_RECHECK_S
        if w.item is None:  # shutdown
            with self._lock:
                if w in self._workers:
                    self._workers.remove(w)
            return False
        return True
