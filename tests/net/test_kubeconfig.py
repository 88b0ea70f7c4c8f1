"""--kubeconfig read by our own reader (discovery/credentials.py), without the
``kubernetes`` package: every form a node's kubeconfig takes, against the fake API
server with real TLS (CAs made at run time); a bad kubeconfig is one clear line naming
the file and what is wrong, and stops start-up with exit 2; a file it refers to that is
not there yet fails requests (naming it) until it appears; only a plugin user loads
the ``kubernetes`` package."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme

from extractedprism.config.endpoints import Endpoint
from extractedprism.config.table import Config
from extractedprism.discovery import credentials, kube
from extractedprism.discovery.credentials import KubeconfigError
from tests.fakes.fake_apiserver import FakeApiServer, make_slice
from tests.logcheck import parse_logfmt
from tests.net.test_watch import Harness
from tests.process.proxyproc import start_proxy
from tests.util import free_ports, run_cli, wait_until

pytestmark = pytest.mark.timeout(60)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def write(path: Path, cluster: dict[str, Any], user: dict[str, Any] | None,
          **top: Any) -> Path:
    cfg: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": cluster}],
        "users": [{"name": "u", "user": user or {}}],
        "contexts": [{"name": "c", "context": {"cluster": "k",
                                               **({"user": "u"} if user is not None else {})}}],
    }
    cfg.update(top)
    path.write_text(json.dumps(cfg))
    return path


def client(path: Path) -> kube.KubeClient:
    cfg = Config(endpoints=(Endpoint("127.0.0.1", 1),), kubeconfig=str(path))
    made = kube.build_client(cfg, "/nonexistent")
    assert made is not None
    return made


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer(token="t0k3n") as fake:
        fake.set_slice(make_slice("kubernetes", ["10.0.0.1"]))
        yield fake


def pair(ca: trustme.CA) -> tuple[bytes, bytes]:
    leaf = ca.issue_cert("n1.nodes.test", common_name="system:node:n1")
    return leaf.cert_chain_pems[0].bytes(), leaf.private_key_pem.bytes()


FORMS = ["ca-file-absolute+token", "ca-file-relative+tokenFile-relative", "ca-data+token",
         "insecure+token", "tls-server-name", "client-cert-files", "client-cert-data",
         "client-cert-and-key-in-one-file"]


@pytest.mark.parametrize("form", FORMS)
def test_each_kubeconfig_form_lists_from_the_fake_api_server(
        api: FakeApiServer, tmp_path: Path, form: str) -> None:
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(api.ca_pem())
    (tmp_path / "token").write_text("t0k3n\n")
    cluster: dict[str, Any] = {"server": api.url}
    user: dict[str, Any] = {}
    if form == "ca-file-absolute+token":
        cluster["certificate-authority"] = str(ca_file)
        user["token"] = "t0k3n"
    elif form == "ca-file-relative+tokenFile-relative":
        cluster["certificate-authority"] = "ca.pem"
        user["tokenFile"] = "token"
    elif form == "ca-data+token":
        cluster["certificate-authority-data"] = b64(api.ca_pem())
        user["token"] = "t0k3n"
    elif form == "insecure+token":
        cluster["insecure-skip-tls-verify"] = True
        user["token"] = "t0k3n"
    elif form == "tls-server-name":
        cluster.update({"certificate-authority": "ca.pem",
                        "tls-server-name": "kubernetes.default.svc"})
        user["token"] = "t0k3n"
    else:
        cluster["certificate-authority"] = "ca.pem"
        client_ca = trustme.CA()
        api.require_client_ca(client_ca)
        cert, key = pair(client_ca)
        if form == "client-cert-files":
            (tmp_path / "c.pem").write_bytes(cert)
            (tmp_path / "c.key").write_bytes(key)
            user.update({"client-certificate": "c.pem", "client-key": "c.key"})
        elif form == "client-cert-and-key-in-one-file":
            (tmp_path / "both.pem").write_bytes(key + cert)
            user.update({"client-certificate": "both.pem", "client-key": "both.pem"})
        else:
            user.update({"client-certificate-data": b64(cert), "client-key-data": b64(key)})
    c = client(write(tmp_path / "kubeconfig", cluster, user))
    try:
        assert isinstance(c.api, kube.HttpApi)
        items, rv = c.list_slices()
    finally:
        c.close()
    assert rv == str(api.resource_version) and len(items) == 1
    assert api.list_requests()[-1].authorized
    if form == "tls-server-name":
        assert api.sni_names[-1] == "kubernetes.default.svc"


def test_without_a_user_the_request_is_anonymous(api: FakeApiServer, tmp_path: Path) -> None:
    c = client(write(tmp_path / "kc", {"server": api.url,
                                       "certificate-authority-data": b64(api.ca_pem())}, None))
    try:
        with pytest.raises(kube.ApiError) as exc:
            c.list_slices()
    finally:
        c.close()
    assert exc.value.status == 401


def test_basic_auth_and_a_path_prefix(tmp_path: Path) -> None:
    path = write(tmp_path / "kc", {"server": "https://[::1]:8443/k8s/clusters/c-1/",
                                   "insecure-skip-tls-verify": True},
                 {"username": "admin", "password": "s3cret"})
    target = credentials.kubeconfig(str(path)).get()
    assert (target.host, target.port, target.prefix) == ("::1", 8443, "/k8s/clusters/c-1")
    assert target.url == "https://[::1]:8443/k8s/clusters/c-1"
    assert target.authorization == "Basic " + b64(b"admin:s3cret")


def test_a_server_the_ca_does_not_verify_fails_naming_the_reason(
        api: FakeApiServer, tmp_path: Path) -> None:
    other = trustme.CA()
    c = client(write(tmp_path / "kc", {"server": api.url, "certificate-authority-data":
                                       b64(other.cert_pem.bytes())}, {"token": "t0k3n"}))
    try:
        with pytest.raises(kube.RequestFailed, match="CERTIFICATE_VERIFY_FAILED"):
            c.list_slices()
    finally:
        c.close()


def test_a_missing_referenced_file_fails_requests_until_it_appears(
        api: FakeApiServer, tmp_path: Path) -> None:
    kc = write(tmp_path / "kc", {"server": api.url, "certificate-authority-data":
                                 b64(api.ca_pem())}, {"tokenFile": "later-token"})
    assert credentials.check_kubeconfig(str(kc)) == \
        f"tokenFile missing: {tmp_path / 'later-token'}"
    h = Harness(api, tmp_path / "no-sa", kubeconfig=str(kc))
    h.provider.start()  # not a start-up failure: the file may come later
    try:
        wait_until(lambda: len(h.errored) >= 2, 10, message="requests failing")
        assert not api.slice_requests()  # nothing sent without the credential
        (tmp_path / "later-token").write_text("t0k3n")
        h.wait_watches(1)
        assert h.last_endpoints() == ["10.0.0.1:6443"]
    finally:
        assert h.provider.stop_and_join(5)


def test_kubeconfig_discovery_imports_neither_kubernetes_nor_urllib3(
        api: FakeApiServer, tmp_path: Path) -> None:
    kc = api.write_kubeconfig(tmp_path / "kc")
    code = textwrap.dedent(f"""
        import sys
        from extractedprism.config.endpoints import Endpoint
        from extractedprism.config.table import Config
        from extractedprism.discovery.kube import build_client
        cfg = Config(endpoints=(Endpoint("127.0.0.1", 1),), kubeconfig={str(kc)!r})
        client = build_client(cfg, "/nonexistent")
        items, rv = client.list_slices()
        client.close()
        print(rv, "kubernetes" in sys.modules, "urllib3" in sys.modules)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [str(api.resource_version), "False", "False"]


