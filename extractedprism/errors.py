"""Errors the command line reports in a sentence of their own."""

from __future__ import annotations


class ListenError(OSError):
    """A listener could not be opened: says which one (by its flags) and where."""

    def __init__(self, flags: str, host: str, port: int, cause: OSError) -> None:
        self.flags = flags
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        reason = (cause.strerror or str(cause)).lower()
        self.reason = reason
        super().__init__(cause.errno, f"cannot listen on {self.address} ({flags}): {reason}")

    def __str__(self) -> str:
        return str(self.strerror)
