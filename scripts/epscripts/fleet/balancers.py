"""The node-local balancers a fleet node can run, each as a node runs it in production.

* ``extractedprism``: as its static pod would run it (``extractedprism static-pod``): its
  default port 7445 on the node's loopback, readyz probes with the node's own client
  certificate, discovery through its own listener with its own identity (the token of the
  user ``extractedprism``, bound at ``scripts/controlplane up`` to the chart's ClusterRole,
  standing in for the ServiceAccount token docs/deploy.md recommends), a state file.
* ``haproxy`` and ``nginx``: the configurations kubespray renders
  (``roles/kubernetes/node/templates/loadbalancer/haproxy.cfg.j2`` and ``nginx.conf.j2``
  at kubespray commit 46dbdd3994b3, with the role's and the sample inventory's values:
  ``loadbalancer_apiserver_port`` 6443 -> here 7445 so every balancer takes the same
  port, ``loadbalancer_apiserver_healthcheck_port`` 8081,
  ``loadbalancer_apiserver_keepalive_timeout`` 5m, no IPv6), run from Debian's packages.
  The rendered text is kept directive for directive; the only additions are the ones
  Debian's packaging needs (nginx's stream module is a loadable module there) and, on
  the command line, a pid file per node (N nginx masters would otherwise share one).
* ``go-original``: lexfrei/extractedprism built by hand from its public source (the Go
  module proxy does not serve it; this project does not build or ship it), with its own
  defaults; given by path.

Every balancer listens on 127.0.0.1:7445 inside the node's network namespace, so the
kubelet's kubeconfig is the same for every kind.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

KINDS = ("extractedprism", "haproxy", "nginx", "go-original")
LB_PORT = 7445  # every kind listens here, on the node namespace's own loopback
HEALTH_PORT = 7446  # extractedprism's and the Go original's health port
# The sample inventory's loadbalancer_apiserver_healthcheck_port and the node role's
# loadbalancer_apiserver_keepalive_timeout.
KUBESPRAY_HEALTHCHECK_PORT = 8081
KUBESPRAY_KEEPALIVE = "5m"
KUBESPRAY_COMMIT = "46dbdd3994b32640bcd806b0097f50e8fdf1d514"
HAPROXY_DEFAULT_SERVER = ("inter 15s downinter 15s rise 2 fall 2 slowstart 60s maxconn 1000 "
                          "maxqueue 256 weight 100")
NGINX_STREAM_MODULE = "/usr/lib/nginx/modules/ngx_stream_module.so"  # libnginx-mod-stream
# In an extra extractedprism argument, stands for the node's own directory (a per-node
# path such as --handover-socket={node_dir}/handover.sock; scripts/chaos).
NODE_DIR = "{node_dir}"


@dataclass
class NodeFiles:
    """What a node's balancer is given: the run's CA, the node's key pair, its paths."""

    name: str
    dir: Path
    ca: str
    cert: str
    key: str
    discovery_token: str
    endpoints: list[str]
    extra: list[str] = field(default_factory=list)


# HAProxy's and nginx's masters fork workers, which outlive a master killed with SIGKILL
# (as `scripts/controlplane down` kills a crashed run's processes). In a PID namespace of
# their own under `unshare --kill-child`, killing the recorded pid (unshare's) kills the
# master, the namespace's init, and with it every worker.
PID_NS = ["unshare", "--pid", "--fork", "--kill-child"]


