"""The first answer: when a new connection counts as established, and the hedge when its
upstream stays silent.

Run by a pipe thread for each new connection (Proxy._serve), between the dial and the
relay; with the native relay the first wait runs inside the relay call itself
(``_relay.judged_relay``, the same steps in C, see ``wait_answer``), and Python takes
over only when it finds the upstream silent.

A connect proves only that the upstream's kernel is alive: a stopped (SIGSTOP) or wedged
API server still completes handshakes from its backlog. So a connection is established
when its upstream answers the client's first flight (a TLS client speaks first: its
ClientHello). If no answer comes within ``--answer-hedge-delay`` (a healthy kube-apiserver
answers a ClientHello in milliseconds), the same ClientHello also goes to one other
pickable upstream not yet tried, and whichever answers first carries the connection
(``race``). The rules:

* Only a complete TLS ClientHello record (``is_client_hello``) ever goes to a second
  upstream: harmless to repeat, since kube-apiserver has no 0-RTT. Any other first bytes
  go to the first upstream only, relayed at once with no wait and no hedge: a cleartext
  request must never be executed twice. The drain race and panic mode follow the rule
  too (``replayable``).
* A client's ClientHello reaches at most two upstreams, ever: the first and one hedge.
  Hedge dials that fail before connecting got nothing, so the hedge moves on to the next
  pickable upstream; but once a second upstream has the ClientHello nothing else gets it,
  even when one of the two is later dropped as silent (a third try would only spread
  one client's wait over more servers and charge each a failure; a client-go client
  gives up on its TLS handshake after 10 s and reconnects anyway, through a fresh pick).
  With nothing to hedge to, or once only one attempt is left, the connection is relayed
  to that one unanswered (the relay passes on whatever it later says). The drain race's
  retry (proxy.Proxy._connect) is the ClientHello's second upstream, so it is never
  hedged. And a client never has more than two attempts out at once: a dial its first
  attempt won against (a hedged dial still running off the client's path, the Dialer's
  reaper) is dropped, uncounted, before the hedge dials.
* An answer is bytes. An upstream that closes or resets without a byte answered nothing:
  one failure toward its streak; it never carries the client, and if the hedge is still
  unused it starts at once. An upstream that has not got the whole ClientHello can never
  carry the client either.
* The client is watched during the wait: if it closes or resets, every attempt is closed,
  nothing goes anywhere else, and no upstream is charged. Shutdown ends the wait at once
  (``close_all``: the client is not attached to an upstream until its carrier is known).
* The attempt that is not used is parked off the client's path (offpath.Reaper, the
  ``answer-reaper`` thread, no pipe thread held) until it answers or ``--health-timeout``
  passes since it got the ClientHello, then closed with a FIN. Answered: its upstream is
  alive (a success). Closed, reset or never answered: one failure toward its streak, so a
  frozen server is excluded by its second such connection while a slow but alive one
  never is. Where it cannot be parked (no descriptor or thread for the reaper) it is
  closed uncounted; the client keeps its carrier.
* ``extractedprism_answer_hedges_total{upstream,outcome}``, counted only when the hedge
  fired: ``won`` (answered first and carried the connection), ``lost`` (answered after
  the other), ``silent`` (closed, reset or never answered within --health-timeout). An
  upstream left to carry the connection unanswered gets no outcome.
* Counting (Table.count_locked): a connection is counted once, on the upstream that
  carries it; never on one that was silent or that the client left.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Iterator

from extractedprism.datapath.dialer import Dial, Dialer
from extractedprism.datapath.offpath import Reaper
from extractedprism.datapath.relay import ANSWERED, LEFT, SILENT, NativeFirstAnswer
from extractedprism.upstreams.registry import Registry
from extractedprism.upstreams.reservation import Reservation

log = logging.getLogger(__name__)

# The client's first bytes, read once: a TLS ClientHello is one record of at most 16 KiB;
# anything past it stays in the socket for the relay.
FIRST_BYTES_MAX = 16 * 1024

_INT_MAX = 2**31 - 1
_TLS_HANDSHAKE = 22
_CLIENT_HELLO = 1
_POLLIN = select.POLLIN | select.POLLERR | select.POLLHUP
_POLLOUT = select.POLLOUT | select.POLLERR | select.POLLHUP


def _ms(seconds: float) -> int:
    """A timeout in milliseconds for poll() and the native relay: at least 1, at most a C
    int (--answer-hedge-delay is bounded far below that; this keeps any caller safe)."""
    return min(max(1, int(seconds * 1000)), _INT_MAX)


def is_client_hello(first: bytes | None) -> bool:
    """One complete TLS ClientHello record and nothing else: record type 22, handshake
    type 1, the record's length exactly the bytes read (at most FIRST_BYTES_MAX).
    _relay.c's is_client_hello is the same rule in C."""
    # The record type first: a cleartext first write fails there, at one len() call.
    return (first is not None and len(first) >= 6 and first[0] == _TLS_HANDSHAKE
            and first[5] == _CLIENT_HELLO and len(first) <= FIRST_BYTES_MAX
            and 5 + (first[3] << 8 | first[4]) == len(first))


