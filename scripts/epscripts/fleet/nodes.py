"""A fleet of hollow nodes on a scripts/controlplane run.

Each node is a network namespace of its own on the run's bridge (``epcp-<id>-n1``..,
addresses ``.101``.. of the run's /24) holding two processes, as a real node would: its
node-local balancer on 127.0.0.1:7445 and a hollow kubelet (kubemark ``--morph=kubelet``:
the kubelet's own code with a fake container runtime) whose kubeconfig points at that
balancer with the node's own client certificate (``CN=system:node:<name>``). A further
namespace ``epcp-<id>-ctrl`` (``.20``) holds kube-controller-manager (the node lifecycle
controller with its default grace periods, so NotReady means what it means in
production) and kube-scheduler, both talking straight to one API server.

Everything is journaled in the run's own state file before it is made (namespaces,
links, pids), so ``scripts/controlplane down`` of the run also removes a fleet a crash
left behind; ``Fleet.down`` removes only the fleet and leaves the control plane up.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from epscripts.controlplane import host as cphost
from epscripts.controlplane import pki as cppki
from epscripts.fleet import balancers

NODE_BASE = 100  # node i gets host .(100 + i) of the run's /24
MAX_NODES = 100
CTRL_HOST = 20  # kube-controller-manager and kube-scheduler
KUBELET_PORT = 10250
START_TIMEOUT = 20.0  # a balancer's listener accepting after exec


def _log(msg: str) -> None:
    print(f"fleet: {msg}", file=sys.stderr, flush=True)


class FleetError(Exception):
    """A fleet operation failed; the message says which and why."""


def repo_root() -> Path:
    """The checkout: scripts/epscripts/fleet/nodes.py -> three levels up from fleet/."""
    return Path(__file__).resolve().parents[3]


def default_ep_cmd() -> list[str]:
    """How this checkout runs extractedprism: the repository's venv, else this Python."""
    venv = repo_root() / ".venv" / "bin" / "python"
    py = str(venv) if venv.exists() else sys.executable
    return [py, "-m", "extractedprism"]


