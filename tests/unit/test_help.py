"""--help reads like a manual: the flags in sections by concern, each with what it is for,
the spec's flags first; every row of the flag table names its section."""

from __future__ import annotations

import re

from extractedprism.cli import SUBCOMMANDS
from extractedprism.config.parser import build_parser
from extractedprism.config.table import FLAGS, GROUPS, SPEC_FLAGS


def test_every_flag_names_a_section() -> None:
    # A new row (--stall-timeout, say) fails here until it names one of GROUPS.
    missing = [f.name for f in FLAGS if f.group not in GROUPS]
    assert missing == [], f"flags without a --help section: {missing}"
    assert set(GROUPS) == {f.group for f in FLAGS}, "a section with no flag"
    assert set(SPEC_FLAGS) <= {f.name for f in FLAGS}


def sections(text: str) -> dict[str, tuple[str, list[str]]]:
    """title -> (its one-line purpose, its options in order)."""
    out: dict[str, tuple[str, list[str]]] = {}
    for block in re.split(r"\n(?=\S[^\n]*:\n)", text):
        head, _, rest = block.partition(":\n")
        if head.strip() not in {t for t, _ in GROUPS.values()}:
            continue
        purpose, _, body = rest.partition("\n\n")
        options = re.findall(r"^  (--[a-z-]+)", body, re.M)
        out[head.strip()] = (" ".join(purpose.split()), options)
    return out


def test_help_lists_each_section_with_its_purpose_and_the_spec_flags_first() -> None:
    text = build_parser(tuple(SUBCOMMANDS)).format_help()
    found = sections(text)
    assert list(found) == [t for t, _ in GROUPS.values()]
    listed = []
    for key, (title, purpose) in GROUPS.items():
        got_purpose, options = found[title]
        assert got_purpose == purpose
        assert sorted(options) == sorted(f.option for f in FLAGS if f.group == key)
        names = [o[2:] for o in options]
        spec = [n for n in names if n in SPEC_FLAGS]
        assert names[:len(spec)] == spec, f"{title}: the spec's flags come first"
        assert spec == sorted(spec, key=SPEC_FLAGS.index), f"{title}: in the spec's order"
        listed += options
    assert sorted(listed) == sorted(f.option for f in FLAGS)  # each flag once


def test_usage_is_two_lines_naming_the_subcommands() -> None:
    text = build_parser(tuple(SUBCOMMANDS)).format_help()
    usage = text.split("\n\n")[0].splitlines()
    assert usage == ["usage: extractedprism --endpoints HOST:PORT[,HOST:PORT...] [FLAGS]",
                     f"       extractedprism {{{','.join(SUBCOMMANDS)}}} ..."]
