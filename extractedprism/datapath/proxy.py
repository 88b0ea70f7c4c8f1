"""Proxy: the listener, the acceptor thread, and what each pipe thread does per connection.

# design
The acceptor thread owns the listening socket. It counts live connections against
``--max-connections`` (the pool's counter); at the limit it stops accepting, so
new clients wait in the kernel backlog (HAProxy's maxconn) instead of piling up
threads. Each accepted socket is handed straight to one parked pipe thread of the pipe
pool (pool.py holds the pool's policy: LIFO hand-off, threads started on demand up
to the limit, a few kept warm, the rest retired when idle). Each pipe thread then does
pick -> dial -> copy for its connection (``_serve``), so the acceptor never waits on an upstream.

Dial failures never reach the client while another upstream is pickable: each failed
dial counts toward that upstream's failure streak and the connection moves on, trying
each upstream at most once. With nothing pickable (every upstream failed its checks)
the connection enters panic mode and tries every known upstream, most recently
successful first, within one --health-timeout, because health checks can be wrong
during a local blip and a refused kubelet is worse than a slow one.

EMFILE/ENFILE on accept back off (up to 1 s) instead of spinning, and recover as soon
as descriptors free up.

# modules
The listening socket and its accept wake-up live in listener.py, the pipe-thread pool
in pool.py, the dial in dialer.py, the first answer (the silent-upstream check on the
client's ClientHello, and its hedge) in first_answer.py, the attempts kept off a client's
path in offpath.py, the byte copy in pipe.py, and the relay strategy (``--relay``,
resolved once) in relay.py. The acceptor thread runs ``_accept_loop``; each pipe thread
runs ``_serve`` for the connection it is handed (PipePool calls it); docs/architecture.md
("A connection's trip") says why the native relay attaches before the first answer.
"""

from __future__ import annotations

import errno
import logging
import select
import socket
import threading
import time
from collections.abc import Callable

from extractedprism.datapath import sched
from extractedprism.datapath.dialer import Dialer
from extractedprism.datapath.first_answer import FirstAnswer, Leg, replayable, send_rest
from extractedprism.datapath.listener import format_addr, has_opts, open_listener, set_accept_wake
from extractedprism.datapath.pipe import Pipe
from extractedprism.datapath.pool import PipePool
from extractedprism.datapath.relay import ANSWERED, LEFT, SILENT, Relay
from extractedprism.datapath.sockopts import apply_sockopts
from extractedprism.errors import FD_ERRNOS
from extractedprism.logs import connlog
from extractedprism.upstreams.registry import Registry

log = logging.getLogger(__name__)

# Failures that repeat once per client during an outage: first line, then summaries.
_no_upstream = connlog.RateLimited(log, logging.INFO, "no upstream available; closing client")


