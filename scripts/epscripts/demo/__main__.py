"""python -m epscripts.demo: what scripts/demo runs."""

from epscripts.demo.cli import main

raise SystemExit(main())
