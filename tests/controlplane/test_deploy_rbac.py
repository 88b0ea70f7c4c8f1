"""The deployment's RBAC against a real kube-apiserver (Node,RBAC): what the chart grants
and what docs/deploy.md tells static-pod and systemd operators to create let discovery read
the EndpointSlices in ``default`` and nothing else, while the node's own credentials cannot
read them at all (the reason the static pod needs its own identity)."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from typing import Any

import pytest
import yaml

from tests.controlplane.conftest import cpmod
from tests.deploy.helpers import ENDPOINTS, render
from tests.util import ROOT

# Rendered at import: the first call into Helm's Go runtime opens descriptors it keeps for
# the process's life, which a test's fd-leak guard would blame on that test.
CHART_DOCS = render({"endpoints": ENDPOINTS})[0]
SLICES = "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"
PATHS = {
    "POST ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
    "POST Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    "POST RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
}


def _raw(cluster: Any, path: str, token: str | None = None, cert: str | None = None
         ) -> int:
    req = urllib.request.Request(f"https://{cluster.endpoint('api1')}{path}")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    ctx = cluster.ssl_context()
    if cert:
        ctx.load_cert_chain(str(cluster.pki / f"{cert}.crt"), str(cluster.pki / f"{cert}.key"))
    try:
        with cpmod._sni_opener(ctx).open(req, timeout=10) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        exc.read()
        return int(exc.code)


def _apply(cluster: Any, docs: list[dict[str, Any]]) -> list[str]:
    """Create the objects (as admin); return their paths for the clean-up."""
    made = []
    for doc in docs:
        ns = doc["metadata"]["namespace"]
        path = PATHS[f"POST {doc['kind']}"].format(ns=ns)
        status, body = cluster.request("api1", path, method="POST", body=doc)
        assert status in (201, 409), (doc["kind"], status, body)
        made.append(f"{path}/{doc['metadata']['name']}")
    return made


def _token(cluster: Any, namespace: str, name: str) -> str:
    status, body = cluster.request(
        "api1", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token", method="POST",
        body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
              "spec": {"expirationSeconds": 600}})
    assert status == 201, (status, body)
    return str(body["status"]["token"])


def _reads_slices_in_default_only(cluster: Any, token: str) -> None:
    assert _raw(cluster, SLICES.format(ns="default"), token) == 200
    assert _raw(cluster, SLICES.format(ns="default")
                + "?labelSelector=kubernetes.io%2Fservice-name%3Dkubernetes", token) == 200
    assert _raw(cluster, SLICES.format(ns="default") + "?watch=1&timeoutSeconds=1",
                token) == 200
    # Nothing else: other namespaces, cluster-wide, secrets, nodes.
    assert _raw(cluster, SLICES.format(ns="kube-system"), token) == 403
    assert _raw(cluster, "/apis/discovery.k8s.io/v1/endpointslices", token) == 403
    assert _raw(cluster, "/api/v1/namespaces/default/secrets", token) == 403
    assert _raw(cluster, "/api/v1/nodes", token) == 403


def _cleanup(cluster: Any, paths: list[str]) -> None:
    for path in reversed(paths):
        cluster.request("api1", path, method="DELETE")


@pytest.mark.timeout(60)
def test_node_credentials_cannot_read_endpointslices(cluster) -> None:
    # CN=system:node:<name>, O=system:nodes: the Node authorizer's static rules have no
    # discovery.k8s.io, and RBAC binds nothing to nodes.
    assert _raw(cluster, SLICES.format(ns="default"), cert="node") == 403
    assert _raw(cluster, "/api/v1/namespaces/default/services", cert="node") == 200


@pytest.mark.timeout(60)
def test_the_charts_service_account_reads_the_slices_and_nothing_else(cluster) -> None:
    docs = [d for d in CHART_DOCS if d["kind"] in ("ServiceAccount", "Role", "RoleBinding")]
    assert sorted(d["kind"] for d in docs) == ["Role", "RoleBinding", "ServiceAccount"]
    made = _apply(cluster, docs)
    try:
        sa = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]
        _reads_slices_in_default_only(cluster, _token(cluster, sa["namespace"], sa["name"]))
    finally:
        _cleanup(cluster, made)


def _docs_recipe() -> list[dict[str, Any]]:
    text = (ROOT / "docs" / "deploy.md").read_text()
    section = text.split("#### Least-privilege discovery", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block, "the RBAC recipe block in docs/deploy.md"
    return [d for d in yaml.safe_load_all(block.group(1)) if d]


@pytest.mark.timeout(60)
def test_the_documented_static_pod_identity_reads_the_slices_and_nothing_else(cluster) -> None:
    docs = _docs_recipe()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["Role", "RoleBinding", "Secret", "ServiceAccount"], kinds
    # The long-lived token Secret is filled by kube-controller-manager, which this control
    # plane does not run; a TokenRequest for the same ServiceAccount carries the same identity.
    made = _apply(cluster, [d for d in docs if d["kind"] != "Secret"])
    try:
        sa = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]
        _reads_slices_in_default_only(cluster, _token(cluster, sa["namespace"], sa["name"]))
    finally:
        _cleanup(cluster, made)
    assert json.dumps(docs)  # plain data, as kubectl apply would take it
