"""A real node on a scripts/controlplane run: containerd, runc, CNI and a real kubelet,
running the product's image (issue 40).

The node is a network namespace of its own on the run's bridge (``epcp-<id>-r1``, host
``.151`` of the run's /24, made and journaled as the fleet's nodes are). containerd and
the kubelet run in it through ``nsenter --net`` (not ``ip netns exec``, whose private
mount namespace would hide each one's mounts from the other); containers with
``hostNetwork`` land in it too. The kubelet's only path to the API is
``https://127.0.0.1:7445``: extractedprism's static pod, from the manifest
``extractedprism static-pod`` prints, from the image ``scripts/image`` builds (imported
into containerd; no registry is reachable here, so the sandbox image is Kubernetes' own
pause.c, built by build.py and imported as ``registry.k8s.io/pause:3.10``).

What a node changes on the machine, each recorded in the run's state *before* it is
made, so ``down`` removes exactly that: the namespace and its veth (the run's journal),
its processes (containerd, the kubelet, containerd's shims and every container: found by
the node's directory in their command line or by the node's cgroups), every mount under
the node's directory (overlay root filesystems, the sandboxes' shm and network
namespace files, the kubelet's volumes), the node's cgroups (its own ``--cgroup-root``
in every cgroup v1 hierarchy and in the unified one), and the machine-wide sysctls the
kubelet sets (saved before the first node starts, written back when the last goes).

One real node per machine at a time is what this was built and tried with: the sysctls
are machine-wide, and two runs' kubelets would each save the other's values.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from epscripts.controlplane import host as cphost
from epscripts.controlplane import pki as cppki
from epscripts.fleet.nodes import Fleet, default_ep_cmd, repo_root
from epscripts.realnode import build as rnbuild

NODE_BASE = 150  # real node i gets host .(150 + i) of the run's /24
LB_PORT = 7445
HEALTH_PORT = 7446
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
# What the kubelet writes at start (pkg/kubelet/cm: setupKernelTunables), machine-wide.
SYSCTLS = ("vm.overcommit_memory", "vm.panic_on_oom", "kernel.panic", "kernel.panic_on_oops",
           "kernel.keys.root_maxkeys", "kernel.keys.root_maxbytes")
CGROUP_ROOT = Path("/sys/fs/cgroup")
SHIM_DIR = Path("/run/containerd/s")
CNI_BIN = "/usr/lib/cni"  # Debian's containernetworking-plugins
KUBELET_ADDRESS_FLAG = "--kubelet-preferred-address-types=InternalIP"
TOOLS = ("containerd", "runc", "ctr", "nsenter", "buildah")


class NodeError(Exception):
    """A real-node operation failed; the message says which and why."""


def _log(msg: str) -> None:
    print(f"realnode: {msg}", file=sys.stderr, flush=True)


def missing_prerequisites() -> str | None:
    why = cphost.missing_prerequisites()
    if why:
        return why
    for tool in TOOLS:
        if shutil.which(tool) is None:
            return (f"no `{tool}` (Debian: apt-get install -y containerd runc "
                    "containernetworking-plugins buildah)")
    if not Path(CNI_BIN, "bridge").exists():
        return f"no CNI plugins in {CNI_BIN} (Debian: containernetworking-plugins)"
    if not (CGROUP_ROOT / "memory").is_dir() and not (CGROUP_ROOT / "cgroup.controllers").exists():
        return "no cgroup hierarchy at /sys/fs/cgroup"
    return None


def image_archive() -> Path:
    """scripts/image's output for this checkout's version."""
    version = _version()
    return repo_root() / "dist" / f"extractedprism-{version}.oci.tar"


def _version() -> str:
    text = (repo_root() / "extractedprism" / "__init__.py").read_text()
    for line in text.splitlines():
        if line.startswith("__version__"):
            return line.split('"')[1]
    raise NodeError("no __version__ in extractedprism/__init__.py")


def image_name() -> str:
    return f"localhost/extractedprism:{_version()}"


def _read_sysctl(name: str) -> str:
    return Path("/proc/sys", *name.split(".")).read_text().strip()


def _write_sysctl(name: str, value: str) -> None:
    Path("/proc/sys", *name.split(".")).write_text(value + "\n")


def cgroup_hierarchies() -> list[Path]:
    """Every mounted cgroup hierarchy a kubelet with the cgroupfs driver writes under."""
    out = []
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return [CGROUP_ROOT]  # cgroup v2 only
    for d in sorted(CGROUP_ROOT.iterdir()):
        if d.is_dir() and (d / "cgroup.procs").exists():
            out.append(d)
    return out


def _mounts_under(prefix: str) -> list[str]:
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == prefix or point.startswith(prefix.rstrip("/") + "/"):
            out.append(point)
    return out


class RealNodes:
    """The real nodes of one control-plane run."""

    def __init__(self, cp: Any) -> None:
        self.cp = cp
        self.fleet = Fleet(cp)  # its namespace and process helpers, same journal
        self.state: dict[str, Any] = cp.state.setdefault(
            "realnode", {"nodes": {}, "sysctls": None, "cgroups": []})

    def save(self) -> None:
        self.cp.state["realnode"] = self.state
        self.cp.save()

    # -- names --

    @property
    def nodes(self) -> list[str]:
        return sorted(self.state["nodes"], key=lambda n: self.state["nodes"][n]["index"])

    def dir(self, node: str) -> Path:
        return Path(self.cp.dir) / "realnode" / node

    def netns(self, node: str) -> str:
        return f"epcp-{self.cp.id}-{node}"

    def ip(self, node: str) -> str:
        return str(self.state["nodes"][node]["ip"])

    def sock(self, node: str) -> str:
        return str(self.dir(node) / "containerd.sock")

    def cgroup_name(self, node: str) -> str:
        return f"eprn{self.cp.id}{node}"

    # -- processes --

    def spawn(self, name: str, node: str, argv: list[str]) -> int:
        """Start ``argv`` in the node's network namespace (and the machine's mount
        namespace); journaled as the run's process ``name``."""
        cp = self.cp
        log_path = Path(cp.dir) / f"{name}.log"
        with open(log_path, "ab") as logf:
            logf.write(f"---- start {time.strftime('%H:%M:%S')} ----\n".encode())
            logf.flush()
            proc = subprocess.Popen(["nsenter", f"--net=/run/netns/{self.netns(node)}", "--",
                                     *argv], stdin=subprocess.DEVNULL, stdout=logf,
                                    stderr=logf, start_new_session=True, close_fds=True)
        cp._pidfile(name).write_text(f"{proc.pid}\n")
        cp.state["pids"][name] = proc.pid
        cp.save()
        cp._children[name] = proc
        return proc.pid

    def ctr(self, node: str, *args: str, timeout: float = 120.0,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(["ctr", "-a", self.sock(node), "-n", "k8s.io", *args],
                              capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise NodeError(f"`ctr {' '.join(args)}` failed: {proc.stderr.strip()[-800:]}")
        return proc

    # -- up --

    def up(self, node: str = "r1", index: int = 1, *, lb_extra: list[str] | None = None,
           image: Path | None = None, timeout: float = 180.0,
           apis_down: list[str] | None = None,
           blackholed: list[str] | None = None) -> dict[str, float]:
        """containerd, the images, the static pod's manifest, the kubelet; returns timings
        (seconds): ``kubelet_start`` (monotonic), ``ready`` (kubelet start to Node Ready).

        A cold start under a fault: ``apis_down`` are killed (-9) before the node starts
        (and left down: ``scripts/controlplane start API`` brings one back);
        ``blackholed`` are made unreachable from the node, silently (a neighbour entry
        in the node's namespace pointing at a MAC address nobody has: packets vanish,
        as with a DROP rule), until ``unblackhole``."""
        why = missing_prerequisites()
        if why:
            raise NodeError(why)
        if rnbuild.missing():
            rnbuild.build()
        image = image or image_archive()
        if not image.exists():
            raise NodeError(f"no image at {image}: run scripts/image first")
        if node in self.state["nodes"]:
            raise NodeError(f"real node {node} exists already on run {self.cp.id}")
        d = self.dir(node)
        for sub in ("manifests", "cni", "cni-ipam", "kubelet", "pod-logs", "containerd/root",
                    "containerd/state", "containerd/opt", "ep/run", "ep/lib", "files"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        self.state["nodes"][node] = {"index": index,
                                     "ip": self.fleet.host_ip(NODE_BASE + index)}
        self.save()
        self._save_sysctls()
        if "shim_dir_made" not in self.state:
            # The shims' sockets go to /run/containerd/s whatever the configuration says.
            self.state["shim_dir_made"] = not SHIM_DIR.exists()
            self.save()
        self.api_servers_reach_kubelets()
        self.fleet._add_netns(node, NODE_BASE + index)
        for api in apis_down or []:
            if self.cp.pid(api) is not None:
                self.cp.signal(api, signal.SIGKILL)
                self.cp.wait_exit(api, 10)
        for api in blackholed or []:
            cphost.run_ip("-n", self.netns(node), "neigh", "replace", self.cp.ip(api),
                          "lladdr", cphost.DEAD_MAC, "nud", "permanent", "dev", "eth0")
        self._make_cgroups(node)
        self._write_containerd_config(node)
        self.spawn(f"containerd-{node}", node, ["containerd", "--config",
                                                str(d / "containerd.toml")])
        self._wait(lambda: Path(self.sock(node)).exists()
                   and self.ctr(node, "version", check=False).returncode == 0,
                   30, f"containerd-{node} answers", f"containerd-{node}")
        self.import_images(node, image)
        self._node_files(node)
        self.write_static_pod(node, lb_extra or [])
        t0 = time.monotonic()
        self.start_kubelet(node)
        from epscripts.fleet import observe

        observe.wait_nodes_ready(self.cp, [node], timeout=timeout,
                                 alive=lambda: self._alive(node))
        return {"kubelet_start": t0, "ready": time.monotonic() - t0}

    def unblackhole(self, node: str, api: str) -> None:
        cphost.run_ip("-n", self.netns(node), "neigh", "del", self.cp.ip(api), "dev", "eth0",
                      check=False)

    def api_servers_reach_kubelets(self) -> None:
        """`kubectl logs` and `exec` dial the kubelet by its node name unless the API
        servers prefer its InternalIP (the node's name resolves nowhere here): restart
        every API server that lacks the flag, with it."""
        cp = self.cp
        restart = [a for a in cphost.APISERVERS
                   if KUBELET_ADDRESS_FLAG not in cp.extra_args(a)]
        for api in restart:
            if cp.pid(api) is not None:
                cp.term(api)
        for api in restart:
            cp.wait_exit(api, 30)
            cp.start(api, [*cp.extra_args(api), KUBELET_ADDRESS_FLAG])
        if restart:
            cp.wait_ready(restart)

    def _alive(self, node: str) -> None:
        for name in (f"containerd-{node}", f"kubelet-{node}"):
            if self.cp.pid(name) is None:
                raise NodeError(f"{name} is not running; log tail:\n"
                                f"{self.fleet.log(name)[-2500:]}")

    def _wait(self, ok: Any, timeout: float, what: str, proc: str | None = None) -> float:
        t0 = time.monotonic()
        while not ok():
            if proc and self.cp.pid(proc) is None:
                raise NodeError(f"{proc} exited; log tail:\n{self.fleet.log(proc)[-2500:]}")
            if time.monotonic() - t0 > timeout:
                raise NodeError(f"timed out after {timeout:g}s waiting until {what}")
            time.sleep(0.2)
        return time.monotonic() - t0

    def _save_sysctls(self) -> None:
        if self.state.get("sysctls"):
            return  # saved by the first node of the run
        saved = {}
        for name in SYSCTLS:
            with contextlib.suppress(OSError):
                saved[name] = _read_sysctl(name)
        self.state["sysctls"] = saved
        self.save()

    def _make_cgroups(self, node: str) -> None:
        name = self.cgroup_name(node)
        for h in cgroup_hierarchies():
            path = h / name
            self.state["cgroups"].append(str(path))
            self.save()
            path.mkdir(exist_ok=True)
            if h.name == "cpuset":
                # A new cpuset cgroup starts with no CPUs and no memory nodes.
                for f in ("cpuset.cpus", "cpuset.mems"):
                    (path / f).write_text((h / f).read_text())

    def _write_containerd_config(self, node: str) -> None:
        d = self.dir(node)
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        (d / "containerd.toml").write_text(f"""version = 2
root = "{d}/containerd/root"
state = "{d}/containerd/state"

[grpc]
  address = "{self.sock(node)}"

[ttrpc]
  address = ""

[debug]
  address = ""

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/containerd/opt"

[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  # Root here lacks CAP_SYS_RESOURCE: runc cannot lower oom_score_adj, and every sandbox
  # failed with "can't get final child's PID from pipe: EOF" without this.
  restrict_oom_score_adj = true
  # The pods' network namespace files under this node's directory, not /run/netns.
  netns_mounts_under_state_dir = true
  enable_selinux = false

  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"

    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"

      [{cri}.containerd.runtimes.runc.options]
        SystemdCgroup = false
        # runc's state under the node's directory, not /run/containerd/runc.
        Root = "{d}/runc"

  [{cri}.cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{d}/cni"
""")
        subnet = f"10.88.{self.state['nodes'][node]['index']}.0/24"
        (d / "cni" / "10-eprn.conflist").write_text(json.dumps({
            "cniVersion": "0.4.0", "name": f"eprn-{self.cp.id}-{node}",
            "plugins": [{"type": "bridge", "bridge": "cni0", "isGateway": True,
                         "ipMasq": False,
                         "ipam": {"type": "host-local",
                                  "ranges": [[{"subnet": subnet}]],
                                  "dataDir": str(d / "cni-ipam")}}],
        }, indent=1) + "\n")

    def import_images(self, node: str, image: Path) -> None:
        """The pause image (built here, committed with buildah from scratch) and the
        product's image (scripts/image), into containerd's k8s.io namespace."""
        d = self.dir(node)
        pause_tar = Path(self.cp.state["bin"]) / "pause-image.tar"
        if not pause_tar.exists():
            _build_pause_image(pause_tar, d)
        self.ctr(node, "images", "import", "--all-platforms", str(pause_tar))
        out = self.ctr(node, "images", "import", "--all-platforms",
                       "--base-name", "localhost/extractedprism", str(image))
        names = self.ctr(node, "images", "ls", "-q").stdout.split()
        if image_name() not in names:
            raise NodeError(f"{image_name()} not among the imported images {names} "
                            f"({out.stdout.strip()})")
        if PAUSE_IMAGE not in names:
            raise NodeError(f"{PAUSE_IMAGE} not among the imported images {names}")

    def _node_files(self, node: str) -> None:
        """The kubelet's client certificate and kubeconfig (via 127.0.0.1:7445), and the
        files the product's pod reads (readable by its uid 65534)."""
        cp = self.cp
        d = self.dir(node)
        cppki.issue(cp.pki, f"node-{node}", f"/O=system:nodes/CN=system:node:{node}",
                    "extendedKeyUsage=clientAuth")
        (d / "kubelet.kubeconfig").write_text(cppki.kubeconfig(
            f"https://127.0.0.1:{LB_PORT}", cp.ca, cert=str(cp.pki / f"node-{node}.crt"),
            key=str(cp.pki / f"node-{node}.key")))
        files = d / "files"
        shutil.copy(cp.ca, files / "ca.crt")
        (files / "extractedprism.kubeconfig").write_text(cppki.kubeconfig(
            f"https://127.0.0.1:{LB_PORT}", str(files / "ca.crt"),
            token=cp.token("extractedprism")))
        for f in files.iterdir():
            os.chown(f, 65534, 65534)
            f.chmod(0o400)
        (d / "resolv.conf").write_text("nameserver 127.0.0.1\n")

    def static_pod_args(self, node: str, extra: list[str]) -> list[str]:
        d = self.dir(node)
        files = d / "files"
        return ["--endpoints", ",".join(self.cp.endpoints),
                "--health-check-ca-file", str(files / "ca.crt"),
                "--health-check-server-name", cphost.SERVER_NAME,
                "--enable-discovery=true", "--kubeconfig",
                str(files / "extractedprism.kubeconfig"),
                "--handover-socket", str(d / "ep" / "run" / "handover.sock"),
                "--state-file", str(d / "ep" / "lib" / "state.json"),
                "--shutdown-drain-timeout", "10s", "--image", image_name(), *extra]

    def write_static_pod(self, node: str, extra: list[str]) -> Path:
        argv = [*default_ep_cmd(), "static-pod", *self.static_pod_args(node, extra)]
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=repo_root(),
                              timeout=60)
        if proc.returncode != 0:
            raise NodeError(f"extractedprism static-pod failed: {proc.stderr.strip()}")
        path = self.dir(node) / "manifests" / "extractedprism.yaml"
        path.write_text(proc.stdout)
        self.state["nodes"][node]["static_pod_args"] = extra
        self.save()
        return path

    def start_kubelet(self, node: str) -> int:
        d = self.dir(node)
        cp = self.cp
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "staticPodPath": str(d / "manifests"),
            "containerRuntimeEndpoint": f"unix://{self.sock(node)}",
            "cgroupDriver": "cgroupfs", "cgroupRoot": f"/{self.cgroup_name(node)}",
            "cgroupsPerQOS": True, "failSwapOn": False,
            "address": self.ip(node), "port": 10250, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": 10248,
            # A test node on the run's bridge: the API servers call it anonymously
            # (kubectl logs/exec); nothing outside the machine reaches the bridge.
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False},
                               "x509": {"clientCAFile": cp.ca}},
            "authorization": {"mode": "AlwaysAllow"},
            "resolvConf": str(d / "resolv.conf"), "podLogsDir": str(d / "pod-logs"),
            "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%",
                             "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "protectKernelDefaults": False, "serializeImagePulls": False,
            "registerNode": True, "rotateCertificates": False,
            "localStorageCapacityIsolation": False,
        }
        (d / "kubelet.json").write_text(json.dumps(config, indent=1) + "\n")
        argv = [rnbuild.binary("kubelet").as_posix(), f"--config={d / 'kubelet.json'}",
                f"--kubeconfig={d / 'kubelet.kubeconfig'}", f"--root-dir={d / 'kubelet'}",
                f"--cert-dir={d / 'kubelet' / 'pki'}", f"--hostname-override={node}",
                f"--node-ip={self.ip(node)}", "--v=2"]
        return self.spawn(f"kubelet-{node}", node, argv)

    def client_loop(self, node: str, port: int, stop_file: Path, *, every: float = 0.05,
                    max_s: float = 300.0) -> subprocess.Popen[str]:
        """clientloop.py in the node's network namespace: new TLS connections through
        the node's 127.0.0.1:``port`` until ``stop_file`` exists; its stdout is one JSON
        line at the end."""
        here = Path(__file__).resolve().parents[2]
        return subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{self.netns(node)}", "--", sys.executable, "-m",
             "epscripts.realnode.clientloop", "--port", str(port), "--ca", self.cp.ca,
             "--server-name", cphost.SERVER_NAME, "--every", str(every), "--max-s",
             str(max_s), "--stop-file", str(stop_file)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=here,
            env={**os.environ, "PYTHONPATH": str(here)})

    # -- looking at it --

    def lb_pids(self, node: str) -> list[int]:
        """Host pids of the product's processes on the node (in its containers)."""
        out = []
        for p in Path("/proc").iterdir():
            if not p.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                cmd = (p / "cmdline").read_bytes().split(b"\0")
                if any(c.endswith(b"/opt/venv/bin/extractedprism") for c in cmd[:2]) and (
                        self._in_node_cgroup(int(p.name), node)):
                    out.append(int(p.name))
        return sorted(out)

    def _in_node_cgroup(self, pid: int, node: str) -> bool:
        with contextlib.suppress(OSError):
            return f"/{self.cgroup_name(node)}/" in Path(f"/proc/{pid}/cgroup").read_text()
        return False

    # -- down --

    def node_pids(self, node: str) -> list[int]:
        """Every process of the node: in its cgroups, or naming its directory."""
        pids: set[int] = set()
        name = self.cgroup_name(node)
        for h in cgroup_hierarchies():
            root = h / name
            if root.is_dir():
                for procs in root.rglob("cgroup.procs"):
                    with contextlib.suppress(OSError, ValueError):
                        pids.update(int(x) for x in procs.read_text().split())
        mark = str(self.dir(node)).encode()
        for p in Path("/proc").iterdir():
            if p.name.isdigit():
                with contextlib.suppress(OSError):
                    if mark in (p / "cmdline").read_bytes():
                        pids.add(int(p.name))
        pids.discard(os.getpid())
        return sorted(pids)

    def down(self, node: str | None = None) -> list[str]:
        """Remove one node (default: all) and everything it made on the machine."""
        done: list[str] = []
        for n in ([node] if node else list(self.nodes)):
            done += self._down_one(n)
        if not self.state["nodes"]:
            done += self._restore_sysctls()
            done += self._remove_shim_sockets()
            if self.fleet.state.get("controllers_api") and not self.fleet.nodes:
                # Started for a DaemonSet on the real node (faults.daemonset_check, the
                # tests), with no hollow node of scripts/fleet using them.
                done += self.fleet.down()
        return done

    def _remove_shim_sockets(self) -> list[str]:
        """Shim sockets nobody listens on (their shims are gone); /run/containerd itself
        when this run made it and nothing else is left there."""
        done = []
        if SHIM_DIR.is_dir():
            for f in SHIM_DIR.iterdir():
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.connect(str(f))
                except ConnectionRefusedError:
                    f.unlink(missing_ok=True)
                    done.append(f"removed stale shim socket {f}")
                except OSError:
                    pass
                finally:
                    s.close()
        if self.state.pop("shim_dir_made", False):
            with contextlib.suppress(OSError):
                SHIM_DIR.rmdir()
                SHIM_DIR.parent.rmdir()
                done.append(f"removed {SHIM_DIR.parent}")
        self.save()
        return done

    def _down_one(self, node: str) -> list[str]:
        done = []
        for name in (f"kubelet-{node}", f"containerd-{node}"):
            pid = self.cp.pid(name)
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                self.cp.wait_exit(name, 10)
                done.append(f"killed {name} pid {pid}")
        for _ in range(5):  # shims and containers; a shim may start one more meanwhile
            pids = self.node_pids(node)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            done.append(f"killed {len(pids)} container and shim processes")
            time.sleep(0.3)
        d = self.dir(node)
        for point in sorted(_mounts_under(str(d)), key=len, reverse=True):
            if subprocess.run(["umount", point], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", point], capture_output=True)
            done.append(f"unmounted {point}")
        name = self.cgroup_name(node)
        for path in [p for p in self.state["cgroups"] if Path(p).name == name]:
            root = Path(path)
            if root.is_dir():
                for sub in sorted((p for p in root.rglob("*") if p.is_dir()),
                                  key=lambda p: len(p.parts), reverse=True):
                    with contextlib.suppress(OSError):
                        sub.rmdir()
                with contextlib.suppress(OSError):
                    root.rmdir()
            if root.exists():
                done.append(f"left cgroup {root}: not empty")
            else:
                self.state["cgroups"].remove(path)
                done.append(f"removed cgroup {root}")
        self.save()
        self.fleet._del_netns(node)
        done.append(f"deleted netns {self.netns(node)}")
        for api in cphost.APISERVERS:
            with contextlib.suppress(OSError):
                if self.cp.request(api, f"/api/v1/nodes/{node}", method="DELETE",
                                   timeout=3)[0] in (200, 404):
                    break
        done += self._delete_pods_of(node)
        # The container images and root filesystems (hundreds of MB), and the pods' logs:
        # a next kubelet counts a container's restarts from the files there.
        shutil.rmtree(d / "containerd", ignore_errors=True)
        shutil.rmtree(d / "kubelet", ignore_errors=True)
        shutil.rmtree(d / "pod-logs", ignore_errors=True)
        del self.state["nodes"][node]
        self.save()
        return done

    def _delete_pods_of(self, node: str) -> list[str]:
        """The pods bound to the node (its mirror pod, DaemonSet pods): with no pod GC
        controller running they would outlive it, and a next node of the same name would
        inherit the mirror pod's status (restart counts included)."""
        done = []
        for api in cphost.APISERVERS:
            try:
                status, body = self.cp.request(
                    api, f"/api/v1/pods?fieldSelector=spec.nodeName%3D{node}", timeout=5)
            except OSError:
                continue
            if status != 200:
                continue
            for pod in body.get("items") or []:
                meta = pod["metadata"]
                with contextlib.suppress(OSError):
                    self.cp.request(api, f"/api/v1/namespaces/{meta['namespace']}/pods/"
                                    f"{meta['name']}", method="DELETE",
                                    body={"gracePeriodSeconds": 0}, timeout=5)
                    done.append(f"deleted pod {meta['namespace']}/{meta['name']}")
            break
        return done

    def _restore_sysctls(self) -> list[str]:
        done = []
        for name, value in (self.state.get("sysctls") or {}).items():
            with contextlib.suppress(OSError):
                if _read_sysctl(name) != value:
                    _write_sysctl(name, value)
                    done.append(f"restored {name}={value}")
        self.state["sysctls"] = None
        self.save()
        return done

    def leftovers(self) -> list[str]:
        """What of this run's real nodes is still on the machine (for tests: empty after
        down)."""
        out = []
        for node, info in self.state["nodes"].items():
            out.append(f"node {node} still recorded ({info})")
        base = Path(self.cp.dir) / "realnode"
        out += [f"mount {m}" for m in _mounts_under(str(base))]
        for h in cgroup_hierarchies():
            out += [f"cgroup {p}" for p in h.glob(f"eprn{self.cp.id}*")]
        out += [f"netns {n}" for n in os.listdir("/run/netns")
                if n.startswith(f"epcp-{self.cp.id}-r")] if Path("/run/netns").is_dir() else []
        mark = str(base).encode()
        for p in Path("/proc").iterdir():
            if p.name.isdigit():
                with contextlib.suppress(OSError):
                    if mark in (p / "cmdline").read_bytes():
                        out.append(f"process {p.name}")
        if self.state.get("sysctls"):
            out.append("sysctls not restored")
        return out


def _build_pause_image(dest: Path, work: Path) -> None:
    """The pause binary as an image from scratch (buildah, vfs storage of its own),
    written as a docker archive named registry.k8s.io/pause:3.10."""
    store = work / "buildah"
    b = ["buildah", "--root", str(store / "storage"), "--runroot", str(store / "run"),
         "--storage-driver", "vfs"]
    try:
        ctr = subprocess.run([*b, "from", "--quiet", "scratch"], check=True,
                             capture_output=True, text=True).stdout.strip()
        subprocess.run([*b, "copy", ctr, str(rnbuild.binary("pause")), "/pause"], check=True,
                       capture_output=True, text=True)
        subprocess.run([*b, "config", "--entrypoint", '["/pause"]', "--user", "65535:65535",
                        ctr], check=True, capture_output=True, text=True)
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}")
        subprocess.run([*b, "commit", "--quiet", "--rm", ctr,
                        f"docker-archive:{tmp}:{PAUSE_IMAGE}"], check=True,
                       capture_output=True, text=True)
        os.replace(tmp, dest)
    except subprocess.CalledProcessError as exc:
        raise NodeError(f"building the pause image failed: {exc.stderr.strip()[-800:]}"
                        ) from None
    finally:
        shutil.rmtree(store, ignore_errors=True)
