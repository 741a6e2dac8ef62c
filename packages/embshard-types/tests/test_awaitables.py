"""Awaitables: callbacks, waiting once, every lazy trigger, lazy item access, device-to-host."""

from __future__ import annotations

import copy
import operator
import pickle
import subprocess
import sys
from collections import namedtuple
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.overrides import handle_torch_function, has_torch_function

from embshard_types.awaitables import (
    Awaitable,
    DeviceToHostTensorAwaitable,
    GetItemLazyAwaitable,
    LazyAwaitable,
    LazyGetItemMixin,
    LazyNoWait,
    NoWait,
)


class CountingLazy(LazyAwaitable[Any]):
    """A lazy awaitable that counts how often its value is produced."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value_ = value
        self.waits = 0

    def _wait_impl(self) -> Any:
        self.waits += 1
        return self.value_


class CountingAwaitable(Awaitable[int]):
    def __init__(self, value: int) -> None:
        super().__init__()
        self.value_ = value
        self.waits = 0

    def _wait_impl(self) -> int:
        self.waits += 1
        return self.value_


class KeyedLazy(LazyGetItemMixin[str, torch.Tensor], CountingLazy):
    pass


# --- Awaitable / NoWait ------------------------------------------------------------------------


def test_nowait_returns_its_object() -> None:
    obj = object()
    assert NoWait(obj).wait() is obj


def test_callbacks_apply_in_order() -> None:
    aw = NoWait(2)
    aw.callbacks.append(lambda x: x + 3)
    aw.callbacks.append(lambda x: x * 10)
    assert aw.wait() == 50  # (2 + 3) * 10, not 2 * 10 + 3


def test_plain_awaitable_waits_on_every_call() -> None:
    aw = CountingAwaitable(1)
    aw.wait()
    aw.wait()
    assert aw.waits == 2


def test_awaitable_is_abstract() -> None:
    with pytest.raises(TypeError):
        Awaitable()  # type: ignore[abstract]
    with pytest.raises(TypeError):
        LazyAwaitable()  # type: ignore[abstract]


# --- LazyAwaitable: waits exactly once ---------------------------------------------------------


def test_lazy_waits_once_across_triggers_and_runs_callbacks_once() -> None:
    lazy = CountingLazy(torch.tensor([1.0, 2.0]))
    calls: list[int] = []

    def cb(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return t * 2

    lazy.callbacks.append(cb)
    assert not lazy.is_waited
    torch.testing.assert_close(lazy + 1, torch.tensor([3.0, 5.0]))
    torch.testing.assert_close(torch.sum(lazy), torch.tensor(6.0))
    assert lazy.shape == (2,)
    torch.testing.assert_close(lazy.wait(), torch.tensor([2.0, 4.0]))
    assert lazy.waits == 1
    assert calls == [1]
    assert lazy.is_waited


def test_lazy_caches_a_none_result() -> None:
    lazy = CountingLazy(None)
    assert lazy.wait() is None
    assert lazy.wait() is None
    assert lazy.waits == 1


def test_lazy_nowait() -> None:
    t = torch.arange(3.0)
    lazy = LazyNoWait(t)
    torch.testing.assert_close(lazy * 2, t * 2)
    assert lazy.wait() is t


# --- LazyAwaitable: operators ------------------------------------------------------------------

BINARY: list[tuple[str, Callable[[Any, Any], Any]]] = [
    ("add", operator.add),
    ("sub", operator.sub),
    ("mul", operator.mul),
    ("truediv", operator.truediv),
    ("floordiv", operator.floordiv),
    ("mod", operator.mod),
    ("pow", operator.pow),
    ("and", operator.and_),
    ("or", operator.or_),
    ("xor", operator.xor),
    ("lshift", operator.lshift),
    ("rshift", operator.rshift),
    ("eq", operator.eq),
    ("ne", operator.ne),
    ("lt", operator.lt),
    ("le", operator.le),
    ("gt", operator.gt),
    ("ge", operator.ge),
]
INT_OPS = {"and", "or", "xor", "lshift", "rshift"}


def _operands(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if name in INT_OPS:
        return torch.tensor([6, 3, 12]), torch.tensor([1, 2, 3])
    return torch.tensor([6.0, 3.0, 12.0]), torch.tensor([4.0, 2.0, 5.0])


@pytest.mark.parametrize(("name", "op"), BINARY, ids=[n for n, _ in BINARY])
def test_binary_operator_waits(name: str, op: Callable[[Any, Any], Any]) -> None:
    a, b = _operands(name)
    lazy = CountingLazy(a)
    torch.testing.assert_close(op(lazy, b), op(a, b))
    assert lazy.waits == 1


@pytest.mark.parametrize(("name", "op"), BINARY, ids=[n for n, _ in BINARY])
def test_binary_operator_with_python_scalar_on_the_left(
    name: str, op: Callable[[Any, Any], Any]
) -> None:
    # int OP lazy: int's method returns NotImplemented, so the reflected method (or, for
    # comparisons, the swapped one) of the awaitable runs.
    a, _ = _operands(name)
    lazy = CountingLazy(a)
    torch.testing.assert_close(op(3, lazy), op(3, a))
    assert lazy.waits == 1


@pytest.mark.parametrize(
    "name",
    [
        "radd",
        "rsub",
        "rmul",
        "rtruediv",
        "rfloordiv",
        "rmod",
        "rpow",
        "rmatmul",
        "rand",
        "ror",
        "rxor",
        "rlshift",
        "rrshift",
    ],
)
def test_reflected_method_puts_the_awaitable_on_the_right(name: str) -> None:
    a, b = _operands(name[1:])
    if name == "rmatmul":
        a, b = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[0.5, 1.0], [2.0, 0.0]])
    lazy = CountingLazy(a)
    got = getattr(lazy, f"__{name}__")(b)
    forward = getattr(operator, name[1:] + ("_" if name[1:] in ("and", "or") else ""))
    torch.testing.assert_close(got, forward(b, a))
    assert lazy.waits == 1


def test_both_operands_lazy() -> None:
    x, y = CountingLazy(torch.tensor([2.0])), CountingLazy(torch.tensor([5.0]))
    torch.testing.assert_close(x * y, torch.tensor([10.0]))
    torch.testing.assert_close(x - y, torch.tensor([-3.0]))
    assert (x.waits, y.waits) == (1, 1)


def test_tensor_on_the_left_dispatches_through_torch_function() -> None:
    lazy = CountingLazy(torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(torch.tensor([10.0, 10.0]) - lazy, torch.tensor([9.0, 8.0]))
    assert lazy.waits == 1


def test_matmul_both_ways() -> None:
    m = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    v = torch.tensor([1.0, -1.0])
    torch.testing.assert_close(CountingLazy(m) @ v, m @ v)
    torch.testing.assert_close(v @ CountingLazy(m), v @ m)


@pytest.mark.parametrize(
    ("op", "value"),
    [
        (operator.neg, torch.tensor([1.0, -2.0])),
        (operator.pos, torch.tensor([1.0, -2.0])),
        (abs, torch.tensor([1.0, -2.0])),
        (operator.invert, torch.tensor([1, 6])),
    ],
    ids=["neg", "pos", "abs", "invert"],
)
def test_unary_operator_waits(op: Callable[[Any], Any], value: torch.Tensor) -> None:
    lazy = CountingLazy(value)
    torch.testing.assert_close(op(lazy), op(value))
    assert lazy.waits == 1


def test_operators_work_on_non_tensor_results() -> None:
    assert CountingLazy(7) + 1 == 8
    assert 10 - CountingLazy(7) == 3
    assert CountingLazy((1, 2)).__add__((3,)) == (1, 2, 3)
    assert CountingLazy("ab") + "c" == "abc"
    assert CountingLazy(5) == 5
    assert CountingLazy(5) != 6


def test_indexing_a_plain_lazy_awaitable_waits() -> None:
    lazy = CountingLazy({"a": 1})
    assert lazy["a"] == 1
    assert lazy.waits == 1


def test_lazy_awaitable_stays_hashable_by_identity() -> None:
    lazy = CountingLazy(torch.ones(1))
    assert {lazy: 1}[lazy] == 1
    assert lazy.waits == 0


# --- LazyAwaitable: torch functions and attributes ---------------------------------------------


def test_torch_function_resolves_nested_lists_and_tuples() -> None:
    a, b = CountingLazy(torch.ones(2)), CountingLazy(torch.zeros(2))
    torch.testing.assert_close(
        torch.cat([a, b, torch.full((1,), 5.0)]), torch.tensor([1, 1, 0, 0, 5.0])
    )
    torch.testing.assert_close(torch.stack((a, b)), torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    assert (a.waits, b.waits) == (1, 1)


def test_torch_function_resolves_keyword_arguments() -> None:
    lazy = CountingLazy(torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(torch.add(torch.ones(2), other=lazy), torch.tensor([2.0, 3.0]))
    assert lazy.waits == 1


Pair = namedtuple("Pair", ["x", "y"])


def _double_x(d: dict[str, Any], p: Any) -> Any:
    """An overridable function taking a dict and a namedtuple (dispatches like torch's own)."""
    relevant = (d["x"], p.y)
    if has_torch_function(relevant):
        return handle_torch_function(_double_x, relevant, d, p)
    assert isinstance(d["x"], torch.Tensor) and isinstance(p, Pair)
    return d["x"] * 2 + p.y


def test_torch_function_resolves_dicts_and_namedtuples() -> None:
    x, y = CountingLazy(torch.tensor([1.0])), CountingLazy(torch.tensor([10.0]))
    out = _double_x({"x": x, "other": 3}, Pair(x=0, y=y))
    torch.testing.assert_close(out, torch.tensor([12.0]))
    assert (x.waits, y.waits) == (1, 1)


def test_tensor_methods_and_attributes_wait() -> None:
    lazy = CountingLazy(torch.arange(6.0).view(2, 3))
    assert lazy.shape == torch.Size([2, 3])
    assert lazy.dtype == torch.float32
    torch.testing.assert_close(lazy.sum(dim=0), torch.tensor([3.0, 5.0, 7.0]))
    assert lazy.waits == 1


def test_missing_attribute_on_result_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_attribute"):
        _ = CountingLazy(torch.ones(1)).no_such_attribute


def test_dunder_probes_do_not_wait_and_copy_pickle_work() -> None:
    lazy = LazyNoWait(torch.ones(2))
    assert not hasattr(lazy, "__array_interface__")
    clone = copy.deepcopy(lazy)
    restored = pickle.loads(pickle.dumps(lazy))
    assert not lazy.is_waited and not clone.is_waited
    torch.testing.assert_close(clone + 0, torch.ones(2))
    torch.testing.assert_close(restored + 0, torch.ones(2))


def test_subclass_that_skips_super_init_gets_a_clear_error() -> None:
    class Broken(LazyAwaitable[int]):
        def __init__(self) -> None:
            pass

        def _wait_impl(self) -> int:
            return 1

    with pytest.raises(RuntimeError, match=r"super\(\).__init__\(\)"):
        Broken().wait()


def test_attribute_missing_during_wait_does_not_recurse() -> None:
    class Buggy(LazyAwaitable[int]):
        def _wait_impl(self) -> int:
            return self.never_set  # type: ignore[no-any-return]

    with pytest.raises(AttributeError, match="never_set"):
        Buggy().wait()


def test_symbolic_trace_records_the_awaitable() -> None:
    class Model(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            return LazyNoWait(x) * 2 + 1

    traced = torch.fx.symbolic_trace(Model())
    targets = [node.target for node in traced.graph.nodes if node.op == "call_function"]
    assert LazyNoWait in targets
    torch.testing.assert_close(traced(torch.ones(2)), torch.full((2,), 3.0))


# --- LazyGetItemMixin / GetItemLazyAwaitable ---------------------------------------------------


def test_getitem_is_lazy_and_parent_waits_once() -> None:
    parent = KeyedLazy({"a": torch.ones(2), "b": torch.zeros(2)})
    item_a, item_b = parent["a"], parent["b"]
    assert isinstance(item_a, GetItemLazyAwaitable)
    assert parent.waits == 0
    torch.testing.assert_close(item_a + 1, torch.full((2,), 2.0))
    torch.testing.assert_close(item_b * 1, torch.zeros(2))
    torch.testing.assert_close(parent["a"].wait(), torch.ones(2))
    assert parent.waits == 1


def test_getitem_of_getitem_chains_lazily() -> None:
    parent = KeyedLazy({"a": {"b": 5}})
    inner = GetItemLazyAwaitable(parent["a"], "b")
    assert parent.waits == 0
    assert inner + 1 == 6
    assert parent.waits == 1


def test_getitem_on_a_plain_awaitable_parent() -> None:
    parent = NoWait({"k": 3})
    child: GetItemLazyAwaitable[int, dict[str, int], str] = GetItemLazyAwaitable(parent, "k")
    assert child * 2 == 6


def test_getitem_missing_key_raises_key_error_on_use() -> None:
    item = KeyedLazy({"a": 1})["missing"]
    with pytest.raises(KeyError):
        item.wait()


def test_mixin_without_an_awaitable_is_a_type_error() -> None:
    class NotAwaitable(LazyGetItemMixin[str, int]):
        pass

    with pytest.raises(TypeError, match="Awaitable"):
        NotAwaitable()["k"]


# --- DeviceToHostTensorAwaitable ---------------------------------------------------------------


def test_device_to_host_on_cpu_is_a_plain_copy() -> None:
    t = torch.arange(4.0)
    aw = DeviceToHostTensorAwaitable(t)
    t.add_(100)  # the copy was taken at construction
    torch.testing.assert_close(aw.wait(), torch.arange(4.0))
    assert aw.wait().device.type == "cpu"
    torch.testing.assert_close(aw + 1, torch.arange(1.0, 5.0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_to_host_from_cuda() -> None:
    t = torch.arange(1000.0, device="cuda")
    aw = DeviceToHostTensorAwaitable(t * 2)
    out = aw.wait()
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, torch.arange(1000.0) * 2)


def test_import_does_not_touch_cuda() -> None:
    probe = (
        "import torch, embshard_types.awaitables as a;"
        "a.DeviceToHostTensorAwaitable(torch.ones(2)).wait();"
        "print(torch.cuda.is_initialized())"
    )
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True)
    assert out.stdout.strip().splitlines()[-1] == "False"
