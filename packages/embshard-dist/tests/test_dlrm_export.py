"""A DLRM over an unsharded (fp32 or quantized) collection: torch.export and torch.compile.

The exported inference program (dynamic batch) is saved, loaded in a fresh process that imports
only torch, fbgemm_gpu and embshard_kernels (with embshard_types, which it imports), and gives
the eager model's outputs bit for bit on the example batch and on a batch of another size.
``torch._dynamo.explain`` finds no graph break in the DLRM's forward.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.export import Dim

from embshard_dist.dmp.model_parallel import DistributedModelParallel
from embshard_dist.models.dlrm import DLRM
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_kernels.quantize import quantize_embeddings
from embshard_kernels.serving import package_for_serving
from embshard_types.configs import EmbeddingBagConfig
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

KEYS = ["f0", "f1", "f2", "f3"]


def dlrm(data_type: str) -> nn.Module:
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(
            name="t0", num_embeddings=60, embedding_dim=16, feature_names=["f0", "f1"]
        ),
        EmbeddingBagConfig(name="t1", num_embeddings=30, embedding_dim=16, feature_names=["f2"]),
        EmbeddingBagConfig(name="t2", num_embeddings=45, embedding_dim=16, feature_names=["f3"]),
    ]
    model = DLRM(EmbeddingBagCollection(tables), 13, [32, 16], [32, 1]).eval()
    return model if data_type == "fp32" else quantize_embeddings(model, data_type)


def batch(size: int, seed: int) -> tuple[Tensor, KeyedJaggedTensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(KEYS) * size,), generator=g)
    lengths[0] = 2
    rows = torch.tensor([60, 60, 30, 45]).repeat_interleave(size)
    ids = torch.cat(
        [
            torch.randint(0, int(r), (int(n),), generator=g)
            for r, n in zip(rows, lengths, strict=True)
        ]
    )
    dense = torch.rand(size, 13, generator=g)
    return dense, KeyedJaggedTensor.from_lengths_sync(KEYS, ids, lengths)


_LOADER = textwrap.dedent(
    """
    import sys
    import torch, fbgemm_gpu, embshard_kernels
    from embshard_types.sparse import KeyedJaggedTensor

    program = torch.export.load(sys.argv[1])
    outputs = []
    for b in torch.load(sys.argv[2]):
        kjt = KeyedJaggedTensor(b["keys"], b["values"], lengths=b["lengths"])
        with torch.no_grad():
            outputs.append(program.module()(b["dense"], kjt))
    torch.save(outputs, sys.argv[3])
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("embshard_dist", "torchrec"))
    print("EXTRA MODULES:", loaded)
    """
)


@pytest.mark.parametrize("data_type", ["fp32", "int8", "int4"])
def test_exported_dlrm_serves_eager_outputs_in_a_fresh_process(
    tmp_path: Path, data_type: str
) -> None:
    model = dlrm(data_type)
    example, other = batch(8, 1), batch(5, 2)
    dims = ({0: Dim.AUTO}, [{0: Dim.AUTO}, {0: Dim.AUTO}])  # dense rows; ids, lengths
    with torch.no_grad():
        program = torch.export.export(model, example, dynamic_shapes=dims, strict=False)
        expected = [model(*example), model(*other)]
    torch.export.save(program, tmp_path / "dlrm.pt2")
    torch.save(
        [
            {"dense": d, "keys": k.keys(), "values": k.values(), "lengths": k.lengths()}
            for d, k in (example, other)
        ],
        tmp_path / "in.pt",
    )
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _LOADER,
            str(tmp_path / "dlrm.pt2"),
            str(tmp_path / "in.pt"),
            str(tmp_path / "out.pt"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "EXTRA MODULES: []" in done.stdout, done.stdout
    for got, want in zip(torch.load(tmp_path / "out.pt"), expected, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("data_type", ["fp32", "int8"])
def test_dynamo_sees_the_dlrm_forward_without_graph_breaks(data_type: str) -> None:
    torch._dynamo.reset()
    model = dlrm(data_type)
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(*batch(8, 3))
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    assert explained.graph_count == 1


def test_a_sharded_model_is_refused_by_package_for_serving(tmp_path: Path) -> None:
    """A package serves in one process: packaging a DMP model names its sharded module."""
    started = not dist.is_initialized()
    if started:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        model = DistributedModelParallel(dlrm("fp32"), device=torch.device("cpu")).eval()
        with pytest.raises(ValueError, match=r"embedding_bag_collection' is sharded .*unsharded"):
            package_for_serving(model, batch(8, 1), tmp_path / "m.pt2")
        assert not (tmp_path / "m.pt2").exists()
    finally:
        if started:
            dist.destroy_process_group()
