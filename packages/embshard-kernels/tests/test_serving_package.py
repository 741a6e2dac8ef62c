"""An AOTInductor serving package (``embshard_kernels.serving``) of a quantized ranker.

Packaged once (dense features and a weighted KJT in, one logit per sample out), the package is
loaded in a fresh process that imports only torch and embshard_kernels and gives the eager
model's outputs on the example batch and on batches of other sizes; its weights are views of one
mapping of the package file; a model without weights packages too; a bad id is named by feature
and sample; wrong calls fail before any compiling; a package is replaced only by one that passed
its check, and a process serving the old one keeps serving it. A quantized sequence collection
(``dict`` of ``JaggedTensor`` out, sizes known only from the ids) packages too. A C++ process
(``embshard_kernels/cpp/serve_package.cpp``, compiled here against the installed libtorch)
serves the package with the eager model's outputs, with no Python in it. On CUDA (``nox -s
gpu_tests``) a package of the ranker on the GPU serves the eager GPU model's outputs.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

import embshard_kernels
from embshard_kernels.collections import EmbeddingBagCollection, EmbeddingCollection
from embshard_kernels.quantize import quantize_embeddings
from embshard_kernels.serving import (
    ATOL,
    RTOL,
    fbgemm_libraries,
    load_for_serving,
    package_for_serving,
)
from embshard_types.configs import EmbeddingBagConfig, EmbeddingConfig
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.sparse.keyed_tensor import KeyedTensor

FEATURES = {"f1": 40, "f2": 40, "f3": 24}
DENSE = 5


class _Ranker(nn.Module):
    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.sparse = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(
                    name="t1", embedding_dim=16, num_embeddings=40, feature_names=["f1", "f2"]
                ),
                EmbeddingBagConfig(
                    name="t2", embedding_dim=8, num_embeddings=24, feature_names=["f3"]
                ),
            ],
            is_weighted=True,
            device=device,
        )
        self.over = nn.Linear(DENSE + 16 + 16 + 8, 1, device=device)

    def forward(self, dense: Tensor, features: KeyedJaggedTensor) -> Tensor:
        pooled: KeyedTensor = self.sparse(features)
        return self.over(torch.cat([dense, pooled.values()], dim=1)).squeeze(1)


def _batch(size: int, seed: int) -> tuple[Tensor, KeyedJaggedTensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(FEATURES) * size,), generator=g)
    lengths[0] = 2
    rows = torch.tensor(list(FEATURES.values())).repeat_interleave(size)
    ids = torch.cat(
        [
            torch.randint(0, int(r), (int(n),), generator=g)
            for r, n in zip(rows, lengths, strict=True)
        ]
    )
    weights = torch.rand(ids.numel(), generator=g)
    kjt = KeyedJaggedTensor.from_lengths_sync(list(FEATURES), ids, lengths, weights=weights)
    return torch.rand(size, DENSE, generator=g), kjt


@pytest.fixture(scope="module")
def packaged(tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, Path]:
    model = quantize_embeddings(_Ranker().eval(), "int8")
    path = tmp_path_factory.mktemp("serving") / "ranker.pt2"
    assert package_for_serving(model, _batch(8, 1), path) == path
    return model, path


_LOADER = textwrap.dedent(
    """
    import sys
    import torch
    from embshard_kernels.serving import load_for_serving
    from embshard_types.sparse import KeyedJaggedTensor

    served = load_for_serving(sys.argv[1])
    outputs = []
    for b in torch.load(sys.argv[2]):
        kjt = KeyedJaggedTensor(b["keys"], b["values"], weights=b["weights"], lengths=b["lengths"])
        outputs.append(served(b["dense"], kjt))
    torch.save(outputs, sys.argv[3])
    print("FEATURE ROWS:", sorted(served.feature_rows.items()))
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("embshard_dist", "torchrec"))
    print("EXTRA MODULES:", loaded)
    """
)


def test_package_serves_the_eager_outputs_in_a_fresh_process(
    packaged: tuple[nn.Module, Path], tmp_path: Path
) -> None:
    model, path = packaged
    batches = [_batch(8, 1), _batch(3, 2), _batch(40, 3)]
    torch.save(
        [
            {
                "dense": d,
                "keys": k.keys(),
                "values": k.values(),
                "weights": k.weights(),
                "lengths": k.lengths(),
            }
            for d, k in batches
        ],
        tmp_path / "in.pt",
    )
    out = _run(
        [
            sys.executable,
            "-c",
            _LOADER,
            str(path),
            str(tmp_path / "in.pt"),
            str(tmp_path / "out.pt"),
        ]
    )
    assert "EXTRA MODULES: []" in out, out
    assert "FEATURE ROWS: [('f1', 40), ('f2', 40), ('f3', 24)]" in out, out
    with torch.no_grad():
        expected = [model(d, k) for d, k in batches]
    for got, want in zip(torch.load(tmp_path / "out.pt"), expected, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_the_weights_are_views_of_the_package_file(packaged: tuple[nn.Module, Path]) -> None:
    _, path = packaged
    constants = load_for_serving(path).constants
    assert constants, "the package keeps its weights beside its compiled code"
    storages = {
        (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in constants.values()
    }
    # one mapping of the whole file, every weight a view into it: nothing was read and copied
    assert len(storages) == 1
    assert next(iter(storages))[1] == path.stat().st_size


class _Stateless(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.sum(1) * 2


def test_a_model_without_weights_packages(tmp_path: Path) -> None:
    x = torch.rand(6, 3)
    served = load_for_serving(package_for_serving(_Stateless().eval(), (x,), tmp_path / "m.pt2"))
    assert dict(served.constants) == {}
    y = torch.rand(9, 3)
    torch.testing.assert_close(served(y), _Stateless()(y))


def _run(command: list[str]) -> str:
    """Run ``command`` (10 minutes at most); its stdout, once it exited 0."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


