"""A real Kubernetes control plane on this machine: etcd and three kube-apiservers.

Used by tests/controlplane (through :class:`ControlPlane`) and by people (through
``scripts/controlplane VERB``). Each process runs in a network namespace of its own,
joined by veth pairs to a bridge in the root namespace; the bridge has no uplink and no
namespace has a default route, so nothing can leave the machine. The root namespace
(where extractedprism and the test clients run) reaches every process over the bridge.
EndpointSlice addresses may not be loopback, hence the namespaces.

Runs are independent: every run has a random id, and everything it makes is named after
it (namespaces ``epcp-<id>-etcd``, ``-api1``.., bridge ``epcpb<id>``, veths ``epcp<id><n>``)
and lives in its own /24 inside 192.168.200.0-192.168.254.255 that no link uses yet. The run's
state file lists each namespace, link and process *before* it is made, so ``down`` removes
exactly what the run made, also after a crash in the middle of ``up``, and nothing else:
a namespace is deleted only when its nsfs inode is the one recorded at creation, a
process is signalled only when its command line still names the run directory.

Faults (each its own verb): kill -9, SIGSTOP/SIGCONT, graceful SIGTERM, start again;
partitioning an apiserver from etcd with permanent neighbour entries that point at a MAC
address nobody has (this kernel has no iptables or nft; such frames are dropped
silently, as a DROP rule would); stopping and starting etcd; etcd compaction, after
which an old resourceVersion answers 410.

Standard library only (plus ``openssl`` for the PKI), so it runs with the system python3.
"""

from __future__ import annotations

import argparse
import sys
import time

from epscripts.controlplane import build as cpbuild
from epscripts.controlplane.host import (
    APISERVERS,
    ETCD_PORT,
    SERVER_NAME,
    CPError,
    missing_prerequisites,
    say,
)
from epscripts.controlplane.plane import ControlPlane, current, down_stale


def describe(cp: ControlPlane) -> str:
    lines = [f"run {cp.id}: {cp.dir}",
             f"versions: kube-apiserver {cp.state['versions']['kubernetes']}, "
             f"etcd {cp.state['versions']['etcd']} ({cp.state['bin']})",
             f"subnet {cp.state['subnet']} on bridge {cp.state['bridge']}",
             f"etcd  http://{cp.ip('etcd')}:{ETCD_PORT}  pid {cp.pid('etcd')}"]
    for api in APISERVERS:
        lines.append(f"{api}  https://{cp.endpoint(api)}  pid {cp.pid(api)}  "
                     f"netns {cp.state['netns'][api]}")
    lines += [f"CA: {cp.ca}  (serving certificate names: {SERVER_NAME}, the IPs)",
              f"admin token: {cp.token('admin')} (in {cp.token_file('admin')}; a user in "
              "system:masters, made for this run)",
              f"kubeconfig: {cp.dir}/admin.kubeconfig",
              f"kubectl: {cp.binary('kubectl')} --kubeconfig {cp.dir}/admin.kubeconfig "
              "get --raw /readyz",
              f"export EP_CONTROLPLANE_RUN={cp.dir}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/controlplane", description=__doc__.split("\n")[0])
    p.add_argument("--run", help="run id or directory (default: $EP_CONTROLPLANE_RUN, "
                   "then the latest `up`)")
    sub = p.add_subparsers(dest="verb", required=True)
    sub.add_parser("build", help="build and cache etcd, kube-apiserver and kubectl")
    sub.add_parser("check", help="say what this machine lacks (exit 1 if anything)")
    up = sub.add_parser("up", help="start etcd and three apiservers; wait until all are ready")
    up.add_argument("--owner-pid", type=int, default=None,
                    help="`down --stale` takes this run down once that process is gone")
    sub.add_parser("status", help="addresses, pids, readiness")
    down = sub.add_parser("down", help="remove the run's processes, namespaces and links")
    down.add_argument("--stale", action="store_true",
                      help="instead: every run whose --owner-pid is gone")
    for verb, helptext in (("kill", "SIGKILL"), ("stop", "SIGSTOP"), ("cont", "SIGCONT"),
                           ("term", "graceful SIGTERM"), ("partition-etcd", "cut from etcd"),
                           ("heal", "undo partition-etcd")):
        sp = sub.add_parser(verb, help=f"{helptext} one apiserver")
        sp.add_argument("api", choices=APISERVERS)
    sp = sub.add_parser("start", help="start a stopped apiserver (extra flags after --)")
    sp.add_argument("api", choices=APISERVERS)
    sp.add_argument("--wait", action="store_true", help="wait until it is ready")
    sp.add_argument("extra", nargs="*", help="extra kube-apiserver flags for this start")
    sub.add_parser("etcd-down", help="kill etcd")
    sub.add_parser("etcd-up", help="start etcd again (same data)")
    sub.add_parser("compact", help="compact etcd at its current revision")
    args = p.parse_args(argv)
    try:
        if args.verb == "build":
            t0 = time.monotonic()
            print(cpbuild.build())
            say(f"binaries ready in {time.monotonic() - t0:.0f}s")
            return 0
        if args.verb == "check":
            why = missing_prerequisites()
            print(why or "ok")
            return 1 if why else 0
        if args.verb == "up":
            why = missing_prerequisites()
            if why:
                raise CPError(why)
            cpbuild.build()
            cp = ControlPlane.create(owner_pid=args.owner_pid)
            try:
                took = cp.up()
            except BaseException:
                say(f"up failed; taking run {cp.id} down (logs kept in {cp.dir})")
                cp.down()
                raise
            print(describe(cp))
            say(f"up in {took:.1f}s")
            return 0
        if args.verb == "down" and args.stale:
            for line in down_stale():
                print(line)
            return 0
        cp = current(args.run)
        if args.verb == "status":
            print(describe(cp))
            for api in APISERVERS:
                print(f"{api} /readyz: {cp.readyz(api)}")
            print(f"slice: {sorted(cp.slice_addresses() or [])}")
        elif args.verb == "down":
            for line in cp.down():
                print(line)
        elif args.verb in ("kill", "stop", "cont", "term"):
            getattr(cp, args.verb)(args.api)
        elif args.verb == "start":
            cp.start(args.api, args.extra)
            if args.wait:
                cp.wait_ready([args.api])
        elif args.verb == "partition-etcd":
            cp.partition_etcd(args.api)
        elif args.verb == "heal":
            cp.heal(args.api)
        elif args.verb == "etcd-down":
            cp.etcd_down()
        elif args.verb == "etcd-up":
            cp.etcd_up()
        elif args.verb == "compact":
            print(cp.compact())
        return 0
    except CPError as exc:
        print(f"controlplane: {exc}", file=sys.stderr)
        return 1
