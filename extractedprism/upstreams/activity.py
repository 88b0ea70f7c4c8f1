"""A live connection's activity, sampled from its pipe's byte counters (pure).

Both relays (``_relay.c`` and the Python loop in ``datapath/pipe.py``) keep two live
counters per connection, client->upstream ("up") and upstream->client ("down"), written as
bytes are read and never touched for this. The ``conn-sampler`` thread
(:mod:`extractedprism.upstreams.sampler`) reads them through
:meth:`Registry.sample_activity` every sample period, and each connection's
:class:`Activity` turns the readings into two facts:

* **quiet time** (rebalancing, ``--rebalance-quiet``): when either count last moved;
* **the stall rule** (``--stall-timeout``): a connection *stalls* when its client has
  sent bytes and its upstream has sent nothing back for the stall timeout. Precisely:
  ``asked`` is the first sample that saw the client's count above what it was at the
  last sample at which the upstream's count grew (``answered_up``; 0 before the upstream
  ever sent a byte), with the upstream's count unchanged since; any growth of the
  upstream's count answers it. The connection is stalled once ``asked`` is
  ``--stall-timeout`` old.

What that means in time: ``asked`` is never before the client's bytes (a sample sees
them after they were sent), so a stall is never found before the upstream has been
silent for the whole stall timeout, and at most one sample period after it. A sample
that sees both counts grow cannot tell their order and counts the client's bytes as
answered: on a new HTTP/2 connection the server's SETTINGS, WINDOW_UPDATE and SETTINGS
ACK frames follow the client's first request within a millisecond, so a request sent
with the connection preface is answered by them as far as the counters can tell; the
client's next bytes on that connection (its next request, or the RST_STREAM of the
first one when it times out) start the clock. A new connection whose ClientHello gets
no byte back at all (a frozen server still accepts TCP) is asked from its first sample.
"""

from __future__ import annotations

# A stall-triggered check's results (extractedprism_stall_checks_total{result}, the
# ``stall_checks`` of /upstreams): its check failed (TCP or readyz) or passed.
STALL_FAILED, STALL_PASSED = STALL_CHECK_RESULTS = ("failed", "passed")


class Activity:
    """One live connection's sampled byte counts, on the registry clock.

    ``attached`` is the first sample that saw the connection and ``active`` the first
    that saw a count move (age and quiet time err short by at most one sample period,
    never long). ``asked``: see the module docstring (None: nothing unanswered).
    ``stalled``: counted as a stall (once per unanswered stretch); ``checked``: a
    stall-triggered check has covered it (one check per stretch)."""

    __slots__ = ("active", "answered_up", "asked", "attached", "checked", "down", "stalled",
                 "up")

    def __init__(self, now: float, up: int, down: int) -> None:
        self.attached = now
        self.active = now
        self.up = up
        self.down = down
        self.answered_up = up if down else 0
        self.asked: float | None = now if up and not down else None
        self.stalled = False
        self.checked = False

    def sample(self, now: float, up: int, down: int) -> None:
        """One reading of the pipe's live counters."""
        if up == self.up and down == self.down:
            return  # the common case: nothing moved
        self.active = now
        if down != self.down:
            # The upstream sent something: whatever the client sent before (or in the
            # same sample period) is answered.
            self.answered_up = up
            self.asked = None
            self.stalled = self.checked = False
        elif up > self.answered_up and self.asked is None:
            self.asked = now
        self.up, self.down = up, down

    def stalled_for(self, now: float) -> float:
        """How long the client's bytes have gone unanswered (0: nothing unanswered)."""
        return 0.0 if self.asked is None else now - self.asked

    def is_stalled(self, now: float, timeout: float) -> bool:
        """Stalled: unanswered for at least ``timeout`` (``--stall-timeout``; 0: off)."""
        return timeout > 0 and self.asked is not None and now - self.asked >= timeout
