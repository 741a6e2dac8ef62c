"""The test harness's backend / device switch (``EMBSHARD_TEST_BACKEND``), on any machine.

The selection functions are checked with the environment variables set by hand (a GPU count is
faked only to check the arithmetic of GPU assignment and the skip); one real launch checks
that the ranks join the selected backend and that the library builds its own collective
tensors on the same device as the tests (``collective_device``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _mp import (
    BACKEND_VAR,
    DEVICE_VAR,
    require_devices,
    run_on_ranks,
    selected_backend,
    test_device,
)

from embshard_dist.comm.collectives import all_gather_ints, collective_device


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv(BACKEND_VAR, raising=False)
    monkeypatch.delenv(DEVICE_VAR, raising=False)
    return monkeypatch


def test_gloo_and_the_cpu_are_the_default(clean_env: pytest.MonkeyPatch) -> None:
    assert selected_backend() == "gloo"
    assert test_device() == test_device(2) == torch.device("cpu")
    require_devices(64)  # never skips on gloo
    clean_env.setenv(BACKEND_VAR, " GLOO ")
    clean_env.setenv(DEVICE_VAR, "cpu")
    assert selected_backend() == "gloo" and test_device(1) == torch.device("cpu")


def test_nccl_puts_each_rank_on_its_gpu(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(BACKEND_VAR, "nccl")
    clean_env.setenv(DEVICE_VAR, "cuda")
    clean_env.setattr(torch.cuda, "device_count", lambda: 2)
    assert selected_backend() == "nccl"
    assert [test_device(r) for r in range(3)] == [
        torch.device("cuda", 0),
        torch.device("cuda", 1),
        torch.device("cuda", 0),
    ]
    require_devices(2)  # enough GPUs: no skip
    with pytest.raises(pytest.skip.Exception, match="runs 3 ranks, one per GPU, but only 2"):
        require_devices(3)


def test_bad_settings_are_refused(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(BACKEND_VAR, "mpi")
    with pytest.raises(ValueError, match="'mpi' is not a test backend; use 'gloo'"):
        selected_backend()
    clean_env.setenv(BACKEND_VAR, "gloo")
    clean_env.setenv(DEVICE_VAR, "cuda")
    with pytest.raises(ValueError, match="set EMBSHARD_TEST_BACKEND=nccl"):
        test_device()
    clean_env.setenv(BACKEND_VAR, "nccl")
    clean_env.setenv(DEVICE_VAR, "cpu")
    with pytest.raises(ValueError, match="the nccl ranks run on 'cuda'"):
        selected_backend()


def _where() -> tuple[str, str, str, list[list[int]]]:
    rank = dist.get_rank()
    gathered = all_gather_ints([rank, 7])  # built on collective_device(): must go through
    return str(dist.get_backend()), str(test_device()), str(collective_device()), gathered


def test_ranks_join_the_selected_backend_on_the_selected_devices() -> None:
    results = run_on_ranks(2, _where)
    for rank, (backend, device, built_on, gathered) in enumerate(results):
        assert backend == selected_backend()
        assert device == built_on == str(test_device(rank))
        assert gathered == [[0, 7], [1, 7]]


def test_device_fixture_matches_the_harness(device: torch.device) -> None:
    assert device == test_device()
    assert device.type == ("cpu" if selected_backend() == "gloo" else "cuda")


@pytest.mark.cpu_only("checks that cpu_only tests are skipped under nccl")
def test_cpu_only_tests_run_on_gloo_only() -> None:
    assert selected_backend() == "gloo"
