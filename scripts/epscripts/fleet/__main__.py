"""scripts/fleet VERB: build, check, up, status, down (docs/fleet.md)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from epscripts.controlplane import build as cpbuild
from epscripts.controlplane import host as cphost
from epscripts.controlplane import plane as cpplane
from epscripts.fleet import balancers, observe
from epscripts.fleet.nodes import Fleet, FleetError, default_ep_cmd


def _log(msg: str) -> None:
    print(f"fleet: {msg}", file=sys.stderr, flush=True)


def why_not() -> str | None:
    """What this machine lacks for a fleet, in one line (None: nothing)."""
    why = cphost.missing_prerequisites()
    if why:
        return why
    if cpbuild.missing(fleet=True) and cpbuild.find_go() is None:
        return "no Go toolchain to build kubemark and the controllers (set GO=)"
    return None


def describe(fleet: Fleet) -> str:
    cp = fleet.cp
    lines = [f"run {cp.id}: {cp.dir}  balancer: {fleet.state['lb']}  "
             f"controllers -> {fleet.state.get('controllers_api')}"]
    conds = observe.node_conditions(cp) or {}
    leases = observe.lease_renewals(cp) or {}
    now = time.time()
    for node in fleet.nodes:
        info = fleet.state["nodes"][node]
        c = conds.get(node) or {}
        lease = f"{now - leases[node]:.1f}s ago" if node in leases else "none"
        rss = fleet.rss_kib(f"lb-{node}")
        krss = fleet.rss_kib(f"kubelet-{node}")
        lines.append(
            f"{node} {info['ip']} netns {fleet.netns(node)}: Ready={c.get('ready', 'absent')} "
            f"lease renewed {lease}; {info['lb']} pid {cp.pid(f'lb-{node}')} "
            f"RSS {rss and rss // 1024} MiB; kubelet pid {cp.pid(f'kubelet-{node}')} "
            f"RSS {krss and krss // 1024} MiB")
    for name in ("kube-controller-manager", "kube-scheduler"):
        lines.append(f"{name}: pid {cp.pid(name)}")
    lines.append("kubelets' connections reach: " + ", ".join(
        f"{n}->{'+'.join(a) or '?'}" for n, a in observe.kubelet_apis(cp, fleet).items()))
    peers = {fleet.state["nodes"][n]["ip"]: n for n in fleet.nodes}
    peers[fleet.host_ip(20)] = "ctrl"
    for api, counts in observe.connections(cp, peers).items():
        lines.append(f"{api} established connections by peer: "
                     + (", ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "none"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/fleet", description=__doc__)
    p.add_argument("--run", help="control-plane run id or directory (default: "
                   "$EP_CONTROLPLANE_RUN, then the latest `scripts/controlplane up`)")
    sub = p.add_subparsers(dest="verb", required=True)
    sub.add_parser("build", help="build the control plane and kubemark, "
                   "kube-controller-manager, kube-scheduler (cached)")
    sub.add_parser("check", help="say what this machine lacks (exit 1 if anything)")
    up = sub.add_parser("up", help="start N hollow nodes, each behind its own balancer")
    up.add_argument("--nodes", type=int, default=3)
    up.add_argument("--lb", choices=balancers.KINDS, default="extractedprism")
    up.add_argument("--go-original-bin", help="lexfrei/extractedprism, built by hand")
    up.add_argument("--ep-cmd", help="command that runs extractedprism (default: "
                    f"{' '.join(default_ep_cmd())})")
    up.add_argument("--lb-arg", action="append", default=[],
                    help="extra argument for every balancer (repeat)")
    up.add_argument("--controllers-api", choices=cphost.APISERVERS, default="api1",
                    help="the API server kube-controller-manager and kube-scheduler use")
    up.add_argument("--new-controlplane", action="store_true",
                    help="bring a new control plane up first (default: only when none runs)")
    sub.add_parser("status", help="nodes, Ready, Lease age, balancers, connections")
    down = sub.add_parser("down", help="remove the fleet (the control plane stays)")
    down.add_argument("--all", action="store_true", help="take the control plane down too")
    mv = sub.add_parser("move-controllers", help="restart the controllers against API")
    mv.add_argument("api", choices=cphost.APISERVERS)
    args = p.parse_args(argv)
    try:
        if args.verb == "build":
            t0 = time.monotonic()
            print(cpbuild.build(fleet=True))
            _log(f"binaries ready in {time.monotonic() - t0:.0f}s")
            return 0
        if args.verb == "check":
            why = why_not()
            print(why or "ok")
            return 1 if why else 0
        if args.verb == "up":
            return _up(args)
        cp = cpplane.current(args.run)
        fleet = Fleet(cp)
        if args.verb == "status":
            print(describe(fleet))
        elif args.verb == "down":
            for line in fleet.down():
                print(line)
            if args.all:
                for line in cp.down():
                    print(line)
        elif args.verb == "move-controllers":
            fleet.move_controllers(args.api)
        return 0
    except (FleetError, cphost.CPError, TimeoutError) as exc:
        print(f"fleet: {exc}", file=sys.stderr)
        return 1


def _up(args: Any) -> int:
    why = why_not()
    if why:
        raise FleetError(why)
    cpbuild.build(fleet=True)
    cp = None
    if not args.new_controlplane:
        try:
            cp = cpplane.current(args.run)
            if cp.state.get("downed_at"):
                cp = None
        except cphost.CPError:
            cp = None
    if cp is None:
        cp = cpplane.ControlPlane.create()
        try:
            _log(f"control plane up in {cp.up():.1f}s")
        except BaseException:
            cp.down()
            raise
    fleet = Fleet(cp)
    if fleet.state["nodes"]:
        raise FleetError(f"run {cp.id} has a fleet already ({len(fleet.nodes)} nodes); "
                         "`scripts/fleet down` first")
    try:
        took = fleet.up(args.nodes, args.lb,
                        ep_cmd=args.ep_cmd.split() if args.ep_cmd else None,
                        go_original_bin=args.go_original_bin, lb_extra=args.lb_arg,
                        controllers_api=args.controllers_api)
    except BaseException:
        _log(f"up failed; taking the fleet down (logs kept in {cp.dir})")
        fleet.down()
        raise
    print(describe(fleet))
    _log(f"{args.nodes} nodes Ready in {took:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