def haproxy_cfg(endpoints: list[str], *, port: int = LB_PORT,
                health: str = f"0.0.0.0:{KUBESPRAY_HEALTHCHECK_PORT}") -> str:
    """kubespray's haproxy.cfg.j2, rendered with its defaults for these API servers
    (``port`` and ``health``: where a bench puts it on a shared loopback instead)."""
    servers = "".join(f"  server api{i} {ep} check check-ssl verify none\n"
                      for i, ep in enumerate(endpoints, 1))
    # HAProxy 2.6 refuses a file whose last line lacks its newline: the text ends in one.
    return f"""global
    maxconn                 4000
    log                     127.0.0.1 local0

defaults
    mode                    http
    log                     global
    option                  httplog
    option                  dontlognull
    option                  http-server-close
    option                  redispatch
    retries                 5
    timeout http-request    5m
    timeout queue           5m
    timeout connect         30s
    timeout client          {KUBESPRAY_KEEPALIVE}
    timeout server          15m
    timeout http-keep-alive 30s
    timeout check           30s
    maxconn                 4000

frontend healthz
  bind {health}
  mode http
  monitor-uri /healthz

frontend kube_api_frontend
  bind 127.0.0.1:{port}
  mode tcp
  option tcplog
  default_backend kube_api_backend

backend kube_api_backend
  mode tcp
  balance leastconn
  default-server {HAPROXY_DEFAULT_SERVER}
  option httpchk GET /healthz
  http-check expect status 200
{servers}"""


def nginx_conf(endpoints: list[str], *, port: int = LB_PORT,
               health: str = str(KUBESPRAY_HEALTHCHECK_PORT), head: str = "",
               http: str = "") -> str:
    """kubespray's nginx.conf.j2 with its defaults; Debian loads the stream module.
    ``port``, ``health`` (a listen argument), ``head`` (main-context lines) and ``http``
    (http-context lines) are for a bench that runs it outside a node."""
    servers = "".join(f"    server {ep};\n" for ep in endpoints)
    return f"""load_module {NGINX_STREAM_MODULE};
{head}error_log stderr notice;

worker_processes 2;
worker_rlimit_nofile 65535;
worker_shutdown_timeout 10s;

events {{
  multi_accept on;
  use epoll;
  worker_connections 16384;
}}

stream {{
  upstream kube_apiserver {{
    least_conn;
{servers}  }}

  server {{
    listen        127.0.0.1:{port};
    proxy_pass    kube_apiserver;
    proxy_timeout 10m;
    proxy_connect_timeout 1s;
  }}
}}

http {{
{http}  aio threads;
  aio_write on;
  tcp_nopush on;
  tcp_nodelay on;

  keepalive_timeout {KUBESPRAY_KEEPALIVE};
  keepalive_requests 100;
  reset_timedout_connection on;
  server_tokens off;
  autoindex off;

  server {{
    listen {health};
    location /healthz {{
      access_log off;
      return 200;
    }}
    location /stub_status {{
      stub_status on;
      access_log off;
    }}
  }}
}}
"""


def missing(kind: str, ep_cmd: list[str] | None, go_original_bin: str | None) -> str | None:
    """Why ``kind`` cannot run here, in one line (None: it can)."""
    if kind not in KINDS:
        return f"unknown balancer {kind!r}; one of {', '.join(KINDS)}"
    if kind == "haproxy" and shutil.which("haproxy") is None:
        return "no haproxy (apt-get install haproxy)"
    if kind == "nginx":
        if shutil.which("nginx") is None:
            return "no nginx (apt-get install nginx libnginx-mod-stream)"
        if not Path(NGINX_STREAM_MODULE).exists():
            return f"no {NGINX_STREAM_MODULE} (apt-get install libnginx-mod-stream)"
    if kind == "go-original" and not (go_original_bin and Path(go_original_bin).is_file()):
        return ("go-original needs --go-original-bin PATH: lexfrei/extractedprism built by "
                "hand from its public source (docs/fleet.md)")
    if kind == "extractedprism" and not ep_cmd:
        return "no command for extractedprism"
    return None


