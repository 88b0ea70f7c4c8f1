"""Every flag, default, env var and validation rule of the spec's configuration table."""

from __future__ import annotations

import pytest

from extractedprism.config.endpoints import Endpoint, parse_endpoint
from extractedprism.config.flags import format_duration, parse_bool, parse_duration
from extractedprism.config.table import FLAGS, ConfigError, validate

OK = {"endpoints": "10.0.0.1:6443"}


def problems(**values: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        validate({**OK, **values})
    return err.value.problems


def test_defaults_match_the_spec():
    c = validate(dict(OK))
    assert (c.bind_address, c.bind_port, c.health_port) == ("127.0.0.1", 7445, 7446)
    assert c.health_bind_address == "127.0.0.1"
    assert (c.health_interval, c.health_timeout) == (20, 15)
    assert c.enable_discovery is True
    assert c.log_level == "info"
    assert (c.liveness_interval, c.liveness_threshold, c.drain_timeout) == (5, 15, 30)
    assert (c.upstream_selection, c.health_check) == ("random", "tcp")
    assert c.health_check_server_name == "kubernetes.default.svc"
    assert c.max_connections == 4096
    assert c.endpoints == (Endpoint("10.0.0.1", 6443),)


def test_every_flag_has_its_ep_env_var():
    assert {f.env for f in FLAGS} >= {
        "EP_BIND_ADDRESS", "EP_BIND_PORT", "EP_HEALTH_PORT", "EP_HEALTH_BIND_ADDRESS",
        "EP_ENDPOINTS", "EP_HEALTH_INTERVAL", "EP_HEALTH_TIMEOUT", "EP_ENABLE_DISCOVERY",
        "EP_LOG_LEVEL", "EP_LIVENESS_INTERVAL", "EP_LIVENESS_THRESHOLD", "EP_DRAIN_TIMEOUT",
        "EP_UPSTREAM_SELECTION", "EP_HEALTH_CHECK", "EP_HEALTH_CHECK_CA_FILE",
        "EP_HEALTH_CHECK_CERT_FILE", "EP_HEALTH_CHECK_KEY_FILE", "EP_HEALTH_CHECK_TOKEN_FILE",
        "EP_HEALTH_CHECK_SERVER_NAME", "EP_KUBECONFIG", "EP_MAX_CONNECTIONS"}


def test_health_bind_address_follows_bind_address():
    assert validate({**OK, "bind_address": "::1"}).health_bind_address == "::1"
    c = validate({**OK, "bind_address": "::1", "health_bind_address": "0.0.0.0"})
    assert c.health_bind_address == "0.0.0.0"


@pytest.mark.parametrize("text,seconds", [
    ("20s", 20), ("500ms", 0.5), ("1m30s", 90), ("1h", 3600), ("1.5s", 1.5), ("7", 7),
    ("0", 0), ("2.5", 2.5), ("-1s", -1), ("100us", 1e-4),
])
def test_durations(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "abc", "10x", "s", "1s2", "--1s"])
def test_bad_durations(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_format_duration_round_trips():
    for s in (20, 0.5, 90, 3600, 0, 1.5):
        assert parse_duration(format_duration(s)) == pytest.approx(s)


@pytest.mark.parametrize("text,value", [("true", True), ("FALSE", False), ("1", True),
                                        ("0", False), ("yes", True), ("no", False)])
def test_booleans(text, value):
    assert parse_bool(text) is value


# --endpoints values: tests/endpoint_cases.py, the one table the chart's test shares.
@pytest.mark.parametrize("field,value,needle", [
    ("bind_address", "not_a_host!", "--bind-address (not_a_host!) must be a valid IP"),
    ("health_bind_address", "-bad-", "--health-bind-address (-bad-) must be a valid IP"),
    ("bind_port", "0", "--bind-port (0) must be in the range 1-65535"),
    ("bind_port", "70000", "--bind-port (70000) must be in the range 1-65535"),
    ("health_port", "-1", "--health-port (-1) must be in the range 1-65535"),
    ("bind_port", "abc", "--bind-port (abc) is invalid"),
    ("health_port", "7445", "--bind-port (7445) and --health-port (7445) must differ"),
    ("health_interval", "500ms", "--health-interval (500ms) must be at least 1s"),
    ("health_timeout", "999ms", "--health-timeout (999ms) must be at least 1s"),
    ("health_timeout", "20s", "--health-timeout (20s) must be less than --health-interval (20s)"),
    ("log_level", "verbose", "--log-level (verbose) is invalid: must be one of debug"),
    ("log_level", "DEBUG", "--log-level (DEBUG) is invalid: must be one of debug"),
    ("log_level", " info", "--log-level ( info) is invalid"),
    ("upstream_selection", "Random", "--upstream-selection (Random) is invalid"),
    ("liveness_interval", "0s", "--liveness-interval (0s) must be at least 1s"),
    ("liveness_threshold", "900ms", "--liveness-threshold (900ms) must be at least 1s"),
    ("liveness_threshold", "5s",
     "--liveness-threshold (5s) must be greater than --liveness-interval (5s)"),
    ("drain_timeout", "-1s", "--drain-timeout (-1s) must not be negative"),
    ("upstream_selection", "roundrobin", "--upstream-selection (roundrobin) is invalid"),
    ("health_check", "http", "--health-check (http) is invalid: must be one of tcp, readyz"),
    ("health_check", "readyz", "--health-check=readyz requires --health-check-ca-file"),
    ("health_check_cert_file", "/c.pem", "must be set together"),
    ("health_check_key_file", "/k.pem", "must be set together"),
    ("health_check_server_name", "  ", "--health-check-server-name must not be empty"),
    ("enable_discovery", "maybe", "--enable-discovery (maybe) is invalid"),
    ("max_connections", "0", "--max-connections (0) must be at least 1"),
])
def test_each_rule_names_the_flag_and_value(field, value, needle):
    found = problems(**{field: value})
    assert any(needle in p for p in found), found


def test_all_problems_reported_at_once():
    found = problems(bind_port="0", health_timeout="30s", log_level="loud",
                     drain_timeout="-5s")
    assert len(found) == 4, found


def test_valid_edge_values():
    c = validate({**OK, "bind_port": "1", "health_port": "65535", "health_interval": "2s",
                  "health_timeout": "1s", "liveness_interval": "1s",
                  "liveness_threshold": "1001ms", "drain_timeout": "0",
                  "endpoints": "[fd00::1]:6443,cp-1.example.com:6443,10.0.0.1:6443",
                  "health_check": "readyz", "health_check_ca_file": "/ca.pem",
                  "upstream_selection": "latency"})
    assert c.drain_timeout == 0
    assert [str(e) for e in c.endpoints] == ["[fd00::1]:6443", "cp-1.example.com:6443",
                                             "10.0.0.1:6443"]


def test_endpoint_round_trip():
    for text in ("10.0.0.1:6443", "[::1]:7445", "api.example.com:443"):
        assert str(parse_endpoint(text)) == text
    # Any host may be bracketed (as Go's SplitHostPort allows); it prints canonically.
    assert str(parse_endpoint("[127.0.0.1]:6443")) == "127.0.0.1:6443"


def test_ipv6_endpoints_have_one_spelling():
    # RFC 5952 form, so a static entry and the same address from an EndpointSlice
    # (slices.py writes the compressed form) are one upstream.
    assert parse_endpoint("[FD00:0:0::1]:6443") == Endpoint("fd00::1", 6443)
    assert str(parse_endpoint("[0:0:0:0:0:0:0:1]:7445")) == "[::1]:7445"
    c = validate({**OK, "endpoints": "[fd00::1]:6443,[FD00:0::1]:6443"})
    assert [str(e) for e in c.endpoints] == ["[fd00::1]:6443"]


def test_blank_credential_paths_count_as_unset():
    assert "--health-check=readyz requires --health-check-ca-file" in problems(
        health_check="readyz", health_check_ca_file="   ")
    assert any("must be set together" in p for p in problems(
        health_check_cert_file=" ", health_check_key_file="/k.pem"))
    c = validate({**OK, "health_check_token_file": "  ", "health_check_cert_file": " ",
                  "health_check_key_file": "\t"})
    assert (c.health_check_token_file, c.health_check_cert_file,
            c.health_check_key_file) == ("", "", "")


# --- issue 12, item 2 -------------------------------------------------------------


@pytest.mark.parametrize("field", ["health_interval", "health_timeout", "liveness_interval",
                                   "liveness_threshold", "drain_timeout"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "infinity", "1e400"])
def test_non_finite_durations_are_rejected_naming_flag_and_value(field, value):
    option = "--" + field.replace("_", "-")
    found = problems(**{field: value})
    assert any(p.startswith(f"{option} ({value}) is invalid") and "finite" in p
               for p in found), found


def test_durations_too_long_to_wait_for_are_rejected():
    # Event.wait() raises OverflowError past threading.TIMEOUT_MAX: an exit-2 message,
    # not a traceback in the heartbeat thread.
    found = problems(liveness_interval="1e300", liveness_threshold="2e300")
    assert any(p.startswith("--liveness-interval (1e300) is invalid") for p in found), found


def test_blank_health_bind_address_means_same_as_bind_address():
    assert validate({**OK, "health_bind_address": ""}).health_bind_address == "127.0.0.1"
    c = validate({**OK, "bind_address": "::1", "health_bind_address": ""})
    assert c.health_bind_address == "::1"


@pytest.mark.parametrize("host", ["10.0.0.256", "1.2.3", "167772161", "300.1.1.1", "1.2.3.4."])
def test_numeric_looking_hosts_are_invalid_addresses(host):
    assert any("is not an IP address or RFC 1123 hostname" in p
               for p in problems(endpoints=f"{host}:6443"))
    assert problems(bind_address=host) == [
        f"--bind-address ({host}) must be a valid IP address or RFC 1123 hostname"]


def test_hostnames_with_digits_are_still_hostnames():
    c = validate({**OK, "endpoints": "cp1.example.com:6443,10-0-0-1.nip.io:6443,k8s.1a:6443"})
    assert len(c.endpoints) == 3


def test_bad_bind_address_is_reported_once():
    assert problems(bind_address="not_a_host!") == [
        "--bind-address (not_a_host!) must be a valid IP address or RFC 1123 hostname"]


def test_every_flag_has_a_converter_and_every_rule_names_real_flags():
    from extractedprism.config.flags import KINDS
    from extractedprism.config.table import RULES
    dests = {f.dest for f in FLAGS}
    assert all(f.kind in KINDS for f in FLAGS)
    for rule in RULES:
        assert set(rule.fields) <= dests, rule


def test_a_new_flag_row_is_validated_by_its_own_checks():
    # The table is the validation: a row with a check is checked without other code.
    import dataclasses

    from extractedprism.config import table as cfg
    from extractedprism.config.flags import PORT, Flag
    row = Flag("extra-port", "int", "1", "test", checks=(PORT,))
    fields = [(f.name, f.type, f) for f in dataclasses.fields(cfg.Config)]
    extended = dataclasses.make_dataclass(
        "C2", [(n, t, dataclasses.field(default=f.default)) if f.default is not
               dataclasses.MISSING else (n, t) for n, t, f in fields] + [("extra_port", int, 1)],
        frozen=True)
    orig_flags, orig_config = cfg.FLAGS, cfg.Config
    try:
        cfg.FLAGS = (*orig_flags, row)
        cfg.FLAG_BY_NAME[row.name] = row
        cfg.Config = extended  # type: ignore[misc]
        with pytest.raises(ConfigError) as err:
            cfg.validate({**OK, "extra_port": "0"})
        assert err.value.problems == ["--extra-port (0) must be in the range 1-65535"]
    finally:
        cfg.FLAGS, cfg.Config = orig_flags, orig_config
        del cfg.FLAG_BY_NAME[row.name]


def test_config_is_the_flag_table_one_field_per_row_with_its_default():
    # Defaults are written once, in FLAGS: Config's fields and defaults come from it.
    import dataclasses

    from extractedprism.config.flags import KINDS
    from extractedprism.config.table import FLAG_BY_NAME, Config

    fields = {f.name: f for f in dataclasses.fields(Config)}
    assert list(fields) == [f.dest for f in FLAGS if f.required] + [
        f.dest for f in FLAGS if not f.required]
    for flag in FLAGS:
        field = fields[flag.dest]
        if flag.required:
            assert field.default is dataclasses.MISSING
            continue
        source = FLAG_BY_NAME[flag.same_as] if flag.same_as else flag
        assert field.default == KINDS[source.kind](source, source.default), flag.name
    # validate() with only the required flag gives exactly Config's defaults.
    assert validate(dict(OK)) == Config(endpoints=validate(dict(OK)).endpoints)
    assert Config(endpoints=()).replace(bind_port=1).bind_port == 1


def test_answer_hedge_delay_is_bounded():
    """Issue 29, item 10: a delay past a minute never fires for a client-go client (its
    TLS handshake gives up after 10 s), and ~596 h overflowed the native relay's int."""
    assert validate({**OK, "answer_hedge_delay": "60s"}).answer_hedge_delay == 60
    assert validate({**OK, "answer_hedge_delay": "0"}).answer_hedge_delay == 0
    for bad in ("61s", "700h"):
        assert problems(answer_hedge_delay=bad) == [
            f"--answer-hedge-delay ({bad}) must be between 0 (off) and 60s"]


# --- issue 37, finding 10: a path with a NUL byte -------------------------------------

PATH_FLAGS = [f for f in FLAGS if f.kind == "path"]


@pytest.mark.parametrize("flag", PATH_FLAGS, ids=[f.name for f in PATH_FLAGS])
def test_a_path_with_a_nul_byte_is_one_problem_naming_the_flag(flag):
    # Kubeconfig, CA, certificate, key and token files, the state file, the unix sockets:
    # no file is named so, and os.stat() would raise ValueError, naming nothing.
    found = problems(**{flag.dest: "/etc/kube\0config"})
    assert found == [f"{flag.option} (/etc/kube\\x00config) is invalid: the path contains "
                     "a NUL byte"], found


def test_a_nul_in_an_ep_variable_is_named_by_the_variable():
    # The environment of a real process cannot carry a NUL (execve's strings end at it);
    # a configuration parsed in-process can, and gets the same one line, not a traceback.
    from extractedprism.config.parser import parse

    with pytest.raises(ConfigError) as err:
        parse(["--endpoints", "10.0.0.1:6443"],
              environ={"EP_KUBECONFIG": "/etc/k\0c", "EP_STATE_FILE": "/var/s\0f"})
    assert err.value.problems == [
        "EP_KUBECONFIG (/etc/k\\x00c) is invalid: the path contains a NUL byte",
        "EP_STATE_FILE (/var/s\\x00f) is invalid: the path contains a NUL byte"]


# --- issue 37, finding 13: --answer-hedge-delay against --health-timeout ----------------


def _warnings(*argv: str) -> list[str]:
    from extractedprism.config.parser import parse

    return parse(["--endpoints", "10.0.0.1:6443", *argv], environ={}).warnings


def test_a_hedge_delay_not_below_the_health_timeout_is_warned_about():
    # datapath/first_answer.py gives an attempt up once it was silent for --health-timeout
    # while another runs: at or past it, the hedge replaces the first attempt instead of
    # racing it. The default delay (1s) with a 1 s timeout is such a case.
    for hedge, argv in (("1s", ["--health-timeout", "1s"]),
                        ("2s", ["--health-timeout", "1s", "--answer-hedge-delay", "2s"])):
        found = [w for w in _warnings(*argv) if "--answer-hedge-delay" in w]
        assert len(found) == 1, (argv, found)
        assert found[0].startswith(f"--answer-hedge-delay ({hedge}) is not below "
                                   "--health-timeout (1s): the first attempt is given up"), found


def test_a_hedge_delay_below_the_timeout_or_off_is_not_warned_about():
    for argv in ([], ["--health-timeout", "1s", "--answer-hedge-delay", "500ms"],
                 ["--health-timeout", "1s", "--answer-hedge-delay", "0"]):
        assert not [w for w in _warnings(*argv) if "--answer-hedge-delay" in w], argv


def test_the_warning_names_the_ep_variables_that_set_them():
    from extractedprism.config.parser import parse

    warnings = parse(["--endpoints", "10.0.0.1:6443"],
                     environ={"EP_HEALTH_TIMEOUT": "2s",
                              "EP_ANSWER_HEDGE_DELAY": "2s"}).warnings
    assert any(w.startswith("EP_ANSWER_HEDGE_DELAY (2s) is not below EP_HEALTH_TIMEOUT "
                            "(2s)") for w in warnings), warnings
