"""Configuration: one declarative flag table -> configargparse -> validate() -> Config (pure).

Every flag is one :class:`Flag` row (name, EP_ env var, kind, default, help), so the
command line, the environment, the defaults, ``--help`` and the chart cannot drift
apart. argparse only collects strings; :func:`validate` converts and checks them all
and reports *every* problem at once, each naming the flag and the offending value.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass

from extractedprism.endpoints import Endpoint, is_valid_host, parse_endpoint_list

LOG_LEVELS = ("debug", "info", "warn", "error", "dpanic", "panic", "fatal")
SELECTION_MODES = ("random", "latency", "least-conn")
HEALTH_CHECKS = ("tcp", "readyz")
PIPE_SCHED_POLICIES = ("batch", "normal")


class ConfigError(ValueError):
    """Invalid configuration; ``problems`` lists every message."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = list(problems)


# --- durations ---------------------------------------------------------------

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Go-style duration (``20s``, ``500ms``, ``1m30s``, ``-1s``) or bare seconds -> seconds."""
    raw = text.strip()
    if not raw:
        raise ValueError("empty duration")
    try:
        return float(raw)
    except ValueError:
        pass
    sign = 1.0
    body = raw
    if body[0] in "+-":
        sign = -1.0 if body[0] == "-" else 1.0
        body = body[1:]
    pos, total = 0, 0.0
    while pos < len(body):
        m = _DURATION_PART.match(body, pos)
        if not m:
            raise ValueError(f"{text!r} is not a duration (examples: 20s, 500ms, 1m30s)")
        total += float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
        pos = m.end()
    if pos == 0:
        raise ValueError(f"{text!r} is not a duration (examples: 20s, 500ms, 1m30s)")
    return sign * total


def format_duration(seconds: float) -> str:
    """Seconds -> Go-style text, so messages echo what an operator would have typed."""
    if seconds == 0:
        return "0s"
    sign = "-" if seconds < 0 else ""
    s = abs(seconds)
    if s < 1:
        ms = s * 1000
        return f"{sign}{ms:g}ms"
    hours, rem = divmod(s, 3600)
    minutes, secs = divmod(rem, 60)
    out = ""
    if hours:
        out += f"{int(hours)}h"
    if minutes:
        out += f"{int(minutes)}m"
    if secs or not out:
        out += f"{round(secs, 6):g}s"
    return sign + out


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("true", "1", "yes", "y", "on", "t"):
        return True
    if value in ("false", "0", "no", "n", "off", "f"):
        return False
    raise ValueError(f"{text!r} is not a boolean (use true/false, 1/0, yes/no)")


# --- the flag table ----------------------------------------------------------


@dataclass(frozen=True)
class Flag:
    name: str  # without leading dashes
    kind: str  # str | int | duration | bool | choice | endpoints | path
    default: str | None
    help: str
    choices: tuple[str, ...] = ()

    @property
    def option(self) -> str:
        return "--" + self.name

    @property
    def env(self) -> str:
        return "EP_" + self.name.upper().replace("-", "_")

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")


FLAGS: tuple[Flag, ...] = (
    Flag("bind-address", "str", "127.0.0.1", "Address for the TCP load balancer listener"),
    Flag("bind-port", "int", "7445", "Port for the TCP load balancer listener"),
    Flag("health-port", "int", "7446", "Port for the health check HTTP server"),
    Flag(
        "health-bind-address",
        "str",
        None,
        "Address for the health check HTTP server (default: same as --bind-address)",
    ),
    Flag("endpoints", "endpoints", None, "Comma-separated API server endpoints (host:port)"),
    Flag("health-interval", "duration", "20s", "Interval between upstream health checks"),
    Flag("health-timeout", "duration", "15s", "Timeout for each upstream health check"),
    Flag("enable-discovery", "bool", "true", "Enable Kubernetes EndpointSlice discovery"),
    Flag("log-level", "choice", "info", "Log level", LOG_LEVELS),
    Flag("liveness-interval", "duration", "5s", "Heartbeat probe interval for liveness detection"),
    Flag(
        "liveness-threshold",
        "duration",
        "15s",
        "Maximum time since last heartbeat before liveness fails",
    ),
    Flag(
        "drain-timeout",
        "duration",
        "30s",
        "Grace period for connections to removed endpoints, and with readyz to unready ones "
        "while another upstream is ready, before force close (0 closes immediately)",
    ),
    Flag(
        "upstream-selection",
        "choice",
        "random",
        "How new connections pick an upstream: random (uniform among pickable upstreams), "
        "latency (prefer the lowest-latency tier) or least-conn (fewest active connections)",
        SELECTION_MODES,
    ),
    Flag(
        "health-check",
        "choice",
        "tcp",
        "Upstream health check: tcp (connect only) or readyz (connect, then prefer upstreams "
        "answering 200 on GET /readyz)",
        HEALTH_CHECKS,
    ),
    Flag(
        "health-check-ca-file",
        "path",
        "",
        "CA bundle that verifies the upstream serving certificates; required with readyz",
    ),
    Flag("health-check-cert-file", "path", "", "Client certificate for the readyz probe"),
    Flag(
        "health-check-key-file",
        "path",
        "",
        "Client key for the readyz probe; may be the same file as the certificate",
    ),
    Flag("health-check-token-file", "path", "", "Bearer token for the readyz probe"),
    Flag(
        "health-check-server-name",
        "str",
        "kubernetes.default.svc",
        "Name the upstream serving certificates are verified against",
    ),
    Flag(
        "kubeconfig",
        "path",
        "",
        "Kubeconfig for EndpointSlice discovery outside a cluster (default: in-cluster config)",
    ),
    Flag(
        "max-connections",
        "int",
        "4096",
        "Maximum concurrent proxied connections; at the limit new clients wait in the backlog",
    ),
    Flag(
        "pipe-sched",
        "choice",
        "batch",
        "Linux scheduling policy of the acceptor and pipe threads: batch (SCHED_BATCH, nice "
        "unchanged: a woken pipe thread does not preempt the one holding the GIL, which "
        "saves most context switches) or normal (SCHED_OTHER)",
        PIPE_SCHED_POLICIES,
    ),
    Flag(
        "admin-socket",
        "path",
        "",
        "Unix socket for runtime control (`extractedprism admin`: drain, undrain, close, "
        "list), created with mode 0600 so only this user and root can use it; never a TCP "
        "port (empty: off)",
    ),
)

FLAG_BY_NAME = {f.name: f for f in FLAGS}


# --- the validated configuration ---------------------------------------------


@dataclass(frozen=True)
class Config:
    """Validated, immutable configuration. Durations are float seconds."""

    endpoints: tuple[Endpoint, ...]
    bind_address: str = "127.0.0.1"
    bind_port: int = 7445
    health_port: int = 7446
    health_bind_address: str = "127.0.0.1"
    health_interval: float = 20.0
    health_timeout: float = 15.0
    enable_discovery: bool = True
    log_level: str = "info"
    liveness_interval: float = 5.0
    liveness_threshold: float = 15.0
    drain_timeout: float = 30.0
    upstream_selection: str = "random"
    health_check: str = "tcp"
    health_check_ca_file: str = ""
    health_check_cert_file: str = ""
    health_check_key_file: str = ""
    health_check_token_file: str = ""
    health_check_server_name: str = "kubernetes.default.svc"
    kubeconfig: str = ""
    max_connections: int = 4096
    pipe_sched: str = "batch"
    admin_socket: str = ""

    def replace(self, **changes: object) -> Config:
        """A copy with some fields changed (tests and tools; no re-validation)."""
        return dataclasses.replace(self, **changes)


def _show(flag: Flag, raw: str) -> str:
    return f"{flag.option} ({raw})"


def validate(values: dict[str, str | None]) -> Config:
    """Convert and check raw flag strings (keyed by dest); raise ConfigError with all problems.

    Cross-field rules are checked only when both fields converted, so one bad value
    yields one message instead of a cascade.
    """
    problems: list[str] = []
    out: dict[str, object] = {}
    raw: dict[str, str] = {}

    for flag in FLAGS:
        value = values.get(flag.dest)
        if value is None:
            value = flag.default
        if value is None:
            continue
        raw[flag.dest] = value
        try:
            out[flag.dest] = _convert(flag, value)
        except ValueError as exc:
            problems.append(f"{_show(flag, value)} is invalid: {exc}")

    def have(*names: str) -> bool:
        return all(n in out for n in names)

    def p(name: str) -> str:
        return _show(FLAG_BY_NAME[name.replace("_", "-")], raw[name])

    # Addresses.
    if "health_bind_address" not in raw and "bind_address" in raw:
        raw["health_bind_address"] = raw["bind_address"]
        out["health_bind_address"] = out.get("bind_address", raw["bind_address"])
    for name in ("bind_address", "health_bind_address"):
        if have(name) and not is_valid_host(str(out[name])):
            problems.append(f"{p(name)} must be a valid IP address or RFC 1123 hostname")

    # Endpoints.
    if "endpoints" not in raw or not raw["endpoints"].strip():
        problems.append(
            "--endpoints is required: give a comma-separated list of API server host:port pairs"
        )
    elif have("endpoints") and not out["endpoints"]:
        problems.append(f"{p('endpoints')} must not be empty")

    # Ports.
    for name in ("bind_port", "health_port"):
        if have(name) and not 1 <= int(out[name]) <= 65535:  # type: ignore[call-overload]
            problems.append(f"{p(name)} must be in the range 1-65535")
    if have("bind_port", "health_port") and out["bind_port"] == out["health_port"]:
        problems.append(f"{p('bind_port')} and {p('health_port')} must differ")

    # Durations.
    for name in ("health_interval", "health_timeout", "liveness_interval", "liveness_threshold"):
        if have(name) and float(out[name]) < 1.0:  # type: ignore[arg-type]
            problems.append(f"{p(name)} must be at least 1s")
    if have("health_interval", "health_timeout") and float(out["health_timeout"]) >= float(  # type: ignore[arg-type]
        out["health_interval"]  # type: ignore[arg-type]
    ):
        problems.append(f"{p('health_timeout')} must be less than {p('health_interval')}")
    if have("liveness_interval", "liveness_threshold") and float(
        out["liveness_threshold"]  # type: ignore[arg-type]
    ) <= float(out["liveness_interval"]):  # type: ignore[arg-type]
        problems.append(f"{p('liveness_threshold')} must be greater than {p('liveness_interval')}")
    if have("drain_timeout") and float(out["drain_timeout"]) < 0:  # type: ignore[arg-type]
        problems.append(f"{p('drain_timeout')} must not be negative")

    # Modes and TLS.
    # A path of spaces is as unset as an empty one (a template's blank value, say).
    for name in ("health_check_ca_file", "health_check_cert_file", "health_check_key_file",
                 "health_check_token_file", "admin_socket"):
        if name in out and not str(out[name]).strip():
            out[name] = ""
    if have("health_check") and out["health_check"] == "readyz" and not out.get(
        "health_check_ca_file"
    ):
        problems.append("--health-check=readyz requires --health-check-ca-file")
    cert, key = out.get("health_check_cert_file"), out.get("health_check_key_file")
    if bool(cert) != bool(key):
        given, missing = (
            ("--health-check-cert-file", "--health-check-key-file")
            if cert
            else ("--health-check-key-file", "--health-check-cert-file")
        )
        problems.append(
            "--health-check-cert-file and --health-check-key-file must be set together "
            f"({given} is set, {missing} is not)"
        )
    if have("health_check_server_name") and not str(out["health_check_server_name"]).strip():
        problems.append("--health-check-server-name must not be empty")
    if have("max_connections") and int(out["max_connections"]) < 1:  # type: ignore[call-overload]
        problems.append(f"{p('max_connections')} must be at least 1")

    if problems:
        raise ConfigError(problems)
    out["endpoints"] = tuple(out["endpoints"])  # type: ignore[arg-type]
    return Config(**out)  # type: ignore[arg-type]


def _convert(flag: Flag, value: str) -> object:
    if flag.kind == "int":
        text = value.strip()
        if not text.lstrip("-").isdigit():
            raise ValueError(f"{value!r} is not a whole number")
        return int(text)
    if flag.kind == "duration":
        return parse_duration(value)
    if flag.kind == "bool":
        return parse_bool(value)
    if flag.kind == "choice":
        # Exact, as the spec lists them: "DEBUG" or " info" are typos worth reporting.
        text = value
        if text not in flag.choices:
            raise ValueError(f"must be one of {', '.join(flag.choices)}")
        return text
    if flag.kind == "endpoints":
        endpoints, problems = parse_endpoint_list(value)
        if problems:
            raise ValueError("; ".join(problems))
        return endpoints
    return value.strip() if flag.kind == "str" else value
