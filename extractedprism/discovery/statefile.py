"""State file: the endpoints discovery last found, kept across restarts (``--state-file``).

Format: ``{"version": 1, "endpoints": ["host:port", ...], "written": "<RFC 3339>"}``.
Written whenever discovery produces a changed, non-empty list, atomically (a temporary
file in the same directory, made exclusively under a random name so a symlink planted in
a shared directory is never followed; fsync, rename over the old one, fsync of the
directory), so a crash or power loss leaves either the old file or the new one, never
half of one.
Read once at start as the provider ``cache``: a node whose static endpoints were all
replaced still reaches the API server, and the cache is dropped as soon as discovery
produces its first list (a stale file can never keep a node on old servers).

Reading never fails the start: a missing file is the first start (silent); anything
else that is not this format (not JSON, another shape, unreadable, a directory) is
"corrupt or foreign": one warning naming the path and the reason, then a start without
it. Writes happen on their own thread (``state-file-writer``), never under a lock and
never on the watcher thread, so a slow disk delays only the file.
"""

from __future__ import annotations

import datetime
import errno
import json
import logging
import os
import secrets
import threading
from collections.abc import Callable, Sequence

from extractedprism.config.endpoints import Endpoint, parse_endpoint
from extractedprism.errors import Error

log = logging.getLogger(__name__)

VERSION = 1
MAX_BYTES = 1 << 20  # a list of API servers is a few hundred bytes


class StateFileError(Error, ValueError):
    """The file is not a state file of this version; the message says why."""


class StateWriteError(Error, OSError):
    """The state file could not be written safely; the message says why."""

    def __str__(self) -> str:
        return str(self.strerror or super().__str__())


def encode(endpoints: Sequence[Endpoint], now: datetime.datetime) -> bytes:
    doc = {"version": VERSION, "endpoints": [str(e) for e in endpoints],
           "written": now.astimezone(datetime.UTC).isoformat(timespec="seconds")
           .replace("+00:00", "Z")}
    return (json.dumps(doc, indent=2) + "\n").encode()


def decode(data: bytes) -> list[Endpoint]:
    """The endpoints of a state file; raises StateFileError saying what is wrong."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise StateFileError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise StateFileError("not a JSON object")
    if doc.get("version") != VERSION:
        raise StateFileError(f"version is {doc.get('version')!r}, expected {VERSION}")
    raw = doc.get("endpoints")
    if not isinstance(raw, list) or not raw:
        raise StateFileError("'endpoints' is not a non-empty list")
    written = doc.get("written")
    if not isinstance(written, str):
        raise StateFileError("'written' is not an RFC 3339 time")
    try:
        datetime.datetime.fromisoformat(written.replace("Z", "+00:00"))
    except ValueError:
        raise StateFileError(f"'written' ({written[:40]!r}) is not an RFC 3339 time") from None
    out: list[Endpoint] = []
    for item in raw:
        if not isinstance(item, str):
            raise StateFileError(f"endpoint {item!r} is not a string")
        try:
            out.append(parse_endpoint(item))
        except ValueError as exc:
            raise StateFileError(f"endpoint {item[:80]!r}: {exc}") from None
    return out


def read(path: str) -> list[Endpoint] | None:
    """The cached endpoints, or None (missing: silently; unusable: one warning)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        _ignored(path, "is a directory")
        return None
    except OSError as exc:
        _ignored(path, f"unreadable: {exc.strerror or exc}")
        return None
    if len(data) > MAX_BYTES:
        _ignored(path, f"larger than {MAX_BYTES} bytes")
        return None
    try:
        endpoints = decode(data)
    except StateFileError as exc:
        _ignored(path, str(exc))
        return None
    log.info("state file read path=%s endpoints=%s", path, ",".join(map(str, endpoints)))
    return endpoints


def _ignored(path: str, reason: str) -> None:
    log.warning("state file ignored: corrupt or foreign path=%s reason=%r", path, reason)


def write(path: str, endpoints: Sequence[Endpoint],
          now: Callable[[], datetime.datetime] | None = None) -> None:
    """Replace ``path`` atomically with ``endpoints``; raises OSError."""
    stamp = (now or _utcnow)()
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = _create_temporary(directory, os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(encode(endpoints, stamp))
            fh.flush()
            os.fsync(fh.fileno())
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    # The rename itself is durable only once the directory is.
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


TEMP_ATTEMPTS = 8


def _create_temporary(directory: str, base: str) -> tuple[int, str]:
    """A new file beside the state file, (fd, path), that nobody else made.

    The directory may be writable by another user (a shared /var/lib): a predictable
    name followed through a symlink planted there would truncate and overwrite whatever
    it points at, and the rename would then install the symlink as the state file. So
    the name is random and the file is created exclusively (O_EXCL, O_NOFOLLOW): a
    name someone took is never opened, only skipped."""
    for _ in range(TEMP_ATTEMPTS):
        tmp = os.path.join(directory, f".{base}.{_random_suffix()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            continue
        return fd, tmp
    raise StateWriteError(errno.EEXIST, f"no free temporary name in {directory} after "
                          f"{TEMP_ATTEMPTS} attempts")


def _random_suffix() -> str:
    return secrets.token_hex(8)


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class StateWriter:
    """Writes the latest list handed to :meth:`save` on a ``state-file-writer`` thread;
    lists saved while a write runs are coalesced (only the newest is written).

    The thread runs only while there is something to write: :meth:`save` starts it, and
    it ends once no list is pending. Discovery's list changes a few times a year, so a
    thread parked for ever in between would cost every node a thread for nothing."""

    def __init__(self, path: str, stop: threading.Event) -> None:
        self._path = path
        self._stop = stop
        self._cond = threading.Condition()
        self._pending: list[Endpoint] | None = None
        self._written: list[Endpoint] | None = None
        self._failing = ""
        self._thread: threading.Thread | None = None  # the running writer, under _cond
        self.writes = 0

    def start(self, current: Sequence[Endpoint] | None = None) -> None:
        """``current``: what the file holds now (read at start), so an unchanged first
        discovery list is not written again."""
        self._written = list(current) if current else None

    def save(self, endpoints: Sequence[Endpoint]) -> None:
        """Queue ``endpoints`` for writing if non-empty and changed; never blocks on I/O."""
        if not endpoints:
            return
        with self._cond:
            if self._stop.is_set():
                return
            self._pending = list(endpoints)
            if self._thread is None:
                self._thread = threading.Thread(name="state-file-writer", target=self._loop,
                                                daemon=True)
                self._thread.start()

    def join(self, timeout: float) -> bool:
        with self._cond:
            thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        if thread.is_alive():
            log.warning("thread outlived its shutdown deadline; abandoned "
                        "thread=state-file-writer")
            return False
        return True

    def _loop(self) -> None:
        while True:
            with self._cond:
                pending, self._pending = self._pending, None
                if pending is None:
                    self._thread = None  # the next save() starts a new writer
                    return
            if pending != self._written:
                self._write(pending)

    def _write(self, endpoints: list[Endpoint]) -> None:
        try:
            write(self._path, endpoints)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            if reason != self._failing:  # once per distinct failure, not per update
                log.warning("state file not written path=%s reason=%r", self._path, reason)
            self._failing = reason
            return
        if self._failing:
            log.info("state file written again path=%s", self._path)
            self._failing = ""
        self._written = endpoints
        self.writes += 1
        log.debug("state file written path=%s endpoints=%s", self._path,
                  ",".join(map(str, endpoints)))
