"""The readyz probe's kept connection against a real kube-apiserver (node client
certificate): one TLS connection carries many probes (the answer framed exactly), a 500
from an apiserver cut off from etcd keeps it, a frozen apiserver fails the probe within
the deadline and a killed one is reconnected to when it is back.

The probes run in the test process (ProbeConnections, what the ticker runs), so the
number of TLS connections opened is read exactly; bounds come from TIMEOUT and SLACK.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from extractedprism.checks.probes import ProbeConnections, ReadyzSettings
from extractedprism.config.endpoints import Endpoint
from tests.controlplane.conftest import MARKS, SLACK, TIMEOUT, require_control_plane, restore
from tests.util import wait_until

require_control_plane()
pytestmark = MARKS

SERVER_NAME = "kubernetes.default.svc"
N = 20


def settings(cp: Any) -> ReadyzSettings:
    return ReadyzSettings(ca_file=cp.ca, server_name=SERVER_NAME,
                          cert_file=str(cp.pki / "node.crt"), key_file=str(cp.pki / "node.key"))


@pytest.mark.timeout(300)
def test_real_apiserver_probes_share_one_kept_connection(cluster: Any) -> None:
    rz = settings(cluster)
    ep = Endpoint(cluster.ip("api1"), 6443)
    conns = ProbeConnections(max_age=3600.0)  # no probe here reaches it
    try:
        results = [conns.probe(ep, TIMEOUT, rz) for _ in range(N)]
        assert all(r.ok and r.ready is True for r in results), results
        assert conns.opened() == {str(ep): 1}

        # Cut off from etcd: /readyz answers 500 on the same connection, framed exactly.
        # Its etcd check waits for etcd up to its own timeout (2 s), longer than TIMEOUT:
        # these probes get a deadline that lets the answer come.
        cluster.partition_etcd("api1")
        last: list[Any] = []
        slow = 5.0

        def failing() -> bool:
            last[:] = [conns.probe(ep, slow, rz)]
            return last[0].ready is False

        wait_until(failing, 60 + slow, interval=0.5)
        assert last[0].ok and last[0].ready_reason == "HTTP 500", last
        assert conns.opened() == {str(ep): 1}
        cluster.heal("api1")
        wait_until(lambda: conns.probe(ep, slow, rz).ready is True, 60, interval=0.5)
        assert conns.opened() == {str(ep): 1}

        # Frozen: the TCP check passes (the kernel accepts), the kept connection does not
        # answer within the deadline; the probe fails and the connection is replaced.
        cluster.stop("api1")
        try:
            t0 = time.monotonic()
            r = conns.probe(ep, TIMEOUT, rz)
            took = time.monotonic() - t0
            assert r.ok and r.ready is False and r.ready_reason == "timeout", r
            assert took <= TIMEOUT + SLACK, took
        finally:
            cluster.cont("api1")
        wait_until(lambda: conns.probe(ep, TIMEOUT, rz).ready is True, 30, interval=0.5)
        assert conns.opened() == {str(ep): 2}

        # Killed and started again: the dead connection is replaced without a failure
        # once the server answers again.
        cluster.kill("api1")
        cluster.start("api1", cluster.extra_args("api1"))
        cluster.wait_ready(["api1"], timeout=90, in_slice=False)
        r = conns.probe(ep, TIMEOUT, rz)
        assert r.ok and r.ready is True, r
        assert conns.opened() == {str(ep): 3}
    finally:
        conns.close()
        restore(cluster)
