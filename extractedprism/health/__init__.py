"""The health port: its HTTP server and connection loop, the ``/upstreams`` document,
the metrics collectors and the liveness heartbeat.
"""
