"""Every file discovery reads at run time is re-read when it changes (issue 29 item 2
and its class): the service account's CA and token in a cluster; a kubeconfig's CA,
client certificate and key, token file, and the kubeconfig itself, with the proxy
running as a real process. The fake API server switches to a new serving CA, a new
client CA or a new token at the moment the files are rotated, and cuts every live
connection, so discovery must connect again with what the files say now."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import pytest
import trustme

from tests.fakes.fake_apiserver import FakeApiServer, make_slice
from tests.net.test_watch import Harness
from tests.process.proxyproc import start_proxy
from tests.util import http, wait_until

pytestmark = pytest.mark.timeout(120)

ERRORS = 'extractedprism_discovery_errors_total{provider="kubernetes"}'


def replace(path: Path, data: bytes) -> None:
    """Write as rotation tools do: a new file renamed over the old one."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def test_in_cluster_ca_and_token_rotation_is_picked_up(tmp_path: Path) -> None:
    with FakeApiServer(token="old-token") as api:
        api.set_slice(make_slice("kubernetes", ["10.0.0.1"]))
        sa = api.write_service_account(tmp_path / "sa")
        h = Harness(api, sa)
        h.provider.start()
        try:
            h.wait_watches(1)
            # The cluster CA rotates: ca.crt first (the kubelet updates the projected
            # volume), then the server presents a certificate only the new CA verifies.
            new_ca = trustme.CA()
            replace(sa / "ca.crt", new_ca.cert_pem.bytes())
            api.rotate_ca(new_ca)
            api.set_slice(make_slice("kubernetes", ["10.0.0.2"]))
            wait_until(lambda: h.last_endpoints() == ["10.0.0.2:6443"], 15,
                       message="discovery through the rotated CA")
            # The token rotates: the file, then the server wants the new one only.
            replace(sa / "token", b"new-token\n")
            api.set_tokens("new-token")
            api.drop_streams()
            api.set_slice(make_slice("kubernetes", ["10.0.0.3"]))
            wait_until(lambda: h.last_endpoints() == ["10.0.0.3:6443"], 15,
                       message="discovery with the rotated token")
            assert h.errored == []
            assert api.requests[-1].authorized
        finally:
            assert h.provider.stop_and_join(5)


def client_pair(ca: trustme.CA) -> tuple[bytes, bytes]:
    """(certificate, key) PEM of a node's client certificate signed by ``ca``."""
    leaf = ca.issue_cert("n1.nodes.test", common_name="system:node:n1")
    return leaf.cert_chain_pems[0].bytes(), leaf.private_key_pem.bytes()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def write_kubeconfig(path: Path, server: str, cluster: dict[str, Any],
                     user: dict[str, Any]) -> None:
    cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "c",
           "clusters": [{"name": "k", "cluster": {"server": server, **cluster}}],
           "users": [{"name": "u", "user": user}],
           "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}
    replace(path, json.dumps(cfg, indent=1).encode())


def upstream_addresses(health: int) -> set[str]:
    try:
        doc = json.loads(http(("127.0.0.1", health), "/upstreams", timeout=5)[2])
    except (OSError, ValueError):
        return set()
    return {u["address"] for u in doc["upstreams"]}


def errors(health: int) -> float:
    body = http(("127.0.0.1", health), "/metrics", timeout=5)[2].decode()
    for line in body.splitlines():
        if line.startswith(ERRORS):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.fd_leak_ok("the fake API server's watch connections close with its threads")
