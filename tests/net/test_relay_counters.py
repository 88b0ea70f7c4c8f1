"""Both relays store the stall check's two upstream-side counters in the order its reader
relies on (issue 37, finding 12): the answered mark (the client's count when the
upstream's latest bytes were read) before the bytes-down count. The registry's sampler
reads up, down, then answered (upstreams/registry.py): with the other order, a sample
between the two stores saw the upstream's new bytes with the old mark, i.e. unanswered
client bytes after an answer, and started a stall clock that no later sample cleared when
the connection then went quiet (a watch after its last event).

The native relay's window is two stores apart, far too short to hit from Python, so this
test builds the extension once more with a pause between the two stores
(``RELAY_BETWEEN_STORES``, empty in the product) and samples during it; the Python relay's
stores are recorded as they happen. Both fail with the stores the other way round."""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import sysconfig
import time
from pathlib import Path
from types import ModuleType

import pytest

from extractedprism.datapath import pipe as pipe_mod
from tests.net.test_pipe import piped, start_pipe
from tests.util import wait_until

PAUSE_US = 50_000  # between the two stores: a sampler polling in a loop cannot miss it
ASK, ANSWER = b"ask", b"answer!"
ROUNDS = 3


@pytest.fixture(scope="module")
def paused_relay(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    """_relay.c built with a pause between the answered mark's store and the count's."""
    pytest.importorskip("extractedprism.datapath._relay")  # no compiler here: no relay
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc, "the native relay was built here, so a compiler must be"
    src = Path(pipe_mod.__file__).with_name("_relay.c")
    out = tmp_path_factory.mktemp("paused") / ("_relay" + sysconfig.get_config_var("EXT_SUFFIX"))
    r = subprocess.run([cc, "-O2", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}",
                        f"-DRELAY_BETWEEN_STORES()=usleep({PAUSE_US})", str(src), "-o",
                        str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    spec = importlib.util.spec_from_file_location("_relay", out)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(60)
def test_native_relay_a_sample_that_sees_the_answer_sees_what_it_answers(
        paused_relay: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pipe_mod, "_native", paused_relay.relay)
    client, upstream, p = piped(("native", "splice"))
    relay = start_pipe(p)
    try:
        client.settimeout(5)
        upstream.settimeout(5)
        for i in range(1, ROUNDS + 1):
            client.sendall(ASK)
            assert upstream.recv(100) == ASK
            wait_until(lambda i=i: p.bytes_up == i * len(ASK), 5)
            upstream.sendall(ANSWER)
            deadline = time.monotonic() + 10
            while True:  # sample as the registry does: down, then answered
                down, answered = p.bytes_down, p.up_answered
                if down == i * len(ANSWER):
                    break
                assert time.monotonic() < deadline, "the answer was never counted"
            assert answered == i * len(ASK), (
                f"round {i}: a sample saw the answer's bytes with the mark before it")
            assert client.recv(100) == ANSWER
        client.shutdown(socket.SHUT_WR)
        upstream.shutdown(socket.SHUT_WR)
        relay.join(5)
        assert not relay.is_alive()
    finally:
        client.close()
        upstream.close()
        relay.join(5)


class StoreLog(list):
    """A pipe's counters that note, at each store of the bytes-down count, what a sampler
    running right then would read: (down, answered, up)."""

    def __init__(self) -> None:
        super().__init__([0, 0, 0])
        self.at_down: list[tuple[int, int, int]] = []

    def __setitem__(self, i, value) -> None:  # type: ignore[no-untyped-def]
        super().__setitem__(i, value)
        if i == 1:
            self.at_down.append((self[1], self[2], self[0]))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["splice", "buffer"])
def test_python_relay_stores_the_mark_before_the_count(mode: str) -> None:
    client, upstream, p = piped(("python", mode))
    log = p._counts = StoreLog()  # type: ignore[assignment]
    relay = start_pipe(p)
    try:
        client.settimeout(5)
        upstream.settimeout(5)
        for _ in range(ROUNDS):
            client.sendall(ASK)
            assert upstream.recv(100) == ASK
            upstream.sendall(ANSWER)
            assert client.recv(100) == ANSWER
        client.shutdown(socket.SHUT_WR)
        upstream.shutdown(socket.SHUT_WR)
        relay.join(5)
        assert not relay.is_alive()
    finally:
        client.close()
        upstream.close()
        relay.join(5)
    assert [down for down, _, _ in log.at_down] == [
        i * len(ANSWER) for i in range(1, ROUNDS + 1)]
    # Each time the answer's bytes became visible, the mark already said what they answer.
    assert all(answered == up for _, answered, up in log.at_down), log.at_down
