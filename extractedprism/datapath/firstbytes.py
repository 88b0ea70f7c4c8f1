"""The silent-upstream check: the client's first bytes go to a new upstream, which
must answer within one dial timeout before the pipe starts.

Run by a pipe thread (Proxy._serve, through Proxy._first_answer) for each new
connection, between the dial and the pipe.

A connect proves only that the upstream's kernel is alive: a stopped (SIGSTOP) or
wedged API server still completes handshakes from its backlog. So the client's first
bytes (its TLS ClientHello) are read before the pipe starts and the upstream gets one
dial timeout to answer them; a silent one counts as a failed dial and the same bytes
go to the next upstream (nothing went back to the client yet, so the client cannot
tell). Found against a real control plane (tests/controlplane, the SIGSTOP scenario).
"""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Callable

# The client's first bytes held for a possible re-dial: a TLS ClientHello is one record
# (at most 16 KiB); anything past it stays in the socket for the pipe.
FIRST_BYTES_MAX = 16 * 1024

NativeFirstAnswer = Callable[[int, int, int, bytes | None, int], tuple[int, bytes]]


def first_answer(client: socket.socket, upstream: socket.socket, first: bytes | None, *,
                 dial_timeout: float, native_first: NativeFirstAnswer | None,
                 sent: int = 0) -> tuple[bool, bytes]:
    """Hand the client's first bytes to a new upstream; did it answer within a dial timeout?

    A TCP connect proves only that the upstream's kernel is alive: a stopped
    (SIGSTOP) or wedged API server still completes handshakes from its backlog, and a
    client's TLS handshake would then wait for its own timeout. The client speaks
    first in TLS, so its first bytes (the ClientHello) are read here, sent on, and
    the upstream gets one dial timeout to send anything back (or to close).

    Returns (answered, first bytes). Not judged, so answered: the client sent
    nothing within a dial timeout, or closed, or the upstream spoke first or failed
    (the pipe passes the error on). ``first`` is what an earlier, silent upstream
    got, or what Proxy._serve took and sent on at once (``sent`` of them reached this
    upstream already); the rest goes to this one as it is.
    """
    timeout_ms = max(1, int(dial_timeout * 1000))
    cfd, ufd = client.fileno(), upstream.fileno()
    if native_first is not None:
        # The same steps in C with the GIL released once, instead of four releases
        # (poll, recv, send, poll) on every new connection.
        answered, first = native_first(cfd, ufd, timeout_ms, first, sent)
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
    deadline = time.monotonic() + dial_timeout
    view = memoryview(first)[sent:]
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
