"""Test setup for embshard-optim: the package must work without FBGEMM.

The workspace environment has FBGEMM installed (for the kernels package); this conftest makes
``import fbgemm_gpu`` fail for the whole test session, so a test that (directly or through
embshard_optim) imports it fails here as it would in embshard-optim's own environment.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType


class _BlockFbgemm(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname == "fbgemm_gpu" or fullname.startswith("fbgemm_gpu."):
            raise ImportError(f"embshard-optim must not import {fullname} (FBGEMM is blocked here)")
        return None


def pytest_configure() -> None:
    loaded = [m for m in sys.modules if m.startswith("fbgemm_gpu")]
    assert not loaded, f"fbgemm_gpu was imported before the tests started: {loaded}"
    sys.meta_path.insert(0, _BlockFbgemm())
