"""Shared fixtures: in-process App factory, upstream servers, thread- and fd-leak guards."""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import trustme

from extractedprism.app import App
from extractedprism.config.endpoints import Endpoint
from extractedprism.config.table import Config
from tests.fakes.answering import Fake
from tests.fakes.fake_apiserver import FakeApiServer
from tests.fakes.upstream import EchoServer, IdentityServer

PRODUCT_THREAD_PREFIXES = ("acceptor", "ticker", "pipe-", "probe-", "watcher", "heartbeat",
                           "log-writer", "handover", "state-file",
                           "health-http", "admin-", "dial-", "conn-sampler")


def _product_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(PRODUCT_THREAD_PREFIXES)}


@pytest.fixture(autouse=True)
def no_leaked_product_threads() -> Iterator[None]:
    """Fail a test whose product threads (acceptor, pipes, probes, ...) outlive it."""
    before = _product_threads()
    yield
    deadline = time.monotonic() + 5.0
    leaked = _product_threads() - before
    while leaked and time.monotonic() < deadline:
        time.sleep(0.05)
        leaked = {t for t in leaked if t.is_alive()}
    assert not leaked, f"threads outlived the test: {sorted(t.name for t in leaked)}"


def _open_fds() -> dict[int, str]:
    """This process's descriptors and what each refers to (socket:[inode], pipe:[...])."""
    out: dict[int, str] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the listing's own descriptor, or one closed meanwhile
            pass
    return out


def _describe_sockets(fds: dict[int, str]) -> str:
    """Local and remote address of each leaked TCP socket, to tell whose it is."""
    inodes = {what[8:-1] for what in fds.values() if what.startswith("socket:[")}
    found = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6", "/proc/self/net/udp",
                  "/proc/self/net/udp6", "/proc/self/net/unix"):
        try:
            with open(table) as fh:
                lines = fh.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if table.endswith("unix") and len(f) > 6 and f[6] in inodes:
                found.append(f"unix {' '.join(f[7:]) or '(unnamed)'}")
            elif len(f) > 9 and f[9] in inodes:
                found.append(f"{table.rsplit('/', 1)[1]} {f[1]}->{f[2]} st={f[3]}")
    return f" ({', '.join(found)})" if found else ""


def _new_fds(before: dict[int, str]) -> dict[int, str]:
    return {fd: what for fd, what in _open_fds().items() if before.get(fd) != what}


@pytest.fixture(autouse=True)
def no_leaked_fds(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test whose file descriptors (sockets, kernel pipes, files) outlive it."""
    tolerated = request.node.get_closest_marker("fd_leak_ok")
    before = _open_fds()
    yield
    deadline = time.monotonic() + 5.0
    leaked = _new_fds(before)
    while leaked and time.monotonic() < deadline:  # threads that are ending close theirs
        time.sleep(0.05)
        leaked = _new_fds(before)
    if leaked:
        # Still open: held only by a reference cycle (an exception's traceback), say?
        # The collector closes those, so they are not leaks; report what it leaves. (Its
        # ResourceWarning is not an error: pyproject's filterwarnings.)
        gc.collect()
        leaked = _new_fds(before)
    if leaked and tolerated is not None:
        logging.getLogger(__name__).warning(
            "tolerated leftover descriptors (%s): %s%s", tolerated.args[0],
            sorted(leaked.values()), _describe_sockets(leaked))
        return
    assert not leaked, (f"file descriptors outlived the test: {sorted(leaked.values())}"
                        f"{_describe_sockets(leaked)}")


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    """A fake Kubernetes API server (HTTPS, list/watch of EndpointSlices) for one test."""
    with FakeApiServer() as server:
        yield server


def fast_config(endpoints: list[Endpoint] | tuple[Endpoint, ...], **overrides: object) -> Config:
    """A Config on ephemeral ports with short timings, for in-process tests."""
    base: dict[str, object] = dict(
        endpoints=tuple(endpoints),
        bind_port=0,
        health_port=0,
        enable_discovery=False,
        health_interval=0.3,
        health_timeout=0.2,
        liveness_interval=0.2,
        liveness_threshold=1.0,
        drain_timeout=1.0,
    )
    base.update(overrides)
    # Flags whose unset value is another flag's (same_as rows) follow it here as validate()
    # would; Config's own field default is the source flag's *default*.
    base.setdefault("health_recheck", base["health_interval"])
    base.setdefault("unready_drain_timeout", base["drain_timeout"])
    return Config(**base)  # type: ignore[arg-type]


@pytest.fixture
def make_app() -> Iterator[Callable[..., App]]:
    apps: list[App] = []

    def factory(endpoints: list[Endpoint], *, prober: object = None, **overrides: object
                ) -> App:
        extra = {"prober": prober} if prober is not None else {}
        app = App(fast_config(endpoints, **overrides), **extra)  # type: ignore[arg-type]
        app.start()
        apps.append(app)
        return app

    yield factory
    for app in apps:
        app.stop()


@pytest.fixture
def servers() -> Iterator[Callable[..., list[IdentityServer]]]:
    made: list[EchoServer] = []

    def factory(n: int = 3, kind: type[EchoServer] = IdentityServer) -> list[IdentityServer]:
        out = [kind(name=f"up{i}").start() for i in range(n)]
        made.extend(out)
        return out  # type: ignore[return-value]

    yield factory
    for s in made:
        s.stop()


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    """A run-time CA that signs the fake upstreams' serving certificates (one a module)."""
    return trustme.CA()


@pytest.fixture
def fakes() -> Iterator[Callable[..., Fake]]:
    made: list[Fake] = []

    def factory(*args, **kwargs) -> Fake:  # type: ignore[no-untyped-def]
        f = Fake(*args, **kwargs)
        made.append(f)
        return f

    yield factory
    for f in made:
        f.close()
