"""A listening unix socket only its owner can reach, put in place atomically.

Shared by the admin socket (``--admin-socket``) and the handover offer
(``--handover-socket``). The socket is bound under a temporary name beside the path,
restricted to 0600, set listening, and only then renamed to the path: there is no moment
at which it is reachable with a looser mode, and no process-wide umask change (which
would race every other thread that creates a file meanwhile). The rename also replaces a
predecessor's socket file in one step, so a client never finds the path missing.
"""

from __future__ import annotations

import os
import socket
import stat

from extractedprism.errors import Error

SUN_PATH_MAX = 107  # bytes in sockaddr_un.sun_path, less the terminating NUL


class UnixSocketError(Error, OSError):
    """A private unix socket could not be created; the message names the flag and path."""

    def __str__(self) -> str:
        return str(self.strerror or super().__str__())


def listen_private(path: str, flag: str, backlog: int) -> tuple[socket.socket, tuple[int, int]]:
    """A listening socket at ``path`` with mode 0600, and the (st_dev, st_ino) of its
    file (to tell later whether the path is still this socket). Whatever is at ``path``
    is replaced: the caller decides beforehand whether it may be. Raises
    UnixSocketError naming ``flag`` and the path."""
    sock, ident, tmp = listen_aside(path, flag, backlog)
    try:
        put_in_place(tmp, path, flag)
    except UnixSocketError:
        sock.close()
        raise
    return sock, ident


def listen_aside(path: str, flag: str, backlog: int
                 ) -> tuple[socket.socket, tuple[int, int], str]:
    """Like :func:`listen_private`, but left under its temporary name beside ``path``
    (returned third) until :func:`put_in_place` moves it there: for a caller that may
    replace what is at ``path`` only once nothing can fail any more."""
    where = f"{flag} {path}"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UnixSocketError(f"cannot create {where}: directory {parent} does not exist")
    if len(os.fsencode(path)) > SUN_PATH_MAX:
        raise UnixSocketError(f"cannot create {where}: the path is too long for a unix "
                              f"socket ({len(os.fsencode(path))} bytes, at most "
                              f"{SUN_PATH_MAX})")
    tmp = _temporary_name(parent, os.path.basename(path), where)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(tmp)
        os.chmod(tmp, 0o600)
        sock.listen(backlog)
        st = os.lstat(tmp)
    except OSError as exc:
        sock.close()
        _unlink_quietly(tmp)
        raise UnixSocketError(exc.errno, f"cannot create {where}: {exc.strerror or exc}"
                              ) from exc
    return sock, (st.st_dev, st.st_ino), tmp


def put_in_place(tmp: str, path: str, flag: str) -> None:
    """Rename the socket :func:`listen_aside` made at ``tmp`` to ``path``, replacing
    what is there in one step; on failure ``tmp`` is removed and UnixSocketError says
    why (the socket itself is the caller's to close)."""
    try:
        os.rename(tmp, path)
    except OSError as exc:
        _unlink_quietly(tmp)
        raise UnixSocketError(exc.errno, f"cannot create {flag} {path}: "
                              f"{exc.strerror or exc}") from exc


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def unlink_if_same(path: str, ident: tuple[int, int] | None) -> None:
    """Remove ``path`` if it is still the file ``ident`` names: a successor may have
    renamed its own socket over it, which is left alone."""
    if ident is None:
        return
    try:
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) == ident:
            os.unlink(path)
    except OSError:
        pass  # gone already, or not ours to remove


def _temporary_name(parent: str, base: str, where: str) -> str:
    """A free name beside the socket to bind under, no longer than a unix socket's path
    allows; a leftover socket of this pid (a killed start) is removed, nothing else."""
    pid = os.getpid()
    for name in (f".{base}.{pid}.tmp", f".ep{pid}", f".ep{pid}x"):
        tmp = os.path.join(parent, name)
        if len(os.fsencode(tmp)) > SUN_PATH_MAX:
            continue
        try:
            st = os.lstat(tmp)
        except FileNotFoundError:
            return tmp
        if stat.S_ISSOCK(st.st_mode):
            os.unlink(tmp)
            return tmp
    raise UnixSocketError(f"cannot create {where}: no free temporary name beside it (or the "
                          f"path is too long for a unix socket, {SUN_PATH_MAX} bytes)")