def kubeconfig_text(server: str, files: NodeFiles, token: str | None = None,
                    cert: bool = False) -> str:
    """A kubeconfig through the node's balancer, verified as kubernetes.default.svc."""
    import json

    user: dict[str, str] = {}
    if token:
        user["token"] = token
    if cert:
        user["client-certificate"] = files.cert
        user["client-key"] = files.key
    return json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "node",
        "clusters": [{"name": "node", "cluster": {
            "server": server, "certificate-authority": files.ca,
            "tls-server-name": "kubernetes.default.svc"}}],
        "users": [{"name": "node", "user": user}],
        "contexts": [{"name": "node", "context": {"cluster": "node", "user": "node"}}],
    }, indent=1) + "\n"


def argv(kind: str, files: NodeFiles, ep_cmd: list[str], go_original_bin: str | None,
         ) -> tuple[list[str], dict[str, str]]:
    """The command line (and extra environment) of ``kind`` for one node.

    Every command line names a file in the node's directory, inside the run directory:
    that is how scripts/controlplane recognises the run's processes before it signals one.
    """
    d = files.dir
    eps = ",".join(files.endpoints)
    if kind == "extractedprism":
        kc = d / "discovery.kubeconfig"
        kc.write_text(kubeconfig_text(f"https://127.0.0.1:{LB_PORT}", files,
                                      token=files.discovery_token))
        kc.chmod(0o600)
        return [*ep_cmd, f"--bind-port={LB_PORT}", f"--health-port={HEALTH_PORT}",
                f"--endpoints={eps}", "--health-check=readyz",
                f"--health-check-ca-file={files.ca}",
                f"--health-check-cert-file={files.cert}",
                f"--health-check-key-file={files.key}",
                f"--kubeconfig={kc}", f"--state-file={d / 'extractedprism.state'}",
                f"--admin-socket={d / 'extractedprism.admin'}",
                *(a.replace(NODE_DIR, str(d)) for a in files.extra)], {}
    if kind == "haproxy":
        cfg = d / "haproxy.cfg"
        cfg.write_text(haproxy_cfg(files.endpoints))
        # -W -db: master-worker in the foreground, as the haproxy image's entrypoint runs it.
        return [*PID_NS, "haproxy", "-W", "-db", "-f", str(cfg), *files.extra], {}
    if kind == "nginx":
        conf = d / "nginx.conf"
        conf.write_text(nginx_conf(files.endpoints))
        # `daemon off` as the nginx image's CMD; the pid file and prefix per node because
        # the Debian build's defaults (/run/nginx.pid) would be shared by every node.
        return [*PID_NS, "nginx", "-p", str(d), "-e", "stderr", "-c", str(conf), "-g",
                f"daemon off; pid {d / 'nginx.pid'};", *files.extra], {}
    if kind == "go-original":
        assert go_original_bin
        # It reads only the in-cluster service-account files for discovery: give it its
        # own /run (a tmpfs in a private mount namespace) holding a token and the CA, and
        # the in-cluster environment pointing at its own listener (the serving
        # certificate names 127.0.0.1).
        sa = "/run/secrets/kubernetes.io/serviceaccount"
        script = (f"mount -t tmpfs -o size=1m,mode=0755 tmpfs /run && mkdir -p {sa} && "
                  f"cp {files.ca} {sa}/ca.crt && cp {d / 'sa-token'} {sa}/token && "
                  f"echo default > {sa}/namespace && exec \"$0\" \"$@\"")
        (d / "sa-token").write_text(files.discovery_token)
        (d / "sa-token").chmod(0o600)
        # Started through a link in the node's directory, so its command line names the run.
        link = d / "extractedprism-go"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(Path(go_original_bin).resolve())
        return ["unshare", "-m", "--propagation", "private", "sh", "-c", script,
                str(link), f"--bind-port={LB_PORT}", f"--health-port={HEALTH_PORT}",
                f"--endpoints={eps}", *files.extra], {
                    "KUBERNETES_SERVICE_HOST": "127.0.0.1",
                    "KUBERNETES_SERVICE_PORT": str(LB_PORT)}
    raise ValueError(kind)
