"""One control-plane run (ControlPlane): its state file, namespaces, processes, faults and
HTTP helpers; the runs on this machine and the stale ones."""

from __future__ import annotations

import base64
import contextlib
import fcntl
import ipaddress
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from epscripts.controlplane import build as cpbuild
from epscripts.controlplane.host import (
    APISERVERS,
    DEAD_MAC,
    DISABLED_ADMISSION,
    ETCD_PORT,
    HOST_INDEX,
    POD_SECURITY_DEFAULTS,
    PORT,
    PRODUCTION_ADMISSION_ENABLE,
    SA_ISSUER,
    SERVER_NAME,
    SPARE_APISERVERS,
    SUBNET_POOL,
    UP_TIMEOUT,
    CPError,
    run_ip,
    state_root,
)
from epscripts.controlplane.pki import kubeconfig, make_pki

# --- the run --------------------------------------------------------------------


class ControlPlane:
    """One run: its directory, state file, namespaces, links and processes."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir
        self.state: dict[str, Any] = json.loads((run_dir / "state.json").read_text())
        self._children: dict[str, subprocess.Popen[bytes]] = {}

    # -- state --

    @classmethod
    def create(cls, owner_pid: int | None = None) -> ControlPlane:
        root = state_root()
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        # Picking the /24 and recording it happen under one lock, so two sessions
        # starting together cannot pick the same one before either has made its bridge.
        lock = open(root / ".subnet.lock", "w")  # noqa: SIM115 - closed below
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return cls._create_locked(root, owner_pid)
        finally:
            lock.close()

    @classmethod
    def _create_locked(cls, root: Path, owner_pid: int | None) -> ControlPlane:
        run_id = secrets.token_hex(3)
        run_dir = root / run_id
        run_dir.mkdir(mode=0o700)
        taken = [ipaddress.ip_network(cp.state["subnet"]) for cp in runs()
                 if not cp.state.get("downed_at")]
        subnet = _free_subnet(taken)
        hosts = list(subnet.hosts())
        ips = {name: str(hosts[idx - 1]) for name, idx in HOST_INDEX.items()}
        state = {
            "id": run_id, "dir": str(run_dir), "owner_pid": owner_pid,
            "created_at": time.time(), "subnet": str(subnet), "ips": ips,
            "bridge": f"epcpb{run_id}",
            "netns": {n: f"epcp-{run_id}-{n}" for n in ("etcd", *APISERVERS)},
            "veth": {n: f"epcp{run_id}{n[-1] if n != 'etcd' else 'e'}"
                     for n in ("etcd", *APISERVERS)},
            "made": [],  # [kind, name, extra]: the journal `down` undoes in reverse
            "pids": {},
            "versions": {"kubernetes": cpbuild.KUBERNETES_VERSION, "etcd": cpbuild.ETCD_VERSION},
            "bin": str(cpbuild.cache_dir()),
        }
        (run_dir / "state.json").write_text(json.dumps(state, indent=1))
        with contextlib.suppress(OSError):
            (root / "current").unlink()
        (root / "current").symlink_to(run_id)
        return cls(run_dir)

    def save(self) -> None:
        tmp = self.dir / "state.json.tmp"
        tmp.write_text(json.dumps(self.state, indent=1))
        os.replace(tmp, self.dir / "state.json")

    def _journal(self, kind: str, name: str, extra: Any = None) -> None:
        self.state["made"].append([kind, name, extra])
        self.save()

    @property
    def id(self) -> str:
        return str(self.state["id"])

    def ip(self, name: str) -> str:
        return str(self.state["ips"][name])

    def endpoint(self, api: str) -> str:
        return f"{self.ip(api)}:{PORT}"

    @property
    def endpoints(self) -> list[str]:
        return [self.endpoint(a) for a in APISERVERS]

    @property
    def pki(self) -> Path:
        return self.dir / "pki"

    @property
    def ca(self) -> str:
        return str(self.pki / "ca.crt")

    def token(self, who: str = "admin") -> str:
        return (self.pki / f"{who}.token").read_text().strip()

    def token_file(self, who: str = "admin") -> str:
        return str(self.pki / f"{who}.token")

    def binary(self, name: str) -> str:
        return str(Path(self.state["bin"]) / name)

    # -- network --

    def _make_network(self) -> None:
        br = self.state["bridge"]
        subnet = ipaddress.ip_network(self.state["subnet"])
        self._journal("link", br)
        run_ip("link", "add", br, "type", "bridge")
        run_ip("addr", "add", f"{self.ip('bridge')}/{subnet.prefixlen}", "dev", br)
        run_ip("link", "set", br, "up")
        for name in self.state["netns"]:
            self._add_member(name)

    def _add_member(self, name: str) -> None:
        """The namespace of etcd or an apiserver on the run's bridge, journaled first."""
        br = self.state["bridge"]
        subnet = ipaddress.ip_network(self.state["subnet"])
        ns = self.state["netns"][name]
        if Path(f"/run/netns/{ns}").exists():
            raise CPError(f"network namespace {ns} exists already; not touching it")
        self._journal("netns", ns)
        run_ip("netns", "add", ns)
        self.state["made"][-1][2] = os.stat(f"/run/netns/{ns}").st_ino
        self.save()
        veth = self.state["veth"][name]
        self._journal("link", veth)
        run_ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        run_ip("-n", ns, "addr", "add", f"{self.ip(name)}/{subnet.prefixlen}", "dev", "eth0")
        run_ip("-n", ns, "link", "set", "lo", "up")
        run_ip("-n", ns, "link", "set", "eth0", "up")
        run_ip("link", "set", veth, "master", br, "up")

    def add_apiserver(self, api: str) -> None:
        """Make the namespace of a spare apiserver (SPARE_APISERVERS), so ``start`` can run
        it: a scale-out. Idempotent; ``down`` removes it with the rest of the run."""
        if api not in SPARE_APISERVERS:
            raise CPError(f"{api!r} is not a spare apiserver; one of "
                          f"{', '.join(SPARE_APISERVERS)}")
        if api in self.state["netns"]:
            return
        if api not in self.state["ips"]:
            raise CPError(f"run {self.id} predates spare apiservers (no address for {api})")
        self.state["netns"][api] = f"epcp-{self.id}-{api}"
        self.state["veth"][api] = f"epcp{self.id}{api[-1]}"
        self.save()
        self._add_member(api)

    def _ours(self, ns: str) -> bool:
        for kind, name, extra in self.state["made"]:
            if kind == "netns" and name == ns:
                try:
                    return extra is not None and os.stat(f"/run/netns/{ns}").st_ino == extra
                except FileNotFoundError:
                    return False
        return False

    # -- processes --

    def _pidfile(self, name: str) -> Path:
        return self.dir / f"{name}.pid"

    def pid(self, name: str) -> int | None:
        """The live process ``name`` of this run, or None."""
        child = self._children.get(name)
        if child is not None:
            # Our own child: authoritative, also between fork and exec, when its
            # command line is still this process's.
            return child.pid if child.poll() is None else None
        try:
            pid = int(self._pidfile(name).read_text())
        except (FileNotFoundError, ValueError):
            return None
        return pid if self._is_ours(pid) else None

    def _is_ours(self, pid: int) -> bool:
        """Alive and still the process we started (its argv names our run directory)."""
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
        return str(self.dir).encode() in cmdline

    def _spawn(self, name: str, ns: str, argv: list[str]) -> int:
        log_path = self.dir / f"{name}.log"
        with open(log_path, "ab") as logf:
            logf.write(f"---- start {time.strftime('%H:%M:%S')} ----\n".encode())
            logf.flush()
            # `ip netns exec` execs the binary: the pid is the binary's own.
            proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdin=subprocess.DEVNULL,
                                    stdout=logf, stderr=logf, start_new_session=True,
                                    close_fds=True)
        self._pidfile(name).write_text(f"{proc.pid}\n")
        self.state["pids"][name] = proc.pid
        self.save()
        # Kept to reap it when it exits while this process lives (a test session); a CLI
        # `up` exits at once and init reaps.
        self._children[name] = proc
        return proc.pid

    def _etcd_argv(self) -> list[str]:
        ip = self.ip("etcd")
        return [self.binary("etcd"), "--name=etcd0", f"--data-dir={self.dir}/etcd-data",
                f"--listen-client-urls=http://{ip}:{ETCD_PORT}",
                f"--advertise-client-urls=http://{ip}:{ETCD_PORT}",
                "--listen-peer-urls=http://127.0.0.1:2380",
                "--initial-advertise-peer-urls=http://127.0.0.1:2380",
                "--initial-cluster=etcd0=http://127.0.0.1:2380",
                "--initial-cluster-state=new",
                # A test fixture on tmp storage: fsync buys nothing and costs the others.
                "--unsafe-no-fsync", "--log-level=warn"]

    def _apiserver_argv(self, api: str, extra: list[str]) -> list[str]:
        pki = self.pki
        # A start that names its own --disable-admission-plugins (e.g. empty: a production
        # cluster's admission) replaces the run's list: kube-apiserver appends repeated
        # list flags and refuses a plugin both enabled and disabled.
        admission = ([] if any(a.startswith("--disable-admission-plugins=") for a in extra)
                     else [f"--disable-admission-plugins={DISABLED_ADMISSION}"])
        return [self.binary("kube-apiserver"),
                f"--etcd-servers=http://{self.ip('etcd')}:{ETCD_PORT}",
                f"--secure-port={PORT}", f"--bind-address={self.ip(api)}",
                f"--advertise-address={self.ip(api)}",
                f"--cert-dir={self.dir}/{api}-certs",
                f"--tls-cert-file={pki}/apiserver.crt",
                f"--tls-private-key-file={pki}/apiserver.key",
                f"--client-ca-file={pki}/ca.crt",
                f"--service-account-key-file={pki}/sa.pub",
                f"--service-account-signing-key-file={pki}/sa.key",
                f"--service-account-issuer={SA_ISSUER}",
                f"--token-auth-file={pki}/tokens.csv",
                "--authorization-mode=Node,RBAC",
                "--endpoint-reconciler-type=lease",
                "--service-cluster-ip-range=10.96.0.0/24",
                "--profiling=false", "--enable-priority-and-fairness=false",
                "--watch-cache=false", "--enable-garbage-collector=false", "--event-ttl=5m",
                *admission, "--v=1", *extra]

    def production_admission(self) -> list[str]:
        """Extra flags for ``start``: admission as a production cluster has it (host.py),
        with its PodSecurity configuration written into the run directory."""
        path = self.dir / "admission.json"
        defaults: dict[str, str] = {}
        for mode, level in POD_SECURITY_DEFAULTS.items():
            defaults.update({mode: level, f"{mode}-version": "latest"})
        path.write_text(json.dumps({
            "apiVersion": "apiserver.config.k8s.io/v1", "kind": "AdmissionConfiguration",
            "plugins": [{"name": "PodSecurity", "configuration": {
                "apiVersion": "pod-security.admission.config.k8s.io/v1",
                "kind": "PodSecurityConfiguration", "defaults": defaults,
                "exemptions": {"usernames": [], "runtimeClasses": [], "namespaces": []}}}],
        }, indent=1) + "\n")
        return ["--disable-admission-plugins=",
                f"--enable-admission-plugins={PRODUCTION_ADMISSION_ENABLE}",
                f"--admission-control-config-file={path}"]

    def start_etcd(self) -> int:
        if self.pid("etcd"):
            raise CPError("etcd is running already")
        return self._spawn("etcd", self.state["netns"]["etcd"], self._etcd_argv())

    def start(self, api: str, extra: list[str] | None = None) -> int:
        """Start an apiserver (``extra`` flags for this start only); returns its pid."""
        self._check_api(api)
        if self.pid(api):
            raise CPError(f"{api} is running already (pid {self.pid(api)})")
        self.state.setdefault("extra", {})[api] = list(extra or [])
        return self._spawn(api, self.state["netns"][api], self._apiserver_argv(api, extra or []))

    def extra_args(self, api: str) -> list[str]:
        """The extra flags ``api`` was last started with (empty: the defaults)."""
        return list(self.state.get("extra", {}).get(api, []))

    def _check_api(self, api: str) -> None:
        if api not in APISERVERS and not (api in SPARE_APISERVERS
                                          and api in self.state["netns"]):
            raise CPError(f"unknown apiserver {api!r}; one of {', '.join(APISERVERS)}"
                          f" (or a spare added with add_apiserver: "
                          f"{', '.join(SPARE_APISERVERS)})")

    def signal(self, name: str, sig: signal.Signals) -> int:
        pid = self.pid(name)
        if pid is None:
            raise CPError(f"{name} is not running")
        os.kill(pid, sig)
        return pid

    def _reap(self) -> None:
        for name, child in list(self._children.items()):
            if child.poll() is not None:
                del self._children[name]

    def running(self, name: str) -> bool:
        self._reap()
        return self.pid(name) is not None

    def wait_exit(self, name: str, timeout: float) -> bool:
        pid = self.state["pids"].get(name)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._reap()
            if pid is None or self.pid(name) is None:
                child = self._children.pop(name, None)
                if child is not None:  # a zombie of ours: collect it
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        child.wait(max(0.1, deadline - time.monotonic()))
                return True
            time.sleep(0.05)
        return False

    def kill(self, api: str) -> None:
        self._check_api(api)
        self.signal(api, signal.SIGKILL)
        self.wait_exit(api, 10)

    def term(self, api: str) -> None:
        """Graceful SIGTERM; returns once the signal is sent (the process drains on its own)."""
        self._check_api(api)
        self.signal(api, signal.SIGTERM)

    def stop(self, api: str) -> None:
        self._check_api(api)
        self.signal(api, signal.SIGSTOP)

    def cont(self, api: str) -> None:
        self._check_api(api)
        self.signal(api, signal.SIGCONT)

    def etcd_down(self) -> None:
        self.signal("etcd", signal.SIGKILL)
        self.wait_exit("etcd", 10)

    def etcd_up(self) -> None:
        self.start_etcd()
        self.wait_etcd(30)

    # -- partitions --

    def partition_etcd(self, api: str) -> None:
        """Frames between ``api`` and etcd go to a MAC nobody has: both directions drop."""
        self._check_api(api)
        ns = self.state["netns"]
        run_ip("-n", ns[api], "neigh", "replace", self.ip("etcd"), "lladdr", DEAD_MAC,
            "dev", "eth0", "nud", "permanent")
        run_ip("-n", ns["etcd"], "neigh", "replace", self.ip(api), "lladdr", DEAD_MAC,
            "dev", "eth0", "nud", "permanent")

    def heal(self, api: str) -> None:
        self._check_api(api)
        ns = self.state["netns"]
        run_ip("-n", ns[api], "neigh", "del", self.ip("etcd"), "dev", "eth0", check=False)
        run_ip("-n", ns["etcd"], "neigh", "del", self.ip(api), "dev", "eth0", check=False)

    # -- HTTP helpers (root namespace, over the bridge) --

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=self.ca)

    def request(self, api: str, path: str, method: str = "GET", body: Any = None,
                token: str | None = "admin", timeout: float = 5.0,
                cert: str | None = None, content_type: str = "application/json",
                ) -> tuple[int, Any]:
        """(status, decoded JSON or text) from one apiserver, verified as kubernetes.default.svc."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"https://{self.endpoint(api)}{path}", data=data,
                                     method=method)
        if token:
            req.add_header("Authorization", f"Bearer {self.token(token)}")
        if data is not None:
            req.add_header("Content-Type", content_type)  # a PATCH: its patch type
        ctx = self.ssl_context()
        if cert:  # a client certificate of the run's PKI, by name: "node", "admin"
            ctx.load_cert_chain(str(self.pki / f"{cert}.crt"), str(self.pki / f"{cert}.key"))
        try:
            with _sni_opener(ctx).open(req, timeout=timeout) as resp:
                raw = resp.read()
                status = resp.status
        except urllib.error.HTTPError as exc:
            with exc:
                raw = exc.read()
                status = exc.code
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")

    def readyz(self, api: str, timeout: float = 3.0) -> int | None:
        try:
            return self.request(api, "/readyz", timeout=timeout)[0]
        except (OSError, ssl.SSLError):
            return None

    def slice_addresses(self, via: str | None = None) -> set[str] | None:
        """Addresses in the ``kubernetes`` EndpointSlice (the first apiserver that answers)."""
        for api in ([via] if via else APISERVERS):
            try:
                status, body = self.request(
                    api, "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"
                    "?labelSelector=kubernetes.io%2Fservice-name%3Dkubernetes", timeout=3)
            except (OSError, ssl.SSLError):
                continue
            if status == 200 and isinstance(body, dict):
                out = set()
                for item in body.get("items") or []:
                    for ep in item.get("endpoints") or []:
                        if (ep.get("conditions") or {}).get("ready") is False:
                            continue
                        out.update(ep.get("addresses") or [])
                return out
        return None

    def wait_etcd(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.etcd_revision()
                return
            except (OSError, CPError, ValueError):
                time.sleep(0.1)
        raise CPError(f"etcd not serving within {timeout:g}s (see {self.dir}/etcd.log)")

    def wait_ready(self, apis: tuple[str, ...] | list[str] = APISERVERS,
                   timeout: float = UP_TIMEOUT, in_slice: bool = True) -> float:
        """Wait until each of ``apis`` answers /readyz 200 (and is in the slice); seconds taken."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        want = {self.ip(a) for a in apis}
        while True:
            for api in apis:
                if self.pid(api) is None:
                    tail = (self.dir / f"{api}.log").read_text(errors="replace")[-1500:]
                    raise CPError(f"{api} exited while starting; log tail:\n{tail}")
            ready = all(self.readyz(a) == 200 for a in apis)
            if ready and (not in_slice or want <= (self.slice_addresses() or set())):
                return time.monotonic() - t0
            if time.monotonic() > deadline:
                raise CPError(f"{', '.join(apis)} not ready (and in the kubernetes "
                              f"EndpointSlice) within {timeout:g}s; logs in {self.dir}")
            time.sleep(0.2)

    def wait_slice(self, want: set[str], timeout: float) -> float:
        t0 = time.monotonic()
        while self.slice_addresses() != want:
            if time.monotonic() - t0 > timeout:
                raise CPError(f"EndpointSlice never became {sorted(want)} "
                              f"(last {self.slice_addresses()}) within {timeout:g}s")
            time.sleep(0.2)
        return time.monotonic() - t0

    # -- etcd --

    def _etcd_post(self, path: str, body: dict[str, Any], timeout: float = 5.0) -> Any:
        req = urllib.request.Request(f"http://{self.ip('etcd')}:{ETCD_PORT}{path}",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with _plain_opener().open(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    def etcd_revision(self) -> int:
        out = self._etcd_post("/v3/kv/range", {"key": base64.b64encode(b"/").decode(),
                                               "limit": 1})
        return int(out["header"]["revision"])

    def compact(self) -> int:
        """Compact etcd at its current revision; returns that revision."""
        rev = self.etcd_revision()
        self._etcd_post("/v3/kv/compaction", {"revision": rev, "physical": True}, timeout=30)
        return rev

    # -- up / down --

    def up(self, timeout: float = UP_TIMEOUT) -> float:
        t0 = time.monotonic()
        self._make_network()
        # The spares' addresses too: a scale-out serves the same certificate.
        make_pki(self.pki, [self.ip(a) for a in (*APISERVERS, *SPARE_APISERVERS)
                            if a in self.state["ips"]])
        self.write_kubeconfigs()
        self.start_etcd()
        self.wait_etcd(30)
        for api in APISERVERS:
            self.start(api)
        self.wait_ready(timeout=timeout)
        self._bootstrap_rbac()
        return time.monotonic() - t0

    def write_kubeconfigs(self) -> None:
        for api in APISERVERS:
            (self.dir / f"admin-{api}.kubeconfig").write_text(kubeconfig(
                f"https://{self.endpoint(api)}", self.ca, token=self.token("admin")))
        (self.dir / "admin.kubeconfig").write_text(kubeconfig(
            f"https://{self.endpoint('api1')}", self.ca, token=self.token("admin")))
        (self.dir / "node.kubeconfig").write_text(kubeconfig(
            f"https://{self.endpoint('api1')}", self.ca, cert=str(self.pki / "node.crt"),
            key=str(self.pki / "node.key")))

    def proxy_kubeconfig(self, port: int, path: Path, who: str = "admin",
                         host: str = "127.0.0.1") -> Path:
        """A kubeconfig that reaches the cluster through a local proxy on ``host:port``."""
        path.write_text(kubeconfig(f"https://{host}:{port}", self.ca, token=self.token(who)))
        return path

    def _bootstrap_rbac(self) -> None:
        """What the chart grants extractedprism: get/list/watch EndpointSlices."""
        role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                "metadata": {"name": "extractedprism"},
                "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                           "verbs": ["get", "list", "watch"]}]}
        binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                   "metadata": {"name": "extractedprism"},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                               "name": "extractedprism"},
                   "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                                 "name": "extractedprism"}]}
        base = "/apis/rbac.authorization.k8s.io/v1"
        for path, obj in ((f"{base}/clusterroles", role),
                          (f"{base}/clusterrolebindings", binding)):
            status, body = self.request("api1", path, method="POST", body=obj)
            if status not in (201, 409):
                raise CPError(f"creating {obj['kind']} extractedprism: {status} {body}")

    def down(self) -> list[str]:
        """Stop every process, delete every namespace and link this run made; idempotent."""
        done = []
        if (self.state.get("realnode") or {}).get("nodes"):
            # Real nodes first (scripts/realnode): their mounts, cgroups, containers and
            # the sysctls their kubelets changed are not in the journal below.
            from epscripts.realnode.node import RealNodes

            done += RealNodes(self).down()
        names = sorted(self.state["pids"], key=lambda n: n == "etcd")  # apiservers first
        for name in names:
            pid = self.pid(name)
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)  # a stopped process would not die of TERM
                    os.kill(pid, signal.SIGKILL)
                done.append(f"killed {name} pid {pid}")
        for name in names:
            self.wait_exit(name, 10)
        for kind, name, _ in reversed(self.state["made"]):
            if kind == "link":
                if run_ip("link", "show", name, check=False).returncode == 0:
                    run_ip("link", "del", name, check=False)
                    done.append(f"deleted link {name}")
            elif kind == "netns":
                if self._ours(name):
                    run_ip("netns", "del", name, check=False)
                    done.append(f"deleted netns {name}")
                elif Path(f"/run/netns/{name}").exists():
                    done.append(f"left netns {name}: not the one this run made")
        # `ip netns del` frees the namespace's devices asynchronously: wait for the veths.
        deadline = time.monotonic() + 10
        for kind, name, _ in self.state["made"]:
            while (kind == "link" and time.monotonic() < deadline
                   and run_ip("link", "show", name, check=False).returncode == 0):
                time.sleep(0.05)
        # The WAL preallocates 64 MiB; logs, state and PKI stay until `down --stale`.
        shutil.rmtree(self.dir / "etcd-data", ignore_errors=True)
        self.state["downed_at"] = time.time()
        self.save()
        return done


