"""Serve a model ahead of time: export it, compile it into one package file, load it back.

:func:`package_for_serving` exports an eval-mode model with ``torch.export`` (the first dimension
of every input tensor dynamic, so one package serves any batch size), compiles it with
AOTInductor (Inductor's freezing: parameters and buffers become constants of the compiled code)
into a ``.pt2`` package, and checks the loaded package against the eager model on the example.
:func:`load_for_serving` gives a callable taking the model's inputs and returning its outputs
(``KeyedJaggedTensor`` and ``KeyedTensor`` included) in a process that imports only torch and
embshard-kernels: no dynamo, no guards and no Python model code run per call. The weights are
records of the package file, mapped when it loads (``serving_constants``): held once, read as
they are touched. An id outside its table fails inside the package (FBGEMM's FATAL bounds
check); the loaded model then raises the input check's ``IdOutOfRangeError`` (a ``ValueError``)
naming feature, sample and id (the package records each feature's table rows), at no cost to
calls that succeed. Compiling needs Inductor's C++ compiler; loading does not.

A process without Python serves a package through libtorch's ``AOTIModelPackageLoader`` once it
has loaded FBGEMM's operator libraries (:func:`fbgemm_libraries`) and given the loader the
package's constants (``serving_constants.MANIFEST``); ``cpp/serve_package.cpp``, installed with
this package, is such a server. Its inputs are the model's inputs flattened (dense features,
then each KJT's values, weights if any, and lengths).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.export import Dim, ShapesCollection

from embshard_kernels.collections import EmbeddingBagCollection, EmbeddingCollection
from embshard_kernels.quantize import QuantEmbeddingBagCollection, QuantEmbeddingCollection
from embshard_kernels.serving_constants import map_constants, repack_constants
from embshard_types.sharded_module import ShardedModule
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.sparse.kjt_checks import KJTChecker

__all__ = ["ServedModel", "fbgemm_libraries", "load_for_serving", "package_for_serving"]

_FEATURE_ROWS = "embshard.feature_rows"
"""Package metadata key: JSON ``{feature: table rows}`` of the model's collections."""

ATOL = 1e-5
RTOL = 1e-5
"""How far the package's outputs on the example may be from the eager model's (Inductor fuses
and reorders float operations)."""


def package_for_serving(
    model: nn.Module,
    example_inputs: tuple[Any, ...],
    path: str | Path,
    *,
    dynamic_batch: bool = True,
) -> Path:
    """Export ``model`` and compile it ahead of time into the package ``path`` (``.pt2``).

    Args:
        model: in eval mode (``model.eval()``); any module ``torch.export`` can trace, e.g. a
            DLRM over an unsharded or quantized collection.
        example_inputs: positional inputs of one batch; with ``dynamic_batch`` every input tensor
            needs at least 2 rows (a size of 0 or 1 would be fixed into the program).
        dynamic_batch: serve any first dimension (batch size, number of ids); ``False`` fixes
            every shape to the example's.

    Returns:
        ``path``, after its loaded package gave the eager model's outputs on the example.

    Raises:
        ValueError: the model is in training mode or sharded, or an example tensor is too small
            to be dynamic.
        RuntimeError: the package's outputs differ from the eager model's (beyond ``ATOL`` /
            ``RTOL``); ``path`` is left as it was.

    A package already at ``path`` is replaced only once the new one passed its check, by
    renaming: processes serving the old one keep serving it.
    """
    if model.training:
        raise ValueError(
            "package_for_serving: the model is in training mode; call model.eval() first "
            "(a served program runs no backward and no dropout)"
        )
    sharded = [n or "the model" for n, m in model.named_modules() if isinstance(m, ShardedModule)]
    if sharded:
        raise ValueError(
            f"package_for_serving: {sharded[0]!r} is sharded ({len(sharded)} sharded module(s)); "
            "a package serves in one process: package the unsharded model with the trained "
            "tables (e.g. quantize_embeddings on a model filled by load_quantized_export from "
            "`embshard checkpoint export --quantize`)"
        )
    path = Path(path)
    shapes = _dynamic_rows(model, example_inputs) if dynamic_batch else None
    with torch.no_grad():
        expected = model(*example_inputs)
        program = torch.export.export(model, example_inputs, dynamic_shapes=shapes, strict=False)
    configs: dict[str, Any] = {
        "freezing": True,
        "aot_inductor.metadata": {_FEATURE_ROWS: json.dumps(_feature_rows(model))},
    }
    if program.state_dict or program.constants:
        # Weights beside the compiled code, one record each, mapped from the file when loaded
        # (serving_constants): held once, never read whole before being copied.
        configs["aot_inductor.package_constants_in_so"] = False
        configs["aot_inductor.package_constants_on_disk_format"] = "pickle_weights"
        # oneDNN-prepacked weights are opaque tensors with no storage to write as a record
        configs["cpp.weight_prepack"] = False
    compiled = path.with_name(f".{path.stem}.compiled.pt2")
    packed = path.with_name(f".{path.stem}.packed.pt2")
    try:
        with warnings.catch_warnings():
            # torch warns of a weight viewing part of a larger storage (freezing can leave
            # one, e.g. a small Linear's): it pickles the whole storage anyway, and
            # repack_constants writes whole storages with each view's sizes and offset.
            warnings.filterwarnings("ignore", message="No complete tensor found in the group")
            torch._inductor.aoti_compile_and_package(
                program, package_path=str(compiled), inductor_configs=configs
            )
        repack_constants(compiled, packed)
        _check_same(load_for_serving(packed)(*example_inputs), expected, path)
        # A new file renamed over the old one, never the old one rewritten: a server that has
        # the old package's weights mapped keeps them.
        os.replace(packed, path)
    finally:
        compiled.unlink(missing_ok=True)
        packed.unlink(missing_ok=True)
    return path


