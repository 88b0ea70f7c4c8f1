"""Logging set-up: the spec's zap-style level names mapped onto Python's levels.

debug, info, warn and error map to DEBUG, INFO, WARNING and ERROR. Python has no
dpanic/panic/fatal, and this program never panics on purpose, so they are thresholds
above ERROR: dpanic = 45, panic = 50 (CRITICAL), fatal = 55. Choosing one of them
silences everything but the rare critical line (for example a failed start-up).
"""

from __future__ import annotations

import logging
import sys

DPANIC = 45
FATAL = 55
LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "dpanic": DPANIC,
    "panic": logging.CRITICAL,
    "fatal": FATAL,
}
FORMAT = "%(asctime)s level=%(levelname)s thread=%(threadName)s logger=%(name)s msg=%(message)s"


def setup_logging(level: str, stream: object = None) -> None:
    logging.addLevelName(DPANIC, "DPANIC")
    logging.addLevelName(FATAL, "FATAL")
    logging.addLevelName(logging.WARNING, "WARN")
    handler = logging.StreamHandler(stream or sys.stderr)  # type: ignore[arg-type]
    handler.setFormatter(logging.Formatter(FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(LEVELS[level])
    # The kubernetes client and urllib3 are chatty at debug; keep them at warning.
    for noisy in ("urllib3", "kubernetes"):
        logging.getLogger(noisy).setLevel(max(LEVELS[level], logging.WARNING))
