"""The local chaos harness: scripts/chaos-local (cli.py); --control-plane real runs real.py."""
