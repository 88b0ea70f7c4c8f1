"""Linux scheduling policy for the data-path threads (acceptor and pipe threads).

# why SCHED_BATCH
Every pipe thread needs CPython's GIL for the few microseconds it runs Python after
``poll`` wakes it. Under SCHED_OTHER the kernel lets a freshly woken thread preempt the
running one; when the running one is a pipe thread holding the GIL, the woken thread
runs only to find the GIL taken, sleeps on it, and the holder is switched back in:
two futile context switches per wake-up. SCHED_BATCH threads never preempt on wake-up
(the kernel skips wake-up preemption for them), so the holder finishes its few
microseconds, blocks in ``poll`` and hands the CPU *and* the GIL over in one switch.
Measured with 64 keep-alive connections: context switches per request 13 -> 2.5-3,
proxy CPU per request 134 -> 35-60 us, requests/s 1.5-2.5x (docs/performance.md).

SCHED_BATCH keeps nice 0 and the thread's fair share of CPU; it only gives up the
right to cut in line on wake-up, which costs at most one scheduler tick of latency
when every CPU is busy. Setting it needs no privilege. ``--pipe-sched normal``
keeps the default policy.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

POLICIES = ("batch", "normal")

_warned = False


def policy_number(name: str) -> int | None:
    """The os.SCHED_* constant for a --pipe-sched value (None where unsupported)."""
    if name == "batch":
        return getattr(os, "SCHED_BATCH", None)
    return getattr(os, "SCHED_OTHER", None)


def apply_to_current_thread(name: str) -> bool:
    """Give the calling thread the policy ``name``; False (logged once) if refused.

    A refused policy (a seccomp profile, a platform without it) changes performance
    only, so the thread carries on with the default policy.
    """
    global _warned
    number = policy_number(name)
    if number is None or not hasattr(os, "sched_setscheduler"):
        return False
    try:
        if os.sched_getscheduler(0) != number:
            os.sched_setscheduler(0, number, os.sched_param(0))
    except OSError as exc:
        if not _warned:
            _warned = True
            log.warning("could not set thread scheduling policy policy=%s reason=%r; "
                        "keeping the default", name, exc.strerror)
        return False
    return True
