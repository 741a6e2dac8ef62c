"""``embshard train`` under torchrun: 2 simulated nodes x 2 processes on this host, loss goes down.

Two ``torchrun --nnodes 2 --nproc-per-node 2 --node-rank {0,1}`` agents meet at a local c10d
rendezvous, as two hosts would. The main job must notice the torchrun launch (it spawns nothing
and joins torchrun's 4 ranks), read ``LOCAL_WORLD_SIZE`` (2) as the node size, so the
node-aware tables land inside one node (table-row-wise on ranks {0, 1} or {2, 3}), and train:
both agents exit 0 and the loss of the last 3 steps is below that of the first 3 (read from
the ``--json`` summary rank 0 writes).

CPU / gloo only: each simulated node numbers its ranks' ``LOCAL_RANK`` 0 and 1, so on one host
the two nodes would share two GPUs, and NCCL refuses two ranks on one GPU.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

# A guard against a hang, not a speed check: 6 processes (2 agents, 4 ranks) share this
# machine's 2 cores, each importing torch, FBGEMM and torchmetrics (~1-2 s of the latter alone).
TIMEOUT_S = 150.0
NODES, PER_NODE = 2, 2
STEPS, WINDOW = 15, 3
"""Loss windows of 3 steps (``--log-every``), as 30 steps had: the first is the untrained model's,
well above the last (0.97 -> 0.63 here; the curve flattens after ~6 steps). 4 ranks x 32 rows a
step: 15 steps read 1920 of the 2048 generated rows, no second epoch."""
SHARDING = "t0=table_row_wise,t1=table_row_wise,t2=table_column_wise,t3=row_wise"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _agent(node: int, port: int, summary: Path) -> list[str]:
    embshard = str(Path(sys.executable).with_name("embshard"))
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={NODES}",
        f"--nproc-per-node={PER_NODE}",
        f"--node-rank={node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--no-python",
        embshard,
        "train",
        f"--steps={STEPS}",
        f"--log-every={WINDOW}",
        "--synthetic-rows=2048",
        "--eval-batches=2",
        "--tables=4",
        "--rows=200",
        "--dim=8",
        "--batch-size=32",
        f"--sharding={SHARDING}",
        "--device=cpu",
        f"--json={summary}",
    ]


@pytest.mark.cpu_only(reason="two simulated nodes on one host would put two ranks on one GPU")
def test_train_under_torchrun_two_nodes(tmp_path: Path) -> None:
    port = _free_port()
    summary = tmp_path / "summary.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EMBSHARD_COLLECTIVE_TIMEOUT_S": "30"}
    agents = [
        subprocess.Popen(
            _agent(node, port, summary),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,  # its own process group, so a hang can be ended whole
        )
        for node in range(NODES)
    ]
    outputs: list[str] = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
        raise AssertionError(f"torchrun did not finish within {TIMEOUT_S:g} s") from None
    for node, (agent, out) in enumerate(zip(agents, outputs, strict=True)):
        assert agent.returncode == 0, f"node {node} exited {agent.returncode}:\n{out[-4000:]}"
    assert "4 ranks (2 node(s) x 2)" in outputs[0], outputs[0][-4000:]
    result = json.loads(summary.read_text())
    assert result["world_size"] == NODES * PER_NODE
    assert result["local_world_size"] == PER_NODE
    assert result["steps"] == STEPS and result["window"] == WINDOW
    tables = result["plan"]["modules"]["sparse_arch"]["tables"]
    nodes = [{0, 1}, {2, 3}]
    for name in ("t0", "t1", "t2"):
        assert set(tables[name]["ranks"]) in nodes, (name, tables[name])
    assert tables["t2"]["sharding_type"] == "table_column_wise"
    assert set(tables["t3"]["ranks"]) == {0, 1, 2, 3}
    first, final = result["first_window_loss"], result["final_window_loss"]
    assert final < first, f"loss did not go down: first window {first}, final window {final}"
