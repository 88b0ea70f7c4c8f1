"""Fixtures shared by the loopback tests of readiness (tests/net)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import trustme

from tests.fakes.upstream import FakeUpstream


@pytest.fixture
def ups(ca: trustme.CA) -> Iterator[list[FakeUpstream]]:
    """Three TLS upstreams (up0-up2) answering /readyz, signed by the test CA. A module
    that defines its own ``ups`` fixture uses that one instead."""
    made = [FakeUpstream(ca=ca, name=f"up{i}").start() for i in range(3)]
    yield made
    for u in made:
        u.stop()
