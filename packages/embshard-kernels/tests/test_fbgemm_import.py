"""embshard-kernels imports with the CPU FBGEMM build, and says how to fix a missing one."""

from __future__ import annotations

import subprocess
import sys

import torch

from embshard_kernels import _fbgemm


def test_imports_with_the_installed_cpu_build() -> None:
    assert _fbgemm.FBGEMM_VERSION.startswith("1.8")
    assert _fbgemm.check_versions(torch.__version__, _fbgemm.FBGEMM_VERSION) is None


def test_version_pairs() -> None:
    assert _fbgemm.check_versions("2.13.0+cu130", "1.8.0") is None
    assert _fbgemm.check_versions("2.14.1", "1.9.0") is None
    mismatch = _fbgemm.check_versions("2.14.0", "1.8.0")
    assert mismatch is not None and "needs FBGEMM 1.9.0" in mismatch
    unknown = _fbgemm.check_versions("2.99.0", "1.8.0")
    assert unknown is not None and "torch 2.13.x <-> FBGEMM 1.8.0" in unknown
    assert _fbgemm.check_versions("2.13.0", "2025.1.1") is None  # nightly: not judged


def test_install_hint_names_the_extra_and_the_pair() -> None:
    hint = _fbgemm.install_hint("2.13.0")
    assert "embshard-kernels[cpu]" in hint or "embshard-kernels[cuda]" in hint
    assert "FBGEMM 1.8.0" in hint


def _import_error(setup: str) -> str:
    code = (
        "import sys\n" + setup + "\n"
        "try:\n"
        "    import embshard_kernels.fused\n"
        "except ImportError as e:\n"
        "    print('IMPORT-ERROR:', e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return done.stdout + done.stderr


def test_missing_fbgemm_gives_the_install_command() -> None:
    out = _import_error("sys.modules['fbgemm_gpu'] = None")
    assert "IMPORT-ERROR:" in out
    assert "needs FBGEMM" in out and "embshard-kernels[cpu]" in out


def test_mismatched_fbgemm_gives_the_install_command() -> None:
    out = _import_error("import fbgemm_gpu\nfbgemm_gpu.__version__ = '1.9.0'")
    assert "IMPORT-ERROR:" in out
    assert "does not match torch" in out and "embshard-kernels[" in out
