"""torch.export and torch.compile of unsharded (fp32 and quantized) embedding collections.

The exported program is saved, then loaded and run in a fresh process that imports only torch,
fbgemm_gpu and embshard_kernels; its outputs must equal the eager model's bit for bit, on the
example batch and on a batch of another size (the batch dimension is exported dynamic).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torch.export import Dim

from embshard_kernels.collections import EmbeddingBagCollection, EmbeddingCollection
from embshard_kernels.quantize import quantize_embeddings
from embshard_types.configs import EmbeddingBagConfig, EmbeddingConfig
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.sparse.keyed_tensor import KeyedTensor

FEATURES = {"f1": 40, "f2": 40, "f3": 24}


def _ebc(weighted: bool = False) -> EmbeddingBagCollection:
    torch.manual_seed(0)
    return EmbeddingBagCollection(
        [
            EmbeddingBagConfig(
                name="t1", embedding_dim=16, num_embeddings=40, feature_names=["f1", "f2"]
            ),
            EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=24, feature_names=["f3"]),
        ],
        is_weighted=weighted,
    )


def _kjt(batch: int, seed: int, weighted: bool = False) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(FEATURES) * batch,), generator=g)
    lengths[0] = 2  # never an empty batch
    rows = torch.tensor(list(FEATURES.values())).repeat_interleave(batch)
    ids = torch.cat(
        [
            torch.randint(0, int(r), (int(n),), generator=g)
            for r, n in zip(rows, lengths, strict=True)
        ]
    )
    weights = torch.rand(ids.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(list(FEATURES), ids, lengths, weights=weights)


class _Ranker(nn.Module):
    """A collection and a linear layer over its pooled output."""

    def __init__(self, collection: nn.Module) -> None:
        super().__init__()
        self.sparse = collection
        self.over = nn.Linear(16 + 16 + 8, 1)

    def forward(self, features: KeyedJaggedTensor) -> Tensor:
        pooled: KeyedTensor = self.sparse(features)
        return torch.sigmoid(self.over(pooled.values()))


_LOADER = textwrap.dedent(
    """
    import sys
    import torch, fbgemm_gpu, embshard_kernels
    from embshard_types.sparse import KeyedJaggedTensor, KeyedTensor

    program = torch.export.load(sys.argv[1])
    batches = torch.load(sys.argv[2])
    outputs = []
    for b in batches:
        kjt = KeyedJaggedTensor(b["keys"], b["values"], weights=b["weights"], lengths=b["lengths"])
        out = program.module()(kjt)
        outputs.append(out.values() if isinstance(out, KeyedTensor) else out)
    torch.save(outputs, sys.argv[3])
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("embshard_dist", "torchrec"))
    print("EXTRA MODULES:", loaded)
    """
)


def _run_fresh(program_path: Path, batches: list[KeyedJaggedTensor], tmp: Path) -> list[Tensor]:
    inputs, outputs = tmp / "inputs.pt", tmp / "outputs.pt"
    torch.save(
        [
            {
                "keys": b.keys(),
                "values": b.values(),
                "weights": b.weights_or_none(),
                "lengths": b.lengths(),
            }
            for b in batches
        ],
        inputs,
    )
    done = subprocess.run(
        [sys.executable, "-c", _LOADER, str(program_path), str(inputs), str(outputs)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "EXTRA MODULES: []" in done.stdout, done.stdout
    result: list[Tensor] = torch.load(outputs)
    return result


def _export(model: nn.Module, example: KeyedJaggedTensor, weighted: bool) -> object:
    dims = [{0: Dim.AUTO}] * (3 if weighted else 2)  # values, [weights,] lengths
    return torch.export.export(model, (example,), dynamic_shapes=(dims,), strict=False)


@pytest.mark.parametrize(
    ("data_type", "weighted"),
    [("fp32", False), ("fp32", True), ("int8", False), ("int4", True)],
)
def test_exported_collection_gives_eager_outputs_in_a_fresh_process(
    tmp_path: Path, data_type: str, weighted: bool
) -> None:
    model: nn.Module = _Ranker(_ebc(weighted))
    if data_type != "fp32":
        quantize_embeddings(model, data_type)
    model.eval()
    batches = [_kjt(6, seed=1, weighted=weighted), _kjt(11, seed=2, weighted=weighted)]
    with torch.no_grad():
        expected = [model(b) for b in batches]
        program = _export(model, batches[0], weighted)
    path = tmp_path / "ranker.pt2"
    torch.export.save(program, path)  # type: ignore[arg-type]
    got = _run_fresh(path, batches, tmp_path)
    assert [g.shape for g in got] == [(6, 1), (11, 1)]
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)


def test_exported_collection_returns_a_keyed_tensor(tmp_path: Path) -> None:
    ebc = _ebc()
    batch = _kjt(5, seed=3)
    with torch.no_grad():
        expected = ebc(batch)
        program = _export(ebc, batch, weighted=False)
    path = tmp_path / "ebc.pt2"
    torch.export.save(program, path)
    out = torch.export.load(path).module()(batch)
    assert isinstance(out, KeyedTensor)
    assert out.keys() == ["f1", "f2", "f3"] and out.length_per_key() == [16, 16, 8]
    assert torch.equal(out.values(), expected.values())


def _explain(model: nn.Module, batch: KeyedJaggedTensor) -> None:
    explained = torch._dynamo.explain(model)(batch)
    reasons = [str(b.reason) for b in explained.break_reasons]
    assert explained.graph_break_count == 0, reasons
    assert explained.graph_count == 1, reasons


@pytest.mark.parametrize("data_type", ["fp32", "int8"])
def test_dynamo_sees_the_collection_forward_without_graph_breaks(data_type: str) -> None:
    torch._dynamo.reset()
    model: nn.Module = _Ranker(_ebc())
    if data_type != "fp32":
        quantize_embeddings(model, data_type)
    _explain(model, _kjt(4, seed=4))


def test_dynamo_sees_the_sequence_collection_without_graph_breaks() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    ec = EmbeddingCollection(
        [
            EmbeddingConfig(name="t1", embedding_dim=8, num_embeddings=40, feature_names=["f1"]),
            EmbeddingConfig(
                name="t2", embedding_dim=8, num_embeddings=40, feature_names=["f2", "f3"]
            ),
        ]
    )
    _explain(ec, _kjt(4, seed=5))


def test_compiled_inference_equals_eager_on_changing_batches() -> None:
    torch._dynamo.reset()
    model = _Ranker(_ebc())
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        for seed, batch in enumerate((4, 4, 9)):
            kjt = _kjt(batch, seed=10 + seed)
            assert torch.equal(compiled(kjt), model(kjt))


def test_compiled_training_step_gives_eager_gradients() -> None:
    """A traced training graph pools in torch (FBGEMM's dense op has no traceable backward)."""
    torch._dynamo.reset()
    model = _Ranker(_ebc())
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    weights = model.sparse.kernels()[0].emb_module.weights
    for seed, batch in enumerate((4, 9)):
        kjt = _kjt(batch, seed=20 + seed)
        model(kjt).sum().backward()
        expected = weights.grad.clone()
        weights.grad = None
        got = compiled(kjt)
        torch.testing.assert_close(got, model(kjt), rtol=1e-6, atol=1e-6)
        got.sum().backward()
        assert weights.grad is not None
        torch.testing.assert_close(weights.grad, expected, rtol=1e-6, atol=1e-6)
        weights.grad = None


def test_compiled_forward_stops_recompiling_once_shapes_go_dynamic() -> None:
    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []

    def count(gm: torch.fx.GraphModule, example_inputs: object) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    model = _Ranker(_ebc())
    compiled = torch.compile(model, backend=count, fullgraph=True)
    with torch.no_grad():
        for seed, batch in enumerate((4, 4, 9, 9)):
            compiled(_kjt(batch, seed=30 + seed))
        warmed = len(graphs)
        for seed, batch in enumerate((5, 12, 7, 3)):
            kjt = _kjt(batch, seed=40 + seed)
            assert torch.equal(compiled(kjt), model(kjt))
    assert warmed <= 3 and len(graphs) == warmed


@pytest.mark.parametrize("data_type", ["fp32", "int8"])
def test_exported_program_refuses_an_id_outside_its_table(data_type: str) -> None:
    """Eager checks cannot be traced; the exported graph keeps FBGEMM's FATAL bounds check."""
    model: nn.Module = _Ranker(_ebc())
    if data_type != "fp32":
        quantize_embeddings(model, data_type)
    batch = _kjt(3, seed=6)
    with torch.no_grad():
        program = _export(model, batch, weighted=False)
    values = batch.values().clone()
    values[0] = FEATURES["f1"]  # one past the last row of table t1
    bad = KeyedJaggedTensor(batch.keys(), values, lengths=batch.lengths())
    with pytest.raises(RuntimeError, match="idx < num_rows"):
        program.module()(bad)  # type: ignore[attr-defined]
