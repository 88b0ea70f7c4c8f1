"""The data path: the listening socket, the acceptor, the pipe pool, dialing, the first
answer, the relay (``_relay.c`` or the Python loop), socket options and scheduling.
"""
