"""Pure parts of the operator's view: RFC 3339 times and the dial-time buckets."""

from __future__ import annotations

import re
from datetime import datetime

from hypothesis import given
from hypothesis import strategies as st

from extractedprism.discovery.status import DiscoveryStatus
from extractedprism.health.document import discovery_entry, rfc3339
from extractedprism.upstreams.dialstats import BUCKETS, DialHistogram


def test_rfc3339_has_milliseconds_and_an_offset() -> None:
    text = rfc3339(1796150755.1489)
    assert text is not None
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.148[+-]\d\d:\d\d", text), text
    assert abs(datetime.fromisoformat(text).timestamp() - 1796150755.148) < 1e-6
    assert rfc3339(None) is None


@given(st.lists(st.floats(min_value=0, max_value=100, allow_nan=False), max_size=50))
def test_histogram_counts_are_cumulative_and_complete(values: list[float]) -> None:
    h = DialHistogram()
    for v in values:
        h.observe(v)
    frozen = h.frozen()
    cum = frozen.cumulative()
    assert [b for b, _ in cum] == [*BUCKETS, float("inf")]
    assert cum[-1][1] == len(values) == frozen.count
    for bound, n in cum:
        assert n == sum(1 for v in values if v <= bound)
    assert abs(frozen.total - sum(values)) < 1e-6


def test_discovery_entry() -> None:
    assert discovery_entry(None) == {"enabled": False}
    status = DiscoveryStatus(clock=lambda: 1796150755.0)
    assert discovery_entry(status.view()) == {"enabled": True, "connected": False,
                                              "last_event": None, "last_error": None}
    status.watch_opened()
    status.event()
    status.error("watch failed: HTTP 500")
    d = discovery_entry(status.view())
    assert d["connected"] is True and d["last_error"] == "watch failed: HTTP 500"
    assert datetime.fromisoformat(d["last_event"]).timestamp() == 1796150755.0
