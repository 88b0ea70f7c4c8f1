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

from extractedprism.config.table import allowed_cpus

log = logging.getLogger(__name__)

_warned: set[str] = set()  # what was refused already: one warning each, per process


def _refused(what: str, template: str, *args: object) -> bool:
    """Log a refused thread setting once per kind; False, for the caller to return."""
    if what not in _warned:
        _warned.add(what)
        log.warning(template, *args)
    return False


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
    number = policy_number(name)
    if number is None or not hasattr(os, "sched_setscheduler"):
        return False
    try:
        if os.sched_getscheduler(0) != number:
            os.sched_setscheduler(0, number, os.sched_param(0))
    except OSError as exc:
        return _refused("policy", "could not set thread scheduling policy policy=%s "
                        "reason=%r; keeping the default", name, exc.strerror)
    return True


# -- one CPU for the threads that run Python (--gil-cpu) ----------------------------
#
# # why
# CPython runs Python on one CPU at a time, whatever the thread count. When the
# acceptor hands a client to a pipe thread parked on another CPU, or a pipe thread
# returns from the relay there, the kernel wakes that CPU with an interrupt and the GIL
# then crosses CPUs (a cold cache line, often a second wake-up when the GIL is still
# held). Kept on one CPU, each of those hand-offs is a local context switch instead.
# Measured with 64 clients opening one connection per request: context switches per
# connection 8.8 -> 3.8, new connections/s 0.34 -> 0.42 of HAProxy's in the same run
# (docs/performance.md). The bytes need no GIL, so a connection that keeps moving them
# is let out to every CPU after _relay.UNPIN_AFTER_WAKEUPS relay wake-ups (_relay.c; the
# pure-Python relay, being GIL-bound, stays): without that, 64 keep-alive connections
# on one CPU took keep-alive p99 from 4.8 ms to 87 ms.


def gil_cpu_plan(value: str) -> tuple[int, set[int]] | None:
    """--gil-cpu -> (the CPU for the Python threads, every allowed CPU), or None: off,
    or nothing to gain (a single allowed CPU, or no affinity support). ``auto`` takes the
    highest allowed CPU: CPU 0 is where many kernels steer housekeeping and interrupts."""
    allowed = allowed_cpus()
    if value == "off" or allowed is None or len(allowed) < 2:
        return None
    cpu = max(allowed) if value == "auto" else int(value)
    return (cpu, allowed) if cpu in allowed else None


def pin_current_thread(cpu: int) -> bool:
    """Keep the calling thread on ``cpu``; False (logged once) if refused."""
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError as exc:
        return _refused("affinity", "could not pin thread to a CPU cpu=%d reason=%r; "
                        "leaving it unpinned", cpu, exc.strerror)
    return True
