"""Repeated log lines folded into one summary line per interval.

A flood makes the same line over and over: one per dropped connection, one
per connection closed idle, and one per failed accept ten times a second
while the process has no fd to spare (Trio's own accept loop logged that
under ``trio.serve_listeners``; the server's, ``gms.server.edge.admission``,
logs it under ``gms.server``).  Each kind of line (its logger, level
and format string, not its arguments) passes once per interval; the rest are
counted, and a summary line says how many were held back: the next line of
that kind carries it, or :meth:`RateLimit.flush` writes it once the interval
is over (the server runs it every interval, and on its way out).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import trio

INTERVAL_S = 10.0
LOGGERS = ("gms.server", "gms.host")


class _Window:
    __slots__ = ("start", "held", "record")

    def __init__(self, start: float) -> None:
        self.start = start
        self.held = 0
        self.record: logging.LogRecord | None = None  # the last one held back


class RateLimit(logging.Filter):
    def __init__(self, interval: float = INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval = interval
        self.clock = clock
        self._windows: dict[tuple[str, int, str], _Window] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "gms_summary", False):
            return True
        key = (record.name, record.levelno, str(record.msg))
        now = self.clock()
        window = self._windows.get(key)
        if window is not None and now - window.start < self.interval:
            window.held += 1
            window.record = record
            return False
        if window is not None and window.held:
            record.msg = f"{record.msg} [{_held(window.held, now - window.start)}]"
        self._windows[key] = _Window(now)
        return True

    def flush(self, *, everything: bool = False) -> int:
        """Write a summary for each kind whose interval is over (or every kind,
        ``everything``) with lines held back; returns how many it wrote."""
        now = self.clock()
        written = 0
        for key, window in list(self._windows.items()):
            if now - window.start < self.interval and not everything:
                continue
            if window.held and window.record is not None:
                last = window.record
                summary = logging.LogRecord(
                    last.name, last.levelno, last.pathname, last.lineno,
                    "%s more like this in the last %.0f s, the last: %s",
                    (window.held, now - window.start, last.getMessage()), None,
                )
                summary.gms_summary = True
                logging.getLogger(last.name).handle(summary)
                written += 1
            del self._windows[key]
        return written


def _held(count: int, seconds: float) -> str:
    return f"and {count} more like this in the last {seconds:.0f} s"


def install(loggers: Iterable[str] = LOGGERS, interval: float = INTERVAL_S) -> RateLimit:
    """One filter on each of ``loggers`` (it sees the records they make themselves)."""
    limit = RateLimit(interval)
    for name in loggers:
        logging.getLogger(name).addFilter(limit)
    return limit


def uninstall(limit: RateLimit, loggers: Iterable[str] = LOGGERS) -> None:
    for name in loggers:
        logging.getLogger(name).removeFilter(limit)


async def flush_every(limit: RateLimit) -> None:
    """The server's task: summaries at the end of each interval, and on the way out."""
    try:
        while True:
            await trio.sleep(limit.interval)
            limit.flush()
    finally:
        limit.flush(everything=True)
