"""App: wires the parts, starts the threads in dependency order, shuts down in order.

Start: bind the listener and the health port first (so a port clash fails before any
thread runs), feed the static endpoints, then start discovery, the ticker, the
acceptor, the heartbeat and the health server.

With ``--handover-socket`` a predecessor's listeners are taken over instead of bound
(handover.py), and this instance offers its own to the next one once it runs.

Stop (spec, "Graceful shutdown"): one deadline, 5 s from the start of the shutdown,
shared by every stage: stop discovery, shut the proxy down (close the listener,
force-close in-flight connections, wait for pipe threads), and the health server's
graceful shutdown, started at the same time as the proxy's. Every wait is against that
one deadline, so SIGTERM ends the process within about 5 s whatever is stuck (a probe
in getaddrinfo, a list call in flight): a daemon thread still running at the deadline
is logged by name once and abandoned. The admin socket is told to stop at once and
waited for against the same deadline, never before it. With ``--shutdown-drain-timeout``
above 0 a drain comes first: live connections are closed spread evenly over the window,
and the spec's shutdown follows. During the drain, with ``--handover-socket``, the
listeners stay open and offered, so a replacement started meanwhile (``kubectl delete
pod``) takes them over as in an upgrade; without it both ports are released at the
drain's start, so a replacement binds them instead of failing on the health port.
"""

from __future__ import annotations

import functools
import logging
import random
import socket
import threading
import time
from typing import TYPE_CHECKING

from extractedprism import __version__
from extractedprism.checks.probes import (
    ProbeConnections,
    Prober,
    ReadyzSettings,
    ca_file_problem,
    kept_max_age,
)
from extractedprism.checks.ticker import Ticker
from extractedprism.config.endpoints import Endpoint
from extractedprism.config.table import Config
from extractedprism.datapath.proxy import Proxy
from extractedprism.datapath.relay import Relay, resolve
from extractedprism.datapath.shutdown_drain import spread_close
from extractedprism.discovery import statefile
from extractedprism.discovery.merge import CACHE, KUBERNETES, STATIC, Merger
from extractedprism.discovery.status import DiscoveryStatus, DiscoveryView
from extractedprism.errors import ListenError
from extractedprism.health.document import ProcessInfo, upstreams_document
from extractedprism.health.heartbeat import Heartbeat, lock_free
from extractedprism.health.metrics import Metrics
from extractedprism.health.opsmetrics import (
    BuildInfoCollector,
    DiscoveryCollector,
    register_runtime_collectors,
)
from extractedprism.health.server import HealthServer
from extractedprism.ops import handover
from extractedprism.ops.admin import AdminServer
from extractedprism.upstreams.actions import AdminActions
from extractedprism.upstreams.effects import Change
from extractedprism.upstreams.rebalancer import Rebalancer
from extractedprism.upstreams.registry import Registry
from extractedprism.upstreams.sampler import Sampler

if TYPE_CHECKING:
    from extractedprism.discovery.watch import KubernetesProvider

log = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 5.0
HEARTBEAT_JOIN_S = 1.0


