"""The two transports of discovery/kube.py against a recording TLS server: the in-cluster
one (urllib3, no ``kubernetes`` import) puts the same bytes on the wire as the
``kubernetes`` client does for a kubeconfig, and a fresh interpreter running in-cluster
discovery never imports the ``kubernetes`` package."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from extractedprism.config.endpoints import Endpoint
from extractedprism.config.table import Config
from extractedprism.discovery import kube
from tests.fakes.fake_apiserver import FakeApiServer

pytestmark = pytest.mark.timeout(60)


class Recorder:
    """Accepts TLS connections with the fake API server's certificate, records each
    request head and answers ``status`` with an empty body, closing the connection."""

    def __init__(self, api: FakeApiServer, status: int) -> None:
        self.api, self.status = api, status
        self.heads: list[bytes] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="test-recorder")
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                try:
                    tls = self.api.ssl_context.wrap_socket(conn, server_side=True)
                    head = b""
                    while b"\r\n\r\n" not in head:
                        chunk = tls.recv(4096)
                        if not chunk:
                            break
                        head += chunk
                    self.heads.append(head)
                    tls.sendall(b"HTTP/1.1 %d Nope\r\nContent-Length: 0\r\n"
                                b"Connection: close\r\n\r\n" % self.status)
                    tls.close()
                except OSError:
                    pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as fake:
        yield fake


def _calls(client: kube.KubeClient) -> list[str]:
    errors = []
    for call in (client.list_slices, lambda: client.watch("123", 300)):
        try:
            call()
        except kube.ApiError as exc:
            errors.append(f"{exc.status} {exc.reason}")
    client.close()
    return errors


def test_in_cluster_requests_are_the_kubernetes_clients(api: FakeApiServer,
                                                        tmp_path: Path) -> None:
    rec = Recorder(api, 500)
    try:
        sa = api.write_service_account(tmp_path / "sa")
        cfg = Config(endpoints=(Endpoint("127.0.0.1", 1),), bind_address="127.0.0.1",
                     bind_port=rec.port)
        in_cluster = kube.build_client(cfg, str(sa))
        assert isinstance(in_cluster, kube.KubeClient)
        assert isinstance(in_cluster.api, kube.InClusterApi)
        assert _calls(in_cluster) == ["500 Nope", "500 Nope"]
        # The same server as a kubeconfig, read by the kubernetes package, verified as
        # kubernetes.default.svc like the in-cluster client.
        kc = api.write_kubeconfig(tmp_path / "kc", server=f"https://127.0.0.1:{rec.port}",
                                  tls_server_name=kube.TLS_SERVER_NAME)
        by_kubeconfig = kube.build_client(cfg.replace(kubeconfig=str(kc)), str(sa))
        assert isinstance(by_kubeconfig, kube.KubeClient)
        assert isinstance(by_kubeconfig.api, kube.KubeconfigApi)
        assert _calls(by_kubeconfig) == ["500 Nope", "500 Nope"]
    finally:
        rec.close()
    assert len(rec.heads) == 4
    assert rec.heads[:2] == rec.heads[2:]  # byte for byte: request lines and headers
    assert rec.heads[0].startswith(
        b"GET /apis/discovery.k8s.io/v1/namespaces/default/endpointslices?"
        b"labelSelector=kubernetes.io/service-name%3Dkubernetes HTTP/1.1\r\n")
    assert b"\r\nauthorization: Bearer fake-sa-token\r\n" in rec.heads[0]
    assert rec.heads[1].startswith(
        b"GET /apis/discovery.k8s.io/v1/namespaces/default/endpointslices?"
        b"allowWatchBookmarks=true&labelSelector=kubernetes.io/service-name%3Dkubernetes"
        b"&resourceVersion=123&timeoutSeconds=300&watch=true HTTP/1.1\r\n")


def test_in_cluster_discovery_does_not_import_kubernetes(api: FakeApiServer,
                                                          tmp_path: Path) -> None:
    sa = api.write_service_account(tmp_path / "sa")
    code = textwrap.dedent(f"""
        import sys
        from extractedprism.config.endpoints import Endpoint
        from extractedprism.config.table import Config
        from extractedprism.discovery.kube import build_client
        cfg = Config(endpoints=(Endpoint("127.0.0.1", 1),), bind_address="127.0.0.1",
                     bind_port={api.port})
        client = build_client(cfg, {str(sa)!r})
        items, rv = client.list_slices()
        client.close()
        print(rv, "kubernetes" in sys.modules)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [str(api.resource_version), "False"]
