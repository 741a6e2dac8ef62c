"""The single place embshard imports ``fbgemm_gpu``.

Importing it gives working FBGEMM names or raises an ``ImportError`` naming the missing or
mismatched build and the install command (torch and FBGEMM are a matched pair, see
:data:`MATCHED_VERSIONS`).
"""

from __future__ import annotations

import torch

MATCHED_VERSIONS: dict[str, str] = {"2.13": "1.8", "2.14": "1.9"}
"""torch ``major.minor`` -> the FBGEMM ``major.minor`` built against it."""


def _minor(version: str) -> str:
    parts = version.split("+", 1)[0].split(".")
    return ".".join(parts[:2])


def install_hint(torch_version: str | None = None) -> str:
    """The command that installs the FBGEMM build matching ``torch_version`` on this host."""
    torch_version = torch_version or torch.__version__
    extra = "cuda" if torch.cuda.is_available() else "cpu"
    fbgemm = MATCHED_VERSIONS.get(_minor(torch_version))
    pin = f" (torch {_minor(torch_version)}.x goes with FBGEMM {fbgemm}.0)" if fbgemm else ""
    return (
        f"install it with `pip install 'embshard-kernels[{extra}]'` (or `uv sync`; "
        f"'[cpu]' is fbgemm-gpu-cpu for hosts without an NVIDIA driver, '[cuda]' is fbgemm-gpu)"
        f"{pin}"
    )


def check_versions(torch_version: str, fbgemm_version: str) -> str | None:
    """Return a message when ``torch_version`` and ``fbgemm_version`` are not a matched pair.

    Args:
        torch_version: e.g. ``"2.13.0+cu130"``.
        fbgemm_version: e.g. ``"1.8.0"``; local and nightly builds (``INTERNAL``, ``+git``,
            dates) are accepted as they are.

    Returns:
        ``None`` when the pair is known to work (or cannot be judged), else the problem.
    """
    if fbgemm_version == "INTERNAL" or "+git" in fbgemm_version or fbgemm_version[:4].isdigit():
        return None
    want = MATCHED_VERSIONS.get(_minor(torch_version))
    if want is None:
        known = ", ".join(f"torch {t}.x <-> FBGEMM {f}.0" for t, f in MATCHED_VERSIONS.items())
        return f"torch {torch_version} has no known FBGEMM build (known pairs: {known})"
    if _minor(fbgemm_version) != want:
        return (
            f"FBGEMM {fbgemm_version} does not match torch {torch_version}: "
            f"torch {_minor(torch_version)}.x needs FBGEMM {want}.0"
        )
    return None


try:
    import fbgemm_gpu
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        BoundsCheckMode,
        EmbeddingLocation,
        PoolingMode,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
        IntNBitTableBatchedEmbeddingBagsCodegen,
        rounded_row_size_in_bytes,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        DenseTableBatchedEmbeddingBagsCodegen,
        SplitTableBatchedEmbeddingBagsCodegen,
    )
    from fbgemm_gpu.tbe.cache.cache_config import CacheAlgorithm
    from fbgemm_gpu.tbe.config.embedding_config import ComputeDevice
    from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode as FbgemmWeightDecayMode
except (ImportError, OSError, RuntimeError) as _error:  # OSError: undefined symbols in the .so
    raise ImportError(
        f"embshard-kernels needs FBGEMM (fbgemm_gpu) built for torch {torch.__version__}, "
        f"but importing it failed: {_error}. {install_hint()}"
    ) from _error

FBGEMM_VERSION: str = str(getattr(fbgemm_gpu, "__version__", "INTERNAL"))
FBGEMM_VARIANT: str = str(getattr(fbgemm_gpu, "__variant__", "INTERNAL"))

_mismatch = check_versions(torch.__version__, FBGEMM_VERSION)
if _mismatch is not None:
    raise ImportError(f"{_mismatch}. {install_hint()}")

__all__ = [
    "FBGEMM_VARIANT",
    "FBGEMM_VERSION",
    "MATCHED_VERSIONS",
    "BoundsCheckMode",
    "CacheAlgorithm",
    "ComputeDevice",
    "DenseTableBatchedEmbeddingBagsCodegen",
    "EmbOptimType",
    "EmbeddingLocation",
    "FbgemmWeightDecayMode",
    "rounded_row_size_in_bytes",
    "IntNBitTableBatchedEmbeddingBagsCodegen",
    "PoolingMode",
    "SparseType",
    "SplitTableBatchedEmbeddingBagsCodegen",
    "check_versions",
    "install_hint",
]