class Leg:
    """One attempt for a client: an upstream socket, its reservation (held until attach),
    and the client's first bytes as this upstream has them."""

    __slots__ = ("address", "first", "replay", "res", "sent", "since", "sock")

    def __init__(self, sock: socket.socket, res: Reservation, first: bytes | None = None,
                 sent: int = 0, *, replay: bool = False) -> None:
        self.sock = sock
        self.res = res
        self.address = res.address  # a slot, not a property: read on every connection
        self.first = first  # the client's first bytes, once read (None: not yet)
        self.sent = sent  # how many of them this upstream has
        self.since = 0.0  # when it got all of them (the answer's deadlines count from it)
        # The client's first bytes went to another upstream already (the drain race's
        # retry): this is their second and last upstream, so it is never hedged.
        self.replay = replay

    def close(self) -> None:
        self.sock.close()
        self.res.release()


def replayable(leg: Leg) -> bool:
    """May the client's first bytes go to another upstream than ``leg``'s? Only when
    ``leg``'s upstream got none of them, or they are a complete ClientHello."""
    return not leg.sent or is_client_hello(leg.first)


def send_rest(leg: Leg) -> bool:
    """Send what ``leg``'s upstream does not have yet, waiting as the relay would; False
    on the upstream's error (the relay reports it)."""
    first = leg.first
    if first is None or leg.sent == len(first):
        return True
    ufd = leg.sock.fileno()
    try:
        while leg.sent < len(first):
            try:
                leg.sent += leg.sock.send(memoryview(first)[leg.sent:])
            except (BlockingIOError, InterruptedError):
                poller = select.poll()
                poller.register(ufd, _POLLOUT)
                poller.poll()
    except OSError:
        return False
    leg.since = time.monotonic()
    return True


def _client_moved(client: socket.socket) -> int:
    """The client became readable during a wait: LEFT on EOF or a reset, ANSWERED when
    it sent more (nothing left to hedge: the relay takes it)."""
    try:
        data = client.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return ANSWERED
    except OSError:
        return LEFT
    return ANSWERED if data else LEFT


