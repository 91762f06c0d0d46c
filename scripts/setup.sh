#!/usr/bin/env bash
# Makes .venv ready to run lucedesk: creates it if missing, installs torch only where none
# is importable (a CUDA or ROCm torch already on the system is used as it is), then installs
# lucedesk itself (with the dev extra when called with --dev). Re-running is cheap: nothing
# is reinstalled unless pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
venv=.venv
dev=0
[ "${1:-}" = "--dev" ] && dev=1

if [ ! -x "$venv/bin/python" ]; then
    echo "setup: creating $venv"
    # System site-packages stay visible so an existing GPU build of torch is reused.
    "$python" -m venv --system-site-packages "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
fi
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)

if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
    # A bare "torch" requirement would pull a multi-GB CUDA build; take the pinned release,
    # which this project's machines carry as a CPU build. LUCEDESK_TORCH overrides the spec.
    spec=${LUCEDESK_TORCH:-torch==2.13.0}
    echo "setup: no torch found, installing $spec"
    "${pip[@]}" "$spec"
fi

stamp="$venv/.lucedesk-installed"
want="$(sha256sum pyproject.toml | cut -c1-16)-dev$dev"
have="$(cat "$stamp" 2>/dev/null || true)"
# A dev stamp also covers a plain run.
if [ "$have" != "$want" ] && [ "$have" != "${want%-dev0}-dev1" ]; then
    echo "setup: installing lucedesk into $venv"
    if [ $dev = 1 ]; then
        "${pip[@]}" -e ".[dev]"
    else
        "${pip[@]}" -e .
    fi
    echo "$want" > "$stamp"
fi
