"""python -m epscripts.bench: what scripts/bench runs. ``ab`` and ``handover`` as the first
argument run the paired A/B and the handover measurement instead of the benchmark."""

import sys
from collections.abc import Callable

from epscripts.bench import cli


def _tool(name: str) -> Callable[[list[str]], int]:
    # Imported on demand: handover needs the test helpers, the benchmark does not.
    if name == "ab":
        from epscripts.bench import ab
        return ab.main
    from epscripts.bench import handover
    return handover.main


args = sys.argv[1:]
if args[:1] in (["ab"], ["handover"]):
    raise SystemExit(_tool(args[0])(args[1:]))
raise SystemExit(cli.main(args))
