"""scripts/bench probecost: what one health probe costs a real kube-apiserver (issue 28).

Brings up its own control plane (scripts/controlplane's etcd and three kube-apiservers
in network namespaces; taken down at the end), restarts ``api3`` with an RSA-2048 serving
certificate signed by the run's CA (``api1`` keeps the run's ECDSA P-256 one), and runs
extractedprism's own probe code against both, with the node's client certificate:

* ``new``: :func:`extractedprism.checks.probes.probe`, readyz on a new TLS connection
  per probe (what every probe cost before issue 28);
* ``kept``: :class:`~extractedprism.checks.probes.ProbeConnections`, a bare TCP connect
  (the spec's check) and ``GET /readyz`` on a TLS connection kept alive, replaced by a new
  one (a full handshake) once it is ``kept_max_age(--interval)`` old (what ships); the
  probes run back to back, so the connection's age is counted on a clock that moves one
  ``--interval`` per probe, as the ticker's probes would;
* ``forever``: the same with a connection kept for ever (what shipped before issue 37);
* ``tcp``: the bare TCP connect and close alone.

The API server's CPU comes from its own process accounting (``/proc/PID/stat`` utime +
stime), with its idle rate, measured in a quiet window before each round, subtracted.
The variants are interleaved, ``--rounds`` rounds of ``--probes / --rounds`` probes each,
sequential, so all of them see the same machine. ``--leases`` kubelet-like Lease PUTs (one
kept TLS connection, a JSON body renewing ``spec.renewTime``) on ``api1`` give the scale
of what a node already costs (its API server's CPU and etcd's). Prints a table and the
per-API-server cost for 500 / 1,000 / 5,000 nodes at 5 s, 10 s and 20 s; ``--json`` writes
the figures. Bounded: every probe has a 2 s deadline, every phase a count.
"""

from __future__ import annotations

import argparse
import datetime as dt
import http.client
import json
import os
import socket
import ssl
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from epscripts.controlplane.host import APISERVERS, NODE_NAME, SERVER_NAME
from epscripts.controlplane.plane import ControlPlane
from extractedprism.checks.probes import ProbeConnections, ReadyzSettings, kept_max_age, probe
from extractedprism.config.endpoints import Endpoint

TICK = os.sysconf("SC_CLK_TCK")
PROBE_TIMEOUT = 2.0
NODES = (500, 1000, 5000)
INTERVALS = (5.0, 10.0, 20.0)
RSA_OID = bytes.fromhex("2a864886f70d010101")  # rsaEncryption
EC_OID = bytes.fromhex("2a8648ce3d0201")  # id-ecPublicKey


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def say(msg: str) -> None:
    print(f"probecost: {msg}", flush=True)


def make_rsa_cert(cp: ControlPlane, out: Path) -> tuple[str, str]:
    """An RSA-2048 serving certificate with the run's SANs, signed by the run's CA."""
    out.mkdir(parents=True, exist_ok=True)
    ips = [ip for name, ip in cp.state["ips"].items() if name in APISERVERS]
    sans = ",".join(["DNS:kubernetes", "DNS:kubernetes.default", f"DNS:{SERVER_NAME}",
                     "DNS:kubernetes.default.svc.cluster.local", "DNS:localhost",
                     "IP:127.0.0.1", *(f"IP:{ip}" for ip in ips)])
    key, csr, crt, ext = (out / n for n in ("rsa.key", "rsa.csr", "rsa.crt", "rsa.ext"))
    ext.write_text(f"subjectAltName={sans}\nextendedKeyUsage=serverAuth\n"
                   "basicConstraints=critical,CA:FALSE\n"
                   "keyUsage=critical,digitalSignature,keyEncipherment\n")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    openssl("req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
            "-out", str(csr), "-subj", "/CN=kube-apiserver")
    openssl("x509", "-req", "-in", str(csr), "-CA", str(cp.pki / "ca.crt"),
            "-CAkey", str(cp.pki / "ca.key"), "-CAcreateserial", "-days", "2", "-sha256",
            "-extfile", str(ext), "-out", str(crt))
    key.chmod(0o600)
    return str(crt), str(key)