def wait_answer(client: socket.socket, leg: Leg, timeout: float,
                native_first: NativeFirstAnswer | None) -> int:
    """Read the client's first bytes (unless ``leg.first`` has them), send them to
    ``leg``'s upstream and, when they are a ClientHello, wait up to ``timeout`` for its
    answer while watching the client. SILENT, ANSWERED or LEFT; ``leg.first``/``sent``
    say what the upstream has (all of ``leg.first`` unless LEFT before reading)."""
    timeout_ms = _ms(timeout)
    cfd, ufd = client.fileno(), leg.sock.fileno()
    if native_first is not None:
        # The same steps in C with the GIL released once, instead of a release per step.
        found, first = native_first(cfd, ufd, timeout_ms, leg.first, leg.sent)
        if first:
            leg.first, leg.sent = first, len(first)
            leg.since = time.monotonic() - (timeout if found == SILENT else 0.0)
        return found
    if leg.first is None:
        poller = select.poll()
        poller.register(cfd, select.POLLIN)
        poller.register(ufd, select.POLLIN)
        events = dict(poller.poll(timeout_ms))
        if not events or ufd in events:
            return ANSWERED  # nothing from the client yet, or the upstream spoke first
        try:
            first = client.recv(FIRST_BYTES_MAX, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return ANSWERED
        except OSError:
            return LEFT
        if not first:
            return LEFT
        leg.first, leg.sent = first, 0
    if not send_rest(leg) or not is_client_hello(leg.first):
        return ANSWERED
    poller = select.poll()
    poller.register(cfd, select.POLLIN)
    poller.register(ufd, select.POLLIN)
    leg.since = leg.since or time.monotonic()  # had them already (a replay's dial)
    deadline = leg.since + timeout
    while (left := deadline - time.monotonic()) > 0:
        events = dict(poller.poll(max(1, int(left * 1000))))
        if ufd in events:
            return ANSWERED
        if cfd in events:
            return _client_moved(client)
    return SILENT


def _answer_kind(sock: socket.socket) -> bool:
    """An attempt became readable: True when its upstream sent bytes (an answer), False
    when it closed or reset the connection without a word (no answer: a failure)."""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except (BlockingIOError, InterruptedError):
        return False  # POLLERR/POLLHUP with nothing to read
    except OSError:
        return False


class _Parked:
    """The attempt a race did not use, parked on the answer reaper (offpath.Parked)."""

    __slots__ = ("counted", "deadline", "leg", "owner", "sock")
    events = _POLLIN

    def __init__(self, owner: FirstAnswer, leg: Leg, counted: bool) -> None:
        self.owner = owner
        self.leg = leg
        self.sock: socket.socket | None = leg.sock
        self.deadline = leg.since + owner.health_timeout
        self.counted = counted  # the hedge fired: its outcome goes into the metric

    def finish(self, ready: bool) -> None:
        answered = ready and _answer_kind(self.leg.sock)
        _close_with_fin(self.leg.sock)
        self.sock = None
        outcome = "lost" if answered else "silent"
        self.owner.judged(self.leg.address, answered, outcome if self.counted else "",
                          closed=ready)

    def drop(self) -> None:
        self.leg.sock.close()
        self.sock = None


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # closed already, or the peer is gone
        pass


def _close_with_fin(sock: socket.socket) -> None:
    """Close with a FIN, not a reset: an answer left unread would make close() send one."""
    try:
        while sock.recv(65536, socket.MSG_DONTWAIT):
            pass
    except OSError:
        pass
    sock.close()


class _Race:
    """One client's hedge (FirstAnswer.race): the attempts that have its ClientHello (at
    most two ever: the first and one hedge), the hedge's dial while it connects, and one
    poll over the client, the attempts and the dial.

    ``run`` ends in one of three ways: an attempt holding the whole ClientHello answers
    (it carries the client); nothing is left to wait for (the one attempt left carries
    the client unanswered, or there is none); the client leaves or the proxy stops
    (None). ``close`` then parks or closes every other attempt."""

    def __init__(self, owner: FirstAnswer, client: socket.socket, a: Leg,
                 tried: set[str]) -> None:
        assert a.first is not None and a.sent == len(a.first)
        self.owner = owner
        self.client = client
        self.cfd = client.fileno()
        self.first = a.first
        self.tried = tried
        self.poller = select.poll()
        self.poller.register(self.cfd, select.POLLIN)
        self.legs: dict[int, Leg] = {}  # fd -> an attempt that got (some of) the ClientHello
        self.dial: Dial | None = None  # the hedge's dial, until it connects or fails
        self.hedge_at: float | None = time.monotonic()  # None: no hedge (any more)
        self.fired = False  # the hedge got the ClientHello: outcomes go into the metric
        self.answered = False  # the result answered (else it carries the client unanswered)
        self._add(a)

    # -- the loop ---------------------------------------------------------------------

    def run(self) -> Leg | None:
        stopping = self.owner.stopping
        while not stopping.is_set():
            if self.hedge_at is not None and time.monotonic() >= self.hedge_at:
                self._hedge()
            left = self._left_alone()
            if left is not False:
                return left
            for fd, ev in self.poller.poll(self._wait_ms()):
                if fd == self.cfd:
                    return self._client_moved()
                leg = self.legs.get(fd)
                if leg is not None:
                    if self._attempt_moved(leg, ev):
                        self.answered = True
                        return leg
                elif self.dial is not None and self.dial.sock is not None \
                        and fd == self.dial.sock.fileno():
                    self._dial_moved(True)
            self._expire()
        return None

    def _left_alone(self) -> Leg | bool | None:
        """False: keep waiting. Else what the race ends with when nothing more can come:
        no dial, no hedge to come, and at most one attempt (it carries the client)."""
        if self.dial is not None or self.hedge_at is not None or len(self.legs) > 1:
            return False
        return next(iter(self.legs.values()), None)

    def _wait_ms(self) -> float:
        wake = min(leg.since + self.owner.health_timeout for leg in self.legs.values()) \
            if self.legs else time.monotonic() + self.owner.health_timeout
        if self.dial is not None:
            wake = min(wake, self.dial.deadline)
        if self.hedge_at is not None:
            wake = min(wake, self.hedge_at)
        return max(0.0, (wake - time.monotonic()) * 1000) + 1

    # -- what moved ----------------------------------------------------------------

    def _client_moved(self) -> Leg | None:
        """The client closed (None: every attempt closed, nobody charged) or sent more:
        nothing to hedge any more, the first attempt holding the whole ClientHello carries
        it."""
        if _client_moved(self.client) == LEFT:
            return None
        return next((leg for leg in self.legs.values() if leg.sent == len(self.first)), None)

    def _attempt_moved(self, leg: Leg, ev: int) -> bool:
        """True: ``leg`` answered the whole ClientHello. A reset or close without an answer
        is a failure, and so is an answer before the whole ClientHello went out (it can
        never carry the client); with the hedge still unused it starts at once."""
        if leg.sent < len(self.first):
            if not ev & _POLLIN:  # only writable: the rest of the ClientHello
                self._push(leg)
                return False
        elif _answer_kind(leg.sock):
            return True
        self._drop(leg, "closed the connection without answering the client's TLS "
                   "ClientHello")
        return False

    def _dial_moved(self, ready: bool) -> None:
        assert self.dial is not None
        done = self.owner.dialer.progress(self.dial, self.poller, ready)
        if done:
            d, self.dial = self.dial, None
            self._join(d)
        elif done is False:  # failed (recorded): the next upstream, if any
            self.dial, self.hedge_at = None, time.monotonic()

    def _expire(self) -> None:
        now = time.monotonic()
        if self.dial is not None and now >= self.dial.deadline:
            self._dial_moved(False)
        for leg in list(self.legs.values()):
            # Silent for a whole --health-timeout while another attempt runs: a failure.
            # The last one is kept (it carries the client: _left_alone).
            if len(self.legs) + (self.dial is not None) > 1 \
                    and now >= leg.since + self.owner.health_timeout:
                self._drop(leg, "")

    # -- attempts -----------------------------------------------------------------------

    def _hedge(self) -> None:
        """The hedge: one dial to another pickable upstream. Only while no second attempt
        has the ClientHello: never more than two upstreams get it."""
        self.hedge_at = None
        if self.fired or len(self.legs) > 1:
            return
        for leg in self.legs.values():
            # A dial its first attempt won against may still run off the path: dropped
            # first, so the client never has more than two attempts out (issue 37).
            self.owner.dialer.cancel_rivals(leg.res)
        started = self.owner.dialer.start(self.tried, self.poller)
        if started is None:
            return  # nothing (left) to hedge to
        self.dial, connected = started
        if connected:
            d, self.dial = self.dial, None
            self._join(d)

    def _join(self, d: Dial) -> None:
        """A hedge dial connected: it gets the ClientHello."""
        assert d.sock is not None
        leg = Leg(d.sock, d.res, self.first, 0)
        leg.since = time.monotonic()  # its deadline counts from here until all is sent
        d.sock = None
        self.fired = True
        self._add(leg)
        self._push(leg)

    def _add(self, leg: Leg) -> None:
        self.legs[leg.sock.fileno()] = leg
        self.poller.register(leg.sock.fileno(), _POLLIN)

    def _push(self, leg: Leg) -> None:
        """Send what ``leg`` lacks of the ClientHello without waiting (POLLOUT for the rest)."""
        try:
            leg.sent += leg.sock.send(memoryview(self.first)[leg.sent:])
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            return  # its error wakes the poll: _attempt_moved drops it
        full = leg.sent == len(self.first)
        if full:
            leg.since = time.monotonic()
        self.poller.modify(leg.sock.fileno(), _POLLIN if full else _POLLIN | select.POLLOUT)

    def _drop(self, leg: Leg, reason: str) -> None:
        """``leg`` failed (``reason``) or stayed silent past --health-timeout (no
        reason): charged, closed; the hedge, if unused, starts now."""
        del self.legs[leg.sock.fileno()]
        self.poller.unregister(leg.sock.fileno())
        _close_with_fin(leg.sock)
        leg.res.release()
        self.owner.judged(leg.address, False, "silent" if self.fired else "",
                          closed=bool(reason))
        if not self.fired and self.dial is None:
            self.hedge_at = time.monotonic()

    # -- the end --------------------------------------------------------------------------

    def close(self, result: Leg | None) -> None:
        """Every attempt but ``result``: parked when it has the whole ClientHello and the
        client is served (its answer or silence is news about its upstream), else closed
        uncharged; the hedge's dial runs on off the client's path or is dropped."""
        if self.dial is not None:
            if result is not None:
                self.owner.dialer.abandon(self.dial, self.poller)
            else:
                self.dial.drop()
        for leg in self.legs.values():
            if leg is result:
                continue
            if result is not None and leg.sent == len(self.first):
                leg.res.release()
                self.owner.park(_Parked(self.owner, leg, self.fired))
            else:
                leg.close()


class FirstAnswer:
    """The first answer of every new connection (see the module docstring)."""

    def __init__(self, registry: Registry, dialer: Dialer, *, hedge_delay: float,
                 health_timeout: float, native_first: NativeFirstAnswer | None,
                 stopping: threading.Event) -> None:
        self._registry = registry
        self.dialer = dialer
        self.hedge_delay = hedge_delay  # 0: off (no wait, no hedge)
        self.delay_ms = _ms(hedge_delay)
        self.health_timeout = health_timeout
        self._native_first = native_first
        self.stopping = stopping
        self._reaper = Reaper("answer-reaper")
        # Clients waiting on their first answer in Python (settle, race): attached to no
        # upstream yet, so shutdown reaches them here (close_all), under _lock.
        self._lock = threading.Lock()
        self._waiting: set[socket.socket] = set()
        self._closing = False

    def shutdown(self, deadline: float) -> bool:
        """Stop the answer reaper against the shutdown's one deadline."""
        return self._reaper.stop(deadline)

    def close_all(self) -> None:
        """Shutdown: end every wait for a first answer now (the client is shut down, which
        wakes its pipe thread's poll: it closes every attempt, charging nobody), and every
        wait that starts from now on at once."""
        with self._lock:
            self._closing = True
            for client in self._waiting:
                _shut(client)

    @contextlib.contextmanager
    def watching(self, client: socket.socket) -> Iterator[None]:
        """``client`` waits on its first answer for the block's duration (close_all)."""
        with self._lock:
            self._waiting.add(client)
            if self._closing:
                _shut(client)
        try:
            yield
        finally:
            with self._lock:
                self._waiting.discard(client)

    def judges(self, leg: Leg) -> bool:
        """Is ``leg``'s first answer worth waiting for? Not with the hedge off, not in panic
        mode or when nothing else was pickable (nothing to hedge to), and not for first
        bytes already read that are no ClientHello (they may go nowhere else), and not
        for a replay (its ClientHello has reached its second upstream: the last)."""
        return (self.hedge_delay > 0 and not leg.res.panic and not leg.res.alone
                and not leg.replay
                and (leg.first is None or is_client_hello(leg.first)))

    def can_hedge(self, tried: set[str]) -> bool:
        return self._registry.picks.any_pickable(exclude=tried)

    def settle(self, client: socket.socket, leg: Leg, tried: set[str]) -> Leg | None:
        """The first answer in Python for a leg judges() accepts (the Python relay, or
        where the native relay call cannot judge): the leg that carries the connection,
        all of the client's first bytes (if read) sent to it; None: the client left
        (every attempt closed)."""
        with self.watching(client):
            found = wait_answer(client, leg, self.hedge_delay, self._native_first)
        if found == ANSWERED:
            return leg
        if found == LEFT:
            leg.close()
            return None
        return self.race(client, leg, tried)

    # -- the hedge -------------------------------------------------------------------

    def race(self, client: socket.socket, a: Leg, tried: set[str]) -> Leg | None:
        """``a`` has had the client's ClientHello for the hedge delay without a word: the
        same bytes go to one other pickable upstream too, and the first to answer
        carries the connection (_Race says when what else carries it). None: the client
        left (every attempt closed, nobody charged), every attempt failed, or shutdown."""
        if not self.can_hedge(tried):
            return a  # nothing to hedge to: the one there is
        race = _Race(self, client, a, tried)
        result: Leg | None = None
        try:
            with self.watching(client):
                result = race.run()
        finally:
            race.close(result)
        if result is not None and race.fired and race.answered:
            self._registry.verdicts.record_answer_hedge(result.address, "won")
        return result

    def park(self, parked: _Parked) -> None:
        self._reaper.adopt(parked)  # never raises: a failure closes it uncounted

    # -- outcomes (the parked attempts report here) ----------------------------------------

    def judged(self, addr: str, answered: bool, outcome: str, *, closed: bool = False
               ) -> None:
        """An attempt's verdict. Answered: alive, never a failure. Else (``closed``: it
        closed or reset without answering; otherwise no answer within --health-timeout)
        one failure toward its streak. ``outcome``: the hedge metric's, when it fired."""
        if outcome:  # first: an exclusion it causes then finds it counted
            self._registry.verdicts.record_answer_hedge(addr, outcome)
        if answered:
            self._registry.verdicts.record_dial(addr, True)
            return
        reason = ("closed the connection without answering the client's TLS ClientHello"
                  if closed else f"no answer within {self.health_timeout:g}s to the "
                  "client's TLS ClientHello")
        self._registry.verdicts.record_dial(addr, False, reason,
                                   count_error=not self.stopping.is_set(), slow=not closed)
