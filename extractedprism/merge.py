"""Merged discovery provider: combines provider lists, dedupes, never sends empty.

Owns the latest endpoint list of every provider ("static" from the main thread at
start-up, "kubernetes" from the watcher thread) and the merged list last handed to
``apply`` (the registry). One lock serialises updates so two providers can never apply
their merges out of order; ``apply`` must be short and do no I/O (registry methods are).
An empty merge is skipped, so a discovery hiccup can never route to zero backends.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from extractedprism.endpoints import Endpoint
from extractedprism.metrics import Metrics

log = logging.getLogger(__name__)

STATIC = "static"


class Merger:
    """Keeps each provider's latest list and applies the deduplicated union on change."""

    def __init__(self, apply: Callable[[list[Endpoint]], None], metrics: Metrics) -> None:
        self._apply = apply
        self._metrics = metrics
        self._lock = threading.Lock()
        self._lists: dict[str, list[Endpoint]] = {}
        self._applied: list[Endpoint] | None = None

    def update(self, provider: str, endpoints: Sequence[Endpoint]) -> None:
        """Record ``provider``'s full list and apply the merged list if it changed."""
        self._metrics.discovery_updates_total.labels(provider=provider).inc()
        with self._lock:
            self._lists[provider] = list(endpoints)
            merged = self._merge()
            if not merged:
                log.warning(
                    "discovery update skipped provider=%s reason=%r",
                    provider,
                    "merged endpoint list would be empty",
                )
                return
            if merged == self._applied:
                log.debug("discovery update unchanged provider=%s", provider)
                return
            self._applied = merged
            log.info(
                "endpoints updated provider=%s endpoints=%s",
                provider,
                ",".join(str(e) for e in merged),
            )
            self._apply(list(merged))

    def _merge(self) -> list[Endpoint]:
        order = [STATIC] if STATIC in self._lists else []
        order += [p for p in self._lists if p != STATIC]
        seen: set[Endpoint] = set()
        merged: list[Endpoint] = []
        for provider in order:
            for ep in self._lists[provider]:
                if ep not in seen:
                    seen.add(ep)
                    merged.append(ep)
        return merged
