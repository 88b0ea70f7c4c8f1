"""The transports of discovery/kube.py against a recording TLS server: our own client
(http.client, neither ``kubernetes`` nor urllib3 imported), in a cluster and with a
kubeconfig, behaves as the ``kubernetes`` client (urllib3; what a kubeconfig with an
exec plugin still uses) does: the same bytes on the wire, the same retries of a request
without an answer and of a Retry-After, the same reuse of a kept-alive connection; and
a fresh interpreter running discovery, in a cluster or with a kubeconfig, imports
neither package."""

from __future__ import annotations

import json
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
from tests.util import read_head, wait_until

pytestmark = pytest.mark.timeout(60)


NOPE = (b"HTTP/1.1 500 Nope\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
LIST = json.dumps({"kind": "EndpointSliceList", "metadata": {"resourceVersion": "7"},
                   "items": []}).encode()
LIST_KEPT = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
             b"Content-Length: %d\r\n\r\n%s" % (len(LIST), LIST))
# Kept alive by its headers, but the server closes the connection right after it.
LIST_THEN_GONE = LIST_KEPT.replace(b"200 OK\r\n", b"200 OK\r\nX-Then: hang-up\r\n")
THROTTLED = (b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 0\r\nContent-Length: 2\r\n"
             b"\r\n{}")
HANG_UP = b""  # read the request, answer nothing, close


class Recorder:
    """Accepts TLS connections with the fake API server's certificate, records each
    request head and answers from ``answers`` in turn (the last one for ever after),
    keeping a connection open for the next request unless the answer closes it."""

    def __init__(self, api: FakeApiServer, answers: list[bytes]) -> None:
        self.api, self.answers = api, list(answers)
        self.heads: list[bytes] = []
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="test-recorder")
        self.thread.start()

    def _answer(self) -> bytes:
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            with conn:
                conn.settimeout(5)
                try:
                    tls = self.api.ssl_context.wrap_socket(conn, server_side=True)
                    self._requests(tls)
                    tls.close()
                except OSError:
                    pass

    def _requests(self, tls: socket.socket) -> None:
        while True:
            head = read_head(tls)
            if head is None:
                return
            self.heads.append(head)
            answer = self._answer()
            if answer == HANG_UP:
                return
            tls.sendall(answer)
            if b"Connection: close" in answer or b"X-Then: hang-up" in answer:
                return

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
    rec = Recorder(api, [NOPE])
    try:
        sa = api.write_service_account(tmp_path / "sa")
        cfg = Config(endpoints=(Endpoint("127.0.0.1", 1),), bind_address="127.0.0.1",
                     bind_port=rec.port)
        in_cluster = kube.build_client(cfg, str(sa))
        assert isinstance(in_cluster, kube.KubeClient)
        assert isinstance(in_cluster.api, kube.HttpApi)
        assert _calls(in_cluster) == ["500 Nope", "500 Nope"]
        # The same server as a kubeconfig, read by our own kubeconfig reader, verified as
        # kubernetes.default.svc like the in-cluster client.
        kc = api.write_kubeconfig(tmp_path / "kc", server=f"https://127.0.0.1:{rec.port}",
                                  tls_server_name=kube.TLS_SERVER_NAME)
        by_kubeconfig = kube.build_client(cfg.replace(kubeconfig=str(kc)), str(sa))
        assert isinstance(by_kubeconfig, kube.KubeClient)
        assert isinstance(by_kubeconfig.api, kube.HttpApi)
        assert _calls(by_kubeconfig) == ["500 Nope", "500 Nope"]
        # And read by the kubernetes package (the exec-plugin path).
        assert _calls(kube.KubeClient(kube.PluginApi(str(kc)))) == ["500 Nope", "500 Nope"]
    finally:
        rec.close()
    assert len(rec.heads) == 6
    # byte for byte: request lines and headers
    assert rec.heads[:2] == rec.heads[2:4] == rec.heads[4:]
    assert rec.heads[0].startswith(
        b"GET /apis/discovery.k8s.io/v1/namespaces/default/endpointslices?"
        b"labelSelector=kubernetes.io/service-name%3Dkubernetes HTTP/1.1\r\n")
    assert b"\r\nauthorization: Bearer fake-sa-token\r\n" in rec.heads[0]
    assert rec.heads[1].startswith(
        b"GET /apis/discovery.k8s.io/v1/namespaces/default/endpointslices?"
        b"allowWatchBookmarks=true&labelSelector=kubernetes.io/service-name%3Dkubernetes"
        b"&resourceVersion=123&timeoutSeconds=300&watch=true HTTP/1.1\r\n")


