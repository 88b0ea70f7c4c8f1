"""A live connection's activity, sampled from its pipe's byte counters (pure).

Both relays (``_relay.c`` and the Python loop in ``datapath/pipe.py``) keep three live
counters per connection: client->upstream bytes ("up"), upstream->client bytes ("down"),
and "answered", the up count at the moment the relay last read bytes from the upstream
(one store per read, none per byte, no lock). The ``conn-sampler`` thread
(:mod:`extractedprism.upstreams.sampler`) reads them through
:meth:`Stalls.sample_activity` every sample period, and each connection's
:class:`Activity` turns the readings into two facts:

* **quiet time** (rebalancing, ``--rebalance-quiet``): when either count last moved;
* **the stall rule** (``--stall-timeout``): a connection *stalls* when its client has
  sent bytes and its upstream has sent nothing back for the stall timeout. Precisely:
  the client's bytes beyond "answered" are unanswered (the relay read them after the
  upstream's latest bytes); ``asked`` is the first sample that saw unanswered bytes with
  no upstream byte read since; any upstream byte answers everything the client sent
  before it. The connection is stalled once ``asked`` is ``--stall-timeout`` old.

What that means in time: ``asked`` is never before the client's bytes (a sample sees
them after they were read), so a stall is never found before the upstream has been
silent for the whole stall timeout, and at most one sample period after it. The order
of the two directions is the relay's, not the sampler's, so a request sent just after
the answer to the previous one, in the same sample period, is timed too.

The new-connection case: "answered" cannot tell an answer from any other upstream byte.
On a new HTTP/2 connection the server's SETTINGS, WINDOW_UPDATE and SETTINGS ACK frames
(and TLS 1.3 session tickets) follow the client's first request within a millisecond,
so a request sent with the connection preface counts as answered by them; the client's
next bytes on that connection (its next request, a PING, or the RST_STREAM of the first
request when that times out) start the clock. A new connection whose ClientHello gets
no byte back at all (a frozen server still accepts TCP) is asked from its first sample.
"""

from __future__ import annotations

# Stall-triggered checks one unanswered stretch may ask for: the first when it stalls,
# and one second look when it is still unanswered SECOND_LOOK stall timeouts after the
# first was asked for. Why two: a kube-apiserver's own /readyz lags an etcd cut by about
# 3 s (measured on the real control plane: a server cut just before answers the stall's
# first check with 200), so one look would leave a cut server in use until the next
# scheduled check. Why not more: a slow LIST or a quiet exec stream costs at most two
# probes, whatever its length. Why two stall timeouts later and not one: an answer that
# comes after twice the stall timeout (a slow but healthy server) still costs one probe.
STALL_LOOKS = 2
SECOND_LOOK = 2.0

# A stall-triggered check's results (extractedprism_stall_checks_total{result}, the
# ``stall_checks`` of /upstreams): its check failed (TCP or readyz) or passed.
STALL_FAILED, STALL_PASSED = STALL_CHECK_RESULTS = ("failed", "passed")


class Activity:
    """One live connection's sampled byte counts, on the registry clock.

    ``attached`` is the first sample that saw the connection and ``active`` the first
    that saw a count move (age and quiet time err short by at most one sample period,
    never long). ``asked``: see the module docstring (None: nothing unanswered).
    ``stalled``: counted as a stall (once per unanswered stretch); ``checks``: the
    stall-triggered checks asked for it in this stretch (at most :data:`STALL_LOOKS`),
    the last at ``looked``."""

    __slots__ = ("active", "asked", "attached", "checks", "down", "looked", "stalled", "up")

    def __init__(self, now: float, up: int, down: int, answered: int) -> None:
        self.attached = now
        self.active = now
        self.up = up
        self.down = down
        self.asked: float | None = now if up > answered else None
        self.stalled = False
        self.checks = 0
        self.looked = 0.0

    def sample(self, now: float, up: int, down: int, answered: int) -> None:
        """One reading of the pipe's live counters (``answered``: the up count when the
        relay last read the upstream's bytes)."""
        if up == self.up and down == self.down:
            return  # the common case: nothing moved
        self.active = now
        if up <= answered:
            self.asked = None  # everything the client sent has had bytes back since
        elif self.asked is None or down != self.down:
            # Unanswered bytes, read after the upstream's latest: their clock starts now
            # (within a sample period after they came, never before).
            self.asked = now
        if self.asked is None or down != self.down:
            self.stalled = False
            self.checks = 0
        self.up, self.down = up, down

    def wants_look(self, now: float, timeout: float) -> bool:
        """A stalled stretch asks for a check: its first, or its second look
        :data:`SECOND_LOOK` stall timeouts after the first."""
        if self.checks == 0:
            return True
        return self.checks < STALL_LOOKS and now - self.looked >= SECOND_LOOK * timeout

    def looked_now(self, now: float) -> None:
        self.checks += 1
        self.looked = now

    def stalled_for(self, now: float) -> float:
        """How long the client's bytes have gone unanswered (0: nothing unanswered)."""
        return 0.0 if self.asked is None else now - self.asked

    def is_stalled(self, now: float, timeout: float) -> bool:
        """Stalled: unanswered for at least ``timeout`` (``--stall-timeout``; 0: off)."""
        return timeout > 0 and self.asked is not None and now - self.asked >= timeout