def serving_key_kind(cp: ControlPlane, api: str) -> str:
    ctx = ssl.create_default_context(cafile=cp.ca)
    with socket.create_connection((cp.ip(api), 6443), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname=SERVER_NAME) as tls:
        der = tls.getpeercert(binary_form=True) or b""
    return "RSA-2048" if RSA_OID in der else "ECDSA P-256" if EC_OID in der else "unknown"


def run_probes(kind: str, ep: Endpoint, rz: ReadyzSettings, n: int,
               interval: float) -> tuple[int, float]:
    """``n`` probes of one kind; (failures, this process's CPU seconds)."""
    now = [0.0]  # the kept connections' clock: one interval a probe

    def clock() -> float:
        return now[0]

    kept = ProbeConnections(max_age=kept_max_age(interval) if kind == "kept" else float("inf"),
                            clock=clock)
    fn: Callable[[], Any]
    if kind == "new":
        def fn() -> Any:
            return probe(ep, PROBE_TIMEOUT, rz)
    elif kind in ("kept", "forever"):
        def fn() -> Any:
            now[0] += interval
            return kept.probe(ep, PROBE_TIMEOUT, rz)
    else:
        def fn() -> Any:
            return probe(ep, PROBE_TIMEOUT, None)
    failed = 0
    c0 = time.process_time()
    try:
        for _ in range(n):
            r = fn()
            if not r.ok or (kind != "tcp" and r.ready is not True):
                failed += 1
    finally:
        kept.close()
    return failed, time.process_time() - c0


