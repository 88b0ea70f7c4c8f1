"""python -m epscripts.controlplane: what scripts/controlplane runs."""

from epscripts.controlplane.cli import main

raise SystemExit(main())