def test_a_plugin_user_goes_through_the_kubernetes_package(tmp_path: Path) -> None:
    kc = write(tmp_path / "kc", {"server": "https://127.0.0.1:6443",
                                 "insecure-skip-tls-verify": True},
               {"exec": {"apiVersion": "client.authentication.k8s.io/v1",
                         "command": "/bin/true", "interactiveMode": "Never"}})
    assert credentials.check_kubeconfig(str(kc)) == ""
    c = client(kc)
    try:
        assert isinstance(c.api, kube.PluginApi)
    finally:
        c.close()


# --- bad kubeconfigs: one clear line, exit 2 -------------------------------------------

GOOD_CLUSTER = {"server": "https://127.0.0.1:6443", "insecure-skip-tls-verify": True}
BAD: list[tuple[str, Any, str]] = [
    ("missing", None, "--kubeconfig: kubeconfig missing: {path}"),
    ("directory", "dir", "--kubeconfig: kubeconfig unusable: {path}: is a directory"),
    ("not-yaml", "clusters: [\n", "kubeconfig {path}: not valid YAML (line 2): "),
    ("not-a-mapping", "- a\n- b\n", "kubeconfig {path}: not a kubeconfig"),
    ("no-current-context", {"current-context": ""}, "kubeconfig {path}: no current-context"),
    ("unknown-context", {"current-context": "nope"},
     "kubeconfig {path}: no context named 'nope' (in contexts)"),
    ("no-server", {"clusters": [{"name": "k", "cluster": {}}]},
     "kubeconfig {path}: the current context's cluster has no server"),
    ("http-server", {"clusters": [{"name": "k", "cluster": {"server": "http://x:8080"}}]},
     "kubeconfig {path}: server 'http://x:8080' must be an https:// URL"),
    ("insecure-with-ca", {"clusters": [{"name": "k", "cluster": {
        **GOOD_CLUSTER, "certificate-authority-data": b64(b"x")}}]},
     "kubeconfig {path}: insecure-skip-tls-verify with a certificate-authority is not "
     "allowed (as in kubectl)"),
    ("ca-data-not-base64", {"clusters": [{"name": "k", "cluster": {
        "server": "https://127.0.0.1:6443", "certificate-authority-data": "%%%"}}]},
     "kubeconfig {path}: certificate-authority-data is not base64"),
    ("ca-data-not-pem", {"clusters": [{"name": "k", "cluster": {
        "server": "https://127.0.0.1:6443", "certificate-authority-data": b64(b"junk")}}]},
     "CA unusable: kubeconfig {path}: certificate-authority-data: no PEM certificate found"),
    ("cert-without-key", {"users": [{"name": "u", "user": {
        "client-certificate": "/etc/c.pem"}}]},
     "kubeconfig {path}: client-certificate without client-key"),
    ("proxy-url", {"clusters": [{"name": "k", "cluster": {
        **GOOD_CLUSTER, "proxy-url": "http://proxy:3128"}}]},
     "kubeconfig {path}: cluster proxy-url is not supported"),
    ("impersonation", {"users": [{"name": "u", "user": {"as": "admin"}}]},
     "kubeconfig {path}: user as (impersonation) is not supported"),
    ("token-two-lines", {"users": [{"name": "u", "user": {"token": "a\nb"}}]},
     "token unusable: kubeconfig {path}: token: more than one line"),
    # Issue 37, finding 10: a file named with a NUL byte can never appear (no file has
    # such a name): the kubeconfig is wrong, and says which entry.
    ("ca-nul", {"clusters": [{"name": "k", "cluster": {
        "server": "https://127.0.0.1:6443", "certificate-authority": "/etc/c\0a.pem"}}]},
     "kubeconfig {path}: certificate-authority (/etc/c\\x00a.pem) contains a NUL byte"),
    ("cert-nul", {"users": [{"name": "u", "user": {
        "client-certificate": "/etc/c\0.pem", "client-key": "/etc/k.pem"}}]},
     "kubeconfig {path}: client-certificate (/etc/c\\x00.pem) contains a NUL byte"),
    ("key-nul", {"users": [{"name": "u", "user": {
        "client-certificate": "/etc/c.pem", "client-key": "k\0.pem"}}]},
     "kubeconfig {path}: client-key (k\\x00.pem) contains a NUL byte"),
    ("token-file-nul", {"users": [{"name": "u", "user": {"tokenFile": "/var/t\0ken"}}]},
     "kubeconfig {path}: tokenFile (/var/t\\x00ken) contains a NUL byte"),
]


