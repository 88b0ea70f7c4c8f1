"""The flag table, its cross-field rules, and the validated ``Config`` derived from it.

Every flag is one :class:`~extractedprism.config.flags.Flag` row: name (and from it the
option and the EP_ env var), kind (which converter turns the string into a value),
default, help, and the checks that value must pass. Rules that tie two or more flags
together are rows of :data:`RULES`. :func:`validate` only walks the two tables, so a flag
added as a row is converted, checked, shown in ``--help`` and bound to its env var by
construction, and nothing can skip validation. Every problem is reported at once, each
naming the flag and the offending value.

:class:`Config` is built from :data:`FLAGS` (one field per row, its default the row's
default converted by the row's kind), so a default is written once.

Adding a flag: one ``Flag(...)`` row in :data:`FLAGS` (with its ``checks``) and, if it
depends on another flag, a ``Rule(...)`` row in :data:`RULES`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from extractedprism.config.endpoints import Endpoint
from extractedprism.config.flags import (
    AT_LEAST_1,
    AT_LEAST_1S,
    HOST,
    KINDS,
    NOT_EMPTY,
    NOT_NEGATIVE,
    PORT,
    Check,
    Flag,
    Rule,
    show_value,
)
from extractedprism.errors import Error

# The choices of the flags that take one; the modules that act on a value import the
# tuple from here, so a choice is spelled in one place.
LOG_LEVELS = ("debug", "info", "warn", "error", "dpanic", "panic", "fatal")
LOG_FORMATS = ("logfmt", "json")
HEALTH_CHECKS = ("tcp", "readyz")
SELECTION_MODES = ("random", "latency", "least-conn")
PIPE_SCHED_POLICIES = ("batch", "normal")
RELAYS = ("auto", "native", "python")
STATIC_ENDPOINT_MODES = ("always", "fallback")


def allowed_cpus() -> set[int] | None:
    """The CPUs this process may run on (None where the platform cannot tell)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def gil_cpu_valid(value: str) -> bool:
    """--gil-cpu: auto, off, or a CPU this process may run on."""
    if value in ("auto", "off"):
        return True
    if not value.isdigit():
        return False
    allowed = allowed_cpus()
    return allowed is None or int(value) in allowed


# 0 (off) or at most a minute: a client-go client gives up on its TLS handshake after 10 s,
# so a longer delay would never fire; the bound also keeps it within the native relay's
# millisecond timeout (a C int: about 596 hours).
ANSWER_HEDGE_DELAY_MAX = 60.0
ANSWER_HEDGE_DELAY = Check(lambda v: 0 <= v <= ANSWER_HEDGE_DELAY_MAX,
                           "must be between 0 (off) and 60s")

# 0 (off) or long enough that one close per interval stays gentle.
REBALANCE_INTERVAL = Check(lambda v: v == 0 or v >= 0.1, "must be 0 (off) or at least 100ms")
# 0 (off) or long enough that the sampling (a quarter of it) stays cheap and an ordinary
# answer's round trip is never taken for a stall.
STALL_TIMEOUT = Check(lambda v: v == 0 or v >= 0.5, "must be 0 (off) or at least 500ms")


