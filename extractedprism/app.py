"""App: wires the parts, starts the threads in dependency order, shuts down in order.

Start: bind the listener and the health port first (so a port clash fails before any
thread runs), feed the static endpoints, then start discovery, the ticker, the
acceptor, the heartbeat and the health server.

Stop (spec, "Graceful shutdown"): stop discovery, shut the proxy down (close the
listener, force-close in-flight connections, wait up to 5 s for pipe threads), then
give the health server 5 s. Any thread that outlives its deadline is logged by name.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from extractedprism.config import Config
from extractedprism.endpoints import Endpoint
from extractedprism.httpd import HealthServer
from extractedprism.merge import Merger
from extractedprism.metrics import Metrics
from extractedprism.probes import ProbeResult, ReadyzSettings, ca_file_problem, probe
from extractedprism.proxy import Proxy
from extractedprism.registry import Change, Registry
from extractedprism.ticker import Ticker

if TYPE_CHECKING:
    from extractedprism.watch import KubernetesProvider

log = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 5.0


class Heartbeat:
    """Liveness: every --liveness-interval, confirm what a restart would fix: the
    registry lock can be taken, and the acceptor and the ticker make progress (checked
    by their loop counters and clocks, not only ``is_alive()``). /healthz fails when the
    last confirmation is older than --liveness-threshold. Discovery is not part of it:
    provider failures are isolated (the watcher restarts itself) and the static
    endpoints keep serving, so a restart of the pod would only cut every connection."""

    def __init__(self, app: App, *, interval: float, threshold: float, stop: threading.Event,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._app = app
        self._interval = interval
        self._threshold = threshold
        self._stop = stop
        self._clock = clock
        self.last_beat = clock()
        self.last_problem = ""
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(name="heartbeat", target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self.check()

    def check(self) -> bool:
        problem = self._app.liveness_problem(self._interval)
        if problem:
            if problem != self.last_problem:
                log.error("liveness check failed reason=%r", problem)
            self.last_problem = problem
            return False
        if self.last_problem:
            log.info("liveness check passes again")
            self.last_problem = ""
        self.last_beat = self._clock()
        return True

    def alive(self) -> bool:
        return (self._clock() - self.last_beat <= self._threshold
                and self._thread is not None and self._thread.is_alive())

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)


class App:
    """One extractedprism instance (the CLI runs one; tests run many in-process)."""

    def __init__(self, config: Config, *, metrics: Metrics | None = None,
                 stop: threading.Event | None = None, sa_dir: str | None = None,
                 rng: random.Random | None = None,
                 prober: Callable[[Endpoint, float, ReadyzSettings | None], ProbeResult]
                 = probe) -> None:
        self.config = config
        self.stop_event = stop or threading.Event()
        self.metrics = metrics or Metrics()
        self._sa_dir = sa_dir
        self.registry = Registry(
            selection=config.upstream_selection,
            readyz=config.health_check == "readyz",
            drain_timeout=config.drain_timeout,
            max_connections=config.max_connections,
            rng=rng,
            on_change=self._registry_changed,
        )
        self.metrics.attach_state(self.registry.snapshot)
        readyz = None
        if config.health_check == "readyz":
            readyz = ReadyzSettings(
                ca_file=config.health_check_ca_file,
                server_name=config.health_check_server_name,
                cert_file=config.health_check_cert_file,
                key_file=config.health_check_key_file,
                token_file=config.health_check_token_file,
            )
        self.ticker = Ticker(self.registry, interval=config.health_interval,
                             timeout=config.health_timeout, readyz=readyz,
                             stop=self.stop_event, prober=prober,
                             max_wait=min(config.liveness_interval, config.health_interval))
        self.proxy = Proxy(self.registry, bind_address=config.bind_address,
                           bind_port=config.bind_port, dial_timeout=config.health_timeout,
                           max_connections=config.max_connections,
                           pipe_sched=config.pipe_sched, on_accept_loop=self._accept_turned)
        self.merger = Merger(self.registry.set_endpoints, self.metrics)
        self.discovery: KubernetesProvider | None = None
        self.heartbeat = Heartbeat(self, interval=config.liveness_interval,
                                   threshold=config.liveness_threshold, stop=self.stop_event)
        self.health: HealthServer | None = None  # made in start(), after the proxy binds
        self._accept_loops = 0
        self._accept_seen = 0
        self._accept_suspect: int | None = None
        self._started = False

    def _registry_changed(self, change: Change) -> None:
        # A bound method rather than a setter patched in later: the ticker needs the
        # registry first, and the registry calls this only once endpoints are set.
        self.ticker.registry_changed(change)

    # -- addresses -------------------------------------------------------------------

    @property
    def proxy_address(self) -> tuple[str, int]:
        return self.proxy.address

    @property
    def health_address(self) -> tuple[str, int]:
        assert self.health is not None
        return self.health.address

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        cfg = self.config
        self.proxy.bind()
        try:
            self.health = HealthServer(self.registry, self.metrics, self.alive,
                                       host=cfg.health_bind_address, port=cfg.health_port,
                                       liveness_reason=self.liveness_reason)
        except OSError:
            self.proxy.close_listener()
            raise
        if cfg.health_check == "readyz":
            # Not fatal: the file is re-read on every probe and may be mounted later;
            # until then every probe fails and selection falls back to TCP health. But a
            # typo in the path should not hide among per-upstream probe failures.
            problem = ca_file_problem(cfg.health_check_ca_file)
            if problem:
                log.warning("readyz CA file unusable flag=--health-check-ca-file path=%s "
                            "reason=%r; every readyz probe fails until it is fixed",
                            cfg.health_check_ca_file, problem)
        self.merger.update("static", list(cfg.endpoints))
        if cfg.enable_discovery:
            self._start_discovery()
        self.ticker.start()
        self.proxy.start()
        self.heartbeat.start()
        self.health.start()
        self._started = True
        host, port = self.proxy.address
        hhost, hport = self.health.address
        log.info("extractedprism started listen=%s:%d health=%s:%d endpoints=%s selection=%s "
                 "health_check=%s discovery=%s", host, port, hhost, hport,
                 ",".join(str(e) for e in cfg.endpoints), cfg.upstream_selection,
                 cfg.health_check, cfg.enable_discovery)

    def _start_discovery(self) -> None:
        # Imported here: the kubernetes client takes ~0.5 s to import, which static-only
        # runs (and every in-process test) need not pay.
        from extractedprism.watch import KubernetesProvider

        provider = "kubernetes"
        self.discovery = KubernetesProvider(
            self.config.replace(bind_port=self.proxy.address[1]),
            self._on_discovered, self.metrics, self.stop_event, sa_dir=self._sa_dir)
        try:
            self.discovery.start()
        except Exception:
            # Provider failures are isolated: static endpoints keep working.
            log.exception("discovery failed to start; static endpoints only")
            self.metrics.discovery_errors_total.labels(provider=provider).inc()
            self.discovery = None

    def _on_discovered(self, endpoints: list[Endpoint]) -> None:
        self.merger.update("kubernetes", endpoints)

    def _accept_turned(self) -> None:
        # The acceptor's progress counter (acceptor thread; one writer, read by the
        # heartbeat: a plain int is enough).
        self._accept_loops += 1

    def liveness_problem(self, lock_timeout: float) -> str:
        """Empty when alive, else what is wrong (heartbeat thread)."""
        if not self.registry.lock.acquire(timeout=lock_timeout):
            return "registry lock not acquired"
        self.registry.lock.release()
        if not self.proxy.acceptor_alive():
            return "acceptor thread exited"
        # Idle, the acceptor blocks in accept() and its counter stands still; stuck, it
        # also leaves clients in the backlog. A client that waited since the previous
        # check without the loop turning means stuck (one check alone could race a
        # client arriving just now).
        loops, seen = self._accept_loops, self._accept_seen
        self._accept_seen = loops
        if self.proxy.backlog_waiting() and loops == seen:
            if self._accept_suspect == loops:
                return "acceptor not accepting: a client waits in the backlog"
            self._accept_suspect = loops
        else:
            self._accept_suspect = None
        if not self.ticker.alive():
            return "ticker thread exited"
        age = time.monotonic() - self.ticker.last_loop
        if age > self.config.liveness_threshold:
            return f"ticker loop stalled for {age:.1f}s"
        return ""

    def alive(self) -> bool:
        return self._started and not self.stop_event.is_set() and self.heartbeat.alive()

    def liveness_reason(self) -> str:
        if self.stop_event.is_set():
            return "shutting down"
        return self.heartbeat.last_problem or "heartbeat too old"

    def stop(self) -> bool:
        """Ordered, bounded shutdown; True when every thread finished in time."""
        self.stop_event.set()
        ok = True
        if self.discovery is not None:
            ok &= bool(self.discovery.stop_and_join(SHUTDOWN_TIMEOUT_S))
        ok &= self.proxy.shutdown(SHUTDOWN_TIMEOUT_S)
        ok &= self.ticker.join(SHUTDOWN_TIMEOUT_S)
        self.heartbeat.join(1.0)
        if self.health is not None:
            ok &= self.health.shutdown(SHUTDOWN_TIMEOUT_S)
        log.info("extractedprism stopped clean=%s", ok)
        return ok

    def __enter__(self) -> App:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
