"""The fake API server speaks the Kubernetes wire format the watcher relies on.

Raw HTTPS requests (no kubernetes client), so what is checked is the bytes a real
kube-apiserver would send: list shape and pagination, per-selector watch events, bookmark
objects, the 410 Status, and the errors for bad parameters.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import ssl
import time
from typing import Any
from urllib.parse import urlencode

import pytest

from tests.fakes.fake_apiserver import INITIAL_EVENTS_END, FakeApiServer, make_slice

pytestmark = pytest.mark.timeout(30)

PATH = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"
SELECTOR = "kubernetes.io/service-name=kubernetes"


class Client:
    def __init__(self, api: FakeApiServer) -> None:
        self.api = api
        self.ctx = ssl.create_default_context(cadata=api.ca_pem().decode())

    def open(self, **query: str) -> tuple[http.client.HTTPSConnection, http.client.HTTPResponse]:
        conn = http.client.HTTPSConnection("localhost", self.api.port, context=self.ctx,
                                           timeout=10)
        q = {"labelSelector": SELECTOR} | query
        conn.request("GET", f"{PATH}?{urlencode(q)}",
                     headers={"Authorization": f"Bearer {next(iter(self.api.tokens))}"})
        return conn, conn.getresponse()

    def get(self, **query: str) -> tuple[int, Any]:
        conn, resp = self.open(**query)
        with contextlib.closing(conn):
            return resp.status, json.loads(resp.read())

    def events(self, resp: http.client.HTTPResponse, n: int) -> list[dict[str, Any]]:
        out = []
        while len(out) < n:
            line = resp.readline()
            assert line.endswith(b"\n"), f"stream ended after {out}"
            out.append(json.loads(line))
        return out


@pytest.fixture
def client(api: FakeApiServer) -> Client:
    return Client(api)


def test_list_shape(api: FakeApiServer, client: Client) -> None:
    api.set_slice(make_slice("kubernetes", ["10.0.0.1"]))
    api.set_slice(make_slice("other", ["10.0.0.9"], service="other"))
    status, body = client.get()
    assert status == 200
    assert body["kind"] == "EndpointSliceList"
    assert body["apiVersion"] == "discovery.k8s.io/v1"
    assert body["metadata"] == {"resourceVersion": str(api.resource_version)}
    [item] = body["items"]
    # list items carry no kind/apiVersion on the wire (kubectl adds them client-side)
    assert "kind" not in item and "apiVersion" not in item
    assert item["metadata"]["name"] == "kubernetes"
    assert item["metadata"]["resourceVersion"] == "101"
    assert item["metadata"]["labels"] == {"kubernetes.io/service-name": "kubernetes"}
    assert item["ports"] == [{"name": "https", "port": 6443, "protocol": "TCP"}]


def test_limit_and_continue(api: FakeApiServer, client: Client) -> None:
    for name in ("kubernetes-a", "kubernetes-b", "kubernetes-c"):
        api.set_slice(make_slice(name, ["10.0.0.1"]))
    rv = str(api.resource_version)
    status, page1 = client.get(limit="2")
    assert status == 200
    assert [i["metadata"]["name"] for i in page1["items"]] == ["kubernetes-a", "kubernetes-b"]
    assert page1["metadata"]["resourceVersion"] == rv
    assert page1["metadata"]["remainingItemCount"] == 1
    token = page1["metadata"]["continue"]
    api.set_slice(make_slice("kubernetes-d", ["10.0.0.1"]))
    status, page2 = client.get(limit="2", **{"continue": token})
    assert status == 200
    assert [i["metadata"]["name"] for i in page2["items"]] == ["kubernetes-c", "kubernetes-d"]
    assert page2["metadata"]["resourceVersion"] == rv  # the first page's
    assert "continue" not in page2["metadata"]
    api.expire()
    status, body = client.get(**{"continue": token})
    assert status == 410 and body["reason"] == "Expired" and body["code"] == 410
    status, body = client.get(**{"continue": "garbage"})
    assert (status, body["reason"]) == (400, "BadRequest")


def test_watch_events_follow_the_selector_like_the_watch_cache(
        api: FakeApiServer, client: Client) -> None:
    rv = str(api.set_slice(make_slice("kubernetes", ["10.0.0.1"])))
    conn, resp = client.open(watch="true", resourceVersion=rv, allowWatchBookmarks="true",
                             timeoutSeconds="30")
    with contextlib.closing(conn):
        assert resp.status == 200
        assert resp.getheader("Transfer-Encoding") == "chunked"
        assert resp.getheader("Content-Type") == "application/json"
        api.set_slice(make_slice("s2", ["10.0.0.2"], service="other"))  # not seen
        api.set_slice(make_slice("s2", ["10.0.0.2"]))  # enters the selector
        api.set_slice(make_slice("s2", ["10.0.0.3"]))
        leave_rv = api.set_slice(make_slice("s2", ["10.0.0.3"], service="other"))
        api.set_slice(make_slice("kubernetes", ["10.0.0.4"]))
        del_rv = api.delete_slice("kubernetes")
        api.send_bookmark()
        events = client.events(resp, 6)
    kinds = [(e["type"], e["object"]["metadata"].get("name")) for e in events]
    assert kinds == [("ADDED", "s2"), ("MODIFIED", "s2"), ("DELETED", "s2"),
                     ("MODIFIED", "kubernetes"), ("DELETED", "kubernetes"), ("BOOKMARK", None)]
    # leaving the selector: DELETED carries the last matching content at the new version
    left = events[2]["object"]
    assert left["metadata"]["labels"]["kubernetes.io/service-name"] == "kubernetes"
    assert left["metadata"]["resourceVersion"] == str(leave_rv)
    assert events[4]["object"]["metadata"]["resourceVersion"] == str(del_rv)
    assert all(e["object"]["kind"] == "EndpointSlice" for e in events)
    # a bookmark is an empty object holding only the resourceVersion
    bookmark = events[5]["object"]
    assert bookmark["metadata"]["resourceVersion"] == str(api.resource_version)
    assert set(bookmark["metadata"]) <= {"resourceVersion", "creationTimestamp"}
    assert (bookmark["addressType"], bookmark["endpoints"], bookmark["ports"]) == ("", None,
                                                                                  None)


def test_watch_from_an_old_version_replays_history_per_selector(
        api: FakeApiServer, client: Client) -> None:
    rv = str(api.set_slice(make_slice("kubernetes", ["10.0.0.1"])))
    api.set_slice(make_slice("kubernetes", ["10.0.0.1"], service="other"))
    api.set_slice(make_slice("kubernetes", ["10.0.0.2"]))
    conn, resp = client.open(watch="true", resourceVersion=rv, timeoutSeconds="30")
    with contextlib.closing(conn):
        events = client.events(resp, 2)
    assert [e["type"] for e in events] == ["DELETED", "ADDED"]


def test_no_bookmarks_unless_asked(api: FakeApiServer, client: Client) -> None:
    conn, resp = client.open(watch="true", resourceVersion=str(api.resource_version),
                             timeoutSeconds="30")
    with contextlib.closing(conn):
        api.send_bookmark()
        api.set_slice(make_slice("kubernetes", ["10.0.0.1"]))
        assert [e["type"] for e in client.events(resp, 1)] == ["ADDED"]


def test_send_initial_events_ends_with_an_annotated_bookmark(
        api: FakeApiServer, client: Client) -> None:
    api.set_slice(make_slice("kubernetes", ["10.0.0.1"]))
    status, body = client.get(watch="true", sendInitialEvents="true",
                              allowWatchBookmarks="true")
    assert (status, body["reason"]) == (422, "Invalid")
    conn, resp = client.open(watch="true", sendInitialEvents="true",
                             resourceVersionMatch="NotOlderThan", allowWatchBookmarks="true",
                             timeoutSeconds="30")
    with contextlib.closing(conn):
        added, bookmark = client.events(resp, 2)
    assert added["type"] == "ADDED" and added["object"]["metadata"]["name"] == "kubernetes"
    assert bookmark["type"] == "BOOKMARK"
    assert bookmark["object"]["metadata"]["annotations"] == {INITIAL_EVENTS_END: "true"}
    assert bookmark["object"]["metadata"]["resourceVersion"] == str(api.resource_version)


def check_410_status(status: dict[str, Any], rv: str) -> None:
    assert status["kind"] == "Status" and status["apiVersion"] == "v1"
    assert status["status"] == "Failure"
    assert status["reason"] == "Expired" and status["code"] == 410
    assert re.fullmatch(rf"too old resource version: {rv} \(\d+\)", status["message"])


def test_too_old_is_a_200_stream_with_one_410_error_event(
        api: FakeApiServer, client: Client) -> None:
    rv = str(api.set_slice(make_slice("kubernetes", ["10.0.0.1"])))
    api.expire()
    conn, resp = client.open(watch="true", resourceVersion=rv, timeoutSeconds="30")
    with contextlib.closing(conn):
        assert resp.status == 200
        [event] = client.events(resp, 1)
        assert resp.readline() == b""  # and the stream ends
    assert event["type"] == "ERROR"
    check_410_status(event["object"], rv)


def test_too_old_as_http_410_when_asked(api: FakeApiServer, client: Client) -> None:
    api.too_old = "http"
    rv = str(api.set_slice(make_slice("kubernetes", ["10.0.0.1"])))
    api.expire()
    status, body = client.get(watch="true", resourceVersion=rv)
    assert status == 410
    check_410_status(body, rv)


def test_expiring_an_open_watch_sends_the_410_event(api: FakeApiServer, client: Client) -> None:
    rv = str(api.resource_version)
    conn, resp = client.open(watch="true", resourceVersion=rv, timeoutSeconds="30")
    with contextlib.closing(conn):
        api.expire()
        [event] = client.events(resp, 1)
        assert resp.readline() == b""
    assert event["type"] == "ERROR"
    check_410_status(event["object"], rv)


def test_timeout_seconds_ends_the_watch_cleanly(api: FakeApiServer, client: Client) -> None:
    t0 = time.monotonic()
    conn, resp = client.open(watch="true", resourceVersion=str(api.resource_version),
                             timeoutSeconds="1")
    with contextlib.closing(conn):
        assert resp.readline() == b""  # terminating chunk, no error
    assert 0.9 <= time.monotonic() - t0 < 5


def test_bad_parameters_get_a_status(api: FakeApiServer, client: Client) -> None:
    status, body = client.get(labelSelector="a!=b")  # set-based: not supported by the fake
    assert (status, body["reason"], body["kind"]) == (400, "BadRequest", "Status")
    status, body = client.get(watch="true", timeoutSeconds="soon")
    assert (status, body["reason"]) == (400, "BadRequest")
    status, body = client.get(limit="many")
    assert (status, body["reason"]) == (400, "BadRequest")
