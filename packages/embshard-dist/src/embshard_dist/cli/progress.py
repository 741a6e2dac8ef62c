"""Progress of ``embshard train``: a bar with ETA on a terminal, plain lines otherwise.

On a terminal the bar is redrawn in place after every step and each report line (a training
window, an evaluation) is printed above it; when stdout is not a terminal (a file, a pipe, CI)
only the report lines appear, one per line. Report lines go through ``logging``, so they also
reach the log file.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

__all__ = ["Progress", "format_duration"]

BAR_WIDTH = 24


def format_duration(seconds: float) -> str:
    """``m:ss`` (or ``h:mm:ss``) of a non-negative duration."""
    s = max(0, round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """Shows steps ``first .. total`` of a run.

    Args:
        total: the step the run ends at.
        first: the step it starts from (a resumed run starts later).
        logger: where report lines go (its handlers decide: console, file).
        stream: the terminal the bar is drawn on (default stdout).
        bar: draw the bar (default: when ``stream`` is a terminal).
    """

    def __init__(
        self,
        total: int,
        first: int,
        logger: logging.Logger,
        *,
        stream: TextIO | None = None,
        bar: bool | None = None,
    ) -> None:
        self.total, self.first = total, first
        self.logger = logger
        self.stream = stream or sys.stdout
        self.bar = self.stream.isatty() if bar is None else bar
        self._started = time.perf_counter()
        self._done = first
        self._drawn = False

    def step(self, done: int) -> None:
        """Step ``done`` finished: redraw the bar (on a terminal)."""
        self._done = done
        if self.bar:
            self._draw()

    def report(self, text: str) -> None:
        """Log one line (above the bar on a terminal)."""
        if self._drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._drawn = False
        self.logger.info(text)
        if self.bar and self._done < self.total:
            self._draw()

    def close(self) -> None:
        """Leave the terminal on a fresh line."""
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False

    def _draw(self) -> None:
        ran = self._done - self.first
        span = max(self.total - self.first, 1)
        filled = BAR_WIDTH * ran // span
        elapsed = time.perf_counter() - self._started
        eta = elapsed / ran * (self.total - self._done) if ran else 0.0
        self.stream.write(
            f"\r\033[Ktrain [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] "
            f"{self._done}/{self.total} | elapsed {format_duration(elapsed)} | "
            f"ETA {format_duration(eta)}"
        )
        self.stream.flush()
        self._drawn = True
