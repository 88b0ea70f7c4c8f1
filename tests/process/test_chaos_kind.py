"""scripts/chaos-kind with stand-in docker, kind, kubectl and helm executables on PATH.

The stand-ins record every call (argv as one JSON line) and answer like a kind cluster
named "chaos" with three control planes and a worker. The tests check the commands each
scenario runs and restores, the refusal to touch anything that is not that kind cluster,
the confirmation prompt, and that an interrupt mid-scenario still restores (unpause, the
manifest moved back). No container engine is involved.
"""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.util import wait_until

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "chaos-kind"
MANIFEST = "/etc/kubernetes/manifests/kube-apiserver.yaml"
PARKED = "/etc/kubernetes/kube-apiserver.yaml.chaos-kind"
CP = ["chaos-control-plane", "chaos-control-plane2", "chaos-control-plane3"]
WORKER = "chaos-worker"

STANDIN = r'''#!{python}
import json, os, sys, time
args = sys.argv[1:]
tool = os.path.basename(sys.argv[0])
with open(os.environ["CHAOS_RECORD"], "a") as f:
    f.write(json.dumps([tool, *args]) + "\n")
nodes = ["chaos-control-plane", "chaos-control-plane2", "chaos-control-plane3", "chaos-worker"]
if tool == "kind" and args[:2] == ["get", "clusters"]:
    print(os.environ.get("STANDIN_CLUSTERS", "chaos"))
elif tool == "kind" and args[:2] == ["get", "nodes"]:
    print("\n".join(nodes))
elif tool == "kubectl" and args[:2] == ["config", "current-context"]:
    print(os.environ.get("STANDIN_CONTEXT", "kind-chaos"))
elif tool == "docker" and args[:1] == ["inspect"]:
    if "Labels" in args[2]:
        print(os.environ.get("STANDIN_LABEL", "chaos"))
    else:
        print("172.18.0.%d " % (nodes.index(args[-1]) + 2))
elif tool == "docker" and args[:1] == ["exec"] and "curl" in args and "-s" in args:
    if args[-1].endswith("/upstreams"):
        print(json.dumps({"upstreams": [{"address": "172.18.0.2:6443", "healthy": True,
                                         "draining": False, "active_connections": 1}]}))
    else:
        print("extractedprism_connections_total 3")
elif tool == "docker" and args[:1] == ["exec"] and args[2:4] == ["sh", "-c"]:
    now = int(time.time() * 1000)
    for i in range(3):
        print("R %d 200" % (now + i), flush=True)
'''


@pytest.fixture
def standins(tmp_path: Path) -> tuple[dict[str, str], Path]:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("docker", "kind", "kubectl", "helm"):
        p = bindir / tool
        p.write_text(STANDIN.replace("{python}", sys.executable))
        p.chmod(0o755)
    record = tmp_path / "calls.jsonl"
    record.touch()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EP_", "STANDIN_"))}
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    env["CHAOS_RECORD"] = str(record)
    return env, record


def calls(record: Path) -> list[list[str]]:
    return [json.loads(line) for line in record.read_text().splitlines() if line]


def actions(record: Path) -> list[list[str]]:
    """The calls that change something (not the look-ups, the load or the reads)."""
    out = []
    for c in calls(record):
        if c[0] == "docker" and c[1] in ("inspect",):
            continue
        if c[0] == "docker" and c[1] == "exec" and ("curl" in c or c[3:5] == ["sh", "-c"]):
            continue
        if c[0] in ("kubectl",) or c[:3] == ["kind", "get", "clusters"] or \
                c[:3] == ["kind", "get", "nodes"]:
            continue
        out.append(c)
    return out


def chaos(env: dict[str, str], *args: str, stdin: int | None = subprocess.DEVNULL,
          timeout: float = 40) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), "--name", "chaos", *args], env=env,
                          stdin=stdin, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def iptables(op: str, chain: str, iface: str) -> list[str]:
    flag = "-i" if chain == "INPUT" else "-o"
    return ["docker", "exec", CP[2], "iptables", op, chain, flag, iface, "-m", "comment",
            "--comment", "extractedprism-chaos-kind", "-j", "DROP"]


def test_every_scenario_runs_its_commands_and_restores(standins) -> None:
    env, record = standins
    res = chaos(env, "--yes", "--hold", "0.1", "--settle", "0")
    assert res.returncode == 0, res.stdout + res.stderr
    got = actions(record)
    helm = got[0]
    assert helm[:5] == ["helm", "upgrade", "--install", "extractedprism",
                        str(ROOT / "chart" / "extractedprism")]
    assert "--kube-context" in helm and helm[helm.index("--kube-context") + 1] == "kind-chaos"
    assert "endpoints={172.18.0.2:6443,172.18.0.3:6443,172.18.0.4:6443}" in helm
    assert got[1:] == [
        ["docker", "kill", CP[1]], ["docker", "start", CP[1]],
        ["docker", "pause", CP[1]], ["docker", "unpause", CP[1]],
        ["docker", "exec", CP[2], "mv", MANIFEST, PARKED],
        ["docker", "exec", CP[2], "mv", PARKED, MANIFEST],
        iptables("-I", "INPUT", "eth0"), iptables("-I", "OUTPUT", "eth0"),
        iptables("-D", "OUTPUT", "eth0"), iptables("-D", "INPUT", "eth0"),
    ]
    # the load ran on the worker and /upstreams and /metrics were read there
    all_calls = calls(record)
    assert any(c[:3] == ["docker", "exec", WORKER] and c[3:5] == ["sh", "-c"]
               for c in all_calls)
    assert any(c[:3] == ["docker", "exec", WORKER] and c[-1].endswith("/upstreams")
               for c in all_calls)
    assert any(c[:3] == ["docker", "exec", WORKER] and c[-1].endswith("/metrics")
               for c in all_calls)
    assert "/upstreams before" in res.stdout and "requests failed" in res.stdout


