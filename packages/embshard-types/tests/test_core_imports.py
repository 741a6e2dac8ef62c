"""Each core module of embshard_types imports cheaply: no FBGEMM, ShardedTensor, DTensor or
device-mesh module loaded beyond what ``import torch`` loads, and CUDA untouched."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

MODULES = [
    "awaitables",
    "comm_codec",
    "configs",
    "env",
    "interfaces",
    "kernel_params",
    "parameter_sharding",
    "plan",
    "shard_spec",
    "sharded_module",
    "text_table",
    "vocab",
]

_PROBE = """
import json, sys
import torch
before = set(sys.modules)
import embshard_types.{name}
new = sorted(set(sys.modules) - before)
print(json.dumps({{"new": new, "cuda": torch.cuda.is_initialized()}}))
"""


@pytest.mark.parametrize("name", ["plan", "env", "awaitables", "interfaces"])
def test_module_import_is_lean(name: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(name=name)], check=True, capture_output=True, text=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    heavy = [
        m
        for m in result["new"]
        if m.startswith(("fbgemm", "torch.distributed._shard", "torch.distributed.tensor", "numpy"))
    ]
    assert heavy == [], f"importing embshard_types.{name} loaded {heavy}"
    assert result["cuda"] is False


def test_every_module_declares_its_public_names() -> None:
    import importlib

    for name in MODULES:
        module = importlib.import_module(f"embshard_types.{name}")
        assert module.__doc__, name
        for public in getattr(module, "__all__", []):
            assert hasattr(module, public), f"{name}.{public}"
