"""Logging set-up: the chosen line format, and a writer thread so no product thread
ever waits on stderr.

# design
Levels: the spec's zap-style names. debug, info, warn and error map to DEBUG, INFO,
WARNING and ERROR. Python has no dpanic/panic/fatal, and this program never panics on
purpose, so they are thresholds above ERROR: dpanic = 45, panic = 50 (CRITICAL),
fatal = 55. Choosing one of them silences everything but the rare critical line.

Lines (:mod:`extractedprism.logfmt`): ``--log-format=logfmt`` or ``json``, one record
per line. Once :func:`setup_logging` ran, everything the process writes to stderr is
such a line: uncaught exceptions (``sys.excepthook``, ``threading.excepthook``,
``sys.unraisablehook``), warnings (``logging.captureWarnings``) and any stray write to
``sys.stderr`` (each line becomes a record of logger ``stderr``). The one exception is
SIGUSR2's faulthandler dump, written by C code for the case where the interpreter
itself is stuck and nothing written in Python can run.

The writer (the ``log-writer`` thread): the root handler formats a record in the
thread that logs it (so values are taken when the event happens) and puts the line on
a bounded in-memory queue; the writer thread alone writes to stderr. A full queue (a
log collector that stopped reading the pipe) drops the line and counts it; the writer
reports the count in one line when it can write again. A registry transition or a
pipe thread thus never blocks on a full stderr pipe (issue 12, item 7). The queue is
a ``SimpleQueue`` because its ``put`` is reentrant: a signal handler that logs (the
SIGUSR1 dump) cannot deadlock against the line the main thread was queueing.
"""

from __future__ import annotations

import atexit
import io
import logging
import os
import queue
import select
import signal
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any, TextIO

from extractedprism.logs.logfmt import DPANIC, FATAL, LineFormatter

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "dpanic": DPANIC,
    "panic": logging.CRITICAL,
    "fatal": FATAL,
}
FORMATS = ("logfmt", "json")
QUEUE_LINES = 10000  # about 3 MB of lines: seconds of a debug-level connection storm
TICK_S = 1.0  # the writer runs its periodic callbacks (rate-limit summaries) this often
_STOP = object()

log = logging.getLogger(__name__)


class QueueingHandler(logging.Handler):
    """Formats in the caller's thread, queues the line; a full queue drops and counts.

    The stdlib's ``logging.handlers.QueueHandler`` in a few lines: that module (and the
    ``pickle`` it imports) would cost every node half a MiB for one method."""

    def __init__(self, formatter: logging.Formatter, maxsize: int = QUEUE_LINES) -> None:
        super().__init__()
        self.lines: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.setFormatter(formatter)
        self.maxsize = maxsize
        self.dropped = 0  # lines dropped since the writer last reported them
        self.dropped_total = 0
        # An RLock: the SIGUSR1 handler may log on the main thread while the main thread
        # is inside this very method.
        self._drop_lock = threading.RLock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.enqueue(self.prepare(record))
        except Exception:
            self.handleError(record)

    def prepare(self, record: logging.LogRecord) -> str:
        return self.format(record)

    def enqueue(self, record: Any) -> None:
        # qsize() and put() are each atomic; together they bound the queue to maxsize
        # plus at most one line per thread that races here, which is good enough.
        if self.lines.qsize() < self.maxsize:
            self.lines.put(record)
            return
        with self._drop_lock:
            self.dropped += 1
            self.dropped_total += 1

    def take_dropped(self) -> int:
        with self._drop_lock:
            n, self.dropped = self.dropped, 0
        return n


class _Writer:
    """The ``log-writer`` thread: the only writer of log lines to the stream."""

    def __init__(self, handler: QueueingHandler, stream: TextIO) -> None:
        self.handler = handler
        self.stream = stream
        self.thread = threading.Thread(name="log-writer", target=self._run, daemon=True)

    def _run(self) -> None:
        # Signals are the main thread's (docs/HACKING.md); this thread starts before
        # cli.main blocks them for the threads it starts.
        blocked = {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP}
        signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        lines = self.handler.lines
        next_tick = time.monotonic() + TICK_S
        while True:
            try:
                item = lines.get(timeout=max(0.0, next_tick - time.monotonic()))
            except queue.Empty:
                item = None
            batch = [] if item is None else [item]
            while len(batch) < 256:  # write what piled up in one go, one flush
                try:
                    batch.append(lines.get_nowait())
                except queue.Empty:
                    break
            stop = _STOP in batch
            self._write([x for x in batch if x is not _STOP])
            dropped = self.handler.take_dropped()
            if dropped:
                self._write([self._line(logging.WARNING, "log lines dropped; stderr is not "
                                        "keeping up", count=dropped)])
            if stop:
                return
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + TICK_S
                for tick in list(_TICKS):
                    try:
                        tick()
                    except Exception:
                        log.exception("log tick failed")

    def _line(self, level: int, msg: str, **fields: Any) -> str:
        record = logging.LogRecord(__name__, level, __file__, 0, msg, None, None)
        record.__dict__.update(fields)
        return self.handler.format(record)

    def _write(self, batch: list[str]) -> None:
        if batch:
            write_out(self.stream, "\n".join(batch) + "\n", None)


def _fileno(stream: TextIO) -> int | None:
    try:
        return stream.fileno()
    except (OSError, ValueError, AttributeError):  # io.UnsupportedOperation is an OSError
        return None