class ConfigError(Error, ValueError):
    """Invalid configuration; ``problems`` lists every message."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = list(problems)


# --- the flag table ----------------------------------------------------------

# The sections of --help, in order: key -> (title, what the flags in it are for). A row of
# FLAGS names its section in ``group``; tests/unit/test_help.py fails for a row without one.
GROUPS: dict[str, tuple[str, str]] = {
    "listener": ("listener", "Where the proxy and its health server listen, and how many "
                 "connections the proxy takes."),
    "upstreams": ("upstreams and discovery", "Which API servers to forward to, and how the "
                  "list is kept current (static endpoints, EndpointSlices, a state file)."),
    "health": ("health checks", "How each upstream is probed, and when it counts as healthy "
               "(tcp) or ready (readyz)."),
    "selection": ("selection and balance", "How a new connection picks its upstream, and "
                  "how load is evened out over time."),
    "datapath": ("data path", "How connections to upstreams are dialled and their bytes "
                 "copied."),
    "lifecycle": ("lifecycle", "Draining, liveness, shutdown and upgrades without a gap."),
    "operator": ("operator", "Logs and runtime control."),
}

# The flags of the spec's configuration table, in its order: listed first in their section.
SPEC_FLAGS = (
    "bind-address", "bind-port", "health-port", "health-bind-address", "endpoints",
    "health-interval", "health-timeout", "enable-discovery", "log-level", "liveness-interval",
    "liveness-threshold", "drain-timeout", "upstream-selection", "health-check",
    "health-check-ca-file", "health-check-cert-file", "health-check-key-file",
    "health-check-token-file", "health-check-server-name",
)


FLAGS: tuple[Flag, ...] = (
    Flag("bind-address", "str", "127.0.0.1", "Address for the TCP load balancer listener",
         checks=(HOST,), group="listener"),
    Flag("bind-port", "int", "7445", "Port for the TCP load balancer listener",
         checks=(PORT,), group="listener"),
    Flag("health-port", "int", "7446", "Port for the health check HTTP server",
         checks=(PORT,), group="listener"),
    Flag(
        "health-bind-address",
        "str",
        None,
        "Address for the health check HTTP server (default: same as --bind-address)",
        checks=(HOST,),
        same_as="bind-address",
        group="listener",
    ),
    Flag("endpoints", "endpoints", None, "Comma-separated API server endpoints (host:port)",
         checks=(NOT_EMPTY,),
         required="--endpoints is required: give a comma-separated list of API server "
         "host:port pairs", group="upstreams"),
    Flag("health-interval", "duration", "20s", "Interval between upstream health checks",
         checks=(AT_LEAST_1S,), group="health"),
    Flag("health-timeout", "duration", "15s", "Timeout for each upstream health check",
         checks=(AT_LEAST_1S,), group="health"),
    Flag(
        "health-recheck",
        "duration",
        None,
        "Delay of the check that confirms a first failure: after one failed check (or "
        "failed client dial) of a healthy (or, with readyz, ready) upstream, the next check "
        "runs this long after the failed one started instead of a whole --health-interval; "
        "two failures in a row still exclude (default: same as --health-interval)",
        checks=(AT_LEAST_1S,),
        same_as="health-interval",
        group="health",
    ),
    Flag("enable-discovery", "bool", "true", "Enable Kubernetes EndpointSlice discovery",
         group="upstreams"),
    Flag("log-level", "choice", "info", "Log level", LOG_LEVELS, group="operator"),
    Flag("liveness-interval", "duration", "5s", "Heartbeat probe interval for liveness detection",
         checks=(AT_LEAST_1S,), group="lifecycle"),
    Flag(
        "liveness-threshold",
        "duration",
        "15s",
        "Maximum time since last heartbeat before liveness fails",
        checks=(AT_LEAST_1S,),
        group="lifecycle",
    ),
    Flag(
        "drain-timeout",
        "duration",
        "30s",
        "Grace period for connections to removed endpoints, and with readyz to unready ones "
        "while another upstream is ready, before force close (0 closes immediately)",
        checks=(NOT_NEGATIVE,),
        group="lifecycle",
    ),
    Flag(
        "unready-drain-timeout",
        "duration",
        None,
        "With readyz, grace period for the connections of an unready (or unhealthy) "
        "upstream while another upstream is ready, before they are closed (0 closes "
        "immediately); removed endpoints keep --drain-timeout (default: same as "
        "--drain-timeout)",
        checks=(NOT_NEGATIVE,),
        same_as="drain-timeout",
        group="lifecycle",
    ),
    Flag(
        "upstream-selection",
        "choice",
        "random",
        "How new connections pick an upstream: random (uniform among pickable upstreams), "
        "latency (prefer the lowest-latency tier) or least-conn (fewest active connections)",
        SELECTION_MODES,
        group="selection",
    ),
    Flag(
        "rebalance-interval",
        "duration",
        "0s",
        "Every interval (with 10% jitter), when the most loaded pickable upstream holds more "
        "than 1.25 times its fair share of the live connections and at least 2 more than the "
        "least loaded, close one of its quiet connections with a FIN both ways (the client "
        "reconnects and is picked again); never while an upstream drains or closes for "
        "readiness, nor in panic mode (0: off)",
        checks=(REBALANCE_INTERVAL,),
        group="selection",
    ),
    Flag(
        "rebalance-quiet",
        "duration",
        "5s",
        "A connection rebalancing may close has moved no byte either way for at least this "
        "long (the longest quiet first), and is at least one --rebalance-interval old",
        checks=(NOT_NEGATIVE,),
        group="selection",
    ),
    Flag(
        "slow-start",
        "duration",
        "0s",
        "An upstream that becomes pickable again (healthy, ready or undrained again, or added "
        "to the list) takes a weight growing linearly from 0.1 to 1 over this window: random "
        "picks by weight, least-conn compares connections / weight, latency weighs inside "
        "the tier, rebalancing shares by weight (0: off)",
        checks=(NOT_NEGATIVE,),
        group="selection",
    ),
    Flag(
        "stall-timeout",
        "duration",
        "0s",
        "A connection stalls when its client has sent bytes and its upstream has sent "
        "nothing back for this long (sampled from the relay's byte counters); a stall runs "
        "its upstream's next health check now (at most once per upstream per stall "
        "timeout; a stall still unanswered two stall timeouts later gets one second look), "
        "and that check counts like any other; while it is stalled, new connections go to "
        "other upstreams: a stall alone never closes a "
        "connection or marks an upstream down; when a check of an upstream fails while "
        "another serves, its connections stalled then are closed at once and picks avoid "
        "it until its next check; at the exclusion the others keep "
        "--unready-drain-timeout (0: off)",
        checks=(STALL_TIMEOUT,),
        group="health",
    ),
    Flag(
        "overload-guard",
        "bool",
        "false",
        "A slow answer (connected, but the readyz probe or a client's first answer ran out "
        "of --health-timeout) counts as a failure only while another upstream in service "
        "answers in time (its latest check passed, no stalled connection); when every "
        "one serving is slow (an overloaded control plane, or the last one left) it is "
        "not counted, so overload does not take servers out of service in turn and "
        "close their connections, for at most three check periods after the upstream's "
        "last passed check (one that answers none is excluded whatever its peers do); "
        "refusals, resets, TLS errors and non-200 answers always count",
        group="health",
    ),
    Flag(
        "health-check",
        "choice",
        "tcp",
        "Upstream health check: tcp (connect only) or readyz (connect, then prefer upstreams "
        "answering 200 on GET /readyz)",
        HEALTH_CHECKS,
        group="health",
    ),
    Flag(
        "health-check-ca-file",
        "path",
        "",
        "CA bundle that verifies the upstream serving certificates; required with readyz",
        group="health",
    ),
    Flag("health-check-cert-file", "path", "", "Client certificate for the readyz probe",
         group="health"),
    Flag(
        "health-check-key-file",
        "path",
        "",
        "Client key for the readyz probe; may be the same file as the certificate",
        group="health",
    ),
    Flag("health-check-token-file", "path", "", "Bearer token for the readyz probe",
         group="health"),
    Flag(
        "health-check-server-name",
        "str",
        "kubernetes.default.svc",
        "Name the upstream serving certificates are verified against",
        checks=(NOT_EMPTY,),
        group="health",
    ),
    Flag(
        "kubeconfig",
        "path",
        "",
        "Kubeconfig for EndpointSlice discovery outside a cluster (default: in-cluster config)",
        group="upstreams",
    ),
    Flag(
        "max-connections",
        "int",
        "4096",
        "Maximum concurrent proxied connections; at the limit new clients wait in the backlog",
        checks=(AT_LEAST_1,),
        group="listener",
    ),
    Flag(
        "pipe-sched",
        "choice",
        "batch",
        "Linux scheduling policy of the acceptor and pipe threads: batch (SCHED_BATCH, nice "
        "unchanged: a woken pipe thread does not preempt the one holding the GIL, which "
        "saves most context switches) or normal (SCHED_OTHER)",
        PIPE_SCHED_POLICIES,
        group="datapath",
    ),
    Flag(
        "gil-cpu",
        "str",
        "auto",
        "CPU for the threads that run Python (acceptor and pipe threads), so the GIL never "
        "crosses CPUs on a hand-off; a connection that keeps moving bytes is let out to every "
        "CPU after a few relay wake-ups. auto: the highest CPU this process may use, when it "
        "may use two or more; off: no pinning; or a CPU number",
        checks=(Check(gil_cpu_valid, "must be auto, off, or a CPU this process may run on"),),
        group="datapath",
    ),
    Flag(
        "relay",
        "choice",
        "auto",
        "How connections copy bytes: native (the C extension: one blocking splice loop per "
        "connection with the GIL released), python (the pure-Python poll loop) or auto "
        "(native when the extension loads, else python); native exits 2 when it cannot load",
        RELAYS,
        group="datapath",
    ),
    Flag(
        "dial-hedge-delay",
        "duration",
        "250ms",
        "When a dial to an upstream has not connected within this delay, dial a second "
        "pickable upstream too and keep the first to connect (the slower dial still runs to "
        "its end and counts); the stalled upstream takes no new connection while another "
        "can until something succeeds there, and with nothing else left the second dial "
        "may go to a static fallback; 0 turns hedging off",
        checks=(NOT_NEGATIVE,),
        group="datapath",
    ),
    Flag(
        "answer-hedge-delay",
        "duration",
        "1s",
        "A new connection whose upstream has not answered the client's TLS ClientHello "
        "within this delay sends the same ClientHello to one other pickable upstream too, "
        "and the first to answer carries the connection (the other is closed once it "
        "answers, or counts as a failed dial if it never does within --health-timeout); "
        "only a complete ClientHello is ever sent twice; 0 turns this off; at most 60s",
        checks=(ANSWER_HEDGE_DELAY,),
        group="datapath",
    ),
    Flag(
        "handover-socket",
        "path",
        "",
        "Unix socket for upgrades without a gap: a running instance offers its listening "
        "sockets there, and an instance that starts while one runs takes them over "
        "(empty: off)",
        group="lifecycle",
    ),
    Flag(
        "shutdown-drain-timeout",
        "duration",
        "0s",
        "On SIGTERM, stop accepting but keep existing connections, closing them spread "
        "evenly over this window before the shutdown (0: close them at once)",
        checks=(NOT_NEGATIVE,),
        group="lifecycle",
    ),
    Flag(
        "state-file",
        "path",
        "",
        "File that keeps the endpoints discovery last found, read at start as the 'cache' "
        "provider until discovery produces its first list (empty: off)",
        group="upstreams",
    ),
    Flag(
        "static-endpoints",
        "choice",
        "always",
        "always: --endpoints are always upstreams; fallback: once discovery has produced a "
        "list, static endpoints it lacks are kept only as a last resort (panic mode, and "
        "the hedge of a stalled dial when every discovered one stalls)",
        STATIC_ENDPOINT_MODES,
        group="upstreams",
    ),
    Flag(
        "log-format",
        "choice",
        "logfmt",
        "Log line format on stderr: logfmt (key=value, one record per line) or json (one "
        "object per line)",
        LOG_FORMATS,
        group="operator",
    ),
    Flag(
        "admin-socket",
        "path",
        "",
        "Unix socket for runtime control (`extractedprism admin`: drain, undrain, close, "
        "list, rebalance), created with mode 0600 so only this user and root can use it; "
        "never a TCP port (empty: off)",
        group="operator",
    ),
)

FLAG_BY_NAME = {f.name: f for f in FLAGS}


# --- cross-field rules -----------------------------------------------------------


def _ports_differ(v: Mapping[str, Any], show: Callable[[str], str]) -> str | None:
    if v["bind_port"] != v["health_port"]:
        return None
    return f"{show('bind_port')} and {show('health_port')} must differ"


def _timeout_below_interval(v: Mapping[str, Any], show: Callable[[str], str]) -> str | None:
    if v["health_timeout"] < v["health_interval"]:
        return None
    return f"{show('health_timeout')} must be less than {show('health_interval')}"


def _recheck_within_interval(v: Mapping[str, Any], show: Callable[[str], str]) -> str | None:
    if v["health_recheck"] <= v["health_interval"]:
        return None
    return f"{show('health_recheck')} must not be more than {show('health_interval')}"


def _threshold_above_interval(v: Mapping[str, Any], show: Callable[[str], str]) -> str | None:
    if v["liveness_threshold"] > v["liveness_interval"]:
        return None
    return f"{show('liveness_threshold')} must be greater than {show('liveness_interval')}"


READYZ_NEEDS_CA = "--health-check=readyz requires --health-check-ca-file"


def _readyz_needs_ca(v: Mapping[str, Any], show: Callable[[str], str]) -> str | None:
    if v["health_check"] != "readyz" or v["health_check_ca_file"]:
        return None
    return READYZ_NEEDS_CA


def _cert_and_key(v: Mapping[str, Any], show: Callable[[str], str]) -> str | None:
    cert, key = v["health_check_cert_file"], v["health_check_key_file"]
    if bool(cert) == bool(key):
        return None
    given, missing = ("--health-check-cert-file", "--health-check-key-file")
    if not cert:
        given, missing = missing, given
    return ("--health-check-cert-file and --health-check-key-file must be set together "
            f"({given} is set, {missing} is not)")


RULES: tuple[Rule, ...] = (
    Rule(("bind_port", "health_port"), "--bind-port and --health-port must differ",
         _ports_differ),
    Rule(("health_timeout", "health_interval"),
         "--health-timeout must be less than --health-interval", _timeout_below_interval),
    Rule(("health_recheck", "health_interval"),
         "--health-recheck must not be more than --health-interval", _recheck_within_interval),
    Rule(("liveness_threshold", "liveness_interval"),
         "--liveness-threshold must be greater than --liveness-interval",
         _threshold_above_interval),
    Rule(("health_check", "health_check_ca_file"), "readyz requires --health-check-ca-file",
         _readyz_needs_ca),
    Rule(("health_check_cert_file", "health_check_key_file"),
         "--health-check-cert-file and --health-check-key-file must be set together",
         _cert_and_key),
)


# --- the validated configuration ---------------------------------------------


# A kind's Python type, for the Config field of a flag of that kind.
_FIELD_TYPES: dict[str, Any] = {
    "str": str, "int": int, "duration": float, "bool": bool, "choice": str,
    "endpoints": tuple[Endpoint, ...], "path": str,
}


def _field_default(flag: Flag) -> object:
    """A row's default as its kind converts it (a ``same_as`` row: its source's)."""
    source = FLAG_BY_NAME[flag.same_as] if flag.same_as else flag
    assert source.default is not None, f"flag {source.name}: no default"
    return KINDS[source.kind](source, source.default)


class _ConfigMethods:
    __slots__ = ()

    def replace(self, **changes: object) -> Config:
        """A copy with some fields changed (tests and tools; no re-validation)."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


