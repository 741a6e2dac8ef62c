"""Choosing quantized comms codecs per collective and direction (TorchRec's ``QCommsConfig``).

``get_qcomm_codecs`` builds one collective's codecs, ``get_qcomm_codecs_registry`` the registry
the sharded modules read (keyed by ``CommOp`` value). Precisions: fp32 (none), fp16, bf16, int8
(FBGEMM's ops or plain torch, the same bytes; ``"auto"``: FBGEMM where it runs). Every bad
choice raises a ``ValueError`` naming the comm op and the direction, before any codec is built.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import unique
from typing import Any, Literal

import torch

from embshard_dist.comm.codecs import (
    DEFAULT_ROW_DIM,
    CastCommCodec,
    Int8RowwiseCommCodec,
    check_row_dim,
)
from embshard_types.comm_codec import (
    NoOpQuantizedCommCodec,
    QCommCodecsRegistry,
    QuantizedCommCodec,
    QuantizedCommCodecs,
)
from embshard_types.vocab import CommOp, ParsableEnum

__all__ = [
    "CommsPrecision",
    "Int8Backend",
    "QCommsConfig",
    "get_qcomm_codecs",
    "get_qcomm_codecs_registry",
]

Int8Backend = Literal["auto", "fbgemm", "torch"]
"""Which implementation serves INT8: FBGEMM's ops, plain torch, or FBGEMM where it runs."""

_INT8_BACKENDS = ("auto", "fbgemm", "torch")


@unique
class CommsPrecision(ParsableEnum):
    """The precision a collective's payload travels in (TorchRec's ``CommType``)."""

    FP32 = "fp32"
    """No compression."""
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"
    """Row-wise: uint8 codes plus a float32 scale and bias per ``row_dim`` elements."""


_CASTS = {CommsPrecision.FP16: torch.float16, CommsPrecision.BF16: torch.bfloat16}


def _where(comm_op: str | None, direction: str) -> str:
    return f"the {direction} codec" + (f" of comm op {comm_op!r}" if comm_op else "")


def _check_loss_scale(scale: float | None, precision: CommsPrecision, where: str) -> None:
    if scale is None:
        return
    if precision not in _CASTS:
        raise ValueError(
            f"{where}: a loss scale only applies to fp16 / bf16, not {precision.value}; "
            "drop the loss scale or pick fp16 / bf16"
        )
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not 0 < scale < 1e38:
        raise ValueError(f"{where}: the loss scale must be a positive finite number, got {scale!r}")


def _parse(
    forward: CommsPrecision | str,
    backward: CommsPrecision | str,
    forward_loss_scale: float | None,
    backward_loss_scale: float | None,
    row_dim: int,
    comm_op: str | None,
) -> tuple[CommsPrecision, CommsPrecision]:
    parsed = []
    for direction, raw, scale in (
        ("forward", forward, forward_loss_scale),
        ("backward", backward, backward_loss_scale),
    ):
        where = _where(comm_op, direction)
        precision = CommsPrecision.parse(raw, what=where)
        _check_loss_scale(scale, precision, where)
        parsed.append(precision)
    check_row_dim(row_dim, "QCommsConfig" + (f" of comm op {comm_op!r}" if comm_op else ""))
    return parsed[0], parsed[1]


@dataclass(frozen=True)
class QCommsConfig:
    """Precisions of one collective's forward payload and backward gradients.

    Args:
        forward_precision: precision of the forward payload (member or string).
        backward_precision: precision of the gradients in the backward pass.
        forward_loss_scale: fp16 / bf16 only: multiply before sending, divide after receiving.
        backward_loss_scale: the same for the backward pass (keeps small gradients in range).
        row_dim: INT8 only: elements sharing one scale and bias (a positive multiple of 4).

    Raises:
        ValueError: an unknown precision, a loss scale on fp32 / int8, or a bad ``row_dim``.
    """

    forward_precision: CommsPrecision | str = CommsPrecision.FP32
    backward_precision: CommsPrecision | str = CommsPrecision.FP32
    forward_loss_scale: float | None = None
    backward_loss_scale: float | None = None
    row_dim: int = DEFAULT_ROW_DIM

    def __post_init__(self) -> None:
        forward, backward = _parse(
            self.forward_precision,
            self.backward_precision,
            self.forward_loss_scale,
            self.backward_loss_scale,
            self.row_dim,
            None,
        )
        object.__setattr__(self, "forward_precision", forward)
        object.__setattr__(self, "backward_precision", backward)

    @property
    def forward(self) -> CommsPrecision:
        """The parsed forward precision."""
        return CommsPrecision.parse(self.forward_precision)

    @property
    def backward(self) -> CommsPrecision:
        """The parsed backward precision."""
        return CommsPrecision.parse(self.backward_precision)


def _int8_codec(
    row_dim: int, backend: str, device: torch.device | str | None, where: str
) -> QuantizedCommCodec[Any]:
    if backend == "torch":
        return Int8RowwiseCommCodec(row_dim)
    try:
        from embshard_kernels.comm_codecs import (
            FbgemmInt8RowwiseCommCodec,
            fbgemm_int8_rowwise_supported,
        )
    except ImportError as error:
        if backend == "auto":
            return Int8RowwiseCommCodec(row_dim)
        raise ValueError(
            f"{where}: int8 with int8_backend='fbgemm' needs FBGEMM, which does not import "
            f"({error}); use int8_backend='auto' or 'torch' for the pure-torch int8 codec"
        ) from error
    if fbgemm_int8_rowwise_supported(device):
        return FbgemmInt8RowwiseCommCodec(row_dim)
    if backend == "auto":
        return Int8RowwiseCommCodec(row_dim)
    name = torch.device(device if device is not None else "cpu").type
    raise ValueError(
        f"{where}: int8 with int8_backend='fbgemm' needs FBGEMM's fused 8-bit row-wise "
        f"quantize ops, which the installed FBGEMM build does not run on device {name!r}; "
        "use int8_backend='auto' or 'torch' for the pure-torch int8 codec, or fp16 / bf16"
    )


