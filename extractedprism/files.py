"""Files read at run time, read again when they change (CA bundles, client certificates
and keys, tokens, a kubeconfig): the rule, in one place.

:class:`Reloaded` holds a value made from files (an ``ssl.SSLContext``, a token, a
parsed kubeconfig) and the state of every file it was made from: its identity (device,
inode, size, mtime, ctime, taken by ``stat`` just before the read) and a digest of its
content. :meth:`Reloaded.get` reads those files again (a few KiB each: the discovery
watcher does so once per request) and makes the value again when any of them differs,
is gone, or was never read. That catches every way a file is rotated: rewritten in
place (also within one timestamp tick and at the same size: the content differs),
replaced by a rename (inode), and the kubelet's atomic writer, which swaps a ``..data``
symlink (``stat`` follows it: a new inode). A file that changes between its stat and
its read is seen changed on the next ``get``, never missed. :func:`fingerprint` is the
same comparison for a caller that keeps its own made thing (the readyz probe's kept
TLS connection: replaced when the fingerprint of its CA and credentials changes).

Only regular files are opened, so a FIFO or a device named by mistake cannot block the
caller (an ``open`` of a FIFO waits for a writer). A problem is a :class:`FileProblem`
whose text names what the file is for and its path, and the caller keeps no half-made
value: the next ``get`` tries again.

Not thread-safe: each user (the discovery watcher; a probe's settings) owns its own.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable, Iterable
from typing import Generic, NamedTuple, TypeVar

from extractedprism.errors import Error, one_line

T = TypeVar("T")

# Nothing the product reads at run time (PEM bundles, tokens, kubeconfigs) comes near
# this; a bigger file is the wrong file.
MAX_BYTES = 16 * 1024 * 1024


class FileProblem(Error):
    """A file read at run time is missing, not a regular file, unreadable or too big."""


def bearer_token(raw: bytes) -> str:
    """A bearer token from a token file's (or a kubeconfig field's) bytes: the one rule
    for the readyz probe and discovery. ValueError with a short reason ("empty", "not
    UTF-8 text", "more than one line", "contains a non-ASCII character", "contains a
    control character") that the caller puts after what the token is for and where."""
    try:
        # Surrounding whitespace is trimmed like client-go does (strings.TrimSpace).
        token = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    if not token:
        raise ValueError("empty")
    # The token goes into a header: a line break would inject headers, and anything
    # else outside printable ASCII (a tab is allowed in a header value) would be mangled
    # on the wire or rejected by the server, either way an authentication failure that
    # the reason could not explain.
    if "\r" in token or "\n" in token:
        raise ValueError("more than one line")
    if any(not (" " <= ch <= "~" or ch == "\t") for ch in token):
        raise ValueError("contains a non-ASCII character" if any(ord(ch) > 0x7F for ch in token)
                         else "contains a control character")
    return token


class Identity(NamedTuple):
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int


def identity(path: str, what: str) -> Identity:
    """The file's identity; raises :class:`FileProblem` unless it is a regular file."""
    if "\0" in path:  # os.stat() would raise ValueError, not naming the file
        raise FileProblem(f"{what} unusable: {one_line(path)}: the path contains a NUL "
                          "byte")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileProblem(f"{what} missing: {path}") from None
    except OSError as exc:
        raise FileProblem(f"{what} unreadable: {path}: {exc.strerror or exc}") from None
    if stat.S_ISDIR(st.st_mode):
        raise FileProblem(f"{what} unusable: {path}: is a directory")
    if not stat.S_ISREG(st.st_mode):
        raise FileProblem(f"{what} unusable: {path}: not a regular file")
    return Identity(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _read(path: str, what: str, limit: int) -> tuple[tuple[Identity, bytes], bytes]:
    """((identity, content digest), content) of a regular file, at most ``limit`` bytes."""
    ident = identity(path, what)
    try:
        with open(path, "rb") as fh:
            data = fh.read(limit + 1)
    except FileNotFoundError:
        raise FileProblem(f"{what} missing: {path}") from None
    except OSError as exc:
        raise FileProblem(f"{what} unreadable: {path}: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise FileProblem(f"{what} unusable: {path}: larger than {limit // 1024} KiB")
    return (ident, hashlib.sha256(data).digest()), data


def fingerprint(files: Iterable[tuple[str, str]]) -> bytes:
    """A digest of the files ``(path, what)`` as they are now (identity and content):
    equal fingerprints, unchanged files. Raises :class:`FileProblem` naming the first
    file that is missing or unusable."""
    h = hashlib.sha256()
    for path, what in files:
        (ident, digest), _ = _read(path, what, MAX_BYTES)
        h.update(f"{path}\0{tuple(ident)}\0".encode())
        h.update(digest)
    return h.digest()


class Reads:
    """What one making of a value read: hands out the files' contents (or checked
    paths, for APIs that take a path) and remembers each file's state."""

    def __init__(self) -> None:
        self.seen: dict[str, tuple[Identity, bytes]] = {}

    def path(self, path: str, what: str) -> str:
        """``path`` checked and remembered, for a loader that opens it itself."""
        self.seen[path], _ = _read(path, what, MAX_BYTES)
        return path

    def read(self, path: str, what: str, limit: int = MAX_BYTES) -> bytes:
        self.seen[path], data = _read(path, what, limit)
        return data


class Reloaded(Generic[T]):
    """A value made by ``make(reads)`` from files, made again when one of them changes.

    ``generation`` counts the makings, so a holder of something built on the value (a
    kept-alive connection that presented the old client certificate) can tell it is
    stale.
    """

    def __init__(self, make: Callable[[Reads], T]) -> None:
        self._make = make
        self._value: T | None = None
        self._seen: dict[str, tuple[Identity, bytes]] = {}
        self.generation = 0

    def changed(self) -> bool:
        if self._value is None:
            return True
        for path, was in self._seen.items():
            try:
                if _read(path, "file", MAX_BYTES)[0] != was:
                    return True
            except FileProblem:
                return True
        return False

    def get(self) -> T:
        """The value, made again first when a file changed; raises what ``make`` raises
        (a :class:`FileProblem` names the file), keeping nothing of a failed making."""
        if not self.changed():
            assert self._value is not None
            return self._value
        reads = Reads()
        value = self._make(reads)
        self._value, self._seen = value, reads.seen
        self.generation += 1
        return value
