"""SIGUSR1's dump groups threads with identical stacks under one header."""

from __future__ import annotations

import threading

from extractedprism.logs.threaddump import grouped_dump
from tests.util import wait_until


class Parked:
    def __init__(self) -> None:
        self.go = threading.Event()

    def park(self) -> None:
        self.go.wait(30)


def test_identical_stacks_are_one_group_with_the_stack_written_once():
    p = Parked()
    threads = [threading.Thread(name=f"pipe-idle-{i}", target=p.park) for i in range(12)]
    other = threading.Thread(name="odd-one", target=p.park)
    for t in [*threads, other]:
        t.start()
    try:
        wait_until(lambda: grouped_dump(threads=[*threads, other])[2] == 1, 10,
                   message="all 13 threads parked in the same frame")
        text, n, groups = grouped_dump(threads=threads)
        assert (n, groups) == (12, 1)
        assert "--- 12 threads: pipe-idle-* parked in " in text
        assert text.count("self.go.wait(30)") == 1
        text, n, groups = grouped_dump(threads=[*threads, other])
        # Mixed names: the common prefix says nothing, so a small group lists them.
        assert "--- 13 threads: * parked in " in text
        assert text.count("self.go.wait(30)") == 1
    finally:
        p.go.set()
        for t in [*threads, other]:
            t.join()


def test_distinct_stacks_are_distinct_groups():
    p = Parked()
    t = threading.Thread(name="parked", target=p.park)
    t.start()
    try:
        wait_until(lambda: "self.go.wait(30)" in grouped_dump(threads=[t])[0], 10)
        text, n, groups = grouped_dump(threads=[t, threading.current_thread()])
        assert (n, groups) == (2, 2)
        assert "--- 1 thread: parked parked in " in text
        assert "--- 1 thread: MainThread in grouped_dump" in text  # running, not parked
    finally:
        p.go.set()
        t.join()
