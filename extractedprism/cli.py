"""Command line: flags and EP_ env vars -> validate -> logging -> App -> wait for a signal.

Runs on the main thread. Signal handlers only set the stop Event; the main thread then
runs the ordered shutdown. SIGHUP is logged and ignored: configuration is read once at
start, and a hang-up (a closed terminal, a habitual ``kill -HUP``) must not take every
connection of the node down. SIGUSR1 dumps every thread's stack to stderr (faulthandler)
for images without py-spy. Invalid configuration exits with status 2 before any port
is opened, listing every problem.
"""

from __future__ import annotations

import faulthandler
import importlib
import logging
import os
import resource
import signal
import sys
import threading
import traceback
from collections.abc import Sequence

import configargparse

from extractedprism import __version__
from extractedprism.config import FLAGS, Config, ConfigError, validate
from extractedprism.logsetup import setup_logging

log = logging.getLogger("extractedprism")

# `extractedprism NAME ...` runs another tool of the same entry point (one image, one
# binary: `kubectl exec ... extractedprism admin list` works in the distroless image).
# Each lives in its own module; its function takes the arguments after NAME and returns
# the exit status.
SUBCOMMANDS: dict[str, str] = {
    "static-pod": "extractedprism.staticpod:main",
}


def run_subcommand(name: str, argv: Sequence[str]) -> int:
    module, func = SUBCOMMANDS[name].split(":")
    return int(getattr(importlib.import_module(module), func)(list(argv)))


def build_parser() -> configargparse.ArgumentParser:
    parser = configargparse.ArgumentParser(
        prog="extractedprism",
        description="Per-node TCP load balancer for Kubernetes API server high availability. "
        "Every flag can also be set through its EP_ environment variable.",
        formatter_class=configargparse.ArgumentDefaultsHelpFormatter,
    )
    for flag in FLAGS:
        kwargs: dict[str, object] = {
            "env_var": flag.env,
            "dest": flag.dest,
            "default": None,
            "help": f"{flag.help} (default: {flag.default if flag.default is not None else '-'})",
            "metavar": flag.kind.upper() if flag.kind != "choice" else "{" + ",".join(
                flag.choices) + "}",
        }
        if flag.kind == "bool":
            # `--enable-discovery` alone means true; `--enable-discovery=false` works too.
            kwargs.update(nargs="?", const="true")
        parser.add_argument(flag.option, **kwargs)  # type: ignore[arg-type]
    parser.add_argument("--version", action="version", version=f"extractedprism {__version__}")
    return parser


def _join_dash_values(argv: Sequence[str]) -> list[str]:
    """``--drain-timeout -1s`` -> ``--drain-timeout=-1s``.

    argparse takes a value that starts with "-" for another option and stops with
    "expected one argument"; joined, the value reaches validate(), whose message names
    the flag, the value and the rule like every other.
    """
    valued = {f.option for f in FLAGS if f.kind != "bool"}
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if (arg in valued and nxt is not None and nxt.startswith("-") and nxt != "--"
                and nxt.split("=", 1)[0] not in valued and not nxt.startswith("--")):
            out.append(f"{arg}={nxt}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def parse_config(argv: Sequence[str] | None = None) -> Config:
    """Parse and validate; raises ConfigError listing every problem."""
    args = list(sys.argv[1:] if argv is None else argv)
    ns = build_parser().parse_args(_join_dash_values(args))
    return validate(vars(ns))


def _raise_fd_limit() -> None:
    # Each connection needs two sockets (plus a reusable kernel pipe pair per pipe
    # thread); the soft limit is often 1024 while the hard limit is far higher.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else 1 << 20
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass


def dump_threads(_signum: int = 0, _frame: object = None, file: object = None) -> None:
    """Write every thread's name and stack to stderr (SIGUSR1), like a goroutine dump."""
    out = file or sys.stderr
    frames = sys._current_frames()
    lines = [f"=== extractedprism thread dump: {threading.active_count()} threads"]
    for t in threading.enumerate():
        frame = frames.get(t.ident or -1)
        lines.append(f"--- thread {t.name!r} ident={t.ident} daemon={t.daemon}")
        if frame is not None:
            lines.extend(line.rstrip() for line in traceback.format_stack(frame))
    print("\n".join(lines), file=out, flush=True)  # type: ignore[call-overload]


SIGHUP_MESSAGE = "SIGHUP: configuration is read at start; restart to apply changes"


def on_sighup(_signum: int = 0, _frame: object = None) -> None:
    """One line per SIGHUP received, then carry on (the default action would exit)."""
    log.warning(SIGHUP_MESSAGE)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in SUBCOMMANDS:
        return run_subcommand(args[0], args[1:])
    try:
        config = parse_config(args)
    except ConfigError as exc:
        print("extractedprism: invalid configuration:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return 2

    setup_logging(config.log_level)
    # SIGUSR1: named stacks from the main thread. SIGUSR2: faulthandler's dump, which
    # works even when a thread holds the GIL and the main thread cannot run.
    signal.signal(signal.SIGUSR1, dump_threads)
    signal.signal(signal.SIGHUP, on_sighup)
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    _raise_fd_limit()
    # Shorter GIL slices cut the wait of a woken pipe thread under many connections.
    sys.setswitchinterval(float(os.environ.get("EP_SWITCH_INTERVAL", "0.001")))

    from extractedprism.app import App

    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()  # nothing else: the main thread does the shutdown

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    # The kernel may hand a process-directed signal to any thread that does not block
    # it; CPython then only flags it for the main thread, which sleeps in stop.wait()
    # and would not notice (seen: SIGTERM ignored with connections in flight). So every
    # other thread blocks these signals: threads inherit the mask of the thread that
    # starts them, and all of ours descend from threads started here.
    handled = {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP}
    signal.pthread_sigmask(signal.SIG_BLOCK, handled)
    app = App(config, stop=stop)
    try:
        app.start()
    except OSError as exc:
        log.critical("start-up failed error=%r", f"{exc.strerror or exc}")
        print(f"extractedprism: cannot start: {exc}", file=sys.stderr)
        app.stop()
        return 1
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, handled)
    # A bounded wait as well: a signal flagged by any other path is acted on within 1 s.
    while not stop.wait(1.0):
        pass
    log.info("signal received; shutting down")
    app.stop()
    return 0
