"""Operating a running proxy: the admin socket and client, ``extractedprism status``,
``extractedprism static-pod`` and the listener handover.
"""
