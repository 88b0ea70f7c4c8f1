"""Kubernetes EndpointSlice provider: the ``watcher`` thread.

Owns the slice cache (name -> wire object) and the reconnect policy of the spec
("Two-level endpoint discovery", "Endpoint discovery"). Layered like kopf:

* :meth:`KubernetesProvider._watch_forever`: the loop; decides only *when* to list,
  watch or wait, from the outcome of the previous step and :class:`~extractedprism.backoff.Backoff`;
* :meth:`KubernetesProvider._list`: one list, rebuilding the cache; raises on failure;
* :meth:`KubernetesProvider._stream`: one watch stream, applying events to the cache;
  returns on a stream end, raises :class:`~extractedprism.kube.Gone` on 410, raises
  anything else on a failed Watch call or an ERROR event.

Reconnect rules, exactly as the spec words them (``LONG`` = 30 s, measured with the
injected clock from the moment the Watch call is made):

1. delays come from the backoff: 1 s, doubling to 30 s, each plus up to 25% jitter;
2. a watch open >= LONG that closed without an error is re-opened at once. A stream
   end is "without an error" whether the server ended it or the connection dropped:
   neither is counted as an error (metrics table), so neither is treated as one here;
   a stream that ends sooner waits for the backoff;
3. any other error (a failed Watch call, an ERROR event) after such a watch -- i.e.
   ending a watch open >= LONG, or hitting the re-watch right after one closed
   cleanly -- restarts the backoff from 1 s; 410 Gone does not;
4. 410 Gone (ERROR event code 410, or HTTP 410) -> full re-list at once, rebuilding the
   cache. After a successful re-list the next watch starts at once if the 410 ended a
   watch open >= LONG, or hit the re-watch right after such a watch closed cleanly;
   otherwise it waits for the backoff. A failed list waits for the backoff and retries.

The cache keeps, per slice name, the slice's content and the endpoints parsed from it
(:func:`~extractedprism.slices.parse_slice`). A slice is parsed, and its problems
logged, only when its content changes, not on every event of every other slice or on
every re-list. A slice that cannot be used at all keeps the endpoints it last had, so
corrupt input never drains live connections; a slice labelled for another service
(which the label selector should have kept out) is dropped from the cache, as the API
server's own DELETED event would do when a slice leaves the selector.

``discovery_errors_total{provider="kubernetes"}`` counts failed lists/re-lists, failed
Watch calls, watch ERROR events (other than 410) and provider failures (the thread
dying); never a stream end or a 410. Waits go through ``sleep`` (default
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

from extractedprism.backoff import Backoff
from extractedprism.config import Config
from extractedprism.discovery import DiscoveryStatus
from extractedprism.endpoints import Endpoint
from extractedprism.kube import Gone, KubeClient, WatchStream, build_client
from extractedprism.metrics import Metrics
from extractedprism.slices import (
    SERVICE_LABEL,
    SERVICE_NAME,
    parse_slice,
    service_label,
    slice_content,
    slice_name,
    union,
)

log = logging.getLogger(__name__)

PROVIDER = "kubernetes"
LONG_WATCH_S = 30.0
# client-go picks each watch's timeoutSeconds at random in [5 min, 10 min) so a fleet of
# watchers does not reconnect in lock-step.
WATCH_TIMEOUT_RANGE_S = (300, 600)


class _Cached(NamedTuple):
    content: Any  # slice_content(): what the endpoints were parsed from
    endpoints: list[Endpoint]


class KubernetesProvider:
    """Lists then watches the ``kubernetes`` EndpointSlices; calls ``on_update`` on change."""

    def __init__(
        self,
        config: Config,
        on_update: Callable[[list[Endpoint]], None],
        metrics: Metrics,
        stop: threading.Event,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        sa_dir: str | None = None,
        sleep: Callable[[float], object] | None = None,
        watch_timeout_seconds: int | None = None,
        status: DiscoveryStatus | None = None,
    ) -> None:
        self._config = config
        self._on_update = on_update
        self._metrics = metrics
        self._stop = stop
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        self._sa_dir = sa_dir
        self._sleep = sleep if sleep is not None else stop.wait
        self._watch_timeout = watch_timeout_seconds
        # What /upstreams and the discovery gauges show; written only by this thread.
        self._status = status if status is not None else DiscoveryStatus(PROVIDER)
        self.backoff = Backoff(self._rng)
        self._client: KubeClient | None = None
        self._thread: threading.Thread | None = None
        self._stream_lock = threading.Lock()
        self._open_stream: WatchStream | None = None
        self._failed = False
        self._cache: dict[str, _Cached] = {}
        self._sent: list[Endpoint] | None = None
        self._rv = ""

    # -- lifecycle (main thread) -----------------------------------------------------

    def start(self) -> None:
        """Build the client; without one, log one warning and run static-only.

        Raises :class:`~extractedprism.kube.ClientConfigError` when a kubeconfig or service
        account exists but cannot be used (the caller isolates that failure).
        """
        if not self._config.enable_discovery:
            log.info("kubernetes discovery disabled by --enable-discovery=false")
            return
        client = build_client(self._config, self._sa_dir)
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
        if self._thread is None:
            return True
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("thread outlived its shutdown deadline thread=watcher timeout=%s", timeout)
            return False
        return True

    def is_healthy(self) -> bool:
        """False only when the watcher thread died of an unexpected error."""
        if self._thread is None:
            return True
        if self._thread.is_alive():
            return True
        return not self._failed

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the watcher thread ----------------------------------------------------------

    def _run(self) -> None:
        assert self._client is not None
        try:
            self._watch_forever(self._client)
        except Exception:
            if not self._stop.is_set():
                self._failed = True
                self._count_error()
                self._status.error("discovery thread failed; serving the last known endpoints")
                log.exception("kubernetes discovery failed; serving the last known endpoints")
        finally:
            self._client.close()
            log.info("watcher stopped")

    def _count_error(self) -> None:
        self._metrics.discovery_errors_total.labels(provider=PROVIDER).inc()

    def _wait(self, delay: float, why: str) -> None:
        log.info("watch backoff delay=%.3fs reason=%r", delay, why)
        self._sleep(delay)

    def _watch_forever(self, client: KubeClient) -> None:
        stop = self._stop
        need_list = True
        first_list = True
        watch_at_once_after_relist = False
        rewatch_after_long_clean = False  # the next watch is the re-open after a long one
        while not stop.is_set():
            if need_list:
                try:
                    self._list(client)
                except Exception as exc:
                    if stop.is_set():
                        return
                    self._count_error()
                    log.warning("endpointslice list failed error=%s", _describe(exc))
                    self._status.error(f"list failed: {_describe(exc)}")
                    self._wait(self.backoff.next_delay(), "list failed")
                    continue
                need_list = False
                if not first_list and not watch_at_once_after_relist:
                    self._wait(self.backoff.next_delay(), "re-list after 410")
                    if stop.is_set():
                        return
                first_list = False
                watch_at_once_after_relist = False
            opened = self._clock()
            try:
                self._stream(client)
            except Gone as exc:
                if stop.is_set():
                    return
                long_ = rewatch_after_long_clean or self._clock() - opened >= LONG_WATCH_S
                log.info("watch expired (410 Gone); re-listing error=%s after_long_watch=%s",
                         exc, long_)
                watch_at_once_after_relist = long_
                rewatch_after_long_clean = False
                need_list = True
                continue
            except Exception as exc:
                if stop.is_set():
                    return
                self._count_error()
                long_ = rewatch_after_long_clean or self._clock() - opened >= LONG_WATCH_S
                if long_:
                    self.backoff.reset()
                rewatch_after_long_clean = False
                log.warning("watch failed error=%s after_long_watch=%s", _describe(exc), long_)
                self._status.error(f"watch failed: {_describe(exc)}")
                self._wait(self.backoff.next_delay(), "watch failed")
                continue
            if stop.is_set():
                return
            if self._clock() - opened >= LONG_WATCH_S:
                rewatch_after_long_clean = True
                log.info("watch ended after a long watch; re-opening at once")
                continue
            rewatch_after_long_clean = False
            self._wait(self.backoff.next_delay(), "short watch ended")

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
        endpoints = union(c.endpoints for c in self._cache.values())
        if endpoints == self._sent:
            return
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
