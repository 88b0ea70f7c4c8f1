"""The data path's first-bytes defects of issue 22: a scoped IPv6 endpoint (defect 5), no
reservation leaked whatever raises on the way to the relay (defect 5), and the client's
first bytes counted in upstream_bytes_total{direction="up"} on every path (defect 6)."""

from __future__ import annotations

import socket

import pytest

from extractedprism.config.endpoints import Endpoint
from extractedprism.datapath import dialer as dialer_mod
from extractedprism.datapath import first_answer
from extractedprism.datapath.pipe import Pipe
from tests.fakes.answering import hello
from tests.fakes.upstream import EchoServer
from tests.net.test_silent_upstream import PROBES_OFF, _active, _dialing
from tests.util import free_port, wait_until

RELAYS = ["native", "python"]


def _round_trip(app, msg: bytes) -> bytes:  # type: ignore[no-untyped-def]
    """Send ``msg`` and read until it is echoed or the proxy closes: what came back."""
    with socket.create_connection(app.proxy_address, timeout=10) as c:
        c.sendall(msg)
        got = b""
        while len(got) < len(msg):
            try:
                chunk = c.recv(len(msg) - len(got))
            except ConnectionResetError:
                break
            if not chunk:
                break
            got += chunk
    return got


def _errors(app, addr: str) -> float:  # type: ignore[no-untyped-def]
    return app.metrics.registry.get_sample_value(
        "extractedprism_connection_errors_total", {"upstream": addr}) or 0.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("relay", RELAYS)
def test_scoped_ipv6_endpoint_is_dialed_counted_and_failed_over(make_app, servers, relay):
    """``[fe80::1%lo]:port``: the native connect cannot take a scope id, so such an
    endpoint goes to the stdlib's dial. Link-local on lo has no route (EINVAL at connect,
    no packet leaves): each failed dial is counted and the client moves on."""
    (good,) = servers(1, EchoServer)
    scoped = Endpoint("fe80::1%lo", free_port())
    assert str(scoped).startswith("[fe80::1%lo]:")
    app = make_app([scoped, good.endpoint], health_interval=PROBES_OFF, health_timeout=1.0,
                   relay=relay)
    for i in range(20):
        msg = b"scoped %d\n" % i
        assert _round_trip(app, msg) == msg
    assert _errors(app, str(scoped)) >= 1
    wait_until(lambda: _dialing(app) == 0, 5, message="no reservation left")


def _steps(relay: str) -> list[str]:
    """Each step between accept and relay, where an exception is injected."""
    if relay == "native":
        return ["dialer.native_target", "dialer.native_connect", "Pipe.__init__",
                "Pipe.can_judge", "conns.attach_judging", "Pipe.run_judged"]
    return ["dialer.begin_connect", "Pipe.__init__", "first_answer.wait_answer",
            "conns.attach", "Pipe.run"]


def _target(app, step: str) -> tuple[object, str]:  # type: ignore[no-untyped-def]
    owner, name = step.split(".")
    return {"conns": app.registry.conns, "Pipe": Pipe, "dialer": dialer_mod,
            "first_answer": first_answer, "Proxy": app.proxy}[owner], name


@pytest.mark.timeout(60)
@pytest.mark.parametrize("relay", RELAYS)
@pytest.mark.parametrize("index", range(6))
def test_an_exception_at_any_step_leaks_no_reservation(make_app, servers, relay, index,
                                                       monkeypatch):
    steps = _steps(relay)
    if index >= len(steps):
        pytest.skip(f"the {relay} relay has {len(steps)} steps")
    step = steps[index]
    a, b = servers(2, EchoServer)
    app = make_app([a.endpoint, b.endpoint], health_interval=PROBES_OFF, health_timeout=1.0,
                   relay=relay)
    owner, name = _target(app, step)
    real = getattr(owner, name)
    calls = []

    def boom(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError(f"injected at {step}")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, boom)
    # A ClientHello: the path that waits for the first answer (cleartext skips the wait).
    got = _round_trip(app, hello(b"first"))
    assert calls, f"{step} is not on this relay's path"
    assert got == b""  # that connection failed (the pipe thread logged it)
    for i in range(5):
        msg = hello(b"after %d" % i)
        assert _round_trip(app, msg) == msg
    wait_until(lambda: _dialing(app) == 0 and _active(app) == 0, 5,
               message=f"reservations and connections after an exception at {step}")


def _bytes_up(app) -> float:  # type: ignore[no-untyped-def]
    return sum(app.metrics.registry.get_sample_value(
        "extractedprism_upstream_bytes_total", {"upstream": u.address, "direction": "up"})
        or 0.0 for u in app.registry.snapshot().upstreams)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("relay", RELAYS)
@pytest.mark.parametrize("path", ["alone", "two", "hedged"])
def test_first_bytes_are_counted_on_every_path(make_app, fakes, relay, path):
    """upstream_bytes_total{direction="up"} counts the client's first bytes, whichever
    step sent them (the dial, the first answer, the hedge, the relay)."""
    good = fakes()
    eps = [good.endpoint]
    if path == "two":
        eps.append(fakes().endpoint)
    if path == "hedged":
        eps.append(fakes(read=False).endpoint)  # frozen: its connections are hedged
    app = make_app(eps, health_interval=PROBES_OFF, health_timeout=5.0,
                   answer_hedge_delay=0.2, relay=relay)
    total = 0
    for i in range(8):
        msg = hello(b"n%d" % i + b"x" * 480) if path == "hedged" else b"%03d" % i + b"y" * 497
        assert _round_trip(app, msg) == msg
        total += len(msg)
    if path == "hedged":
        assert app.metrics.registry.get_sample_value(
            "extractedprism_answer_hedges_total",
            {"upstream": good.address, "outcome": "won"}), "no connection was hedged"
    wait_until(lambda: _active(app) == 0, 5, message="connections ended")
    assert _bytes_up(app) == total

