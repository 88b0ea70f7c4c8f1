"""The command line's parser, built from the flag table (pure but for argparse).

One option per row of :data:`~extractedprism.config.table.FLAGS`, bound to its ``EP_``
variable, its help text saying its rules and default once; values that start with a
dash joined to their option so validate() words the problem; ``EP_`` variables that no
flag reads, with the closest real one. The server (cli.py) and ``extractedprism
static-pod`` (ops/staticpod.py) share it.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Mapping, Sequence

import configargparse

from extractedprism import __version__
from extractedprism.config.flags import Flag
from extractedprism.config.table import FLAGS, Config, validate


def flag_help(flag: Flag) -> str:
    """A flag's help text and rules, with its default said once (or that it is required)."""
    text = "; ".join((flag.help, *flag.rules))
    if flag.required:
        text += " (required)"
    elif "(default:" in text:
        pass  # the text says what unset means
    elif flag.default is None or flag.default == "":
        text += " (default: unset)"
    else:
        text += f" (default: {flag.default})"
    return text.replace("%", "%%")


# validate() enforces these (naming the flag, with every other problem); help shows them.
_REQUIRED = {f.dest for f in FLAGS if f.required}


class _HelpFormatter(argparse.HelpFormatter):
    """The usage line shows required flags outside brackets.

    They are not argparse-required: validate() reports a missing one together with every
    other problem, and the value may come from the environment.
    """

    def add_usage(self, usage: str | None, actions: object, groups: object,
                  prefix: str | None = None) -> None:
        shown = []
        for action in actions:  # type: ignore[attr-defined]
            if action.dest in _REQUIRED:
                action = copy.copy(action)
                action.required = True
            shown.append(action)
        super().add_usage(usage, shown, groups, prefix)  # type: ignore[arg-type]


def build_parser(subcommands: Sequence[str] = ()) -> configargparse.ArgumentParser:
    """The server's parser: one option per row of FLAGS, bound to its EP_ variable;
    ``subcommands`` are named in the description."""
    parser = configargparse.ArgumentParser(
        prog="extractedprism",
        description="Per-node TCP load balancer for Kubernetes API server high availability. "
        "Every flag can also be set through its EP_ environment variable. "
        f"Subcommands: {', '.join(f'extractedprism {n} --help' for n in subcommands)}.",
        formatter_class=_HelpFormatter,
    )
    required = parser.add_argument_group("required")
    # Shown first, before the "options" group argparse made (with --help in it).
    parser._action_groups.insert(0, parser._action_groups.pop())
    for flag in FLAGS:
        kwargs: dict[str, object] = {
            "env_var": flag.env,
            "dest": flag.dest,
            "default": None,
            "help": flag_help(flag),
            "metavar": flag.kind.upper() if flag.kind != "choice" else "{" + ",".join(
                flag.choices) + "}",
        }
        if flag.kind == "bool":
            # `--enable-discovery` alone means true; `--enable-discovery=false` works too.
            kwargs.update(nargs="?", const="true")
        group = required if flag.required else parser
        group.add_argument(flag.option, **kwargs)  # type: ignore[arg-type]
    parser.add_argument("--version", action="version", version=f"extractedprism {__version__}")
    return parser


def _edits(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions)."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


MAX_SUGGEST_EDITS = 3


def unknown_env_vars(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """Every ``EP_`` variable that no flag reads, with the closest real one (or None)."""
    known = [f.env for f in FLAGS]
    out = []
    for name in sorted(environ):
        if not name.startswith("EP_") or name in known:
            continue
        dist, best = min((_edits(name, k), k) for k in known)
        out.append((name, best if dist <= MAX_SUGGEST_EDITS else None))
    return out


def join_dash_values(argv: Sequence[str]) -> list[str]:
    """``--drain-timeout -1s`` -> ``--drain-timeout=-1s``.

    argparse takes a value that starts with "-" for another option and stops with
    "expected one argument"; joined, the value reaches validate(), whose message names
    the flag, the value and the rule like every other.
    """
    valued = {f.option for f in FLAGS if f.kind != "bool"}
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if (arg in valued and nxt is not None and nxt.startswith("-") and nxt != "--"
                and nxt.split("=", 1)[0] not in valued and not nxt.startswith("--")):
            out.append(f"{arg}={nxt}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def parse_config(argv: Sequence[str], subcommands: Sequence[str] = ()) -> Config:
    """Parse and validate; raises ConfigError listing every problem."""
    ns = build_parser(subcommands).parse_args(join_dash_values(list(argv)))
    return validate(vars(ns))
