"""scripts/realnode VERB: build, check, up, status, down (docs/fleet.md, "Real nodes")."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from epscripts.controlplane import host as cphost
from epscripts.controlplane import plane as cpplane
from epscripts.fleet import observe
from epscripts.realnode import build as rnbuild
from epscripts.realnode import faults
from epscripts.realnode.node import NodeError, RealNodes, missing_prerequisites


def _log(msg: str) -> None:
    print(f"realnode: {msg}", file=sys.stderr, flush=True)


def describe(rn: RealNodes) -> str:
    conds = observe.node_conditions(rn.cp) or {}
    leases = observe.lease_renewals(rn.cp) or {}
    now = time.time()
    lines = [f"run {rn.cp.id}: {rn.cp.dir}"]
    for node in rn.nodes:
        c = conds.get(node) or {}
        lease = f"{now - leases[node]:.1f}s ago" if node in leases else "none"
        lines.append(f"{node} {rn.ip(node)} netns {rn.netns(node)}: Ready="
                     f"{c.get('ready', 'absent')} lease renewed {lease}; kubelet pid "
                     f"{rn.cp.pid(f'kubelet-{node}')}, containerd pid "
                     f"{rn.cp.pid(f'containerd-{node}')} (ctr -a {rn.sock(node)} -n k8s.io); "
                     f"extractedprism pids {rn.lb_pids(node)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/realnode", description=__doc__)
    p.add_argument("--run", help="control-plane run id or directory (default: "
                   "$EP_CONTROLPLANE_RUN, then the latest `scripts/controlplane up`)")
    sub = p.add_subparsers(dest="verb", required=True)
    sub.add_parser("build", help="build the kubelet and the pause binary (cached)")
    sub.add_parser("check", help="say what this machine lacks (exit 1 if anything)")
    up = sub.add_parser("up", help="bring a real node up on the run")
    up.add_argument("--node", default="r1")
    up.add_argument("--lb-arg", action="append", default=[],
                    help="extra extractedprism flag for the static pod (repeat)")
    up.add_argument("--image", default=None, help="the product's image archive "
                    "(default: scripts/image's dist/extractedprism-<version>.oci.tar)")
    up.add_argument("--api-down", action="append", default=[], choices=cphost.APISERVERS,
                    help="kill this API server before the node starts (repeat)")
    up.add_argument("--blackhole", action="append", default=[], choices=cphost.APISERVERS,
                    help="make this API server silently unreachable from the node")
    sub.add_parser("status", help="nodes, Ready, Lease age, pids")
    fault = sub.add_parser("fault", help="one fault, measured (faults.py): "
                           + ", ".join(faults.KINDS))
    fault.add_argument("kind", choices=faults.KINDS)
    fault.add_argument("--node", default="r1")
    fault.add_argument("--hold", type=float, default=30.0)
    fault.add_argument("--settle", type=float, default=20.0)
    down = sub.add_parser("down", help="remove the real nodes and all they made")
    down.add_argument("--node", default=None)
    args = p.parse_args(argv)
    try:
        if args.verb == "build":
            t0 = time.monotonic()
            print(rnbuild.build())
            _log(f"binaries ready in {time.monotonic() - t0:.0f}s")
            return 0
        if args.verb == "check":
            why = missing_prerequisites()
            print(why or "ok")
            return 1 if why else 0
        rn = RealNodes(cpplane.current(args.run))
        if args.verb == "up":
            index = 1 + max([rn.state["nodes"][n]["index"] for n in rn.nodes] or [0])
            try:
                took = rn.up(args.node, index, lb_extra=args.lb_arg,
                             apis_down=args.api_down, blackholed=args.blackhole,
                             image=Path(args.image) if args.image else None)
            except BaseException:
                _log(f"up failed; taking {args.node} down (logs kept in {rn.cp.dir})")
                for line in rn.down(args.node) if args.node in rn.state["nodes"] else []:
                    _log(line)
                raise
            print(describe(rn))
            _log(f"{args.node} Ready {took['ready']:.1f}s after the kubelet started")
        elif args.verb == "status":
            print(describe(rn))
        elif args.verb == "fault":
            print(json.dumps(faults.run(rn, args.node, args.kind, args.hold, args.settle)))
        elif args.verb == "down":
            for line in rn.down(args.node):
                print(line)
        return 0
    except (NodeError, cphost.CPError, TimeoutError) as exc:
        print(f"realnode: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