def write_out(stream: TextIO, text: str, timeout: float | None) -> bool:
    """Write ``text``; False when it was (partly) dropped.

    A real file goes through its descriptor with ``os.write``: a writer blocked on a
    full pipe then holds no lock of Python's buffered I/O, which the interpreter's exit
    would otherwise wait for (or die on, with daemon threads). With ``timeout`` it waits
    at most that long for room (pipes take PIPE_BUF-sized writes atomically once
    writable), and drops the rest.
    """
    fd = _fileno(stream)
    try:
        if fd is None:
            stream.write(text)
            stream.flush()
            return True
        view = memoryview(text.encode("utf-8", "replace"))
        while view:
            if timeout is not None and not _writable(fd, timeout):
                return False
            try:
                n = os.write(fd, view[:4096] if timeout is not None else view)
            except BlockingIOError:  # a non-blocking stderr (some runtimes hand one over)
                if not _writable(fd, 1.0 if timeout is None else timeout) \
                        and timeout is not None:
                    return False
                continue
            view = view[n:]
        return True
    except (OSError, ValueError):
        return False  # stderr closed: nowhere to say so


def _writable(fd: int, timeout: float) -> bool:
    """True once ``fd`` takes a write, False after ``timeout`` seconds. poll, not
    select: select() refuses a descriptor >= 1024 (a stderr reopened on a busy node)."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return bool(poller.poll(max(0, int(timeout * 1000 + 0.999))))


class _LastWords(logging.Handler):
    """After shutdown_logging: formatted lines written at once, never waiting more than
    a moment for a full stderr (a late daemon thread must not hang the exit)."""

    def __init__(self, stream: TextIO, formatter: logging.Formatter) -> None:
        super().__init__()
        self.stream = stream
        self.setFormatter(formatter)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            write_out(self.stream, self.format(record) + "\n", 0.2)
        except Exception:
            pass  # nothing is left to report it to


class _StderrLines(io.TextIOBase):
    """``sys.stderr`` after set-up: each line written becomes a record (logger "stderr")."""

    def __init__(self, real: TextIO) -> None:
        self._real = real
        self._local = threading.local()
        self._log = logging.getLogger("stderr")

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._real.fileno()

    def write(self, text: str) -> int:
        local = self._local
        if getattr(local, "busy", False):  # logging reporting its own failure
            write_out(self._real, text, 0.2)
            return len(text)
        buf = getattr(local, "buf", "") + text
        *lines, local.buf = buf.split("\n")
        local.busy = True
        try:
            for line in lines:
                if line.strip():
                    self._log.warning("%s", line.rstrip())
        finally:
            local.busy = False
        return len(text)

    def flush(self) -> None:
        rest = getattr(self._local, "buf", "")
        if rest.strip():
            self._local.buf = ""
            self.write(rest + "\n")


_state: dict[str, Any] = {}
_TICKS: list[Callable[[], None]] = []


def setup_logging(level: str, stream: TextIO | None = None, fmt: str = "logfmt", *,
                  background: bool = False, capture: bool = False) -> None:
    """Root logger at ``level`` with lines in ``fmt`` on ``stream`` (default stderr).

    ``background``: through the queue and the ``log-writer`` thread (the server).
    ``capture``: also route uncaught exceptions, warnings and stray stderr writes
    through logging (the server; tests keep pytest's own).
    """
    shutdown_logging()
    out = stream or sys.stderr
    formatter = LineFormatter(fmt)
    handler: logging.Handler
    if background:
        qh = QueueingHandler(formatter)
        writer = _Writer(qh, out)
        writer.thread.start()
        _state.update(writer=writer, handler=qh)
        handler = qh
    else:
        handler = logging.StreamHandler(out)
        handler.setFormatter(formatter)
    _state.update(formatter=formatter, stream=out)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(LEVELS[level])
    # The kubernetes client and urllib3 are chatty at debug; keep them at warning.
    for noisy in ("urllib3", "kubernetes"):
        logging.getLogger(noisy).setLevel(max(LEVELS[level], logging.WARNING))
    if capture:
        _capture(out)


def _capture(real: TextIO) -> None:
    logging.captureWarnings(True)
    sys.excepthook = _excepthook
    threading.excepthook = _thread_excepthook
    sys.unraisablehook = _unraisablehook
    sys.stderr = _StderrLines(real)  # type: ignore[assignment]
    _state["captured"] = real


def _excepthook(kind: type[BaseException], exc: BaseException,
                tb: types.TracebackType | None) -> None:
    logging.getLogger("extractedprism").log(FATAL, "uncaught exception error=%s",
                                            exc, exc_info=(kind, exc, tb))


def _thread_excepthook(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("extractedprism").error(
        "thread crashed crashed_thread=%s error=%s", name, args.exc_value,
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback))  # type: ignore[arg-type]


def _unraisablehook(u: Any) -> None:
    logging.getLogger("extractedprism").warning(
        "exception ignored error=%s context=%s", u.exc_value, u.err_msg or repr(u.object),
        exc_info=(u.exc_type, u.exc_value, u.exc_traceback) if u.exc_type else None)


def on_tick(callback: Callable[[], None]) -> None:
    """Run ``callback`` on the writer thread about once per TICK_S, from now on and for
    every later set-up (nothing runs it while there is no writer thread)."""
    _TICKS.append(callback)


def dropped_total() -> int:
    handler = _state.get("handler")
    return handler.dropped_total if handler is not None else 0


def shutdown_logging(timeout: float = 1.0) -> None:
    """Write out the queue (up to ``timeout``: the exit must stay within the shutdown
    deadline even when stderr is stalled), then write directly from here on, so a daemon
    thread's late line is still formatted."""
    writer: _Writer | None = _state.pop("writer", None)
    _state.pop("handler", None)
    if writer is None:
        return
    writer.handler.lines.put(_STOP)
    writer.thread.join(timeout)
    last = _LastWords(_state.get("captured") or writer.stream,
                      writer.handler.formatter)  # type: ignore[arg-type]
    logging.getLogger().handlers[:] = [last]


atexit.register(shutdown_logging)
