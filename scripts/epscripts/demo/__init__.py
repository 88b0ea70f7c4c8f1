"""scripts/demo (cli.py) and its upstream processes (upstream.py)."""

from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGTERM this process when its parent (the demo) dies, even by SIGKILL, so nothing
    the demo started outlives it. Linux only; elsewhere a no-op."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
