"""``embshard calibrate`` when its multi-process measurement fails: a clear error, exit 1.

The failure is real: the two measuring processes inherit an unusable collective time limit
(``EMBSHARD_COLLECTIVE_TIMEOUT_S=soon``), so their first collective raises. Without
``--allow-defaults`` nothing is written and stderr says what failed and how to go on; with it
the default comms figures are written, a warning line is printed on stderr and the status is 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from embshard_dist.cli import main
from embshard_dist.comm.timeouts import ENV_TIMEOUT_VAR

ARGS = ["--world-size", "2", "--reps", "1"]


@pytest.fixture
def broken_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_TIMEOUT_VAR, "soon")


@pytest.mark.usefixtures("broken_collectives")
def test_failed_measurement_exits_1_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "topology.json"
    status = main(["calibrate", "--out", str(out), *ARGS])
    err = capsys.readouterr().err
    assert status == 1, err
    assert err.startswith("embshard calibrate: error: the collective measurement on 2 gloo")
    assert f"{ENV_TIMEOUT_VAR}='soon' is not a number of seconds" in err
    assert "--no-comms" in err and "--allow-defaults" in err and "nothing written" in err
    assert "Traceback" not in err
    assert not out.exists()


@pytest.mark.usefixtures("broken_collectives")
def test_allow_defaults_writes_the_defaults_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "topology.json"
    status = main(["calibrate", "--out", str(out), *ARGS, "--allow-defaults"])
    err = capsys.readouterr().err
    assert status == 0, err
    warning = [line for line in err.splitlines() if line.startswith("embshard calibrate: warning:")]
    assert len(warning) == 1 and "keep their defaults" in warning[0], err
    source = json.loads(out.read_text())["source"]
    assert "comms and sharding overheads: defaults" in source
