"""The upstream registry: the table (:mod:`~extractedprism.upstreams.table`) and the rooms
acting on it, one policy each. Callers use the room that owns what they do:

* ``registry.picks`` (:mod:`.picks`): pipe threads pick and reserve upstreams;
* ``registry.conns`` (:mod:`.connections`): pipe threads attach and detach connections;
* ``registry.verdicts`` (:mod:`.verdicts`): probe threads and dials report results;
* ``registry.membership`` (:mod:`.membership`): discovery's endpoint list, the admin
  socket's marks, the ticker's deadlines;
* ``registry.stalls`` (:mod:`.stalls`): the ``conn-sampler`` thread;
* ``registry.rounds`` (:mod:`.rounds`): the ``rebalancer`` thread;
* the table itself: snapshots and the health server's reads.

Who may take a connection is one function, :func:`.eligibility.eligible`.
"""

from __future__ import annotations

from typing import Any

from extractedprism.upstreams.connections import Connections
from extractedprism.upstreams.membership import Membership
from extractedprism.upstreams.picks import Picks
from extractedprism.upstreams.rounds import Rounds
from extractedprism.upstreams.stalls import Stalls
from extractedprism.upstreams.table import Table
from extractedprism.upstreams.verdicts import Verdicts


class Registry(Table):
    """The table with its rooms (keyword arguments: :class:`Table`'s)."""

    def __init__(self, **flags: Any) -> None:
        super().__init__(**flags)
        self.picks = Picks(self)
        self.stalls = Stalls(self)
        self.verdicts = Verdicts(self, self.stalls)
        self.conns = Connections(self, self.verdicts)
        self.membership = Membership(self)
        self.rounds = Rounds(self, self.stalls)
