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
* Never more than two attempts for one client at once. With nothing to hedge to, the
  connection is relayed to the one upstream there is.
* The client is watched during the wait: if it closes or resets, every attempt is closed,
  nothing goes anywhere else, and no upstream is charged.
* The attempt that is not used is parked off the client's path (offpath.Reaper, the
  ``answer-reaper`` thread, no pipe thread held) until it answers or ``--health-timeout``
  passes since it got the ClientHello, then closed with a FIN. Answered: its upstream is
  alive (a success). Never answered: one failure toward its streak, so a frozen server is
  excluded by its second such connection while a slow but alive one never is.
* ``extractedprism_answer_hedges_total{upstream,outcome}``, counted only when the hedge
  fired: ``won`` (carried the connection), ``lost`` (answered after the other), ``silent``
  (never answered within --health-timeout).
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time

from extractedprism.datapath.dialer import Dial, Dialer
from extractedprism.datapath.offpath import Reaper
from extractedprism.datapath.relay import ANSWERED, LEFT, SILENT, NativeFirstAnswer
from extractedprism.upstreams.registry import Registry
from extractedprism.upstreams.reservation import Reservation

log = logging.getLogger(__name__)

# The client's first bytes, read once: a TLS ClientHello is one record of at most 16 KiB;
# anything past it stays in the socket for the relay.
FIRST_BYTES_MAX = 16 * 1024

_TLS_HANDSHAKE = 22
_CLIENT_HELLO = 1
_POLLIN = select.POLLIN | select.POLLERR | select.POLLHUP
_POLLOUT = select.POLLOUT | select.POLLERR | select.POLLHUP


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

    __slots__ = ("address", "first", "res", "sent", "since", "sock")

    def __init__(self, sock: socket.socket, res: Reservation, first: bytes | None = None,
                 sent: int = 0) -> None:
        self.sock = sock
        self.res = res
        self.address = res.address  # a slot, not a property: read on every connection
        self.first = first  # the client's first bytes, once read (None: not yet)
        self.sent = sent  # how many of them this upstream has
        self.since = 0.0  # when it got all of them (the answer's deadlines count from it)

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
    timeout_ms = max(1, int(timeout * 1000))
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
        _close_with_fin(self.leg.sock)
        self.sock = None
        if ready:
            self.owner.alive(self.leg.address, "lost" if self.counted else "")
        else:
            self.owner.silent(self.leg.address, "silent" if self.counted else "")

    def drop(self) -> None:
        self.leg.sock.close()
        self.sock = None


def _close_with_fin(sock: socket.socket) -> None:
    """Close with a FIN, not a reset: an answer left unread would make close() send one."""
    try:
        while sock.recv(65536, socket.MSG_DONTWAIT):
            pass
    except OSError:
        pass
    sock.close()


