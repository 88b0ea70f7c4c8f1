"""One run's measurements: starting each proxy path and timing every phase against it."""

from __future__ import annotations

import argparse
import contextlib
import os
import selectors
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from epscripts.bench.config import BODY_SIZE, HOST, REF_DIR, REFS
from epscripts.bench.parse import (
    cores_note,
    cpu_seconds,
    cpu_us_per_request,
    parse_iperf3,
    parse_wrk,
    settled_rss,
)
from epscripts.bench.services import (
    Proc,
    Procs,
    haproxy_config,
    nginx_config,
    wait_healthy,
    wait_listening,
)
from epscripts.common import ROOT, child_env, free_port, python_module


@dataclass
class Bench:
    args: argparse.Namespace
    procs: Procs
    tmp: Path
    runs: dict = field(default_factory=dict)  # runs[metric][path] = [values]
    notes: list[str] = field(default_factory=list)
    ep_error: str | None = None
    ref_errors: dict = field(default_factory=dict)  # reference path -> why it is skipped

    def record(self, key: str, path: str, value: float | None) -> None:
        self.runs.setdefault(key, {}).setdefault(path, []).append(value)

    def note(self, text: str) -> None:
        print(f"  ! {text}", flush=True)
        self.notes.append(text)

    # proxies ------------------------------------------------------------------------------

    def start_haproxy(self, tag: str, upstream: int, hosts: tuple[str, ...] = (HOST,)
                      ) -> tuple[Proc, int]:
        port = free_port()
        cfg = self.tmp / f"haproxy-{tag}.cfg"
        cfg.write_text(haproxy_config(port, upstream, self.args.haproxy_threads, hosts))
        proc = self.procs.start(f"haproxy-{tag}", ["haproxy", "-db", "-f", str(cfg)])
        wait_listening(port, proc, self.procs)
        return proc, port

    def start_ep(self, tag: str, upstream: int, relay: str = "native",
                 hosts: tuple[str, ...] = (HOST,)) -> tuple[Proc, int] | None:
        """Start extractedprism; on failure remember why and return None (not a harness error)."""
        if self.ep_error and not self.args.ep_retry:
            return None
        if self.args.ep_cmd_given:
            relay_args: list[str] = []  # a prototype's own command: its flags as given
        else:
            relay_args = ["--relay", relay]
        port, hport = free_port(), free_port()
        argv = [*shlex.split(self.args.ep_cmd.format(python=sys.executable)),
                "--endpoints", ",".join(f"{h}:{upstream}" for h in hosts),
                "--bind-address", HOST, "--bind-port", str(port), "--health-port", str(hport),
                "--enable-discovery=false", "--health-interval", self.args.ep_health_interval,
                "--health-timeout", "1s", "--max-connections", str(self.args.ep_max_connections),
                "--log-level", "warn", *relay_args, *shlex.split(self.args.ep_args)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (self.args.ep_pythonpath or str(ROOT), env.get("PYTHONPATH", "")) if p)
        # Not cwd=ROOT: "python -m" puts the working directory first on sys.path, which
        # would shadow --ep-pythonpath with the repo's own package.
        proc = self.procs.start(f"extractedprism-{relay}-{tag}", argv, env=env, cwd=self.tmp)
        if wait_healthy(hport, proc):
            return proc, port
        tail = self.procs.log_tail(proc)
        self.procs.stop(proc)
        self.ep_error = f"extractedprism did not become healthy ({' '.join(argv)}):\n{tail}"
        self.note(self.ep_error)
        return None

    def ref_argv(self, path: str) -> list[str] | None:
        """The command of a reference proxy (ref-c is compiled once per run), or None."""
        if path == "ref-py":
            return [sys.executable, str(REF_DIR / "tpc_min.py")]
        binary = self.tmp / "tpc"
        if not binary.exists():
            cc = shutil.which("cc") or shutil.which("gcc")
            res = None if cc is None else subprocess.run(
                [cc, "-O2", "-pthread", "-o", str(binary), str(REF_DIR / "tpc.c")],
                capture_output=True, text=True, timeout=120, check=False)
            if res is None or res.returncode != 0:
                why = "no C compiler (cc/gcc) on PATH" if res is None else res.stderr[-2000:]
                self.note(f"ref-c skipped: could not build {REF_DIR / 'tpc.c'}: {why}")
                return None
        return [str(binary)]

    def start_ref(self, path: str, tag: str, upstream: int, hosts: tuple[str, ...] = (HOST,)
                  ) -> tuple[Proc, int] | None:
        """Start a reference proxy with the flags extractedprism gets (it ignores the rest)."""
        if path in self.ref_errors:
            return None
        cmd = self.ref_argv(path)
        if cmd is None:
            self.ref_errors[path] = "could not build"
            return None
        port, hport = free_port(), free_port()
        argv = [*cmd, "--endpoints", ",".join(f"{h}:{upstream}" for h in hosts),
                "--bind-address", HOST,
                "--bind-port", str(port), "--health-port", str(hport)]
        proc = self.procs.start(f"{path}-{tag}", argv, cwd=ROOT, batch=True)
        if wait_healthy(hport, proc):
            return proc, port
        self.ref_errors[path] = f"{path} did not start: {self.procs.log_tail(proc)}"
        self.note(self.ref_errors[path])
        self.procs.stop(proc)
        return None

    def start_proxy(self, path: str, tag: str, upstream: int, hosts: tuple[str, ...] = (HOST,)
                    ) -> tuple[Proc | None, int] | None:
        """(proxy process or None for direct, port to load), or None if it could not start.
        ``hosts``: the upstream's addresses, one endpoint / server each (direct: the first)."""
        if path == "direct":
            return None, upstream
        if path == "haproxy":
            return self.start_haproxy(tag, upstream, hosts)
        if path == "ep-python":
            return self.start_ep(tag, upstream, relay="python", hosts=hosts)
        if path in REFS:
            return self.start_ref(path, tag, upstream, hosts)
        return self.start_ep(tag, upstream, hosts=hosts)

    def proxies_for(self, tag: str, upstream: int, hosts: tuple[str, ...] = (HOST,)
                    ) -> dict[str, tuple[Proc | None, int]]:
        """{path: (proxy process or None, port)} for the selected paths that started."""
        out: dict[str, tuple[Proc | None, int]] = {}
        for path in self.args.paths:
            started = self.start_proxy(path, tag, upstream, hosts)
            if started:
                out[path] = started
        return out

    def stop_proxies(self, proxies: dict) -> None:
        for proc, _ in proxies.values():
            if proc is not None:
                self.procs.stop(proc)

    def py_spy(self, phase: str, path: str, proc: Proc | None, seconds: float) -> Proc | None:
        """Attach py-spy to extractedprism for one run of the phase named by --py-spy."""
        if self.args.py_spy != phase or path != "extractedprism" or proc is None:
            return None
        spy = shutil.which("py-spy") or str(ROOT / ".venv/bin/py-spy")
        out = Path(self.args.py_spy_dir) / f"{phase}-{int(time.time())}.txt"
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"  py-spy -> {out}", flush=True)
        return self.procs.start(f"py-spy-{phase}", [
            spy, "record", "--pid", str(proc.popen.pid), "--format", "raw", "--threads",
            "--rate", "250", "--duration", str(max(1, int(seconds))), "--output", str(out)])

    def timed(self, phase: str, path: str, proc: Proc | None, argv: list[str],
              seconds: float) -> tuple[str, float | None]:
        """Run one bounded load command; return its stdout and the proxy's CPU seconds."""
        spy = self.py_spy(phase, path, proc, seconds)
        cpu0 = cpu_seconds(proc.popen.pid) if proc else None
        try:
            res = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 20,
                                 stdin=subprocess.DEVNULL)
        finally:
            if spy is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    spy.popen.wait(10)
                self.procs.stop(spy)
        cpu = cpu_seconds(proc.popen.pid) - cpu0 if proc else None
        if res.returncode != 0:
            raise RuntimeError(f"{argv[0]} exited {res.returncode}: "
                               f"{(res.stderr or res.stdout)[-500:]}")
        return res.stdout, cpu

    # phases -----------------------------------------------------------------------------

    def phase_bulk(self) -> None:
        print("== bulk throughput (iperf3)", flush=True)
        up = free_port()
        srv = self.procs.start("iperf3-server", ["iperf3", "-s", "-p", str(up), "-B", HOST])
        wait_listening(up, srv, self.procs)
        time.sleep(0.2)  # let iperf3 get over the probe connection above
        proxies = self.proxies_for("bulk", up)
        try:
            for rep in range(self.args.reps):
                for streams in (1, 4):
                    for path, (proc, port) in proxies.items():
                        argv = ["iperf3", "-c", HOST, "-p", str(port), "-t",
                                str(self.args.bulk_seconds), "-P", str(streams), "-J"]
                        key = f"bulk{streams}"
                        try:
                            out, cpu = self.timed("bulk", path, proc, argv,
                                                  self.args.bulk_seconds)
                            r = parse_iperf3(out)
                        except (RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
                            self.note(f"bulk {streams} {path} rep {rep}: {e}")
                            self.record(f"{key}_gbps", path, None)
                            time.sleep(1.0)  # iperf3 server needs a moment after an error
                            continue
                        self.record(f"{key}_gbps", path, r["gbps"])
                        if proc is not None:
                            self.record(f"{key}_cpu_s_per_gb", path,
                                        cpu / (r["bytes"] / 1e9) if r["bytes"] else None)
                        print(f"  rep {rep} streams {streams} {path:15s} {r['gbps']:7.2f} Gbit/s"
                              + (f"  proxy cpu {cpu / r['seconds']:.2f} cores" if cpu else ""),
                              flush=True)
        finally:
            self.stop_proxies(proxies)
            self.procs.stop(srv)

    def wrk(self, phase: str, path: str, proc: Proc | None, port: int, conns: int,
            close: bool) -> dict | None:
        argv = ["wrk", "-t", "1", "-c", str(conns), "-d", f"{self.args.wrk_seconds}s",
                "--latency", "--timeout", "2s"]
        if close:
            argv += ["-H", "Connection: close"]
        argv.append(f"http://{HOST}:{port}/")
        try:
            out, cpu = self.timed(phase, path, proc, argv, self.args.wrk_seconds)
            r = parse_wrk(out)
        except (RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
            self.note(f"wrk {phase} c={conns} {path}: {e}")
            return None
        r["proxy_cpu_s"] = cpu
        if r["errors"] or r["non_2xx"]:
            self.note(f"wrk {phase} c={conns} {path}: {r['errors']} socket errors "
                      f"{r.get('socket_errors')}, {r['non_2xx']} non-2xx")
        return r

    def start_nginx(self) -> tuple[Proc, int]:
        up = free_port()
        www = self.tmp / "www"
        www.mkdir(exist_ok=True)
        (www / "index.html").write_bytes(b"x" * (BODY_SIZE - 1) + b"\n")
        conf = self.tmp / "nginx.conf"
        conf.write_text(nginx_config(self.tmp, up, self.args.http_hosts))
        srv = self.procs.start("nginx", ["nginx", "-p", str(self.tmp), "-c", str(conf),
                                         "-e", str(self.tmp / "nginx-error.log")])
        wait_listening(up, srv, self.procs)
        return srv, up

    def check_http(self, path: str, port: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://{HOST}:{port}/", timeout=3) as r:
                ok = r.status == 200 and len(r.read()) == BODY_SIZE
        except OSError as e:
            self.note(f"{path}: HTTP check through port {port} failed: {e}")
            return False
        if not ok:
            self.note(f"{path}: HTTP check through port {port} returned a wrong body")
        return ok

    def phase_keepalive(self, srv_port: int) -> None:
        print("== keep-alive request/response (wrk -> nginx)", flush=True)
        proxies = self.proxies_for("keepalive", srv_port, self.args.http_hosts)
        try:
            proxies = {p: v for p, v in proxies.items() if self.check_http(p, v[1])}
            for rep in range(self.args.reps):
                for conns in (1, 64):
                    for path, (proc, port) in proxies.items():
                        r = self.wrk("keepalive", path, proc, port, conns, close=False)
                        key = f"ka{conns}"
                        self.record(f"{key}_rps", path, r and r["rps"])
                        self.record(f"{key}_p50_ms", path, r and r["p50_ms"])
                        self.record(f"{key}_p99_ms", path, r and r["p99_ms"])
                        if proc is not None:
                            self.record(f"{key}_cpu_us_per_req", path, cpu_us_per_request(r))
                        if r:
                            print(f"  rep {rep} c={conns:<3d} {path:15s} {r['rps']:9.0f} req/s"
                                  f"  p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms"
                                  + cores_note(r, proc), flush=True)
        finally:
            self.stop_proxies(proxies)

    def phase_newconn(self, srv_port: int) -> None:
        print(f"== new connection per request (wrk -c 1 and -c {self.args.newconn_conns}, "
              "Connection: close)", flush=True)
        proxies = self.proxies_for("newconn", srv_port, self.args.http_hosts)
        try:
            proxies = {p: v for p, v in proxies.items() if self.check_http(p, v[1])}
            for rep in range(self.args.reps):
                for conns, key in ((1, "nc1"), (self.args.newconn_conns, "newconn")):
                    for path, (proc, port) in proxies.items():
                        r = self.wrk("newconn", path, proc, port, conns, close=True)
                        self.record(f"{key}_cps", path, r and r["rps"])
                        if key == "newconn":
                            self.record("newconn_p99_ms", path, r and r["p99_ms"])
                        if proc is not None:
                            self.record(f"{key}_cpu_us_per_conn", path, cpu_us_per_request(r))
                        if r:
                            print(f"  rep {rep} c={conns:<3d} {path:15s} {r['rps']:9.0f} conn/s"
                                  f"  p99 {r['p99_ms']:.3f} ms" + cores_note(r, proc), flush=True)
                        # Let TIME_WAIT and the proxy's connection table settle between runs.
                        time.sleep(0.3)
        finally:
            self.stop_proxies(proxies)

    def open_idle(self, port: int, n: int, deadline: float) -> list[socket.socket]:
        """Open n connections to port and prove each reaches the holder (1-byte echo)."""
        socks: list[socket.socket] = []
        try:
            for _ in range(n):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"only {len(socks)} of {n} connections opened in time")
                s = socket.create_connection((HOST, port), timeout=5)
                socks.append(s)
            for s in socks:
                s.sendall(b"x")
            sel = selectors.DefaultSelector()
            for s in socks:
                s.setblocking(False)
                sel.register(s, selectors.EVENT_READ)
            pending = len(socks)
            while pending:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{pending} of {n} connections not echoed in time")
                for key, _ in sel.select(0.5):
                    data = key.fileobj.recv(16)
                    sel.unregister(key.fileobj)
                    pending -= 1
                    if data != b"x":
                        raise ConnectionError(f"connection closed or garbled: {data!r}")
            sel.close()
            return socks
        except BaseException:
            for s in socks:
                s.close()
            raise

    def phase_idle(self) -> None:
        n = self.args.idle_conns
        print(f"== resident memory with {n} idle connections", flush=True)
        up = free_port()
        holder = self.procs.start("holder", python_module("epscripts.bench", "--hold", str(up)),
                                  env=child_env())
        wait_listening(up, holder, self.procs)
        try:
            for path in self.args.paths:
                if path == "direct":
                    continue
                started = self.start_proxy(path, "idle", up)
                if not started:
                    continue
                try:
                    self.measure_idle(path, started[0], started[1], n)
                finally:
                    self.stop_proxies({path: started})
        finally:
            self.procs.stop(holder)

    def measure_idle(self, path: str, proc: Proc, port: int, n: int) -> None:
        deadline = time.monotonic() + 60
        # Warm up: a few connections first so lazily built state (pools, first-use imports)
        # counts in the baseline, not per connection.
        for s in self.open_idle(port, 20, deadline):
            s.close()
        time.sleep(0.5)
        before = settled_rss(proc.popen.pid)
        try:
            socks = self.open_idle(port, n, deadline)
        except (OSError, TimeoutError, ConnectionError) as e:
            self.note(f"idle {path}: {e}")
            self.record("idle_rss_kib_per_conn", path, None)
            return
        try:
            after = settled_rss(proc.popen.pid)
        finally:
            for s in socks:
                s.close()
        per = (after["rss_kib"] - before["rss_kib"]) / n
        self.record("idle_rss_kib_per_conn", path, per)
        self.record("idle_rss_total_mib", path, after["rss_kib"] / 1024)
        self.idle_detail = getattr(self, "idle_detail", {})
        self.idle_detail[path] = {"before": before, "after": after, "connections": n}
        print(f"  {path:15s} RSS {before['rss_kib']} -> {after['rss_kib']} KiB "
              f"(threads {before['threads']} -> {after['threads']}, fds {before['fds']} -> "
              f"{after['fds']}): {per:.1f} KiB/conn",
              flush=True)
