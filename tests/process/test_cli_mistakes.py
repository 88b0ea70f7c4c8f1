"""Every mistake an operator makes on the command line or in EP_ variables, as a table: what
they ran, the exact lines the program answers with, and the exit status (real subprocesses).

A mistake is named in one line: what was written, where (the flag, or the EP_ variable the
value came from) and what would be right; never a traceback, never argparse's usage dump.
Settings a configuration never reads are one warning line each at start (not an error).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from extractedprism.cli import SUBCOMMANDS
from tests.logcheck import parse_logfmt
from tests.process.proxyproc import start_proxy
from tests.util import run_cli, wait_until

HELP = "see 'extractedprism --help'"
REQUIRED = "--endpoints is required: give a comma-separated list of API server host:port pairs"
OK = ("--endpoints", "127.0.0.1:1", "--enable-discovery=false")
SUBS = ", ".join(SUBCOMMANDS)


@dataclass(frozen=True)
class Mistake:
    id: str
    args: tuple[str, ...]
    lines: tuple[str, ...]  # stderr, exactly
    env: dict[str, str] = field(default_factory=dict)
    status: int = 2


def invalid(*problems: str) -> tuple[str, ...]:
    return ("extractedprism: invalid configuration:", *(f"  {p}" for p in problems))


MISTAKES = (
    # --- names: flags, abbreviations, subcommands, stray words
    Mistake("abbreviated-flag", ("--endpoint", "10.0.0.1:6443"),
            (f"extractedprism: unknown flag --endpoint (did you mean --endpoints?); {HELP}",)),
    Mistake("abbreviation-with-value", ("--end=10.0.0.1:6443",),
            (f"extractedprism: unknown flag --end (did you mean --endpoints?); {HELP}",)),
    Mistake("ambiguous-start", ("--health", "3s", *OK),
            ("extractedprism: unknown flag --health (did you mean one of --health-port, "
             f"--health-check, --health-timeout, --health-recheck?); {HELP}",)),
    Mistake("typo-in-flag", ("--log-levle", "debug", *OK),
            (f"extractedprism: unknown flag --log-levle (did you mean --log-level?); {HELP}",)),
    Mistake("unknown-flag-far-from-any", ("--frobnicate", *OK),
            (f"extractedprism: unknown flag --frobnicate; {HELP}",)),
    Mistake("endpoints-as-separate-words", ("--endpoints", "10.0.0.1:6443", "10.0.0.2:6443"),
            ("extractedprism: unexpected argument '10.0.0.2:6443' (the proxy takes flags "
             f"only; several endpoints are one comma-separated value); {HELP}",)),
    Mistake("flag-without-its-value", ("--endpoints",),
            (f"extractedprism: argument --endpoints: expected one argument; {HELP}",)),
    Mistake("misspelled-subcommand", ("stauts",),
            ("extractedprism: unknown subcommand 'stauts' (did you mean status?); the "
             f"subcommands are {SUBS}, and the proxy itself takes only flags: {HELP}",)),
    Mistake("unknown-subcommand", ("serve", "--endpoints", "10.0.0.1:6443"),
            ("extractedprism: unknown subcommand 'serve'; the subcommands are "
             f"{SUBS}, and the proxy itself takes only flags: {HELP}",)),
    Mistake("static-pod-typo", ("static-pod", "--imge", "x", "--endpoints", "10.0.0.1:6443"),
            ("extractedprism static-pod: unknown flag --imge (did you mean --image?); see "
             "'extractedprism static-pod --help'",)),
    Mistake("status-unknown-flag", ("status", "--frob"),
            ("extractedprism status: unrecognized arguments: --frob; see "
             "'extractedprism status --help'",)),
    # --- values, named by the flag or by the variable they came from
    Mistake("missing-endpoints", ("--enable-discovery=false",), invalid(REQUIRED)),
    Mistake("misspelled-endpoints-variable", ("--enable-discovery=false",),
            invalid(f"{REQUIRED}; EP_ENDPIONTS is set: did you mean EP_ENDPOINTS?"),
            env={"EP_ENDPIONTS": "10.0.0.1:6443"}),
    Mistake("misspelled-variable-beside-another-problem", OK,
            invalid("EP_HEALTH_TIMEOUT (30s) must be less than --health-interval (20s)",
                    "EP_HELTH_INTERVAL is set, but no flag reads it: did you mean "
                    "EP_HEALTH_INTERVAL?"),
            env={"EP_HELTH_INTERVAL": "40s", "EP_HEALTH_TIMEOUT": "30s"}),
    Mistake("bad-value-in-variable", (), invalid("EP_DRAIN_TIMEOUT (-3s) must not be negative"),
            env={"EP_ENDPOINTS": "10.0.0.1:6443", "EP_DRAIN_TIMEOUT": "-3s"}),
    Mistake("bad-value-in-flag", ("--drain-timeout", "-3s", *OK),
            invalid("--drain-timeout (-3s) must not be negative")),
    Mistake("flag-wins-over-variable", ("--drain-timeout", "-1s", *OK),
            invalid("--drain-timeout (-1s) must not be negative"),
            env={"EP_DRAIN_TIMEOUT": "5s"}),
    Mistake("bad-port-in-variable", OK, invalid("EP_BIND_PORT (0) must be in the range 1-65535"),
            env={"EP_BIND_PORT": "0"}),
    Mistake("bad-boolean-in-variable", ("--endpoints", "10.0.0.1:6443"),
            invalid("EP_ENABLE_DISCOVERY (maybe) is invalid: 'maybe' is not a boolean (use "
                    "true/false, 1/0, yes/no)"),
            env={"EP_ENABLE_DISCOVERY": "maybe"}),
    Mistake("url-as-endpoint", ("--endpoints", "https://10.0.0.1:6443"),
            invalid("--endpoints (https://10.0.0.1:6443) is invalid: 'https://10.0.0.1:6443': "
                    "a URL scheme (https://) is not allowed: write host:port, e.g. "
                    "10.0.0.1:6443")),
    Mistake("endpoint-without-port-in-variable", (),
            invalid("EP_ENDPOINTS (10.0.0.1) is invalid: '10.0.0.1' is not host:port"),
            env={"EP_ENDPOINTS": "10.0.0.1"}),
    Mistake("choice-in-wrong-case", ("--log-level", "DEBUG", *OK),
            invalid("--log-level (DEBUG) is invalid: must be one of debug, info, warn, error, "
                    "dpanic, panic, fatal")),
    Mistake("rule-across-a-flag-and-a-variable", ("--health-interval", "10s", *OK),
            invalid("EP_HEALTH_TIMEOUT (15s) must be less than --health-interval (10s)"),
            env={"EP_HEALTH_TIMEOUT": "15s"}),
    # --- files only this machine can judge
    Mistake("missing-kubeconfig", ("--endpoints", "10.0.0.1:6443", "--kubeconfig",
                                   "/nonexistent/kubeconfig"),
            invalid("--kubeconfig (/nonexistent/kubeconfig) cannot be read: no such file or "
                    "directory (discovery reads it at start: give a readable kubeconfig, or "
                    "--enable-discovery=false for static endpoints only)")),
    Mistake("missing-kubeconfig-in-variable", ("--endpoints", "10.0.0.1:6443"),
            invalid("EP_KUBECONFIG (/nonexistent/kubeconfig) cannot be read: no such file or "
                    "directory (discovery reads it at start: give a readable kubeconfig, or "
                    "--enable-discovery=false for static endpoints only)"),
            env={"EP_KUBECONFIG": "/nonexistent/kubeconfig"}),
    Mistake("kubeconfig-is-a-directory", ("--endpoints", "10.0.0.1:6443", "--kubeconfig", "/"),
            invalid("--kubeconfig (/) cannot be read: is a directory (discovery reads it at "
                    "start: give a readable kubeconfig, or --enable-discovery=false for "
                    "static endpoints only)")),
)


@pytest.mark.parametrize("m", MISTAKES, ids=lambda m: m.id)
def test_each_mistake_is_named_in_its_lines_with_its_status(m: Mistake) -> None:
    res = run_cli(*m.args, env=m.env)
    assert (res.returncode, res.stderr.splitlines()) == (m.status, list(m.lines))
    assert res.stdout == ""


UNUSED = [
    ("rebalance-quiet-without-interval", ("--rebalance-quiet", "10s"), {},
     "--rebalance-quiet (10s) has no effect: rebalancing is off: set --rebalance-interval "
     "to turn it on"),
    ("ca-file-with-tcp-checks", (), {"EP_HEALTH_CHECK_CA_FILE": "/etc/ca.pem"},
     "EP_HEALTH_CHECK_CA_FILE (/etc/ca.pem) has no effect: only the readyz check uses it, "
     "and --health-check is tcp"),
    ("token-with-tcp-checks", ("--health-check-token-file", "/t"), {},
     "--health-check-token-file (/t) has no effect: only the readyz check uses it, and "
     "--health-check is tcp"),
    ("server-name-with-tcp-checks", ("--health-check-server-name", "api.example.com"), {},
     "--health-check-server-name (api.example.com) has no effect: only the readyz check uses "
     "it, and --health-check is tcp"),
    ("unready-drain-with-tcp-checks", ("--unready-drain-timeout", "3s"), {},
     "--unready-drain-timeout (3s) has no effect: only the readyz check finds an upstream "
     "unready, and --health-check is tcp"),
    ("state-file-without-discovery", ("--state-file", "/var/lib/ep/state.json"), {},
     "--state-file (/var/lib/ep/state.json) has no effect: discovery is off, and only "
     "discovery's lists are kept there"),
    ("kubeconfig-without-discovery", ("--kubeconfig", "/nonexistent"), {},
     "--kubeconfig (/nonexistent) has no effect: discovery is off"),
    ("fallback-without-discovery", ("--static-endpoints", "fallback"), {},
     "--static-endpoints (fallback) has no effect: discovery is off, so the static endpoints "
     "are the only ones"),
]


@pytest.mark.parametrize(("args", "env", "line"), [u[1:] for u in UNUSED],
                         ids=[u[0] for u in UNUSED])
def test_a_setting_that_does_nothing_is_one_warning(tmp_path, args, env, line) -> None:
    p = start_proxy(tmp_path, *OK, *args, env=env)
    try:
        wait_until(lambda: "upstream added" in p.stderr(), 10, message="started")
    finally:
        assert p.stop() == 0
    assert [r["msg"] for r in setting_warnings(p.stderr())] == [line]


def setting_warnings(stderr: str) -> list[dict[str, str]]:
    """The warnings about settings. OK's endpoint refuses: on a slow machine its checks
    may exclude it before the stop (`upstream healthy->unhealthy`, `panic: ...`), which
    says nothing of the settings."""
    return [r for r in parse_logfmt(stderr) if r["level"] == "warn"
            and r.get("upstream") is None and not r["msg"].startswith("panic")]


def test_defaults_spelled_out_are_not_warned_about(tmp_path) -> None:
    # What a chart or a unit file listing every default passes: nothing to warn about.
    p = start_proxy(tmp_path, *OK, "--rebalance-quiet", "5s", "--health-check-server-name",
                    "kubernetes.default.svc", "--static-endpoints", "always", "--state-file", "")
    try:
        wait_until(lambda: "upstream added" in p.stderr(), 10, message="started")
    finally:
        assert p.stop() == 0
    assert setting_warnings(p.stderr()) == []
