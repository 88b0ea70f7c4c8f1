"""The chart never renders what the program rejects, and says why in the program's words.

Each case renders the chart twice: once as shipped, and once with its render-time checks
(templates/_validate.tpl) replaced by nothing. The second render's EP_ variables go to the
program's own validate(); the first render must then fail with exactly the problems
validate() reports, and succeed exactly when validate() accepts. So the chart's messages
cannot drift from the program's, whatever config.py says next.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extractedprism.config.table import ConfigError, validate
from tests.deploy.helpers import (
    CHART_DIR,
    ENDPOINTS,
    NAMESPACE,
    RELEASE,
    container,
    env_of,
    flag_values,
    helm,
)

h = helm()
PREFIX = "extractedprism: invalid configuration: "
SA_CA = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"


@pytest.fixture(scope="module")
def unchecked_chart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the chart whose render-time checks are a no-op."""
    root = tmp_path_factory.mktemp("chart") / "extractedprism"
    shutil.copytree(CHART_DIR, root)
    validate_tpl = root / "templates" / "_validate.tpl"
    assert "extractedprism.validate" in validate_tpl.read_text()
    validate_tpl.write_text('{{- define "extractedprism.validate" -}}{{- end -}}\n')
    return root


def _render(chart_dir: Path, values: dict[str, Any]) -> list[dict[str, Any]]:
    import yaml

    with h.Chart.load(chart_dir) as chart:
        out = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [d for name, text in sorted(out.items()) if not name.endswith("NOTES.txt")
            for d in yaml.safe_load_all(text) if d]


def program_problems(unchecked: Path, values: dict[str, Any]) -> list[str]:
    """What the program says about the configuration this chart would give it."""
    env = env_of(container(_render(unchecked, values)))
    try:
        validate(flag_values(env))
    except ConfigError as exc:
        return exc.problems
    return []


def chart_problems(values: dict[str, Any]) -> list[str] | None:
    """The problems the shipped chart's render fails with; None when it renders."""
    try:
        _render(CHART_DIR, values)
    except h.HelmError as exc:
        text = str(exc)
        assert PREFIX in text, f"render failed, but not with the program's messages: {text}"
        return text.split(PREFIX, 1)[1].split("; ")
    return None


RULES: dict[str, dict[str, Any]] = {
    # The values that crash-looped every node before: timeout not below interval.
    "timeout-not-below-interval": {"healthInterval": "10s", "healthTimeout": "15s"},
    "timeout-equal-to-interval": {"healthInterval": "15s", "healthTimeout": "15s"},
    "threshold-not-above-liveness-interval": {"livenessThreshold": "5s"},
    "threshold-below-liveness-interval": {"livenessInterval": "20s", "livenessThreshold": "10s"},
    "health-interval-below-1s": {"healthInterval": "500ms", "healthTimeout": "400ms"},
    "health-timeout-below-1s": {"healthTimeout": "999ms"},
    "liveness-interval-below-1s": {"livenessInterval": "0.5s"},
    "liveness-threshold-below-1s": {"livenessInterval": "1s", "livenessThreshold": "900ms"},
    "readyz-without-a-ca-and-without-discovery": {"enableDiscovery": False,
                                                  "healthCheck": "readyz"},
    "readyz-with-a-blank-ca": {"healthCheck": "readyz", "healthCheckCaFile": "  "},
    "cert-without-key": {"healthCheckCertFile": "/etc/pki/c.pem"},
    "key-without-cert": {"healthCheckKeyFile": "/etc/pki/k.pem"},
    "blank-key-counts-as-unset": {"healthCheckCertFile": "/etc/pki/c.pem",
                                  "healthCheckKeyFile": " "},
    "blank-server-name": {"healthCheckServerName": "   "},
    "same-ports": {"bindPort": 7446},
    "recheck-above-interval": {"healthRecheck": "30s"},
    "recheck-below-1s": {"healthRecheck": "500ms"},
    "recheck-below-1s-and-above-interval": {"healthInterval": "500ms", "healthTimeout": "400ms",
                                            "healthRecheck": "999ms"},
    "several-at-once": {"healthInterval": "800ms", "livenessThreshold": "2s",
                        "healthCheckKeyFile": "/k.pem", "healthCheckServerName": " ",
                        "healthPort": 7445},
}


@pytest.mark.parametrize("case", sorted(RULES))
def test_each_rule_fails_the_render_with_the_programs_message(case, unchecked_chart) -> None:
    values = {"endpoints": ENDPOINTS, **RULES[case]}
    expected = program_problems(unchecked_chart, values)
    assert expected, f"{case}: the program accepts {RULES[case]}, so the case tests nothing"
    got = chart_problems(values)
    assert got is not None, f"{case}: the chart renders what the program rejects: {expected}"
    assert sorted(got) == sorted(expected)


