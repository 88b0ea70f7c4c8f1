"""Where a request head ends, as the health server's connection loop decides it."""

from __future__ import annotations

import pytest

from extractedprism.health.head import request_head_end


@pytest.mark.parametrize("buf, end", [
    (b"", 0),
    (b"GE", 0),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\n", 0),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", 34),
    (b"GET /healthz HTTP/1.1\r\n\r\nGET /", 25),  # a pipelined request stays behind
    (b"GET /healthz HTTP/1.1\nHost: x\n\n", 31),  # bare LF, as http.server reads it
    (b"GET /healthz HTTP/1.1\r\nA: b\n\r\n", 30),
    # Lines that cannot begin an HTTP/1.x request end at their newline, or at once when
    # the method itself is impossible, so they are answered instead of waited for.
    (b"GET /healthz\r\n", 14),
    (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 16),
    (b"\x16\x03\x01\x00\xf4\x01", 6),
    (b"G(T /", 5),
])
def test_request_head_end(buf, end):
    assert request_head_end(buf) == end
    assert request_head_end(bytearray(buf)) == end
