"""--gil-cpu: the acceptor and pipe threads run Python on one CPU; a busy connection's
relay is let out to every CPU and pinned back when it ends (sched.py, _relay.c)."""

from __future__ import annotations

import os
import threading

import pytest

from extractedprism.config.table import FLAGS, ConfigError, allowed_cpus, validate
from extractedprism.datapath import sched
from tests.fakes.upstream import EchoServer
from tests.net.test_proxy import relay_app
from tests.util import connect, wait_until

ALLOWED = allowed_cpus() or set()
needs_two = pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two CPUs to pin to one")
UNPIN_AFTER = 16  # _relay.UNPIN_AFTER_WAKEUPS, restated so a change to it is noticed


def affinity(thread: threading.Thread) -> set[int]:
    assert thread.native_id is not None
    return set(os.sched_getaffinity(thread.native_id))


def threads(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def raw_values(**values: str) -> dict[str, str | None]:
    out: dict[str, str | None] = {f.dest: None for f in FLAGS}
    out.update(endpoints="127.0.0.1:6443", **values)
    return out


@pytest.mark.parametrize("value", ["auto", "off", str(min(ALLOWED or {0}))])
def test_valid_values(value: str) -> None:
    assert validate(raw_values(gil_cpu=value)).gil_cpu == value


@pytest.mark.parametrize("value", ["-1", "one", "1.5", "", "100000", "AUTO"])
def test_bad_values_name_the_flag(value: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate(raw_values(gil_cpu=value))
    assert "--gil-cpu" in str(err.value)
    assert "must be auto, off, or a CPU this process may run on" in str(err.value)


def test_plan() -> None:
    assert sched.gil_cpu_plan("off") is None
    if len(ALLOWED) < 2:
        assert sched.gil_cpu_plan("auto") is None  # nothing to gain on one CPU
        return
    assert sched.gil_cpu_plan("auto") == (max(ALLOWED), ALLOWED)
    assert sched.gil_cpu_plan(str(min(ALLOWED))) == (min(ALLOWED), ALLOWED)


def round_trips(sock, n: int) -> None:  # type: ignore[no-untyped-def]
    for i in range(n):
        sock.sendall(b"x%d\n" % i)
        got = b""
        while not got.endswith(b"\n"):
            chunk = sock.recv(64)
            assert chunk
            got += chunk


@needs_two
@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", ["native", "python"])
def test_threads_are_pinned_and_a_busy_native_relay_is_let_out(make_app, servers,
                                                               monkeypatch, path) -> None:
    cpu = min(ALLOWED)  # not auto's choice, so the test shows the flag is followed
    (echo,) = servers(1, EchoServer)
    app = relay_app(make_app, monkeypatch, path, [echo.endpoint], gil_cpu=str(cpu))
    assert app.proxy.gil_cpu == cpu
    (acceptor,) = threads("acceptor")
    assert affinity(acceptor) == {cpu}

    with connect(app) as short:
        round_trips(short, 2)  # a few relay wake-ups: stays on the GIL's CPU
        (t,) = wait_until(lambda: threads("pipe-127.0.0.1"), timeout=5)
        assert affinity(t) == {cpu}
    # Parked once its client left (threads start on demand): still on the GIL's CPU.
    idle = wait_until(lambda: threads("pipe-idle-"), timeout=5)
    assert all(affinity(t) == {cpu} for t in idle)
    with connect(app) as busy:
        round_trips(busy, 2 * UNPIN_AFTER)
        (t,) = wait_until(lambda: threads("pipe-127.0.0.1"), timeout=5)
        # The native relay moves the bytes without the GIL: let out to every CPU. The
        # Python loop needs the GIL for every byte: it stays.
        assert affinity(t) == (ALLOWED if path == "native" else {cpu})
    # Ended: pinned back before the thread runs Python again (parked, renamed idle).
    wait_until(lambda: t.name.startswith("pipe-idle-"), timeout=5)
    assert affinity(t) == {cpu}


@needs_two
@pytest.mark.timeout(30)
def test_off_pins_nothing(make_app, servers) -> None:
    (echo,) = servers(1, EchoServer)
    app = make_app([echo.endpoint], gil_cpu="off")
    assert app.proxy.gil_cpu is None
    with connect(app) as s:
        round_trips(s, 2 * UNPIN_AFTER)
        (t,) = wait_until(lambda: threads("pipe-127.0.0.1"), timeout=5)
        assert affinity(t) == ALLOWED
    (acceptor,) = threads("acceptor")
    assert affinity(acceptor) == ALLOWED


def test_the_extension_says_when_it_lets_out() -> None:
    relay = pytest.importorskip("extractedprism.datapath._relay")
    assert relay.UNPIN_AFTER_WAKEUPS == UNPIN_AFTER


def test_a_refused_pin_is_logged_once_and_harmless(monkeypatch, caplog) -> None:
    def refuse(*_args: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    # A refused scheduling policy earlier must not hide this one's warning.
    monkeypatch.setattr(sched, "_warned", {"policy"})
    monkeypatch.setattr(os, "sched_setaffinity", refuse)
    assert sched.pin_current_thread(0) is False
    assert sched.pin_current_thread(0) is False
    warnings = [r for r in caplog.records if "pin thread" in r.getMessage()]
    assert len(warnings) == 1
    assert "not permitted" in warnings[0].getMessage()
