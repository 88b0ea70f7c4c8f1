"""One production profile, shipped wherever we deploy (issue 28 item 3).

config/profile.py defines it once. The chart as rendered with its default values, the pod
``extractedprism static-pod`` prints, the kubeadm, Talos and systemd examples, the
``extractedprism profile`` output and docs/deploy.md's block must all carry exactly it:
each path's configuration, as the program parses it, has the profile's value for every
flag of the profile. A value changed in one place and not the others fails here, naming
the path and the flag (``scripts/sync-profile`` rewrites them all after a change).
The program's own defaults stay the spec's.
"""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import pytest
import yaml

from extractedprism.config import profile
from extractedprism.config.table import FLAG_BY_NAME, FLAGS, Config, cautions, validate
from extractedprism.ops.profile import env_file
from tests.deploy.helpers import (
    CHART_DIR,
    ENDPOINTS,
    EXAMPLES_DIR,
    container,
    env_of,
    flag_values,
    load_yaml_docs,
    render,
    values_key,
)
from tests.util import ROOT

CA = "/etc/kubernetes/pki/ca.crt"
SYSTEMD = EXAMPLES_DIR / "systemd"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin"}  # no EP_ variable of the caller's leaks in
    return subprocess.run([sys.executable, "-m", "extractedprism", *args], capture_output=True,
                          text=True, timeout=60, env=env, cwd=ROOT)


def _pod_env(pod: dict[str, Any]) -> dict[str, str]:
    (c,) = pod["spec"]["containers"]
    return {e["name"]: str(e["value"]) for e in c["env"]}


def _config(env: dict[str, str]) -> Config:
    return validate(flag_values(env))


def assert_carries_the_profile(where: str, config: Config) -> None:
    want = validate({"endpoints": ",".join(ENDPOINTS), "health_check_ca_file": CA,
                     **{FLAG_BY_NAME[k].dest: v for k, v in profile.flags().items()}})
    drift = {}
    for s in profile.PRODUCTION:
        dest = FLAG_BY_NAME[s.flag].dest
        if getattr(config, dest) != getattr(want, dest):
            drift[s.flag] = (getattr(config, dest), s.value)
    assert not drift, f"{where} drifts from config/profile.py (flag: (has, profile)): {drift}"


# --- the definition --------------------------------------------------------------------


def test_the_profile_names_real_flags_once_each_with_a_reason() -> None:
    names = [s.flag for s in profile.PRODUCTION]
    assert len(names) == len(set(names))
    assert set(names) <= set(FLAG_BY_NAME), set(names) - set(FLAG_BY_NAME)
    for s in profile.PRODUCTION:
        assert s.reason and "\n" not in s.reason and len(s.reason) < 120, s.flag
    # Every knob issue 28 item 3 names is in it, and the one the 100-node freeze added
    # (overload-guard: the survivors' slow answers).
    assert set(names) == {"health-check", "health-interval", "health-timeout", "health-recheck",
                          "unready-drain-timeout", "overload-guard", "stall-timeout",
                          "upstream-selection", "rebalance-interval", "slow-start",
                          "answer-hedge-delay"}


def test_the_profile_is_a_combination_the_program_does_not_warn_about() -> None:
    # Issue 37, finding 13: with --health-timeout 1s the default --answer-hedge-delay (1s)
    # is no hedge: the first attempt is given up the moment it fires (config/table.py,
    # CAUTIONS). The profile sets it below the timeout, and no caution holds for it.
    values = {"endpoints": ",".join(ENDPOINTS), "health_check_ca_file": CA,
              **{FLAG_BY_NAME[k].dest: v for k, v in profile.flags().items()}}
    config = validate(values)
    assert 0 < config.answer_hedge_delay < config.health_timeout
    assert cautions(values, config) == []


def test_the_programs_own_defaults_stay_the_specs() -> None:
    # A bare `extractedprism --endpoints ...` behaves as the spec says: no profile value
    # is a default of the flag table.
    bare = validate({"endpoints": ",".join(ENDPOINTS)})
    assert (bare.health_interval, bare.health_timeout, bare.health_check) == (20.0, 15.0, "tcp")
    for s in profile.PRODUCTION:
        assert FLAG_BY_NAME[s.flag].default != s.value, f"{s.flag}: the profile repeats a default"


# --- every deployment path ---------------------------------------------------------------


def test_the_chart_as_rendered_by_default_carries_the_profile() -> None:
    docs, _ = render({"endpoints": ENDPOINTS})
    env = env_of(container(docs))
    assert_carries_the_profile("chart (rendered, default values)", _config(env))
    # And values.yaml says so in the values themselves (healthCheck "" renders readyz).
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    for s in profile.PRODUCTION:
        key = values_key(FLAG_BY_NAME[s.flag])
        value = values[key]
        shown = str(value).lower() if isinstance(value, bool) else str(value)  # YAML's true
        assert shown == ("" if s.flag == "health-check" else s.value), key


def test_static_pod_prints_the_profile_and_given_flags_win() -> None:
    proc = _run("static-pod", f"--endpoints={','.join(ENDPOINTS)}", "--enable-discovery=false",
                f"--health-check-ca-file={CA}")
    assert proc.returncode == 0, proc.stderr
    (pod,) = [d for d in yaml.safe_load_all(proc.stdout) if d]
    env = _pod_env(pod)
    assert_carries_the_profile("static-pod", _config(env))
    # A flag given explicitly is kept; the rest of the profile still applies.
    proc = _run("static-pod", f"--endpoints={','.join(ENDPOINTS)}", "--enable-discovery=false",
                f"--health-check-ca-file={CA}", "--health-interval=10s")
    assert proc.returncode == 0, proc.stderr
    (pod,) = [d for d in yaml.safe_load_all(proc.stdout) if d]
    config = _config(_pod_env(pod))
    assert config.health_interval == 10.0
    assert config.upstream_selection == dict(profile.flags())["upstream-selection"]


def test_static_pod_without_the_profile_keeps_the_specs_defaults() -> None:
    proc = _run("static-pod", f"--endpoints={','.join(ENDPOINTS)}", "--enable-discovery=false",
                "--profile=none")
    assert proc.returncode == 0, proc.stderr
    (pod,) = [d for d in yaml.safe_load_all(proc.stdout) if d]
    env = _pod_env(pod)
    assert not set(env) & set(profile.env()), env


def test_static_pod_says_how_to_satisfy_the_profiles_readyz() -> None:
    proc = _run("static-pod", f"--endpoints={','.join(ENDPOINTS)}", "--enable-discovery=false")
    assert proc.returncode == 2
    assert proc.stdout == ""
    (_, problem) = proc.stderr.splitlines()
    for words in ("production profile", "--health-check-ca-file", "--health-check=tcp",
                  "--profile=none"):
        assert words in problem, problem


def test_the_kubeadm_example_carries_the_profile() -> None:
    (pod,) = load_yaml_docs(EXAMPLES_DIR / "kubeadm" / "extractedprism.yaml")
    assert_carries_the_profile("examples/kubeadm/extractedprism.yaml", _config(_pod_env(pod)))


def test_the_talos_example_carries_the_profile() -> None:
    (doc,) = load_yaml_docs(EXAMPLES_DIR / "talos" / "machine-config-patch.yaml")
    (pod,) = doc["machine"]["pods"]
    assert_carries_the_profile("examples/talos/machine-config-patch.yaml",
                               _config(_pod_env(pod)))


def _env_lines(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


def test_the_systemd_example_carries_the_profile() -> None:
    # profile.env is `extractedprism profile` verbatim; the unit reads it, then the node's
    # file, whose variables win: together they must still be the profile.
    text = (SYSTEMD / "profile.env").read_text()
    assert text == _run("profile").stdout, "regenerate: extractedprism profile > " \
        "examples/systemd/profile.env"
    unit = (SYSTEMD / "extractedprism.service").read_text()
    files = re.findall(r"^EnvironmentFile=(\S+)$", unit, re.M)
    assert files == ["/etc/extractedprism/profile.env",
                     "/etc/extractedprism/extractedprism.env"], files
    env = _env_lines(text)
    env.update(_env_lines((SYSTEMD / "extractedprism.env").read_text()))
    assert set(env) <= {f.env for f in FLAGS}
    assert_carries_the_profile("examples/systemd (profile.env + extractedprism.env)",
                               _config(env))


def test_profile_subcommand_prints_the_profile_both_ways() -> None:
    env = _run("profile")
    assert env.returncode == 0, env.stderr
    assert env.stdout == env_file()
    assert _env_lines(env.stdout) == profile.env()
    for s in profile.PRODUCTION:  # each value after the comment giving its reason
        assert f"# {s.reason}\n{s.env}={s.value}\n" in env.stdout
    args = _run("profile", "--format", "args")
    assert args.returncode == 0, args.stderr
    assert args.stdout.split() == profile.args()
    # The one line docs give for running the bare program with the profile parses.
    config = validate({**{FLAG_BY_NAME[a[2:].split("=")[0]].dest: a.split("=", 1)[1]
                          for a in args.stdout.split()},
                       "endpoints": ",".join(ENDPOINTS), "health_check_ca_file": CA})
    assert_carries_the_profile("extractedprism profile --format args", config)


# --- the docs --------------------------------------------------------------------------


def _deploy_block() -> str:
    text = (ROOT / "docs" / "deploy.md").read_text()
    m = re.search(r"<!-- profile:begin -->\n(.*?)<!-- profile:end -->", text, re.S)
    assert m, "docs/deploy.md lacks the profile block"
    return m.group(1)


def test_deploy_md_has_one_block_with_each_value_and_its_reason() -> None:
    block = _deploy_block()
    rows = re.findall(r"^\| `--([a-z-]+)` \| `([^`]+)` \| (.+?) \|$", block, re.M)
    assert [(f, v) for f, v, _ in rows] == list(profile.flags().items()), rows
    for (_, _, reason), s in zip(rows, profile.PRODUCTION, strict=True):
        assert reason == s.reason
    readme = (ROOT / "README.md").read_text()
    assert "docs/deploy.md#the-production-profile" in readme


@pytest.mark.parametrize("path", ["README.md", "docs/deploy.md",
                                  "chart/extractedprism/values.yaml"])
def test_no_old_recommendation_is_left_to_contradict_it(path: str) -> None:
    text = (ROOT / path).read_text()
    assert "Failure detection: recommended timings" not in text
    assert "#failure-detection-recommended-timings" not in text


def test_sync_script_finds_every_file_up_to_date() -> None:
    proc = subprocess.run([str(ROOT / "scripts" / "sync-profile"), "--check"],
                          capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout + proc.stderr
