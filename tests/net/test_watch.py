"""The EndpointSlice watcher against the fake API server, through the real kubernetes client.

Timing rules run with an injected clock and a recording sleep, so every wait the watcher
decides on is checked exactly; one test checks the real 1 s first backoff and its jitter.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from extractedprism.config.endpoints import Endpoint
from extractedprism.config.table import Config
from extractedprism.discovery import kube
from extractedprism.discovery.credentials import ClientConfigError
from extractedprism.discovery.kube import proxy_url
from extractedprism.discovery.watch import KubernetesProvider
from tests.fakes.fake_apiserver import FakeApiServer, make_slice
from tests.util import FixedRandom, wait_until

pytestmark = pytest.mark.timeout(60)

J = 0.5  # FixedRandom value: every delay is base * 1.125


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


class Harness:
    """A provider wired to a fake clock, a recording sleep and the fake API server."""

    def __init__(self, api: FakeApiServer, sa_dir: Path, **config: Any) -> None:
        self.api = api
        self.clock = FakeClock()
        self.stop = threading.Event()
        self.errored: list[str] = []  # on_error's calls: discovery_errors_total in the app
        self.updates: list[list[Endpoint]] = []
        # (delay, slice requests seen so far) for every wait the watcher decided on
        self.sleeps: list[tuple[float, int]] = []
        self.gate = threading.Semaphore(1000)
        cfg = Config(endpoints=(Endpoint("127.0.0.1", 1),), bind_address="127.0.0.1",
                     bind_port=api.port).replace(**config)
        self.provider = KubernetesProvider(
            cfg, self.updates.append, self.errored.append, self.stop, clock=self.clock,
            rng=FixedRandom(J), sa_dir=str(sa_dir), sleep=self.sleep,
            watch_timeout_seconds=300)

    def sleep(self, delay: float) -> bool:
        self.sleeps.append((delay, len(self.api.slice_requests())))
        self.clock.advance(delay)
        # Pace the loop a little so a persistently failing server is not hammered.
        self.stop.wait(0.01)
        return self.stop.is_set()

    @property
    def delays(self) -> list[float]:
        return [round(d, 6) for d, _ in self.sleeps]

    def errors(self) -> float:
        return float(self.errored.count("kubernetes"))

    def wait_watches(self, n: int, open_: bool = True) -> None:
        wait_until(lambda: len(self.api.watch_requests()) >= n
                   and (not open_ or self.api.open_streams() >= 1),
                   10, message=f"{n} watch requests (open={open_})")

    def wait_requests(self, n: int) -> None:
        wait_until(lambda: len(self.api.slice_requests()) >= n, 10,
                   message=f"{n} slice requests")

    def kinds(self) -> list[str]:
        """The slice calls so far: L (list) or W (watch)."""
        return ["W" if r.is_watch else "L" for r in self.api.slice_requests()]

    def last_endpoints(self) -> list[str]:
        return [str(e) for e in self.updates[-1]] if self.updates else []


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        server.set_slice(make_slice("kubernetes", ["10.0.0.1", "10.0.0.2"]))
        yield server


@pytest.fixture
def sa_dir(api: FakeApiServer, tmp_path: Path) -> Path:
    return api.write_service_account(tmp_path / "sa")


@contextlib.contextmanager
def running(api: FakeApiServer, sa_dir: Path) -> Iterator[Harness]:
    """A Harness whose provider runs for the with block (started after the test set the
    API server up) and must stop within 5 s after it."""
    harness = Harness(api, sa_dir)
    harness.provider.start()
    try:
        yield harness
    finally:
        assert harness.provider.stop_and_join(5)


@pytest.fixture
def h(api: FakeApiServer, sa_dir: Path) -> Iterator[Harness]:
    with running(api, sa_dir) as harness:
        yield harness


# --- list, watch and the cache -------------------------------------------------------


def test_lists_then_watches_from_the_list_resource_version(h: Harness) -> None:
    h.wait_watches(1)
    lst, watch = h.api.slice_requests()[:2]
    assert not lst.is_watch and lst.authorized
    assert lst.path == "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"
    assert lst.query["labelSelector"] == "kubernetes.io/service-name=kubernetes"
    assert watch.query["watch"] == "true"
    assert watch.query["allowWatchBookmarks"] == "true"
    assert watch.query["timeoutSeconds"] == "300"
    assert watch.query["resourceVersion"] == str(h.api.resource_version)
    assert watch.authorized
    assert h.last_endpoints() == ["10.0.0.1:6443", "10.0.0.2:6443"]
    assert h.sleeps == []
    assert h.api.sni_names[-1] == "kubernetes.default.svc"


def test_events_recompute_from_every_cached_slice(h: Harness) -> None:
    h.wait_watches(1)
    h.api.set_slice(make_slice("kubernetes-2", ["10.0.0.3"], port=443))
    wait_until(lambda: h.last_endpoints() == ["10.0.0.1:6443", "10.0.0.2:6443",
                                              "10.0.0.3:443"])
    # MODIFIED: ready=false is excluded, the other slice is kept
    h.api.set_slice(make_slice("kubernetes", ["10.0.0.1", "10.0.0.2"], not_ready=["10.0.0.2"]))
    wait_until(lambda: h.last_endpoints() == ["10.0.0.1:6443", "10.0.0.3:443"])
    # DELETED: recomputed from the remaining slice
    h.api.delete_slice("kubernetes")
    wait_until(lambda: h.last_endpoints() == ["10.0.0.3:443"])
    h.api.delete_slice("kubernetes-2")
    wait_until(lambda: h.last_endpoints() == [])
    assert h.errors() == 0
    assert len(h.api.watch_requests()) == 1


def test_garbage_in_the_stream_is_skipped(h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    h.wait_watches(1)
    for raw in (b"this is not json", b"[1,2,3]", b'{"no":"type"}', b'{"type":"ADDED"}',
                b'{"type":"ADDED","object":{"metadata":{}}}',
                b'{"type":"ADDED","object":"a string"}',
                b'{"type":"WEIRD","object":{"metadata":{"name":"x"}}}',
                b'{"type":"ADDED","object":{"metadata":{"name":"bad","resourceVersion":"1",'
                b'"labels":{"kubernetes.io/service-name":"kubernetes"}},'
                b'"addressType":"IPv4","endpoints":[{"addresses":["10.9.9.9"]}],'
                b'"ports":[{"port":"https"}]}}',
                b'\xff\xfe\x00garbage', b"{", b""):
        h.api.inject_raw(raw)
    h.api.set_slice(make_slice("kubernetes-2", ["10.0.0.7"]))
    wait_until(lambda: "10.0.0.7:6443" in h.last_endpoints())
    assert h.provider.running
    assert h.errors() == 0
    assert len(h.api.watch_requests()) == 1
    assert "slice=bad field=ports[0].port" in caplog.text
    assert "not JSON" in caplog.text


def test_bookmark_advances_the_resource_version(h: Harness) -> None:
    h.wait_watches(1)
    h.api.set_slice(make_slice("unrelated", ["10.1.1.1"], service="other"))  # filtered out
    h.api.send_bookmark()
    rv = str(h.api.resource_version)
    wait_until(lambda: h.provider._rv == rv, message="bookmark applied")
    h.clock.advance(31)
    h.api.close_streams()
    h.wait_watches(2)
    assert h.api.watch_requests()[1].query["resourceVersion"] == rv
    assert h.kinds() == ["L", "W", "W"]
    assert h.errors() == 0


# --- bad input through the real list/watch path ------------------------------------


def raw_event(kind: str, obj: dict[str, Any]) -> bytes:
    return json.dumps({"type": kind, "object": obj}).encode()


def slice_warnings(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and f"slice={name}" in r.getMessage()]


def test_a_bad_slice_is_logged_once_not_on_every_event_or_relist(
        api: FakeApiServer, sa_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    bad = make_slice("kubernetes-bad", ["10.0.0.9"])
    bad["ports"] = [{"name": "https", "port": 70000}]
    api.set_slice(bad)
    with running(api, sa_dir) as h:
        h.wait_watches(1)
        for i in range(3):  # events of other slices recompute from the whole cache
            api.set_slice(make_slice(f"kubernetes-{i}", [f"10.0.1.{i}"]))
        wait_until(lambda: "10.0.1.2:6443" in h.last_endpoints())
        api.set_slice(bad)  # a new resourceVersion, same content
        h.clock.advance(31)
        api.expire()  # 410: the re-list brings the bad slice again
        h.wait_watches(2)
        api.set_slice(make_slice("kubernetes-9", ["10.0.1.9"]))
        wait_until(lambda: "10.0.1.9:6443" in h.last_endpoints())
        lines = slice_warnings(caplog, "kubernetes-bad")
        assert len(lines) == 2, lines  # what is wrong, and what is done about it
        assert "field=ports[0].port" in lines[0] and "outside 1-65535" in lines[0]
        assert "10.0.0.9:6443" not in h.last_endpoints()
        assert h.errors() == 0


def test_an_unusable_update_keeps_the_slices_last_endpoints(
        h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    h.wait_watches(1)
    assert h.last_endpoints() == ["10.0.0.1:6443", "10.0.0.2:6443"]
    n = len(h.updates)
    for broken in ({"ports": None}, {"ports": [{"name": "https"}]}, {"endpoints": "x"},
                   {"addressType": "AppleTalk"},
                   {"endpoints": [{"addresses": ["not-an-ip"]}]}):
        h.api.set_slice(make_slice("kubernetes", ["10.0.0.1", "10.0.0.2"]) | broken)
    h.api.set_slice(make_slice("kubernetes-2", ["10.0.0.3"]))  # marks the end of the above
    wait_until(lambda: "10.0.0.3:6443" in h.last_endpoints())
    # the corrupt updates did not remove (and so drain) the slice's endpoints
    assert [[str(e) for e in u] for u in h.updates[n:]] == [
        ["10.0.0.1:6443", "10.0.0.2:6443"]] * 5 + [
        ["10.0.0.1:6443", "10.0.0.2:6443", "10.0.0.3:6443"]]
    lines = slice_warnings(caplog, "kubernetes")
    fields = {m.split("field=")[1].split()[0] for m in lines if "field=" in m}
    assert fields == {"ports", "ports[0].port", "endpoints", "addressType",
                      "endpoints[0].addresses[0]"}
    assert sum("keeping its last endpoints=10.0.0.1:6443,10.0.0.2:6443" in m
               for m in lines) == 5
    # a valid update, even an empty one, is applied as usual
    h.api.set_slice(make_slice("kubernetes", ["10.0.0.2"]))
    wait_until(lambda: h.last_endpoints() == ["10.0.0.2:6443", "10.0.0.3:6443"])
    h.api.set_slice(make_slice("kubernetes", []))
    wait_until(lambda: h.last_endpoints() == ["10.0.0.3:6443"])
    assert h.errors() == 0


def test_a_malformed_endpoint_does_not_hide_the_good_ones_of_its_slice(
        h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    h.wait_watches(1)
    obj = make_slice("kubernetes", ["10.0.0.1"])
    obj["endpoints"] = [
        {"addresses": ["10.0.0.1"]},  # no conditions: ready
        {"addresses": None, "conditions": {"ready": True}},
        {"addresses": ["10.0.0.300"], "conditions": {"ready": True}},
        {"addresses": ["10.0.0.3"], "conditions": {"ready": None}},  # null: ready
        {"addresses": ["10.0.0.4"], "conditions": {"ready": False}},
    ]
    h.api.set_slice(obj)
    wait_until(lambda: h.last_endpoints() == ["10.0.0.1:6443", "10.0.0.3:6443"])
    lines = slice_warnings(caplog, "kubernetes")
    assert len(lines) == 2
    assert "field=endpoints[1].addresses " in lines[0]
    assert "field=endpoints[2].addresses[0] " in lines[1] and "10.0.0.300" in lines[1]


def test_duplicates_across_slices_count_once(h: Harness) -> None:
    h.wait_watches(1)
    h.api.set_slice(make_slice("kubernetes-2", ["10.0.0.2", "10.0.0.1"]))
    h.api.delete_slice("kubernetes")
    wait_until(lambda: h.api.open_streams() == 1 and h.provider._rv == str(
        h.api.resource_version))
    assert h.last_endpoints() == ["10.0.0.1:6443", "10.0.0.2:6443"]


def test_ipv6_and_fqdn_slices(h: Harness) -> None:
    h.wait_watches(1)
    h.api.set_slice(make_slice("kubernetes-v6", ["fd00:0::1"], address_type="IPv6"))
    h.api.set_slice(make_slice("kubernetes-fqdn", ["CP1.example.com"], address_type="FQDN",
                               port=443))
    wait_until(lambda: h.last_endpoints() == [
        "10.0.0.1:6443", "10.0.0.2:6443", "cp1.example.com:443", "[fd00::1]:6443"])


def test_a_slice_of_another_service_is_ignored_even_if_the_server_sends_it(
        h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    h.wait_watches(1)
    foreign = make_slice("kubernetes", ["10.9.9.9"], service="evil")
    foreign["metadata"]["resourceVersion"] = str(h.api.resource_version + 1)
    # a server (or something in between) that ignores the label selector
    h.api.inject_raw(raw_event("MODIFIED", foreign))
    h.api.inject_raw(raw_event("ADDED", foreign | {"metadata": foreign["metadata"]
                                                   | {"name": "other"}}))
    wait_until(lambda: h.last_endpoints() == [])
    assert len(slice_warnings(caplog, "kubernetes")) == 1
    assert "not the kubernetes service" in slice_warnings(caplog, "other")[0]
    assert h.errors() == 0


def test_a_slice_leaving_the_selector_arrives_as_deleted(h: Harness) -> None:
    h.wait_watches(1)
    h.api.set_slice(make_slice("kubernetes-2", ["10.0.0.3"]))
    wait_until(lambda: "10.0.0.3:6443" in h.last_endpoints())
    h.api.set_slice(make_slice("kubernetes-2", ["10.0.0.3"], service="other"))
    wait_until(lambda: h.last_endpoints() == ["10.0.0.1:6443", "10.0.0.2:6443"])
    h.api.set_slice(make_slice("kubernetes-2", ["10.0.0.4"]))  # and back: ADDED
    wait_until(lambda: "10.0.0.4:6443" in h.last_endpoints())
    assert len(h.api.watch_requests()) == 1 and h.errors() == 0


def test_odd_events_are_skipped_with_one_line_each(
        h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    h.wait_watches(1)
    rv_before = h.provider._rv
    h.api.inject_raw(b'{"type":"BOOKMARK","object":{"kind":"EndpointSlice","metadata":{}}}')
    h.api.inject_raw(raw_event("WEIRD", make_slice("kubernetes-x", ["10.0.0.8"])))
    h.api.inject_raw(raw_event("DELETED", make_slice("never-seen", ["10.0.0.7"])))
    h.api.inject_raw(b'{"type":"ADDED","object":{"metadata":{"name":"cut-')  # truncated
    h.api.set_slice(make_slice("kubernetes-2", ["10.0.0.3"]))
    wait_until(lambda: "10.0.0.3:6443" in h.last_endpoints())
    assert h.last_endpoints() == ["10.0.0.1:6443", "10.0.0.2:6443", "10.0.0.3:6443"]
    text = caplog.text
    assert "type=BOOKMARK field=metadata.resourceVersion" in text
    assert "type='WEIRD' slice=kubernetes-x reason='unknown type'" in text
    assert "not JSON" in text
    assert rv_before != h.provider._rv == str(h.api.resource_version)
    assert h.errors() == 0 and len(h.api.watch_requests()) == 1


def test_a_line_cut_by_the_stream_end_is_logged_and_refetched(
        h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    h.wait_watches(1)
    rv = h.provider._rv
    h.api.set_slice(make_slice("kubernetes-2", ["10.0.0.3"]))
    wait_until(lambda: "10.0.0.3:6443" in h.last_endpoints())
    h.api.inject_raw(b'{"type":"MODIFIED","object":{"metadata":{"na', newline=False)
    h.api.drop_streams()  # the connection goes away in the middle of a line
    h.wait_watches(2)
    assert "truncated: the stream ended inside it" in caplog.text
    assert rv != h.provider._rv == h.api.watch_requests()[1].query["resourceVersion"]
    assert h.errors() == 0  # a dropped stream is not an error


def test_an_event_split_over_many_chunks_and_events_sharing_one(h: Harness) -> None:
    h.wait_watches(1)
    one = raw_event("ADDED", make_slice("kubernetes-2", ["10.0.0.3"])) + b"\n"
    for i in range(0, len(one), 7):
        h.api.inject_raw(one[i:i + 7], newline=False)
    two = (raw_event("ADDED", make_slice("kubernetes-3", ["10.0.0.4"])) + b"\n"
           + raw_event("ADDED", make_slice("kubernetes-4", ["10.0.0.5"])) + b"\n")
    h.api.inject_raw(two, newline=False)
    wait_until(lambda: "10.0.0.5:6443" in h.last_endpoints())
    assert h.last_endpoints() == [f"10.0.0.{i}:6443" for i in range(1, 6)]
    assert h.errors() == 0 and len(h.api.watch_requests()) == 1


def test_a_slice_with_1000_endpoints_in_one_line(h: Harness) -> None:
    h.wait_watches(1)
    addrs = [f"10.1.{i // 250}.{i % 250 + 1}" for i in range(1000)]
    h.api.set_slice(make_slice("kubernetes-big", addrs))
    wait_until(lambda: len(h.last_endpoints()) == 1002)
    assert set(h.last_endpoints()) == {f"{a}:6443" for a in addrs} | {
        "10.0.0.1:6443", "10.0.0.2:6443"}
    assert h.errors() == 0 and len(h.api.watch_requests()) == 1


CAP = 256 * 1024  # a small line cap, so the tests need not send 16 MiB


def test_a_line_longer_than_the_cap_ends_the_stream_and_keeps_the_cache(
        h: Harness, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kube, "MAX_LINE_BYTES", CAP, raising=False)
    h.wait_watches(1)
    before = h.last_endpoints()
    # Chunks of 32 KiB, never a newline, until the watcher gives up on the line.
    h.api.inject_raw(b'{"type":"ADDED","object":{"metadata":{"name":"', newline=False)
    for _ in range(CAP // (32 * 1024) + 1):
        h.api.inject_raw(b"x" * (32 * 1024), newline=False)
    h.wait_watches(2)  # the stream was ended (short: after the backoff) and re-opened
    assert "watch line too long" in caplog.text
    assert "truncated" not in caplog.text  # one line about it, not two
    assert h.delays == [1.125]
    assert h.errors() == 0  # neither an ERROR event nor a failed Watch call
    assert h.last_endpoints() == before and h.provider.running


def test_a_chunk_promising_more_than_the_cap_is_read_in_bounded_pieces(
        h: Harness, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kube, "MAX_LINE_BYTES", CAP, raising=False)
    h.wait_watches(1)
    # A chunk-size line for 1 GiB, then a little more than the cap of it: a reader that
    # waits for the whole chunk before splitting lines would hold it all (and here wait
    # for bytes that never come).
    h.api.inject_unframed(b"40000000\r\n" + b"x" * (CAP + 64 * 1024))
    h.wait_watches(2)
    assert "watch line too long" in caplog.text
    assert h.errors() == 0 and h.provider.running


@pytest.mark.parametrize("code", [500, 403])
def test_error_event_other_than_410_is_counted_once_and_keeps_the_cache(
        h: Harness, code: int) -> None:
    h.wait_watches(1)
    n = len(h.updates)
    h.api.send_error_event(code)
    h.wait_watches(2)
    assert h.errors() == 1
    assert h.kinds() == ["L", "W", "W"]  # re-watched from where it was, no re-list
    assert len(h.updates) == n


@pytest.mark.parametrize("status", [
    {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Gone",
     "code": 410, "message": "too old resource version: 1 (2)"},
    # client-go treats reason Expired as expiry whatever the code says
    {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Expired",
     "message": "The resourceVersion for the provided watch is too old."},
])
def test_410_error_event_variants_relist_uncounted(h: Harness, status: dict[str, Any]) -> None:
    h.wait_watches(1)
    h.api.inject_raw(json.dumps({"type": "ERROR", "object": status}).encode())
    h.wait_watches(2)
    assert h.kinds() == ["L", "W", "L", "W"]
    assert h.errors() == 0


@pytest.mark.parametrize("body", [
    {"kind": "EndpointSliceList", "metadata": {"resourceVersion": "5"}, "items": "oops"},
    {"kind": "EndpointSliceList", "metadata": {}, "items": []},
    ["not", "a", "list", "object"],
])
def test_a_malformed_list_is_a_counted_failed_list_and_retried(
        api: FakeApiServer, sa_dir: Path, body: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    api.serve_next_list(body)
    with running(api, sa_dir) as h:
        h.wait_watches(1)
        assert h.kinds() == ["L", "L", "W"]
        assert h.delays == [1.125]
        assert h.errors() == 1
        assert "endpointslice list failed error=ValueError" in caplog.text
        assert h.last_endpoints() == ["10.0.0.1:6443", "10.0.0.2:6443"]


def test_list_items_of_wrong_shape_are_skipped(api: FakeApiServer, sa_dir: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    good = make_slice("kubernetes", ["10.0.0.1"])
    api.serve_next_list({"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                         "metadata": {"resourceVersion": str(api.resource_version)},
                         "items": ["a string", None, {"metadata": "x"}, good]})
    with running(api, sa_dir) as h:
        h.wait_watches(1)
        assert h.updates[0] == [Endpoint("10.0.0.1", 6443)]
        assert caplog.text.count("field=metadata.name reason='missing'") == 3
        assert h.errors() == 0


# --- reconnect timing rules ----------------------------------------------------------


def test_short_clean_end_waits_for_the_backoff_without_relisting(h: Harness) -> None:
    h.wait_watches(1)
    h.api.close_streams()  # open for 0 s on the injected clock
    h.wait_watches(2)
    h.clock.advance(10)
    h.api.close_streams()
    h.wait_watches(3)
    assert h.delays == [1.125, 2.25]
    assert h.kinds() == ["L", "W", "W", "W"]
    assert h.errors() == 0


def test_long_clean_end_reopens_at_once(h: Harness) -> None:
    h.wait_watches(1)
    h.clock.advance(30)
    h.api.close_streams()
    h.wait_watches(2)
    h.clock.advance(45)
    h.api.drop_streams()  # a dropped connection is a stream end, not an error
    h.wait_watches(3)
    assert h.sleeps == []
    assert h.kinds() == ["L", "W", "W", "W"]
    assert h.errors() == 0


def test_error_on_the_rewatch_after_a_long_watch_restarts_backoff(api: FakeApiServer,
                                                                   sa_dir: Path) -> None:
    api.fail("list", 500, count=3)
    with running(api, sa_dir) as h:
        h.wait_watches(1)
        assert h.delays == [1.125, 2.25, 4.5]
        h.clock.advance(31)
        api.fail("watch", 503, count=1)
        api.close_streams()
        h.wait_watches(3)
        # backoff restarted from 1 s instead of continuing at 8 s
        assert h.delays == [1.125, 2.25, 4.5, 1.125]
        assert h.kinds() == ["L", "L", "L", "L", "W", "W", "W"]
        assert h.errors() == 4


def test_error_event_ending_a_long_watch_restarts_backoff(api: FakeApiServer,
                                                          sa_dir: Path) -> None:
    api.fail("list", 500, count=2)
    with running(api, sa_dir) as h:
        h.wait_watches(1)
        h.clock.advance(30)
        api.send_error_event(500, "InternalError")
        h.wait_watches(2)
        assert h.delays == [1.125, 2.25, 1.125]
        assert h.errors() == 3


def test_errors_without_a_long_watch_keep_doubling(h: Harness) -> None:
    h.wait_watches(1)
    h.api.send_error_event(500)  # an ERROR event: counted
    h.wait_watches(2)
    h.api.fail("watch", 401, count=2)  # failed Watch calls: counted
    h.api.close_streams()  # short clean end: not counted, still waits
    h.wait_requests(5)
    h.wait_watches(5)
    h.clock.advance(29)
    h.api.close_streams()
    h.wait_watches(6)
    assert h.delays == [1.125, 2.25, 4.5, 9.0, 18.0]
    assert h.errors() == 3
    assert h.kinds() == ["L"] + ["W"] * 6


def test_drop_and_error_after_long_rewatch_counts(h: Harness) -> None:
    h.wait_watches(1)
    h.clock.advance(31)
    h.api.close_streams()
    h.wait_watches(2)
    h.api.send_error_event(500)  # the re-watch right after a long watch hits an error
    h.wait_watches(3)
    assert h.delays == [1.125]
    assert h.errors() == 1


def test_410_event_on_a_short_watch_relists_then_waits(h: Harness) -> None:
    h.wait_watches(1)
    h.api.set_slice(make_slice("kubernetes-2", ["10.0.0.3"]))
    wait_until(lambda: "10.0.0.3:6443" in h.last_endpoints())
    h.api.expire()  # ERROR event, Status code 410 reason Expired
    h.wait_watches(2)
    assert h.kinds() == ["L", "W", "L", "W"]
    # re-list right away (no wait before it), then the backoff before the watch
    assert h.sleeps == [(1.125, 3)]
    assert h.errors() == 0
    assert h.api.watch_requests()[1].query["resourceVersion"] == str(h.api.resource_version)


def test_410_ending_a_long_watch_rewatches_at_once(h: Harness) -> None:
    h.wait_watches(1)
    h.clock.advance(30)
    h.api.expire()
    h.wait_watches(2)
    assert h.kinds() == ["L", "W", "L", "W"]
    assert h.sleeps == []
    assert h.errors() == 0


def test_http_410_on_the_rewatch_after_a_long_watch_rewatches_at_once(h: Harness) -> None:
    h.api.too_old = "http"
    h.wait_watches(1)
    h.api.expire(notify_open=False)  # the open watch stays; its resourceVersion is now too old
    h.clock.advance(31)
    h.api.close_streams()
    h.wait_watches(3)
    assert h.kinds() == ["L", "W", "W", "L", "W"]
    assert h.sleeps == []
    assert h.errors() == 0


def test_http_410_after_a_short_watch_waits_for_backoff(h: Harness) -> None:
    h.api.too_old = "http"
    h.wait_watches(1)
    h.api.expire(notify_open=False)
    h.api.close_streams()  # short: wait 1.125, re-watch -> HTTP 410, re-list, wait 2.25
    h.wait_watches(3)
    assert h.kinds() == ["L", "W", "W", "L", "W"]
    assert h.sleeps == [(1.125, 2), (2.25, 4)]
    assert h.errors() == 0


def test_410_event_on_a_new_watch_like_the_watch_cache(api: FakeApiServer,
                                                        sa_dir: Path) -> None:
    assert api.too_old == "event"  # the fake's default, as the real watch cache answers
    with running(api, sa_dir) as h:
        h.wait_watches(1)
        api.expire(notify_open=False)
        h.clock.advance(31)
        api.close_streams()
        h.wait_watches(3)
        assert h.kinds() == ["L", "W", "W", "L", "W"]
        assert h.sleeps == []
        assert h.errors() == 0


def test_failed_relist_is_counted_and_retried(h: Harness) -> None:
    h.wait_watches(1)
    h.clock.advance(31)
    h.api.fail("list", 500, count=2)
    h.api.expire()
    h.wait_watches(2)
    assert h.kinds() == ["L", "W", "L", "L", "L", "W"]
    # two failed re-lists wait for the backoff; the 410 ended a long watch, so the
    # watch after the successful re-list starts at once
    assert h.sleeps == [(1.125, 3), (2.25, 4)]
    assert h.errors() == 2


def test_dropped_short_stream_is_not_an_error(h: Harness) -> None:
    h.wait_watches(1)
    h.api.drop_streams()
    h.wait_watches(2)
    assert h.delays == [1.125]
    assert h.errors() == 0


def test_first_backoff_is_one_second_plus_at_most_25_percent_real_time(
        api: FakeApiServer, sa_dir: Path) -> None:
    api.fail("list", 500, count=1)
    stop = threading.Event()
    provider = KubernetesProvider(
        Config(endpoints=(Endpoint("127.0.0.1", 1),), bind_port=api.port),
        lambda eps: None, lambda provider: None, stop, sa_dir=str(sa_dir),
        watch_timeout_seconds=300)
    provider.start()
    try:
        wait_until(lambda: len(api.list_requests()) >= 2, 10)
        first, second = api.list_requests()[:2]
        gap = second.time - first.time
        assert 1.0 <= gap <= 1.25 + 0.25, gap
    finally:
        assert provider.stop_and_join(5)


# --- client building, credentials, health, shutdown ----------------------------------


def test_token_file_is_reread_as_it_rotates(h: Harness, sa_dir: Path) -> None:
    h.wait_watches(1)
    h.api.set_tokens("rotated-token")
    (sa_dir / "token").write_text("rotated-token\n")
    h.clock.advance(31)
    h.api.close_streams()
    h.wait_watches(2)
    assert h.api.watch_requests()[1].authorized
    assert h.errors() == 0


def test_connects_to_its_own_listener_with_the_kubernetes_server_name(
        tmp_path: Path) -> None:
    # the certificate names only kubernetes.default.svc: 127.0.0.1 alone would not verify
    with FakeApiServer(names=("kubernetes.default.svc",)) as api:
        api.set_slice(make_slice("kubernetes", ["10.0.0.1"]))
        h = Harness(api, api.write_service_account(tmp_path / "sa"), bind_address="0.0.0.0")
        h.provider.start()
        try:
            h.wait_watches(1)
            assert h.errors() == 0
            assert set(api.sni_names) == {"kubernetes.default.svc"}
        finally:
            assert h.provider.stop_and_join(5)


@pytest.mark.parametrize("bind,expected", [
    ("127.0.0.1", "https://127.0.0.1:7445"), ("0.0.0.0", "https://127.0.0.1:7445"),
    ("::", "https://127.0.0.1:7445"), ("::1", "https://[::1]:7445"),
    ("10.1.2.3", "https://10.1.2.3:7445"), ("node.local", "https://node.local:7445")])
def test_proxy_url(bind: str, expected: str) -> None:
    assert proxy_url(bind, 7445) == expected


def test_kubeconfig_is_used_as_given(api: FakeApiServer, tmp_path: Path) -> None:
    kc = api.write_kubeconfig(tmp_path / "kubeconfig")
    h = Harness(api, tmp_path / "no-sa", kubeconfig=str(kc), bind_port=1)
    h.provider.start()
    try:
        h.wait_watches(1)
        assert h.last_endpoints() == ["10.0.0.1:6443", "10.0.0.2:6443"]
    finally:
        assert h.provider.stop_and_join(5)


def test_broken_kubeconfig_raises_a_config_error(api: FakeApiServer, tmp_path: Path) -> None:
    h = Harness(api, tmp_path / "no-sa", kubeconfig=str(tmp_path / "missing"))
    with pytest.raises(ClientConfigError):
        h.provider.start()
    assert not h.provider.running


def test_no_client_logs_one_warning_and_stays_healthy(
        api: FakeApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="extractedprism.discovery.watch")
    h = Harness(api, tmp_path / "no-sa")
    h.provider.start()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "static endpoints only" in warnings[0].getMessage()
    assert not h.provider.running and h.provider.restarts == 0
    assert h.provider.stop_and_join(1)
    assert api.slice_requests() == []


def test_discovery_disabled_starts_nothing(api: FakeApiServer, sa_dir: Path) -> None:
    h = Harness(api, sa_dir, enable_discovery=False)
    h.provider.start()
    assert not h.provider.running and h.provider.restarts == 0
    assert api.slice_requests() == []


def test_stop_wakes_a_blocked_watch_promptly(api: FakeApiServer, sa_dir: Path) -> None:
    stop = threading.Event()
    provider = KubernetesProvider(
        Config(endpoints=(Endpoint("127.0.0.1", 1),), bind_port=api.port),
        lambda eps: None, lambda provider: None, stop, sa_dir=str(sa_dir))
    provider.start()
    wait_until(lambda: api.open_streams() == 1, 10)
    t0 = time.monotonic()
    assert provider.stop_and_join(5)
    assert time.monotonic() - t0 < 2
    assert provider.restarts == 0


def test_stop_during_backoff_is_prompt(api: FakeApiServer, sa_dir: Path) -> None:
    api.fail("list", 500, count=None)
    stop = threading.Event()
    provider = KubernetesProvider(
        Config(endpoints=(Endpoint("127.0.0.1", 1),), bind_port=api.port),
        lambda eps: None, lambda provider: None, stop, sa_dir=str(sa_dir))
    provider.start()
    wait_until(lambda: len(api.list_requests()) >= 1, 10)
    t0 = time.monotonic()
    assert provider.stop_and_join(5)
    assert time.monotonic() - t0 < 1


def test_a_dying_watch_loop_is_restarted_with_backoff_counted_and_logged(
        api: FakeApiServer, sa_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    h = Harness(api, sa_dir)
    real = h.provider._watch_forever
    deaths = []

    def dies_twice(client: object) -> None:
        if len(deaths) < 2:
            deaths.append(1)
            raise RuntimeError("bug in the loop")
        real(client)  # type: ignore[arg-type]

    h.provider._watch_forever = dies_twice  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="extractedprism.discovery.watch"):
        h.provider.start()
        try:
            h.wait_watches(1)  # restarted: listed and watching again
            assert h.provider.running and h.provider.restarts == 2
            assert h.errors() == 2  # each death counted
            assert h.delays == [1.125, 2.25]  # the spec's backoff, J = 0.5
            assert h.last_endpoints() == ["10.0.0.1:6443", "10.0.0.2:6443"]
        finally:
            assert h.provider.stop_and_join(5)
    died = [r for r in caplog.records if "kubernetes discovery failed" in r.getMessage()]
    assert len(died) == 2 and all(r.exc_info for r in died)  # with the traceback


def test_every_list_and_event_yields_an_update_also_unchanged(h: Harness) -> None:
    # "Endpoint list updates received": every list and every slice event counts, the
    # merge applies only changes (old code: only changed lists were handed on).
    h.wait_watches(1)
    assert len(h.updates) == 1  # the list
    h.api.set_slice(make_slice("kubernetes", ["10.0.0.2", "10.0.0.1"]))  # same endpoints
    wait_until(lambda: len(h.updates) == 2, 10)
    assert h.updates[0] == h.updates[1]
    h.api.send_bookmark()  # no endpoint list: not an update
    h.api.set_slice(make_slice("kubernetes-2", ["10.0.0.4"]))
    wait_until(lambda: h.last_endpoints()[-1:] == ["10.0.0.4:6443"])
    assert len(h.updates) == 3


def test_ipv6_listener_is_bracketed(tmp_path: Path) -> None:
    try:
        api = FakeApiServer(host="::1").start()
    except OSError as exc:  # pragma: no cover - no IPv6 loopback here
        pytest.skip(f"no ::1: {exc}")
    try:
        api.set_slice(make_slice("kubernetes", ["fd00::1"], address_type="IPv6"))
        h = Harness(api, api.write_service_account(tmp_path / "sa"), bind_address="::1")
        h.provider.start()
        try:
            h.wait_watches(1)
            assert h.last_endpoints() == ["[fd00::1]:6443"]
        finally:
            assert h.provider.stop_and_join(5)
    finally:
        api.stop()


def test_a_list_that_trickles_in_fails_at_its_deadline_and_is_retried(
        api: FakeApiServer, sa_dir: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # Each byte arrives well within the read timeout, so only an overall deadline ends
    # it; without one the watcher would wait for the whole trickle (here ~60 s).
    monkeypatch.setattr(kube, "LIST_DEADLINE_S", 0.5)
    api.drip_next_list(0.1)
    h = Harness(api, sa_dir)
    started = time.monotonic()
    h.provider.start()
    try:
        h.wait_watches(1)
        assert time.monotonic() - started < 10
        assert h.kinds() == ["L", "L", "W"]
        assert h.errors() == 1
        assert "not received within 0.5 s" in caplog.text
        assert h.last_endpoints() == ["10.0.0.1:6443", "10.0.0.2:6443"]
    finally:
        assert h.provider.stop_and_join(5)


def test_a_list_over_the_size_cap_is_a_counted_failed_list(
        api: FakeApiServer, sa_dir: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(kube, "LIST_MAX_BYTES", 50)  # the fake's list is a few hundred
    with running(api, sa_dir) as h:
        # The watcher counts the failure just before it logs it: wait for both.
        wait_until(lambda: h.errors() >= 1
                   and "EndpointSlice list larger than 50 bytes" in caplog.text, 10,
                   message="the oversized list counted and logged")
        assert h.kinds()[:1] == ["L"] and "W" not in h.kinds()
