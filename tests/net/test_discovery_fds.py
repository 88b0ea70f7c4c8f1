"""Discovery on a busy node: the watcher keeps working with more than 1,024 descriptors
open in its process (select.select() refuses any descriptor >= FD_SETSIZE, 1024)."""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.fake_apiserver import FakeApiServer, make_slice
from tests.net.test_watch import Harness
from tests.util import wait_until

pytestmark = pytest.mark.timeout(60)

# More than FD_SETSIZE (1024), so every socket the watcher opens lands above it.
HOG = 1100


def raise_fd_limit(need: int) -> None:
    """Raise the soft RLIMIT_NOFILE to at least ``need`` (skip when the hard limit is
    lower: the test then cannot build its busy node)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {need}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


@pytest.fixture
def busy_fds() -> Iterator[list[int]]:
    """``HOG`` descriptors held open, so the next ones the process opens are >= 1024."""
    raise_fd_limit(HOG + 1024)
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(HOG)]
    try:
        assert max(fds) >= 1024
        yield fds
    finally:
        for fd in fds:
            os.close(fd)


def test_the_watcher_keeps_its_connection_with_descriptors_above_1024(
        busy_fds: list[int], tmp_path: Path) -> None:
    """The list, then watches on the same kept-alive connection (each reuse checks the
    idle connection): no discovery error, every watch opened on the first try."""
    with FakeApiServer() as api:
        api.set_slice(make_slice("kubernetes", ["10.0.0.1"]))
        sa = api.write_service_account(tmp_path / "sa")
        h = Harness(api, sa)
        h.provider.start()
        try:
            h.wait_watches(1)
            for n in (2, 3):
                h.clock.advance(31)  # a long watch: re-opened at once, on the kept connection
                api.close_streams()
                h.wait_watches(n)
            api.set_slice(make_slice("kubernetes", ["10.0.0.1", "10.0.0.2"]))
            wait_until(lambda: [str(e) for e in h.updates[-1]] == [
                "10.0.0.1:6443", "10.0.0.2:6443"], 10, message="the watch applies events")
            assert h.errored == []
            assert h.kinds() == ["L", "W", "W", "W"]
            assert h.sleeps == []
        finally:
            assert h.provider.stop_and_join(5)
