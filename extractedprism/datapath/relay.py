"""The relay strategy: how this process copies bytes, resolved once from ``--relay``.

``resolve`` turns the flag's value (``auto``/``native``/``python``, the choices in
config.table.RELAYS) into a :class:`Relay`; cli.py calls it before anything starts (an
unusable ``--relay=native`` exits 2 there) and hands the result to App -> Proxy. The data
path asks the object (``relay.native``, ``relay.first_answer``, ``relay.take_first``),
never the flag's string. Whether the extension loaded is native.py's to say.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from extractedprism.datapath import native as native_ext
from extractedprism.errors import Error

TakeFirst = Callable[[int, int], tuple[bytes | None, int]]
# _relay.first_answer(client_fd, upstream_fd, timeout_ms, first, sent) -> (found, first)
NativeFirstAnswer = Callable[[int, int, int, bytes | None, int], tuple[int, bytes]]
# What a wait for the first answer found (first_answer.py; the same values as _relay.c's).
SILENT = 0  # nothing within the delay: the ClientHello may be hedged
ANSWERED = 1  # answered or closed, or nothing to judge: relay
LEFT = 2  # the client closed or reset during the wait: close every attempt


class RelayUnavailable(Error, RuntimeError):
    """--relay=native, but the extension cannot be loaded (the message says why)."""


@dataclass(frozen=True)
class Relay:
    """The byte copy every connection of this process uses.

    native: the extension's blocking splice loop (pipe.py), which also judges the
    upstream's first answer itself and dials with the extension's connect (dialer.py);
    else the pure-Python poll loop. ``first_answer`` and ``take_first`` are the
    extension's calls for the native relay, None for the Python one.
    """

    native: bool
    first_answer: NativeFirstAnswer | None = None
    take_first: TakeFirst | None = None

    @property
    def name(self) -> str:
        """"native" or "python": the start line, /upstreams and build_info say it."""
        return "native" if self.native else "python"


PYTHON = Relay(native=False)


def resolve(wanted: str) -> Relay:
    """``auto``/``native``/``python`` -> the relay this process will use; raises
    RelayUnavailable for ``native`` when the extension cannot be loaded."""
    if wanted == "python":
        return PYTHON
    ext = native_ext.EXTENSION
    if ext is not None:
        return Relay(native=True, first_answer=ext.first_answer, take_first=ext.take_first)
    if wanted == "native":
        raise RelayUnavailable("the native relay (extractedprism.datapath._relay) cannot be "
                               f"loaded: {native_ext.ERROR}")
    return PYTHON
