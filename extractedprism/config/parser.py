"""The command line's parser, built from the flag table (pure but for argparse).

One option per row of :data:`~extractedprism.config.table.FLAGS`, bound to its ``EP_``
variable, listed in its --help section, its help text saying its rules and default once;
values that start with a dash joined to their option so validate() words the problem;
no abbreviations; an unknown flag or a usage error is one line (:class:`UsageError`) with
the closest real flag; a value from the environment is named by its variable in every
message; ``EP_`` variables that no flag reads, with the closest real one. The server
(cli.py, through :func:`parse`) and ``extractedprism static-pod`` (ops/staticpod.py)
share it.
"""

from __future__ import annotations

import argparse
import copy
import errno
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import configargparse

from extractedprism import __version__
from extractedprism.config.flags import Flag, parse_bool, show_value
from extractedprism.config.table import (
    FLAG_BY_NAME,
    FLAGS,
    GROUPS,
    SPEC_FLAGS,
    Config,
    ConfigError,
    cautions,
    unused_settings,
    validate,
)
from extractedprism.errors import Error


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


class UsageError(Error):
    """A command line argparse cannot take (an unknown flag, a stray argument): one line."""

    exit_status = 2


class _Parser(configargparse.ArgumentParser):
    """Errors are one line with a pointer to --help (UsageError, exit 2), not argparse's
    usage dump; unknown flags are named with the closest real one."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message}; see '{self.prog} --help'")

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None, **kwargs: object
                   ) -> argparse.Namespace:
        ns, extras = self.parse_known_args(args, namespace, **kwargs)  # type: ignore[arg-type]
        if extras:
            options = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
            self.error(unknown_arguments(extras, options))
        return ns


def _group_order(flag: Flag) -> tuple[int, int]:
    """Within its section, the spec's flags first (in the spec's order), then the rest."""
    if flag.name in SPEC_FLAGS:
        return (0, SPEC_FLAGS.index(flag.name))
    return (1, FLAGS.index(flag))


def build_parser(subcommands: Sequence[str] = ()) -> configargparse.ArgumentParser:
    """The server's parser: one option per row of FLAGS, bound to its EP_ variable, listed
    in its section (``Flag.group``, :data:`GROUPS`); ``subcommands`` are named in the
    description."""
    # The server's usage in two lines (argparse's lists all 37 flags); static-pod, which
    # adds its own flag, keeps argparse's.
    usage = None
    if subcommands:
        usage = ("%(prog)s --endpoints HOST:PORT[,HOST:PORT...] [FLAGS]\n"
                 f"       %(prog)s {{{','.join(subcommands)}}} ...")
    parser = _Parser(
        prog="extractedprism",
        usage=usage,
        description="Per-node TCP load balancer for Kubernetes API server high availability. "
        "Every flag can also be set through its EP_ environment variable; a flag on the "
        "command line wins over its variable. "
        f"Subcommands: {', '.join(f'extractedprism {n} --help' for n in subcommands)}.",
        formatter_class=_HelpFormatter,
        # --end is not --endpoints: an abbreviation that works today breaks the day a
        # flag with the same start is added, and reads as a typo in a unit file.
        allow_abbrev=False,
    )
    sections = {key: parser.add_argument_group(title, purpose)
                for key, (title, purpose) in GROUPS.items()}
    other = None
    for flag in sorted(FLAGS, key=_group_order):
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
        section = sections.get(flag.group)
        if section is None:  # a row without a known group still works (a test fails)
            other = other or parser.add_argument_group("other")
            section = other
        section.add_argument(flag.option, **kwargs)  # type: ignore[arg-type]
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


def _closest_options(given: str, options: Sequence[str]) -> list[str]:
    """The flags a mistyped or abbreviated option most likely meant (at most four)."""
    bare = "--" + given.lstrip("-")
    started = [o for o in options if o.startswith(bare)]
    if started:
        return sorted(started, key=len)[:4]
    dist, best = min((_edits(bare, o), o) for o in options)
    return [best] if dist <= MAX_SUGGEST_EDITS else []


def unknown_arguments(extras: Sequence[str], options: Sequence[str]) -> str:
    """One line about what argparse left over: unknown flags, with their closest match
    among ``options``."""
    valued = {f.option for f in FLAGS if f.kind != "bool"}
    parts: list[str] = []
    after_flag = False
    for arg in extras:
        if arg.startswith("-") and arg != "-":
            name = arg.split("=", 1)[0]
            close = _closest_options(name, options)
            hint = ""
            if len(close) == 1:
                hint = f" (did you mean {close[0]}?)"
            elif close:
                hint = f" (did you mean one of {', '.join(close)}?)"
            parts.append(f"unknown flag {name}{hint}")
            # `--endpoint 10.0.0.1:6443`: the value belongs to the unknown flag.
            after_flag = "=" not in arg and name not in valued
        elif after_flag:
            after_flag = False
        else:
            parts.append(f"unexpected argument {arg!r} (the proxy takes flags only; several "
                         "endpoints are one comma-separated value)")
    return "; ".join(parts)


@dataclass(frozen=True)
class Parsed:
    """A validated configuration, and its warnings: the settings it was given that it
    never reads, and combinations that do not do what their flags say (CAUTIONS)."""

    config: Config
    warnings: list[str]


def _env_names(parser: configargparse.ArgumentParser) -> dict[str, str]:
    """dest -> EP_ variable, for each value that came from the environment (the command
    line wins over a variable, and then the flag is what the user wrote)."""
    settings = parser.get_source_to_settings_dict().get("environment_variables", {})
    return {action.dest: env for env, (action, _value) in settings.items()}


def _start_problems(values: Mapping[str, str | None], names: Mapping[str, str]) -> list[str]:
    """What only this machine can tell: a --kubeconfig that discovery cannot read.

    Not in validate(): ``extractedprism static-pod`` validates flags for another machine.
    """
    path = values.get("kubeconfig") or ""
    try:
        discovery = parse_bool(values.get("enable_discovery") or "true")
    except ValueError:
        return []  # reported by validate()
    if not path.strip() or not discovery or "\0" in path:  # a NUL: validate() said so
        return []
    try:
        # O_NONBLOCK: a FIFO given by mistake must not hang the start.
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
    except OSError as exc:
        reason = (exc.strerror or str(exc)).lower()
        shown = show_value(FLAG_BY_NAME["kubeconfig"], path, names.get("kubeconfig", ""))
        return [f"{shown} cannot be read: {reason} (discovery reads it at start: give a "
                "readable kubeconfig, or --enable-discovery=false for static endpoints only)"]
    return []


def _env_hints(problems: list[str], environ: Mapping[str, str]) -> list[str]:
    """An unknown EP_ variable next to the problem it probably explains: EP_ENDPIONTS set
    and --endpoints missing is one mistake, said in one line."""
    out = list(problems)
    for name, closest in unknown_env_vars(environ):
        flag = next((f for f in FLAGS if f.env == closest), None)
        if flag is not None and flag.required and flag.required in out:
            i = out.index(flag.required)
            out[i] = f"{flag.required}; {name} is set: did you mean {closest}?"
        elif closest:
            out.append(f"{name} is set, but no flag reads it: did you mean {closest}?")
        else:
            out.append(f"{name} is set, but no flag reads it")
    return out


def parse(argv: Sequence[str], subcommands: Sequence[str] = (),
          environ: Mapping[str, str] | None = None) -> Parsed:
    """Parse and validate the server's command line and EP_ variables.

    Raises UsageError (one line) for what argparse cannot take, ConfigError listing every
    problem otherwise; problems name the flag or the EP_ variable the value came from.
    """
    env = os.environ if environ is None else environ
    parser = build_parser(subcommands)
    ns = parser.parse_args(join_dash_values(list(argv)), env_vars=env)
    values = vars(ns)
    names = _env_names(parser)
    problems: list[str] = []
    config = None
    try:
        config = validate(values, names)
    except ConfigError as exc:
        problems = exc.problems
    problems += _start_problems(values, names)
    if problems or config is None:
        raise ConfigError(_env_hints(problems, env))
    return Parsed(config, unused_settings(values, config, names)
                  + cautions(values, config, names))


def parse_config(argv: Sequence[str], subcommands: Sequence[str] = ()) -> Config:
    """Parse and validate; raises ConfigError listing every problem."""
    return parse(argv, subcommands).config