def _make_config() -> type:
    required = [(f.dest, _FIELD_TYPES[f.kind]) for f in FLAGS if f.required]
    optional = [(f.dest, _FIELD_TYPES[f.kind], dataclasses.field(default=_field_default(f)))
                for f in FLAGS if not f.required]
    return dataclasses.make_dataclass(
        "Config", [*required, *optional], bases=(_ConfigMethods,), frozen=True,
        namespace={"__doc__": "Validated, immutable configuration: one field per flag (by "
                   "its dest), durations in float seconds.",
                   "__module__": __name__})


Config: Any = _make_config()


def validate(values: Mapping[str, str | None],
             names: Mapping[str, str] | None = None) -> Config:
    """Convert and check raw flag strings (keyed by dest); raise ConfigError with all problems.

    A flag whose value does not convert yields one message and is left out of every
    rule, so one bad value never cascades into several messages. ``names`` (dest -> name)
    says where a value came from when it was not the flag (``EP_DRAIN_TIMEOUT``): messages
    then name what the user wrote.
    """
    names = names or {}
    problems: list[str] = []
    out: dict[str, object] = {}
    raw: dict[str, str] = {}
    derived: list[Flag] = []

    for flag in FLAGS:
        value = values.get(flag.dest)
        if value is None or (not value.strip() and (flag.same_as or flag.required)):
            if flag.same_as:
                derived.append(flag)
                continue
            if flag.required:
                problems.append(flag.required)
                continue
            value = flag.default
        if value is None:
            continue
        raw[flag.dest] = value
        try:
            converted = KINDS[flag.kind](flag, value)
        except ValueError as exc:
            problems.append(f"{show_value(flag, value, names.get(flag.dest, ''))} is "
                            f"invalid: {exc}")
            continue
        out[flag.dest] = converted
        problems.extend(f"{show_value(flag, value, names.get(flag.dest, ''))} {c.text}"
                        for c in flag.checks if not c.ok(converted))

    for flag in derived:
        source = FLAG_BY_NAME[flag.same_as].dest
        if source in out:  # a bad source was reported once, under its own name
            out[flag.dest], raw[flag.dest] = out[source], raw[source]

    def show(dest: str) -> str:
        return show_value(FLAG_BY_NAME[dest.replace("_", "-")], raw[dest], names.get(dest, ""))

    for rule in RULES:
        if all(f in out for f in rule.fields):
            problem = rule.message(out, show)
            if problem:
                problems.append(problem)

    if problems:
        raise ConfigError(problems)
    return Config(**out)