class App:
    """One extractedprism instance (the CLI runs one; tests run many in-process)."""

    def __init__(self, config: Config, *, metrics: Metrics | None = None,
                 stop: threading.Event | None = None, sa_dir: str | None = None,
                 rng: random.Random | None = None,
                 prober: Prober | None = None, relay: Relay | None = None) -> None:
        self.config = config
        self.stop_event = stop or threading.Event()
        self.metrics = metrics or Metrics()
        self._sa_dir = sa_dir
        self.registry = Registry(
            selection=config.upstream_selection,
            readyz=config.health_check == "readyz",
            drain_timeout=config.drain_timeout,
            unready_drain_timeout=config.unready_drain_timeout,
            max_connections=config.max_connections,
            rng=rng,
            on_change=self._registry_changed,
            rebalance_interval=config.rebalance_interval,
            rebalance_quiet=config.rebalance_quiet,
            slow_start=config.slow_start,
            stall_timeout=config.stall_timeout,
            overload_guard=config.overload_guard,
            health_interval=config.health_interval,
            health_timeout=config.health_timeout,
        )
        self.metrics.attach_state(self.registry.snapshot)
        self.started_wall = time.time()
        self.discovery_status = DiscoveryStatus() if config.enable_discovery else None
        self._attach_ops_metrics()
        readyz = None
        if config.health_check == "readyz":
            readyz = ReadyzSettings(
                ca_file=config.health_check_ca_file,
                server_name=config.health_check_server_name,
                cert_file=config.health_check_cert_file,
                key_file=config.health_check_key_file,
                token_file=config.health_check_token_file,
            )
        # The probes' kept-alive readyz connections, owned by the ticker (unless a test
        # hands in a prober of its own).
        self.probe_connections = (ProbeConnections(max_age=kept_max_age(config.health_interval))
                                  if prober is None else None)
        if self.probe_connections is not None and readyz is not None:
            self.metrics.attach_probe_connections(self.probe_connections.opened)
        self.ticker = Ticker(self.registry, interval=config.health_interval,
                             timeout=config.health_timeout, recheck=config.health_recheck,
                             readyz=readyz, stop=self.stop_event,
                             prober=(prober if self.probe_connections is None
                                     else self.probe_connections.probe),
                             connections=self.probe_connections,
                             max_wait=min(config.liveness_interval, config.health_interval))
        self.proxy = Proxy(self.registry, bind_address=config.bind_address,
                           bind_port=config.bind_port, dial_timeout=config.health_timeout,
                           max_connections=config.max_connections,
                           pipe_sched=config.pipe_sched, gil_cpu=config.gil_cpu,
                           # Resolved by the CLI; in-process instances (tests) from config.
                           relay=relay if relay is not None else resolve(config.relay),
                           dial_hedge_delay=config.dial_hedge_delay,
                           answer_hedge_delay=config.answer_hedge_delay,
                           on_accept_loop=self._accept_turned)
        # --rebalance-interval: rounds on the conn-sampler thread (upstreams/rebalancer.py).
        self.rebalancer = (Rebalancer(self.registry, interval=config.rebalance_interval,
                                      quiet=config.rebalance_quiet,
                                      # its own draws: the registry's picks stay as seeded
                                      rng=random.Random(rng.random()) if rng else None)
                           if config.rebalance_interval > 0 else None)
        # The conn-sampler thread reads the relays' byte counters for rebalancing and the
        # stall check; only when one of them is on (upstreams/sampler.py).
        self.sampler = (Sampler(self.registry, stall_timeout=config.stall_timeout,
                                rebalancer=self.rebalancer, stop=self.stop_event)
                        if self.rebalancer is not None or config.stall_timeout > 0 else None)
        self.heartbeat = Heartbeat(lock_free=functools.partial(lock_free, self.registry.lock),
                                   acceptor=self.proxy, ticker=self.ticker,
                                   interval=config.liveness_interval,
                                   threshold=config.liveness_threshold, stop=self.stop_event)
        # The data path in use, "native" or "python" (--relay resolved; logged at start,
        # /upstreams and extractedprism_build_info{relay=...} read it here).
        self.relay = self.proxy.relay.name
        self.merger = Merger(self.registry.membership.set_endpoints, self._count_discovery_update,
                             static_mode=config.static_endpoints,
                             apply_roles=self.registry.membership.set_roles)
        self.discovery: KubernetesProvider | None = None
        self.health: HealthServer | None = None  # made in start(), after the proxy binds
        self.admin: AdminServer | None = None  # with --admin-socket, made in start()
        self._offer: handover.Offer | None = None
        # Set when the shutdown closes the listeners for good: from then on nothing is
        # offered (until then, during a shutdown drain, a successor may still take them).
        self._listeners_closing = threading.Event()
        # Set when a successor accepts on the listeners (ends an offering drain's wait).
        self._successor_accepts = threading.Event()
        self._state_writer: statefile.StateWriter | None = None
        self._cache_in_use = False
        self._started = False

    def _registry_changed(self, change: Change) -> None:
        # A bound method rather than a setter patched in later: the ticker needs the
        # registry first, and the registry calls this only once endpoints are set.
        self.ticker.registry_changed(change)

    def _accept_turned(self) -> None:
        # A bound method for the same reason: the heartbeat asks the proxy, so it is made
        # after it, and the acceptor turns only once both exist (start()).
        self.heartbeat.accept_turned()

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
        if cfg.enable_discovery and cfg.kubeconfig:
            self._check_kubeconfig()  # before anything is bound or taken over
        received = handover.receive(cfg.handover_socket) if cfg.handover_socket else None
        try:
            taken = self._open_listeners(received)
        except BaseException:
            if received is not None:
                received.abort()
            raise
        try:
            self._start_threads(successor=received is not None)
        except BaseException:
            if self.admin is not None:
                # Its file too (a successor's, still beside the path), whether or not the
                # caller's stop() follows: an unexpected error ends the process without.
                self.admin.stop(time.monotonic())
            if received is not None:
                received.abort()
            if "proxy" in taken:
                # Shared with the predecessor, which still accepts on it: the shutdown
                # that follows must not shut it down.
                self.proxy.stop_accepting()
            raise
        if self.admin is not None:
            # Past the last point where this start can fail: only now may a successor's
            # admin socket replace its predecessor's, which would otherwise be left, after
            # a failed start, with none at the path.
            self.admin.take_path()
        if received is not None:
            # Accepting here already: only now may the predecessor stop.
            received.finish(taken)
        if cfg.handover_socket:
            self._offer = handover.Offer(cfg.handover_socket, self._offered_listeners,
                                         self._handed_over)
            try:
                self._offer.start()
            except OSError as exc:
                log.warning("handover: cannot offer listeners; the next instance will "
                            "bind its own path=%s reason=%r", cfg.handover_socket,
                            exc.strerror or str(exc))
                self._offer = None

    def _open_listeners(self, received: handover.Received | None) -> list[str]:
        """Take the predecessor's listeners where they match this configuration, else
        bind; returns the names taken."""
        cfg = self.config
        taken: list[str] = []
        sock = received.take("proxy") if received is not None else None
        if sock is not None and handover.listener_matches(sock, cfg.bind_address,
                                                          cfg.bind_port):
            self.proxy.adopt(sock)
            taken.append("proxy")
        else:
            if sock is not None:
                log.warning("handover: the predecessor's proxy listener is on another "
                            "address; binding a new one address=%s", sock.getsockname())
                sock.close()
            try:
                self.proxy.bind()
            except OSError as exc:
                raise ListenError("--bind-address/--bind-port", cfg.bind_address,
                                  cfg.bind_port, exc) from exc
        sock = received.take("health") if received is not None else None
        if sock is not None and not handover.listener_matches(
                sock, cfg.health_bind_address, cfg.health_port):
            log.warning("handover: the predecessor's health listener is on another "
                        "address; binding a new one address=%s", sock.getsockname())
            sock.close()
            sock = None
        try:
            self.health = HealthServer(self.registry, self.metrics, self.alive,
                                       host=cfg.health_bind_address, port=cfg.health_port,
                                       liveness_reason=self.liveness_reason, listener=sock,
                                       document=self.upstreams_document)
        except OSError as exc:
            if "proxy" not in taken:  # a taken one is shared: never shut it down
                self.proxy.close_listener()
            if self.proxy.listener is not None:
                self.proxy.listener.close()
            raise ListenError("--health-bind-address/--health-port", cfg.health_bind_address,
                              cfg.health_port, exc) from exc
        if sock is not None:
            taken.append("health")
        return taken

    def _offered_listeners(self) -> dict[str, socket.socket]:
        out: dict[str, socket.socket] = {}
        if self._listeners_closing.is_set():
            return out  # they close now; a successor binds its own
        if self.proxy.listener is not None and not self.proxy.handed_over:
            out["proxy"] = self.proxy.listener
        if self.health is not None:
            out["health"] = self.health.listener
        return out

    def _handed_over(self, names: list[str]) -> None:
        """handover-offer thread: the successor accepts on ``names`` now."""
        if "proxy" in names:
            self.proxy.stop_accepting()
        if "health" in names and self.health is not None:
            self.health.stop_accepting()
        self._successor_accepts.set()
        until = "the drain ends" if self.stop_event.is_set() else "SIGTERM"
        log.info("handover: a successor accepts now; serving open connections until "
                 "%s listeners=%s connections=%d", until, ",".join(names),
                 self.registry.snapshot().connections_active)

    def _start_threads(self, *, successor: bool = False) -> None:
        cfg = self.config
        assert self.health is not None
        if cfg.admin_socket:
            # Before any thread runs, like the listeners: a bad path fails the start
            # (exit 1, naming the flag) and the caller's stop() closes what is open. A
            # successor in a handover takes the path over from its predecessor (the
            # same command line names the same path) once its start succeeded
            # (start(): take_path); the predecessor keeps answering on the socket it
            # holds until it stops and then leaves the path alone.
            admin = AdminServer(cfg.admin_socket,
                                AdminActions(self.registry, self.rebalancer),
                                self.admin_listing)
            admin.bind(take_over=successor)
            self.admin = admin
        if cfg.health_check == "readyz":
            # Not fatal: the file is re-read on every probe and may be mounted later;
            # until then every probe fails and selection falls back to TCP health. But a
            # typo in the path should not hide among per-upstream probe failures.
            problem = ca_file_problem(cfg.health_check_ca_file)
            if problem:
                log.warning("readyz CA file unusable flag=--health-check-ca-file path=%s "
                            "reason=%r; every readyz probe fails until it is fixed",
                            cfg.health_check_ca_file, problem)
        self.merger.update(STATIC, list(cfg.endpoints))
        self._load_state_file()
        if cfg.enable_discovery:
            self._start_discovery()
        self.ticker.start()
        if self.sampler is not None:
            self.sampler.start()
        self.proxy.start()
        self.heartbeat.start()
        self.health.start()
        if self.admin is not None:
            self.admin.start()
        self.started_wall = time.time()
        self._started = True
        host, port = self.proxy.address
        hhost, hport = self.health.address
        log.info("extractedprism started listen=%s:%d health=%s:%d endpoints=%s selection=%s "
                 "health_check=%s discovery=%s relay=%s", host, port, hhost, hport,
                 ",".join(str(e) for e in cfg.endpoints), cfg.upstream_selection,
                 cfg.health_check, cfg.enable_discovery, self.relay)

    def _check_kubeconfig(self) -> None:
        """A missing or malformed ``--kubeconfig`` stops the start (KubeconfigError:
        one line naming the file and what is wrong, exit 2); a file it names that is
        not there yet only warns (discovery fails, naming it, until it is)."""
        from extractedprism.discovery.credentials import check_kubeconfig

        problem = check_kubeconfig(self.config.kubeconfig)
        if problem:
            log.warning("kubeconfig refers to a file that is not usable yet path=%s "
                        "error=%s; discovery fails until it is", self.config.kubeconfig,
                        problem)

    def _start_discovery(self) -> None:
        # Imported here: static-only runs need none of discovery's modules (ssl contexts,
        # yaml with a kubeconfig).
        from extractedprism.discovery.watch import KubernetesProvider

        provider = "kubernetes"
        self.discovery = KubernetesProvider(
            self.config.replace(bind_port=self.proxy.address[1]),
            self._on_discovered, self._count_discovery_error, self.stop_event,
            sa_dir=self._sa_dir, status=self.discovery_status)
        try:
            self.discovery.start()
        except Exception as exc:
            # Provider failures are isolated: static endpoints keep working.
            log.exception("discovery failed to start; static endpoints only")
            if self.discovery_status is not None:
                self.discovery_status.error(f"failed to start: {exc}")
            self._count_discovery_error(provider)
            self.discovery = None

    def _count_discovery_update(self, provider: str) -> None:
        self.metrics.discovery_updates_total.labels(provider=provider).inc()

    def _count_discovery_error(self, provider: str) -> None:
        self.metrics.discovery_errors_total.labels(provider=provider).inc()

    def _load_state_file(self) -> None:
        """``--state-file``: the endpoints discovery found last time, as provider
        ``cache`` until discovery produces its first list."""
        cfg = self.config
        if not cfg.state_file:
            return
        if not cfg.enable_discovery:
            return  # the command line warned: config.table.UNUSED
        cached = statefile.read(cfg.state_file)
        if cached:
            self._cache_in_use = True
            self.merger.update(CACHE, cached)
        self._state_writer = statefile.StateWriter(cfg.state_file, self.stop_event)
        self._state_writer.start(current=cached)

    def _on_discovered(self, endpoints: list[Endpoint]) -> None:
        if self._cache_in_use:
            # Discovery speaks for itself now: the cache goes in the same update that
            # applies its first list, so an endpoint in both never leaves; the cache's
            # others drain like any removed endpoint (--drain-timeout).
            self._cache_in_use = False
            log.info("state file cache dropped: discovery produced its first list")
            self.merger.update(KUBERNETES, endpoints, drop=(CACHE,))
        else:
            self.merger.update(KUBERNETES, endpoints)
        if self._state_writer is not None:
            self._state_writer.save(endpoints)

    # -- the operator's view --------------------------------------------------------------

    def _attach_ops_metrics(self) -> None:
        registry = self.metrics.registry
        if getattr(registry, "_extractedprism_ops", False):
            return  # a Metrics shared by two Apps (tests): one process, one set
        registry._extractedprism_ops = True  # type: ignore[attr-defined]
        register_runtime_collectors(registry)
        registry.register(BuildInfoCollector(self._relay_name))
        registry.register(DiscoveryCollector(self._discovery_view))

    def _relay_name(self) -> str:
        return self.relay

    def _discovery_view(self) -> DiscoveryView | None:
        return None if self.discovery_status is None else self.discovery_status.view()

    def process_info(self) -> ProcessInfo:
        return ProcessInfo(version=__version__, started=self.started_wall, relay=self.relay,
                           discovery=self._discovery_view())

    def upstreams_document(self) -> dict[str, object]:
        """The /upstreams body (what `extractedprism status` and `admin list` read)."""
        return upstreams_document(self.registry.snapshot(), self.process_info())

    def admin_listing(self) -> list[dict[str, object]]:
        return list(self.upstreams_document()["upstreams"])  # type: ignore[call-overload]

    def alive(self) -> bool:
        return self._started and not self.stop_event.is_set() and self.heartbeat.alive()

    def liveness_reason(self) -> str:
        if self.stop_event.is_set():
            return "shutting down"
        return self.heartbeat.last_problem or "heartbeat too old"

    def stop(self) -> bool:
        """Ordered, bounded shutdown; True when every thread finished in time.

        At most the shutdown drain window plus ``SHUTDOWN_TIMEOUT_S``: every stage after
        the drain (the proxy and its dial reaper, discovery, the ticker and its probes,
        the state file, the heartbeat, the admin socket, the handover offer, the health
        server) waits against one deadline; before it, stopping is only telling.
        """
        self.stop_event.set()
        # Told now, waited for at the deadline below: the admin socket answers no more,
        # and its wait (a request in hand) never comes before the drain or the deadline.
        if self.admin is not None:
            self.admin.begin_stop()
        drain = self.config.shutdown_drain_timeout if self._started else 0.0
        # With a handover socket and a drain, the listeners stay open and offered through
        # the drain, for a successor started while this one drains (the replacement pod
        # of `kubectl delete pod`, an eviction): it takes both over, as in an upgrade,
        # and no connection is refused in between (docs/lifecycle.md).
        offering = (drain > 0 and self._offer is not None and not self.proxy.handed_over)
        if not offering:
            self._stop_offering()
        if drain > 0:
            self._shutdown_drain(drain, offering=offering)
            if offering:
                self._stop_offering()
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        if self.health is not None:
            self.health.begin_shutdown(deadline)
        # The proxy before discovery's join: a list call in flight goes through this
        # proxy, and the force-close ends it.
        ok = self.proxy.shutdown(left())
        if self.discovery is not None:
            ok &= bool(self.discovery.stop_and_join(left()))
        ok &= self.ticker.join(left())
        if self.sampler is not None:
            ok &= self.sampler.join(left())
        if self._state_writer is not None:
            ok &= self._state_writer.join(left())
        self.heartbeat.join(min(HEARTBEAT_JOIN_S, left()))
        if self.admin is not None:
            ok &= self.admin.stop(deadline)
        if self._offer is not None:
            ok &= self._offer.stop(deadline)
        if self.health is not None:
            ok &= self.health.wait_stopped(deadline)
        log.info("extractedprism stopped clean=%s", ok)
        return ok

    def _stop_offering(self) -> None:
        """No handover starts from here on; the listeners are to close."""
        self._listeners_closing.set()
        if self._offer is not None and self._offer.begin_stop():
            # SIGTERM in the middle of a handover (or after one): the successor may
            # accept on the listener already, so it is closed here, never shut down.
            self.proxy.share_listener()

    def _shutdown_drain(self, window: float, *, offering: bool) -> None:
        """Close the live connections spread evenly over ``window``
        (shutdown_drain.py); whatever is left is force-closed by the shutdown that
        follows.

        ``offering``: the listeners stay open (and this process accepts on them) until
        a successor takes them over or the window ends, however few connections there
        are to close. Otherwise accepting stops now and both ports are released at once,
        so a replacement that binds its own starts, rather than failing on a port this
        process drains on."""
        start = time.monotonic()
        if offering:
            log.info("shutdown drain: accepting and offering the listeners until a "
                     "successor takes them over or the window ends window=%gs", window)
        else:
            self.proxy.close_listener()  # refused from now on, unless a successor accepts
            if self.health is not None:
                self.health.stop_accepting()  # the port is free for a replacement
        conns = self.registry.live_connections()
        log.info("shutdown drain: closing connections spread over the window "
                 "connections=%d window=%gs handed_over=%s", len(conns), window,
                 self.proxy.handed_over)
        closed = spread_close(conns, window)
        if offering:
            # The closes may be over early (few or no connections): the offer stands
            # for the whole window, for a replacement that is still starting.
            self._successor_accepts.wait(max(0.0, start + window - time.monotonic()))
            # Connections accepted here since SIGTERM: spread over what is left of the
            # window too (at its end, if no successor came, the shutdown closes them).
            late = self.registry.live_connections()
            left = start + window - time.monotonic()
            if late and left > 0:
                log.info("shutdown drain: closing the connections accepted while "
                         "draining connections=%d window=%gs", len(late), left)
                closed += spread_close(late, left)
        log.info("shutdown drain over closed=%d handed_over=%s", closed,
                 self.proxy.handed_over)

    def __enter__(self) -> App:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
