"""One run of ``embshard train`` with every option at its default, shared by the tests of it.

``test_train_cli`` (what the job reports) and ``test_train_job`` (what it learns and leaves in its
run folder) check different things of the same default job (2 ranks, 100 steps, evaluations
every 25): it runs once per test session, on the first call of :func:`default_job`.

The run is ``main(["train", "--json", SUMMARY])``, in-process as the tests called it, with the
current directory set to a fresh temporary folder while it runs, so the default run folder
(``./runs/train-<time>``) lands there. What the ranks print (file descriptor 1, which the spawned
ranks inherit) is captured into a file, as pytest's ``capfd`` would.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from embshard_dist.cli import main


@dataclass(frozen=True)
class DefaultJob:
    """What the default run left: its exit code, summary, printed output and duration."""

    code: int
    summary: dict[str, Any]
    out: str
    seconds: float
    cwd: Path


_RUNS: dict[str, DefaultJob] = {}


def default_job(tmp_path_factory: pytest.TempPathFactory) -> DefaultJob:
    """The session's default run (started by the first caller, reused by the others)."""
    job = _RUNS.get("default")
    if job is None:
        job = _RUNS["default"] = _run_default(tmp_path_factory.mktemp("default_job"))
    return job


def _run_default(cwd: Path) -> DefaultJob:
    summary_path = cwd / "summary.json"
    sys.stdout.flush()
    old_cwd = os.getcwd()
    saved_fd = os.dup(1)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 1)
        os.chdir(cwd)
        try:
            start = time.monotonic()
            code = main(["train", "--json", str(summary_path)])
            seconds = time.monotonic() - start
        finally:
            sys.stdout.flush()
            os.chdir(old_cwd)
            os.dup2(saved_fd, 1)
            os.close(saved_fd)
        captured.seek(0)
        out = captured.read().decode()
    summary = json.loads(summary_path.read_text()) if code == 0 else {}
    return DefaultJob(code=code, summary=summary, out=out, seconds=seconds, cwd=cwd)
