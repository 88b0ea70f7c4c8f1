"""`python -m extractedprism` runs the same entry point as the console script."""

from extractedprism.cli import main

raise SystemExit(main())
