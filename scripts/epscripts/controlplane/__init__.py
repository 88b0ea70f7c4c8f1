"""A real control plane on this machine: scripts/controlplane (cli.py)."""
