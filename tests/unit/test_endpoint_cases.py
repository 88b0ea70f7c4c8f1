"""The program's side of the one --endpoints table (tests/endpoint_cases.py): each value
the program rejects is rejected with exactly its line, each one it accepts gives exactly
its upstreams. tests/deploy/test_chart_endpoints.py holds the chart to the same table."""

from __future__ import annotations

import pytest

from extractedprism.config.table import ConfigError, validate
from tests.endpoint_cases import INVALID, VALID, Case


@pytest.mark.parametrize("case", INVALID, ids=lambda c: c.id)
def test_the_program_rejects_with_one_line(case: Case) -> None:
    with pytest.raises(ConfigError) as err:
        validate({"endpoints": case.value})
    assert err.value.problems == [case.problem]


@pytest.mark.parametrize("case", VALID, ids=lambda c: c.id)
def test_the_program_accepts(case: Case) -> None:
    config = validate({"endpoints": case.value})
    assert tuple(str(e) for e in config.endpoints) == case.upstreams


def test_the_table_covers_every_rule() -> None:
    # host, port range, brackets, scheme, empty entries, empty list: each has a case.
    problems = " ".join(c.problem or "" for c in INVALID)
    for needle in ("is required", "must not be empty", "entry 2 is empty", "is not host:port",
                   "is outside 1-65535", "is not a number", "is not an IP address",
                   "must be written in brackets", "expected [ipv6]:port", "URL scheme"):
        assert needle in problems, needle
    assert any(len(c.upstreams) < len(c.value.split(",")) for c in VALID)  # duplicates
