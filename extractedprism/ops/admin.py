"""Runtime control over a local unix socket (``--admin-socket``), and its client.

The server side is one ``admin-socket`` thread: it accepts on a unix stream socket
(mode 0600 from before it listens: only the proxy's own user, and root, can connect;
never a TCP port) and answers each connection in turn, one request per connection,
within a short deadline so a client that never writes cannot hold the socket for
long. Requests are tiny and every action is one short registry call, so serial
answering is enough and nothing piles up. The caller's uid (``SO_PEERCRED``) is
logged with every action; a caller whose uid is neither ours nor root's is refused
even if the socket's mode was loosened by hand.

Wire format: the client sends one JSON object on one line,
``{"command": "drain"|"undrain"|"close"|"list"|"rebalance", "address": "host:port",
"force": bool}`` (no address for list and rebalance),
and gets one JSON object back, ``{"code": 0|1|2, "message": str, "upstreams": [...]}``.
``code`` is the client's exit status: 0 the action was taken (a close goes on in the
background), 1 refused, 2 a bad request or an unknown address. Malformed input gets
code 2 and a message naming what is wrong; nothing a client sends can stop the thread.

State set here is kept in memory only (a restart forgets it, like HAProxy's Runtime
API). The operator actions do the work (:class:`AdminTarget`, which the app fills with
:class:`~extractedprism.upstreams.actions.AdminActions` over the registry); this module
only moves requests and answers, so it holds no upstream state of its own.

The client is ``extractedprism admin [--socket PATH] drain|undrain|close [--force]|list|
rebalance``,
dispatched from :data:`extractedprism.cli.SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import stat
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from extractedprism.errors import Error
from extractedprism.ops.unixsock import (
    UnixSocketError,
    listen_aside,
    listen_private,
    put_in_place,
    unlink_if_same,
)
from extractedprism.threads import join_until, start_daemon

log = logging.getLogger(__name__)

ENV_SOCKET = "EP_ADMIN_SOCKET"
REQUEST_TIMEOUT_S = 2.0  # a whole request must arrive within this
MAX_REQUEST_BYTES = 4096
CLIENT_TIMEOUT_S = 10.0
COMMANDS = ("drain", "undrain", "close", "list", "rebalance")

OK, REFUSED, BAD = 0, 1, 2
_UCRED = struct.Struct("3i")  # pid, uid, gid


class AdminSocketError(Error, OSError):
    """The admin socket could not be created, or answered something unusable; the message
    names the flag or what came back."""

    def __str__(self) -> str:
        return str(self.strerror or super().__str__())


class AdminTarget(Protocol):
    """The operator actions behind every command
    (:class:`~extractedprism.upstreams.actions.AdminActions`): (code, message)."""

    def drain(self, address: str, uid: int) -> tuple[int, str]: ...

    def undrain(self, address: str, uid: int) -> tuple[int, str]: ...

    def close(self, address: str, uid: int, *, force: bool) -> tuple[int, str]: ...

    def known_addresses(self) -> list[str]: ...

    def rebalance(self, uid: int) -> tuple[int, str]: ...


def normalise_address(text: str) -> str:
    """``host:port`` as the registry spells it (IPv6 in brackets); ValueError if bad."""
    # Imported here: `admin list` needs no address parsing, and the client answers faster
    # without the endpoint machinery (dataclasses, ipaddress).
    from extractedprism.config.endpoints import parse_endpoint

    return str(parse_endpoint(text.strip()))


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return pid, uid, gid


class AdminServer:
    """The admin socket and the ``admin-socket`` thread that answers on it."""

    def __init__(self, path: str, target: AdminTarget,
                 listing: Callable[[], list[dict[str, Any]]]) -> None:
        self.path = path
        self._target = target
        self._listing = listing
        self._sock: socket.socket | None = None
        self._inode: tuple[int, int] | None = None
        self._aside: str | None = None  # a successor's socket, until take_path()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # -- lifecycle (main thread) -----------------------------------------------------

    def bind(self, *, take_over: bool = False) -> None:
        """Create the socket at ``path`` with mode 0600 (unixsock.listen_private: never
        reachable with a looser mode); UnixSocketError naming the flag if not.
        ``take_over``: this instance took its listeners from a predecessor in a
        handover, so a live socket at the path is that predecessor's and is replaced
        (renamed over: the predecessor's own socket stays open, and at its stop it
        leaves the path, no longer its file, alone). Not here, though: the socket waits
        beside the path until :meth:`take_path`, which the caller calls once its start
        can no longer fail; a successor that fails before leaves the predecessor, which
        serves on, its admin socket."""
        where = f"--admin-socket {self.path}"
        self._clear_stale(where, take_over=take_over)
        if take_over:
            self._sock, self._inode, self._aside = listen_aside(self.path, "--admin-socket",
                                                                16)
        else:
            self._sock, self._inode = listen_private(self.path, "--admin-socket", 16)

    def take_path(self) -> None:
        """A successor's start is past its last failure: its socket goes to the path now,
        renamed over the predecessor's. Should that fail, this instance runs on without
        an admin socket at the path (the predecessor's, if any, stays there)."""
        aside, self._aside = self._aside, None
        if aside is None:
            return
        try:
            put_in_place(aside, self.path, "--admin-socket")
        except UnixSocketError as exc:
            # Its file is gone (put_in_place removed it): nobody can reach it; stop()
            # closes it with the rest.
            log.warning("admin socket not taken over; this instance answers on none "
                        "path=%s reason=%r", self.path, str(exc))
            return
        log.info("taking over the admin socket from the predecessor path=%s", self.path)

    def _clear_stale(self, where: str, *, take_over: bool = False) -> None:
        """A socket left by a process that died is removed; a live one is replaced only
        with ``take_over``; anything else is not ours."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise AdminSocketError(f"cannot create {where}: the path exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(self.path)
        except OSError:
            log.info("removing stale admin socket path=%s", self.path)
            os.unlink(self.path)
            return
        finally:
            probe.close()
        if take_over:
            return  # take_path() renames the new socket over it
        raise AdminSocketError(f"cannot create {where}: another process is serving on it")

    def start(self) -> None:
        if self._sock is None:
            self.bind()
        self._thread = start_daemon("admin-socket", self._serve_forever)
        log.info("admin socket listening path=%s mode=0600", self.path)

    def begin_stop(self) -> None:
        """Stop answering, at once: the thread leaves accept() now and ends after the
        request in hand, if any (at most ``REQUEST_TIMEOUT_S`` and a short linger)."""
        self._stopping.set()
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def stop(self, deadline: float | None = None) -> bool:
        """begin_stop(), then wait for the thread until ``deadline`` (``time.monotonic()``;
        by default ``REQUEST_TIMEOUT_S`` from now) and remove the socket file if it is
        still ours. True when the thread ended in time."""
        self.begin_stop()
        if deadline is None:
            deadline = time.monotonic() + REQUEST_TIMEOUT_S
        ok = join_until([self._thread], deadline)
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
            # Still aside (the start failed before take_path): the temporary file goes.
            unlink_if_same(self._aside or self.path, self._inode)
        return ok

    # -- the admin-socket thread -----------------------------------------------------

    def _serve_forever(self) -> None:
        sock = self._sock
        assert sock is not None
        while not self._stopping.is_set():
            try:
                conn, _ = sock.accept()
            except OSError as exc:
                if self._stopping.is_set():
                    break
                log.warning("admin socket accept failed error=%r", exc.strerror or str(exc))
                self._stopping.wait(0.1)
                continue
            try:
                self._answer(conn)
            except Exception:  # a bad request must never end the thread
                log.exception("admin request failed")
            finally:
                conn.close()
        log.debug("admin socket stopped")

    def _answer(self, conn: socket.socket) -> None:
        try:
            pid, uid, _gid = peer_credentials(conn)
        except OSError:
            pid, uid = -1, -1
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        try:
            raw = _read_line(conn, deadline)
        except (OSError, ValueError) as exc:
            log.info("admin request unreadable uid=%d pid=%d reason=%r", uid, pid, str(exc))
            _reply_and_linger(conn, {"code": BAD, "message": f"bad request: {exc}"})
            return
        if uid not in (0, os.geteuid()):
            reply: dict[str, Any] = {"code": REFUSED, "message":
                                     f"uid {uid} may not use this admin socket"}
            log.warning("admin request refused uid=%d pid=%d reason=%r", uid, pid,
                        "foreign uid")
        else:
            reply = self.handle(raw, uid=uid, pid=pid)
        _reply_and_linger(conn, reply)

    def handle(self, raw: bytes, *, uid: int, pid: int = -1) -> dict[str, Any]:
        """One request -> its reply; every action is logged with the caller's uid."""
        try:
            req = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            return {"code": BAD, "message": f"bad request: not a JSON object ({exc})"}
        if not isinstance(req, dict):
            return {"code": BAD, "message": "bad request: not a JSON object"}
        command = req.get("command")
        if command not in COMMANDS:
            return {"code": BAD, "message": f"unknown command {str(command)[:40]!r}; "
                                            f"expected one of {', '.join(COMMANDS)}"}
        if command == "list":
            return {"code": OK, "message": "", "upstreams": self._listing()}
        if command == "rebalance":
            code, message = self._target.rebalance(uid)
            log.info("admin request action=rebalance uid=%d pid=%d result=%s reason=%r",
                     uid, pid, {OK: "done", REFUSED: "refused"}.get(code, "failed"), message)
            return {"code": code, "message": message}
        given = req.get("address")
        if not isinstance(given, str) or not given.strip():
            return {"code": BAD, "message": f"{command} needs an upstream address (host:port)"}
        try:
            address = normalise_address(given)
        except ValueError as exc:
            return {"code": BAD, "message": f"{given[:80]!r} is not an upstream address: {exc}"}
        force = req.get("force", False)
        if not isinstance(force, bool):
            return {"code": BAD, "message": "force must be true or false"}
        known = self._target.known_addresses()
        if address not in known:
            return {"code": BAD, "message": f"unknown upstream {address}; known upstreams: "
                                            f"{', '.join(sorted(known)) or 'none'}"}
        if command == "drain":
            code, message = self._target.drain(address, uid)
        elif command == "undrain":
            code, message = self._target.undrain(address, uid)
        else:
            code, message = self._target.close(address, uid, force=force)
        result = {OK: "done", REFUSED: "refused"}.get(code, "failed")
        log.info("admin request action=%s upstream=%s uid=%d pid=%d force=%s result=%s "
                 "reason=%r",
                 command, address, uid, pid, force, result, message)
        return {"code": code, "message": message}


def _read_line(conn: socket.socket, deadline: float) -> bytes:
    buf = b""
    while b"\n" not in buf:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ValueError(f"request not complete within {REQUEST_TIMEOUT_S:g}s")
        conn.settimeout(remaining)
        try:
            chunk = conn.recv(MAX_REQUEST_BYTES + 1 - len(buf))
        except TimeoutError:
            raise ValueError(f"request not complete within {REQUEST_TIMEOUT_S:g}s") from None
        if not chunk:
            if buf:
                break  # no newline, but the client closed its side: take what came
            raise ValueError("empty request")
        buf += chunk
        if len(buf) > MAX_REQUEST_BYTES:
            raise ValueError(f"request longer than {MAX_REQUEST_BYTES} bytes")
    return buf.split(b"\n", 1)[0]


def _reply_and_linger(conn: socket.socket, reply: dict[str, Any]) -> None:
    """Send the answer, then read what the client still sends (briefly) before the
    caller closes: closing with unread bytes would reset the connection and could
    destroy the answer before the client reads it."""
    conn.settimeout(0.5)
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps(reply).encode() + b"\n")
        conn.shutdown(socket.SHUT_WR)
        for _ in range(16):
            if not conn.recv(65536):
                break


