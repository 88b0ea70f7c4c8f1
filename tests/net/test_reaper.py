"""offpath.Reaper (issue 29, item 11): an unexpected failure inside the reaper's loop
must not leave it marked running, or every socket parked later is never handled."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from extractedprism.datapath import offpath
from tests.util import wait_until


class Item:
    """A parked socket that records how it ended."""

    events = offpath.select.POLLIN

    def __init__(self, sock: socket.socket, deadline: object) -> None:
        self.sock: socket.socket | None = sock
        self.deadline = deadline
        self.ended = threading.Event()
        self.how = ""

    def finish(self, ready: bool) -> None:
        assert self.sock is not None
        self.sock.close()
        self.sock = None
        self.how = "ready" if ready else "deadline"
        self.ended.set()

    def drop(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self.how = "dropped"
        self.ended.set()


@pytest.mark.timeout(30)
def test_a_failure_inside_the_loop_does_not_strand_later_sockets():
    reaper = offpath.Reaper("dial-test-reaper")
    pairs = [socket.socketpair() for _ in range(2)]
    try:
        # A deadline that cannot be compared: the loop's own arithmetic raises.
        bad = Item(pairs[0][0], "not a time")
        reaper.adopt(bad)
        wait_until(bad.ended.is_set, 5, message="the bad item dropped")
        assert bad.how == "dropped"
        good = Item(pairs[1][0], time.monotonic() + 10)
        reaper.adopt(good)
        pairs[1][1].send(b"x")  # ready: the reaper must see it
        wait_until(good.ended.is_set, 5, message="a later parked socket handled")
        assert good.how == "ready"
    finally:
        assert reaper.stop(time.monotonic() + 5)
        for a, b in pairs:
            a.close()
            b.close()
