"""Handover in one process: two Apps on one handover socket, and the protocol's edges
(a successor that takes nothing, a path that is not a socket)."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import pytest

from extractedprism.ops import handover
from tests.util import http, wait_until

pytestmark = pytest.mark.timeout(60)


def _greets(address: tuple[str, int], name: bytes) -> bool:
    with socket.create_connection(address, timeout=5) as c:
        c.settimeout(5)
        return c.recv(len(name)) == name


def test_successor_takes_both_listeners_and_offers_next(make_app, servers, tmp_path: Path):
    (up,) = servers(1)
    path = str(tmp_path / "ho.sock")
    old = make_app([up.endpoint], handover_socket=path)
    assert _greets(old.proxy_address, b"up0\n")
    new = make_app([up.endpoint], handover_socket=path)
    # The same sockets: the same addresses, without a bind (the ports are in use).
    assert new.proxy_address == old.proxy_address
    assert new.health_address == old.health_address
    # The contract: the old one stops accepting within 1 s of handing over.
    wait_until(lambda: not old.proxy.acceptor_alive(), 1.0, message="the old one stops")
    assert old.proxy.handed_over
    before = new.registry.snapshot().get(str(up.endpoint)).total_connections
    for _ in range(5):
        assert _greets(old.proxy_address, b"up0\n")
    assert new.registry.snapshot().get(str(up.endpoint)).total_connections == before + 5
    assert http(new.health_address, "/healthz")[0] == 200
    # The old one's shutdown leaves the shared sockets alone.
    old.stop()
    assert _greets(new.proxy_address, b"up0\n")
    assert http(new.health_address, "/healthz")[0] == 200
    # The successor offers on the path now: a third instance takes over from it.
    third = make_app([up.endpoint], handover_socket=path)
    wait_until(lambda: new.proxy.handed_over, 5, message="the second hands over")
    assert _greets(third.proxy_address, b"up0\n")


def test_a_successor_that_takes_nothing_changes_nothing(make_app, servers, tmp_path: Path):
    (up,) = servers(1)
    path = str(tmp_path / "ho.sock")
    app = make_app([up.endpoint], handover_socket=path)
    for _ in range(2):  # and it is offered again, as often as asked
        received = handover.receive(path)
        assert received is not None and set(received.sockets) == {"proxy", "health"}
        received.abort()  # e.g. the successor failed to start
        assert _greets(app.proxy_address, b"up0\n")
        assert app.proxy.acceptor_alive() and not app.proxy.handed_over
    assert http(app.health_address, "/healthz")[0] == 200


def test_a_path_that_is_not_a_socket_is_left_alone(make_app, servers, tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture):
    (up,) = servers(1)
    path = tmp_path / "ho.sock"
    path.write_text("an operator's file")
    caplog.set_level(logging.WARNING)
    app = make_app([up.endpoint], handover_socket=str(path))
    assert _greets(app.proxy_address, b"up0\n")
    assert path.read_text() == "an operator's file"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("not a unix socket" in m for m in warnings), warnings


def test_offer_socket_is_0600(make_app, servers, tmp_path: Path):
    (up,) = servers(1)
    path = tmp_path / "ho.sock"
    old_umask = os.umask(0)
    try:
        make_app([up.endpoint], handover_socket=str(path))
    finally:
        os.umask(old_umask)
    assert (path.stat().st_mode & 0o777) == 0o600
