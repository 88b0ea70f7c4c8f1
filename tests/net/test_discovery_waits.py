"""Every wait of the watcher ends at shutdown, and a server cannot park discovery for
hours: a Retry-After is honoured up to the backoff maximum only (issue 29 item 11)."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import pytest

from extractedprism.app import SHUTDOWN_TIMEOUT_S
from extractedprism.discovery import kube
from extractedprism.discovery.backoff import MAX_DELAY
from tests.fakes.fake_apiserver import FakeApiServer, make_slice
from tests.net.test_discovery_e2e import start_app
from tests.net.test_watch import Harness
from tests.util import connection_count, wait_until

pytestmark = pytest.mark.timeout(60)

SIX_HOURS = "21600"


def throttled_delays(caplog: pytest.LogCaptureFixture) -> list[float]:
    return [float(m.group(1)) for r in caplog.records
            if (m := re.search(r"kube request throttled.* delay=([0-9.]+)s", r.getMessage()))]


def test_a_six_hour_retry_after_is_capped_and_shutdown_ends_the_wait(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="extractedprism.discovery.kube")
    with FakeApiServer() as api:
        api.set_slice(make_slice("kubernetes", ["10.0.0.1"]))
        api.fail("list", 429, None, retry_after=SIX_HOURS)
        h = Harness(api, api.write_service_account(tmp_path / "sa"))
        h.provider.start()
        try:
            wait_until(lambda: throttled_delays(caplog), 10, message="the throttled list")
            assert throttled_delays(caplog) == [MAX_DELAY]  # capped, not 6 h
            assert kube.RETRY_AFTER_MAX_S == MAX_DELAY == 30.0
            started = time.monotonic()
            assert h.provider.stop_and_join(SHUTDOWN_TIMEOUT_S)
            took = time.monotonic() - started
        finally:
            h.provider.stop_and_join(SHUTDOWN_TIMEOUT_S)
        assert took < SHUTDOWN_TIMEOUT_S / 2, took
        assert len(api.list_requests()) == 1  # not tried again after the stop
        assert h.errored == []  # a shutdown is not a discovery error


def test_shutdown_ends_a_list_that_is_still_arriving(tmp_path: Path) -> None:
    """A list whose body drips in (one byte a second: no read ever times out) is cut
    by shutdown, not waited for up to the list deadline."""
    with FakeApiServer() as api:
        api.set_slice(make_slice("kubernetes", ["10.0.0.1"]))
        api.drip_next_list(1.0)
        h = Harness(api, api.write_service_account(tmp_path / "sa"))
        h.provider.start()
        try:
            wait_until(lambda: api.list_requests(), 10, message="the list call")
            time.sleep(0.3)  # the watcher is inside the body read (not a wait for a state)
            started = time.monotonic()
            assert h.provider.stop_and_join(SHUTDOWN_TIMEOUT_S)
            took = time.monotonic() - started
        finally:
            h.provider.stop_and_join(SHUTDOWN_TIMEOUT_S)
        assert took < SHUTDOWN_TIMEOUT_S / 2, took
        assert h.errored == []


def test_the_app_stops_clean_while_the_api_server_asks_for_six_hours(tmp_path: Path) -> None:
    """The whole proxy, discovery through its own listener: stop is clean and within
    the shutdown bound."""
    with FakeApiServer() as api:
        api.fail("any", 503, None, retry_after=SIX_HOURS)
        app = start_app(api, tmp_path)
        try:
            wait_until(lambda: api.slice_requests(), 10, message="a throttled call")
            # The answer is in: the client closed its connection and waits to retry.
            wait_until(lambda: connection_count(app.registry) == 0, 10,
                       message="the throttled call's connection closed")
            started = time.monotonic()
            clean = app.stop()
            took = time.monotonic() - started
        finally:
            app.stop()
        assert clean
        assert took < SHUTDOWN_TIMEOUT_S, took
