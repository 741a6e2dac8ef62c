"""The fused optimizer of an embedding kernel: its tables' state, exposed by table and by name.

:class:`EmbeddingFusedOptimizer` is a ``KeyedOptimizer`` over the kernel's own buffers:
parameter ``"{table}.weight"``, state ``"{table}.momentum1"``... as ``ShardedTensor`` /
``DTensor`` / plain tensors (no copies: loading writes into the kernel). Shapes are checked
against the shard metadata at construction; ``step()`` pushes the learning rate to the kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch import Tensor

from embshard_optim.fused import FusedOptimizer
from embshard_optim.sharded_state import (
    StateFormat,
    check_tiling,
    make_dtensor,
    make_mesh,
    make_sharded_tensor,
    state_layout,
)
from embshard_types.shard_spec import ShardSpec

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh


@runtime_checkable
class FusedKernelLike(Protocol):
    """What the fused optimizer needs of a kernel (FBGEMM's TBE modules fit it).

    Both lists hold one entry per table shard the kernel holds, in the same order as the
    ``tables`` given to :class:`EmbeddingFusedOptimizer`.
    """

    def set_learning_rate(self, lr: float) -> None:
        """Use ``lr`` for the following updates."""
        ...

    def get_optimizer_state(self) -> list[dict[str, Tensor]]:
        """Per table shard, its state tensors (``[rows]`` or ``[rows, cols]``) in order.

        An empty list means the optimizer keeps no state (SGD).
        """
        ...

    def split_embedding_weights(self) -> list[Tensor]:
        """Per table shard, its ``[rows, cols]`` weight (a view of the kernel's storage)."""
        ...


@dataclass(frozen=True, kw_only=True)
class TableShardInfo:
    """One table shard held by a fused kernel, and where the table's other shards are.

    Raises:
        ValueError: the shards are not 2-D, do not tile the table, or ``local_shard`` is not
            among ``all_shards``.
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    local_shard: ShardSpec
    all_shards: tuple[ShardSpec, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "all_shards", tuple(self.all_shards))
        where = f"table {self.name!r}"
        if self.num_embeddings < 0 or self.embedding_dim < 0:
            raise ValueError(
                f"{where}: size [{self.num_embeddings}, {self.embedding_dim}] is negative"
            )
        check_tiling(self.all_shards, self.size, f"{where} weight")
        if self.local_shard not in self.all_shards:
            raise ValueError(
                f"{where}: local shard {self.local_shard} is not among the table's shards"
            )

    @property
    def size(self) -> tuple[int, int]:
        """``(num_embeddings, embedding_dim)``."""
        return (self.num_embeddings, self.embedding_dim)

    @classmethod
    def whole(
        cls,
        name: str,
        num_embeddings: int,
        embedding_dim: int,
        *,
        rank: int = 0,
        device: str = "cpu",
    ) -> TableShardInfo:
        """An unsharded table: one shard covering it, on ``rank``."""
        spec = ShardSpec.on(rank, device, (0, 0), (num_embeddings, embedding_dim))
        return cls(
            name=name,
            num_embeddings=num_embeddings,
            embedding_dim=embedding_dim,
            local_shard=spec,
            all_shards=(spec,),
        )


@dataclass
class _TableParts:
    info: TableShardInfo
    weights: list[tuple[Tensor, ShardSpec]]
    states: list[list[Tensor]]  # per local shard, its state tensors in order


class EmbeddingFusedOptimizer(FusedOptimizer):
    """The keyed view of a fused embedding kernel's tables and optimizer state.

    Args:
        tables: one entry per table shard the kernel holds, in the kernel's order.
        learning_rate: the kernel's current learning rate (the param group's ``"lr"``).
        pg: the process group the shard placements refer to (``None``: the default group).
        state_format: ``ShardedTensor`` (default), ``DTensor``, or plain tensors (``TENSOR``:
            unsharded tables only).
        create_for_table: the optimizer of this table only (parameter key ``""``).
        param_weight_for_table: with ``create_for_table``, the parameter to key the state by.

    Raises:
        ValueError: the kernel's lists do not match ``tables``, a shape disagrees with the shard
            metadata, or the arguments do not fit together.
    """

    def __init__(
        self,
        kernel: FusedKernelLike,
        tables: Sequence[TableShardInfo],
        *,
        learning_rate: float,
        pg: ProcessGroup | None = None,
        state_format: StateFormat | str = StateFormat.SHARDED_TENSOR,
        create_for_table: str | None = None,
        param_weight_for_table: Tensor | None = None,
    ) -> None:
        self._kernel = kernel
        self._pg = pg
        self._format = StateFormat.parse(state_format, what="EmbeddingFusedOptimizer")
        self._mesh: DeviceMesh | None = None
        if (create_for_table is None) != (param_weight_for_table is None):
            raise ValueError(
                "create_for_table and param_weight_for_table go together: pass both (one "
                "table's optimizer) or neither (the whole kernel's)"
            )
        parts = _collect(kernel, tables)
        if create_for_table is not None:
            if create_for_table not in parts:
                raise ValueError(
                    f"create_for_table={create_for_table!r} is not among the kernel's tables "
                    f"{sorted(parts)}"
                )
            parts = {create_for_table: parts[create_for_table]}

        params: dict[str, Tensor] = {}
        state: dict[Tensor, dict[str, Any]] = {}
        for name, table in parts.items():
            if param_weight_for_table is not None:
                weight, key = param_weight_for_table, ""
            else:
                weight, key = self._expose(table, table.weights, rowwise=False), f"{name}.weight"
            params[key] = weight
            state[weight] = {
                f"{name}.momentum{index + 1}": self._expose_state(table, index)
                for index in range(len(table.states[0]) if table.states else 0)
            }
        super().__init__(params, state, [{"params": list(params.values()), "lr": learning_rate}])

    # -- exposing tensors ------------------------------------------------------------------

    def _expose_state(self, table: _TableParts, index: int) -> Tensor:
        local = [
            (shard_states[index], spec)
            for shard_states, (_, spec) in zip(table.states, table.weights, strict=True)
        ]
        return self._expose(table, local, rowwise=local[0][0].dim() == 1)

    def _expose(
        self, table: _TableParts, local: list[tuple[Tensor, ShardSpec]], *, rowwise: bool
    ) -> Tensor:
        info = table.info
        specs, size = state_layout(info.all_shards, info.size, rowwise=rowwise, what=info.name)
        by_weight_spec = dict(zip(info.all_shards, specs, strict=True))
        pieces = [(tensor, by_weight_spec[spec]) for tensor, spec in local]
        if self._format is StateFormat.TENSOR:
            if len(specs) != 1:
                raise ValueError(
                    f"table {info.name!r} has {len(specs)} shards; StateFormat.TENSOR is for "
                    "unsharded tables, use SHARDED_TENSOR or DTENSOR"
                )
            return pieces[0][0]
        if self._format is StateFormat.DTENSOR:
            if self._mesh is None:
                self._mesh = make_mesh(self._pg, pieces[0][0].device.type)
            return make_dtensor(pieces, specs, size, self._mesh)
        return make_sharded_tensor(pieces, specs, size, self._pg)

    # -- kernel hyperparameters -------------------------------------------------------------

    def _push_learning_rate(self) -> None:
        self._kernel.set_learning_rate(float(self.param_groups[0]["lr"]))

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Push the param group's learning rate to the kernel (the update ran in backward)."""
        self._push_learning_rate()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Push the param group's learning rate to the kernel (there are no gradients)."""
        self._push_learning_rate()

    def post_load_state_dict(self) -> None:
        """Push the loaded learning rate to the kernel."""
        self._push_learning_rate()

    def set_optimizer_step(self, step: int) -> None:
        """Set the kernel's step counter (``TypeError`` if it has no ``set_optimizer_step``)."""
        setter = getattr(self._kernel, "set_optimizer_step", None)
        if setter is None:
            raise TypeError(
                f"kernel {type(self._kernel).__name__} has no set_optimizer_step(step); its "
                "step counter cannot be set"
            )
        setter(step)


def _collect(kernel: FusedKernelLike, tables: Sequence[TableShardInfo]) -> dict[str, _TableParts]:
    """Pair the kernel's weights and states with ``tables``, grouped by table, all checked."""
    weights = kernel.split_embedding_weights()
    states = kernel.get_optimizer_state()
    if len(weights) != len(tables) or (states and len(states) != len(tables)):
        raise ValueError(
            f"the kernel holds {len(weights)} weights and {len(states)} optimizer states, but "
            f"{len(tables)} table shards were described; give one TableShardInfo per kernel "
            "table, in the kernel's order"
        )
    parts: dict[str, _TableParts] = {}
    for position, (info, weight) in enumerate(zip(tables, weights, strict=True)):
        where = f"table {info.name!r} (kernel table {position})"
        local_size = tuple(info.local_shard.sizes)
        if tuple(weight.shape) != local_size:
            raise ValueError(
                f"{where}: the kernel's weight is {list(weight.shape)}, its shard metadata says "
                f"{list(local_size)}"
            )
        shard_states = list(states[position].values()) if states else []
        for key, tensor in (states[position] if states else {}).items():
            if tuple(tensor.shape) not in (local_size[:1], local_size):
                raise ValueError(
                    f"{where}: optimizer state {key!r} is {list(tensor.shape)}; expected "
                    f"[{local_size[0]}] (row-wise) or {list(local_size)} (point-wise)"
                )
        table = parts.setdefault(info.name, _TableParts(info, [], []))
        if table.info.size != info.size or table.info.all_shards != info.all_shards:
            raise ValueError(f"{where}: its size or shard list differs from an earlier shard's")
        if table.states and [t.dim() for t in table.states[0]] != [t.dim() for t in shard_states]:
            raise ValueError(f"{where}: its optimizer states differ from an earlier shard's")
        if any(spec == info.local_shard for _, spec in table.weights):
            raise ValueError(f"{where}: shard {info.local_shard} is given twice")
        table.weights.append((weight, info.local_shard))
        table.states.append(shard_states)
    return parts
