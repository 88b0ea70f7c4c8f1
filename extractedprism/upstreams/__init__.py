"""The upstream set: one upstream's pure state machine, the registry (the one RLock) with
its records, snapshots and effects, selection, latency tiers and operator actions.
"""
