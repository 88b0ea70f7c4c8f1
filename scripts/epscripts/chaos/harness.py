"""One run's world: upstreams, fake API server, proxy, load and monitor; the checks'
shapes (Check, Outcome) and the per-event report."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import trustme

from epscripts.chaos.bounds import CLIENT_TIMEOUT, DRAIN, INTERVAL, TIMEOUT, TOTAL, fmt
from epscripts.chaos.load import Attempt, Load, Recorder, mono
from epscripts.chaos.netns import Netns
from epscripts.chaos.procs import Monitor, ProxyProc, UpstreamProc
from tests.fakes.fake_apiserver import FakeApiServer, make_slice


@dataclass
class Check:
    ok: bool
    text: str


@dataclass
class Outcome:
    name: str
    victim: str
    t0: float = 0.0
    t_recover: float = 0.0
    t_end: float = 0.0
    lines: list[str] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)

    def check(self, ok: bool, text: str) -> None:
        self.checks.append(Check(ok, text))


class Harness:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.short = args.short
        self.tmp = Path(tempfile.mkdtemp(prefix="extractedprism-chaos-"))
        self.rec = Recorder()
        self.ups: dict[str, UpstreamProc] = {}
        self.api: FakeApiServer | None = None
        self.proxy: ProxyProc | None = None
        self.monitor: Monitor | None = None
        self.load: Load | None = None
        self.netns: Netns | None = None
        self.netns_skip = ""
        self.outcomes: list[Outcome] = []
        self.global_checks: list[Check] = []
        self.port = 0
        self.slice_addrs: list[str] = []

    # -- set-up ---------------------------------------------------------------------

    def setup(self) -> None:
        ca = trustme.CA()
        self.ca_cert = self.tmp / "ca.pem"
        self.ca_key = self.tmp / "ca.key"
        ca.cert_pem.write_to_path(str(self.ca_cert))
        ca.private_key_pem.write_to_path(str(self.ca_key))
        with socket.socket() as s:
            s.bind(("127.0.0.2", 0))
            self.port = s.getsockname()[1]
        c_host = "127.0.0.4"
        if self.args.no_netns:
            self.netns_skip = "--no-netns given"
        else:
            ns = Netns()
            self.netns = ns
            try:
                c_host = ns.setup()
            except (RuntimeError, OSError, subprocess.SubprocessError, IndexError) as exc:
                err = getattr(exc, "stderr", "") or str(exc)
                self.netns_skip = f"network namespaces not available here ({err.strip()})"
                ns.cleanup()
                self.netns = None
                c_host = "127.0.0.4"
        for name, host in (("a", "127.0.0.2"), ("b", "127.0.0.3"), ("c", c_host)):
            up = UpstreamProc(f"apiserver-{name}", host, self.port, self.ca_cert, self.ca_key,
                              netns=self.netns.name if (name == "c" and self.netns) else None)
            self.ups[name] = up
            up.start()
        for up in self.ups.values():
            if not up.wait_listening(30):
                raise RuntimeError(f"upstream {up.name} did not start")
        self.api = FakeApiServer().start()
        self.slice_addrs = [self.ups[n].host for n in ("a", "b", "c")]
        self.api.set_slice(make_slice("kubernetes", self.slice_addrs, port=self.port))
        kubeconfig = self.api.write_kubeconfig(self.tmp / "kubeconfig")
        with socket.socket() as s1, socket.socket() as s2:
            s1.bind(("127.0.0.1", 0))
            s2.bind(("127.0.0.1", 0))
            self.bind_port, self.health_port = s1.getsockname()[1], s2.getsockname()[1]
        static = ",".join(self.ups[n].address for n in ("a", "b"))
        cmd = [sys.executable, "-m", "extractedprism", "--endpoints", static,
               "--bind-port", str(self.bind_port), "--health-port", str(self.health_port),
               "--health-interval", f"{INTERVAL:g}s", "--health-timeout", f"{TIMEOUT:g}s",
               "--drain-timeout", f"{DRAIN:g}s", "--health-check", "readyz",
               "--health-check-ca-file", str(self.ca_cert), "--kubeconfig", str(kubeconfig),
               "--log-level", "info"]
        self.proxy = ProxyProc(cmd, self.tmp / "proxy.log", self.health_port)
        if not self.wait_all_ready(30):
            raise RuntimeError("the proxy never reported all three upstreams ready; "
                               f"log: {self.proxy.log_path}")
        self.monitor = Monitor(self.proxy)
        self.monitor.start()

    def all_ready(self) -> bool:
        assert self.proxy is not None
        try:
            ups = self.proxy.upstreams()
        except (OSError, ValueError):
            return False
        want = {u.address for u in self.ups.values()}
        return set(ups) == want and all(
            u["healthy"] and u["ready"] and not u["draining"] for u in ups.values())

    def wait_all_ready(self, timeout: float) -> float | None:
        """Seconds until every upstream is healthy, ready and not draining; None: never."""
        t0 = mono()
        while mono() - t0 < timeout:
            assert self.proxy is not None
            if self.proxy.proc.poll() is not None:
                raise RuntimeError(f"the proxy exited with {self.proxy.proc.returncode}; "
                                   f"log: {self.proxy.log_path}")
            if self.all_ready():
                return mono() - t0
            time.sleep(0.05)
        return None

    def stats_min(self, samples: int = 5) -> dict[str, int]:
        """Minimum of a few samples: probe and health-server threads come and go."""
        assert self.proxy is not None
        got = []
        for _ in range(samples):
            got.append(self.proxy.stats())
            time.sleep(0.1)
        return {k: min(s[k] for s in got) for k in got[0]}

    def wait_no_connections(self, timeout: float) -> bool:
        t0 = mono()
        while mono() - t0 < timeout:
            try:
                assert self.proxy is not None
                if all(u["active_connections"] == 0 for u in self.proxy.upstreams().values()):
                    return True
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        return False

    def spread_long_lived(self, victim: str, tries: int = 5) -> int:
        """Make sure some long-lived connections sit on ``victim`` before its event: while
        none do, every long-lived client reconnects (random selection spreads them).
        Returns how many are on it."""
        assert self.load is not None
        on = 0
        for _ in range(tries):
            now = mono()
            live = [a for a in self.attempts() if a.kind != "short" and a.end is None
                    and a.established]
            on = sum(a.upstream == victim for a in live)
            if on:
                return on
            self.load.generation += 1
            clients = {t.name[len("load-"):] for t in self.load.threads
                       if not t.name.startswith("load-short-")}
            deadline = mono() + CLIENT_TIMEOUT
            while mono() < deadline:
                fresh = {a.client for a in self.attempts() if a.kind != "short"
                         and a.established and a.end is None and a.first_byte is not None
                         and a.first_byte > now}
                if fresh >= clients:
                    break
                time.sleep(0.05)
        return on

    def run_load(self, seconds: float) -> Load:
        load = Load(self.bind_port, self.ca_cert, self.rec, watches=5, streams=3, shorts=3,
                    deadline=mono() + seconds)
        load.start()
        return load

    # -- helpers for the event analysis -------------------------------------------

    def name_of(self, key: str) -> str:
        return self.ups[key].name

    def attempts(self) -> list[Attempt]:
        return self.rec.snapshot()

    def moved_after(self, victim: str, at: float, until: float) -> tuple[float | None, int, int]:
        """Long-lived connections established on ``victim`` and open at ``at``: the time
        (since ``at``) until each client had a new connection established elsewhere.
        Returns (time until all moved or None, how many there were, how many not moved)."""
        atts = self.attempts()
        clients = {a.client for a in atts if a.kind != "short" and a.established
                   and a.upstream == victim and a.first_byte is not None
                   and a.first_byte <= at and (a.end is None or a.end > at)}
        worst = 0.0
        not_moved = 0
        for cid in clients:
            later = sorted((a for a in atts if a.client == cid and a.established
                            and a.upstream != victim and a.first_byte is not None
                            and a.first_byte > at), key=lambda a: a.first_byte or 0)
            if later and (later[0].first_byte or 0) <= until:
                worst = max(worst, (later[0].first_byte or 0) - at)
            else:
                not_moved += 1
        if not clients:
            return 0.0, 0, 0
        return (None if not_moved else worst), len(clients), not_moved


def picked_after(window: list[Attempt], victim: str, at: float, until: float
                 ) -> list[Attempt]:
    """New connections that ``victim`` served although they began after ``at``.

    Judged by when the client began to connect: such a connection was certainly picked
    after ``at``, whereas a client thread may note its completed connect late, after a
    pick made before ``at``."""
    return [a for a in window if a.upstream == victim and a.connected is not None
            and at < a.start < until]


def last_close_after(h: Harness, victim: str, at: float) -> float:
    """Seconds after ``at`` until the last long-lived connection open on ``victim`` at
    ``at`` ended (0 when there were none)."""
    ends = [a.end - at for a in h.attempts() if a.kind != "short" and a.established
            and a.upstream == victim and a.first_byte is not None and a.first_byte <= at
            and a.end is not None and a.end > at]
    return max(ends, default=0.0)


def run_event(h: Harness, name: str, victim_key: str, inject: Callable[[], float],
              recover: Callable[[], None], hold_until: Callable[[Outcome], bool],
              max_hold: float, min_hold: float,
              analyse: Callable[[Harness, Outcome, list[Attempt], float], None]) -> Outcome:
    assert h.proxy is not None and h.monitor is not None
    victim = h.ups[victim_key]
    out = Outcome(name, victim.name)
    ready_in = h.wait_all_ready(30)
    if ready_in is None:
        out.check(False, f"{name}: precondition: all upstreams ready before the event")
        return out
    on_victim = h.spread_long_lived(victim.name)
    before = h.proxy.stats()
    m_before = h.proxy.metrics()
    b_before = h.rec.bytes_checked
    c_before = len(h.rec.corrupt)
    base_start = mono()
    time.sleep(1.0)  # baseline: how long a handshake takes here, right now
    base = [a.first_byte - a.connected for a in h.attempts()
            if a.kind == "short" and a.ok and a.start >= base_start - 2.0
            and a.first_byte is not None and a.connected is not None]
    base_wait = max(base) if base else 0.0
    out.t0 = t0 = inject()
    t_min = t0 + min_hold
    while mono() < t0 + max_hold:
        if mono() >= t_min and hold_until(out):
            break
        time.sleep(0.05)
    recover()
    out.t_recover = mono()
    back = h.wait_all_ready(30)
    out.t_end = mono()
    time.sleep(0.3)  # let the clients record what just ended
    atts = [a for a in h.attempts() if a.end is not None]
    window = [a for a in atts if t0 <= a.start < out.t_end]
    new_failed = [a for a in window if not a.ok]
    cut = [a for a in atts if a.kind != "short" and a.established and a.end is not None
           and t0 <= a.end < out.t_end and a.end_reason not in ("stopped", "recycled", "")]
    inflight_cut = [a for a in atts if a.kind == "short" and not a.ok and a.start < t0
                    and a.end is not None and a.end >= t0]
    # From the start of the first failing connection (or the first cut) to the last
    # failure: the time during which some client was hanging or erroring.
    begins = [a.start for a in new_failed] + [a.end for a in cut + inflight_cut
                                             if a.end is not None]
    ends = [a.end for a in new_failed + cut + inflight_cut if a.end is not None]
    err_span = (max(ends) - min(begins)) if ends and begins else 0.0
    last_new = h.monitor.last_new_connection(victim.address, t0, out.t_recover)
    client_last = max((a.connected for a in window if a.upstream == victim.name
                       and a.connected is not None and a.connected < out.t_recover),
                      default=None)
    moved, n_long, not_moved = h.moved_after(victim.name, t0, out.t_recover)
    after = h.proxy.stats()
    m_after = h.proxy.metrics()
    err_key = f'extractedprism_connection_errors_total{{upstream="{victim.address}"}}'
    kinds: dict[str, int] = {}
    for a in new_failed:
        kinds[a.error] = kinds.get(a.error, 0) + 1
    out.lines += [
        f"long-lived connections on it when the fault began: {on_victim}",
        f"client-visible failures: {len(new_failed)} of {len(window)} new connections failed"
        + (f" ({', '.join(f'{k}: {v}' for k, v in sorted(kinds.items()))})" if kinds else "")
        + f"; {len(inflight_cut)} in-flight short requests cut; {len(cut)} long-lived "
        f"connections cut (their clients reconnect)",
        f"clients saw errors for: {err_span:.2f} s (first failing connection to last "
        "failure)",
        "no new connection to it after: "
        + ("none after the event" if last_new is None else f"<= {fmt(last_new - t0)} "
           f"(proxy /upstreams); last one a client saw: "
           f"{'none' if client_last is None else fmt(client_last - t0)}"),
        "its existing connections moved after: "
        + (f"{fmt(moved)} ({n_long} long-lived)" if moved is not None else
           f"NOT moved by recovery ({not_moved} of {n_long} still on it at "
           f"{fmt(out.t_recover - t0)})"),
        f"bytes checked: {h.rec.bytes_checked - b_before} "
        f"({len(h.rec.corrupt) - c_before} corrupted)",
        f"proxy threads {before['threads']} -> {after['threads']}, fds {before['fds']} -> "
        f"{after['fds']}, RSS {before['rss_kib'] / 1024:.1f} -> "
        f"{after['rss_kib'] / 1024:.1f} MiB",
        f"metrics: connection_errors_total{{{victim.address}}} "
        f"+{m_after.get(err_key, 0) - m_before.get(err_key, 0):g}, connections_total "
        f"+{m_after.get(TOTAL, 0) - m_before.get(TOTAL, 0):g}",
        f"recovery: fault held {out.t_recover - t0:.2f} s; all upstreams ready again "
        + (f"{back:.2f} s after recovery" if back is not None else "NEVER (30 s)"),
    ]
    analyse(h, out, window, base_wait)
    if back is None:
        out.check(False, f"{name}: all upstreams healthy and ready again within 30 s "
                  "of recovery")
    return out