SERVER = Path(embshard_kernels.__file__).parent / "cpp" / "serve_package.cpp"


def _compile_server(out: Path) -> Path:
    """``serve_package.cpp`` built against this environment's libtorch."""
    from torch.utils import cpp_extension

    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler (c++ / g++) to build the C++ server")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    command = [
        compiler, "-std=c++20", "-O1", str(SERVER), "-o", str(out),
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{p}" for p in cpp_extension.include_paths()),
        *(f"-L{p}" for p in cpp_extension.library_paths()),
        *(f"-Wl,-rpath,{p}" for p in cpp_extension.library_paths()),
        "-Wl,--no-as-needed", "-ltorch", "-ltorch_cpu", "-lc10", "-ldl",
    ]  # fmt: skip
    _run(command)
    return out


def test_a_cpp_process_serves_the_package(packaged: tuple[nn.Module, Path], tmp_path: Path) -> None:
    model, path = packaged
    server = _compile_server(tmp_path / "serve_package")
    batches = [_batch(8, 1), _batch(3, 2), _batch(21, 4)]
    flat = [[d, k.values(), k.weights(), k.lengths()] for d, k in batches]
    requests, replies_file = tmp_path / "requests.pt", tmp_path / "replies.pt"
    torch.save(flat, requests)
    libraries = [str(p) for p in fbgemm_libraries()]
    assert libraries, "no FBGEMM library found to load"
    command = [str(server), str(path), str(requests), str(replies_file), *libraries]
    assert "served 3 requests" in _run(command)
    # written by our own server with torch::pickle_save: a list of lists of tensors
    replies = torch.load(replies_file, weights_only=False)
    with torch.no_grad():
        for (dense, kjt), reply in zip(batches, replies, strict=True):
            (got,) = reply
            torch.testing.assert_close(got, model(dense, kjt), atol=ATOL, rtol=RTOL)


def test_an_id_outside_its_table_is_named_by_feature_and_sample(
    packaged: tuple[nn.Module, Path],
) -> None:
    served = load_for_serving(packaged[1])
    dense, kjt = _batch(4, 5)
    values = kjt.values().clone()
    f3_start = int(kjt.offset_per_key()[2])
    first_sample = int(torch.nonzero(kjt.lengths()[8:])[0])  # f3's first non-empty bag
    values[f3_start] = 24
    bad = KeyedJaggedTensor(kjt.keys(), values, weights=kjt.weights(), lengths=kjt.lengths())
    with pytest.raises(ValueError, match=rf"'f3', sample {first_sample}: id 24 .* \[0, 24\)"):
        served(dense, bad)


