"""Health checks: tcp and readyz probes, and the ticker thread that schedules them.
"""
