"""The storage writer of a save: ``torch.distributed.checkpoint``'s, remembering its files.

Guarantees: after a successful ``write_data``, :attr:`RecordingWriter.written` lists exactly the
files (relative to the checkpoint) this rank wrote, so the rank can hash them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter

__all__ = ["RecordingWriter"]


class RecordingWriter(FileSystemWriter):
    """A ``FileSystemWriter`` (files fsynced) that records the files this rank wrote."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, sync_files=True)
        self.written: list[str] = []

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        results = future.wait()
        self.written = sorted({str(r.storage_data.relative_path) for r in results})
        return future
