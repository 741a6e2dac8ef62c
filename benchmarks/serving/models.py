"""The served models of the serving benchmark: a DLRM on W2's tables, six ways, eager or compiled.

embshard fp32 / INT8 / INT4 (``embshard_dist.models.DLRM`` over embshard's collections, quantized
by ``quantize_embeddings``) and TorchRec 1.8.0 fp32 / INT8 / INT4 (``torchrec.models.dlrm.DLRM``
over TorchRec's collection, quantized by ``torchrec.quant.embedding_modules
.EmbeddingBagCollection.from_float``, as ``torchrec.inference.modules.quantize_embeddings``
does). Every variant holds the same initial W2 weights and, seeded alike, the same dense
parameters; a batch of ``B`` samples is W2's id distribution with 13 dense features.

A variant name ending in ``+compiled`` (e.g. ``embshard-int8+compiled``) is that model under
``torch.compile`` with Inductor's freezing (weights as constants, as for serving): the whole
forward, lookups included, is one graph for embshard. TorchRec's quantized model does not
compile (dynamo stops in FBGEMM's inference module, at the TorchScript cache-location queue);
``build`` returns it anyway and the benchmark reports its error. A name ending in ``+script``
(e.g. ``torchrec-int8+script``) is TorchRec's own serving form: ``torchrec.fx.symbolic_trace``
then ``torch.jit.script``; embshard's models are not TorchScript modules (they export and
compile instead), so ``build`` refuses ``embshard-*+script``. A name ending in ``+aoti`` (e.g.
``embshard-int8+aoti``) is embshard's ahead-of-time serving form: the model packaged by
``embshard_kernels.serving.package_for_serving`` (torch.export + AOTInductor, one ``.pt2``
file, any batch size) and called through ``load_for_serving``; TorchRec's quantized model does
not export, so ``build`` refuses ``torchrec-*+aoti``.
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from benchmarks.compare.workloads import Workload, w2

DENSE_FEATURES = 13
BOTTOM = [512, 256, 128]
TOP = [512, 256, 1]
VARIANTS = (
    "embshard-fp32",
    "embshard-int8",
    "embshard-int4",
    "torchrec-fp32",
    "torchrec-int8",
    "torchrec-int4",
)
COMPILED = "+compiled"
"""Suffix of a variant served under ``torch.compile`` (see the module docstring)."""
SCRIPTED = "+script"
"""Suffix of a TorchRec variant served as TorchScript (see the module docstring)."""
AOTI = "+aoti"
"""Suffix of an embshard variant served as an AOTInductor package (see the module docstring)."""
SERVING_FORMS = (COMPILED, SCRIPTED, AOTI)


@dataclass(frozen=True)
class ServingBatch:
    """One request batch: dense features, and the ids in W2's key order (key-major lengths)."""

    dense: Tensor
    keys: tuple[str, ...]
    lengths: Tensor
    values: Tensor


def workload() -> Workload:
    return w2()


