"""``extractedprism profile [--format env|args]``: print the production profile.

The program's own defaults are the spec's; the chart, ``static-pod`` and the examples run
the production profile (``config/profile.py``). This prints it for every other way of
running the proxy: as an ``EP_`` environment file with the reason for each value (the
default; what ``examples/systemd/profile.env`` is), or as one line of flags::

    extractedprism profile > /etc/extractedprism/profile.env
    extractedprism $(extractedprism profile --format args) --endpoints ... \\
        --health-check-ca-file /etc/kubernetes/pki/ca.crt
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from extractedprism.config import profile

HEADER = (
    "# extractedprism's production profile (`extractedprism profile`): the values the chart,\n"
    "# `extractedprism static-pod` and the examples ship. The program's own defaults are the\n"
    "# spec's; these replace them. readyz also needs EP_HEALTH_CHECK_CA_FILE (the cluster CA)\n"
    "# and, where anonymous /readyz is off, the node's credentials.\n"
)


def env_file(settings: Sequence[profile.Setting] = profile.PRODUCTION) -> str:
    """The profile as an environment file: each variable after a comment saying why."""
    lines = [HEADER]
    for s in settings:
        lines.append(f"# {s.reason}\n{s.env}={s.value}\n")
    return "".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="extractedprism profile",
        description="Print the production profile: the flag values the chart, static-pod "
        "and the examples ship (the program's own defaults are the spec's).")
    parser.add_argument("--format", choices=("env", "args"), default="env",
                        help="env: an EP_ environment file with the reason for each value "
                        "(default); args: the flags on one line")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if ns.format == "args":
        sys.stdout.write(" ".join(profile.args()) + "\n")
    else:
        sys.stdout.write(env_file())
    return 0
