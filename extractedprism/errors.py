"""The product's exception root, and the errors that belong to no one package.

Every error extractedprism raises on purpose derives from :class:`Error`, so the command
line can turn any of them into one clear line and an exit status (``exit_status``) without
knowing each kind, and a caller can tell ours from a bug. An error that is also a kind
Python code expects (a bad value, an OS failure) keeps that base as well:
``ConfigError(Error, ValueError)``, ``ListenError(Error, OSError)``.
"""

from __future__ import annotations

import errno

# errno values that mean "out of descriptors or buffers" on accept/socket: a listener
# backs off and retries instead of spinning or failing (the data path and the health port).
FD_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def one_line(text: str) -> str:
    """A value the user gave, as a message shows it: a NUL, a line break or another
    control character but the tab escaped (``\\x00``, ``\\n``), so the message stays one
    line a terminal shows as written (the chart's own messages show a tab as it is)."""
    if not any((ch < " " and ch != "\t") or ch == "\x7f" for ch in text):
        return text
    return "".join(ch.encode("unicode_escape").decode("ascii") if ch != "\t" else ch
                   for ch in text)


class Error(Exception):
    """An error extractedprism raises on purpose; ``str()`` is the sentence to show."""

    exit_status = 1


class ListenError(Error, OSError):
    """A listener could not be opened: says which one (by its flags) and where."""

    def __init__(self, flags: str, host: str, port: int, cause: OSError) -> None:
        self.flags = flags
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        reason = (cause.strerror or str(cause)).lower()
        self.reason = reason
        super().__init__(cause.errno, f"cannot listen on {self.address} ({flags}): {reason}")

    def __str__(self) -> str:
        return str(self.strerror)
