"""nox sessions for embshard (uv backend).

- ``lint``: ruff format check, ruff lint and mypy over every package's ``src/``; then the import
  contracts (``lint-imports``, ``[tool.importlinter]`` in pyproject.toml), the import-cycle check
  (``scripts/import_cycles.py``), the pins check (``scripts/pins.py --check``) and codespell.
- ``tests-<package>``: one isolated environment per package, holding only that package (built as a
  wheel, not editable), its declared dependencies and the test tools; runs its tests and imports it.
  For embshard-types and embshard-optim it also proves ``fbgemm_gpu`` is neither installed nor
  imported.
- ``dist_tests``: the multi-process tests under ``tests/`` (real processes, gloo, CPU).
- ``gpu_tests``: the same suite on CUDA / NCCL; skips (exit 0) with a message where CUDA is absent.
- ``bench``, ``asv``, ``asv_compare``: the benchmark suites under ``benchmarks/``;
- ``compare``, ``plan_quality``: embshard beside TorchRec 1.8.0 (W1, W2, W4, W2-DLRM; the planners);
  ``serving``: quantized inference latency and memory beside TorchRec's.
- ``build``: the four wheels and sdists into ``dist/``, then each package installed alone from
  them into a fresh virtual environment (PyPI for everything else) and imported (not a default
  session).

``nox`` with no arguments runs lint, tests and dist_tests. Every environment is synced from
``uv.lock`` (``--frozen``), so sessions see exactly the locked versions.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "tests", "dist_tests"]
nox.options.error_on_external_run = True

PACKAGES = ["embshard-types", "embshard-optim", "embshard-kernels", "embshard-dist"]
# Packages that must work without FBGEMM.
FBGEMM_FREE = {"embshard-types", "embshard-optim"}
# The extra that selects FBGEMM's CPU build, for packages that need FBGEMM.
CPU_EXTRA = {"embshard-kernels": "cpu", "embshard-dist": "cpu"}


def _sync(session: nox.Session, *args: str) -> None:
    """Sync the session's virtualenv from uv.lock with exactly the given selection."""
    session.run_install(
        "uv",
        "sync",
        "--frozen",
        "--exact",
        "--no-default-groups",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
        external=True,
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (format and lint) and mypy over every package's sources."""
    _sync(session, "--all-packages", "--group", "dev")
    sources = [f"packages/{p}/src" for p in PACKAGES]
    session.run("ruff", "format", "--check", ".")
    session.run("ruff", "check", ".")
    session.run("mypy", *sources)
    session.run("lint-imports")
    session.run("python", "scripts/import_cycles.py")
    session.run("python", "scripts/pins.py", "--check")
    docs = [d for d in ("docs",) if Path(d).is_dir()]
    markdown = sorted(str(p) for p in Path().glob("*.md"))
    session.run("codespell", "packages", "tests", "benchmarks", "scripts", *docs, *markdown)


@nox.session
@nox.parametrize("package", PACKAGES, ids=[p.removeprefix("embshard-") for p in PACKAGES])
def tests(session: nox.Session, package: str) -> None:
    """One package's unit tests, in an environment holding that package alone."""
    selection = ["--package", package, "--no-editable", "--group", "test"]
    if package in CPU_EXTRA:
        selection += ["--extra", CPU_EXTRA[package]]
    _sync(session, *selection)
    module = package.replace("-", "_")
    if package in FBGEMM_FREE:
        session.run(
            "python",
            "-c",
            "import importlib.util, sys\n"
            "assert importlib.util.find_spec('fbgemm_gpu') is None, 'fbgemm_gpu is installed'\n"
            f"import {module}\n"
            "loaded = [m for m in sys.modules if m.startswith('fbgemm')]\n"
            "assert not loaded, f'fbgemm modules were imported: {loaded}'\n"
            f"print('{module} imports without fbgemm_gpu installed or imported')",
        )
    else:
        session.run("python", "-c", f"import {module}; print('{module} imports')")
    session.run("pytest", f"packages/{package}/tests", "-q", *session.posargs)


@nox.session
def dist_tests(session: nox.Session) -> None:
    """Multi-process tests: real processes on gloo, compared against the unsharded modules."""
    _sync(session, "--all-packages", "--extra", "cpu", "--group", "test")
    session.run("pytest", "tests", "-q", *session.posargs, env={"EMBSHARD_TEST_BACKEND": "gloo"})


@nox.session
def gpu_tests(session: nox.Session) -> None:
    """The distributed suite on CUDA / NCCL across the visible GPUs."""
    if shutil.which("nvidia-smi") is None and not os.path.exists("/proc/driver/nvidia/version"):
        session.skip(
            "no NVIDIA driver on this machine: gpu_tests need CUDA GPUs (skipped, not failed)"
        )
    _sync(session, "--all-packages", "--extra", "cuda", "--group", "test")
    gpus = session.run(
        "python", "-c", "import torch; print(torch.cuda.device_count())", silent=True
    )
    count = int(str(gpus).strip().splitlines()[-1]) if gpus else 0
    if count < 1:
        session.skip("torch sees no CUDA device: gpu_tests skipped")
    session.log(
        f"running the distributed suite on {count} GPU(s) with NCCL "
        f"(tests needing more than {count} ranks, and cpu_only tests, are skipped)"
    )
    session.run(
        "pytest",
        "tests",
        "packages/embshard-kernels/tests",
        "-q",
        *session.posargs,
        env={"EMBSHARD_TEST_BACKEND": "nccl", "EMBSHARD_TEST_DEVICE": "cuda"},
    )


@nox.session
def bench(session: nox.Session) -> None:
    """pytest-benchmark suites; the run is saved as JSON and compared with the previous saved
    run: a benchmark whose fastest round is over 10% slower is measured again, and fails the
    session only if it stays slower (``benchmarks/bench_gate.py``; pytest arguments after
    ``--``)."""
    _sync(session, "--all-packages", "--extra", "cpu", "--group", "test", "--group", "bench")
    session.run("python", "benchmarks/bench_gate.py", "--", *session.posargs)


@nox.session
def asv(session: nox.Session) -> None:
    """asv of HEAD and the recent history of main (each commit's own four packages), HTML
    published to benchmarks/html and made self-contained: asv's CDN scripts and styles are
    replaced by the npm packages pinned in benchmarks/dashboard/assets.lock.json (fetched with
    npm once, cached in benchmarks/.dashboard-cache). The dashboard is then checked in headless
    Chromium with the network cut (benchmarks/dashboard/check_browser.py; Debian package
    ``chromium``), which saves screenshot-summary.png and screenshot-graph.png beside it.
    Arguments go to the driver: revisions, --commits N, --bench REGEX, --no-publish."""
    _sync(session, "--all-packages", "--extra", "cpu", "--group", "bench")
    session.run("pytest", "benchmarks/dashboard/test_vendor.py", "-q", "-p", "no:cacheprovider")
    session.run("python", "benchmarks/asv_history.py", "run", "--quick", *session.posargs)
    if "--no-publish" not in session.posargs:
        session.run("python", "benchmarks/dashboard/check_browser.py")


@nox.session
def asv_compare(session: nox.Session) -> None:
    """Fail when revision B is worse than A by more than 10% on any asv benchmark:
    ``nox -s asv_compare -- A B [--factor 1.10] [--confirm 2] [--rerun]``."""
    if len(session.posargs) < 2:
        session.error("usage: nox -s asv_compare -- A B [--factor 1.10] [--confirm N] [--rerun]")
    _sync(session, "--all-packages", "--extra", "cpu", "--group", "bench")
    session.run("python", "benchmarks/asv_history.py", "compare", "--quick", *session.posargs)


def _with_torchrec(session: nox.Session) -> None:
    """Sync embshard, then add TorchRec 1.8.0 without its CUDA FBGEMM (checked)."""
    _sync(session, "--all-packages", "--extra", "cpu", "--group", "bench")
    session.install("--no-deps", "torchrec==1.8.0")
    session.install("tensordict==0.15.3", "pyre-extensions==0.0.32", "tqdm", "matplotlib")
    session.run(
        "python",
        "-c",
        "import importlib.metadata as m, torch, fbgemm_gpu, torchrec\n"
        "assert torch.__version__.startswith('2.13.'), torch.__version__\n"
        "assert m.version('fbgemm-gpu-cpu') == '1.8.0'\n"
        "try:\n"
        "    m.version('fbgemm-gpu')\n"
        "    raise SystemExit('the CUDA fbgemm-gpu got installed beside fbgemm-gpu-cpu')\n"
        "except m.PackageNotFoundError:\n"
        "    pass\n"
        "print('torch', torch.__version__, 'fbgemm-gpu-cpu', fbgemm_gpu.__version__, "
        "'torchrec', m.version('torchrec'))",
    )


@nox.session
def compare(session: nox.Session) -> None:
    """embshard vs TorchRec side by side (W1, W2, W4, W2-DLRM; every sharding type, a mixed plan).

    TorchRec 1.8.0 declares the CUDA ``fbgemm-gpu``, which must never sit beside
    ``fbgemm-gpu-cpu``: it is installed with ``--no-deps``, plus the packages ``import torchrec``
    actually loads (tensordict, tqdm, pyre-extensions) and matplotlib for the chart. Results go
    to ``benchmarks/results/compare/``. Arguments go to the driver, e.g.
    ``nox -s compare -- --workload W1 --quick``.
    """
    _with_torchrec(session)
    if "--help" not in session.posargs:
        # import cost side by side (fresh interpreters): embshard_dist vs torchrec
        session.run("python", "benchmarks/import_time.py", "--torchrec", "--repeat", "5")
    session.run("python", "-m", "benchmarks.compare.run", *session.posargs)


@nox.session
def serving(session: nox.Session) -> None:
    """Serving: latency (p50, p99) and throughput at batch 1, 64 and 512 of a DLRM on W2's
    tables, embshard fp32 / INT8 / INT4 (eager, compiled and packaged with AOTInductor)
    beside TorchRec 1.8.0's float and quantized (``QuantEmbeddingBagCollection``) models,
    eager and TorchScript, in the same process, and each variant's peak memory in a fresh one. Arguments go to the driver, e.g. ``nox -s serving -- --seconds 5``.
    Results go to ``benchmarks/results/serving/``."""
    _with_torchrec(session)
    session.run("python", "-m", "benchmarks.serving.run", *session.posargs)


@nox.session(venv_backend="none")
def plan_quality(session: nox.Session) -> None:
    """The planner against measurements, in the compare session's environment: predicted vs
    measured step time per plan (W1, W2) and embshard's plan vs TorchRec's planner's plan, both
    executed by embshard in the same processes. Arguments go to the driver, e.g.
    ``nox -s plan_quality -- --workload W2 --steps 20``. Run ``nox -s compare -- --help`` once
    first to build that environment."""
    python = Path(".nox/compare/bin/python")
    if not python.exists():
        session.error("run `uv run nox -s compare -- --help` first: it builds the environment")
    session.run(str(python), "-m", "benchmarks.plan_quality.run", *session.posargs)


@nox.session(venv_backend="none")
def torchrec_parity(session: nox.Session) -> None:
    """TorchRec 1.8's DLRM / DLRM_DCN and embshard's, built from the same seeds and sharded
    table-wise and row-wise on 2 gloo processes, give the same forward (in the compare session's
    environment). Arguments go to the driver, e.g. ``nox -s torchrec_parity -- --seed 3``. Run
    ``nox -s compare -- --help`` once first to build that environment."""
    python = Path(".nox/compare/bin/python")
    if not python.exists():
        session.error("run `uv run nox -s compare -- --help` first: it builds the environment")
    session.run(str(python), "-m", "benchmarks.compare.parity", *session.posargs)


# Where `nox -s build` puts the wheels and sdists, and the environments it installs them into.
DIST = Path("dist")
BUILD_ENVS = Path(".nox/build-envs")


# Run inside each environment of `nox -s build`: the embshard distributions installed are exactly
# the package and those below it, at the built versions and not editable; every module of the
# package but ``__main__`` imports (so each import is covered by declared dependencies); FBGEMM is
# absent from embshard-types / embshard-optim environments, and only its CPU build is present in
# the others.
_INSTALL_CHECK = """\
import importlib, importlib.metadata as md, importlib.util, pkgutil, sys

expected = {expected!r}
found = {{d.metadata["Name"]: d.version for d in md.distributions()
         if d.metadata["Name"].startswith("embshard")}}
assert found == expected, f"embshard distributions {{found}}, expected {{expected}}"
for name in found:
    direct = md.distribution(name).read_text("direct_url.json") or ""
    assert '"editable": true' not in direct, f"{{name}} is an editable install: {{direct}}"
if {fbgemm_free!r}:
    assert importlib.util.find_spec("fbgemm_gpu") is None, "fbgemm_gpu is installed"
else:
    assert md.version("fbgemm-gpu-cpu"), "fbgemm-gpu-cpu is missing"
    try:
        md.version("fbgemm-gpu")
        raise SystemExit("the CUDA fbgemm-gpu is installed beside fbgemm-gpu-cpu")
    except md.PackageNotFoundError:
        pass
package = importlib.import_module("{module}")
assert package.__file__.startswith({env!r}), package.__file__
names = [
    m.name
    for m in pkgutil.walk_packages(package.__path__, "{module}.")
    if not m.name.endswith(".__main__")  # runs the command
]
for name in names:
    importlib.import_module(name)
if {fbgemm_free!r}:
    loaded = [m for m in sys.modules if m.startswith("fbgemm")]
    assert not loaded, f"fbgemm modules were imported: {{loaded}}"
print(f"{module} {{found}}: installed alone from the wheels, {{len(names) + 1}} modules import")
"""


@nox.session(venv_backend="none")
def build(session: nox.Session) -> None:
    """Build the four wheels and sdists into ``dist/``, then install each package ALONE from them.

    ``uv build --no-sources`` builds each sdist and the wheel from that sdist, as a release would
    (no workspace sources). Then, per package, a fresh virtual environment under
    ``.nox/build-envs/`` gets that package's wheel (with the ``cpu`` extra where FBGEMM is
    needed), its embshard dependencies from the same ``dist/`` (``--find-links``), everything else
    from PyPI: no editable install, no workspace. The session checks that exactly the expected
    embshard distributions, at the built versions, are installed, that embshard-types and
    embshard-optim have no ``fbgemm_gpu``, and imports the package. Not a default session.
    """
    started = time.monotonic()
    DIST.mkdir(exist_ok=True)
    for old in DIST.glob("embshard_*"):
        old.unlink()
    for package in PACKAGES:
        session.run(
            "uv", "build", "--no-sources", "--package", package, "--out-dir", str(DIST),
            external=True,
        )  # fmt: skip
    wheels = {}
    for package in PACKAGES:
        found = sorted(DIST.glob(f"{package.replace('-', '_')}-*.whl"))
        sdists = sorted(DIST.glob(f"{package.replace('-', '_')}-*.tar.gz"))
        if len(found) != 1 or len(sdists) != 1:
            session.error(
                f"expected one wheel and one sdist of {package} in {DIST}/: {found + sdists}"
            )
        wheels[package] = found[0].resolve()
    session.log(
        f"built in {time.monotonic() - started:.0f} s: "
        + ", ".join(w.name for w in wheels.values())
    )

    for index, package in enumerate(PACKAGES):
        env = BUILD_ENVS / package
        shutil.rmtree(env, ignore_errors=True)
        session.run("uv", "venv", "--quiet", "--python", sys.executable, str(env), external=True)
        # absolute, not resolved: the venv's python is a link to the base interpreter
        python = str((env / "bin" / "python").absolute())
        requirement = str(wheels[package])
        if package in CPU_EXTRA:
            requirement = f"{package}[{CPU_EXTRA[package]}] @ {wheels[package].as_uri()}"
        session.run(
            "uv", "pip", "install", "--python", python, "--find-links", str(DIST.resolve()),
            "--only-binary", ",".join(PACKAGES),
            # the wheels just built, never a cached one of the same name and version
            *[f"--refresh-package={p}" for p in PACKAGES],
            requirement,
            env={"UV_NO_CONFIG": "1"},
            external=True,
        )  # fmt: skip
        expected = {p: wheels[p].name.split("-")[1] for p in PACKAGES[: index + 1]}
        script = env / "check_install.py"
        script.write_text(
            _INSTALL_CHECK.format(
                module=package.replace("-", "_"),
                expected=expected,
                fbgemm_free=package in FBGEMM_FREE,
                env=str(env.absolute()),
            )
        )
        session.run(python, str(script), external=True)
    session.log(
        f"build: 4 wheels and sdists built, each installed alone and imported in {time.monotonic() - started:.0f} s"
    )