# --- settings that do nothing in a configuration ------------------------------------

# (dest, when it has no effect, why): a value given for it then earns one warning at start,
# so a flag that is silently ignored never looks like it was applied.
_READYZ_ONLY = "only the readyz check uses it, and --health-check is tcp"
UNUSED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("rebalance_quiet", lambda c: c.rebalance_interval == 0,
     "rebalancing is off: set --rebalance-interval to turn it on"),
    *((dest, lambda c: c.health_check == "tcp", _READYZ_ONLY)
      for dest in ("health_check_ca_file", "health_check_cert_file", "health_check_key_file",
                   "health_check_token_file", "health_check_server_name")),
    ("unready_drain_timeout", lambda c: c.health_check == "tcp",
     "only the readyz check finds an upstream unready, and --health-check is tcp"),
    ("state_file", lambda c: not c.enable_discovery,
     "discovery is off, and only discovery's lists are kept there"),
    ("kubeconfig", lambda c: not c.enable_discovery, "discovery is off"),
    ("static_endpoints", lambda c: not c.enable_discovery,
     "discovery is off, so the static endpoints are the only ones"),
)


def unused_settings(values: Mapping[str, str | None], config: Any,
                    names: Mapping[str, str] | None = None) -> list[str]:
    """One line per setting given (non-blank, not its default: a chart or unit file that
    spells out every default is not warned about) that this configuration never reads."""
    names = names or {}
    out = []
    for dest, unused, why in UNUSED:
        raw = values.get(dest)
        flag = FLAG_BY_NAME[dest.replace("_", "-")]
        if raw is None or not raw.strip() or raw == flag.default or not unused(config):
            continue
        out.append(f"{show_value(flag, raw, names.get(dest, ''))} has no effect: {why}")
    return out


