"""The public names of embshard_dist resolve, and importing the package loads none of them."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_import_is_lazy() -> None:
    code = (
        "import sys, embshard_dist; "
        "heavy = [m for m in sys.modules if m.startswith(('fbgemm', 'embshard_kernels', 'torch.distributed._shard'))]; "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_public_names_leave_the_compiler_unloaded() -> None:
    """Every public name, sharders and collectives included, resolves without importing torch's
    compiler (dynamo and inductor: a second and ~150 MB per process); only ``torch.compile``
    loads it."""
    code = (
        "import sys, embshard_dist; "
        "import embshard_dist.sharded.embedding_bag, embshard_dist.comm.kjt_all_to_all; "
        "[getattr(embshard_dist, n) for n in embshard_dist.__all__]; "
        "print([m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_public_names_resolve() -> None:
    import embshard_dist

    for name in embshard_dist.__all__:
        assert getattr(embshard_dist, name) is not None, name


def test_unknown_name_is_an_attribute_error() -> None:
    import embshard_dist

    with pytest.raises(AttributeError, match="no_such_thing"):
        embshard_dist.no_such_thing  # noqa: B018