# -- the client: `extractedprism admin ...` ---------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # Exit 2 as argparse does, but one line: what is wrong and where help is.
        print(f"{self.prog}: {message}; see '{self.prog} --help'", file=sys.stderr)
        raise SystemExit(BAD)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="extractedprism admin",
        description="Runtime control of a running extractedprism through its admin socket "
        "(--admin-socket). Changes are kept in memory only: a restart forgets them.",
        epilog="Exit status: 0 the action was taken, 1 it was refused, 2 a usage error, an "
        "unknown address or an unreachable socket.",
    )
    parser.add_argument("--socket", metavar="PATH", default=None,
                        help=f"the proxy's admin socket (default: ${ENV_SOCKET})")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    p = sub.add_parser("drain", help="send no new connections to ADDR; existing ones stay")
    p.add_argument("address", metavar="ADDR", help="upstream host:port")
    drain = p
    p = sub.add_parser("undrain", help="put ADDR back in service (it takes connections "
                                       "again once it is healthy)")
    p.add_argument("address", metavar="ADDR", help="upstream host:port")
    undrain = p
    p = sub.add_parser("close", help="stop new connections to ADDR and close its existing "
                                     "ones spread over --drain-timeout")
    p.add_argument("--force", action="store_true",
                   help="close even when no other ready (readyz) / healthy (tcp) upstream "
                        "would be left")
    p.add_argument("address", metavar="ADDR", help="upstream host:port")
    close = p
    listing = sub.add_parser("list", help="show every upstream with its state and admin "
                                          "action")
    rebalance = sub.add_parser("rebalance", help="run one rebalance round now (the rules of "
                                                 "--rebalance-interval: at most one quiet "
                                                 "connection of an overloaded upstream is "
                                                 "closed)")
    for p in (drain, undrain, close, listing, rebalance):
        # Also after the command (`admin drain --socket PATH ADDR`); SUPPRESS keeps the
        # value given before the command when this one is absent.
        p.add_argument("--socket", metavar="PATH", default=argparse.SUPPRESS,
                       help=f"the proxy's admin socket (default: ${ENV_SOCKET})")
    return parser