# --- combinations that run but do not do what their flags say ----------------------


def _hedge_below_timeout(v: Mapping[str, Any], show: Callable[[str], str]) -> str | None:
    # datapath/first_answer.py: an attempt silent for --health-timeout since it got the
    # ClientHello is dropped and charged as silent as soon as another attempt runs; the
    # hedge's dial starts --answer-hedge-delay after the ClientHello. Not below the
    # timeout, the first attempt is given up the moment the hedge fires: the two never
    # race (a first upstream answering just after the delay cannot carry the client), and
    # when the hedge's dial then fails the client is left with no upstream at all.
    hedge, timeout = v["answer_hedge_delay"], v["health_timeout"]
    if hedge > 0 and hedge >= timeout:
        return (f"{show('answer_hedge_delay')} is not below {show('health_timeout')}: the "
                "first attempt is given up, and charged as silent, the moment the hedge "
                "fires, so the two never race; set it below --health-timeout (the "
                "production profile: half of it), or 0 for no hedge")
    return None


# Each one warning at start (the value stands: it is not invalid, only not what its flags
# promise).
CAUTIONS: tuple[Rule, ...] = (
    Rule(("answer_hedge_delay", "health_timeout"),
         "--answer-hedge-delay, when not 0, is below --health-timeout", _hedge_below_timeout),
)


def cautions(values: Mapping[str, str | None], config: Any,
             names: Mapping[str, str] | None = None) -> list[str]:
    """One line per :data:`CAUTIONS` rule the configuration breaks."""
    names = names or {}

    def show(dest: str) -> str:
        flag = FLAG_BY_NAME[dest.replace("_", "-")]
        raw = values.get(dest)
        raw = raw if raw is not None and raw.strip() else (flag.default or "")
        return show_value(flag, raw, names.get(dest, ""))

    converted = {f: getattr(config, f) for rule in CAUTIONS for f in rule.fields}
    return [problem for rule in CAUTIONS
            if (problem := rule.message(converted, show)) is not None]