def _both(api: FakeApiServer, tmp_path: Path, answers: list[bytes]
          ) -> Iterator[tuple[kube.KubeClient, Recorder]]:
    """The in-cluster client, the kubeconfig one, then the kubernetes package's, each
    with a fresh recorder."""
    sa = api.write_service_account(tmp_path / "sa")
    for transport in ("in-cluster", "kubeconfig", "kubernetes-package"):
        rec = Recorder(api, answers)
        try:
            cfg = Config(endpoints=(Endpoint("127.0.0.1", 1),), bind_address="127.0.0.1",
                         bind_port=rec.port)
            kc = api.write_kubeconfig(tmp_path / "kc", server=f"https://127.0.0.1:{rec.port}",
                                      tls_server_name=kube.TLS_SERVER_NAME)
            if transport == "kubeconfig":
                cfg = cfg.replace(kubeconfig=str(kc))
            client = (kube.KubeClient(kube.PluginApi(str(kc)))
                      if transport == "kubernetes-package" else kube.build_client(cfg, str(sa)))
            assert client is not None
            try:
                yield client, rec
            finally:
                client.close()
        finally:
            rec.close()


# The kubernetes client keeps the connection of a request that failed (see
# test_discovery_e2e); freed with the exception, not a leak of the proxy's.
@pytest.mark.fd_leak_ok("kubernetes client connections of failed requests")
def test_a_request_without_an_answer_is_tried_again_three_times(
        api: FakeApiServer, tmp_path: Path) -> None:
    outcomes = []
    for client, rec in _both(api, tmp_path, [HANG_UP]):
        with pytest.raises(Exception) as exc:  # each transport raises its own type
            client.list_slices()
        outcomes.append((len(rec.heads), rec.connections))
        assert not isinstance(exc.value, kube.ApiError)
    assert outcomes == [(4, 4)] * 3  # urllib3's Retry(3): four attempts, then fail


def test_retry_after_is_waited_then_tried_again(api: FakeApiServer, tmp_path: Path) -> None:
    outcomes = []
    for client, rec in _both(api, tmp_path, [THROTTLED, THROTTLED, NOPE]):
        with pytest.raises(kube.ApiError) as exc:
            client.list_slices()
        outcomes.append((exc.value.status, len(rec.heads)))
    assert outcomes == [(500, 3)] * 3


def test_a_kept_alive_connection_is_reused(api: FakeApiServer, tmp_path: Path) -> None:
    outcomes = []
    for client, rec in _both(api, tmp_path, [LIST_KEPT]):
        assert client.list_slices() == ([], "7")
        assert client.list_slices() == ([], "7")
        outcomes.append((len(rec.heads), rec.connections))
    assert outcomes == [(2, 1)] * 3


def test_a_connection_the_server_closed_is_not_reused(api: FakeApiServer,
                                                      tmp_path: Path) -> None:
    outcomes = []
    for client, rec in _both(api, tmp_path, [LIST_THEN_GONE]):
        assert client.list_slices() == ([], "7")
        wait_until(lambda rec=rec: rec.connections == 1 and len(rec.heads) == 1, 5)
        # No error: a fresh connection (found closed before use, or failing on use and
        # tried again: the server sees the same either way).
        assert client.list_slices() == ([], "7")
        outcomes.append((len(rec.heads), rec.connections))
    assert outcomes == [(2, 2)] * 3


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
        print(rv, "kubernetes" in sys.modules, "urllib3" in sys.modules)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [str(api.resource_version), "False", "False"]
