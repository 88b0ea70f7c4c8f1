"""The benchmark: scripts/bench (cli.py), its paired A/B (ab.py) and the handover figures
(handover.py)."""
