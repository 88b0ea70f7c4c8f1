"""Logging: logfmt/JSON lines through a bounded queue, per-connection lines and rate
limits, and the grouped thread dump of SIGUSR1.
"""
