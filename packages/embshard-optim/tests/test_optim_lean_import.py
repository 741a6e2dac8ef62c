"""Importing embshard_optim is cheap and FBGEMM-free.

Every module is imported in a fresh interpreter, which must then hold no ``fbgemm_gpu`` module
and neither ``torch.distributed._shard`` (ShardedTensor) nor ``torch.distributed.tensor``
(DTensor): those load only when sharded state is actually built.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import embshard_optim

MODULES = sorted(
    m.name for m in pkgutil.walk_packages(embshard_optim.__path__, prefix="embshard_optim.")
)

SCRIPT = f"""
import importlib, sys
before = set(sys.modules)
for name in {MODULES!r}:
    importlib.import_module(name)
heavy = ("fbgemm_gpu", "torch.distributed._shard", "torch.distributed.tensor")
loaded = sorted(m for m in sys.modules if m.startswith(heavy) and m not in before)
print(repr(loaded))
"""


def test_every_module_imports_without_fbgemm_or_distributed_tensors() -> None:
    assert "embshard_optim.embedding_fused" in MODULES
    assert "embshard_optim.sparse_rules.adam" in MODULES
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout
