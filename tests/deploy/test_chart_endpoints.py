"""The chart's side of the one --endpoints table (tests/endpoint_cases.py).

Every value the program rejects at start fails the chart's render with the program's own
line, in both forms the chart takes (one comma-separated string, or a list, which the chart
joins with commas into EP_ENDPOINTS); every value the program accepts renders, and the
EP_ENDPOINTS it renders gives the program the same upstreams. So no endpoint list can
render into a pod that exits 2 on every node.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extractedprism.config.table import ConfigError, validate
from tests.deploy.helpers import container, env_of, flag_values, helm, render
from tests.endpoint_cases import CHART_REQUIRED_HINT, INVALID, REQUIRED, VALID, Case

h = helm()
PREFIX = "extractedprism: invalid configuration: "


def forms(case: Case) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = [("string", case.value)]
    out.append(("list", case.value.split(",") if case.value else []))
    return out


def render_error(values: dict[str, Any]) -> str | None:
    try:
        render(values)
    except h.HelmError as exc:
        text = str(exc)
        assert PREFIX in text, f"render failed, but not with the program's message: {text}"
        return text.split(PREFIX, 1)[1].strip()
    return None


@pytest.mark.parametrize("case", INVALID, ids=lambda c: c.id)
def test_the_chart_rejects_what_the_program_rejects_in_its_words(case: Case) -> None:
    expected = case.problem + CHART_REQUIRED_HINT if case.problem == REQUIRED else case.problem
    for form, value in forms(case):
        got = render_error({"endpoints": value})
        assert got == expected, f"{form} form {value!r}"


def test_absent_endpoints_are_the_required_message() -> None:
    assert render_error({}) == REQUIRED + CHART_REQUIRED_HINT
    assert render_error({"endpoints": None}) == REQUIRED + CHART_REQUIRED_HINT


@pytest.mark.parametrize("case", VALID, ids=lambda c: c.id)
def test_the_chart_renders_what_the_program_accepts(case: Case) -> None:
    for form, value in forms(case):
        env = env_of(container(render({"endpoints": value})[0]))
        config = validate(flag_values(env))
        assert tuple(str(e) for e in config.endpoints) == case.upstreams, form
        # Entries are passed trimmed, as written otherwise (the program canonicalises).
        assert env["EP_ENDPOINTS"] == ",".join(e.strip() for e in case.value.split(","))


def test_other_problems_are_reported_with_the_endpoints_one() -> None:
    got = render_error({"endpoints": "10.0.0.1", "bindPort": 7446})
    assert got is not None
    assert got.startswith("--endpoints (10.0.0.1) is invalid: '10.0.0.1' is not host:port; ")
    assert got.endswith("--bind-port (7446) and --health-port (7446) must differ")


# Pieces endpoint lists are made of, so random lists hit every branch of both parsers.
PIECES = ["10.0.0.1", "256", "0", "010", "fd00", "::", ":", "[", "]", ",", ".", "-", "%",
          "eth0", "cp1", "example", "com", "6443", "65536", "99999", "x", " ", "\t", "_",
          "https://", "/", "'", "1", "ffff", "192.0.2.1"]


@settings(max_examples=120, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=10).map("".join))
def test_chart_and_program_agree_on_any_list(value: str) -> None:
    try:
        validate({"endpoints": value})
        expected = None
    except ConfigError as exc:
        (expected,) = exc.problems
        if expected == REQUIRED:
            expected += CHART_REQUIRED_HINT
    assert render_error({"endpoints": value}) == expected
