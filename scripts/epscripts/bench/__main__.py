"""python -m epscripts.bench: what scripts/bench runs. ``ab``, ``handover`` and
``footprint`` as the first argument run the paired A/B, the handover measurement and the
footprint measurement instead of the benchmark; ``probecost`` what a health probe costs a
real kube-apiserver (issue 28)."""

import sys
from collections.abc import Callable

from epscripts.bench import cli


def _tool(name: str) -> Callable[[list[str]], int]:
    # Imported on demand: handover and footprint need the test helpers, the benchmark
    # does not.
    if name == "ab":
        from epscripts.bench import ab
        return ab.main
    if name == "probecost":
        from epscripts.bench import probecost
        return probecost.main
    if name == "footprint":
        from epscripts.bench import footprint
        return footprint.main
    from epscripts.bench import handover
    return handover.main


args = sys.argv[1:]
if args[:1] in (["ab"], ["handover"], ["footprint"], ["probecost"]):
    raise SystemExit(_tool(args[0])(args[1:]))
raise SystemExit(cli.main(args))