def request(path: str, payload: dict[str, Any], timeout: float = CLIENT_TIMEOUT_S
            ) -> dict[str, Any]:
    """Send one request to the admin socket at ``path``; OSError if unreachable."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(json.dumps(payload).encode() + b"\n")
        buf = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            buf += chunk
    try:
        reply = json.loads(buf.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise AdminSocketError(f"the admin socket answered something that is not JSON: {buf[:80]!r}"
                      ) from None
    if not isinstance(reply, dict) or not isinstance(reply.get("code"), int):
        raise AdminSocketError("the admin socket answered an object without a code")
    return reply


def format_listing(rows: list[dict[str, Any]]) -> str:
    """One line per upstream: address, state, health, readiness, connections, admin."""
    header = ("ADDRESS", "STATE", "HEALTHY", "READY", "ACTIVE", "ADMIN")
    table = [header]
    for r in rows:
        admin = r.get("admin") or {}
        action = f"{admin['action']} by uid {admin['uid']} at {admin['at']}" if admin else "-"
        ready = r.get("ready")
        table.append((
            str(r.get("address", "?")), str(r.get("state", "?")),
            "yes" if r.get("healthy") else "no",
            "-" if ready is None else ("yes" if ready else "no"),
            str(r.get("active_connections", 0)), action,
        ))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in table)


def main(argv: Sequence[str] | None = None) -> int:
    """``extractedprism admin ...``: 0 taken, 1 refused, 2 usage / address / socket."""
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[2:] if argv is None else argv))
    except SystemExit as exc:
        return int(exc.code) if isinstance(exc.code, int) else BAD
    if args.command is None:
        parser.print_usage(sys.stderr)
        print("extractedprism admin: give a command: drain, undrain, close, list or "
              "rebalance",
              file=sys.stderr)
        return BAD
    path = args.socket if args.socket is not None else os.environ.get(ENV_SOCKET, "")
    if not path.strip():
        print(f"extractedprism admin: no admin socket: pass --socket PATH or set {ENV_SOCKET} "
              "(the proxy's --admin-socket)", file=sys.stderr)
        return BAD
    payload: dict[str, Any] = {"command": args.command}
    if args.command not in ("list", "rebalance"):
        try:
            payload["address"] = normalise_address(args.address)
        except ValueError as exc:
            print(f"extractedprism admin: {args.address!r} is not an upstream address "
                  f"(host:port): {exc}", file=sys.stderr)
            return BAD
        payload["force"] = bool(getattr(args, "force", False))
    try:
        reply = request(path, payload)
    except OSError as exc:
        print(f"extractedprism admin: cannot reach the admin socket {path} (--socket / "
              f"{ENV_SOCKET}): {exc.strerror or exc}", file=sys.stderr)
        return BAD
    code = reply["code"] if reply["code"] in (OK, REFUSED, BAD) else BAD
    message = str(reply.get("message", ""))
    if args.command == "list" and code == OK:
        print(format_listing(list(reply.get("upstreams") or [])))
    elif code == OK:
        print(message or f"{args.command} {payload.get('address', '')}: done")
    else:
        print(f"extractedprism admin: {message}", file=sys.stderr)
    return code
