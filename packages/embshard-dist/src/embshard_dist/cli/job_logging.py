"""Logging of ``embshard train``: the console and a log file in the run folder.

Rank 0 logs at INFO to stdout (the bare message, as before) and to ``train.log`` (with time and
level); other ranks log warnings and errors only, to stderr, marked with their rank. Calling it
again replaces the handlers it installed, so a process can run several jobs.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

__all__ = ["LOGGER_NAME", "setup_logging"]

LOGGER_NAME = "embshard.train"
LOG_FILE = "train.log"


def setup_logging(run_dir: Path | None, rank: int) -> logging.Logger:
    """The job's logger for ``rank``, writing ``run_dir / train.log`` on rank 0."""
    logger = logging.getLogger(LOGGER_NAME)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    logger.propagate = False
    if rank != 0:
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(message)s"))
        logger.addHandler(console)
        logger.setLevel(logging.WARNING)
        return logger
    logger.setLevel(logging.INFO)
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(console)
    if run_dir is not None:
        file = logging.FileHandler(run_dir / LOG_FILE, encoding="utf-8")
        file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(file)
    return logger


def close_logging() -> None:
    """Flush and close the job's handlers (the log file is complete afterwards)."""
    logger = logging.getLogger(LOGGER_NAME)
    for handler in list(logger.handlers):
        handler.flush()
        logger.removeHandler(handler)
        handler.close()
