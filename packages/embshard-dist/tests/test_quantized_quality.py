"""A quantized DLRM keeps the trained fp32 model's quality on generated Criteo-format clicks.

A DLRM is trained (one process) on a generated Criteo TSV day whose labels follow a hidden model,
then evaluated on the next day in fp32 and after ``quantize_embeddings``: INT8's normalized
entropy is within 0.5% of fp32's (INT4 within 2%), and the model did learn (NE well below 1).
"""

from __future__ import annotations

import math

import pytest
import torch

from embshard_dist.data.criteo_dataset import CriteoIterDataset
from embshard_dist.data.criteo_format import DEFAULT_CAT_NAMES, CriteoTransform
from embshard_dist.data.criteo_synth import write_synthetic_criteo
from embshard_dist.data.criteo_tsv import TsvSource
from embshard_dist.models.dlrm import DLRM
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_kernels.quantize import quantize_embeddings
from embshard_types.configs import EmbeddingBagConfig

ROWS, DIM = 500, 16


def normalized_entropy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    p = torch.sigmoid(logits.double()).clamp(1e-12, 1 - 1e-12)
    y = labels.double()
    ce = -(y * p.log() + (1 - y) * (1 - p).log()).mean()
    q = float(y.mean())
    return float(ce) / (-q * math.log(q) - (1 - q) * math.log(1 - q))


def evaluate(model: torch.nn.Module, data: CriteoIterDataset) -> float:
    logits, labels = [], []
    with torch.no_grad():
        for batch in data:
            logits.append(model(batch.dense, batch.sparse).reshape(-1))
            labels.append(batch.labels.reshape(-1))
    return normalized_entropy(torch.cat(logits), torch.cat(labels))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[DLRM, CriteoIterDataset]:
    root = tmp_path_factory.mktemp("criteo")
    days = write_synthetic_criteo(root, days=2, rows_per_day=20000, seed=3, vocab_size=400)
    transform = CriteoTransform.uniform(ROWS)
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name=f"t_{f}", num_embeddings=ROWS, embedding_dim=DIM, feature_names=[f])
        for f in DEFAULT_CAT_NAMES
    ]
    model = DLRM(EmbeddingBagCollection(tables), 13, [64, DIM], [64, 32, 1])
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.01)
    train = CriteoIterDataset(TsvSource([days[0]], transform), 256, rank=0, world_size=1)
    for batch in train:  # one pass over the training day
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            model(batch.dense, batch.sparse).reshape(-1), batch.labels.reshape(-1)
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    held_out = CriteoIterDataset(TsvSource([days[1]], transform), 1024, rank=0, world_size=1)
    return model, held_out


def test_int8_ne_within_half_a_percent_of_fp32(trained: tuple[DLRM, CriteoIterDataset]) -> None:
    model, held_out = trained
    fp32 = evaluate(model, held_out)
    assert fp32 < 0.9  # it learned the hidden model
    int8 = evaluate(quantize_embeddings(model, "int8"), held_out)
    int4 = evaluate(quantize_embeddings(model, "int4"), held_out)
    print(f"held-out NE: fp32 {fp32:.7f}, int8 {int8:.7f}, int4 {int4:.7f}")
    assert int4 != fp32  # the tables really were quantized
    assert abs(int8 / fp32 - 1) <= 0.005
    assert abs(int4 / fp32 - 1) <= 0.02