def test_kubeconfig_files_rotated_while_the_proxy_runs(tmp_path: Path) -> None:
    """CA file, token file, client certificate and key (files, then embedded), and the
    kubeconfig itself: each rotated while a real proxy process watches; each time a
    slice change made after the rotation reaches the proxy, with no discovery error."""
    with FakeApiServer(token="token-1") as api:
        api.set_slice(make_slice("kubernetes", ["127.0.0.11"], port=6443))
        kc, ca, token = tmp_path / "kubeconfig", tmp_path / "ca.pem", tmp_path / "token"
        cert, key = tmp_path / "client.pem", tmp_path / "client.key"
        replace(ca, api.ca_pem())
        replace(token, b"token-1")
        # Relative paths: from the kubeconfig's directory, as client-go reads them.
        write_kubeconfig(kc, api.url, {"certificate-authority": "ca.pem"},
                         {"tokenFile": "token"})
        proxy = start_proxy(tmp_path, "--endpoints", f"127.0.0.1:{api.port}",
                            "--kubeconfig", str(kc))
        step = 11

        def discovered_after(what: str) -> None:
            nonlocal step
            step += 1
            api.set_slice(make_slice("kubernetes", [f"127.0.0.{step}"], port=6443))
            wait_until(lambda: f"127.0.0.{step}:6443" in upstream_addresses(proxy.health),
                       20, message=f"discovery after {what}")

        try:
            wait_until(lambda: "127.0.0.11:6443" in upstream_addresses(proxy.health), 20,
                       message="discovery")
            # The serving CA.
            new_ca = trustme.CA()
            replace(ca, new_ca.cert_pem.bytes())
            api.rotate_ca(new_ca)
            discovered_after("the CA file rotated")
            # The token file.
            replace(token, b"token-2\n")
            api.set_tokens("token-2")
            api.drop_streams()
            discovered_after("the token file rotated")
            # Client certificates: the kubeconfig itself changes to name them.
            client_ca = trustme.CA()
            cert_pem, key_pem = client_pair(client_ca)
            replace(cert, cert_pem)
            replace(key, key_pem)
            write_kubeconfig(kc, api.url, {"certificate-authority": "ca.pem"},
                             {"client-certificate": "client.pem", "client-key": "client.key"})
            api.require_client_ca(client_ca)
            discovered_after("the kubeconfig changed to a client certificate")
            # The client certificate and key, rotated to a new client CA's.
            client_ca = trustme.CA()
            cert_pem, key_pem = client_pair(client_ca)
            replace(key, key_pem)
            replace(cert, cert_pem)
            api.require_client_ca(client_ca)
            discovered_after("the client certificate and key rotated")
            # Embedded data: the kubeconfig carries the CA, certificate and key itself.
            new_ca, client_ca = trustme.CA(), trustme.CA()
            cert_pem, key_pem = client_pair(client_ca)
            write_kubeconfig(kc, api.url,
                             {"certificate-authority-data": b64(new_ca.cert_pem.bytes())},
                             {"client-certificate-data": b64(cert_pem),
                              "client-key-data": b64(key_pem)})
            api.rotate_ca(new_ca)
            api.require_client_ca(client_ca)
            discovered_after("the kubeconfig's embedded data rotated")
            assert errors(proxy.health) == 0, proxy.stderr()
        finally:
            proxy.stop()
        assert "Traceback" not in proxy.stderr()


@pytest.mark.fd_leak_ok("the fake API server's watch connections close with its threads")
def test_a_plugin_users_kubeconfig_files_rotated_while_the_proxy_runs(tmp_path: Path) -> None:
    """A user with an exec plugin goes through the kubernetes package, which reads the
    kubeconfig and its CA file once per client it makes: the CA file rotated, then the
    kubeconfig changed to another plugin's token, each reach the next request (a slice
    change made after the rotation reaches the proxy), with no discovery error."""
    plugin = tmp_path / "plugin"

    def plugin_says(token: str) -> None:
        cred = {"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
                "status": {"token": token}}
        replace(plugin, f"#!/bin/sh\necho '{json.dumps(cred)}'\n".encode())
        plugin.chmod(0o755)

    def user(arg: str) -> dict[str, Any]:
        return {"exec": {"apiVersion": "client.authentication.k8s.io/v1",
                         "command": str(plugin), "args": [arg], "interactiveMode": "Never"}}

    with FakeApiServer(token="token-1") as api:
        api.set_slice(make_slice("kubernetes", ["127.0.0.11"], port=6443))
        kc, ca = tmp_path / "kubeconfig", tmp_path / "ca.pem"
        replace(ca, api.ca_pem())
        plugin_says("token-1")
        write_kubeconfig(kc, api.url, {"certificate-authority": "ca.pem"}, user("one"))
        proxy = start_proxy(tmp_path, "--endpoints", f"127.0.0.1:{api.port}",
                            "--kubeconfig", str(kc))
        step = 11

        def discovered_after(what: str) -> None:
            nonlocal step
            step += 1
            api.set_slice(make_slice("kubernetes", [f"127.0.0.{step}"], port=6443))
            wait_until(lambda: f"127.0.0.{step}:6443" in upstream_addresses(proxy.health),
                       20, message=f"discovery after {what}: {proxy.stderr()[-2000:]}")

        try:
            wait_until(lambda: "127.0.0.11:6443" in upstream_addresses(proxy.health), 20,
                       message=f"discovery: {proxy.stderr()[-2000:]}")
            assert "reader=kubernetes-package" in proxy.stderr()
            # The serving CA: the file first, then the server presents the new one only.
            new_ca = trustme.CA()
            replace(ca, new_ca.cert_pem.bytes())
            api.rotate_ca(new_ca)
            discovered_after("the CA file rotated")
            # The kubeconfig itself: the plugin is called with other arguments and the
            # server wants another token.
            plugin_says("token-2")
            write_kubeconfig(kc, api.url, {"certificate-authority": "ca.pem"}, user("two"))
            api.set_tokens("token-2")
            api.drop_streams()
            discovered_after("the kubeconfig changed")
            assert errors(proxy.health) == 0, proxy.stderr()
        finally:
            proxy.stop()
        assert "Traceback" not in proxy.stderr()
