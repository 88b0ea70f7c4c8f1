"""Roles: what the registry is told about each address of a merged endpoint list.

The discovery merger (:mod:`extractedprism.discovery.merge`) computes them and hands
them to :meth:`~extractedprism.upstreams.membership.Membership.set_endpoints` and
:meth:`~extractedprism.upstreams.membership.Membership.set_roles`; they live here, with their
consumer, so the upstreams package needs nothing from discovery.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Roles:
    """Per address of a merged list: the providers listing it (in the merger's provider
    order), and the static ones demoted to a last resort."""

    sources: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    fallback: frozenset[str] = frozenset()
