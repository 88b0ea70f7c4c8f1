"""Merged discovery provider: combines provider lists, dedupes, never sends empty.

Owns the latest endpoint list of every provider ("static" from the main thread at
start-up, "cache" from the state file at start-up, "kubernetes" from the watcher
thread) and the merged list last handed to ``apply`` (the registry), with each
endpoint's :class:`~extractedprism.upstreams.roles.Roles`: the providers that list it,
and whether it is a static endpoint kept only as a last resort
(``--static-endpoints=fallback``: once discovery has produced a non-empty list, static
endpoints missing from it). One lock serialises updates so two providers can never
apply their merges out of order; ``apply`` must be short and do no I/O (registry
methods are). An empty merge is skipped, so a discovery hiccup can never route to zero
backends.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from extractedprism.config.endpoints import Endpoint
from extractedprism.health.metrics import Metrics
from extractedprism.upstreams.roles import Roles

log = logging.getLogger(__name__)

STATIC = "static"
KUBERNETES = "kubernetes"
CACHE = "cache"
_ORDER = (STATIC, KUBERNETES, CACHE)


class Merger:
    """Keeps each provider's latest list and applies the deduplicated union on change."""

    def __init__(self, apply: Callable[[list[Endpoint], Roles], None], metrics: Metrics,
                 *, static_mode: str = "always",
                 apply_roles: Callable[[Roles], None] | None = None) -> None:
        # ``apply``: a changed list (with its roles); ``apply_roles``: the same list
        # whose roles changed (another provider lists an endpoint, a static one is
        # demoted or promoted), which is not an endpoint update.
        self._apply = apply
        self._apply_roles = apply_roles
        self._metrics = metrics
        self._static_mode = static_mode
        self._lock = threading.Lock()
        self._lists: dict[str, list[Endpoint]] = {}
        self._applied: tuple[list[Endpoint], Roles] | None = None

    def update(self, provider: str, endpoints: Sequence[Endpoint], *,
               drop: Sequence[str] = ()) -> None:
        """Record ``provider``'s full list (and forget the providers in ``drop``) and
        apply the merged list if it or its roles changed, in one step."""
        self._metrics.discovery_updates_total.labels(provider=provider).inc()
        with self._lock:
            self._lists[provider] = list(endpoints)
            for gone in drop:
                self._lists.pop(gone, None)
            merged = self._merge()
            if not merged:
                log.warning(
                    "discovery update skipped provider=%s reason=%r",
                    provider,
                    "merged endpoint list would be empty",
                )
                return
            roles = self._roles(merged)
            if self._applied is not None and merged == self._applied[0]:
                if roles != self._applied[1] and self._apply_roles is not None:
                    self._applied = (merged, roles)
                    self._apply_roles(roles)
                log.debug("discovery update unchanged provider=%s", provider)
                return
            self._applied = (merged, roles)
            log.info(
                "endpoints updated provider=%s endpoints=%s%s",
                provider,
                ",".join(str(e) for e in merged),
                f" fallback={','.join(sorted(roles.fallback))}" if roles.fallback else "",
            )
            self._apply(list(merged), roles)

    def _roles(self, merged: list[Endpoint]) -> Roles:
        providers = sorted(self._lists, key=_provider_rank)
        listing = {p: set(self._lists[p]) for p in providers}
        sources = {str(ep): tuple(p for p in providers if ep in listing[p]) for ep in merged}
        fallback: frozenset[str] = frozenset()
        discovered = listing.get(KUBERNETES)
        if self._static_mode == "fallback" and discovered:
            fallback = frozenset(str(ep) for ep in self._lists.get(STATIC, ())
                                 if ep not in discovered)
        return Roles(sources=sources, fallback=fallback)

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


def _provider_rank(provider: str) -> tuple[int, str]:
    return (_ORDER.index(provider) if provider in _ORDER else len(_ORDER), provider)
