"""Merging the discovery providers' lists: a pure function and the stateful merger.

* :func:`merge` (pure): the providers' latest lists in, the deduplicated union and each
  address's :class:`~extractedprism.upstreams.roles.Roles` out (the providers that list
  it, and whether it is a static endpoint kept only as a last resort:
  ``--static-endpoints=fallback``, once discovery has produced a non-empty list, static
  endpoints missing from it). No state, no lock, no I/O: tested from tables.
* :class:`Merger` (stateful): keeps the latest list of every provider ("static" from
  the main thread at start-up, "cache" from the state file at start-up, "kubernetes"
  from the watcher thread) and the merged list last handed to ``apply`` (the registry),
  and on every update calls :func:`merge` and hands on what changed. One lock
  serialises updates so two providers can never apply their merges out of order;
  ``apply`` must be short and do no I/O (registry methods are). An empty merge is
  skipped, so a discovery hiccup can never route to zero backends.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence

from extractedprism.config.endpoints import Endpoint
from extractedprism.upstreams.roles import Roles

log = logging.getLogger(__name__)

STATIC = "static"
KUBERNETES = "kubernetes"
CACHE = "cache"
_ORDER = (STATIC, KUBERNETES, CACHE)


def merge(lists: Mapping[str, Sequence[Endpoint]], *, static_mode: str = "always"
          ) -> tuple[list[Endpoint], Roles]:
    """The union of every provider's list without duplicates, and its roles (pure).

    Static endpoints come first, then the other providers' in the order of ``lists``
    (the order they first reported in); each endpoint keeps its first place. A role's
    sources are in provider order (static, kubernetes, cache, then any other by name)."""
    order = [STATIC] if STATIC in lists else []
    order += [p for p in lists if p != STATIC]
    seen: set[Endpoint] = set()
    merged: list[Endpoint] = []
    for provider in order:
        for ep in lists[provider]:
            if ep not in seen:
                seen.add(ep)
                merged.append(ep)
    providers = sorted(lists, key=_provider_rank)
    listing = {p: set(lists[p]) for p in providers}
    sources = {str(ep): tuple(p for p in providers if ep in listing[p]) for ep in merged}
    fallback: frozenset[str] = frozenset()
    discovered = listing.get(KUBERNETES)
    if static_mode == "fallback" and discovered:
        fallback = frozenset(str(ep) for ep in lists.get(STATIC, ()) if ep not in discovered)
    return merged, Roles(sources=sources, fallback=fallback)


def _provider_rank(provider: str) -> tuple[int, str]:
    return (_ORDER.index(provider) if provider in _ORDER else len(_ORDER), provider)


class Merger:
    """Keeps each provider's latest list and applies the deduplicated union on change
    (stateful: its lock guards the lists and the last merge applied)."""

    def __init__(self, apply: Callable[[list[Endpoint], Roles], None],
                 on_update: Callable[[str], None], *, static_mode: str = "always",
                 apply_roles: Callable[[Roles], None] | None = None) -> None:
        # ``apply``: a changed list (with its roles); ``apply_roles``: the same list
        # whose roles changed (another provider lists an endpoint, a static one is
        # demoted or promoted), which is not an endpoint update. ``on_update``: told
        # the provider's name of every update received, changed or not (the app counts
        # discovery_updates_total with it).
        self._apply = apply
        self._apply_roles = apply_roles
        self._on_update = on_update
        self._static_mode = static_mode
        self._lock = threading.Lock()
        self._lists: dict[str, list[Endpoint]] = {}
        self._applied: tuple[list[Endpoint], Roles] | None = None

    def update(self, provider: str, endpoints: Sequence[Endpoint], *,
               drop: Sequence[str] = ()) -> None:
        """Record ``provider``'s full list (and forget the providers in ``drop``) and
        apply the merged list if it or its roles changed, in one step."""
        self._on_update(provider)
        with self._lock:
            self._lists[provider] = list(endpoints)
            for gone in drop:
                self._lists.pop(gone, None)
            merged, roles = merge(self._lists, static_mode=self._static_mode)
            if not merged:
                log.warning(
                    "discovery update skipped provider=%s reason=%r",
                    provider,
                    "merged endpoint list would be empty",
                )
                return
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
