"""pytest-benchmark suites: one thread, fixed seeds, contenders from ``k1_contenders``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)
