"""Per-table options of the fused (optimizer-in-backward) kernels.

``FusedParams`` is TorchRec's untyped ``fused_params`` dict as a frozen, hashable, validated
dataclass; ``from_dict`` accepts TorchRec's spelling and rejects unknown keys by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from embshard_optim.specs import OptimizerSpec, OptimType
from embshard_types.kernel_params import BoundsCheckMode, CacheParams
from embshard_types.vocab import DataType

_OPTIMIZER_KEYS = frozenset(
    {
        "learning_rate",
        "lr",
        "eps",
        "beta1",
        "beta2",
        "betas",
        "weight_decay",
        "weight_decay_mode",
        "momentum",
        "eta",
        "max_norm",
        "stochastic_rounding",
    }
)
_CACHE_KEYS = {
    "cache_load_factor": "load_factor",
    "cache_algorithm": "algorithm",
    "cache_precision": "precision",
    "cache_reserved_memory": "reserved_memory",
    "prefetch_pipeline": "prefetch_pipeline",
}
_OWN_KEYS = frozenset({"optimizer", "output_dtype", "bounds_check_mode", "cache_params"})


@dataclass(frozen=True)
class FusedParams:
    """Options of a fused kernel (one TBE) beyond the tables' shapes.

    Args:
        optimizer: applied inside the backward (default: FBGEMM's, exact SGD, lr 0.01).
        output_dtype: ``fp32`` or ``fp16`` (``bf16`` on CUDA).
        bounds_check_mode: FBGEMM's own id check, off by default (embshard checks ids first).
        cache_params: device cache of hot rows (UVM caching kernels on CUDA only).
    """

    optimizer: OptimizerSpec = field(default_factory=lambda: OptimizerSpec(OptimType.SGD))
    output_dtype: DataType = DataType.FP32
    bounds_check_mode: BoundsCheckMode = BoundsCheckMode.NONE
    cache_params: CacheParams | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.optimizer, OptimizerSpec):
            raise TypeError(
                f"FusedParams.optimizer must be an OptimizerSpec, got {self.optimizer!r}; "
                "build one with OptimizerSpec.from_name(...) or OptimizerSpec.from_torch(...)"
            )
        output = DataType.parse(self.output_dtype, what="FusedParams.output_dtype")
        if output.is_quantized:
            raise ValueError(f"FusedParams.output_dtype must be a float type, got {output.value!r}")
        object.__setattr__(self, "output_dtype", output)
        mode = self.bounds_check_mode
        if isinstance(mode, Enum) and not isinstance(mode, BoundsCheckMode):
            mode = mode.name  # FBGEMM's own enum: match by name
        object.__setattr__(
            self, "bounds_check_mode", BoundsCheckMode.parse(mode, what="bounds_check_mode")
        )
        if self.cache_params is not None and not isinstance(self.cache_params, CacheParams):
            raise TypeError(
                f"FusedParams.cache_params must be CacheParams, got {self.cache_params!r}"
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FusedParams:
        """Build from TorchRec's ``fused_params`` dict spelling.

        Args:
            data: ``optimizer`` (a name, ``OptimType``, ``EmbOptimType`` or ``OptimizerSpec``),
                its hyperparameters, ``output_dtype``, ``bounds_check_mode`` and the cache
                settings (``cache_*``, ``prefetch_pipeline``) or ``cache_params``.

        Raises:
            ValueError: an unknown key (all valid keys are listed) or an invalid value.
        """
        unknown = sorted(set(data) - _OPTIMIZER_KEYS - _OWN_KEYS - set(_CACHE_KEYS))
        if unknown:
            valid = sorted(_OPTIMIZER_KEYS | _OWN_KEYS | set(_CACHE_KEYS))
            raise ValueError(f"unknown fused_params key(s) {unknown}; valid keys: {valid}")
        hyper = {k: _enum_value(v) for k, v in data.items() if k in _OPTIMIZER_KEYS}
        optimizer = data.get("optimizer", OptimType.SGD)
        if isinstance(optimizer, OptimizerSpec):
            spec = replace(optimizer, **_spec_fields(hyper)) if hyper else optimizer
        else:
            spec = OptimizerSpec.from_name(_enum_value(optimizer), **hyper)
        cache = data.get("cache_params")
        cache_fields = {_CACHE_KEYS[k]: v for k, v in data.items() if k in _CACHE_KEYS}
        if cache_fields:
            cache = replace(cache, **cache_fields) if cache else CacheParams(**cache_fields)
        kwargs: dict[str, Any] = {"optimizer": spec, "cache_params": cache}
        for key in ("output_dtype", "bounds_check_mode"):
            if key in data:
                kwargs[key] = _enum_value(data[key])
        return cls(**kwargs)


def _enum_value(value: Any) -> Any:
    """A foreign enum (FBGEMM's ``SparseType``, ``EmbOptimType``...) as its name or value."""
    if isinstance(value, Enum) and not isinstance(value, OptimType):
        if not isinstance(value.value, str):  # FBGEMM's WeightDecayMode is int-valued
            return "decoupled" if value.name == "DECOUPLE" else value.name
        return value.value
    return value


def _spec_fields(hyper: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(hyper)
    if "lr" in out:
        out["learning_rate"] = out.pop("lr")
    if "betas" in out:
        out["beta1"], out["beta2"] = out.pop("betas")
    return out
