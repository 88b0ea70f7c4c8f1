"""Benchmark reference, not part of the product: the design card's data-path shape in
the least CPython that can express it (no registry, metrics, retries, draining or
options), to tell how fast any CPython implementation of that shape can be here.

Same shape as scripts/bench_ref/tpc.c and extractedprism/datapath/proxy.py + pipe.py: the main
thread accepts and hands each socket to the most recently parked of 64 pre-started
pipe threads; each pipe thread connects, sleeps in poll on both sockets and splices
through its two kernel pipes. scripts/bench starts it with SCHED_BATCH, the product's
default --pipe-sched. Flags: the ones scripts/bench passes; others are ignored.
"""

from __future__ import annotations

import os
import select
import socket
import sys
import threading

CHUNK = 64 * 1024
FLAGS = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
POOL = 64


class Box:
    """One parked pipe thread: the lock it sleeps on and the socket it gets."""

    __slots__ = ("sock", "wake")

    def __init__(self) -> None:
        self.wake = threading.Lock()
        self.wake.acquire()
        self.sock: socket.socket | None = None


def serve(c: socket.socket, upstream: tuple[str, int], pipes: list[tuple[int, int]]) -> bool:
    """Copy until both sides end; True when it died with bytes maybe left in a pipe."""
    u = socket.socket()
    try:
        u.connect(upstream)
        for s in (c, u):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.setblocking(False)
        cf, uf = c.fileno(), u.fileno()
        poller = select.poll()
        poller.register(cf, select.POLLIN)
        poller.register(uf, select.POLLIN)
        route = {cf: (u, pipes[0]), uf: (c, pipes[1])}
        eofs = 0
        splice = os.splice
        while eofs < 2:
            for fd, _ in poller.poll():
                dst, (pr, pw) = route[fd]
                try:
                    n = splice(fd, pw, CHUNK, flags=FLAGS)
                except BlockingIOError:
                    continue
                if n == 0:
                    poller.unregister(fd)
                    dst.shutdown(socket.SHUT_WR)
                    eofs += 1
                    continue
                while n:
                    try:
                        n -= splice(pr, dst.fileno(), n, flags=FLAGS)
                    except BlockingIOError:
                        select.select([], [dst], [])
    except OSError:
        return True
    finally:
        c.close()
        u.close()
    return False


def worker(idle: list[Box], lock: threading.Lock, upstream: tuple[str, int]) -> None:
    pipes = [os.pipe2(os.O_NONBLOCK) for _ in range(2)]
    box = Box()
    while True:
        with lock:
            idle.append(box)
        box.wake.acquire()
        assert box.sock is not None
        if serve(box.sock, upstream, pipes):
            for r, w in pipes:
                os.close(r)
                os.close(w)
            pipes = [os.pipe2(os.O_NONBLOCK) for _ in range(2)]


def health(listener: socket.socket) -> None:
    while True:
        c, _ = listener.accept()
        with c:
            c.recv(1024)
            c.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\nok\n")


def main(argv: list[str]) -> None:
    args = dict(zip(argv[::2], argv[1::2], strict=False))
    host, port = args["--endpoints"].rsplit(":", 1)
    upstream = (host, int(port))
    bind = args.get("--bind-address", "127.0.0.1")
    sys.setswitchinterval(0.001)  # the product's default (EP_SWITCH_INTERVAL)
    idle: list[Box] = []
    lock = threading.Lock()
    threading.stack_size(256 * 1024)

    def spawn() -> None:
        threading.Thread(target=worker, args=(idle, lock, upstream), daemon=True).start()

    for _ in range(POOL):
        spawn()
    hl = socket.create_server((bind, int(args.get("--health-port", "7446"))))
    threading.Thread(target=health, args=(hl,), daemon=True).start()
    listener = socket.create_server((bind, int(args.get("--bind-port", "7445"))), backlog=4096)
    while True:
        c, _ = listener.accept()
        with lock:
            box = idle.pop() if idle else None
        if box is None:
            spawn()
            while box is None:
                with lock:
                    box = idle.pop() if idle else None
        box.sock = c
        box.wake.release()


if __name__ == "__main__":
    main(sys.argv[1:])