def test_image_is_loaded_with_kind_and_used_by_the_chart(standins) -> None:
    env, record = standins
    res = chaos(env, "--yes", "--hold", "0.1", "--settle", "0", "--scenarios", "pause",
                "--image", "localhost/extractedprism:dev")
    assert res.returncode == 0, res.stdout + res.stderr
    got = actions(record)
    assert got[0] == ["kind", "load", "docker-image", "localhost/extractedprism:dev",
                      "--name", "chaos"]
    helm = got[1]
    assert "image.repository=localhost/extractedprism" in helm
    assert "image.tag=dev" in helm and "image.pullPolicy=Never" in helm


def test_create_uses_the_shipped_config_when_the_cluster_is_missing(standins) -> None:
    env, record = standins
    env["STANDIN_CLUSTERS"] = "other"
    res = chaos(env, "--yes", "--create", "--scenarios", "pause", "--hold", "0.1")
    # the stand-in still lists no "chaos" afterwards, so identification refuses
    assert res.returncode == 2
    assert ["kind", "create", "cluster", "--name", "chaos", "--config",
            str(ROOT / "scripts" / "kind-chaos-config.yaml"), "--wait", "5m"] in calls(record)
    cfg = (ROOT / "scripts" / "kind-chaos-config.yaml").read_text()
    assert cfg.count("role: control-plane") == 3 and cfg.count("role: worker") == 1


@pytest.mark.parametrize(("var", "value", "why"), [
    ("STANDIN_CONTEXT", "prod-admin@prod", "current kubectl context is 'prod-admin@prod'"),
    ("STANDIN_CLUSTERS", "something-else", "does not list a cluster named 'chaos'"),
    ("STANDIN_LABEL", "", "is not labelled io.x-k8s.kind.cluster=chaos"),
])
def test_refuses_anything_but_the_identified_kind_cluster(standins, var, value, why) -> None:
    env, record = standins
    env[var] = value
    res = chaos(env, "--yes", "--hold", "0.1")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "refusing" in res.stderr and why in res.stderr
    assert actions(record) == []  # nothing installed, killed, paused, moved or blocked


def test_asks_for_confirmation_unless_yes(standins) -> None:
    env, record = standins
    # no terminal and no --yes: refuse without touching anything
    res = chaos(env, "--hold", "0.1")
    assert res.returncode == 2 and "pass --yes" in res.stderr
    assert actions(record) == []
    # a terminal answering "n": refuse
    master, slave = pty.openpty()
    try:
        os.write(master, b"n\n")
        res = chaos(env, "--hold", "0.1", stdin=slave)
    finally:
        os.close(slave)
        os.close(master)
    assert res.returncode == 2 and "not confirmed" in res.stderr
    assert "Continue? [y/N]" in res.stdout
    assert actions(record) == []
    # a terminal answering "y": go on
    master, slave = pty.openpty()
    try:
        os.write(master, b"y\n")
        res = chaos(env, "--hold", "0.1", "--settle", "0", "--scenarios", "pause", stdin=slave)
    finally:
        os.close(slave)
        os.close(master)
    assert res.returncode == 0, res.stdout + res.stderr
    assert ["docker", "pause", CP[1]] in actions(record)


@pytest.mark.parametrize(("scenario", "injected", "restored"), [
    ("pause", ["docker", "pause", CP[1]], ["docker", "unpause", CP[1]]),
    ("static-pod", ["docker", "exec", CP[2], "mv", MANIFEST, PARKED],
     ["docker", "exec", CP[2], "mv", PARKED, MANIFEST]),
    ("kill", ["docker", "kill", CP[1]], ["docker", "start", CP[1]]),
    ("partition", iptables("-I", "OUTPUT", "eth0"), iptables("-D", "OUTPUT", "eth0")),
])
def test_interrupt_mid_scenario_restores(standins, scenario, injected, restored) -> None:
    env, record = standins
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--name", "chaos", "--yes",
                             "--no-install", "--scenarios", scenario, "--hold", "30"],
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        wait_until(lambda: injected in calls(record), 20, message=f"{scenario} injected")
        time.sleep(0.2)  # inside the hold
        assert restored not in calls(record)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out + err
    got = calls(record)
    assert restored in got
    assert got.index(restored) > got.index(injected)
    assert "interrupted; restoring" in out
