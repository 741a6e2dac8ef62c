"""Every ```python block of README.md and docs/*.md runs as written.

Each block runs in its own interpreter (a fresh process, nothing imported beforehand); a block
that starts a process group (``init_process_group``) runs on 2 gloo ranks set up as ``torchrun``
sets them (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` / ``MASTER_PORT``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``). A failure names the Markdown file and the line of the statement that
raised, with the rank's output.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
WORLD_SIZE = 2
TIMEOUT_S = 120.0
GRACE_S = 10.0
_FENCE = re.compile(r"^(\s*)```python\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    first_line: int  # 1-based line of the block's first code line in ``path``
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.first_line - 1}"

    @property
    def distributed(self) -> bool:
        return "init_process_group" in self.code


def python_blocks(path: Path) -> list[Block]:
    """The ```python blocks of ``path`` in order, dedented to their fence's indentation."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        indent, start, body = len(fence.group(1)), i + 2, []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:])
            i += 1
        if i == len(lines):
            raise ValueError(f"{path.relative_to(ROOT)}:{start - 1}: ```python block never closes")
        blocks.append(Block(path, start, "\n".join(body) + "\n"))
        i += 1
    return blocks


BLOCKS = [b for path in DOCS for b in python_blocks(path)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _failing_line(block: Block, script: Path, output: str) -> str:
    """``file:line`` of the block's last frame in a traceback (the block's start if none)."""
    frames = re.findall(rf'File "{re.escape(str(script))}", line (\d+)', output)
    line = block.first_line + int(frames[-1]) - 1 if frames else block.first_line
    return f"{block.path.relative_to(ROOT)}:{line}"


def _wait(procs: list[subprocess.Popen[bytes]]) -> tuple[list[int], int] | None:
    """The ranks' exit codes and the rank that failed first (0 when none did). Once a rank
    fails the others get a short grace (they may wait on it in a collective) before they are
    killed. ``None`` past :data:`TIMEOUT_S`."""
    deadline = time.monotonic() + TIMEOUT_S
    first: int | None = None
    while any(p.poll() is None for p in procs):
        if first is None:
            first = next((r for r, p in enumerate(procs) if p.returncode not in (None, 0)), None)
            if first is not None:
                deadline = min(deadline, time.monotonic() + GRACE_S)
        if time.monotonic() > deadline:
            if first is None:
                return None
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.1)
    codes = [p.wait() for p in procs]
    if first is None:
        first = next((r for r, c in enumerate(codes) if c != 0), 0)
    return codes, first


def _run(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(block.code)
    ranks = WORLD_SIZE if block.distributed else 1
    base = dict(os.environ, PYTHONUNBUFFERED="1", EMBSHARD_COLLECTIVE_TIMEOUT_S="30")
    if block.distributed:
        base.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
            WORLD_SIZE=str(ranks),
            LOCAL_WORLD_SIZE=str(ranks),
        )
    logs = [tmp_path / f"rank{r}.log" for r in range(ranks)]
    procs = []
    for r, log in enumerate(logs):
        with log.open("w") as out:  # a file, not a pipe: a chatty rank never blocks
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script)],
                    cwd=tmp_path,
                    env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}
                    if block.distributed
                    else base,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
    try:
        waited = _wait(procs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if waited is None:
        pytest.fail(f"{block.where}: the ```python block ran past {TIMEOUT_S:.0f} s")
    codes, first = waited
    failed = [r for r in [first, *range(ranks)] if codes[r] != 0]
    if failed:
        outputs = {r: logs[r].read_text() for r in dict.fromkeys(failed)}
        shown = "\n".join(
            (f"--- rank {r} of {ranks} (exit {codes[r]}):\n" if block.distributed else "")
            + out[-3000:]
            for r, out in outputs.items()
        )
        pytest.fail(
            f"{_failing_line(block, script, outputs[failed[0]])}: the ```python block starting "
            f"at {block.where} raised:\n{shown}",
            pytrace=False,
        )


def test_the_readme_has_python_blocks() -> None:
    assert any(b.path.name == "README.md" for b in BLOCKS)


def test_failures_name_the_markdown_line(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("text\n\n```python\nx = 1\nraise ValueError('boom')\n```\n")
    (block,) = python_blocks(doc)
    assert block.first_line == 4
    script = tmp_path / "block.py"
    output = f'Traceback:\n  File "{script}", line 2, in <module>\nValueError: boom\n'
    relocated = Block(ROOT / "doc.md", block.first_line, block.code)
    assert _failing_line(relocated, script, output) == "doc.md:5"


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    _run(block, tmp_path)
