"""The shipped alerting rules on a real Prometheus beside the hollow fleet, through faults.

    scripts/fleet-alerts --nodes 30 [--steady 600] [--scrape 30] [--out FILE]

Brings the control plane and N hollow nodes up (scripts/fleet; every balancer runs the
production profile with its health port on the node's address), starts Debian's
`prometheus` in the machine's namespace scraping every node's balancer over the run's
bridge with chart/extractedprism/files/prometheus-rules.yaml as shipped, then:

1. steady traffic (the kubelets' own) for --steady seconds: no alert may fire;
2. a rolling restart of the API servers (SIGTERM, start, ready, one at a time): every node
   rides through, no alert may fire;
3. faults, one at a time, each held until its expected alert fires (or --fault-timeout),
   then undone and held until every alert has resolved: kill -9 of an API server, SIGSTOP of
   one, one's etcd partition, one node's balancer killed, one node's path to one API server
   cut, one node's path to every API server cut.

Every alert seen (pending, firing, resolved) is written to --out with its times relative
to the fault and to its undoing, with the fleet matrix (node x API server state) through
the first fault as Prometheus recorded it (scripts/fleet-alerts-png draws it).
The fleet stays up with --keep; otherwise it is taken down at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from epscripts.controlplane import host as cphost
from epscripts.controlplane import plane as cpplane
from epscripts.fleet import balancers
from epscripts.fleet.nodes import Fleet, default_ep_cmd, repo_root

RULES = repo_root() / "chart" / "extractedprism" / "files" / "prometheus-rules.yaml"
DEAD_MAC = "02:00:00:00:de:ad"  # frames to it go nowhere (as plane.partition_etcd does)
STATE = ("max by (node, upstream) (2 * ((clamp_max((1 - extractedprism_health_check_status) "
         "+ (1 - extractedprism_upstream_ready), 1)) or (1 - extractedprism_health_check_status)))")


def _log(msg: str) -> None:
    print(f"fleet-alerts: {msg}", file=sys.stderr, flush=True)


def profile_args() -> list[str]:
    from extractedprism.config import profile

    # --health-check=readyz is on the fleet's command line already.
    return [a for a in profile.args() if not a.startswith("--health-check=")]


class Prom:
    """Debian's prometheus in the machine's namespace, scraping every node's balancer."""

    def __init__(self, fleet: Fleet, workdir: Path, scrape: float) -> None:
        self.dir = workdir
        self.port = _free_port()
        targets = [{"targets": [f"{fleet.state['nodes'][n]['ip']}:{balancers.HEALTH_PORT}"],
                    "labels": {"node": n}} for n in fleet.nodes]
        def ms(seconds: float) -> str:  # Prometheus durations take no fractions
            return f"{round(seconds * 1000)}ms"
        config = {"global": {"scrape_interval": ms(scrape), "evaluation_interval": ms(scrape),
                             "scrape_timeout": ms(min(10.0, scrape / 2))},
                  "rule_files": [str(RULES)],
                  "scrape_configs": [{"job_name": "extractedprism",
                                      "static_configs": targets}]}
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "prometheus.yml").write_text(json.dumps(config, indent=1))
        binary = shutil.which("prometheus")
        if binary is None:
            raise SystemExit("prometheus not found: apt-get install prometheus")
        with open(workdir / "prometheus.log", "ab") as log:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={workdir / 'prometheus.yml'}",
                 f"--storage.tsdb.path={workdir / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=log, start_new_session=True)

    def get(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.load(r)["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.get("/api/v1/query", query=expr)["result"]

    def alerts(self) -> list[dict[str, Any]]:
        return self.get("/api/v1/alerts")["alerts"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def key(a: dict[str, Any]) -> str:
    lab = a["labels"]
    where = ",".join(f"{k}={lab[k]}" for k in ("node", "upstream") if k in lab)
    return f"{lab['alertname']}{{{where}}}"


class Watcher:
    """Every alert's first pending, first firing and end, polled every second."""

    def __init__(self, prom: Prom) -> None:
        self.prom = prom
        self.seen: dict[str, dict[str, float]] = {}

    def poll(self) -> dict[str, str]:
        now = time.time()
        current = {key(a): a["state"] for a in self.prom.alerts()}
        for k, st in current.items():
            rec = self.seen.setdefault(k, {})
            rec.setdefault(st, now)
            rec.pop("resolved", None)
        for k, rec in self.seen.items():
            if k not in current and "resolved" not in rec:
                rec["resolved"] = now
        return current

    def hold(self, seconds: float, until: Callable[[dict[str, str]], bool] | None = None,
             ) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            current = self.poll()
            if until is not None and until(current):
                return True
            time.sleep(1.0)
        return False


def wait_scraped(prom: Prom, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if prom.proc.poll() is not None:
            raise RuntimeError("prometheus exited: "
                               + (prom.dir / "prometheus.log").read_text()[-1500:])
        try:
            ok = prom.query('count(up{job="extractedprism"} == 1)')
            out = prom.query("count(extractedprism:upstream_out_of_service == 0)")
            if ok and out and int(float(ok[0]["value"][1])) == n and \
                    int(float(out[0]["value"][1])) == 3 * n:
                return
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError(f"not every one of {n} balancers scraped with 3 upstreams in service")


def cut(fleet: Fleet, node: str, ips: list[str]) -> None:
    for ip in ips:
        cphost.run_ip("-n", fleet.netns(node), "neigh", "replace", ip, "lladdr", DEAD_MAC,
                      "dev", "eth0", "nud", "permanent")


def mend(fleet: Fleet, node: str, ips: list[str]) -> None:
    for ip in ips:
        cphost.run_ip("-n", fleet.netns(node), "neigh", "del", ip, "dev", "eth0", check=False)


def run(args: argparse.Namespace) -> dict[str, Any]:
    # A run of its own unless --run names one: the current run may be someone else's
    # (other sessions on this machine use the same state directory), and this one kills
    # and partitions its API servers.
    own = not args.run
    if own:
        current = cphost.state_root() / "current"
        before = os.readlink(current) if current.is_symlink() else None
        cp = cpplane.ControlPlane.create(owner_pid=os.getpid())
        if before is not None and os.readlink(current) == cp.id:
            # create() points `current` at the new run; give it back to whoever had it.
            current.unlink()
            current.symlink_to(before)
        _log(f"control plane {cp.id} up in {cp.up():.1f}s")
    else:
        cp = cpplane.current(args.run)
    fleet = Fleet(cp)
    if not fleet.state["nodes"]:
        took = fleet.up(args.nodes, "extractedprism",
                        lb_extra=["--health-bind-address=0.0.0.0", *profile_args()],
                        controllers_api="api1", timeout=600)
        _log(f"{args.nodes} nodes Ready in {took:.1f}s")
    nodes = fleet.nodes
    api_ip = {a: cp.ip(a) for a in cphost.APISERVERS[:3]}
    addr = {a: f"{ip}:6443" for a, ip in api_ip.items()}
    prom = Prom(fleet, Path(cp.dir) / "prometheus", args.scrape)
    result: dict[str, Any] = {"nodes": len(nodes), "scrape_s": args.scrape,
                              "api": addr, "phases": []}
    try:
        wait_scraped(prom, len(nodes), 300)
        w = Watcher(prom)

        def phase(name: str, do: Callable[[], None], undo: Callable[[], None],
                  expect: str | None, hold: float) -> dict[str, Any]:
            w.seen = {}
            _log(f"{name}: start")
            t_fault = time.time()
            do()
            fired = w.hold(hold, (lambda cur: cur.get(expect) == "firing") if expect else None)
            t_undo = time.time()
            undo()
            if expect:
                w.hold(args.resolve_timeout, lambda cur: not cur)
            seen = {k: {st: round(t - (t_undo if st == "resolved" else t_fault), 1)
                        for st, t in rec.items()} for k, rec in w.seen.items()}
            rec = {"phase": name, "expect": expect, "expected_fired": fired,
                   "held_s": round(t_undo - t_fault, 1), "alerts": seen,
                   "t_fault": t_fault, "t_undo": t_undo}
            _log(f"{name}: {json.dumps(seen)}")
            result["phases"].append(rec)
            save(args.out, result)  # a crash later keeps what ran
            return rec

        phase("steady traffic", lambda: None, lambda: None, None, args.steady)

        def roll() -> None:
            for api in cphost.APISERVERS[:3]:
                if fleet.state["controllers_api"] == api:
                    fleet.move_controllers(next(a for a in cphost.APISERVERS[:3] if a != api))
                cp.term(api)
                cp.wait_exit(api, 90)
                cp.start(api)
                cp.wait_ready([api], timeout=120)
                w.hold(20)

        phase("rolling restart of the API servers", roll, lambda: None, None, 60)

        def server_fault(label: str, api: str, do: Callable[[], None],
                         undo: Callable[[], None]) -> None:
            def prep() -> None:
                if fleet.state["controllers_api"] == api:
                    fleet.move_controllers(next(a for a in cphost.APISERVERS[:3] if a != api))
                do()

            def fix() -> None:
                undo()
                cp.wait_ready([api], timeout=180)
            rec = phase(label, prep, fix,
                        f"ExtractedprismAPIServerOutOfServiceFleetWide{{upstream={addr[api]}}}",
                        args.fault_timeout)
            if label.startswith("kill -9"):
                rec["matrix"] = prom.get(
                    "/api/v1/query_range", query=STATE,
                    start=str(rec["t_fault"] - 120), end=str(time.time()),
                    step=f"{args.scrape:g}")["result"]
                save(args.out, result)

        server_fault("kill -9 of api2", "api2", lambda: cp.kill("api2"),
                     lambda: cp.start("api2"))
        server_fault("SIGSTOP of api3", "api3", lambda: cp.stop("api3"),
                     lambda: cp.cont("api3"))
        server_fault("etcd partition of api1", "api1", lambda: cp.partition_etcd("api1"),
                     lambda: cp.heal("api1"))

        victim = nodes[len(nodes) // 2]
        phase(f"{victim}'s balancer killed (kill -9)",
              lambda: fleet.stop_proc(f"lb-{victim}", signal.SIGKILL),
              lambda: fleet.start_balancer(victim, "extractedprism", default_ep_cmd(), None),
              f"ExtractedprismDown{{node={victim}}}", args.fault_timeout)
        victim = nodes[1]
        phase(f"{victim}'s path to api3 cut",
              lambda: cut(fleet, victim, [api_ip["api3"]]),
              lambda: mend(fleet, victim, [api_ip["api3"]]),
              f"ExtractedprismNodePathToAPIServerDown{{node={victim},upstream={addr['api3']}}}",
              args.fault_timeout)
        victim = nodes[2]
        phase(f"{victim}'s path to every API server cut",
              lambda: cut(fleet, victim, list(api_ip.values())),
              lambda: mend(fleet, victim, list(api_ip.values())),
              f"ExtractedprismPanic{{node={victim}}}", args.fault_timeout)
    finally:
        prom.stop()
        if not args.keep:
            for line in fleet.down():
                _log(line)
            if own:
                for line in cp.down():
                    _log(line)
    return result


def save(path: str, result: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(result, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/fleet-alerts", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", help="an existing control-plane run to use (default: a new one, "
                   "taken down at the end unless --keep)")
    p.add_argument("--nodes", type=int, default=30)
    p.add_argument("--steady", type=float, default=600.0, help="seconds of steady traffic")
    p.add_argument("--scrape", type=float, default=30.0,
                   help="scrape and evaluation interval (the chart's is 30 s)")
    p.add_argument("--fault-timeout", type=float, default=240.0,
                   help="longest a fault is held waiting for its alert")
    p.add_argument("--resolve-timeout", type=float, default=240.0)
    p.add_argument("--out", default=str(repo_root() / "docs" / "fleet-alerts.json"))
    p.add_argument("--keep", action="store_true", help="leave the fleet up at the end")
    args = p.parse_args(argv)
    run(args)
    _log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
