"""Removes the demo's temporary directory (the demo CA's private key, the admin socket)
once the demo is gone, however it ended: a demo killed with SIGKILL cannot clean up after
itself, so this small child waits for its parent to disappear and does it.

    python -m epscripts.demo.janitor DIR
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time

POLL_S = 0.5


def main() -> int:
    path = sys.argv[1]
    parent = os.getppid()
    # The demo's own stop removes the directory and then ends this process with SIGTERM;
    # a Ctrl-C in the terminal reaches the whole group, and the demo handles it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while os.getppid() == parent:  # re-parented: the demo is gone
        time.sleep(POLL_S)
    shutil.rmtree(path, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
