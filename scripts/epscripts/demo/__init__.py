"""scripts/demo (cli.py) and its upstream processes (upstream.py)."""
