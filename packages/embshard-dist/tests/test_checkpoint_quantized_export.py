"""``embshard checkpoint export --quantize``: a checkpoint quantized offline, table by table.

A model trained and checkpointed in fp32, exported quantized (INT8, INT4) and loaded into the
quantized architecture, equals ``quantize_embeddings`` of the model loaded from the float
checkpoint: the same packed bytes, the same outputs. Bad requests are refused before writing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from embshard_dist.checkpoint.export import export_checkpoint, load_quantized_export, read_export
from embshard_dist.checkpoint.import_ import import_state_dict
from embshard_dist.cli import main
from embshard_kernels.collections import EmbeddingBagCollection, EmbeddingCollection
from embshard_kernels.quantize import quantize_embeddings
from embshard_types.configs import EmbeddingBagConfig, EmbeddingConfig
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sparse = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(
                    name="a", num_embeddings=50, embedding_dim=16, feature_names=["fa"]
                ),
                EmbeddingBagConfig(
                    name="b", num_embeddings=20, embedding_dim=8, feature_names=["fb"]
                ),
            ]
        )
        self.seq = EmbeddingCollection(
            [EmbeddingConfig(name="s", num_embeddings=30, embedding_dim=8, feature_names=["fs"])]
        )
        self.head = nn.Linear(24, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.head(self.sparse(kjt).values())
        return pooled, self.seq(kjt)["fs"].values()


def trained(seed: int) -> Model:
    torch.manual_seed(seed)
    model = Model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


def batch() -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(0, 4, (3 * 8,), generator=g)
    rows = [50] * 8 + [20] * 8 + [30] * 8
    values = torch.cat(
        [torch.randint(0, r, (int(n),), generator=g) for r, n in zip(rows, lengths, strict=True)]
    )
    return KeyedJaggedTensor.from_lengths_sync(["fa", "fb", "fs"], values, lengths)


def checkpoint(tmp_path: Path, model: nn.Module) -> Path:
    torch.save(model.state_dict(), tmp_path / "state.pt")
    import_state_dict(tmp_path / "state.pt", tmp_path / "ckpt")
    return tmp_path / "ckpt"


@pytest.mark.parametrize("dtype", ["int8", "int4", "fp16"])
def test_quantized_export_equals_quantizing_the_loaded_model(tmp_path: Path, dtype: str) -> None:
    source = trained(1)
    ckpt = checkpoint(tmp_path, source)
    index = export_checkpoint(ckpt, tmp_path / "q", optimizer=False, quantize=dtype)
    assert index["quantized"] == dtype
    expected = quantize_embeddings(source, dtype)
    served = quantize_embeddings(trained(2), dtype)  # another model's weights, overwritten
    assert load_quantized_export(served, tmp_path / "q") == []
    for name in ("sparse", "seq"):
        want = getattr(expected, name).packed_tables()
        got = getattr(served, name).packed_tables()
        for table, holder in want.items():
            assert torch.equal(got[table].weight, holder.weight), table
            if holder.weight_qscaleshift is not None:
                assert torch.equal(got[table].weight_qscaleshift, holder.weight_qscaleshift)
    kjt = batch()
    for a, b in zip(served(kjt), expected(kjt), strict=True):
        assert torch.equal(a, b)
    assert read_export(tmp_path / "q")["model/sparse.embedding_bags.a.weight"].dtype == torch.uint8


def test_bad_quantized_exports_are_refused(tmp_path: Path) -> None:
    ckpt = checkpoint(tmp_path, trained(1))
    with pytest.raises(ValueError, match="weights only"):
        export_checkpoint(ckpt, tmp_path / "x", quantize="int8")
    with pytest.raises(ValueError, match="not a serving type"):
        export_checkpoint(ckpt, tmp_path / "x", optimizer=False, quantize="fp32")
    assert not (tmp_path / "x").exists()
    export_checkpoint(ckpt, tmp_path / "q4", optimizer=False, quantize="int4")
    with pytest.raises(ValueError, match="quantized to int8 but the export holds int4"):
        load_quantized_export(quantize_embeddings(trained(1), "int8"), tmp_path / "q4")
    export_checkpoint(ckpt, tmp_path / "float", optimizer=False)
    with pytest.raises(ValueError, match="float export"):
        load_quantized_export(quantize_embeddings(trained(1), "int8"), tmp_path / "float")
    with pytest.raises(ValueError, match="no quantized embedding collection"):
        load_quantized_export(trained(1), tmp_path / "q4")


def test_cli_export_quantize(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = checkpoint(tmp_path, trained(1))
    out = tmp_path / "served"
    assert main(["checkpoint", "export", str(ckpt), str(out), "--quantize", "int8"]) == 0
    assert "int8" in capsys.readouterr().out
    served = quantize_embeddings(trained(3), "int8")
    load_quantized_export(served, out)
    expected = quantize_embeddings(trained(1), "int8")
    kjt = batch()
    assert torch.equal(served(kjt)[0], expected(kjt)[0])


def test_a_meta_model_is_served_from_the_export_without_a_float_copy(tmp_path: Path) -> None:
    ckpt = checkpoint(tmp_path, trained(1))
    export_checkpoint(ckpt, tmp_path / "q", optimizer=False, quantize="int8")
    with torch.device("meta"):
        skeleton = Model()
    skeleton.head.to_empty(device="cpu")
    served = quantize_embeddings(skeleton, "int8")
    assert all(not p.is_meta for p in served.parameters())
    assert all(not b.is_meta for b in served.buffers())
    load_quantized_export(served, tmp_path / "q")
    expected = quantize_embeddings(trained(1), "int8")
    kjt = batch()
    for a, b in zip(served(kjt), expected(kjt), strict=True):
        assert torch.equal(a, b)