class Fleet:
    """The hollow nodes (and their controllers) of one control-plane run."""

    def __init__(self, cp: Any) -> None:
        self.cp = cp
        self.state: dict[str, Any] = cp.state.setdefault("fleet", {
            "nodes": {}, "lb": None, "controllers_api": None})

    # -- names and addresses --

    @property
    def dir(self) -> Path:
        return Path(self.cp.dir) / "fleet"

    def node_dir(self, node: str) -> Path:
        return self.dir / node

    @property
    def nodes(self) -> list[str]:
        return sorted(self.state["nodes"], key=lambda n: self.state["nodes"][n]["index"])

    def host_ip(self, host: int) -> str:
        net = ipaddress.ip_network(self.cp.state["subnet"])
        return str(net.network_address + host)

    def netns(self, node: str) -> str:
        return f"epcp-{self.cp.id}-{node}"

    def save(self) -> None:
        self.cp.state["fleet"] = self.state
        self.cp.save()

    # -- network --

    def _add_netns(self, key: str, host: int) -> str:
        """A namespace on the run's bridge with one address; journaled before it is made."""
        cp = self.cp
        ns = f"epcp-{cp.id}-{key}"
        veth = f"epcp{cp.id}{key}"  # <= 15 characters: 4 + 6 + len(key) (key <= 5)
        if Path(f"/run/netns/{ns}").exists():
            raise FleetError(f"network namespace {ns} exists already; not touching it")
        prefix = ipaddress.ip_network(cp.state["subnet"]).prefixlen
        cp._journal("netns", ns)
        cphost.run_ip("netns", "add", ns)
        cp.state["made"][-1][2] = os.stat(f"/run/netns/{ns}").st_ino
        cp.save()
        cp._journal("link", veth)
        cphost.run_ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        cphost.run_ip("-n", ns, "addr", "add", f"{self.host_ip(host)}/{prefix}", "dev", "eth0")
        cphost.run_ip("-n", ns, "link", "set", "lo", "up")
        cphost.run_ip("-n", ns, "link", "set", "eth0", "up")
        cphost.run_ip("link", "set", veth, "master", cp.state["bridge"], "up")
        return ns

    def _ours(self, ns: str) -> bool:
        """The namespace is the one this run made last under that name (its nsfs inode)."""
        made = [extra for kind, name, extra in self.cp.state["made"]
                if kind == "netns" and name == ns]
        try:
            return bool(made) and made[-1] is not None and (
                os.stat(f"/run/netns/{ns}").st_ino == made[-1])
        except FileNotFoundError:
            return False

    def _del_netns(self, key: str) -> None:
        ns = f"epcp-{self.cp.id}-{key}"
        veth = f"epcp{self.cp.id}{key}"
        self._kill_netns_pids(ns)
        if self._ours(ns):
            cphost.run_ip("netns", "del", ns, check=False)
        deadline = time.monotonic() + 10
        while (time.monotonic() < deadline
               and cphost.run_ip("link", "show", veth, check=False).returncode == 0):
            cphost.run_ip("link", "del", veth, check=False)
            time.sleep(0.05)
        if not Path(f"/run/netns/{ns}").exists():
            # Gone: out of the run's journal, so a later fleet on this run journals the
            # name afresh and `scripts/controlplane down` never meets a stale inode.
            self.cp.state["made"] = [m for m in self.cp.state["made"]
                                     if not (m[0] == "netns" and m[1] == ns)
                                     and not (m[0] == "link" and m[1] == veth)]
            self.cp.save()

    def _kill_netns_pids(self, ns: str) -> None:
        """Processes left in one of our namespaces (nginx workers whose master was killed)."""
        if not self._ours(ns):
            return
        out = cphost.run_ip("netns", "pids", ns, check=False).stdout.split()
        for pid in out:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)

    # -- processes --

    def spawn(self, name: str, ns: str, argv: list[str], env: dict[str, str] | None = None,
              cwd: Path | None = None) -> int:
        """Like ControlPlane._spawn, with environment variables for the child."""
        cp = self.cp
        log_path = Path(cp.dir) / f"{name}.log"
        prefix = ["env", *(f"{k}={v}" for k, v in (env or {}).items())] if env else []
        with open(log_path, "ab") as logf:
            logf.write(f"---- start {time.strftime('%H:%M:%S')} ----\n".encode())
            logf.flush()
            # `ip netns exec` and `env` exec: the pid is the program's own.
            proc = subprocess.Popen(["ip", "netns", "exec", ns, *prefix, *argv],
                                    stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                    start_new_session=True, close_fds=True,
                                    cwd=str(cwd) if cwd else None)
        cp._pidfile(name).write_text(f"{proc.pid}\n")
        cp.state["pids"][name] = proc.pid
        cp.save()
        cp._children[name] = proc
        return proc.pid

    def stop_proc(self, name: str, sig: signal.Signals = signal.SIGKILL,
                  timeout: float = 10.0) -> None:
        """Signal one of the fleet's processes and its process group (nginx's workers)."""
        pid = self.cp.pid(name)
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            # start_new_session made it a group leader; the group is only its own children.
            os.killpg(pid, sig)
        self.cp.wait_exit(name, timeout)

    def log(self, name: str) -> str:
        path = Path(self.cp.dir) / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # -- controllers --

    def controllers_kubeconfig(self, api: str) -> Path:
        return Path(self.cp.dir) / f"admin-{api}.kubeconfig"

    def start_controllers(self, api: str) -> None:
        """kube-controller-manager and kube-scheduler against ``api`` (one of each).

        Leader election is off: one instance of each, and a lost election lease would end
        the process during a fault, which would hide whether nodes go NotReady.
        """
        cp = self.cp
        if "ctrl" not in self.state.get("namespaces", []):
            self.state.setdefault("namespaces", []).append("ctrl")
            self.save()
            self._add_netns("ctrl", CTRL_HOST)
        ns = f"epcp-{cp.id}-ctrl"
        kc = str(self.controllers_kubeconfig(api))
        pki = cp.pki
        self.spawn("kube-controller-manager", ns, [
            cp.binary("kube-controller-manager"), f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
            "--leader-elect=false", "--secure-port=0",
            f"--service-account-private-key-file={pki}/sa.key",
            f"--root-ca-file={pki}/ca.crt", "--use-service-account-credentials=false",
            "--cluster-name=extractedprism-fleet", "--v=1"])
        self.spawn("kube-scheduler", ns, [
            cp.binary("kube-scheduler"), f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
            "--leader-elect=false", "--secure-port=0", "--v=1"])
        self.state["controllers_api"] = api
        self.save()

    def move_controllers(self, api: str) -> None:
        """Restart the controllers against another API server (before a fault on theirs)."""
        for name in ("kube-controller-manager", "kube-scheduler"):
            self.stop_proc(name)
        self.start_controllers(api)

    # -- nodes --

    def _node_files(self, node: str, extra: list[str]) -> balancers.NodeFiles:
        cp = self.cp
        d = self.node_dir(node)
        return balancers.NodeFiles(
            name=node, dir=d, ca=cp.ca, cert=str(cp.pki / f"node-{node}.crt"),
            key=str(cp.pki / f"node-{node}.key"), discovery_token=cp.token("extractedprism"),
            endpoints=cp.endpoints, extra=extra)

    def add_node(self, index: int, lb: str, ep_cmd: list[str], go_original_bin: str | None,
                 lb_extra: list[str]) -> str:
        cp = self.cp
        node = f"n{index}"
        if node in self.state["nodes"]:
            raise FleetError(f"node {node} exists already")
        d = self.node_dir(node)
        (d / "tmp").mkdir(parents=True, exist_ok=True)
        d.chmod(0o700)
        self.state["nodes"][node] = {"index": index, "ip": self.host_ip(NODE_BASE + index),
                                     "lb": lb}
        self.save()
        self._add_netns(node, NODE_BASE + index)
        cppki.issue(cp.pki, f"node-{node}", f"/O=system:nodes/CN=system:node:{node}",
                     "extendedKeyUsage=clientAuth")
        for suffix in ("crt", "key"):
            (cp.pki / f"node-{node}.{suffix}").chmod(0o600)
        files = self._node_files(node, lb_extra)
        self.start_balancer(node, lb, ep_cmd, go_original_bin, files)
        kc = d / "kubelet.kubeconfig"
        kc.write_text(balancers.kubeconfig_text(
            f"https://127.0.0.1:{balancers.LB_PORT}", files, cert=True))
        kc.chmod(0o600)
        self.start_kubelet(node)
        return node

    def start_balancer(self, node: str, lb: str, ep_cmd: list[str],
                       go_original_bin: str | None,
                       files: balancers.NodeFiles | None = None) -> int:
        files = files or self._node_files(node, self.state["nodes"][node].get("lb_extra", []))
        argv, env = balancers.argv(lb, files, ep_cmd, go_original_bin)
        self.state["nodes"][node].update(lb=lb, lb_argv=argv, lb_env=env,
                                         lb_extra=files.extra)
        self.save()
        # cwd: extractedprism runs from this checkout.
        pid = self.spawn(f"lb-{node}", self.netns(node), argv, env, cwd=repo_root())
        self.wait_listening(node, balancers.LB_PORT, START_TIMEOUT, f"lb-{node}")
        return pid

    def start_kubelet(self, node: str) -> int:
        cp = self.cp
        d = self.node_dir(node)
        # Flags: the fake image service (no containerd here); the kubelet ports are the
        # defaults, free in the node's own namespace; no read-only port, as in production.
        argv = [cp.binary("kubemark"), "--morph=kubelet", f"--name={node}",
                f"--kubeconfig={d / 'kubelet.kubeconfig'}", "--use-host-image-service=false",
                f"--kubelet-port={KUBELET_PORT}", "--kubelet-read-only-port=0", "--v=2"]
        # The kubelet finds its node IP by looking its name up: a hosts file of the node's
        # own says it at once. Without it the lookup went to the machine's resolver, which
        # the node's namespace cannot reach, and registration waited out two DNS timeouts
        # (20 s), long enough to lose the kubelet's race with its CSINode initialisation.
        # Nameserver 127.0.0.1 in the node's namespace: any other lookup fails at once.
        (d / "hosts").write_text(f"127.0.0.1 localhost\n{self.state['nodes'][node]['ip']} "
                                 f"{node}\n")
        (d / "resolv.conf").write_text("nameserver 127.0.0.1\n")
        # Both files are mounted in the private mount namespace `ip netns exec` makes
        # (mounts there never reach the machine's). TMPDIR: the fake runtime's socket.
        script = (f"mount --bind {d / 'hosts'} /etc/hosts && "
                  f"mount --bind {d / 'resolv.conf'} /etc/resolv.conf && exec \"$0\" \"$@\"")
        return self.spawn(f"kubelet-{node}", self.netns(node), ["sh", "-c", script, *argv],
                          {"TMPDIR": str(d / "tmp")})

    def in_netns(self, node: str, argv: list[str], timeout: float = 10.0,
                 ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", self.netns(node), *argv],
                              capture_output=True, text=True, timeout=timeout)

    def wait_listening(self, node: str, port: int, timeout: float, name: str) -> float:
        """Seconds until something accepts on the node's 127.0.0.1:``port``."""
        t0 = time.monotonic()
        probe = (f"import socket; socket.create_connection(('127.0.0.1', {port}), 1).close()")
        while True:
            if self.cp.pid(name) is None:
                raise FleetError(f"{name} exited while starting; log tail:\n"
                                 f"{self.log(name)[-2000:]}")
            if self.in_netns(node, [sys.executable, "-c", probe]).returncode == 0:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise FleetError(f"{name}: nothing accepts on 127.0.0.1:{port} in "
                                 f"{self.netns(node)} after {timeout:g}s")
            time.sleep(0.2)

    def kubelet_roots(self, node: str) -> list[Path]:
        """The root directories kubemark made for the node, one per start (under /tmp,
        whatever TMPDIR says), as its log names them."""
        return [Path(m) for m in re.findall(r"Using (/tmp/hollow-kubelet\.\d+) as root dir",
                                            self.log(f"kubelet-{node}"))]

    def remove_node_objects(self) -> None:
        """Delete the fleet's Node objects (best effort), so a next fleet starts clean."""
        for node in self.nodes:
            for api in cphost.APISERVERS:
                with contextlib.suppress(OSError):
                    if self.cp.request(api, f"/api/v1/nodes/{node}", method="DELETE",
                                       timeout=3)[0] in (200, 404):
                        break

    # -- up / down --

    def up(self, n: int, lb: str, ep_cmd: list[str] | None = None,
           go_original_bin: str | None = None, lb_extra: list[str] | None = None,
           controllers_api: str = "api1", timeout: float = 120.0) -> float:
        """Controllers, then ``n`` nodes; returns seconds until every node is Ready."""
        from epscripts.fleet import observe

        if self.state["nodes"]:
            raise FleetError(f"run {self.cp.id} has a fleet already ({len(self.nodes)} nodes);"
                             " `scripts/fleet down` first")
        if not 1 <= n <= MAX_NODES:
            raise FleetError(f"--nodes must be 1..{MAX_NODES}")
        ep_cmd = ep_cmd or default_ep_cmd()
        why = balancers.missing(lb, ep_cmd, go_original_bin)
        if why:
            raise FleetError(why)
        t0 = time.monotonic()
        self.state["lb"] = lb
        self.save()
        self.start_controllers(controllers_api)
        for i in range(1, n + 1):
            self.add_node(i, lb, ep_cmd, go_original_bin, list(lb_extra or []))
        observe.wait_nodes_ready(self.cp, self.nodes, timeout=timeout,
                                 alive=self.check_alive)
        return time.monotonic() - t0

    def check_alive(self) -> None:
        """Raise with a log tail when a fleet process has exited."""
        for name in self.proc_names():
            if self.cp.pid(name) is None:
                raise FleetError(f"{name} is not running; log tail:\n{self.log(name)[-2500:]}")

    def proc_names(self) -> list[str]:
        names = [n for node in self.nodes for n in (f"lb-{node}", f"kubelet-{node}")]
        if self.state.get("controllers_api"):
            names += ["kube-controller-manager", "kube-scheduler"]
        return names

    def down(self) -> list[str]:
        """Stop the fleet's processes and remove its namespaces; the control plane stays."""
        done = []
        for name in self.proc_names():
            pid = self.cp.pid(name)
            if pid is not None:
                self.stop_proc(name)
                done.append(f"killed {name} pid {pid}")
        for node in self.nodes:
            for root in self.kubelet_roots(node):
                shutil.rmtree(root, ignore_errors=True)
        for key in [*self.nodes, *self.state.get("namespaces", [])]:
            self._del_netns(key)
            done.append(f"deleted netns epcp-{self.cp.id}-{key}")
        self.remove_node_objects()
        self.state = {"nodes": {}, "lb": None, "controllers_api": None}
        self.save()
        return done

    # -- looking at it --

    def rss_kib(self, name: str) -> int | None:
        """RSS of a fleet process and its descendants (haproxy's and nginx's workers)."""
        pid = self.cp.pid(name)
        if pid is None:
            return None
        total = 0
        for p in [pid, *_descendants(pid)]:
            with contextlib.suppress(OSError, ValueError):
                status = Path(f"/proc/{p}/status").read_text().splitlines()
                if status[0].split()[-1] == "unshare":
                    continue  # the PID-namespace wrapper, not the balancer
                for line in status:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        return total


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    todo = [pid]
    for _ in range(1000):  # bounded: a process tree here has a handful of members
        if not todo:
            break
        p = todo.pop()
        with contextlib.suppress(OSError, ValueError):
            for task in Path(f"/proc/{p}/task").iterdir():
                kids = (task / "children").read_text().split()
                out += [int(k) for k in kids]
                todo += [int(k) for k in kids]
    return out
