"""The shipped alerting rules and dashboard on a real Prometheus scraping real balancers.

Three "nodes": three extractedprism processes with the production profile (readyz probes,
EndpointSlice discovery against a fake API server), each over the same three TLS API
server fakes on loopback. Debian's `prometheus` binary scrapes them every SCRAPE seconds
and evaluates chart/extractedprism/files/prometheus-rules.yaml as shipped (its `for`
durations unchanged) every EVAL seconds. Then:

* a healthy fleet: no alert pending or firing, and every dashboard panel's query returns
  data;
* kill -9 of one node's balancer: ExtractedprismDown fires for that node alone and
  resolves once it is back;
* every API server's /readyz failing (an etcd partition as the nodes see it):
  ExtractedprismNoUpstreamInService fires on every node (not Panic: TCP still answers) and
  resolves when /readyz passes again.

Bounds come from the flags: the profile's detection time, a scrape, an evaluation, the
rule's `for`, and SLACK for a shared 2-core machine. The measured times are printed.
Skipped (with that reason) without the `prometheus` binary; .ci/run installs it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trustme
import yaml

from extractedprism.config import profile
from extractedprism.upstreams.state import FAILURE_THRESHOLD
from tests.fakes.fake_apiserver import FakeApiServer
from tests.fakes.upstream import FakeUpstream
from tests.util import PYTHON, ROOT, free_ports, reap, wait_until

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.skipif(
        PROMETHEUS is None,
        reason="prometheus not found (Debian package `prometheus`; .ci/run installs it)"),
    # The module's fakes serve the balancers for the whole module: a restarted balancer's
    # probe and watch connections to them close at the module's end, not the test's.
    pytest.mark.fd_leak_ok("the module's fake API servers hold the balancers' connections"),
]

if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))
from epscripts import dashboard  # noqa: E402 - scripts/ is put on the path above

RULES = ROOT / "chart" / "extractedprism" / "files" / "prometheus-rules.yaml"
NODES = ("n1", "n2", "n3")
SCRAPE = 2.0  # s: scrape and evaluation interval of this Prometheus
EVAL = 2.0
SLACK = 10.0  # process start-up, scheduling on a shared machine


def _seconds(v: str) -> float:
    units = {"ms": 0.001, "s": 1.0, "m": 60.0}
    for u in ("ms", "s", "m"):
        if v.endswith(u):
            return float(v[: -len(u)]) * units[u]
    raise ValueError(v)


PROFILE = {k: _seconds(v) for k, v in profile.flags().items()
           if k in ("health-interval", "health-timeout", "health-recheck")}
# A node has acted on a fault within: the next check (one interval), the confirming
# rechecks, each check's timeout.
DETECT = (PROFILE["health-interval"] + (FAILURE_THRESHOLD - 1) * PROFILE["health-recheck"]
          + FAILURE_THRESHOLD * PROFILE["health-timeout"])
FOR = {r["alert"]: _seconds(r.get("for", "0s")) for g in yaml.safe_load(RULES.read_text())[
    "groups"] for r in g["rules"] if "alert" in r}


def api_get(port: int, path: str, **params: str) -> Any:
    url = f"http://127.0.0.1:{port}{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]


@dataclass
class Fleet:
    tmp: Path
    ups: list[FakeUpstream]
    ca_file: Path
    kubeconfig: Path
    ports: dict[str, tuple[int, int]] = field(default_factory=dict)  # node -> (bind, health)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    prom: subprocess.Popen[bytes] | None = None
    prom_port: int = 0

    def start_node(self, node: str) -> None:
        bind, health = self.ports[node]
        cmd = [PYTHON, "-m", "extractedprism",
               "--endpoints", ",".join(u.address for u in self.ups),
               "--bind-port", str(bind), "--health-port", str(health),
               *profile.args(), "--health-check-ca-file", str(self.ca_file),
               "--kubeconfig", str(self.kubeconfig), "--log-level", "warn"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("EP_")}
        log = open(self.tmp / f"{node}.log", "ab")  # noqa: SIM115 - the child owns it
        self.procs[node] = subprocess.Popen(cmd, stdout=log, stderr=log, env=env,
                                            cwd=ROOT, start_new_session=True)
        log.close()

    def query(self, expr: str) -> list[dict[str, Any]]:
        return api_get(self.prom_port, "/api/v1/query", query=expr)["result"]

    def alerts(self, name: str, state: str = "firing") -> dict[str, dict[str, Any]]:
        """node -> alert, for the alerts `name` in `state`."""
        found = api_get(self.prom_port, "/api/v1/alerts")["alerts"]
        return {a["labels"].get("node", a["labels"].get("instance", "")): a for a in found
                if a["labels"]["alertname"] == name and a["state"] == state}

    def active(self) -> list[str]:
        found = api_get(self.prom_port, "/api/v1/alerts")["alerts"]
        return [f'{a["labels"]["alertname"]}{{{a["labels"].get("node", "")}}} {a["state"]}'
                for a in found]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    assert PROMETHEUS is not None
    tmp = tmp_path_factory.mktemp("live")
    ca = trustme.CA()
    ca_file = tmp / "ca.crt"
    ca.cert_pem.write_to_path(str(ca_file))
    ups = [FakeUpstream(ca=ca, name=f"api{i}").start() for i in (1, 2, 3)]
    api = FakeApiServer().start()
    f = Fleet(tmp, ups, ca_file, api.write_kubeconfig(tmp / "kubeconfig"))
    try:
        ports = free_ports(2 * len(NODES) + 1)
        f.prom_port = ports.pop()
        for i, node in enumerate(NODES):
            f.ports[node] = (ports[2 * i], ports[2 * i + 1])
            f.start_node(node)
        config = {
            "global": {"scrape_interval": f"{SCRAPE:g}s", "evaluation_interval": f"{EVAL:g}s",
                       "scrape_timeout": f"{SCRAPE / 2:g}s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "extractedprism", "static_configs": [
                {"targets": [f"127.0.0.1:{f.ports[n][1]}"], "labels": {"node": n}}
                for n in NODES]}]}
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        log = open(tmp / "prometheus.log", "ab")  # noqa: SIM115 - the child owns it
        f.prom = subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{f.prom_port}", "--log.level=warn"],
            stdout=log, stderr=log, start_new_session=True)
        log.close()
        wait_until(lambda: _ready(f), 60, interval=0.5,
                   message="Prometheus up and every balancer scraped with its upstreams ready")
        yield f
    finally:
        for p in [*f.procs.values(), *([f.prom] if f.prom else [])]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    pass
            reap(p)
        for u in ups:
            u.stop()
        api.stop()


def _ready(f: Fleet) -> bool:
    try:
        up = f.query('up{job="extractedprism"} == 1')
        out = f.query("extractedprism:upstream_out_of_service == 0")
    except OSError:
        return False
    return len(up) == len(NODES) and len(out) == len(NODES) * len(f.ups)


def _through_each_balancer(f: Fleet) -> None:
    """A few client connections per node, so the dial histogram and bytes have samples."""
    import socket
    import ssl

    ctx = ssl.create_default_context(cafile=str(f.ca_file))
    for bind, _ in f.ports.values():
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", bind), timeout=5) as raw, \
                    ctx.wrap_socket(raw, server_hostname="kubernetes.default.svc") as s:
                s.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                s.recv(100)


@pytest.mark.timeout(120)
def test_healthy_fleet_fires_nothing_and_every_dashboard_panel_has_data(fleet: Fleet) -> None:
    _through_each_balancer(fleet)
    # A rate needs two samples of the counters after the connections: polled below.
    rate_window = f"{4 * SCRAPE:g}s"
    doc = json.loads(dashboard.OUT.read_text())

    def empty_panels() -> list[str]:
        empty = []
        for p in doc["panels"]:
            exprs = [t["expr"] for t in p.get("targets", [])]
            if not exprs:
                continue
            got = [fleet.query(e.replace("$job", "extractedprism").replace("$node", ".*")
                               .replace("$__rate_interval", rate_window)) for e in exprs]
            if not any(got):
                empty.append(p["title"])
        return empty

    wait_until(lambda: not empty_panels(), 6 * SCRAPE + SLACK, interval=SCRAPE,
               message="every dashboard panel returns data")
    assert fleet.active() == [], f"alerts on a healthy fleet: {fleet.active()}"


@pytest.mark.timeout(180)
def test_a_killed_balancer_fires_down_for_its_node_and_resolves(fleet: Fleet) -> None:
    node = "n2"
    t0 = time.monotonic()
    fleet.procs[node].send_signal(signal.SIGKILL)
    reap(fleet.procs[node])
    bound = SCRAPE + EVAL + FOR["ExtractedprismDown"] + SLACK
    wait_until(lambda: node in fleet.alerts("ExtractedprismDown"), bound, interval=0.5,
               message=f"ExtractedprismDown for {node} within {bound:g}s")
    fired = time.monotonic() - t0
    assert set(fleet.alerts("ExtractedprismDown")) == {node}
    t1 = time.monotonic()
    fleet.start_node(node)
    wait_until(lambda: not fleet.alerts("ExtractedprismDown", "firing")
               and not fleet.alerts("ExtractedprismDown", "pending"),
               SCRAPE + EVAL + SLACK, interval=0.5, message="ExtractedprismDown resolved")
    resolved = time.monotonic() - t1
    print(f"\nExtractedprismDown: fired {fired:.1f}s after kill -9 (for "
          f"{FOR['ExtractedprismDown']:g}s, bound {bound:g}s); resolved {resolved:.1f}s after "
          "the restart")
    wait_until(lambda: _ready(fleet), 30, interval=0.5, message="the fleet back")


@pytest.mark.timeout(180)
def test_every_server_unready_fires_no_upstream_in_service_on_every_node(fleet: Fleet) -> None:
    wait_until(lambda: _ready(fleet), 30, interval=0.5, message="a healthy fleet first")
    t0 = time.monotonic()
    for u in fleet.ups:
        u.set_ready_status(500)
    try:
        name = "ExtractedprismNoUpstreamInService"
        bound = DETECT + SCRAPE + EVAL + FOR[name] + SLACK
        wait_until(lambda: set(fleet.alerts(name)) == set(NODES), bound, interval=0.5,
                   message=f"{name} on every node within {bound:g}s")
        fired = time.monotonic() - t0
        assert not fleet.alerts("ExtractedprismPanic", "firing"), "TCP still answers"
    finally:
        t1 = time.monotonic()
        for u in fleet.ups:
            u.set_ready_status(200)
    # A probe passes within an interval (and its timeout); then a scrape and an evaluation.
    back = PROFILE["health-interval"] + PROFILE["health-timeout"] + SCRAPE + EVAL + SLACK
    wait_until(lambda: not fleet.alerts(name, "firing"), back, interval=0.5,
               message=f"{name} resolved within {back:g}s")
    resolved = time.monotonic() - t1
    print(f"\n{name}: fired on {len(NODES)} nodes {fired:.1f}s after /readyz failed (detect "
          f"{DETECT:g}s + for {FOR[name]:g}s, bound {bound:g}s); resolved {resolved:.1f}s "
          "after it passed again")
