"""Fixtures over a real control plane: etcd and three kube-apiservers (scripts/controlplane).

* ``control_plane`` (session): one run for the whole session, brought up on first use and
  taken down at the end, also when the session fails. Runs left by a crashed session
  (their owner process is gone) are taken down first.
* ``cluster`` (function): the session's run, restored to the baseline before each test
  (every apiserver and etcd running, no partition, every apiserver ready and in the
  ``kubernetes`` EndpointSlice) so each test starts from the same place.
* ``extractedprism`` (function): a factory starting the product as a subprocess with
  real flags, listening on 127.0.0.1 (free ports), discovering through its own listener
  with a kubeconfig that verifies the API server as kubernetes.default.svc; stopped with
  SIGTERM at the end of the test.
* ``namespace`` (function): a namespace made for the test and deleted after it.

The whole directory is skipped, with one line saying what is missing, where the machine
cannot run a control plane (not root, no ``ip netns``, no openssl, binaries not built and
no Go to build them). ``scripts/test`` builds the binaries first (cached).
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.controlplane import harness
from tests.util import ROOT, wait_until

# The control plane is a package under scripts/ (scripts/controlplane runs it the same way).
if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))
from epscripts.controlplane import build as cpbuild
from epscripts.controlplane import host as cphost
from epscripts.controlplane import plane as cpmod

# The proxy's timing flags; every bound in the tests is computed from these.
INTERVAL = 2.0  # --health-interval
TIMEOUT = 1.0  # --health-timeout (also the proxy's dial timeout)
# Added once to every time bound, for the sampler's period, process start-up and a
# machine shared by several workers; printed with every figure.
SLACK = 1.5

FIGURES: dict[str, dict[str, Any]] = {}


def record(test: str, **figures: Any) -> None:
    """Figures of a scenario, printed at the end of the session and written to a file."""
    FIGURES.setdefault(test, {}).update(figures)


def why_not() -> str | None:
    why = cphost.missing_prerequisites()
    if why:
        return why
    missing = cpbuild.missing()
    if missing:
        # Not built inside a test: the first build takes minutes (scripts/test builds first).
        return (f"control-plane binaries not built ({', '.join(missing)}): run "
                "`scripts/controlplane build` (scripts/test does)")
    return None


def require_control_plane() -> None:
    """Skip the calling test module, with one line saying why, where this machine cannot
    run a control plane."""
    why = why_not()
    if why:
        pytest.skip(f"control-plane tests: {why}", allow_module_level=True)


# The marks of every control-plane test module. The Python kubernetes client (urllib3)
# can keep the socket of a request that a fault broke (and that it retried) until its
# pool is collected: reported, not failed.
MARKS = [pytest.mark.controlplane,
         pytest.mark.fd_leak_ok("urllib3 sockets of requests broken by the fault")]


@pytest.fixture(scope="session")
def control_plane() -> Iterator[Any]:
    for line in cpmod.down_stale():
        print(line)
    cp = cpmod.ControlPlane.create(owner_pid=os.getpid())
    try:
        t0 = time.monotonic()
        cp.up()
        record("control plane", up_seconds=round(time.monotonic() - t0, 1),
               kubernetes=cpbuild.KUBERNETES_VERSION, etcd=cpbuild.ETCD_VERSION)
        yield cp
    finally:
        cp.down()


@pytest.fixture(autouse=True)
def stop_background_clients() -> Iterator[None]:
    """Clients a failing test left running (kubectl watches, load threads) stop here."""
    yield
    harness.stop_live()


def fleet_why_not() -> str | None:
    """Why the hollow-node fleet (scripts/fleet) cannot run here, in one line (None: it can)."""
    why = why_not()
    if why:
        return why
    missing = cpbuild.missing(fleet=True)
    if missing:
        return f"fleet binaries not built ({', '.join(missing)}): run `scripts/fleet build`"
    return None


def restore(cp: Any, extra: list[str] | None = None) -> float:
    """Every apiserver and etcd running, no partition, every apiserver ready and in the
    slice, each apiserver started with ``extra`` flags (restarted where its flags differ);
    returns the seconds it took."""
    t0 = time.monotonic()
    want = list(extra or [])
    for api in cphost.APISERVERS:
        cp.heal(api)
    if not cp.running("etcd"):
        cp.etcd_up()
    for api in cphost.APISERVERS:
        if cp.pid(api) is not None:
            cp.cont(api)
    differ = [a for a in cphost.APISERVERS if cp.running(a) and cp.extra_args(a) != want]
    for api in differ:  # all at once: each drains on its own
        cp.term(api)
    for api in differ:
        cp.wait_exit(api, 90)
    for api in cphost.APISERVERS:
        if not cp.running(api):
            cp.start(api, want)
    cp.wait_ready(timeout=90)
    return time.monotonic() - t0


@pytest.fixture
def cluster(control_plane: Any) -> Any:
    restore(control_plane)  # a test's special flags: back to defaults
    return control_plane


@pytest.fixture
def namespace(cluster: Any) -> Iterator[str]:
    name = f"ep-{secrets.token_hex(3)}"
    status, body = cluster.request("api1", "/api/v1/namespaces", method="POST",
                                   body={"apiVersion": "v1", "kind": "Namespace",
                                         "metadata": {"name": name}})
    assert status == 201, (status, body)
    yield name
    for api in cphost.APISERVERS:
        try:
            if cluster.request(api, f"/api/v1/namespaces/{name}", method="DELETE",
                               timeout=5)[0] in (200, 202, 404):
                break
        except OSError:
            continue


@pytest.fixture
def extractedprism(cluster: Any, tmp_path: Path) -> Iterator[Callable[..., harness.Proxy]]:
    started: list[harness.Proxy] = []

    def start(**kw: Any) -> harness.Proxy:
        kw.setdefault("interval", INTERVAL)  # a test of the defaults passes its own
        kw.setdefault("timeout", TIMEOUT)
        proxy = harness.start_proxy(cluster, tmp_path, **kw)
        started.append(proxy)
        return proxy

    yield start
    harness.stop_live()  # clients first: a watch would re-dial a stopped proxy in a loop
    for proxy in started:
        proxy.stop()
        if proxy.proc.returncode not in (0, None):
            print(f"extractedprism exited {proxy.proc.returncode}; log tail:\n"
                  f"{proxy.log()[-2000:]}")


def wait_all_ready(proxy: harness.Proxy, addresses: list[str], timeout: float) -> float:
    """Seconds until every address is in /upstreams, healthy and ready."""
    t0 = time.monotonic()

    def ok() -> bool:
        ups = proxy.upstreams()
        return all(a in ups and ups[a]["healthy"] and not ups[a]["draining"]
                   and ups[a]["readiness"] in ("ready", "n/a") for a in addresses)

    wait_until(ok, timeout, interval=0.1, message=f"{addresses} healthy and ready in /upstreams")
    return time.monotonic() - t0


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not FIGURES:
        return
    tr = terminalreporter
    tr.section("control-plane figures (scripts/controlplane; bounds derived from flags)")
    for test, figs in FIGURES.items():
        tr.write_line(f"{test}: " + ", ".join(f"{k}={v}" for k, v in figs.items()))
    out = os.environ.get("EP_CONTROLPLANE_REPORT") or str(cphost.state_root() / "last-report.json")
    try:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(FIGURES, indent=1) + "\n")
        tr.write_line(f"(written to {out})")
    except OSError as exc:
        tr.write_line(f"(could not write {out}: {exc})")