def batches(size: int, count: int, seed: int = 1) -> list[ServingBatch]:
    """``count`` request batches of ``size`` samples."""
    wl = replace(workload(), batch_per_rank=size, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    return [
        ServingBatch(torch.rand(size, DENSE_FEATURES, generator=gen), b.keys, b.lengths, b.values)
        for b in wl.batches(0, 1, count)
    ]


def _weights(wl: Workload) -> dict[str, Tensor]:
    return {t.name: wl.initial_weight(i) for i, t in enumerate(wl.tables)}


def _load_tables(collection: nn.Module, wl: Workload) -> None:
    """Write W2's initial weights into a float collection, one table at a time."""
    state = collection.state_dict()
    with torch.no_grad():
        for i, t in enumerate(wl.tables):
            state[f"embedding_bags.{t.name}.weight"].copy_(wl.initial_weight(i))


def embshard_model(dtype: str) -> nn.Module:
    """embshard's DLRM on W2, fp32 or quantized from fp32 (``quantize_embeddings``)."""
    from embshard_dist.models.dlrm import DLRM
    from embshard_kernels.collections import EmbeddingBagCollection
    from embshard_kernels.quantize import quantize_embeddings
    from embshard_types.configs import EmbeddingBagConfig

    wl = workload()
    configs = [
        EmbeddingBagConfig(
            name=t.name, num_embeddings=t.rows, embedding_dim=t.dim, feature_names=[t.feature]
        )
        for t in wl.tables
    ]
    ebc = EmbeddingBagCollection(configs, device="meta")
    ebc.to_empty(device="cpu")
    _load_tables(ebc, wl)
    torch.manual_seed(0)
    model = DLRM(ebc, DENSE_FEATURES, BOTTOM, TOP)
    model.eval()
    return model if dtype == "fp32" else quantize_embeddings(model, dtype)


def embshard_served_from_export(export: str, dtype: str) -> nn.Module:
    """embshard's quantized DLRM as a server builds it: the architecture on ``meta``, the
    quantized tables from a quantized export (no float table is ever held)."""
    from embshard_dist.checkpoint.export import load_quantized_export
    from embshard_dist.models.dlrm import DLRM
    from embshard_kernels.collections import EmbeddingBagCollection
    from embshard_kernels.quantize import quantize_embeddings
    from embshard_types.configs import EmbeddingBagConfig

    wl = workload()
    configs = [
        EmbeddingBagConfig(
            name=t.name, num_embeddings=t.rows, embedding_dim=t.dim, feature_names=[t.feature]
        )
        for t in wl.tables
    ]
    torch.manual_seed(0)
    model = DLRM(EmbeddingBagCollection(configs, device="meta"), DENSE_FEATURES, BOTTOM, TOP)
    model = quantize_embeddings(model, dtype)
    load_quantized_export(model, export)
    model.eval()
    return model


def torchrec_model(dtype: str) -> nn.Module:
    """TorchRec's DLRM on W2, fp32 or quantized from fp32 as TorchRec's inference does."""
    import torchrec
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import QuantConfig
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEBC

    wl = workload()
    configs = [
        torchrec.EmbeddingBagConfig(
            name=t.name, num_embeddings=t.rows, embedding_dim=t.dim, feature_names=[t.feature]
        )
        for t in wl.tables
    ]
    ebc = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    ebc = ebc.to_empty(device="cpu")
    _load_tables(ebc, wl)
    torch.manual_seed(0)
    model = DLRM(ebc, DENSE_FEATURES, BOTTOM, TOP)
    model.eval()
    if dtype == "fp32":
        return model
    weight = {"int8": torch.qint8, "int4": torch.quint4x2}[dtype]
    float_ebc = model.sparse_arch.embedding_bag_collection
    float_ebc.qconfig = QuantConfig(  # type: ignore[assignment]
        activation=torch.quantization.PlaceholderObserver.with_args(dtype=torch.float),
        weight=torch.quantization.PlaceholderObserver.with_args(dtype=weight),
    )
    model.sparse_arch.embedding_bag_collection = QuantEBC.from_float(float_ebc)
    return model


def eager_of(name: str) -> str:
    """The eager variant a ``+compiled`` or ``+script`` variant serves (``name`` itself if
    it is eager)."""
    for suffix in SERVING_FORMS:
        name = name.removesuffix(suffix)
    return name


def is_variant(name: str) -> bool:
    """Whether ``name`` is a variant: one of ``VARIANTS``, eager, ``+compiled`` or ``+script``."""
    return eager_of(name) in VARIANTS


def build(variant: str) -> tuple[nn.Module, Callable[[ServingBatch], Any]]:
    """The model of ``variant`` and a function that turns a batch into its inputs."""
    if variant.endswith(COMPILED):
        model, inputs = build(variant.removesuffix(COMPILED))
        compiled = torch.compile(model, options={"freezing": True})
        return cast(nn.Module, compiled), inputs
    if variant.endswith(AOTI):
        if not variant.startswith("embshard"):
            raise ValueError(f"{variant}: only embshard's models are packaged with AOTInductor")
        from embshard_kernels.serving import load_for_serving, package_for_serving

        model, inputs = build(variant.removesuffix(AOTI))
        with tempfile.TemporaryDirectory(prefix="embshard-serving-") as tmp:
            package = Path(tmp) / "model.pt2"
            package_for_serving(model, inputs(batches(64, 1, seed=97)[0]), package)
            served = load_for_serving(package)  # the loaded package no longer reads the file
        return cast(nn.Module, served), inputs
    if variant.endswith(SCRIPTED):
        if not variant.startswith("torchrec"):
            raise ValueError(
                f"{variant}: embshard's models are served compiled or exported, not as "
                "TorchScript; use +compiled"
            )
        import torchrec.fx

        model, inputs = build(variant.removesuffix(SCRIPTED))
        scripted = torch.jit.script(torchrec.fx.symbolic_trace(model))
        return cast(nn.Module, scripted), inputs
    library, dtype = variant.split("-")
    if library == "embshard":
        from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

        def embshard_inputs(b: ServingBatch) -> tuple[Tensor, Any]:
            kjt = KeyedJaggedTensor.from_lengths_sync(list(b.keys), b.values, b.lengths)
            return b.dense, kjt

        return embshard_model(dtype), embshard_inputs
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor as TrecKJT

    def torchrec_inputs(b: ServingBatch) -> tuple[Tensor, Any]:
        kjt = TrecKJT.from_lengths_sync(keys=list(b.keys), values=b.values, lengths=b.lengths)
        return b.dense, kjt

    return torchrec_model(dtype), torchrec_inputs


def same_dense_part(a: nn.Module, b: nn.Module) -> bool:
    """Whether two variants' dense parameters are equal (they are seeded alike)."""
    dense_a = {k: v for k, v in a.state_dict().items() if "embedding" not in k}
    dense_b = {k: v for k, v in copy.copy(b).state_dict().items() if "embedding" not in k}
    return dense_a.keys() == dense_b.keys() and all(
        torch.equal(dense_a[k], dense_b[k]) for k in dense_a
    )