def test_the_program_accepts_what_the_chart_renders_by_default(unchecked_chart) -> None:
    for values in ({"endpoints": ENDPOINTS}, {"endpoints": ENDPOINTS, "enableDiscovery": False},
                   {"endpoints": ENDPOINTS, "healthCheck": "tcp"}):
        assert program_problems(unchecked_chart, values) == [], values
        assert chart_problems(values) is None, values


DURATIONS = ["500ms", "999ms", "1s", "1.5s", "2s", "5s", "10s", "15s", "20s", "1m", "1m30s",
             "90s", "0.5m"]


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(hi=st.sampled_from(DURATIONS), ht=st.sampled_from(DURATIONS),
       hr=st.sampled_from(["", *DURATIONS]),
       li=st.sampled_from(DURATIONS), lt=st.sampled_from(DURATIONS),
       check=st.sampled_from(["", "tcp", "readyz"]), discovery=st.booleans(),
       cert=st.sampled_from(["", " ", "/c.pem"]), key=st.sampled_from(["", "/k.pem"]))
def test_chart_and_program_agree_on_any_combination(unchecked_chart, hi, ht, hr, li, lt, check,
                                                    discovery, cert, key) -> None:
    values = {"endpoints": ENDPOINTS, "healthInterval": hi, "healthTimeout": ht,
              "healthRecheck": hr,
              "livenessInterval": li, "livenessThreshold": lt, "healthCheck": check,
              "enableDiscovery": discovery, "healthCheckCertFile": cert,
              "healthCheckKeyFile": key}
    expected = program_problems(unchecked_chart, values)
    got = chart_problems(values)
    if not expected:
        assert got is None, f"the chart rejects what the program accepts: {got}"
    else:
        assert got is not None and sorted(got) == sorted(expected)


def test_missing_endpoints_fail_with_the_programs_message(unchecked_chart) -> None:
    with pytest.raises(ConfigError) as program:
        validate({})
    (expected,) = program.value.problems
    with pytest.raises(h.HelmError) as err:
        _render(CHART_DIR, {})
    assert PREFIX + expected in str(err.value)


def test_discovery_defaults_to_readyz_with_the_service_account_ca(unchecked_chart) -> None:
    env = env_of(container(_render(CHART_DIR, {"endpoints": ENDPOINTS})))
    config = validate(flag_values(env))
    assert config.health_check == "readyz"
    assert config.health_check_ca_file == SA_CA
    env = env_of(container(_render(CHART_DIR, {"endpoints": ENDPOINTS, "healthCheck": "tcp"})))
    assert validate(flag_values(env)).health_check == "tcp"  # one value away
    assert "EP_HEALTH_CHECK_CA_FILE" not in env
    env = env_of(container(_render(CHART_DIR, {"endpoints": ENDPOINTS,
                                               "enableDiscovery": False})))
    assert validate(flag_values(env)).health_check == "tcp"  # no service account files
    assert "EP_HEALTH_CHECK_CA_FILE" not in env


@pytest.mark.parametrize(("drain", "grace", "ok"), [
    ("30s", "", True), ("0s", "", True), ("2m", "", True), ("1.5s", "", True),
    ("30s", 41, True), ("30s", 40, False), ("30s", 30, False), ("0s", 10, False),
    ("0s", 11, True),
])
def test_termination_grace_exceeds_the_drain_window(drain, grace, ok) -> None:
    from extractedprism.config.flags import parse_duration

    values = {"endpoints": ENDPOINTS, "shutdownDrainTimeout": drain,
              "terminationGracePeriodSeconds": grace}
    if not ok:
        problems = chart_problems(values)
        assert problems and "terminationGracePeriodSeconds" in problems[0]
        return
    docs = _render(CHART_DIR, values)
    pod = next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    period = pod["terminationGracePeriodSeconds"]
    # The drain window plus the program's shutdown (5 s proxy + 5 s health server).
    assert period > parse_duration(drain) + 10
    if grace != "":
        assert period == grace
    env = env_of(pod["containers"][0])
    assert env["EP_SHUTDOWN_DRAIN_TIMEOUT"] == drain


def test_every_cross_field_rule_of_the_program_has_a_case(unchecked_chart) -> None:
    """A new Rule row in config.RULES fails this until RULES above (and the chart) cover it."""
    from extractedprism.config.table import FLAG_BY_NAME
    from extractedprism.config.table import RULES as PROGRAM_RULES

    problems = [p for case in RULES.values()
                for p in program_problems(unchecked_chart, {"endpoints": ENDPOINTS, **case})]
    for rule in PROGRAM_RULES:
        options = [FLAG_BY_NAME[f.replace("_", "-")].option for f in rule.fields]
        assert any(all(o in p for o in options) for p in problems), (
            f"no case triggers the program's rule {rule.text!r}")
