"""SIGUSR1's thread dump: threads with identical stacks grouped, as one text block.

A goroutine-style dump of a busy proxy, hundreds of pipe threads relaying in the same
place, is mostly repetition; grouped it is a dozen stacks, each under a header such as
``400 threads: pipe-* in run_judged (datapath/pipe.py:257)`` naming the innermost
frame of this package (where the thread *is*, rather than the ``threading`` wait it
sits in). The caller logs the block as one record, so a log collector keeps it whole.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import traceback
from types import FrameType

MAX_NAMES = 12  # a group this small lists its threads by name


def _pattern(names: list[str]) -> str:
    """One name, or the names' common prefix and ``*`` (``pipe-idle-*``)."""
    if len(set(names)) == 1:
        return names[0]
    first, last = min(names), max(names)  # the common prefix of all is theirs
    n = 0
    while n < min(len(first), len(last)) and first[n] == last[n]:
        n += 1
    return first[:n] + "*"


# A thread whose innermost frame is in one of these modules, or calls one of these
# blocking calls, waits for something (a lock, an event, a queue, a socket): parked.
_WAITING_MODULES = ("threading.py", "queue.py", "selectors.py")
_WAITING_CALL = re.compile(r"\b(acquire|wait|get|poll|select|accept|_accept|recv|recv_into"
                           r"|sleep)\(")


def _where(stack: traceback.StackSummary) -> str:
    if not stack:
        return "(no Python frame)"
    ours = [fs for fs in stack if f"{os.sep}extractedprism{os.sep}" in fs.filename]
    fs = (ours or list(stack))[-1]
    parts = fs.filename.split(os.sep)
    short = os.sep.join(parts[-2:]) if len(parts) > 1 else fs.filename
    inner = stack[-1]
    parked = (inner.filename.endswith(_WAITING_MODULES)
              or bool(_WAITING_CALL.search(inner.line or "")))
    return f"{'parked in' if parked else 'in'} {fs.name} ({short}:{fs.lineno})"


def grouped_dump(frames: dict[int, FrameType] | None = None,
                 threads: list[threading.Thread] | None = None) -> tuple[str, int, int]:
    """(dump text, number of threads, number of groups)."""
    frames = sys._current_frames() if frames is None else frames
    threads = threading.enumerate() if threads is None else threads
    groups: dict[tuple[tuple[str, int | None, str], ...],
                 tuple[traceback.StackSummary, list[str]]] = {}
    for t in threads:
        frame = frames.get(t.ident or -1)
        stack = traceback.extract_stack(frame) if frame is not None else \
            traceback.StackSummary()
        key = tuple((fs.filename, fs.lineno, fs.name) for fs in stack)
        groups.setdefault(key, (stack, []))[1].append(t.name)
    ordered = sorted(groups.values(), key=lambda g: (-len(g[1]), sorted(g[1])[0]))
    lines = [f"=== extractedprism thread dump: {len(threads)} threads, "
             f"{len(ordered)} distinct stacks"]
    for stack, names in ordered:
        names.sort()
        n = len(names)
        lines.append(f"--- {n} thread{'s' if n != 1 else ''}: {_pattern(names)} "
                     f"{_where(stack)}")
        if 1 < n <= MAX_NAMES and len(set(names)) > 1:
            lines.append(f"    threads: {', '.join(names)}")
        for entry in traceback.format_list(stack):
            lines.extend("    " + line for line in entry.rstrip("\n").split("\n"))
    return "\n".join(lines), len(threads), len(ordered)
