"""Command line: flags and EP_ env vars -> validate -> logging -> App -> wait for a signal.

Runs on the main thread. Signal handlers only set the stop Event; the main thread then
runs the ordered shutdown. SIGHUP is logged and ignored: configuration is read once at
start, and a hang-up must not take every connection of the node down. SIGUSR1 logs
every thread's stack, identical stacks grouped, as one record (for images without
py-spy). Invalid configuration exits with status 2
before any port is opened, listing every problem in plain text; everything after the
logging set-up is a log line in the chosen format. A listener that cannot be opened
exits 1 naming its flags and address. ``extractedprism NAME ...`` runs the subcommand
NAME from :data:`SUBCOMMANDS` instead of the proxy.

Imports are made where they are needed: a subcommand (``status``, ``admin``: typed by
people, run in loops by scripts) loads its own module and nothing of the proxy's (no
flag machinery, no logging set-up, no server), so it answers in tens of milliseconds.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from extractedprism import heap
from extractedprism.errors import Error

if TYPE_CHECKING:
    import logging

    from extractedprism.config.table import Config
    from extractedprism.datapath.relay import Relay


def _log() -> logging.Logger:
    """The CLI's logger; ``logging`` is imported by the proxy's path only."""
    import logging

    return logging.getLogger("extractedprism")


# `extractedprism NAME args...` -> "module:function", called with args; returns the exit
# status. Each subcommand's code lives in its own module, imported only when run.
SUBCOMMANDS: dict[str, str] = {
    "status": "extractedprism.ops.status:main",
    "admin": "extractedprism.ops.admin:main",
    "static-pod": "extractedprism.ops.staticpod:main",
    "profile": "extractedprism.ops.profile:main",
}


def warn_unknown_env_vars(environ: Mapping[str, str]) -> None:
    from extractedprism.config.parser import unknown_env_vars

    log = _log()
    for name, closest in unknown_env_vars(environ):
        if closest:
            log.warning("unknown environment variable ignored; did you mean %s? "
                        "variable=%s closest=%s", closest, name, closest)
        else:
            log.warning("unknown environment variable ignored variable=%s", name)


def _raise_fd_limit() -> None:
    import resource

    # Each connection needs two sockets (plus a reusable kernel pipe pair per pipe
    # thread); the soft limit is often 1024 while the hard limit is far higher.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else 1 << 20
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass


def dump_threads(_signum: int = 0, _frame: object = None) -> None:
    """Log every thread's stack (SIGUSR1), identical stacks grouped, as one record."""
    import logging

    from extractedprism.logs.threaddump import grouped_dump

    log = _log()
    text, threads, groups = grouped_dump()
    # Asked for explicitly, so shown whatever --log-level says (handle() skips the
    # level check, not the handlers).
    record = log.makeRecord(log.name, logging.WARNING, __file__, 0,
                            "thread dump threads=%d stacks=%d", (threads, groups), None,
                            extra={"dump": text})
    log.handle(record)


def run_subcommand(name: str, args: Sequence[str]) -> int:
    """Run one subcommand; an :class:`~extractedprism.errors.Error` it lets out becomes
    one line on stderr and its exit status."""
    module, _, func = SUBCOMMANDS[name].partition(":")
    try:
        return int(getattr(importlib.import_module(module), func)(list(args)))
    except Error as exc:
        print(f"extractedprism {name}: {exc}", file=sys.stderr)
        return exc.exit_status


SIGHUP_MESSAGE = "SIGHUP: configuration is read at start; restart to apply changes"


def on_sighup(_signum: int = 0, _frame: object = None) -> None:
    """One line per SIGHUP received, then carry on (the default action would exit)."""
    _log().warning(SIGHUP_MESSAGE)


HELP_POINTER = "see 'extractedprism --help'"


def unknown_subcommand(name: str) -> str:
    """One line: the word is not a subcommand; the real ones, the closest first."""
    from extractedprism.config.parser import MAX_SUGGEST_EDITS, _edits

    dist, best = min((_edits(name, n), n) for n in SUBCOMMANDS)
    hint = f" (did you mean {best}?)" if dist <= MAX_SUGGEST_EDITS else ""
    return (f"unknown subcommand {name!r}{hint}; the subcommands are "
            f"{', '.join(SUBCOMMANDS)}, and the proxy itself takes only flags: {HELP_POINTER}")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in SUBCOMMANDS:
        return run_subcommand(args[0], args[1:])
    if args and not args[0].startswith("-"):
        print(f"extractedprism: {unknown_subcommand(args[0])}", file=sys.stderr)
        return 2
    # The proxy: from here on the flag machinery, logging and the server. The malloc
    # arenas are capped before any thread starts (heap.py).
    heap.limit_arenas()
    from extractedprism.config.parser import UsageError, parse
    from extractedprism.config.table import ConfigError
    from extractedprism.logs.setup import setup_logging, shutdown_logging

    try:
        parsed = parse(args, tuple(SUBCOMMANDS))
    except UsageError as exc:
        print(f"extractedprism: {exc}", file=sys.stderr)  # it says where help is
        return exc.exit_status
    except ConfigError as exc:
        print("extractedprism: invalid configuration:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return 2
    config = parsed.config

    from extractedprism.datapath.relay import RelayUnavailable, resolve

    try:
        relay = resolve(config.relay)  # once, before anything starts; App hands it on
    except RelayUnavailable as exc:
        print("extractedprism: invalid configuration:", file=sys.stderr)
        print(f"  --relay ({config.relay}): {exc}", file=sys.stderr)
        return 2

    setup_logging(config.log_level, fmt=config.log_format, background=True, capture=True)
    for warning in parsed.warnings:  # a setting never read, a combination that misleads
        _log().warning("%s", warning)
    try:
        return _run(config, relay)
    finally:
        shutdown_logging()


def _run(config: Config, relay: Relay) -> int:
    import faulthandler
    import os
    import signal
    import threading

    from extractedprism.errors import ListenError
    from extractedprism.logs.logfmt import FATAL

    log = _log()
    warn_unknown_env_vars(os.environ)
    # SIGUSR1: named stacks from the main thread. SIGUSR2: faulthandler's dump, which
    # works even when a thread holds the GIL and the main thread cannot run.
    signal.signal(signal.SIGUSR1, dump_threads)
    signal.signal(signal.SIGHUP, on_sighup)
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    _raise_fd_limit()
    # Shorter GIL slices cut the wait of a woken pipe thread under many connections
    # (measured: 0.2-5 ms are all within the noise; docs/performance.md).
    sys.setswitchinterval(0.001)

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
    app = App(config, stop=stop, relay=relay)
    try:
        app.start()
    except ListenError as exc:
        log.log(FATAL, "%s", exc, extra={"address": exc.address, "flags": exc.flags,
                                         "error": exc.reason})
        app.stop()
        return 1
    except Error as exc:
        log.log(FATAL, "cannot start error=%s", exc)
        app.stop()
        return exc.exit_status
    except OSError as exc:
        log.log(FATAL, "cannot start error=%s", exc.strerror or exc)
        app.stop()
        return 1
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, handled)
    # The start-up's freed heap back to the kernel (heap.py): ~1 MiB on every node.
    heap.trim()
    # A bounded wait as well: a signal flagged by any other path is acted on within 1 s.
    while not stop.wait(1.0):
        pass
    log.info("signal received; shutting down")
    app.stop()
    return 0