class ServedModel:
    """A packaged model, called with the model's inputs; see the module docstring.

    Inputs must have the example's structure (the same KJT keys in the same order, weights or
    not); anything else raises ``ValueError`` before the package runs.
    """

    def __init__(
        self,
        runner: Any,
        feature_rows: Mapping[str, int],
        constants: Mapping[str, Tensor] | None = None,
    ) -> None:
        self._loader = runner.loader
        self._constants = dict(constants or {})  # user-managed: the package's code reads them
        in_spec, out_spec = self._loader.get_call_spec()
        self._in_spec = pytree.treespec_loads(in_spec)
        self._out_spec = pytree.treespec_loads(out_spec)
        self.feature_rows = dict(feature_rows)
        """Each feature's table rows, as the packaged model's collections had them."""

    @property
    def constants(self) -> Mapping[str, Tensor]:
        """The package's weights as its compiled code names them, views of one mapping of the
        package file (empty for a package that keeps them inside its library)."""
        return MappingProxyType(self._constants)

    def __call__(self, *inputs: Any) -> Any:
        leaves, spec = pytree.tree_flatten((inputs, {}))
        if spec != self._in_spec:
            raise ValueError(
                f"served model: the inputs' structure {spec} is not the package's "
                f"{self._in_spec} (same positional inputs, KJT keys in the same order)"
            )
        try:
            outputs = self._loader.boxed_run([x for x in leaves if isinstance(x, Tensor)])
        except RuntimeError as e:
            error = _id_error(inputs, self.feature_rows)
            if error is None:
                raise
            raise error from e
        return pytree.tree_unflatten(outputs, self._out_spec)


def load_for_serving(path: str | Path) -> ServedModel:
    """The compiled model in the package ``path``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"load_for_serving: no package at {path}")
    runner = torch._inductor.aoti_load_package(str(path))
    constants = map_constants(path)
    if constants is not None:
        runner.loader.load_constants(constants, False, True, True)  # full update, user-managed
    rows = json.loads(runner.get_metadata().get(_FEATURE_ROWS, "{}"))
    return ServedModel(runner, {str(k): int(v) for k, v in rows.items()}, constants)


def fbgemm_libraries() -> list[Path]:
    """FBGEMM's operator libraries, in the order FBGEMM loads them: what a process without
    Python loads (``dlopen`` with ``RTLD_GLOBAL``) before it loads a package."""
    from embshard_kernels._fbgemm import fbgemm_gpu

    root = Path(fbgemm_gpu.__file__).parent
    names = getattr(fbgemm_gpu, "fbgemm_gpu_libraries", None) or sorted(
        p.stem for p in root.glob("fbgemm_gpu_*.so")
    )
    return [root / f"{name}.so" for name in names if (root / f"{name}.so").is_file()]


def _dynamic_rows(model: nn.Module, example_inputs: tuple[Any, ...]) -> Any:
    """Dynamic shapes marking the first dimension of every tensor leaf of the inputs."""
    shapes = ShapesCollection()
    for i, leaf in enumerate(pytree.tree_leaves(example_inputs)):
        if not isinstance(leaf, Tensor) or leaf.dim() == 0:
            continue
        if leaf.shape[0] < 2:
            raise ValueError(
                f"package_for_serving: input tensor #{i} of the example has {leaf.shape[0]} "
                "rows; give an example batch whose every tensor has at least 2 rows (or "
                "dynamic_batch=False to serve only the example's shapes)"
            )
        shapes[leaf] = {0: Dim.AUTO}
    return shapes.dynamic_shapes(model, example_inputs)


def _check_same(got: Any, expected: Any, path: Path) -> None:
    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(expected)
    if got_spec != want_spec:
        raise RuntimeError(
            f"package_for_serving: the package {path} returns {got_spec}, the model {want_spec}"
        )
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves, strict=True)):
        if isinstance(w, Tensor) and not torch.allclose(g, w, atol=ATOL, rtol=RTOL):
            worst = float((g - w).abs().max())
            raise RuntimeError(
                f"package_for_serving: output #{i} of the package {path} differs from the eager "
                f"model's by up to {worst:g} on the example (allowed {ATOL:g} + {RTOL:g} x |value|)"
            )


def _feature_rows(model: nn.Module) -> dict[str, int]:
    """Each feature of the model's collections and its table's rows (the smallest, should two
    collections read one feature)."""
    rows: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, EmbeddingBagCollection | QuantEmbeddingBagCollection):
            configs: list[Any] = list(module.embedding_bag_configs())
        elif isinstance(module, EmbeddingCollection | QuantEmbeddingCollection):
            configs = list(module.embedding_configs())
        else:
            continue
        for config in configs:
            for feature in config.feature_names:
                rows[feature] = min(rows.get(feature, config.num_embeddings), config.num_embeddings)
    return rows


def _id_error(inputs: tuple[Any, ...], feature_rows: Mapping[str, int]) -> Exception | None:
    """The input check's error for the inputs' KJTs against the packaged features, if any."""
    for kjt in pytree.tree_leaves(inputs, is_leaf=lambda x: isinstance(x, KeyedJaggedTensor)):
        if not isinstance(kjt, KeyedJaggedTensor):
            continue
        keys: list[str] = kjt.keys()  # a KJT's key list, not a mapping's view
        features = [k for k in keys if k in feature_rows]
        checker = KJTChecker(features, [feature_rows[f] for f in features], weighted=False)
        problem = checker.check(kjt)
        if problem is not None:
            return problem.error(features)
    return None
