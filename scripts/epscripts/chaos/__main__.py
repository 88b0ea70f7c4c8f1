"""python -m epscripts.chaos: what scripts/chaos-local runs."""

from epscripts.chaos.cli import main

raise SystemExit(main())
