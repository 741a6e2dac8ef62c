#!/usr/bin/env bash
# Set up embshard's workspace environment on a fresh machine and run the main job.
#
#   bash scripts/bootstrap.sh            # install uv if missing, sync .venv from uv.lock, run the main job
#   bash scripts/bootstrap.sh --setup    # only install uv and sync .venv
#
# Needs only Python 3.11+ and access to PyPI. uv comes from PyPI when it is not on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v uv >/dev/null 2>&1; then
    echo "bootstrap: uv not found; installing it from PyPI with pip" >&2
    python3 -m pip install --quiet --disable-pip-version-check uv
    if ! command -v uv >/dev/null 2>&1; then
        bindir="$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')"
        userbin="$(python3 -c 'import site, os; print(os.path.join(site.USER_BASE, "bin"))')"
        export PATH="$bindir:$userbin:$PATH"
        hash -r
        echo "bootstrap: uv is in $bindir (or $userbin); add it to PATH for later commands" >&2
    fi
fi
uv --version

# The workspace environment: every package, FBGEMM's CPU build, the test / lint tools and nox.
uv sync --frozen

if [[ "${1:-}" == "--setup" ]]; then
    exit 0
fi
uv run --frozen embshard train