def _codec(
    config: QCommsConfig,
    direction: str,
    backend: str,
    device: torch.device | str | None,
    comm_op: str | None,
) -> QuantizedCommCodec[Any]:
    precision = config.forward if direction == "forward" else config.backward
    if precision == CommsPrecision.FP32:
        return NoOpQuantizedCommCodec()
    if precision in _CASTS:
        scale = config.forward_loss_scale if direction == "forward" else config.backward_loss_scale
        return CastCommCodec(_CASTS[precision], scale)
    return _int8_codec(config.row_dim, backend, device, _where(comm_op, direction))


def _codecs(
    config: QCommsConfig, backend: str, device: torch.device | str | None, comm_op: str | None
) -> QuantizedCommCodecs:
    if backend not in _INT8_BACKENDS:
        where = f" for comm op {comm_op!r}" if comm_op else ""
        raise ValueError(
            f"unknown int8_backend {backend!r}{where}; expected one of {_INT8_BACKENDS}"
        )
    return QuantizedCommCodecs(
        forward=_codec(config, "forward", backend, device, comm_op),
        backward=_codec(config, "backward", backend, device, comm_op),
    )


def get_qcomm_codecs(
    forward: CommsPrecision | str = CommsPrecision.FP32,
    backward: CommsPrecision | str = CommsPrecision.FP32,
    *,
    forward_loss_scale: float | None = None,
    backward_loss_scale: float | None = None,
    row_dim: int = DEFAULT_ROW_DIM,
    int8_backend: Int8Backend = "auto",
    device: torch.device | str | None = None,
    comm_op: CommOp | str | None = None,
) -> QuantizedCommCodecs:
    """The forward / backward codecs of one collective.

    Args:
        forward: precision of the forward payload.
        backward: precision of the backward gradients.
        forward_loss_scale, backward_loss_scale: see ``QCommsConfig``.
        row_dim: INT8 elements per scale and bias (a positive multiple of 4).
        int8_backend: ``"auto"``, ``"fbgemm"`` or ``"torch"`` (see the module docstring).
        device: where the payloads live (decides whether FBGEMM's INT8 ops can run).
        comm_op: the collective these are for, named in error messages.
    """
    op = CommOp.parse(comm_op, what="get_qcomm_codecs").value if comm_op is not None else None
    fwd, bwd = _parse(forward, backward, forward_loss_scale, backward_loss_scale, row_dim, op)
    config = QCommsConfig(fwd, bwd, forward_loss_scale, backward_loss_scale, row_dim)
    return _codecs(config, int8_backend, device, op)


def get_qcomm_codecs_registry(
    configs: Mapping[CommOp | str, QCommsConfig | tuple[CommsPrecision | str, CommsPrecision | str]]
    | QCommsConfig,
    *,
    comm_ops: Iterable[CommOp | str] | None = None,
    row_dim: int = DEFAULT_ROW_DIM,
    int8_backend: Int8Backend = "auto",
    device: torch.device | str | None = None,
) -> QCommCodecsRegistry:
    """Codecs per collective, keyed by ``CommOp`` value, for the sharded modules.

    Args:
        configs: per comm op a ``QCommsConfig`` or a ``(forward, backward)`` precision pair; or
            one ``QCommsConfig`` for every op in ``comm_ops``. Ops left out send float32.
        comm_ops: the ops a single ``QCommsConfig`` applies to (default: every ``CommOp``).
        row_dim: INT8 ``row_dim`` for the ops given as precision pairs.
        int8_backend: ``"auto"``, ``"fbgemm"`` or ``"torch"`` (see the module docstring).
        device: where the payloads live.

    Raises:
        ValueError: an unknown comm op or precision, or an unsupported choice; the message names
            the comm op and the direction.
        TypeError: a value that is neither a ``QCommsConfig`` nor a pair.
    """
    if isinstance(configs, QCommsConfig):
        ops = list(CommOp) if comm_ops is None else list(comm_ops)
        configs = dict.fromkeys(ops, configs)
    elif comm_ops is not None:
        raise ValueError("comm_ops only applies when configs is a single QCommsConfig")
    registry: QCommCodecsRegistry = {}
    for key, value in configs.items():
        op = CommOp.parse(key, what="get_qcomm_codecs_registry").value
        if isinstance(value, QCommsConfig):
            registry[op] = _codecs(value, int8_backend, device, op)
        elif isinstance(value, tuple) and len(value) == 2:
            registry[op] = get_qcomm_codecs(
                value[0],
                value[1],
                row_dim=row_dim,
                int8_backend=int8_backend,
                device=device,
                comm_op=op,
            )
        else:
            raise TypeError(
                f"comm op {op!r}: expected a QCommsConfig or a (forward, backward) precision "
                f"pair such as ('fp16', 'bf16'), got {value!r}"
            )
    return registry