def measure(cp: ControlPlane, servers: dict[str, str], rz: ReadyzSettings, probes: int,
            rounds: int, baseline: float, interval: float) -> dict[str, Any]:
    per_round = max(1, probes // rounds)
    kinds = ["new", "kept", "forever", "tcp"]
    acc: dict[str, dict[str, dict[str, float]]] = {
        api: {k: {"n": 0, "cpu": 0.0, "secs": 0.0, "failed": 0, "client_cpu": 0.0,
                  "etcd_cpu": 0.0}
              for k in kinds} for api in servers}
    for rnd in range(rounds):
        order = kinds[rnd % len(kinds):] + kinds[:rnd % len(kinds)]
        for api in servers:
            pid, etcd = cp.pid(api), cp.pid("etcd")
            assert pid is not None and etcd is not None, f"{api} or etcd is not running"
            # The idle rates right before, of this server and etcd: background work.
            c0, e0, t0 = cpu_seconds(pid), cpu_seconds(etcd), time.monotonic()
            time.sleep(baseline)
            idle = (cpu_seconds(pid) - c0) / (time.monotonic() - t0)
            eidle = (cpu_seconds(etcd) - e0) / (time.monotonic() - t0)
            ep = Endpoint(cp.ip(api), 6443)
            for kind in order:
                c0, e0, t0 = cpu_seconds(pid), cpu_seconds(etcd), time.monotonic()
                failed, client_cpu = run_probes(kind, ep, rz, per_round, interval)
                secs = time.monotonic() - t0
                used = cpu_seconds(pid) - c0 - idle * secs
                eused = cpu_seconds(etcd) - e0 - eidle * secs
                a = acc[api][kind]
                a["n"] += per_round
                a["cpu"] += used
                a["secs"] += secs
                a["failed"] += failed
                a["client_cpu"] += client_cpu
                a["etcd_cpu"] += eused
                say(f"round {rnd + 1}/{rounds} {api} ({servers[api]}) {kind}: "
                    f"{per_round} probes in {secs:.1f}s, API server "
                    f"{used / per_round * 1000:.3f} ms each (idle {idle * 100:.1f}% "
                    f"subtracted), {failed} failed, load {loadavg()}")
    return acc


def idle_reuse(cp: ControlPlane, api: str, rz: ReadyzSettings, gap: float) -> dict[str, Any]:
    """Does a kept connection survive ``gap`` seconds idle (the server's idle timeout)?"""
    kept = ProbeConnections(max_age=float("inf"))
    ep = Endpoint(cp.ip(api), 6443)
    try:
        first = kept.probe(ep, PROBE_TIMEOUT, rz)
        time.sleep(gap)
        second = kept.probe(ep, PROBE_TIMEOUT, rz)
        opened = kept.opened().get(str(ep), 0)
    finally:
        kept.close()
    return {"gap": gap, "ready": [first.ready, second.ready], "opened": opened}


def lease_puts(cp: ControlPlane, api: str, n: int, baseline: float) -> dict[str, Any]:
    """``n`` Lease renewals like a kubelet's (a PUT of the whole Lease, one connection)."""
    name = f"probecost-{os.getpid()}"
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
             "metadata": {"name": name, "namespace": "kube-node-lease"},
             "spec": {"holderIdentity": NODE_NAME, "leaseDurationSeconds": 40,
                      "renewTime": now}}
    path = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
    status, body = cp.request(api, path, "POST", lease)
    if status not in (200, 201):
        raise RuntimeError(f"creating the Lease failed: {status} {body}")
    ctx = ssl.create_default_context(cafile=cp.ca)
    conn = http.client.HTTPSConnection(cp.ip(api), 6443, context=ctx, timeout=5)
    conn.sock = ctx.wrap_socket(socket.create_connection((cp.ip(api), 6443), timeout=5),
                                server_hostname=SERVER_NAME)
    headers = {"Authorization": f"Bearer {cp.token('admin')}",
               "Content-Type": "application/json", "Accept": "application/json"}
    pid, etcd = cp.pid(api), cp.pid("etcd")
    assert pid is not None and etcd is not None
    c0, e0, t0 = cpu_seconds(pid), cpu_seconds(etcd), time.monotonic()
    time.sleep(baseline)
    secs = time.monotonic() - t0
    idle, eidle = (cpu_seconds(pid) - c0) / secs, (cpu_seconds(etcd) - e0) / secs
    obj = body
    failed = 0
    c0, e0, t0 = cpu_seconds(pid), cpu_seconds(etcd), time.monotonic()
    try:
        for _ in range(n):
            obj["spec"]["renewTime"] = dt.datetime.now(dt.UTC).strftime(
                "%Y-%m-%dT%H:%M:%S.%fZ")
            conn.request("PUT", f"{path}/{name}", json.dumps(obj), headers)
            resp = conn.getresponse()
            raw = resp.read()
            if resp.status != 200:
                failed += 1
                continue
            obj = json.loads(raw)
    finally:
        conn.close()
    secs = time.monotonic() - t0
    used = cpu_seconds(pid) - c0 - idle * secs
    eused = cpu_seconds(etcd) - e0 - eidle * secs
    cp.request(api, f"{path}/{name}", "DELETE")
    return {"n": n, "failed": failed, "secs": secs, "apiserver_ms": used / n * 1000,
            "etcd_ms": eused / n * 1000, "load": loadavg()}


