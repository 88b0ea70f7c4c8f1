"""The C extension (``_relay.c``), loaded once for the whole process.

The one place that decides whether the native relay exists: ``EXTENSION`` is the loaded
module, or None with ``ERROR`` saying why (kept for ``--relay=native``'s exit message).
The extension is optional (``pip install .`` builds it where a compiler is available),
and useless without splice(), which every one of its relay calls is built on.
relay.py turns this into the process's relay strategy; pipe.py and sockopts.py take the
extension's calls from here.
"""

from __future__ import annotations

import os
from types import ModuleType

# The platform's splice(): the native relay and the Python loop's splice copy need it.
HAVE_SPLICE = hasattr(os, "splice") and hasattr(os, "pipe2")


def _load() -> tuple[ModuleType | None, str]:
    try:
        from extractedprism.datapath import _relay  # type: ignore[attr-defined]
    except ImportError as exc:
        return None, str(exc) or type(exc).__name__
    if not HAVE_SPLICE:
        return None, "this platform has no splice()"
    return _relay, ""


EXTENSION, ERROR = _load()
