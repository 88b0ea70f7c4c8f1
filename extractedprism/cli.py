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
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import importlib
import logging
import os
import resource
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import configargparse

from extractedprism import __version__
from extractedprism.config.table import FLAGS, Config, ConfigError, Flag, validate
from extractedprism.errors import ListenError
from extractedprism.logs.logfmt import FATAL
from extractedprism.logs.setup import setup_logging, shutdown_logging
from extractedprism.logs.threaddump import grouped_dump

if TYPE_CHECKING:
    from extractedprism.datapath.relay import Relay

log = logging.getLogger("extractedprism")

# `extractedprism NAME args...` -> "module:function", called with args; returns the exit
# status. Each subcommand's code lives in its own module, imported only when run.
SUBCOMMANDS: dict[str, str] = {
    "status": "extractedprism.ops.status:main",
    "admin": "extractedprism.ops.admin:main",
    "static-pod": "extractedprism.ops.staticpod:main",
}

def flag_help(flag: Flag) -> str:
    """A flag's help text and rules, with its default said once (or that it is required)."""
    text = "; ".join((flag.help, *flag.rules))
    if flag.required:
        text += " (required)"
    elif "(default:" in text:
        pass  # the text says what unset means
    elif flag.default is None or flag.default == "":
        text += " (default: unset)"
    else:
        text += f" (default: {flag.default})"
    return text.replace("%", "%%")


# validate() enforces these (naming the flag, with every other problem); help shows them.
_REQUIRED = {f.dest for f in FLAGS if f.required}


class _HelpFormatter(argparse.HelpFormatter):
    """The usage line shows required flags outside brackets.

    They are not argparse-required: validate() reports a missing one together with every
    other problem, and the value may come from the environment.
    """

    def add_usage(self, usage: str | None, actions: object, groups: object,
                  prefix: str | None = None) -> None:
        shown = []
        for action in actions:  # type: ignore[attr-defined]
            if action.dest in _REQUIRED:
                action = copy.copy(action)
                action.required = True
            shown.append(action)
        super().add_usage(usage, shown, groups, prefix)  # type: ignore[arg-type]


def build_parser() -> configargparse.ArgumentParser:
    parser = configargparse.ArgumentParser(
        prog="extractedprism",
        description="Per-node TCP load balancer for Kubernetes API server high availability. "
        "Every flag can also be set through its EP_ environment variable. "
        f"Subcommands: {', '.join(f'extractedprism {n} --help' for n in SUBCOMMANDS)}.",
        formatter_class=_HelpFormatter,
    )
    required = parser.add_argument_group("required")
    # Shown first, before the "options" group argparse made (with --help in it).
    parser._action_groups.insert(0, parser._action_groups.pop())
    for flag in FLAGS:
        kwargs: dict[str, object] = {
            "env_var": flag.env,
            "dest": flag.dest,
            "default": None,
            "help": flag_help(flag),
            "metavar": flag.kind.upper() if flag.kind != "choice" else "{" + ",".join(
                flag.choices) + "}",
        }
        if flag.kind == "bool":
            # `--enable-discovery` alone means true; `--enable-discovery=false` works too.
            kwargs.update(nargs="?", const="true")
        group = required if flag.required else parser
        group.add_argument(flag.option, **kwargs)  # type: ignore[arg-type]
    parser.add_argument("--version", action="version", version=f"extractedprism {__version__}")
    return parser


def _edits(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions)."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


MAX_SUGGEST_EDITS = 3


def unknown_env_vars(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """Every ``EP_`` variable that no flag reads, with the closest real one (or None)."""
    known = [f.env for f in FLAGS]
    out = []
    for name in sorted(environ):
        if not name.startswith("EP_") or name in known:
            continue
        dist, best = min((_edits(name, k), k) for k in known)
        out.append((name, best if dist <= MAX_SUGGEST_EDITS else None))
    return out


def warn_unknown_env_vars(environ: Mapping[str, str]) -> None:
    for name, closest in unknown_env_vars(environ):
        if closest:
            log.warning("unknown environment variable ignored; did you mean %s? "
                        "variable=%s closest=%s", closest, name, closest)
        else:
            log.warning("unknown environment variable ignored variable=%s", name)


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


def dump_threads(_signum: int = 0, _frame: object = None) -> None:
    """Log every thread's stack (SIGUSR1), identical stacks grouped, as one record."""
    text, threads, groups = grouped_dump()
    # Asked for explicitly, so shown whatever --log-level says (handle() skips the
    # level check, not the handlers).
    record = log.makeRecord(log.name, logging.WARNING, __file__, 0,
                            "thread dump threads=%d stacks=%d", (threads, groups), None,
                            extra={"dump": text})
    log.handle(record)


def run_subcommand(name: str, args: Sequence[str]) -> int:
    module, _, func = SUBCOMMANDS[name].partition(":")
    return int(getattr(importlib.import_module(module), func)(list(args)))


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

    from extractedprism.datapath.relay import RelayUnavailable, resolve

    try:
        relay = resolve(config.relay)  # once, before anything starts; App hands it on
    except RelayUnavailable as exc:
        print("extractedprism: invalid configuration:", file=sys.stderr)
        print(f"  --relay ({config.relay}): {exc}", file=sys.stderr)
        return 2

    setup_logging(config.log_level, fmt=config.log_format, background=True, capture=True)
    try:
        return _run(config, relay)
    finally:
        shutdown_logging()


def _run(config: Config, relay: Relay) -> int:
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
    except OSError as exc:
        log.log(FATAL, "cannot start error=%s", exc.strerror or exc)
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
