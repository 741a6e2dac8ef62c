"""Test setup for the multi-process tests: the backend / device switch and the ``cpu_only`` mark.

The suite runs on gloo and the CPU by default, and on NCCL and the GPUs with
``EMBSHARD_TEST_BACKEND=nccl`` (``nox -s gpu_tests``); :mod:`_mp` reads the switch.

* ``@pytest.mark.cpu_only(reason)``: a test that only makes sense on gloo / the CPU (it kills
  or hangs a rank, or checks a gloo-specific path); skipped under NCCL with its reason.
* ``device`` fixture: the device this process's tensors belong on (``_mp.test_device()``).
* ``EMBSHARD_FUSED_PATH`` defaults to ``torch`` here (unless set): the fused kernels' FBGEMM-or-
  torch choice is otherwise measured per process, and tests that compare runs across processes
  (resume, the launcher) must not depend on a timing. Both paths are tested against each other
  in embshard-kernels' suite.
"""

from __future__ import annotations

import os

import pytest
import torch
from _mp import selected_backend, test_device

os.environ.setdefault("EMBSHARD_FUSED_PATH", "torch")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "cpu_only(reason): runs only on gloo / the CPU; skipped under EMBSHARD_TEST_BACKEND=nccl",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    backend = selected_backend()  # raises early on a bad EMBSHARD_TEST_BACKEND / _DEVICE
    if backend == "gloo":
        return
    for item in items:
        mark = item.get_closest_marker("cpu_only")
        if mark is None:
            continue
        why = mark.kwargs.get("reason") or (mark.args[0] if mark.args else "gloo / CPU only")
        item.add_marker(pytest.mark.skip(reason=f"cpu_only under {backend}: {why}"))


@pytest.fixture
def device() -> torch.device:
    """The device this test process's tensors belong on (CPU under gloo, a GPU under nccl)."""
    return test_device()