def report(acc: dict[str, Any], servers: dict[str, str], lease: dict[str, Any] | None,
           reuse: dict[str, Any] | None) -> list[str]:
    lines = ["", "| serving certificate | probe | API-server CPU per probe | "
             "etcd CPU per probe | proxy CPU per probe | failed |", "|---|---|---|---|---|---|"]
    for api, kinds in acc.items():
        for kind, a in kinds.items():
            lines.append(f"| {servers[api]} | {kind} | {a['cpu'] / a['n'] * 1000:.3f} ms | "
                         f"{a['etcd_cpu'] / a['n'] * 1000:.3f} ms | "
                         f"{a['client_cpu'] / a['n'] * 1000:.2f} ms | {a['failed']:.0f} |")
    lines += ["", "API-server CPU (cores) per API server, every node probing it once per "
              "interval:", "",
              "| nodes | interval | probes/s | " + " | ".join(
                  f"{servers[api]} {kind}" for api in acc for kind in ("new", "kept", "forever"))
              + " |", "|---|---|---|" + "---|" * (3 * len(acc))]
    for nodes in NODES:
        for interval in INTERVALS:
            rate = nodes / interval
            cells = [f"{rate * acc[api][kind]['cpu'] / acc[api][kind]['n']:.2f}"
                     for api in acc for kind in ("new", "kept", "forever")]
            lines.append(f"| {nodes} | {interval:g} s | {rate:g} | " + " | ".join(cells) + " |")
    if reuse:
        lines += ["", f"Two probes {reuse['gap']:g} s apart on one kept connection: "
                  f"{reuse['opened']} TLS connection(s) opened"]
    if lease:
        lines += ["", f"Lease PUT ({lease['n']}, one connection): API server "
                  f"{lease['apiserver_ms']:.3f} ms, etcd {lease['etcd_ms']:.3f} ms of CPU "
                  f"each ({lease['failed']} failed; load {lease['load']})"]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench probecost", description=__doc__.split(
        "\n\n")[0])
    ap.add_argument("--probes", type=int, default=1500, help="probes per kind and server")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", type=float, default=5.0,
                    help="seconds of idle measured before each round")
    ap.add_argument("--leases", type=int, default=500, help="Lease PUTs (0: none)")
    ap.add_argument("--settle", type=float, default=20.0,
                    help="seconds to wait after the servers are ready")
    ap.add_argument("--idle-gap", type=float, default=21.0,
                    help="seconds between two probes on one kept connection (0: skip)")
    ap.add_argument("--interval", type=float, default=5.0,
                    help="the probe interval the kept connection's max age is counted in "
                         "(the profile's 5 s)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    if not 1 <= args.probes <= 20000 or not 1 <= args.rounds <= 20:
        ap.error("--probes 1..20000, --rounds 1..20")
    started_load = loadavg()
    cp = ControlPlane.create(owner_pid=os.getpid())
    try:
        say(f"control plane {cp.id} up in {cp.up():.1f}s")
        crt, key = make_rsa_cert(cp, cp.dir / "probecost-rsa")
        cp.kill("api3")
        cp.start("api3", [f"--tls-cert-file={crt}", f"--tls-private-key-file={key}"])
        cp.wait_ready(["api3"])
        servers = {"api1": serving_key_kind(cp, "api1"), "api3": serving_key_kind(cp, "api3")}
        say(f"serving certificates: {servers}; settling {args.settle:g}s")
        time.sleep(args.settle)
        rz = ReadyzSettings(ca_file=cp.ca, server_name=SERVER_NAME,
                            cert_file=str(cp.pki / "node.crt"), key_file=str(cp.pki / "node.key"))
        acc = measure(cp, servers, rz, args.probes, args.rounds, args.baseline, args.interval)
        lease = lease_puts(cp, "api1", args.leases, args.baseline) if args.leases else None
        reuse = idle_reuse(cp, "api1", rz, args.idle_gap) if args.idle_gap else None
        if reuse:
            say(f"kept connection after {reuse['gap']:g}s idle: {reuse['opened']} connection(s) "
                f"opened for 2 probes, ready={reuse['ready']}")
    finally:
        for line in cp.down():
            say(line)
    lines = report(acc, servers, lease, reuse)
    lines.append(f"\nload average: {started_load} at start, {loadavg()} at the end; "
                 f"{os.cpu_count()} CPUs")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"servers": servers, "probes": acc,
                                               "lease": lease, "idle_reuse": reuse,
                                               "load_start": started_load,
                                               "load_end": loadavg(),
                                               "cpus": os.cpu_count()}, indent=1))
    return 0
