"""Importing embshard_types is side-effect free and cheap: no FBGEMM, no ShardedTensor, no DTensor."""

from __future__ import annotations

import json
import subprocess
import sys

_PROBE = """
import json, sys
before = set(sys.modules)
import torch
after_torch = set(sys.modules)
import embshard_types
new = sorted(set(sys.modules) - after_torch)
print(json.dumps({"new": new, "cuda_init": torch.cuda.is_initialized()}))
"""


def _probe() -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", _PROBE], check=True, capture_output=True, text=True)
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_import_loads_no_heavy_or_optional_modules() -> None:
    result = _probe()
    new = result["new"]
    assert isinstance(new, list)
    heavy = [
        m
        for m in new
        if m.startswith(("fbgemm", "torch.distributed._shard", "torch.distributed.tensor", "numpy"))
    ]
    assert heavy == [], f"importing embshard_types loaded {heavy}"
    assert result["cuda_init"] is False


def test_public_names_resolve() -> None:
    import embshard_types

    for name in embshard_types.__all__:
        assert getattr(embshard_types, name) is not None, name