class _SNIHTTPSHandler(urllib.request.HTTPSHandler):
    """Connect to the IP in the URL, but send SNI and verify as kubernetes.default.svc."""

    def __init__(self, ctx: ssl.SSLContext) -> None:
        super().__init__(context=ctx)
        self._ctx = ctx

    def https_open(self, req: urllib.request.Request) -> Any:
        import http.client

        ctx = self._ctx

        class Conn(http.client.HTTPSConnection):
            def connect(self) -> None:
                http.client.HTTPConnection.connect(self)
                self.sock = ctx.wrap_socket(self.sock, server_hostname=SERVER_NAME)

        return self.do_open(Conn, req)


def _sni_opener(ctx: ssl.SSLContext) -> urllib.request.OpenerDirector:
    return urllib.request.build_opener(urllib.request.ProxyHandler({}), _SNIHTTPSHandler(ctx))


def _plain_opener() -> urllib.request.OpenerDirector:
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _free_subnet(taken: list[Any]) -> ipaddress.IPv4Network:
    out = run_ip("-4", "-o", "addr", "show").stdout
    used = list(taken)
    for line in out.splitlines():
        parts = line.split()
        if "inet" in parts:
            used.append(ipaddress.ip_interface(parts[parts.index("inet") + 1]).network)
    routes = run_ip("-4", "route", "show", "table", "all", check=False).stdout.split()
    for word in routes:
        with contextlib.suppress(ValueError):
            if "/" in word:
                used.append(ipaddress.ip_network(word, strict=False))
    candidates = [n for n in SUBNET_POOL if not any(n.overlaps(u) for u in used)]
    if not candidates:
        raise CPError("no free /24 in 192.168.200.0-192.168.254.255 for the control plane")
    return candidates[secrets.randbelow(len(candidates))]


def runs() -> list[ControlPlane]:
    out = []
    root = state_root()
    if not root.is_dir():
        return out
    for d in sorted(root.iterdir()):
        if d.is_dir() and (d / "state.json").is_file():
            with contextlib.suppress(ValueError, OSError):
                out.append(ControlPlane(d))
    return out


def _owner_alive(cp: ControlPlane) -> bool:
    pid = cp.state.get("owner_pid")
    if not pid:
        return True  # started by a person: only an explicit `down` ends it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def down_stale() -> list[str]:
    """Take down runs whose owning process (a test session) is gone; remove downed runs' dirs."""
    out = []
    for cp in runs():
        if cp.state.get("downed_at"):
            shutil.rmtree(cp.dir, ignore_errors=True)
            continue
        if not _owner_alive(cp):
            out += [f"stale run {cp.id}: {line}" for line in cp.down()]
            shutil.rmtree(cp.dir, ignore_errors=True)
    return out


def current(run: str | None) -> ControlPlane:
    root = state_root()
    if run:
        path = Path(run) if "/" in run else root / run
    else:
        env = os.environ.get("EP_CONTROLPLANE_RUN")
        path = Path(env) if env else root / "current"
    if not (path / "state.json").is_file():
        raise CPError(f"no control-plane run at {path} (run `scripts/controlplane up` first)")
    return ControlPlane(path.resolve())