class Proxy:
    """Accepts clients on the listener and pipes each to an upstream from the registry."""

    def __init__(self, registry: Registry, *, bind_address: str, bind_port: int,
                 dial_timeout: float, max_connections: int, relay: Relay,
                 pipe_sched: str = "batch", gil_cpu: str = "off",
                 dial_hedge_delay: float = 0.0, answer_hedge_delay: float = 1.0,
                 on_accept_loop: Callable[[], None] | None = None) -> None:
        self._registry = registry
        self._bind = (bind_address, bind_port)
        self._dial_timeout = dial_timeout
        self._sched = pipe_sched
        # --gil-cpu: the CPU the acceptor and pipe threads are pinned to (sched.py), or None.
        plan = sched.gil_cpu_plan(gil_cpu)
        self.gil_cpu = plan[0] if plan is not None else None
        # The byte copy every connection uses, fixed at start (relay.resolve).
        self.relay = relay
        self._take_first = relay.take_first
        # The native relay runs the silent-upstream check itself (Pipe.run_judged).
        self._judge_in_relay = relay.native
        self._pin = 0 if self.gil_cpu is None else self.gil_cpu + 1  # the native relay's
        # Whether accepted sockets still need the connection options set one by one
        # (decided on the first accepted socket; see open_listener).
        self._client_opts: bool | None = None
        self._stopping = threading.Event()
        # The pipe threads (their counts: pipe_pool.view()).
        self.pipe_pool = PipePool(self._serve, max_connections=max_connections,
                                  pipe_sched=pipe_sched, gil_cpu=self.gil_cpu,
                                  stopping=self._stopping)
        self._dialer = Dialer(registry, dial_timeout=dial_timeout,
                              hedge_delay=dial_hedge_delay, stopping=self._stopping,
                              relay=relay)
        # The first answer of every new connection, and its hedge (first_answer.py).
        self._answer = FirstAnswer(registry, self._dialer, hedge_delay=answer_hedge_delay,
                                   health_timeout=dial_timeout,
                                   native_first=relay.first_answer, stopping=self._stopping)
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
        self._on_accept_loop = on_accept_loop

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
        self._acceptor = threading.Thread(name="acceptor", target=self._accept_loop,
                                          daemon=True)
        self._acceptor.start()
        if self.gil_cpu is not None:
            log.info("acceptor and pipe threads run Python on one CPU cpu=%d", self.gil_cpu)

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
        closed = self._registry.conns.close_all()
        self._answer.close_all()  # clients waiting on a first answer, attached nowhere yet
        if closed:
            log.info("shutdown: force-closed connections count=%d", closed)
        threads = self.pipe_pool.stop()  # busy ones see _stopping when their connection ends
        ok = self._dialer.shutdown(deadline)
        ok = self._answer.shutdown(deadline) and ok
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                ok = False
                log.warning("thread outlived shutdown deadline thread=%s", t.name)
        return ok

    # -- acceptor thread --------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        sched.apply_to_current_thread(self._sched)
        if self.gil_cpu is not None:
            sched.pin_current_thread(self.gil_cpu)
        listener = self._listener
        family = listener.family
        # socket.accept() converts family and type to enums on every call; the raw
        # accept plus a socket built from known ints does the same work without that.
        raw_accept = listener._accept  # type: ignore[attr-defined]
        wait_for_slot, dispatch = self.pipe_pool.wait_for_slot, self.pipe_pool.dispatch
        fd_backoff = 0.0
        while not self._accept_stop.is_set():
            if self._on_accept_loop is not None:
                self._on_accept_loop()
            if not wait_for_slot():  # at --max-connections: clients wait in the backlog
                continue
            try:
                fd, addr = raw_accept()
                sock = socket.socket(family, socket.SOCK_STREAM, 0, fd)
            except OSError as exc:
                if self._accept_stop.is_set():
                    break
                if exc.errno == errno.EAGAIN:  # SO_RCVTIMEO: look at the flags again
                    continue
                if exc.errno in FD_ERRNOS:
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
            if self._client_opts is None:
                self._learn_client_opts(sock)
            dispatch(sock, format_addr(addr))
        log.debug("acceptor stopped")

    def _learn_client_opts(self, sock: socket.socket) -> None:
        """Whether accepted sockets inherit the listener's options (the first one
        that can tell decides), or each needs them set (in _serve)."""
        inherited = has_opts(sock)
        self._client_opts = None if inherited is None else not inherited
        if self._client_opts:
            log.debug("accepted sockets do not inherit the listener's options; "
                      "setting them per connection")

    # -- pipe threads (PipePool._worker_loop calls this) ----------------------------------

    def _serve(self, client_sock: socket.socket, client: str, me: threading.Thread) -> None:
        """One client's trip, one way: pick and dial -> first answer -> attach -> relay ->
        detach (each step a method returning what the next one takes). With the native
        relay the first answer is judged inside the relay call itself, after attach (one
        native call per connection; docs/architecture.md, "A connection's trip"); only
        when it finds the upstream silent does the hedge pick the carrier, which is
        attached and relayed in turn."""
        if self._stopping.is_set():
            client_sock.close()
            return
        if self._client_opts is not False:
            apply_sockopts(client_sock)
        debug = log.isEnabledFor(logging.DEBUG)  # per connection, never per byte
        t0 = time.monotonic() if debug else 0.0
        tried: set[str] = set()
        placed = self._connect(client_sock, client, tried)
        if placed is None:
            return  # the client was closed (turned away, left, or refused)
        leg, pipe, judging = placed
        me.name = f"pipe-{client}->{leg.address}"
        if debug:
            connlog.opened(log, client, leg.address, time.monotonic() - t0)
        if judging:
            found, first = self._relay_judged(leg, pipe, tried, debug)
            if found == ANSWERED:
                return
            if found == LEFT:  # nothing sent elsewhere, nobody charged
                client_sock.close()
                return
            # Silent: the hedge picks the upstream that carries the connection.
            leg.first, leg.sent = first, len(first or b"")
            leg.since = time.monotonic() - self._answer.hedge_delay
            carrier = self._answer.race(client_sock, leg, tried)
            if carrier is None:
                client_sock.close()
                return
            pipe = self._pipe(client_sock, client, carrier)
            pipe.count_sent(len(first or b""))
            # The first upstream's reservation ended at attach_judging: by address.
            if not self._registry.conns.attach(
                    carrier.res if carrier.res.held else carrier.address, pipe):
                carrier.close()
                client_sock.close()
                return
            leg = carrier
            me.name = f"pipe-{client}->{leg.address}"  # the upstream that carries it
        self._relay(leg, pipe, debug)

    def _connect(self, client_sock: socket.socket, client: str, tried: set[str]
                 ) -> tuple[Leg, Pipe, bool] | None:
        """pick and dial -> first answer -> attach: the leg that carries the client, its
        attached Pipe, and whether the relay's first call still judges the first answer
        (attach_judging). None: the client was closed (turned away, left, refused)."""
        reg = self._registry
        first: bytes | None = None  # the client's first bytes, once read (for a replay)
        retry = True
        while True:
            leg = self._dial(client_sock, tried, first)
            if leg is None:
                self._turn_away(client_sock, client)
                return None
            placed = self._place(client_sock, client, leg, tried)
            if placed is None:  # the client left during the first answer
                client_sock.close()
                return None
            leg, pipe, judging = placed
            if pipe is not None:
                return leg, pipe, judging
            # Attach refused: its upstream started draining (or the proxy is closing)
            # while we dialed. One retry elsewhere, if the first bytes may go elsewhere.
            leg.sock.close()
            if retry and not reg.closing and replayable(leg) and reg.picks.any_pickable(
                    exclude=tried):
                retry, first = False, leg.first
                continue
            if not reg.closing:  # its upstream drained away, and no other was left
                reg.verdicts.record_no_upstream()
            client_sock.close()
            return None

    def _dial(self, client_sock: socket.socket, tried: set[str], first: bytes | None
              ) -> Leg | None:
        """pick -> dial: a connected upstream (its reservation held), or None."""
        native = self._judge_in_relay
        upstream, res = self._dialer.connect(
            tried, client_sock.fileno() if first is None and native else -1)
        if upstream is None or res is None:
            return None
        if first is not None:  # a replay: the next step sends them, and hedges nothing
            return Leg(upstream, res, first, replay=True)
        leg = Leg(upstream, res, res.first, res.sent)
        if native and leg.first is None and not res.panic:
            # The client's request, when it is there (the client speaks first), goes to
            # the upstream now, so the upstream works on it while Python attaches the
            # connection (new connections c=1: see docs/performance.md); mostly the
            # dial's own call did that.
            try:
                leg.first, leg.sent = self._take_first(  # type: ignore[misc]
                    client_sock.fileno(), upstream.fileno())
            except BaseException:
                leg.close()
                raise
        return leg

    def _place(self, client_sock: socket.socket, client: str, leg: Leg, tried: set[str]
               ) -> tuple[Leg, Pipe | None, bool] | None:
        """first answer -> attach: (the leg carrying the connection, its attached Pipe or
        None when attach was refused, whether the relay call still judges the first
        answer). None: the client left (every attempt closed)."""
        reg = self._registry
        try:
            pipe = self._pipe(client_sock, client, leg)
            if not self._answer.judges(leg):
                # Nothing to wait for (one upstream, panic mode, no ClientHello, hedge
                # off): what the client sent goes to this upstream, and the relay starts.
                if leg.first is not None and leg.sent < len(leg.first):
                    send_rest(leg)
            else:
                if self._judge_in_relay and pipe.can_judge():
                    # The common case with several upstreams: attached now, judged by the
                    # relay's own first call (Pipe.run_judged), counted once it carries.
                    attached = reg.conns.attach_judging(leg.res, pipe)
                    if attached is not None:
                        return leg, pipe if attached else None, True
                carrier = self._answer.settle(client_sock, leg, tried)
                if carrier is None:
                    return None
                if carrier is not leg:
                    leg = carrier  # first: the except below must close this one
                    pipe = self._pipe(client_sock, client, carrier)
            if leg.first:
                pipe.count_sent(len(leg.first))
            return leg, pipe if reg.conns.attach(leg.res, pipe) else None, False
        except BaseException:
            leg.close()
            raise

    def _pipe(self, client_sock: socket.socket, client: str, leg: Leg) -> Pipe:
        return Pipe(client_sock, leg.sock, client_addr=client, upstream_addr=leg.address,
                    relay=self.relay, pin=self._pin)

    def _relay_judged(self, leg: Leg, pipe: Pipe, tried: set[str], debug: bool
                      ) -> tuple[int, bytes | None]:
        """The relay's first call judges the first answer, then relays (one native call);
        detached at its end, counted only if it carried. (ANSWERED, None): relayed to the
        end. (SILENT or LEFT, first): nothing relayed, both sockets open, the upstream has
        the client's first bytes ``first``."""
        t0 = time.monotonic() if debug else 0.0
        found, first = -1, None  # -1: the call raised, nothing carried
        try:
            found, first = pipe.run_judged(self._answer.delay_ms, leg.first, leg.sent)
            if found == SILENT and not self._answer.can_hedge(tried):
                # Nothing to hedge to: the one there is has the bytes, and may answer.
                pipe.count_sent(len(first or b""))
                found = ANSWERED
                pipe.run()
        except BaseException:
            leg.sock.close()  # the relay raised before closing it (the pool closes the client)
            raise
        finally:
            self._registry.conns.detach(leg.address, pipe, carried=found == ANSWERED)
            if debug and found == ANSWERED:
                connlog.closed(log, pipe, t0)
        if found == LEFT:
            leg.sock.close()
        return found, first

    def _relay(self, leg: Leg, pipe: Pipe, debug: bool) -> None:
        """relay, until the connection ends; then detach."""
        t0 = time.monotonic() if debug else 0.0
        try:
            pipe.run()
        except BaseException:
            leg.sock.close()  # the relay raised before closing it (the pool closes the client)
            raise
        finally:
            self._registry.conns.detach(leg.address, pipe)
            if debug:
                connlog.closed(log, pipe, t0)

    def _turn_away(self, client_sock: socket.socket, client: str) -> None:
        _no_upstream(client=client)
        if not self._stopping.is_set():
            self._registry.verdicts.record_no_upstream()  # connection_errors_total{upstream="none"}
        client_sock.close()
