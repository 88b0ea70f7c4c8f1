"""Files read at run time, read again when they change (CA bundles, client certificates
and keys, tokens, a kubeconfig): the rule, in one place.

:class:`Reloaded` holds a value made from files (an ``ssl.SSLContext``, a token, a
parsed kubeconfig) and the identity of every file it was made from: device, inode,
size, mtime and ctime, taken by ``stat`` just before each read. :meth:`Reloaded.get`
stats those files again (a few microseconds each, no read) and makes the value again
when any of them differs, is gone, or was never read. That catches every way a file is
rotated: rewritten in place (size, mtime, ctime), replaced by a rename (inode), and the
kubelet's atomic writer, which swaps a ``..data`` symlink (``stat`` follows it: a new
inode). A file that changes between its stat and its read is seen changed on the next
``get``, never missed.

Only regular files are opened, so a FIFO or a device named by mistake cannot block the
caller (an ``open`` of a FIFO waits for a writer). A problem is a :class:`FileProblem`
whose text names what the file is for and its path, and the caller keeps no half-made
value: the next ``get`` tries again.

Not thread-safe: each user (the discovery watcher; a probe's settings) owns its own.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from typing import Generic, NamedTuple, TypeVar

from extractedprism.errors import Error

T = TypeVar("T")

# Nothing the product reads at run time (PEM bundles, tokens, kubeconfigs) comes near
# this; a bigger file is the wrong file.
MAX_BYTES = 16 * 1024 * 1024


class FileProblem(Error):
    """A file read at run time is missing, not a regular file, unreadable or too big."""


class Identity(NamedTuple):
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int


def identity(path: str, what: str) -> Identity:
    """The file's identity; raises :class:`FileProblem` unless it is a regular file."""
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


class Reads:
    """What one making of a value read: hands out the files' contents (or checked
    paths, for APIs that take a path) and remembers each file's identity."""

    def __init__(self) -> None:
        self.seen: dict[str, Identity] = {}

    def path(self, path: str, what: str) -> str:
        """``path`` checked and remembered, for a loader that opens it itself."""
        self.seen[path] = identity(path, what)
        return path

    def read(self, path: str, what: str, limit: int = MAX_BYTES) -> bytes:
        self.seen[path] = identity(path, what)
        try:
            with open(path, "rb") as fh:
                data = fh.read(limit + 1)
        except FileNotFoundError:
            raise FileProblem(f"{what} missing: {path}") from None
        except OSError as exc:
            raise FileProblem(f"{what} unreadable: {path}: {exc.strerror or exc}") from None
        if len(data) > limit:
            raise FileProblem(f"{what} unusable: {path}: larger than {limit // 1024} KiB")
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
        self._seen: dict[str, Identity] = {}
        self.generation = 0

    def changed(self) -> bool:
        if self._value is None:
            return True
        for path, was in self._seen.items():
            try:
                if identity(path, "file") != was:
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
