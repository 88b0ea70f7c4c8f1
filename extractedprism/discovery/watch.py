"""Kubernetes EndpointSlice provider: the ``watcher`` thread.

Owns the slice cache (name -> wire object) and executes the reconnect policy of the
spec ("Two-level endpoint discovery", "Endpoint discovery"). Layered like kopf:

* :meth:`KubernetesProvider._run`: the supervisor; restarts a loop that died of a bug
  after the spec's backoff, counting and logging each death with its traceback;
* :meth:`KubernetesProvider._watch_forever`: the loop; runs one list or watch, then does
  what :func:`~extractedprism.discovery.backoff.next_step` (pure, with the rules quoted from the
  spec and tested from a table) says: re-list or watch, at once or after the backoff,
  with or without a reset. Durations are measured with the injected clock from the
  moment the Watch call is made; a stream end is "without an error" whether the server
  ended it or the connection dropped (neither is counted as an error);
* :meth:`KubernetesProvider._list`: one list, rebuilding the cache; raises on failure;
* :meth:`KubernetesProvider._stream`: one watch stream, applying events to the cache;
  returns on a stream end, raises :class:`~extractedprism.discovery.kube.Gone` on 410, raises
  anything else on a failed Watch call or an ERROR event.

Every list and every slice event hands the recomputed endpoint list to ``on_update``,
also when it did not change (``discovery_updates_total`` counts updates received; the
merge applies only changes).

The cache keeps, per slice name, the slice's content and the endpoints parsed from it
(:func:`~extractedprism.discovery.slices.parse_slice`). A slice is parsed, and its problems
logged, only when its content changes, not on every event of every other slice or on
every re-list. A slice that cannot be used at all keeps the endpoints it last had, so
corrupt input never drains live connections; a slice labelled for another service
(which the label selector should have kept out) is dropped from the cache, as the API
server's own DELETED event would do when a slice leaves the selector.

``on_error`` is called, and so ``discovery_errors_total{provider="kubernetes"}``
counted by the app, for failed lists/re-lists, failed Watch calls, watch ERROR events
(other than 410) and provider failures (each death of the loop); never for a stream
end or a 410. Waits go through ``sleep`` (default
``stop.wait``) so shutdown is prompt; :meth:`stop_and_join` also shuts the open watch's
socket down to wake the blocked read.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from extractedprism.config.endpoints import Endpoint
from extractedprism.config.table import Config
from extractedprism.discovery.backoff import LONG_WATCH_S, Backoff, Ended, WatchMemory, next_step
from extractedprism.discovery.kube import Gone, KubeClient, WatchStream, build_client
from extractedprism.discovery.slices import (
    SERVICE_LABEL,
    SERVICE_NAME,
    parse_slice,
    service_label,
    slice_content,
    slice_name,
    union,
)
from extractedprism.discovery.status import DiscoveryStatus
from extractedprism.threads import join_until

log = logging.getLogger(__name__)

PROVIDER = "kubernetes"
# client-go picks each watch's timeoutSeconds at random in [5 min, 10 min) so a fleet of
# watchers does not reconnect in lock-step.
WATCH_TIMEOUT_RANGE_S = (300, 600)


class _Cached(NamedTuple):
    content: Any  # slice_content(): what the endpoints were parsed from
    endpoints: list[Endpoint]


class KubernetesProvider:
    """Lists then watches the ``kubernetes`` EndpointSlices; calls ``on_update`` on change
    and ``on_error`` with its name on every error counted."""

    def __init__(
        self,
        config: Config,
        on_update: Callable[[list[Endpoint]], None],
        on_error: Callable[[str], None],
        stop: threading.Event,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        sa_dir: str | None = None,
        sleep: Callable[[float], object] | None = None,
        watch_timeout_seconds: int | None = None,
        status: DiscoveryStatus | None = None,
    ) -> None:
        self._config, self._sa_dir = config, sa_dir
        self._on_update = on_update
        # Told the provider's name of every error counted (discovery_errors_total).
        self._on_error = on_error
        self._stop = stop
        # Time and chance are injected, so tests decide every wait exactly.
        self._clock, self._sleep = clock, (sleep if sleep is not None else stop.wait)
        self._rng = rng if rng is not None else random.Random()
        self._watch_timeout = watch_timeout_seconds
        # What /upstreams and the discovery gauges show; written only by this thread.
        self._status = status if status is not None else DiscoveryStatus(PROVIDER)
        self.backoff = Backoff(self._rng)
        self._client: KubeClient | None = None
        self._thread: threading.Thread | None = None
        self._stream_lock = threading.Lock()
        self._open_stream: WatchStream | None = None
        self.restarts = 0  # times the watch loop died and was restarted
        self._cache: dict[str, _Cached] = {}
        self._sent: list[Endpoint] | None = None
        self._rv = ""

    # -- lifecycle (main thread) -----------------------------------------------------

    def start(self) -> None:
        """Build the client; without one, log one warning and run static-only.

        Raises :class:`~extractedprism.discovery.credentials.ClientConfigError` when a kubeconfig or
        service
        account exists but cannot be used (the caller isolates that failure).
        """
        if not self._config.enable_discovery:
            log.info("kubernetes discovery disabled by --enable-discovery=false")
            return
        client = build_client(self._config, self._sa_dir, self._stop)
        if client is None:
            reason = "no --kubeconfig and no in-cluster service account"
            log.warning(
                "kubernetes discovery unavailable reason=%r; serving static endpoints only",
                reason,
            )
            self._status.error(f"unavailable: {reason}")
            return
        self._client = client
        self._thread = threading.Thread(name="watcher", target=self._run, daemon=True)
        self._thread.start()

    def stop_and_join(self, timeout: float) -> bool:
        """Set stop, wake a blocked watch read, and join; True when the thread ended."""
        self._stop.set()
        with self._stream_lock:
            stream = self._open_stream
        if stream is not None:
            stream.close()
        if self._client is not None:
            self._client.interrupt()  # a list, connect or Retry-After wait in flight
        return join_until([self._thread], time.monotonic() + timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the watcher thread ----------------------------------------------------------

    def _run(self) -> None:
        """The watcher thread: runs the watch loop and restarts it when it dies.

        Provider failures are isolated (spec): a bug that kills the loop is counted,
        logged with its traceback and followed by a fresh list after the spec's backoff,
        while the static endpoints and the last known list keep serving. A run that
        lasted a long watch's worth of time starts the next death's backoff from 1 s.
        """
        assert self._client is not None
        deaths = Backoff(self._rng)
        try:
            while not self._stop.is_set():
                started = self._clock()
                try:
                    self._watch_forever(self._client)
                    return
                except Exception:
                    if self._stop.is_set():
                        return
                    self.restarts += 1
                    self._count_error()
                    self._status.error("discovery failed; restarting after backoff")
                    if self._clock() - started >= LONG_WATCH_S:
                        deaths.reset()
                    delay = deaths.next_delay()
                    log.exception("kubernetes discovery failed; restarting after backoff "
                                  "delay=%.3fs restarts=%d; serving the last known endpoints",
                                  delay, self.restarts)
                    self._sleep(delay)
        finally:
            self._client.close()
            log.info("watcher stopped")

    def _count_error(self) -> None:
        self._on_error(PROVIDER)

    def _wait(self, delay: float, why: str) -> None:
        log.info("watch backoff delay=%.3fs reason=%r", delay, why)
        self._sleep(delay)

    def _watch_forever(self, client: KubeClient) -> None:
        """Execute :func:`~extractedprism.discovery.backoff.next_step`, one list or watch at a
        time."""
        stop = self._stop
        memory = WatchMemory()
        relist = True
        while not stop.is_set():
            open_for = 0.0
            if relist:
                try:
                    self._list(client)
                    ended = Ended.LISTED
                except Exception as exc:
                    if stop.is_set():
                        return
                    self._count_error()
                    log.warning("endpointslice list failed error=%s", _describe(exc))
                    self._status.error(f"list failed: {_describe(exc)}")
                    ended = Ended.LIST_FAILED
            else:
                opened = self._clock()
                try:
                    self._stream(client)
                    ended = Ended.CLEAN
                except Gone as exc:
                    ended, error = Ended.GONE, str(exc)
                except Exception as exc:
                    ended, error = Ended.ERROR, _describe(exc)
                    if not stop.is_set():
                        self._count_error()
                        self._status.error(f"watch failed: {error}")
                if stop.is_set():
                    return
                open_for = self._clock() - opened
            step, memory = next_step(memory, ended, open_for)
            if ended is Ended.GONE:
                log.info("watch expired (410 Gone); re-listing error=%s after_long_watch=%s",
                         error, step.after_long)
            elif ended is Ended.ERROR:
                log.warning("watch failed error=%s after_long_watch=%s", error,
                            step.after_long)
            elif ended is Ended.CLEAN and not step.wait:
                log.info("watch ended after a long watch; re-opening at once")
            if step.reset:
                self.backoff.reset()
            if step.wait:
                self._wait(self.backoff.next_delay(), step.reason)
            relist = step.list

    def _list(self, client: KubeClient) -> None:
        items, rv = client.list_slices()
        old = self._cache
        cache: dict[str, _Cached] = {}
        for obj in items:
            name = _valid_name(obj)
            if name is None:
                log.warning("endpointslice skipped slice=%s field=metadata.name reason=%r",
                            slice_name(obj), "missing")
                continue
            if not _ours(obj, name):
                continue
            cache[name] = self._parsed(name, obj, old.get(name))
        self._cache = cache
        self._rv = rv
        log.info("endpointslices listed slices=%d resource_version=%s", len(cache), rv)
        self._status.event()
        self._publish()

    def _stream(self, client: KubeClient) -> None:
        timeout = self._watch_timeout or self._rng.randrange(*WATCH_TIMEOUT_RANGE_S)
        stream = client.watch(self._rv, timeout)
        with self._stream_lock:
            self._open_stream = stream
        if self._stop.is_set():  # stop_and_join ran between the call and the registration
            stream.close()
        log.info("watch opened resource_version=%s timeout=%ss", self._rv, timeout)
        self._status.watch_opened()
        try:
            for event in stream:
                self._status.event()
                self._apply(event)
        finally:
            self._status.watch_closed()
            with self._stream_lock:
                self._open_stream = None
            stream.release()
        log.info("watch ended how=%r resource_version=%s", stream.ended_by, self._rv)

    def _apply(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        obj = event["object"]
        meta = obj.get("metadata")
        rv = meta.get("resourceVersion") if isinstance(meta, dict) else None
        if kind == "BOOKMARK":
            if isinstance(rv, str) and rv:
                self._rv = rv
            else:
                log.warning("watch event skipped type=BOOKMARK field=metadata.resourceVersion "
                            "reason=%r value=%.40r", "missing or not a string", rv)
            return
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            log.warning("watch event skipped type=%.40r slice=%s reason=%r", kind,
                        slice_name(obj), "unknown type")
            return
        name = _valid_name(obj)
        if name is None:
            log.warning("watch event skipped type=%s slice=%s field=metadata.name reason=%r",
                        kind, slice_name(obj), "missing")
            return
        if isinstance(rv, str) and rv:
            self._rv = rv
        if kind == "DELETED":
            if self._cache.pop(name, None) is None:
                log.debug("watch event for an unknown slice type=DELETED slice=%s", name)
        elif _ours(obj, name):
            self._cache[name] = self._parsed(name, obj, self._cache.get(name))
        else:
            self._cache.pop(name, None)
        log.debug("watch event type=%s slice=%s resource_version=%s", kind, name, rv)
        self._publish()

    @staticmethod
    def _parsed(name: str, obj: dict[str, Any], old: _Cached | None) -> _Cached:
        """The cache entry for ``obj``; parses (and logs) only when its content changed."""
        content = slice_content(obj)
        if old is not None and old.content == content:
            return _Cached(content, old.endpoints)
        endpoints = parse_slice(obj)
        if endpoints is not None:
            return _Cached(content, endpoints)
        kept = old.endpoints if old is not None else []
        log.warning("endpointslice ignored slice=%s; keeping its last endpoints=%s", name,
                    ",".join(str(e) for e in kept) or "-")
        return _Cached(content, kept)

    def _publish(self) -> None:
        """Hand the recomputed list on: after every list and every slice event, also
        when it did not change, so discovery_updates_total counts every update
        received (the merge applies only changes)."""
        endpoints = union(c.endpoints for c in self._cache.values())
        if endpoints != self._sent:
            self._sent = endpoints
            log.info("kubernetes endpoints changed endpoints=%s",
                     ",".join(str(e) for e in endpoints) or "-")
        self._on_update(list(endpoints))


def _ours(obj: dict[str, Any], name: str) -> bool:
    """True when the slice belongs to the ``kubernetes`` service; logs why not."""
    label = service_label(obj)
    if label == SERVICE_NAME:
        return True
    log.warning("endpointslice ignored slice=%s field=metadata.labels[%s] reason=%r "
                "value=%.80r", name, SERVICE_LABEL, "not the kubernetes service", label)
    return False


def _valid_name(obj: Any) -> str | None:
    if not isinstance(obj, dict):
        return None
    meta = obj.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    return name if isinstance(name, str) and name else None


def _describe(exc: BaseException) -> str:
    status = getattr(exc, "status", None)
    reason = getattr(exc, "reason", None)
    if status is not None:
        return f"{type(exc).__name__} status={status} reason={reason}"
    return f"{type(exc).__name__}: {exc}"