def bad_file(tmp_path: Path, content: Any) -> Path:
    path = tmp_path / "kubeconfig"
    if content is None:
        return path
    if content == "dir":
        path.mkdir()
    elif isinstance(content, str):
        path.write_text(content)
    else:
        write(path, GOOD_CLUSTER, {"token": "x"})
        doc = json.loads(path.read_text())
        doc.update(content)
        path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize(("name", "content", "message"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_kubeconfig_is_named_in_one_line(tmp_path: Path, name: str, content: Any,
                                                message: str) -> None:
    path = bad_file(tmp_path, content)
    with pytest.raises(KubeconfigError) as exc:
        credentials.check_kubeconfig(str(path))
    assert str(exc.value).startswith(message.format(path=path)), str(exc.value)
    assert "\n" not in str(exc.value)
    assert exc.value.exit_status == 2


@pytest.mark.parametrize("name", ["missing", "not-yaml", "no-current-context", "ca-nul"])
def test_a_bad_kubeconfig_stops_start_up_with_exit_2(tmp_path: Path, name: str) -> None:
    content, message = next((c, m) for n, c, m in BAD if n == name)
    path = bad_file(tmp_path, content)
    bind, health = free_ports(2)
    res = run_cli("--endpoints", "127.0.0.1:1", "--bind-port", str(bind), "--health-port",
                  str(health), "--kubeconfig", str(path))
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    lines = [line for line in res.stderr.splitlines() if str(path) in line]
    assert len(lines) == 1, res.stderr
    # A file that cannot be opened is caught with the other command-line mistakes
    # (config/parser.py); what is wrong inside one, by the kubeconfig reader.
    # A command-line mistake is a plain line; the kubeconfig reader's, a logfmt record
    # (its values unquoted here: a backslash in the message is escaped there).
    said = lines[0] if name == "missing" else \
        " ".join(str(v) for v in parse_logfmt(lines[0])[0].values())
    assert (message.format(path=path) if name != "missing" else "cannot be read") \
        in said, res.stderr
    assert "extractedprism started" not in res.stderr


def test_discovery_off_does_not_read_the_kubeconfig(tmp_path: Path) -> None:
    """--enable-discovery=false: the file is not used, so not checked; the proxy runs."""
    proxy = start_proxy(tmp_path, "--endpoints", "127.0.0.1:1", "--kubeconfig",
                        str(tmp_path / "missing"), "--enable-discovery=false")
    assert proxy.stop() == 0