def test_inputs_of_another_structure_are_refused(packaged: tuple[nn.Module, Path]) -> None:
    served = load_for_serving(packaged[1])
    dense, kjt = _batch(4, 6)
    parts = kjt.to_dict()
    reordered = KeyedJaggedTensor.from_jt_dict({k: parts[k] for k in ("f2", "f1", "f3")})
    with pytest.raises(ValueError, match="is not the package's"):
        served(dense, reordered)
    with pytest.raises(ValueError, match="is not the package's"):
        served(dense)


def test_a_sequence_collection_packages(tmp_path: Path) -> None:
    torch.manual_seed(0)
    collection = EmbeddingCollection(
        [
            EmbeddingConfig(
                name="t1", embedding_dim=8, num_embeddings=40, feature_names=["f1", "f2"]
            ),
            EmbeddingConfig(name="t2", embedding_dim=8, num_embeddings=24, feature_names=["f3"]),
        ]
    )
    model = quantize_embeddings(nn.Sequential(collection).eval(), "int8")

    def ids(size: int, seed: int) -> KeyedJaggedTensor:
        kjt = _batch(size, seed)[1]
        return KeyedJaggedTensor(kjt.keys(), kjt.values(), lengths=kjt.lengths())

    served = load_for_serving(package_for_serving(model, (ids(8, 1),), tmp_path / "seq.pt2"))
    for size, seed in ((8, 1), (3, 2), (17, 3)):
        got, want = served(ids(size, seed)), model(ids(size, seed))
        assert list(got) == list(want) == list(FEATURES)
        for key in want:
            assert torch.equal(got[key].lengths(), want[key].lengths())
            torch.testing.assert_close(got[key].values(), want[key].values(), atol=ATOL, rtol=RTOL)


class _Noisy(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x + torch.rand_like(x)  # never the same twice: the package cannot agree


def _linear(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(3, 2).eval()


@torch.no_grad()
def test_a_package_is_replaced_only_by_one_that_passed_its_check(tmp_path: Path) -> None:
    path, x = tmp_path / "m.pt2", torch.rand(5, 3)
    first, second = _linear(0), _linear(1)
    serving_first = load_for_serving(package_for_serving(first, (x,), path))
    package_for_serving(second, (x,), path)
    # the running server still has the first package's weights mapped; a new load the second's
    torch.testing.assert_close(serving_first(x), first(x), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(load_for_serving(path)(x), second(x), atol=ATOL, rtol=RTOL)
    with pytest.raises(RuntimeError, match=r"output #0 of the package .* differs"):
        package_for_serving(_Noisy().eval(), (x,), path)
    torch.testing.assert_close(load_for_serving(path)(x), second(x), atol=ATOL, rtol=RTOL)
    assert [p.name for p in tmp_path.iterdir()] == ["m.pt2"]  # no temporary file left


def test_wrong_calls_fail_before_compiling(tmp_path: Path) -> None:
    model = _Ranker()
    with pytest.raises(ValueError, match=r"training mode; call model.eval\(\)"):
        package_for_serving(model, _batch(4, 1), tmp_path / "a.pt2")
    with pytest.raises(ValueError, match="input tensor #0 of the example has 1 rows"):
        package_for_serving(model.eval(), _batch(1, 1), tmp_path / "a.pt2")
    assert not (tmp_path / "a.pt2").exists()
    with pytest.raises(FileNotFoundError, match="no package at"):
        load_for_serving(tmp_path / "missing.pt2")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: runs under nox -s gpu_tests")
def test_a_cuda_package_serves_the_eager_outputs(tmp_path: Path) -> None:
    model = quantize_embeddings(_Ranker("cuda").eval(), "int8")

    def on_gpu(size: int, seed: int) -> tuple[Tensor, KeyedJaggedTensor]:
        dense, kjt = _batch(size, seed)
        return dense.cuda(), kjt.to(torch.device("cuda"))

    served = load_for_serving(package_for_serving(model, on_gpu(8, 1), tmp_path / "gpu.pt2"))
    with torch.no_grad():
        for size, seed in ((8, 1), (3, 2), (40, 3)):
            batch = on_gpu(size, seed)
            got, want = served(*batch), model(*batch)
            assert got.device.type == "cuda"
            torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
