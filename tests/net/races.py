"""The drain race, made to happen: the registry's attach (and attach_judging) wrapped so
that the first connection to attach finds its upstream gone (what discovery does when it
removes an API server while a client's connection is being dialed)."""

from __future__ import annotations

from collections.abc import Callable

import pytest


def drain_race(monkeypatch: pytest.MonkeyPatch, app,  # type: ignore[no-untyped-def]
               remove: Callable[[str], None]) -> list[str]:
    """On the first attach, ``remove(address)`` runs before the real attach; returns the
    list the raced address is appended to."""
    raced: list[str] = []
    conns = app.registry.conns
    for name in ("attach", "attach_judging"):
        real = getattr(conns, name)

        def racing(res, conn, _real=real):  # type: ignore[no-untyped-def]
            if not raced and hasattr(res, "address"):
                raced.append(res.address)
                remove(res.address)
            return _real(res, conn)

        monkeypatch.setattr(conns, name, racing)
    return raced