class FirstAnswer:
    """The first answer of every new connection (see the module docstring)."""

    def __init__(self, registry: Registry, dialer: Dialer, *, hedge_delay: float,
                 health_timeout: float, native_first: NativeFirstAnswer | None,
                 stopping: threading.Event) -> None:
        self._registry = registry
        self._dialer = dialer
        self.hedge_delay = hedge_delay  # 0: off (no wait, no hedge)
        self.delay_ms = max(1, int(hedge_delay * 1000))
        self.health_timeout = health_timeout
        self._native_first = native_first
        self._stopping = stopping
        self._reaper = Reaper("answer-reaper")

    def shutdown(self, deadline: float) -> bool:
        """Stop the answer reaper against the shutdown's one deadline."""
        return self._reaper.stop(deadline)

    def judges(self, leg: Leg) -> bool:
        """Is ``leg``'s first answer worth waiting for? Not with the hedge off, not in panic
        mode or when nothing else was pickable (nothing to hedge to), and not for first
        bytes already read that are no ClientHello (they may go nowhere else)."""
        return (self.hedge_delay > 0 and not leg.res.panic and not leg.res.alone
                and (leg.first is None or is_client_hello(leg.first)))

    def can_hedge(self, tried: set[str]) -> bool:
        return self._registry.any_pickable(exclude=tried)

    def settle(self, client: socket.socket, leg: Leg, tried: set[str]) -> Leg | None:
        """The first answer in Python for a leg judges() accepts (the Python relay, or
        where the native relay call cannot judge): the leg that carries the connection,
        all of the client's first bytes (if read) sent to it; None: the client left
        (every attempt closed)."""
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
        carries the connection. None: the client left (every attempt closed, nobody
        charged) or shutdown."""
        first = a.first
        assert first is not None and a.sent == len(first)
        if not self.can_hedge(tried):
            return a  # nothing to hedge to: the one there is
        poller = select.poll()
        cfd = client.fileno()
        poller.register(cfd, select.POLLIN)
        poller.register(a.sock.fileno(), _POLLIN)
        legs = [a]
        by_fd = {a.sock.fileno(): a}
        dialing: Dial | None = None
        hedge_at: float | None = time.monotonic()
        fired = False
        result: Leg | None = None
        try:
            while result is None and not self._stopping.is_set():
                now = time.monotonic()
                if hedge_at is not None and now >= hedge_at and dialing is None \
                        and len(legs) < 2:
                    hedge_at = None
                    started = self._dialer.start(tried, poller)
                    if started is None:
                        if len(legs) == 1:
                            result = legs[0]  # nothing (left) to hedge to: the one there is
                        continue
                    dialing, connected = started
                    if connected:
                        fired = self._join(dialing, first, poller, legs, by_fd)
                        dialing = None
                    continue
                wake = min(leg.since + self.health_timeout for leg in legs)
                if dialing is not None:
                    wake = min(wake, dialing.deadline)
                if hedge_at is not None:
                    wake = min(wake, hedge_at)
                for fd, ev in poller.poll(max(0, (wake - now) * 1000 + 1)):
                    leg = by_fd.get(fd)
                    if fd == cfd:
                        if _client_moved(client) == LEFT:
                            return None  # finally: every attempt closed, nobody charged
                        result = legs[0]  # it sent more: nothing to hedge any more
                    elif leg is not None and leg.sent < len(first) and ev & select.POLLOUT:
                        self._push(leg, first, poller)
                    elif leg is not None:
                        result = leg  # answered (or closed: the relay passes that on)
                    elif dialing is not None and dialing.sock is not None \
                            and fd == dialing.sock.fileno():
                        done = self._dialer.progress(dialing, poller, True)
                        if done:
                            fired = self._join(dialing, first, poller, legs, by_fd)
                            dialing = None
                        elif done is False:
                            dialing, hedge_at = None, time.monotonic()  # the next one
                    if result is not None:
                        break
                if result is not None:
                    break
                now = time.monotonic()
                if dialing is not None and now >= dialing.deadline and \
                        self._dialer.progress(dialing, poller, False) is False:
                    dialing, hedge_at = None, now
                for leg in list(legs):
                    # Silent for a whole --health-timeout while another attempt runs: a
                    # failure, and room for another hedge. The last one is kept.
                    if len(legs) > 1 and leg.since and now >= leg.since + self.health_timeout:
                        legs.remove(leg)
                        del by_fd[leg.sock.fileno()]
                        poller.unregister(leg.sock.fileno())
                        _close_with_fin(leg.sock)
                        leg.res.release()
                        self.silent(leg.address, "silent")
                        hedge_at = now
        finally:
            if dialing is not None:
                if result is not None:
                    self._dialer.abandon(dialing, poller)  # runs on; the reaper records it
                else:
                    dialing.drop()
            for leg in legs:
                if leg is result:
                    continue
                if result is not None and leg.sent == len(first):
                    leg.res.release()
                    self._reaper.adopt(_Parked(self, leg, fired))
                else:
                    leg.close()  # the client left, or it never got the whole ClientHello
        if result is not None and fired:
            self._registry.record_answer_hedge(result.address, "won")
        return result

    def _join(self, d: Dial, first: bytes, poller: select.poll, legs: list[Leg],
              by_fd: dict[int, Leg]) -> bool:
        """A hedge dial connected: it gets the ClientHello. True: the hedge fired."""
        assert d.sock is not None
        leg = Leg(d.sock, d.res, first, 0)
        d.sock = None
        legs.append(leg)
        by_fd[leg.sock.fileno()] = leg
        poller.register(leg.sock.fileno(), _POLLIN)
        self._push(leg, first, poller)
        return True

    @staticmethod
    def _push(leg: Leg, first: bytes, poller: select.poll) -> None:
        try:
            leg.sent += leg.sock.send(memoryview(first)[leg.sent:])
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            leg.since = leg.since or time.monotonic()
            poller.modify(leg.sock.fileno(), _POLLIN)  # its error answers: the relay says
            return
        if leg.sent < len(first):
            poller.modify(leg.sock.fileno(), _POLLIN | select.POLLOUT)
        else:
            leg.since = time.monotonic()
            poller.modify(leg.sock.fileno(), _POLLIN)

    # -- outcomes (the parked attempts report here) ----------------------------------------

    def alive(self, addr: str, outcome: str) -> None:
        """It answered: alive, never a failure."""
        if outcome:
            self._registry.record_answer_hedge(addr, outcome)
        self._registry.record_dial(addr, True)

    def silent(self, addr: str, outcome: str) -> None:
        """It never answered within --health-timeout: one failure toward its streak."""
        if outcome:  # first: an exclusion it causes then finds it counted
            self._registry.record_answer_hedge(addr, outcome)
        self._registry.record_dial(
            addr, False, f"no answer within {self.health_timeout:g}s to the client's TLS "
            "ClientHello", count_error=not self._stopping.is_set())

